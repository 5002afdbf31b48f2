"""Token store formats (#30): the project's flat token parts + manifest vs ArrayRecord of packed rows read with Grain.

Runs in its OWN virtual environment, not the project's (Grain and ArrayRecord are not in the project's lock, and
installing them there could move shared dependencies). Stdlib + numpy + grain + array_record only; diloco is not
imported: the flat store's parts are read with numpy.memmap the way diloco/data/store.py's Store does.

    python3 -m venv .venv-grain && .venv-grain/bin/pip install grain array_record numpy
    diloco data tokenize --data stdlib --vocab byte --out /tmp/st_stdlib        # (project env) any store works
    .venv-grain/bin/python benchmarks/bench_store_formats.py --store /tmp/st_stdlib [--steps 1000] [--seq_lens 2048,512]

For each seq_len it writes the store's train rows (row r = tokens[r*L:(r+1)*L] of the parts concatenated, the
tail < L dropped, exactly the flat store's rows) to ArrayRecord, one record per row (the row's uint16/uint32
bytes), in as many files as the store has parts (contiguous row ranges), with ArrayRecordWriter options
`group_size:1` (what Grain requires for random access; zstd:3 is ArrayRecord's default codec) and
`group_size:1,uncompressed`, and `group_size:1` in one file (so a batched read is one reader's C++ read, no
threads: ArrayRecordDataSource.__getitems__ starts a new thread pool, one thread per file touched, per call); it
reports write seconds and bytes on disk against the flat parts. Then, per
"step", it reads B random rows by global index (the project's order rule: a keyed Feistel permutation of the
rows, copied from diloco/data/reader.py, so every reader gets the same indices) and decodes them into int32
(B, L), interleaving the readers step by step so they share the machine's load:

  flat            Store.rows: per row a part lookup (searchsorted) and a memmap slice copied into the batch
  ar.getitem      grain.sources.ArrayRecordDataSource[i] per row, np.frombuffer, copy
  ar.getitems     ArrayRecordDataSource.__getitems__(rows) (one batched call; Grain's per-file read threads)
  grain.mapds     grain.MapDataset.source(ds).shuffle(seed).map(decode).batch(B)[t]: Grain's own pipeline,
                  its own index_shuffle order (same work per step, other rows)

It reports rows/s and p50/p99 seconds per step, as ratios to flat; and the cost of the permutations themselves
(Grain's index_shuffle, one C++ call per index, vs the project's vectorised numpy Feistel). Everything is local
disk in the page cache (the files are written just before they are read): this measures the formats' CPU cost
per row, not storage latency.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import numpy as np

# ---- the project's order rule (a copy of diloco/data/reader.py's permute / global_rows; not imported) ----------
ROUNDS = 4
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _round_keys(seed: int, epoch: int):
    d = hashlib.sha256(f"diloco-feistel:{int(seed)}:{int(epoch)}".encode()).digest()
    return [np.uint64(int.from_bytes(d[8 * r:8 * r + 8], "little")) for r in range(ROUNDS)]


def _mix(x, key):
    z = x ^ key
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def permute(i, n: int, seed: int, epoch: int) -> np.ndarray:
    i = np.asarray(i, np.uint64)
    half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
    mask, h = np.uint64((1 << half) - 1), np.uint64(half)
    keys = _round_keys(seed, epoch)

    def enc(x):
        left, right = x >> h, x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right, k) & mask)
        return (left << h) | right

    with np.errstate(over="ignore"):
        y = enc(i)
        bad = y >= np.uint64(n)
        while bad.any():
            y[bad] = enc(y[bad])
            bad = y >= np.uint64(n)
    return y.astype(np.int64)


def global_rows(positions, n_rows: int, batch: int, seed: int) -> np.ndarray:
    per_epoch = n_rows // batch * batch
    p = np.asarray(positions, np.int64).reshape(-1)
    epochs, idx = p // per_epoch, p % per_epoch
    out = np.empty(p.shape, np.int64)
    for e in np.unique(epochs):
        sel = epochs == e
        out[sel] = permute(idx[sel], n_rows, seed, int(e))
    return out


# ---- the flat store, read as diloco/data/store.py's Store reads a local one --------------------------------------
class Flat:
    def __init__(self, store: str, split: str = "train"):
        man = json.load(open(os.path.join(store, "manifest.json")))
        s = man["splits"][split]
        self.fingerprint, self.dtype = man["fingerprint"], np.dtype(s["dtype"])
        self.files = [os.path.join(store, split, p["file"]) for p in s["parts"]]
        self.starts = np.concatenate([[0], np.cumsum([p["tokens"] for p in s["parts"]])]).astype(np.int64)
        self.tokens = int(self.starts[-1])
        self._maps = {}

    def _span(self, part, a, b):
        m = self._maps.get(part)
        if m is None:
            m = self._maps[part] = np.memmap(self.files[part], self.dtype, mode="r")
        return m[a:b]

    def row(self, r: int, L: int) -> np.ndarray:
        a, b = r * L, (r + 1) * L
        p = int(np.searchsorted(self.starts, a, side="right") - 1)
        out, pos = [], a
        while pos < b:  # a row may continue into the next part(s)
            end = min(b, int(self.starts[p + 1]))
            out.append(self._span(p, pos - int(self.starts[p]), end - int(self.starts[p])))
            pos, p = end, p + 1
        return out[0] if len(out) == 1 else np.concatenate(out)

    def rows(self, ids, L: int) -> np.ndarray:
        out = np.empty((len(ids), L), np.int32)
        for k, r in enumerate(ids):
            out[k] = self.row(int(r), L)
        return out


def disk_bytes(paths) -> tuple[int, int]:
    """(apparent bytes, allocated bytes) of the files."""
    st = [os.stat(p) for p in paths]
    return sum(s.st_size for s in st), sum(s.st_blocks * 512 for s in st)


def write_arrayrecord(flat: Flat, L: int, out_dir: str, options: str, n_files: int) -> tuple[list[str], float, int]:
    """The store's rows at seq_len L as ArrayRecord, one record per row, n_files files of contiguous rows."""
    from array_record.python.array_record_module import ArrayRecordWriter

    n_rows = flat.tokens // L
    os.makedirs(out_dir, exist_ok=True)
    bounds = np.linspace(0, n_rows, n_files + 1).astype(np.int64)
    paths = []
    t0 = time.perf_counter()
    for f in range(n_files):
        p = os.path.join(out_dir, f"rows-L{L}-{f:05d}-of-{n_files:05d}.array_record")
        w = ArrayRecordWriter(p, options)
        for r in range(int(bounds[f]), int(bounds[f + 1])):
            w.write(flat.row(r, L).tobytes())
        w.close()
        paths.append(p)
    return paths, time.perf_counter() - t0, n_rows


def write_flat_copy(flat: Flat, out_dir: str) -> float:
    """Seconds to write the flat parts' bytes again (what tokenize writes once per store, for every seq_len)."""
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.perf_counter()
    for i, f in enumerate(flat.files):
        data = np.fromfile(f, flat.dtype).tobytes()  # tokenize holds the part's tokens in memory, then writes them
        with open(os.path.join(out_dir, f"p{i}.bin"), "wb") as g:  # no fsync: ArrayRecordWriter does none either
            g.write(data)
    return time.perf_counter() - t0


def stats(times: list[float], rows_per_step: int) -> dict:
    t = np.asarray(times)
    return {"rows_per_s": rows_per_step * len(t) / t.sum(), "p50_ms": 1e3 * float(np.percentile(t, 50)),
            "p99_ms": 1e3 * float(np.percentile(t, 99))}


def bench_reads(flat: Flat, L: int, ar_paths: dict, B: int, steps: int, seed: int, warm: int = 20) -> dict:
    import grain

    n_rows = flat.tokens // L
    dtype = flat.dtype
    readers = {"flat": lambda ids, t: flat.rows(ids, L)}
    srcs = {}
    for opt, paths in ar_paths.items():
        src = srcs[opt] = grain.sources.ArrayRecordDataSource(paths)
        assert len(src) == n_rows

        def getitem(ids, t, src=src):
            out = np.empty((len(ids), L), np.int32)
            for k, r in enumerate(ids):
                out[k] = np.frombuffer(src[int(r)], dtype)
            return out

        def getitems(ids, t, src=src):
            recs = src.__getitems__([int(r) for r in ids])
            out = np.empty((len(ids), L), np.int32)
            for k, b in enumerate(recs):
                out[k] = np.frombuffer(b, dtype)
            return out

        mapds = (grain.MapDataset.source(src).shuffle(seed=seed)
                 .map(lambda b: np.frombuffer(b, dtype).astype(np.int32)).batch(B, drop_remainder=True))

        readers[f"ar.getitem [{opt}]"] = getitem
        readers[f"ar.getitems [{opt}]"] = getitems
        readers[f"grain.mapds [{opt}]"] = lambda ids, t, ds=mapds: ds[t % len(ds)]

    # the same rows from every format (grain.mapds reads rows of its own order; checked against flat below)
    ids0 = global_rows(np.arange(B), n_rows, B, seed)
    ref = flat.rows(ids0, L)
    for name, fn in readers.items():
        if not name.startswith("grain.mapds"):
            assert np.array_equal(fn(ids0, 0), ref), name
    for opt, src in srcs.items():
        pos = [grain.MapDataset.source(src).shuffle(seed=seed)._shuffled_index(g) for g in range(B)]
        got = readers[f"grain.mapds [{opt}]"](None, 0)
        assert np.array_equal(got, flat.rows(pos, L)), opt

    times = {k: [] for k in readers}
    for t in range(-warm, steps):  # interleaved: every step, every reader, in a rotating order
        s = t % steps
        ids = global_rows(s * B + np.arange(B), n_rows, B, seed)
        names = list(readers)
        k = t % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            out = readers[name](ids, s)
            dt = time.perf_counter() - t0
            assert out.shape == (B, L)
            if t >= 0:
                times[name].append(dt)
    for src in srcs.values():
        src.__exit__(None, None, None)
    return {k: stats(v, B) for k, v in times.items()}


def bench_permutations(n_rows: int, B: int, steps: int, seed: int) -> dict:
    from grain._src.python.experimental.index_shuffle.python import index_shuffle_module as ix

    out = {}
    t0 = time.perf_counter()
    for s in range(steps):
        global_rows(s * B + np.arange(B), n_rows, B, seed)
    out["feistel_us_per_step"] = 1e6 * (time.perf_counter() - t0) / steps
    t0 = time.perf_counter()
    for s in range(steps):
        [ix.index_shuffle(i % n_rows, max_index=n_rows - 1, seed=(seed + i // n_rows) % 2**32, rounds=4)  # as Grain's
         for i in range(s * B, (s + 1) * B)]                                                              # shuffle
    out["index_shuffle_us_per_step"] = 1e6 * (time.perf_counter() - t0) / steps
    n = 1 << 18
    t0 = time.perf_counter()
    permute(np.arange(n), n_rows_big := 76_000_000, seed, 0)  # ~C4 en's rows at 2048 (156 B tokens)
    out["feistel_ns_per_index_bulk"] = 1e9 * (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for i in range(n):
        ix.index_shuffle(i, max_index=n_rows_big - 1, seed=seed, rounds=4)
    out["index_shuffle_ns_per_index_bulk"] = 1e9 * (time.perf_counter() - t0) / n
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", default="/tmp/st_stdlib")
    ap.add_argument("--seq_lens", default="2048,512")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--options", default="group_size:1;group_size:1,uncompressed;group_size:1@1",
                    help="ArrayRecordWriter option strings, ';'-separated; OPTIONS@K writes K files (default: one "
                         "file per flat part)")
    ap.add_argument("--work", default=None, help="where the ArrayRecord files go (default: a temporary folder)")
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args(argv)

    import array_record
    import grain

    flat = Flat(a.store)
    work = a.work or tempfile.mkdtemp(prefix="bench_store_formats.")
    res = {"store": a.store, "fingerprint": flat.fingerprint, "tokens": flat.tokens, "dtype": flat.dtype.str,
           "parts": len(flat.files), "batch": a.batch, "steps": a.steps,
           "versions": {"python": platform.python_version(), "numpy": np.__version__,
                        "grain": getattr(grain, "__version__", None) or _dist_version("grain"),
                        "array_record": _dist_version("array_record")},
           "load_avg_at_start": os.getloadavg(), "seq_lens": {}}
    flat_app, flat_alloc = disk_bytes(flat.files)
    res["flat"] = {"bytes": flat_app, "allocated": flat_alloc, "write_s": write_flat_copy(flat, os.path.join(work, "flat"))}
    print(f"store {a.store} ({flat.fingerprint}): {flat.tokens:,} train tokens {flat.dtype.str} in {len(flat.files)} parts, "
          f"{flat_app:,} B; rewriting its parts: {res['flat']['write_s']:.3f} s; grain {res['versions']['grain']}, "
          f"array_record {res['versions']['array_record']}, B={a.batch}, {a.steps} steps, load {os.getloadavg()[0]:.1f}",
          flush=True)
    try:
        for L in [int(x) for x in a.seq_lens.split(",")]:
            r = res["seq_lens"][L] = {"rows": flat.tokens // L, "write": {}}
            paths = {}
            for spec in a.options.split(";"):
                opt, _, k = spec.partition("@")
                k = int(k or len(flat.files))
                opt_dir = os.path.join(work, f"{opt.replace(',', '_').replace(':', '')}_{k}")
                p, secs, n = write_arrayrecord(flat, L, opt_dir, opt, k)
                opt = f"{opt}, {k} file{'s' if k > 1 else ''}"
                app, alloc = disk_bytes(p)
                paths[opt] = p
                r["write"][opt] = {"write_s": secs, "bytes": app, "allocated": alloc, "files": len(p),
                                   "bytes_vs_flat": app / flat_app, "write_vs_flat": secs / res["flat"]["write_s"]}
                print(f"L={L}: ArrayRecord [{opt}]: {n:,} records in {len(p)} files, write {secs:.2f} s "
                      f"({secs / res['flat']['write_s']:.1f}x the flat parts'), {app:,} B ({app / flat_app:.3f}x flat)",
                      flush=True)
            r["read"] = bench_reads(flat, L, paths, a.batch, a.steps, a.seed)
            base = r["read"]["flat"]
            print(f"L={L}: {a.batch} random rows per step, {a.steps} steps, interleaved (load {os.getloadavg()[0]:.1f})")
            print(f"  {'reader':<44} {'rows/s':>10} {'vs flat':>8} {'p50 ms':>8} {'p99 ms':>8} {'p50 vs flat':>11}")
            for name, s in r["read"].items():
                print(f"  {name:<44} {s['rows_per_s']:>10,.0f} {s['rows_per_s'] / base['rows_per_s']:>7.2f}x "
                      f"{s['p50_ms']:>8.3f} {s['p99_ms']:>8.3f} {s['p50_ms'] / base['p50_ms']:>10.2f}x", flush=True)
            for opt in paths:
                shutil.rmtree(os.path.dirname(paths[opt][0]), ignore_errors=True)
        n2048 = flat.tokens // 2048
        res["permutation"] = bench_permutations(n2048, a.batch, a.steps, a.seed)
        pm = res["permutation"]
        print(f"permutation of {a.batch} indices per step: project Feistel (numpy) {pm['feistel_us_per_step']:.1f} us, "
              f"Grain index_shuffle (one call per index) {pm['index_shuffle_us_per_step']:.1f} us; "
              f"262,144 indices of 76 M (one numpy call vs a loop): {pm['feistel_ns_per_index_bulk']:.0f} vs "
              f"{pm['index_shuffle_ns_per_index_bulk']:.0f} ns/index")
    finally:
        if a.work is None:
            shutil.rmtree(work, ignore_errors=True)
    res["load_avg_at_end"] = os.getloadavg()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def _dist_version(name: str):
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
