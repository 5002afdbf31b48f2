"""Data supply vs demand: can one host's loader feed its chips at every paper scale?

    python benchmarks/bench_data.py --shared DIR [--mfu 0.5] [--chip_tflops 459] [--chips 4]
                                    [--host_cores 208] [--batches 200]

Supply, measured here for each corpus/vocabulary, in tokens per CPU-second (process CPU time, all
threads: "per core", steady on a shared machine):
  uncached  tokenizing one shard from the source (seqio/SentencePiece, or the byte fast path): what
            preparing a store costs (diloco data tokenize, or a run's first use of a corpus spec)
  cached    TokenBatches from the corpus's token store (prepared first, in a temporary $DILOCO_CACHE):
            the keyed row permutation and the memory-mapped reads (batch 64x2048, prefetch off so the
            work is all counted)
Demand at each paper scale: tokens/s = chips · MFU · peak / (6·N) (N from `diloco sizes`, vocab 32k;
6N training FLOPs per token, attention FLOPs ignored, which only lowers demand). The table gives the
cores a host needs to supply that with 2x headroom, from the cache and without it.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure(data: str, vocab: str, data_dir: str | None, batches: int) -> dict:
    from diloco.data import TokenBatches, specs, tasks

    spec = specs.parse_data(data, data_dir)
    n = specs.num_shards(spec, "train")
    tasks.get_vocabulary(vocab)  # imports (TF, seqio) and model loading are not tokenization
    c0 = time.process_time()
    toks, _ = tasks.tokenize_shard(spec, vocab, "train", 0, n)
    uncached = len(toks) / (time.process_time() - c0)
    with tempfile.TemporaryDirectory() as d:
        os.environ["DILOCO_CACHE"] = d
        it = TokenBatches(data, vocab, 2048, 64, data_dir=data_dir, prefetch=0)  # prepares the store (once)
        c0 = time.process_time()
        for _ in range(batches):
            next(it)
        cached = batches * 64 * 2048 / (time.process_time() - c0)
        epochs = it.step // max(1, it.n_rows // 64)
        it.close()
    return {"data": data.split(":")[0], "vocab": vocab.split(":")[0], "shards": n, "shard_tokens": len(toks),
            "uncached": uncached, "cached": cached, "epochs": epochs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", required=True, help="folder with data/ (the C4 sample, the T5 SentencePiece model)")
    ap.add_argument("--mfu", type=float, default=0.5)
    ap.add_argument("--chip_tflops", type=float, default=459.0, help="chip peak, bf16 (TPU v5p: 459)")
    ap.add_argument("--chips", type=int, default=4, help="chips per host (TPU v5p: 4)")
    ap.add_argument("--host_cores", type=int, default=208, help="CPU cores per host (TPU v5p VM: 208 vCPUs)")
    ap.add_argument("--batches", type=int, default=200, help="cached-path batches of 64x2048 tokens to time")
    a = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

    from diloco.model import param_count
    from diloco.model.scales import SCALES

    data = Path(a.shared) / "data"
    sp = f"sentencepiece:{data / 'vocab' / 'sentencepiece_cc_all.32000.100extra-sentencepiece.model'}"
    cases = [("stdlib", "byte", None)]
    if (data / "tfds").is_dir():
        cases += [("c4", "byte", str(data / "tfds")), ("c4", sp, str(data / "tfds"))]
    else:
        print(f"(no {data}/tfds: C4 rows skipped)")
    rows = [measure(d, v, dd, a.batches) for d, v, dd in cases]
    print("supply per core (tokens per CPU-second):")
    print(f"  {'data':<7} {'vocab':<14} {'uncached':>12} {'cached':>14}   (shard 0: {'tokens':>9})")
    for r in rows:
        print(f"  {r['data']:<7} {r['vocab']:<14} {r['uncached']:>12,.0f} {r['cached']:>14,.0f}   ({r['shard_tokens']:>17,})")
    sp_row = rows[-1]
    print(f"\ndemand of one host ({a.chips} chips x {a.chip_tflops:g} TFLOP/s x MFU {a.mfu:g}, 6N FLOPs/token) vs "
          f"supply of {sp_row['data']}+{sp_row['vocab']}; cores for 2x headroom (host has {a.host_cores}):")
    print(f"  {'scale':>6} {'params':>14} {'tokens/s/host':>14} {'cores (cached)':>15} {'cores (uncached)':>17} {'headroom, 1 core cached':>24}")
    for name in SCALES:
        if name in ("tiny", "toy", "toy-l"):
            continue
        n = param_count(name)
        need = a.chips * a.mfu * a.chip_tflops * 1e12 / (6 * n)
        c_cached, c_unc = 2 * need / sp_row["cached"], 2 * need / sp_row["uncached"]
        print(f"  {name:>6} {n:>14,} {need:>14,.0f} {c_cached:>15.2f} {c_unc:>17.1f} {sp_row['cached'] / need:>23.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
