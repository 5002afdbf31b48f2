"""python -m diloco.data {info,warm,peek,prepare}: inspect a corpus, make its token store in the cache ahead of a
run (warm: what a run would prepare on first use, with --workers processes), or tfds-build C4."""

from __future__ import annotations

import argparse
import json


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m diloco.data", description=__doc__)
    p.add_argument("cmd", choices=["info", "warm", "peek", "prepare"])
    p.add_argument("--data", default="stdlib")
    p.add_argument("--vocab", default="byte")
    p.add_argument("--data_dir", default=None)
    p.add_argument("--split", default="train")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--seq_len", type=int, default=128)
    a = p.parse_args(argv)
    from diloco.data import TokenBatches, corpus_info, get_vocabulary, specs, store_for, validate_data

    if a.cmd == "prepare":  # the only code path that downloads: TFDS's own c4/en builder (needs apache-beam, days of CPU)
        import tensorflow_datasets as tfds

        name = {"c4": "c4/en:3.1.0"}.get(a.data, a.data)
        tfds.builder(name, data_dir=a.data_dir or specs.default_tfds_dir()).download_and_prepare()
        return
    if a.cmd == "warm":  # a TFDS corpus of any size, asked for explicitly: tokenized here by --workers processes
        print(store_for(a.data, a.vocab, a.data_dir, workers=max(1, a.workers), explicit=True), flush=True)
        return
    validate_data(a.data, a.vocab, a.data_dir, a.seq_len, a.split)
    if a.cmd == "info":
        print(json.dumps(corpus_info(a.data, a.data_dir), indent=1))
    else:
        row = next(TokenBatches(a.data, a.vocab, a.seq_len, 1, data_dir=a.data_dir, split=a.split, prefetch=0))[0]
        print(row.tolist(), "\n---\n", get_vocabulary(a.vocab).decode([int(t) for t in row if t > 1]))


if __name__ == "__main__":
    main()
