"""Reading a token store by global index: the rows of global step t are a pure function of
(seed, epoch, position), whatever the process count, device layout or slice shape.

Order rule (store with N rows of seq_len, global batch B):
    an epoch is E = N // B whole steps; global position p = t·B + g (t: 0-based steps consumed, g: row
    of the flattened (replica, row) global batch); epoch e = p // (E·B), i = p % (E·B);
    row(p) = perm_{seed,e}(i), perm a keyed Feistel bijection of [0, N) (O(1) memory, cycle-walking).
So within an epoch no row repeats (a step never holds a row twice: replicas are disjoint), every row is
read once per epoch when B divides N, and the N − E·B rows a step cannot fill are different ones each
epoch. The iterator's state is the number of rows consumed (a multiple of B).
"""

from __future__ import annotations

import hashlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from diloco.errors import ConfigError

STATE_VERSION = 2
ROUNDS = 4
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _round_keys(seed: int, epoch: int) -> list[np.uint64]:
    digest = hashlib.sha256(f"diloco-feistel:{int(seed)}:{int(epoch)}".encode()).digest()
    return [np.uint64(int.from_bytes(digest[8 * r:8 * r + 8], "little")) for r in range(ROUNDS)]


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """splitmix64's finalizer of x ^ key (uint64, wrapping)."""
    z = x ^ key
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def permute(i, n: int, seed: int, epoch: int) -> np.ndarray:
    """perm_{seed,epoch}(i) for an array i of ints in [0, n): a bijection of [0, n), O(1) memory."""
    i = np.asarray(i, np.uint64)
    if n < 1 or (i.size and int(i.max()) >= n):
        raise ValueError(f"indices must lie in [0, {n})")
    half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)  # domain 4**half >= n, < 4n
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
        while bad.any():  # cycle-walk: re-encrypt until back inside [0, n)
            y[bad] = enc(y[bad])
            bad = y >= np.uint64(n)
    return y.astype(np.int64)


def global_rows(positions, n_rows: int, batch: int, seed: int) -> np.ndarray:
    """Store row of each global position (the order rule of this module's docstring)."""
    if n_rows < batch:
        raise ConfigError("data", f"the token store has {n_rows} rows at this seq_len, fewer than the global batch "
                          f"{batch}; use a smaller batch_size or seq_len, or a bigger store")
    per_epoch = n_rows // batch * batch
    p = np.asarray(positions, np.int64).reshape(-1)
    epochs, idx = p // per_epoch, p % per_epoch
    out = np.empty(p.shape, np.int64)
    for e in np.unique(epochs):
        sel = epochs == e
        out[sel] = permute(idx[sel], n_rows, seed, int(e))
    return out


def local_row_ids(sharding, shape: tuple[int, int, int], devices=None) -> list[int]:
    """Flattened rows (r·b + j of the (R, b, L) global batch) that this process's devices (or `devices`) hold."""
    R, b, _ = shape
    rows: set[int] = set()
    held = (sharding.addressable_devices_indices_map(shape) if devices is None else
            {d: i for d, i in sharding.devices_indices_map(shape).items() if d in set(devices)})
    for idx in held.values():
        for r in range(R)[idx[0]]:
            rows.update(r * b + j for j in range(b)[idx[1]])
    return sorted(rows)


class StoreBatches:
    """This process's rows of every global batch, read from a token store (diloco.data.store).

    rows: the flattened global rows this process holds (all of 0..B-1 on one process). next() returns
    int32 (len(rows), seq_len). Batches are read `prefetch` steps ahead on a background thread; they
    depend only on (store, seq_len, B, seed, step), so prefetching changes nothing but timing."""

    def __init__(self, store: str, seq_len: int, batch_size: int, seed: int = 0, rows=None, prefetch: int = 2,
                 split: str = "train"):
        from diloco.data.store import Store

        self.store = Store(store, split)
        self.seq_len, self.batch_size, self.seed = int(seq_len), int(batch_size), int(seed)
        self.n_rows = self.store.num_rows(self.seq_len)
        global_rows(np.zeros(0), self.n_rows, self.batch_size, self.seed)  # too small a store: refused now
        self.local = list(range(self.batch_size)) if rows is None else [int(r) for r in rows]
        self.prefetch = int(prefetch)
        self.step = 0  # global batches consumed
        self._pool: ThreadPoolExecutor | None = None
        self._futs: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._hashes: dict[int, str] = {}  # step → batch_hash(step, step + 1), filled by the prefetch thread

    # -- the pure part --------------------------------------------------------------------------------
    def step_rows(self, step: int, local: bool = True) -> np.ndarray:
        """Store rows of global step `step` (0-based): this process's, or the whole batch's."""
        g = np.asarray(self.local if local else range(self.batch_size), np.int64)
        return global_rows(step * self.batch_size + g, self.n_rows, self.batch_size, self.seed)

    def batch_hash(self, first: int, last: int) -> str:
        """sha256 (16 hex) of the store fingerprint, seq_len and the global rows of steps first..last-1."""
        if last == first + 1 and first in self._hashes:  # computed beside the read, off the batch thread
            return self._hashes[first]
        h = hashlib.sha256(f"{self.store.fingerprint}:{self.seq_len}:{self.batch_size}".encode())
        for s in range(first, last):
            h.update(self.step_rows(s, local=False).astype("<i8").tobytes())
        return h.hexdigest()[:16]

    def read(self, step: int) -> np.ndarray:
        """This process's rows of global step `step` (what the prefetch thread runs: the step's rows of the
        permutation, their hash and the reads; nothing is prepared per epoch or per file)."""
        everyone = self.step_rows(step, local=False)
        h = hashlib.sha256(f"{self.store.fingerprint}:{self.seq_len}:{self.batch_size}".encode())
        h.update(everyone.astype("<i8").tobytes())
        self._hashes[step] = h.hexdigest()[:16]
        return self.store.rows(everyone[np.asarray(self.local, np.int64)], self.seq_len)

    # -- iteration with prefetch ----------------------------------------------------------------------
    def rows(self) -> list[int]:
        return list(self.local)

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        s = self.step
        if not self.prefetch:
            out = self.read(s)
        else:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="store-batches")
                for k in range(s, s + self.prefetch + 1):
                    if k not in self._futs:
                        self._futs[k] = self._pool.submit(self.read, k)
                fut = self._futs.pop(s)
            out = fut.result()
        self.step = s + 1
        for k in [k for k in list(self._hashes) if k < s]:  # keep the hash of the step just handed out (its log row)
            del self._hashes[k]
        return out

    def close(self) -> None:
        with self._lock:
            for f in self._futs.values():
                f.cancel()
            self._futs.clear()
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None
        self.store.close()

    # -- state (the same number on every process) -----------------------------------------------------
    def describe(self) -> str:
        return f"token store {self.store.fingerprint}, {len(self.local)} of {self.batch_size} rows per step"

    def tokens_read(self) -> int:
        return self.step * len(self.local) * self.seq_len

    def local_positions(self) -> np.ndarray:
        return np.asarray([self.step], np.int64)

    def get_state(self) -> dict:
        return {"version": STATE_VERSION, "kind": "tokens", "store": self.store.fingerprint, "store_path": self.store.path,
                "seed": self.seed, "seq_len": self.seq_len, "batch_size": self.batch_size,
                "rows_consumed": self.step * self.batch_size}

    def state(self, positions=None) -> dict:
        if positions is not None and len(set(np.asarray(positions).reshape(-1).tolist())) > 1:
            raise ValueError(f"data state: processes disagree on the steps consumed: {np.asarray(positions).tolist()}")
        return self.get_state()

    def set_state(self, state: dict) -> None:
        """Continue at the saved row count; another store, seed, seq_len or batch size is refused."""
        refuse_foreign_state(state, self.store.path)
        if state.get("store") != self.store.fingerprint:
            raise ConfigError("data", f"the checkpoint was trained on token store {state.get('store')} "
                              f"({state.get('store_path')}), this run reads {self.store.fingerprint} ({self.store.path}); "
                              "point --config.data at the store the run started on")
        mine = self.get_state()
        bad = [f"{k}: saved {state.get(k)!r} vs now {mine[k]!r}" for k in ("seed", "seq_len", "batch_size")
               if state.get(k) != mine[k]]
        if bad:
            raise ConfigError("data", f"data state does not match this run ({', '.join(bad)}); resume with the same values")
        self.close()
        self.step = int(state["rows_consumed"]) // self.batch_size


def refuse_foreign_state(state: dict, data: str) -> None:
    """A data state this reader cannot continue: the per-host shard reader's (diloco before #30: {epoch,
    shard, pos, batches}, or {readers: […]}), refused in one line naming what to do."""
    if state.get("kind") != "tokens":
        raise ConfigError("data", "the checkpoint's data position was written by the per-host shard reader (before "
                          "#30); this version reads every corpus through a token store by global index, in another "
                          f"order, so the run cannot continue its data stream on {data!r}: start it again with "
                          "`diloco train --fresh` (the old checkpoints are set aside) or in a new --workdir, or "
                          "finish it with the diloco version it started on")


def store_eval_batches(store: str, seq_len: int, batch_size: int, num_batches: int) -> list[np.ndarray]:
    """The first num_batches·batch_size rows of the store's validation split in order (wrapping if short)."""
    from diloco.data.store import Store

    s = Store(store, "validation")
    n = s.num_rows(seq_len)
    if n < 1:
        raise ConfigError("data", f"the validation split of {store} has no row of seq_len={seq_len}")
    ids = np.arange(num_batches * batch_size) % n
    out = s.rows(ids, seq_len).reshape(num_batches, batch_size, seq_len)
    s.close()
    return list(out)
