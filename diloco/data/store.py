"""The token store: a corpus tokenized once (seqio Tasks of diloco.data.tasks), read by global row index.

Layout (local path or gs://…; seq_len-free):

    STORE/manifest.json                        written last, atomically: what the store holds
    STORE/<split>/part-00003-of-00016.bin      raw little-endian uint16 (vocab ≤ 65,535 ids) or uint32 tokens
    STORE/<split>/part-00003-of-00016.json     that part's counts and sha256, written after its .bin

A part is one shard of the source (a TFDS TFRecord file, a JSONL file, ~1 MiB of stdlib/text files), its
documents in source order, each followed by EOS (seqio's append_eos). Row r of a split at seq_len L is
tokens[r·L:(r+1)·L] of the concatenation of its parts in order; the last < L tokens are never read.
The manifest's fingerprint hashes the source identity, the vocabulary's sha256, the packing rule and every
part's token sha256 (no paths, times or worker counts), so an interrupted and resumed tokenize gives the
fingerprint of an uninterrupted one, and two stores with the same fingerprint hold the same tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed

import numpy as np

from diloco.data import specs
from diloco.errors import ConfigError

FORMAT = "diloco-token-store"
VERSION = 1
MANIFEST = "manifest.json"
PACKING = ("documents of a part in source order, each followed by EOS (seqio append_eos); parts of a split "
           "concatenated in order; row r at seq_len L = tokens[r*L:(r+1)*L]; the tail shorter than L is unused")
BYTE_VOCAB_ID = b"seqio.ByteVocabulary: UTF-8 bytes + 3; pad 0, EOS 1, UNK 2; 259 ids"


def _path(p):
    from diloco.rundir import require

    return require(os.path.expanduser(os.fspath(p)), "data")


def digest(obj) -> str:
    """sha256 hex of obj's canonical JSON."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def vocab_identity(vocab: str) -> dict:
    """{"kind", "sha256"}: the byte vocabulary's fixed id, or the SentencePiece model file's sha256."""
    kind, path = specs.parse_vocab(vocab)
    if kind == "byte":
        return {"kind": "byte", "sha256": hashlib.sha256(BYTE_VOCAB_ID).hexdigest()}
    from diloco.rundir import path as epath_of

    return {"kind": "sentencepiece", "sha256": hashlib.sha256(epath_of(path).read_bytes()).hexdigest()}


def source_identity(spec: specs.Spec, split: str) -> dict:
    """What was tokenized, without machine-specific paths: TFDS name/config/version/dataset_info digest, or
    the digest of the split's file list (paths relative to their common root, sizes)."""
    if spec.kind == "tfds":
        from diloco.rundir import path as epath_of

        text = (epath_of(spec.root) / "dataset_info.json").read_text()
        meta = json.loads(text)
        return {"kind": "tfds", "name": meta.get("name"), "config": meta.get("configName"), "version": meta.get("version"),
                "split": split, "dataset_info_sha256": hashlib.sha256(text.encode()).hexdigest(),
                "shard_lengths": specs.tfds_split_info(spec.root)[split]}
    files = list(spec.files) if spec.kind == "jsonl" else specs.file_split(spec, split)
    root = spec.root or os.path.commonpath([os.path.dirname(f) for f in spec.files])
    listing = [[os.path.relpath(f, root), os.path.getsize(f)] for f in files]
    out = {"kind": spec.kind, "split": split, "files": len(files), "bytes": sum(s for _, s in listing),
           "file_list_sha256": digest(listing)}
    if spec.kind == "jsonl":
        out["split_rule"] = f"validation = documents with farmhash(text) % 1000 < {specs.VAL_PER_MILLE}"
    elif spec.kind == "stdlib":  # the shipped snapshot's archive (data/snapshot.py), not this interpreter's
        from diloco.data import snapshot

        out["snapshot_sha256"] = snapshot.SHA256
    return out


def _part_name(i: int, n: int) -> str:
    return f"part-{i:05d}-of-{n:05d}"


class PartWriter:
    """Writes a part's tokens as they come (chunk by chunk, hashed on the way): a local part into a temporary
    file renamed into place; a gs://… part spooled to a local temporary file, then copied up, so the object
    appears whole. `most` is the largest number of tokens it was handed at once (a worker's token buffer)."""

    def __init__(self, p, dtype: np.dtype):
        import tempfile

        from diloco.rundir import is_remote

        self.p, self.dtype, self.remote = p, np.dtype(dtype), is_remote(p)
        self.tokens = self.most = 0
        self.sha = hashlib.sha256()
        self.tmp = f"{os.fspath(p)}.{os.getpid()}.tmp"
        self.f = tempfile.TemporaryFile() if self.remote else open(self.tmp, "wb")

    def write(self, tokens: np.ndarray) -> None:
        raw = np.asarray(tokens).astype(self.dtype).tobytes()
        self.sha.update(raw)
        self.f.write(raw)
        self.tokens, self.most = self.tokens + len(tokens), max(self.most, len(tokens))

    def commit(self) -> str:
        """Make the part visible whole; returns its sha256."""
        if self.remote:
            import shutil

            self.f.seek(0)
            with self.p.open("wb") as out:
                shutil.copyfileobj(self.f, out, 8 << 20)
            self.f.close()
        else:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
            os.replace(self.tmp, os.fspath(self.p))
        return self.sha.hexdigest()

    def abort(self) -> None:
        self.f.close()
        if not self.remote and os.path.exists(self.tmp):
            os.unlink(self.tmp)


def tokenize_part(job: dict) -> dict:
    """Tokenize source shard job["index"] of job["num"] into STORE/<split>/part-…{.bin,.json}, streaming
    (tasks.shard_chunks → PartWriter: one chunk in memory, never the shard); returns its json."""
    from diloco.data import tasks
    from diloco.rundir import atomic_write_json

    t0 = time.time()
    spec = specs.parse_data(job["data"], job["data_dir"])
    vocab_size = int(tasks.get_vocabulary(job["vocab"]).vocab_size) if job["vocab_size"] is None else job["vocab_size"]
    dtype = np.dtype("<u2") if vocab_size <= 65535 else np.dtype("<u4")
    d = _path(job["out"]) / job["split"]
    d.mkdir(parents=True, exist_ok=True)
    name = _part_name(job["index"], job["num"])
    w, docs = PartWriter(d / f"{name}.bin", dtype), 0
    try:
        for tokens, ends in tasks.shard_chunks(spec, job["vocab"], job["split"], job["index"], job["num"]):
            w.write(tokens)
            docs += len(ends)
        sha = w.commit()
    except BaseException:
        w.abort()
        raise
    meta = {"job": job["key"], "file": f"{name}.bin", "tokens": w.tokens, "docs": docs, "dtype": dtype.str,
            "vocab_size": vocab_size, "sha256": sha, "most_tokens_held": w.most, "seconds": round(time.time() - t0, 3)}
    atomic_write_json(d / f"{name}.json", meta)
    pause = float(os.environ.get("DILOCO_TOKENIZE_PAUSE_S", "0") or 0)  # tests: a window to interrupt in
    if pause:
        time.sleep(pause)
    return meta


def _done(out, split: str, i: int, n: int, key: str) -> dict | None:
    from diloco.rundir import read_json

    d = _path(out) / split
    try:
        meta = read_json(d / f"{_part_name(i, n)}.json")
    except (ValueError, OSError):
        return None
    if not meta or meta.get("job") != key or not (d / meta["file"]).exists():
        return None
    return meta


def _fmt_eta(s: float) -> str:
    s = int(max(s, 0))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    """One line per finished part: parts, documents, tokens, tokens/s (this run), ETA."""

    def __init__(self, split: str, n: int, done: list[dict], enabled: bool = True):
        self.split, self.n, self.enabled = split, n, enabled
        self.parts, self.docs, self.tokens = len(done), sum(m["docs"] for m in done), sum(m["tokens"] for m in done)
        self.t0, self.new_parts, self.new_tokens = time.time(), 0, 0

    def add(self, meta: dict) -> str:
        self.parts, self.new_parts = self.parts + 1, self.new_parts + 1
        self.docs, self.tokens, self.new_tokens = self.docs + meta["docs"], self.tokens + meta["tokens"], self.new_tokens + meta["tokens"]
        dt = max(time.time() - self.t0, 1e-9)
        eta = dt / self.new_parts * (self.n - self.parts)
        line = (f"tokenize {self.split}: {self.parts}/{self.n} parts, {self.docs:,} docs, {self.tokens:,} tokens, "
                f"{self.new_tokens / dt:,.0f} tokens/s, ETA {_fmt_eta(eta)}")
        if self.enabled:
            print(line, file=sys.stderr, flush=True)
        return line


# Memory one tokenize worker may use. Measured peak RSS of one worker (TensorFlow + seqio + one chunk) on a
# C4-sized TFDS shard (152 M byte-vocab tokens): 1.03 GiB streaming (0.99 GiB on a tiny shard; 2.47 GiB before).
WORKER_RAM = 3 << 29  # 1.5 GiB


def available_ram() -> int:
    """Bytes of memory free for new processes: MemAvailable of /proc/meminfo, else all physical memory."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def size_workers(asked: int | None, ram: int | None = None, cpus: int | None = None) -> tuple[int, str | None]:
    """Tokenize processes: `asked` (default: every core), at most one per WORKER_RAM of available memory;
    returns (workers, the note to print when `asked` was cut down, else None)."""
    ram, cpus = available_ram() if ram is None else ram, cpus or os.cpu_count() or 1
    fit = max(1, ram // WORKER_RAM)
    n = min(asked or cpus, fit)
    note = (f"--workers {asked} cut to {n}: {ram / 2**30:.1f} GiB available / {WORKER_RAM / 2**30:g} GiB per worker"
            if asked and asked > n else None)
    return n, note


def probe_writable(out: str) -> None:
    """Write and delete a small object at `out` now, so that a store that cannot be written (a VM's read-only
    default storage scope, a missing role, a file in the way) fails in one line before any tokenizing."""
    root = _path(out)
    probe = root / f".write-probe-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"diloco tokenize write probe\n")
        probe.unlink()
    except Exception as e:  # OSError locally; gcsfs/google-auth errors on gs://
        why = (str(e).strip().splitlines() or [""])[0][:160]
        raise ConfigError("out", f"cannot write the token store at {os.fspath(out)!r} ({type(e).__name__}: {why}); give "
                          "a folder you can write, or on a VM one created with --scopes=cloud-platform whose "
                          "service account has roles/storage.objectAdmin on the bucket") from None


def tokenize(data: str, vocab: str, out: str, data_dir: str | None = None, splits=specs.SPLITS,
             workers: int | None = None, progress: bool = True) -> dict:
    """Tokenize `data` with `vocab` into a store at `out` (local or gs://), resumably; returns the manifest."""
    from diloco.rundir import atomic_write_json

    spec = specs.parse_data(data, data_dir)
    for split in splits:
        specs.validate_data(data, vocab, data_dir, 2, split)
    root = _path(out)
    probe_writable(out)
    vid = vocab_identity(vocab)
    vocab_size = 259 if vid["kind"] == "byte" else None
    workers, note = size_workers(workers)
    if note and progress:
        print(f"tokenize: {note}", file=sys.stderr, flush=True)
    man = {"format": FORMAT, "version": VERSION, "vocab": vid, "packing": PACKING, "eos_id": 1, "pad_id": 0, "splits": {}}
    plan = {}
    for split in splits:
        src = source_identity(spec, split)
        n = specs.num_shards(spec, split)
        key = digest([FORMAT, VERSION, src, vid, split, n])[:16]
        plan[split] = src, n, key, {i: m for i in range(n) if (m := _done(out, split, i, n, key))}
    if any(len(metas) < n for _, n, _, metas in plan.values()) and (root / MANIFEST).exists():
        (root / MANIFEST).unlink()  # parts are about to change: the store reads as unfinished until the new manifest
    for split, (src, n, key, metas) in plan.items():
        bar = Progress(split, n, list(metas.values()), progress)
        jobs = [{"data": data, "vocab": vocab, "data_dir": data_dir, "split": split, "index": i, "num": n,
                 "out": os.fspath(out), "key": key, "vocab_size": vocab_size} for i in range(n) if i not in metas]
        if workers == 1 or len(jobs) <= 1:
            for job in jobs:
                metas[job["index"]] = m = tokenize_part(job)
                bar.add(m)
        else:
            import multiprocessing as mp

            with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=mp.get_context("spawn")) as pool:
                futs = {pool.submit(tokenize_part, j): j["index"] for j in jobs}
                for f in as_completed(futs):
                    metas[futs[f]] = m = f.result()
                    bar.add(m)
        parts = [metas[i] for i in range(n)]
        if len({m["dtype"] for m in parts}) > 1:
            raise RuntimeError(f"parts of {split} disagree on dtype: {sorted({m['dtype'] for m in parts})}")
        man["splits"][split] = {"source": src, "dtype": parts[0]["dtype"], "vocab_size": parts[0]["vocab_size"],
                                "tokens": sum(m["tokens"] for m in parts), "docs": sum(m["docs"] for m in parts),
                                "parts": [{k: m[k] for k in ("file", "tokens", "docs", "sha256")} for m in parts]}
    man["vocab"]["size"] = next(iter(man["splits"].values()))["vocab_size"]
    man["fingerprint"] = fingerprint(man)
    man["created"] = {"data": data, "vocab": vocab, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    atomic_write_json(root / MANIFEST, man)
    return man


def fingerprint(man: dict) -> str:
    """sha256 of the manifest's content fields (not 'created' or the fingerprint itself), 16 hex digits."""
    return digest({k: v for k, v in man.items() if k not in ("fingerprint", "created")})[:16]


def read_manifest(store: str) -> dict:
    """The manifest of a complete store; a ConfigError naming `data` and `diloco data tokenize` otherwise."""
    p = _path(store) / MANIFEST
    try:
        text = p.read_text()
    except (FileNotFoundError, OSError):
        raise ConfigError("data", f"no token store at {os.fspath(store)!r} (no {MANIFEST}: missing, or its tokenize "
                          "did not finish); make it with `diloco data tokenize --data <corpus> --vocab <vocab> "
                          f"--out {os.fspath(store)}` (rerun the same command to finish an interrupted one)") from None
    try:
        man = json.loads(text)
    except ValueError as e:
        raise ConfigError("data", f"{os.fspath(p)} is not valid JSON ({e.msg}, line {e.lineno}); delete the store "
                          "and make it again with `diloco data tokenize … --out " + os.fspath(store) + "`") from None
    if not isinstance(man, dict) or man.get("format") != FORMAT or man.get("version") != VERSION:
        raise ConfigError("data", f"{os.fspath(p)} is not a {FORMAT} v{VERSION} manifest")
    if fingerprint(man) != man.get("fingerprint"):
        raise ConfigError("data", f"{os.fspath(p)}: manifest content does not match its fingerprint {man.get('fingerprint')}")
    return man


def check_store(store: str, vocab: str, seq_len: int, splits=specs.SPLITS) -> dict:
    """Preflight: the manifest exists, was written with `vocab`, and every split has rows of seq_len.
    Returns the manifest; raises ConfigError('data' | 'vocab', one line with the fix)."""
    man = read_manifest(store)
    want = vocab_identity(vocab)
    if man["vocab"]["sha256"] != want["sha256"]:
        raise ConfigError("vocab", f"the token store {os.fspath(store)} was tokenized with a {man['vocab']['kind']} "
                          f"vocabulary (sha256 {man['vocab']['sha256'][:12]}…), not {vocab!r} ({want['sha256'][:12]}…); "
                          f"set --config.vocab to the store's, or `diloco data tokenize` with {vocab!r} into another store")
    for split in splits:
        if split not in man["splits"]:
            raise ConfigError("data", f"the token store {os.fspath(store)} has no {split!r} split (it has "
                              f"{sorted(man['splits'])}); `diloco data tokenize --splits train,validation`")
        if man["splits"][split]["tokens"] < seq_len:
            raise ConfigError("data", f"the {split!r} split of {os.fspath(store)} has {man['splits'][split]['tokens']} "
                              f"tokens, less than one row of seq_len={seq_len}")
    return man


class Store:
    """Rows of one split of a store: rows(ids, L) → int32 (len(ids), L). Local parts are memory-mapped;
    gs://… parts are read by byte range (one GET per row span), the rows of one call in parallel threads."""

    def __init__(self, store: str, split: str = "train", threads: int | None = None):
        from diloco.rundir import is_remote

        self.path, self.split = os.fspath(store), split
        self.manifest = read_manifest(store)
        if split not in self.manifest["splits"]:
            raise ConfigError("data", f"the token store {self.path} has no {split!r} split")
        s = self.manifest["splits"][split]
        self.fingerprint, self.dtype = self.manifest["fingerprint"], np.dtype(s["dtype"])
        self.files = [_path(store) / split / p["file"] for p in s["parts"]]
        self.starts = np.concatenate([[0], np.cumsum([p["tokens"] for p in s["parts"]])]).astype(np.int64)
        self.tokens = int(self.starts[-1])
        # gs://: reads are latency-bound, so many in flight (DILOCO_STORE_THREADS, default 64)
        self.remote, self.threads = is_remote(self.path), int(threads or os.environ.get("DILOCO_STORE_THREADS", 64))
        self._maps: dict[int, np.ndarray] = {}
        self._pool = self._fs = None
        if not self.remote:  # every local part checked now, before any row is read (1.7 GB/s of sha256 here)
            for i in range(len(self.files)):
                self._maps[i] = self._open(i)

    def num_rows(self, seq_len: int) -> int:
        return self.tokens // seq_len

    def _span(self, part: int, a: int, b: int) -> np.ndarray:
        """tokens [a, b) of one part (offsets within the part)."""
        if not self.remote:
            m = self._maps.get(part)
            if m is None:
                m = self._maps[part] = self._open(part)
            return m[a:b]
        if self._fs is None:  # one ranged GET per span (fsspec/gcsfs: what epath uses without TensorFlow)
            import fsspec

            self._fs = fsspec.filesystem(self.path.split("://", 1)[0])
        k = self.dtype.itemsize
        return np.frombuffer(self._fs.cat_file(os.fspath(self.files[part]), start=a * k, end=b * k), self.dtype)

    def _open(self, part: int) -> np.ndarray:
        """Memory-map a local part after checking its size and sha256 against the manifest (every part when
        the Store opens: a corrupt, truncated, zeroed or missing part is refused in one line naming it and the fix)."""
        f, want = os.fspath(self.files[part]), self.manifest["splits"][self.split]["parts"][part]
        fix = (f"delete it and rerun the `diloco data tokenize … --out {self.path}` that made the store (it remakes "
               "missing parts), or delete the store to have it made again")
        h, size = hashlib.sha256(), 0
        try:
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 23):
                    h.update(chunk)
                    size += len(chunk)
        except OSError as e:
            raise ConfigError("data", f"token store part {f}: {e.strerror}; {fix}") from None
        if size != want["tokens"] * self.dtype.itemsize or h.hexdigest() != want["sha256"]:
            raise ConfigError("data", f"token store part {f} does not match the manifest's size and sha256 (corrupt "
                              f"or truncated); {fix}")
        return np.memmap(f, self.dtype, mode="r")

    def row(self, r: int, seq_len: int) -> np.ndarray:
        a, b = r * seq_len, (r + 1) * seq_len
        if b > self.tokens or r < 0:
            raise IndexError(f"row {r} of seq_len {seq_len}: the {self.split} split has {self.num_rows(seq_len)} rows")
        p = int(np.searchsorted(self.starts, a, side="right") - 1)
        out, pos = [], a
        while pos < b:  # a row may continue into the next part(s)
            end = min(b, int(self.starts[p + 1]))
            out.append(self._span(p, pos - int(self.starts[p]), end - int(self.starts[p])))
            pos, p = end, p + 1
        return out[0] if len(out) == 1 else np.concatenate(out)

    def rows(self, ids, seq_len: int) -> np.ndarray:
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        out = np.empty((len(ids), seq_len), np.int32)
        parallel = self.remote and len(ids) > 1
        if parallel and self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="store-read")
        for k, row in enumerate((self._pool.map if parallel else map)(lambda r: self.row(r, seq_len), ids)):
            out[k] = row
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        self._maps.clear()


def info(store: str) -> dict:
    """The manifest, plus rows at a few seq_len values, for `diloco data info STORE`."""
    man = read_manifest(store)
    for s in man["splits"].values():
        s["rows_at_seq_len"] = {L: s["tokens"] // L for L in (128, 512, 1024, 2048)}
        s["parts"] = len(s["parts"])
    return man
