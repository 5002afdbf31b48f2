"""Token store: tokenize speed, reader speed (local and the storage emulator), step gaps, and the demand of a v5p host.

    python benchmarks/bench_store.py --shared DIR [--reads 2000] [--skip_tokenize] [--skip_gcs]

tokenize   tokens per CPU-second of seqio tokenization of the C4 sample (TFDS, 8 train shards) with the byte
           and the T5 SentencePiece vocabulary, in this process after its imports (what one core of a big
           CPU VM supplies); 1 vs 2 processes on shards 1..7 started together after their imports (wall
           tokens/s); then the wall time of `diloco data tokenize` with --workers 1 and 2 (imports of each
           spawned worker included).
reader     rows/s of StoreBatches (64 x 2048 rows, prefetch 0: all work counted) from a local store (memory
           map) and from a store on the GCS emulator (one ranged GET per row through gcsfs, 16 and 64 threads;
           the emulator is one single-threaded Python HTTP server, so this bounds the emulator, not GCS); the step gap
           (time between next() calls with prefetch 2 and a simulated 20 ms step) median and p99, over steps
           that cross part and epoch boundaries.
demand     a v5p host (4 chips) at 40% MFU: tokens/s = global_batch x seq_len / step_seconds from
           results/pod/memory.csv (`diloco compile`'s FLOPs per step at 40% MFU), at 35M and at 1B.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def tokenize_rate(data: str, vocab: str, data_dir: str | None) -> float:
    from diloco.data import specs, tasks

    spec = specs.parse_data(data, data_dir)
    n = specs.num_shards(spec, "train")
    tasks.get_vocabulary(vocab)
    tasks.tokenize_shard(spec, vocab, "train", 0, n)  # warm: imports, task registration, graph tracing
    c0, tokens = time.process_time(), 0
    for i in range(1, n):
        tokens += len(tasks.tokenize_shard(spec, vocab, "train", i, n)[0])
    return tokens / (time.process_time() - c0)


def _scaling_worker(args) -> tuple[int, float]:
    data, vocab, data_dir, shards, n, barrier = args
    from diloco.data import specs, tasks

    spec = specs.parse_data(data, data_dir)
    tasks.tokenize_shard(spec, vocab, "train", 0, n)  # warm: imports, task, tracing (not timed)
    barrier.wait()
    t0, tokens = time.time(), 0
    for i in shards:
        tokens += len(tasks.tokenize_shard(spec, vocab, "train", i, n)[0])
    return tokens, time.time() - t0


def tokenize_scaling(data: str, vocab: str, data_dir: str | None, workers: int) -> float:
    """tokens/s (wall) of `workers` processes tokenizing the train shards 1..n-1 between them, imports excluded."""
    import multiprocessing as mp

    from diloco.data import specs

    n = specs.num_shards(specs.parse_data(data, data_dir), "train")
    ctx = mp.get_context("spawn")
    with ctx.Manager() as m:
        barrier = m.Barrier(workers)
        with ctx.Pool(workers) as pool:
            out = pool.map(_scaling_worker, [(data, vocab, data_dir, list(range(1, n))[w::workers], n, barrier)
                                             for w in range(workers)])
    return sum(t for t, _ in out) / max(s for _, s in out)


def tokenize_wall(data: str, vocab: str, workers: int) -> tuple[float, dict]:
    with tempfile.TemporaryDirectory() as d:
        t0 = time.time()
        r = subprocess.run([sys.executable, "-m", "diloco.cli", "data", "tokenize", "--data", data, "--vocab", vocab,
                            "--out", f"{d}/s", "--workers", str(workers), "--splits", "train"],
                           capture_output=True, text=True, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-2000:]
        return time.time() - t0, json.loads(r.stdout)


def reader_rate(store: str, reads: int, L: int = 2048, B: int = 64) -> float:
    from diloco.data.reader import StoreBatches

    it = StoreBatches(store, L, B, 0, prefetch=0)
    next(it)
    t0, rows = time.perf_counter(), 0
    while rows < reads:
        rows += len(next(it))
    it.close()
    return rows / (time.perf_counter() - t0)


def step_gaps(store: str, steps: int, L: int = 2048, B: int = 64, step_s: float = 0.02) -> tuple[float, float, float, int]:
    from diloco.data.reader import StoreBatches

    it = StoreBatches(store, L, B, 0, prefetch=2)
    next(it)
    gaps, last = [], time.perf_counter()
    for _ in range(steps):
        time.sleep(step_s)  # the training step
        next(it)
        now = time.perf_counter()
        gaps.append(now - last - step_s)
        last = now
    it.close()
    g = np.asarray(gaps) * 1e3
    per_epoch = it.n_rows // B
    at_epoch = g[[t for t in range(len(g)) if (t + 1) % per_epoch == 0]]  # gap before the first step of an epoch
    return float(np.median(g)), float(np.percentile(g, 99)), float(at_epoch.max()), per_epoch


def demand() -> dict[str, float]:
    out = {}
    for r in csv.DictReader(open(ROOT / "results" / "pod" / "memory.csv")):
        if r["chip"] == "v5p" and r["method"] == "DP" and r["scale"] in ("35M", "1B") and r["chips"] == "4":
            out[r["scale"]] = int(r["global_batch"]) * int(r["seq_len"]) / float(r["step_seconds"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", required=True, help="folder with data/ (TFDS C4, the T5 SentencePiece model)")
    ap.add_argument("--reads", type=int, default=2000)
    ap.add_argument("--skip_tokenize", action="store_true")
    ap.add_argument("--skip_gcs", action="store_true")
    a = ap.parse_args()
    emu = None
    if not a.skip_gcs:  # first: every gs:// library must see the emulator's variables before it is imported
        sys.path.insert(0, str(ROOT / "tests"))
        from standin.gcs import Emulator

        emu_dir = tempfile.mkdtemp()
        emu = Emulator.start(Path(emu_dir) / "emu")
        os.environ.update(emu.env)
        emu.create_bucket("bench")
    tfds_dir = f"{a.shared}/data/tfds"
    spm = f"sentencepiece:{a.shared}/data/vocab/sentencepiece_cc_all.32000.100extra-sentencepiece.model"
    rows = []
    if not a.skip_tokenize:
        for vocab in ("byte", spm):
            rate = tokenize_rate("c4", vocab, tfds_dir)
            rows.append(f"tokenize c4 sample, {vocab.split(':')[0]}: {rate / 1e6:.3f} M tokens per CPU-second")
            print(rows[-1], flush=True)
        for vocab in ("byte", spm):
            rates = {w: tokenize_scaling("c4", vocab, tfds_dir, w) for w in (1, 2)}
            rows.append(f"tokenize c4 sample, {vocab.split(':')[0]}, imports excluded: 1 process {rates[1] / 1e6:.3f} M "
                        f"tokens/s, 2 processes {rates[2] / 1e6:.3f} M tokens/s ({rates[2] / rates[1]:.2f}x)")
            print(rows[-1], flush=True)
        for vocab in ("byte", spm):
            for w in (1, 2):
                os.environ["TFDS_DATA_DIR"] = tfds_dir
                secs, out = tokenize_wall("c4", vocab, w)
                rows.append(f"diloco data tokenize --data c4 --vocab {vocab.split(':')[0]} --workers {w}: "
                            f"{secs:.1f} s wall for {out['train']['tokens']:,} tokens (fingerprint {out['fingerprint']})")
                print(rows[-1], flush=True)
    from diloco.data import store

    with tempfile.TemporaryDirectory() as d:
        local = f"{d}/stdlib"
        store.tokenize("stdlib", "byte", local, workers=1, progress=False)
        r_local = reader_rate(local, a.reads * 10)
        med, p99, at_epoch, per_epoch = step_gaps(local, 3 * store.Store(local).num_rows(2048) // 64 + 5)
        rows.append(f"reader, local store: {r_local:,.0f} rows/s = {r_local * 2048 / 1e6:.1f} M tokens/s (L=2048, 1 thread)")
        rows.append(f"step gap beyond a 20 ms step (prefetch 2, {per_epoch} steps/epoch, 3 epochs, 12 parts): "
                    f"median {med:.2f} ms, p99 {p99:.2f} ms, largest at an epoch boundary {at_epoch:.2f} ms")
        print(*rows[-2:], sep="\n", flush=True)
        if emu is not None:
            try:
                url = "gs://bench/stdlib"
                t0 = time.time()
                store.tokenize("stdlib", "byte", url, workers=1, progress=False)
                up = time.time() - t0
                for threads in (16, 64):
                    os.environ["DILOCO_STORE_THREADS"] = str(threads)
                    r_gcs = reader_rate(url, a.reads)
                    rows.append(f"reader, store on the GCS emulator: {r_gcs:,.0f} rows/s = {r_gcs * 2048 / 1e6:.2f} M tokens/s "
                                f"({threads} threads of byte-range reads; tokenize+upload of 11.9 M tokens {up:.1f} s)")
                    print(rows[-1], flush=True)
            finally:
                emu.stop()
    for scale, tok_s in demand().items():
        rows.append(f"demand, v5p host (4 chips) at 40% MFU, {scale}: {tok_s / 1e6:.3f} M tokens/s = {tok_s / 2048:,.0f} rows/s of 2048")
        print(rows[-1], flush=True)


if __name__ == "__main__":
    main()
