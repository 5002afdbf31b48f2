"""python -m diloco.data {info,warm,peek,prepare}: inspect a corpus, fill the token cache ahead of a run, or tfds-build C4."""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor


def _warm_one(args: tuple) -> tuple[int, int, float]:
    data, vocab, data_dir, split, i = args
    from diloco.data import batches, specs

    t = time.time()
    tokens, _ = batches.ShardStore(specs.parse_data(data, data_dir), vocab, split).get(i)
    return i, len(tokens), time.time() - t


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m diloco.data", description=__doc__)
    p.add_argument("cmd", choices=["info", "warm", "peek", "prepare"])
    p.add_argument("--data", default="stdlib")
    p.add_argument("--vocab", default="byte")
    p.add_argument("--data_dir", default=None)
    p.add_argument("--split", default="train")
    p.add_argument("--shards", default=":", help="python slice of shard indices to warm, e.g. 0:100")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--seq_len", type=int, default=128)
    a = p.parse_args(argv)
    from diloco.data import TokenBatches, corpus_info, get_vocabulary, specs, validate_data

    if a.cmd == "prepare":  # the only code path that downloads: TFDS's own c4/en builder (needs apache-beam, days of CPU)
        import tensorflow_datasets as tfds

        name = {"c4": "c4/en:3.1.0"}.get(a.data, a.data)
        tfds.builder(name, data_dir=a.data_dir or specs.default_tfds_dir()).download_and_prepare()
        return
    validate_data(a.data, a.vocab, a.data_dir, a.seq_len, a.split)
    if a.cmd == "info":
        print(json.dumps(corpus_info(a.data, a.data_dir), indent=1))
    elif a.cmd == "peek":
        row = next(TokenBatches(a.data, a.vocab, a.seq_len, 1, split=a.split, data_dir=a.data_dir))[0]
        print(row.tolist(), "\n---\n", get_vocabulary(a.vocab).decode([int(t) for t in row if t > 1]))
    else:
        n = specs.num_shards(specs.parse_data(a.data, a.data_dir), a.split)
        todo = list(range(n))[slice(*[int(x) if x else None for x in a.shards.split(":")])]
        jobs = [(a.data, a.vocab, a.data_dir, a.split, i) for i in todo]
        with ProcessPoolExecutor(a.workers) as pool:
            for i, ntok, secs in pool.map(_warm_one, jobs):
                print(f"shard {i}/{n}: {ntok} tokens in {secs:.1f}s", flush=True)


if __name__ == "__main__":
    main()
