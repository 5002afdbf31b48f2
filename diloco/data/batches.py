"""Seeded, resumable int32 token batches over per-shard token caches."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import tempfile
import threading
import weakref
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from diloco.data import specs
from diloco.data.specs import cache_dir  # noqa: F401  (diloco.cli and tests use batches.cache_dir)
from diloco.errors import ConfigError

CACHE_VERSION = 1
STATE_VERSION = 1


def _split_fingerprint(spec: specs.Spec, vocab: str, split: str, n: int) -> str:
    """Changes whenever the source files, the vocabulary or the sharding change."""
    from diloco.data import tasks

    if spec.kind == "tfds":
        from diloco.rundir import path as epath_of

        stats = [(epath_of(spec.root) / "dataset_info.json").read_text()]
    else:
        files = spec.files if spec.kind == "jsonl" else specs.file_split(spec, split)
        stats = [(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
    blob = json.dumps([CACHE_VERSION, spec.kind, spec.root, stats, tasks.vocab_fingerprint(vocab), split, n])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class ShardStore:
    """(tokens, offsets) per shard of one (data, vocab, split): memory → disk cache → seqio tokenization."""

    def __init__(self, spec: specs.Spec, vocab: str, split: str):
        self.spec, self.vocab, self.split = spec, vocab, split
        self.n = specs.num_shards(spec, split)
        self._fp = _split_fingerprint(spec, vocab, split, self.n)
        self._lock = threading.Lock()
        self._futures: dict[int, Future] = {}

    def _path(self, i: int) -> Path | None:
        d = cache_dir()
        return d and d / "tokens" / f"{self.spec.kind}-{self.split}-{self._fp}" / f"{i:05d}-of-{self.n:05d}.npz"

    def _load(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        path = self._path(i)
        if path is not None and path.is_file():
            with np.load(path) as z:
                return z["tokens"], z["offsets"]
        from diloco.data import tasks

        tokens, offsets = tasks.tokenize_shard(self.spec, self.vocab, self.split, i, self.n)
        if path is not None:  # atomic: write a temp file in the same directory, then rename
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
                np.savez(f, tokens=tokens, offsets=offsets)
            os.replace(f.name, path)
        return tokens, offsets

    def _future(self, i: int) -> Future:
        with self._lock:
            fut = self._futures.get(i)
            if fut is None:
                fut = self._futures[i] = Future()
                threading.Thread(target=self._run, args=(i, fut), daemon=True).start()
            return fut

    def _run(self, i: int, fut: Future) -> None:
        try:
            fut.set_result(self._load(i))
        except BaseException as e:  # surfaced in the caller's thread by fut.result()
            fut.set_exception(e)

    def get(self, i: int, prefetch: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Shard i (blocking); optionally start preparing shard `prefetch` in the background."""
        out = self._future(i).result()
        with self._lock:  # keep at most the shard in use and the prefetched one in memory
            for k in [k for k in self._futures if k not in (i, prefetch)]:
                del self._futures[k]
        if prefetch is not None and prefetch != i:
            self._future(prefetch)
        return out


PERMUTE_DOCS = 4096  # documents gathered per pass: scratch is bounded by their tokens, not the shard's


def permute_documents(tokens: np.ndarray, offsets: np.ndarray, perm: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Documents reordered by perm: (token stream, document start offsets incl. the end). Gathered
    PERMUTE_DOCS documents at a time, so the transient beyond the output is ~16 bytes per token of one
    pass (int64 indices), not of the whole shard."""
    if perm is None:
        return tokens, offsets
    lens = np.diff(offsets)[perm]
    new_off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    out = np.empty(int(new_off[-1]), tokens.dtype)
    for a in range(0, len(perm), PERMUTE_DOCS):
        b = min(a + PERMUTE_DOCS, len(perm))
        base, end = int(new_off[a]), int(new_off[b])
        idx = np.arange(base, end, dtype=np.int64) + np.repeat(offsets[:-1][perm[a:b]] - new_off[a:b], lens[a:b])
        out[base:end] = tokens[idx]
    return out, new_off


class TokenBatches:
    """Infinite iterator of int32 (batch_size, seq_len) token batches; 0 is padding.

    Order: each epoch visits the split's shards in a seeded permutation and each shard's documents in a
    seeded permutation (shuffle=False: source order). pack=True concatenates EOS-terminated documents
    and cuts seq_len rows; pack=False cuts every document into seq_len rows, padding the last one.
    State is a position (epoch, shard, offset) in that stream, so resuming loads one shard.

    reader=(k, K) reads only the split's shards k, k+K, k+2K, … (seqio's ShardInfo(k, K) at shard
    granularity): K readers, each on one process, together cover the split once per epoch, and no
    shard is tokenized by two of them. (0, 1), the default, is the whole split.

    prefetch=k > 0 assembles up to k batches ahead on a background thread (the shard store already
    tokenizes or loads the next shard ahead on its own thread), so the training step does not wait on
    data. The batches and their order are the same for every k; get_state() describes the position
    after the last batch handed out by next(), never the prefetcher's.
    """

    def __init__(self, data: str, vocab: str, seq_len: int, batch_size: int, split: str = "train", seed: int = 0,
                 data_dir: str | None = None, pack: bool = True, *, shuffle: bool = True, prefetch: int = 2,
                 reader: tuple[int, int] = (0, 1)):
        specs.validate_data(data, vocab, data_dir, seq_len, split)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError("batch_size", f"batch_size={batch_size!r} must be an int >= 1")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ConfigError("prefetch", f"prefetch={prefetch!r} must be an int >= 0 (0: no background thread)")
        self.data, self.vocab, self.split, self.data_dir = data, vocab or "byte", split, data_dir
        self.seq_len, self.batch_size, self.seed, self.pack, self.shuffle = seq_len, batch_size, int(seed), pack, shuffle
        self.store = ShardStore(specs.parse_data(data, data_dir), self.vocab, split)
        from diloco.data.store import source_identity

        src = source_identity(self.store.spec, split)  # what the stream is made of, not where it lies
        self.content = hashlib.sha256(json.dumps(src, sort_keys=True).encode()).hexdigest()[:16]
        self.reader = (int(reader[0]), int(reader[1]))
        self.shard_ids = list(range(self.store.n))[self.reader[0]::self.reader[1]]
        if not self.shard_ids:
            raise ConfigError("data_readers", f"the {split!r} split of {data!r} has {self.store.n} shard(s), fewer "
                              f"than the {self.reader[1]} data readers (one per process by default); use fewer "
                              "processes or set --config.data_readers to at most the shard count")
        self.epoch, self.shard, self.pos, self.batches = 0, 0, 0, 0
        self._cur: tuple | None = None  # (epoch, shard, stream, row_starts, row_lens)
        # epoch/shard/pos/batches above are the producer's cursor; _consumed is the position after the
        # last batch next() returned (what get_state reports).
        self._consumed = self._cursor()
        self.prefetch = prefetch
        self._queue: queue.Queue | None = None
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def _cursor(self) -> tuple[int, int, int, int]:
        return self.epoch, self.shard, self.pos, self.batches

    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng([self.seed & (2**63 - 1), *key])

    def _shard_id(self, epoch: int, shard: int) -> int:
        m = len(self.shard_ids)
        return self.shard_ids[int(self._rng(epoch).permutation(m)[shard]) if self.shuffle else shard]

    def _next_pos(self, epoch: int, shard: int) -> tuple[int, int]:
        return (epoch, shard + 1) if shard + 1 < len(self.shard_ids) else (epoch + 1, 0)

    def _stream(self):
        if self._cur is None or self._cur[:2] != (self.epoch, self.shard):
            sid = self._shard_id(self.epoch, self.shard)
            tokens, offsets = self.store.get(sid, prefetch=self._shard_id(*self._next_pos(self.epoch, self.shard)))
            ndocs = len(offsets) - 1
            perm = self._rng(self.epoch, sid, 1).permutation(ndocs) if self.shuffle else None
            stream, offs = permute_documents(tokens, offsets, perm)
            starts = lens = None
            if not self.pack:  # rows: every document cut into seq_len pieces
                dl = np.diff(offs)
                nrows = -(-dl // self.seq_len)
                first = np.repeat(np.cumsum(nrows) - nrows, nrows)
                k = np.arange(nrows.sum()) - first
                starts = np.repeat(offs[:-1], nrows) + k * self.seq_len
                lens = np.minimum(self.seq_len, np.repeat(dl, nrows) - k * self.seq_len)
            self._cur = (self.epoch, self.shard, stream, starts, lens)
        return self._cur[2:]

    def _advance_shard(self, empty_run: int) -> int:
        self.epoch, self.shard = self._next_pos(self.epoch, self.shard)
        self.pos = 0
        if empty_run > len(self.shard_ids):
            raise ConfigError("data", f"the {self.split!r} split of {self.data!r} has no documents after filtering (e.g. the ~2% hash-chosen validation split of a tiny corpus)")
        return empty_run + 1

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        if not self.prefetch:
            batch = self._produce()
            self._consumed = self._cursor()
            return batch
        if self._thread is None:
            self._start()
        kind, item, cursor = self._queue.get()
        if kind == "error":
            self._thread = None  # the producer has ended; a later next() retries from the consumed position
            self._restore(self._consumed)
            raise item
        self._consumed = cursor
        return item

    def _start(self) -> None:
        self._queue, self._stop = queue.Queue(maxsize=self.prefetch), threading.Event()
        self._thread = threading.Thread(target=_produce_into, args=(weakref.ref(self), self._queue, self._stop),
                                        name=f"TokenBatches-{self.data}-{self.split}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the prefetch thread (it also stops when the iterator is garbage-collected)."""
        if self._thread is not None:
            self._stop.set()
            while True:  # unblock a producer waiting on a full queue
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
            self._thread.join()
            self._thread = None

    def __del__(self):
        if getattr(self, "_stop", None) is not None:
            self._stop.set()

    def _restore(self, cursor: tuple[int, int, int, int]) -> None:
        self.epoch, self.shard, self.pos, self.batches = cursor
        self._cur = None if self._cur is None or self._cur[:2] != cursor[:2] else self._cur

    def _produce(self) -> np.ndarray:
        L, B = self.seq_len, self.batch_size
        out = np.zeros((B, L), np.int32)
        empty_run = 0
        if self.pack:
            flat, filled = out.reshape(-1), 0
            while filled < B * L:
                stream = self._stream()[0]
                take = min(B * L - filled, len(stream) - self.pos)
                flat[filled:filled + take] = stream[self.pos:self.pos + take]
                filled, self.pos = filled + take, self.pos + take
                empty_run = 0 if take else empty_run
                if self.pos >= len(stream):
                    empty_run = self._advance_shard(empty_run)
        else:
            row = 0
            while row < B:
                stream, starts, lens = self._stream()
                take = min(B - row, len(starts) - self.pos)
                for r in range(take):
                    s, n = starts[self.pos + r], lens[self.pos + r]
                    out[row + r, :n] = stream[s:s + n]
                row, self.pos = row + take, self.pos + take
                empty_run = 0 if take else empty_run
                if self.pos >= len(starts):
                    empty_run = self._advance_shard(empty_run)
        self.batches += 1
        return out

    def get_state(self) -> dict:
        """JSON-serializable position of the next batch next() will return (not the prefetcher's)."""
        epoch, shard, pos, batches = self._consumed
        extra = {} if self.reader == (0, 1) else {"reader": list(self.reader)}
        return {**extra, "version": STATE_VERSION, "data": self.data, "vocab": self.vocab, "split": self.split, "seed": self.seed,
                "pack": self.pack, "shuffle": self.shuffle, "seq_len": self.seq_len, "num_shards": self.store.n,
                "content": self.content,
                "epoch": epoch, "shard": shard, "pos": pos, "batches": batches}

    def set_state(self, state: dict) -> None:
        """Continue exactly where get_state() was taken (batch_size may differ; with pack=True so may seq_len)."""
        mine = self.get_state()
        keys = ["version", "data", "vocab", "split", "seed", "pack", "shuffle", "num_shards"] + ([] if self.pack else ["seq_len"])
        keys += ["content"] if "content" in state else []  # states written before the content digest: not checked
        bad = {k: (state.get(k), mine[k]) for k in keys if state.get(k) != mine[k]}
        if list(state.get("reader", [0, 1])) != list(self.reader):
            bad["reader"] = (state.get("reader", [0, 1]), list(self.reader))
        if bad:
            hint = (" (the corpus's files or TFDS dataset_info.json changed: another version or copy of the data)"
                    if "content" in bad else "")
            raise ConfigError("data", f"data state does not match this iterator ({', '.join(f'{k}: saved {a!r} vs now {b!r}' for k, (a, b) in bad.items())}){hint}; resume with the same data config")
        self.close()
        self.epoch, self.shard, self.pos, self.batches = (int(state[k]) for k in ("epoch", "shard", "pos", "batches"))
        self._consumed = self._cursor()
        self._cur = None


def _produce_into(ref: "weakref.ref[TokenBatches]", q: queue.Queue, stop: threading.Event) -> None:
    """Prefetch thread: batches in order, each with the cursor after it. Holds the iterator only by a weak
    reference while it waits, so an abandoned iterator is collected and its thread ends."""
    while not stop.is_set():
        it = ref()
        if it is None:
            return
        try:
            item = ("batch", it._produce(), it._cursor())
        except BaseException as e:  # re-raised by next() in the consumer's thread
            item = ("error", e, None)
        del it
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                break
            except queue.Full:
                if ref() is None:
                    return
        if item[0] == "error":
            return


class HostBatches:
    """This process's rows of every global batch: the global batch (batch_size rows) is cut into
    `readers` equal blocks, block k read by TokenBatches(reader=(k, readers)); a process reads only
    `blocks`, the blocks its devices hold. With readers=1 the global batch is TokenBatches' own."""

    def __init__(self, data: str, vocab: str, seq_len: int, batch_size: int, readers: int, blocks: list[int], **kw):
        if not isinstance(readers, int) or readers < 1 or batch_size % readers:
            raise ConfigError("data_readers", f"data_readers={readers} must divide the global batch {batch_size} "
                              "(each reader supplies batch_size/data_readers rows)")
        self.readers, self.blocks, self.rows_per = readers, list(blocks), batch_size // readers
        self.seq_len = seq_len
        self.parts = [TokenBatches(data, vocab, seq_len, self.rows_per, reader=(k, readers), **kw) for k in self.blocks]

    def describe(self) -> str:
        shards = self.shards_read()
        return f"data blocks {self.blocks} of {self.readers}, shards {shards[:8]}{'…' if len(shards) > 8 else ''}"

    def rows(self) -> list[int]:
        """Global (flattened) row index of each local row next() returns."""
        return [k * self.rows_per + i for k in self.blocks for i in range(self.rows_per)]

    def __iter__(self):
        return self

    def __next__(self) -> "np.ndarray":
        return np.concatenate([next(p) for p in self.parts]) if self.parts else np.zeros((0, self.seq_len), np.int32)

    def tokens_read(self) -> int:
        return sum(p.get_state()["batches"] for p in self.parts) * self.rows_per * self.seq_len

    def shards_read(self) -> list[int]:
        return sorted(i for p in self.parts for i in p.shard_ids)

    def local_positions(self) -> np.ndarray:
        """(len(blocks), 5) int64 rows [reader, epoch, shard, pos, batches]: what every process gathers."""
        out = np.zeros((len(self.parts), 5), np.int64)
        for i, (k, p) in enumerate(zip(self.blocks, self.parts)):
            st = p.get_state()
            out[i] = [k, st["epoch"], st["shard"], st["pos"], st["batches"]]
        return out

    def state(self, positions: np.ndarray) -> dict:
        """The whole job's data state from every process's local_positions() (concatenated)."""
        if self.readers == 1 and len(self.parts) == 1:
            return self.parts[0].get_state()  # the single-reader format, as before
        tmpl = {k: v for k, v in self.parts[0].get_state().items() if k != "reader"} if self.parts else {}
        by_k = {int(r[0]): r for r in np.asarray(positions).reshape(-1, 5)}
        missing = sorted(set(range(self.readers)) - set(by_k))
        if missing:
            raise ValueError(f"data state: no process reported reader(s) {missing}")
        return {"readers": [{**tmpl, "reader": [k, self.readers], "epoch": int(by_k[k][1]), "shard": int(by_k[k][2]),
                             "pos": int(by_k[k][3]), "batches": int(by_k[k][4])} for k in range(self.readers)]}

    def set_state(self, state: dict) -> None:
        saved = state.get("readers") if "readers" in state else [state]
        if len(saved) != self.readers:
            raise ConfigError("data_readers", f"the checkpoint's data was read by {len(saved)} reader(s), this run "
                              f"has {self.readers}; resume with --config.data_readers={len(saved)}")
        for k, p in zip(self.blocks, self.parts):
            p.set_state(saved[k])

    def close(self) -> None:
        for p in self.parts:
            p.close()


def train_batches(cfg, sharding, shape: tuple[int, int, int], saved: dict | None = None):
    """This process's reader of a run's train split: the rows of the (R, b, L) global batch its devices
    hold. tokens:<store> → reader.StoreBatches (any process count); else HostBatches, whose reader count
    K is the checkpoint's when resuming (data_readers=0) and refused, naming the store, when this run's
    devices cannot hold K whole blocks. `saved`: the checkpoint's data state (checked here, before the
    model state is read)."""
    from diloco import distributed as dist

    if specs.store_path(cfg.data) is not None:
        from diloco.data.reader import StoreBatches, local_row_ids
        from diloco.data.store import resolve

        store = resolve(cfg.data, cfg.vocab, cfg.data_dir or None)

        it = StoreBatches(store, cfg.seq_len, cfg.batch_size, cfg.seed, local_row_ids(sharding, shape))
    else:
        if saved and saved.get("kind") == "tokens":
            raise ConfigError("data", f"the checkpoint's data was read from the token store {saved.get('store_path')} "
                              f"(fingerprint {saved.get('store')}), this run reads {cfg.data!r}; resume with "
                              f"--config.data=tokens:{saved.get('store_path')}")
        readers = int(cfg.get("data_readers", 0))
        if not readers:
            readers = (len(saved["readers"]) if "readers" in saved else 1) if saved else dist.num_processes()
        try:
            blocks = dist.reader_blocks(sharding, shape, readers) if readers > 1 else [0]  # 1: every process reads all
        except ConfigError as e:
            why = f"the checkpoint's data was read by {readers} reader(s); " if saved else ""
            raise ConfigError("data_readers", f"{why}{str(e).split(': ', 1)[1]}. The per-host shard reader cannot "
                              "change its reader count; a run that must resume on another host count reads a token "
                              "store (`diloco data tokenize`, --config.data=tokens:STORE)") from None
        it = HostBatches(cfg.data, cfg.vocab, cfg.seq_len, cfg.batch_size, readers, blocks, split="train",
                         seed=cfg.seed, data_dir=cfg.data_dir or None)
    if saved:
        it.set_state(saved)
    return it


def eval_batches(data: str, vocab: str, seq_len: int, batch_size: int, num_batches: int, data_dir: str | None = None) -> list[np.ndarray]:
    """The first num_batches packed batches of the validation split in source order (wrapping if short)."""
    if specs.store_path(data) is not None:
        from diloco.data.reader import store_eval_batches
        from diloco.data.store import resolve

        return store_eval_batches(resolve(data, vocab, data_dir), seq_len, batch_size, num_batches)
    it = TokenBatches(data, vocab, seq_len, batch_size, split="validation", data_dir=data_dir, shuffle=False, prefetch=0)
    return [next(it) for _ in range(num_batches)]
