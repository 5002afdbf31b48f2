"""Orbax checkpoints of the whole training state, with a JSON sidecar for the data position, the
counters, the code that wrote it and a checksum of every array. The directory may be local or
`gs://…` (an epath).

The state (trainer.TrainState) is every replica's parameters and AdamW state, the step, and the outer
state (outer/sync.OuterState): θᵍ, one outer-optimizer state per fragment, per fragment the averaged Δ
of its last send (which a fragment sent less than τ steps ago has not applied yet), and the send rule's
buffers (`extra`: error-feedback residuals, eager buffers). Every exchange in flight
is landed before a save, so no bytes on the wire are ever part of a checkpoint.

A checkpoint that cannot be restored is one of three things, and only the first is ever moved:
  corrupt     checksum mismatch, truncated / missing / unparsable files → skipped, ckpt_corrupt/
  mismatch    written for another state (a leaf added, removed, reshaped or retyped) → CheckpointMismatch
  unreadable  the storage failed (OSError, a transient status) → retried with backoff, then CheckpointUnreadable
An emptied or half-deleted step folder (no state/ or meta/) is corrupt. A save that runs out of space removes
its temporary folder and raises DiskFull (exit 4); the previous checkpoints stay. A killed save's temporary
folder is removed when the run resumes (one line on stderr).
"""
from __future__ import annotations

import errno
import functools
import json
import os
import sys
import time
import warnings
from typing import Any

from diloco.noise import native_stderr_captured, silence_stderr

# The training state's layout, in the sidecar of every checkpoint (none before version 2). 2: the outer
# optimizer's state of adam/adamw/muon is shaped like each fragment's parameter subtree, not a flat vector.
# 3: the qkv kernel is D×3×(H·K), was D×3D (the same bytes: restoring a version-2 checkpoint is refused).
# 4: nesterov's and sgd's outer momentum is shaped like each fragment's subtree too, was one flat vector.
# 5: the pending averaged Δ is each fragment's subtree (sharded like θᵍ), was one flat vector per fragment.
STATE_VERSION = 5


class CheckpointError(Exception):
    """A checkpoint exists that this run cannot use; nothing was moved. The message says what to do."""


class CheckpointMismatch(CheckpointError):
    """The checkpoint was written for another state structure (another version of the code)."""


class CheckpointUnreadable(CheckpointError):
    """The storage failed to read a checkpoint, again after the retries."""


class NoUsableCheckpoint(CheckpointError):
    """Every checkpoint is corrupt."""


class DiskFull(CheckpointError):
    """No space left while saving: the partial checkpoint was removed, the previous ones kept."""


class ChecksumMismatch(ValueError):
    pass


# Status names (absl / TensorStore / gRPC) of a failure of the storage rather than of the bytes stored.
STORAGE_STATUS = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED", "CANCELLED",
                  "UNAUTHENTICATED", "PERMISSION_DENIED", "INTERNAL", "UNKNOWN")
# ... and of bytes that are not what was written: truncated, garbled, missing
CORRUPT_STATUS = ("OUT_OF_RANGE", "DATA_LOSS", "FAILED_PRECONDITION", "NOT_FOUND", "INVALID_ARGUMENT")
# orbax's own words when the saved tree is not the requested one (leaves compared first: state_mismatch)
MISMATCH_WORDS = ("Structure mismatch", "tree structures do not match", "is not compatible with the stored shape")


def _chain(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _disk_full(e: BaseException) -> bool:
    return any(getattr(x, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(x)
               for x in _chain(e))


def classify(e: BaseException) -> str:
    """"mismatch", "corrupt" or "unreadable" (the storage failed, or a failure not known to be corruption:
    retried, then the run stops with nothing moved) for an exception raised while restoring."""
    chain = list(_chain(e))
    texts = [str(x) for x in chain]
    if any(w in t for w in MISMATCH_WORDS for t in texts):
        return "mismatch"
    if any(t.startswith(c + ":") for c in STORAGE_STATUS for t in texts):
        return "unreadable"
    for x in chain:
        if isinstance(x, (ChecksumMismatch, json.JSONDecodeError, FileNotFoundError, NotADirectoryError,
                          IsADirectoryError)):
            return "corrupt"
        if isinstance(x, OSError):
            return "unreadable"
    if any(t.startswith(c + ":") for c in CORRUPT_STATUS for t in texts):
        return "corrupt"
    return "unreadable"


def leaf_names(tree) -> dict[str, tuple[tuple[int, ...], str]]:
    """{dotted path, as orbax names a leaf (opt.1.0.mu.embed): (shape, dtype)} of a state or its metadata."""
    import jax

    def key(k):
        return str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k))))

    return {".".join(key(k) for k in path): (tuple(x.shape), str(x.dtype))
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0] if hasattr(x, "shape")}


def state_mismatch(saved: dict, wanted: dict, shown: int = 3) -> str | None:
    """What differs between a checkpoint's leaves and the state's (leaf_names of each), first leaves
    first, in one line; None when every leaf matches in name, shape and dtype."""
    def listed(names):
        return ", ".join(names[:shown]) + (f" (+{len(names) - shown} more)" if len(names) > shown else "")

    def typed(v):
        return f"{v[1]}[{','.join(map(str, v[0]))}]"

    parts = []
    if new := sorted(set(wanted) - set(saved)):
        parts.append(f"the state has {listed(new)} that the checkpoint lacks")
    if gone := sorted(set(saved) - set(wanted)):
        parts.append(f"the checkpoint has {listed(gone)} that the state lacks")
    if changed := [k for k in sorted(set(saved) & set(wanted)) if saved[k] != wanted[k]]:
        parts.append(listed([f"{k} is {typed(saved[k])} in the checkpoint, {typed(wanted[k])} in the state"
                             for k in changed]))
    return "; ".join(parts) or None


def state_checksum(state) -> list[int]:
    """Per-leaf uint32 sum of the raw bits weighted by odd position factors (wrapping), computed
    where the arrays live (sharded or not): any change of one word changes its leaf's value."""
    import jax

    leaves = jax.tree_util.tree_leaves(state)
    return [int(x) for x in _checksum_fn()(leaves)] if leaves else []


@functools.cache
def _checksum_fn():
    import jax
    import jax.numpy as jnp

    def words(x):
        x = x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x
        if x.dtype.itemsize >= 4:
            w = jax.lax.bitcast_convert_type(x, jnp.uint32)
        else:
            w = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16}[x.dtype.itemsize]).astype(jnp.uint32)
        w = w.reshape(-1)
        i = jnp.arange(w.size, dtype=jnp.uint32)
        return jnp.sum(w * (i * jnp.uint32(2654435761) + jnp.uint32(1)), dtype=jnp.uint32)

    return jax.jit(lambda leaves: jnp.stack([words(x) for x in leaves]))


def use_client_barriers() -> None:
    """Orbax's default barrier between processes is a small psum program over every device, and orbax
    also waits at barriers from its own threads: there such a program can meet the trainer's collective
    programs in a different order on different processes, and every process waits for ever (seen with
    4 processes × 2 devices, at random steps after a save). The JAX distributed client's barrier (a
    coordinator RPC with a timeout) uses no device, so it cannot interleave with them."""
    from absl import flags
    import orbax.checkpoint  # noqa: F401  (defines the flag)

    if not flags.FLAGS.is_parsed():  # outside an absl app nothing parsed flags: their defaults stand
        flags.FLAGS.mark_as_parsed()
    flags.FLAGS.experimental_orbax_use_distributed_barrier = True


class Checkpointer:
    """Keeps the last `keep` checkpoints in `directory` (a run's ckpt/); restores the newest usable one."""

    RETRIES, BACKOFF_S = 4, 2.0  # a failed read is tried again after 2, 4, 8, 16 s

    def __init__(self, directory: str | os.PathLike, keep: int = 2):
        import jax
        import orbax.checkpoint as ocp

        from diloco.rundir import path

        self._ocp = ocp
        self.dir = path(directory)
        if jax.process_count() > 1:
            use_client_barriers()
        self.mngr = ocp.CheckpointManager(
            self.dir, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                           enable_async_checkpointing=False),
            item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})

    def steps(self) -> list[int]:
        return sorted(self.mngr.all_steps())

    def save(self, step: int, state, meta: dict) -> None:
        """Orbax writes into a tmp dir and renames it when complete; the sidecar carries a checksum and
        the code that wrote it (diloco version, git commit)."""
        from diloco.rundir import code_version

        ocp = self._ocp
        meta = {**meta, "state_checksum": state_checksum(state), "code": code_version(), "state_version": STATE_VERSION}
        try:  # a full disk makes orbax/tensorstore print ~140 tracebacks: held, and dropped for our one line
            with native_stderr_captured(replay=lambda e: e is None or not _disk_full(e)):
                self.mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                              meta=ocp.args.JsonSave(meta)), force=True)
                self.mngr.wait_until_finished()
        except Exception as e:
            if not _disk_full(e):
                raise
            silence_stderr()  # the writers' threads keep failing while this unwinds; the caller restores it
            self._remove_partial(step)
            self.mngr.reload()
            raise DiskFull(f"no space left on the device of {self.dir} while saving the checkpoint of step {step}; "
                           f"its partial files were removed, the previous checkpoints {self.steps()} are kept. Free "
                           "space and run the same command to resume") from None

    def _remove_partial(self, step: int, quiet_s: float = 0.3, limit_s: float = 10.0) -> None:
        """Removes orbax's temporary folder of a failed save (it would keep the disk full). Writer threads
        of the save may still be running and recreate parts of it, so it is removed until it has stayed
        gone for `quiet_s`."""
        start = last_seen = time.monotonic()
        while time.monotonic() - last_seen < quiet_s and time.monotonic() - start < limit_s:
            for p in self.dir.iterdir():
                if p.name.startswith(f"{step}.") and "tmp" in p.name:
                    try:
                        p.rmtree()
                    except OSError:  # a writer thread changed it under us: the next pass removes the rest
                        pass
                    last_seen = time.monotonic()
            time.sleep(0.05)

    def remove_leftovers(self) -> list[str]:
        """Removes orbax's temporary folders of saves that never finished (`<step>.orbax-checkpoint-tmp-<n>`,
        left by a killed process), with a one-line notice; the names removed. Only the trainer's resume calls
        it (restore with quarantine): it holds the run folder's lock, so no save of this run is in flight. A
        finished checkpoint's folder (a plain step number) is never touched; the primary process removes."""
        import jax

        if jax.process_index() != 0:
            return []
        try:  # an object store has no folder before the first save: nothing to remove
            gone = sorted(p.name for p in self.dir.iterdir() if ".orbax-checkpoint-tmp" in p.name and p.is_dir())
        except FileNotFoundError:
            return []
        for name in gone:
            (self.dir / name).rmtree()
        if gone:
            print(f"diloco train: removed {len(gone)} unfinished checkpoint folder(s) of a save that was stopped: "
                  f"{', '.join(gone)}", file=sys.stderr)
        return gone

    def latest_meta(self) -> dict:
        """The sidecar of the newest checkpoint alone (no array read), {} when there is none or it cannot
        be read (restore then decides): lets a run refuse a data state it cannot continue before the
        model state is restored."""
        steps = self.steps()
        return self._meta(steps[-1]) if steps else {}

    def _meta(self, step: int) -> dict:
        """The sidecar of checkpoint `step`, {} when it cannot be read."""
        args = self._ocp.args.Composite(meta=self._ocp.args.JsonRestore())
        try:
            return dict(self.mngr.restore(step, args=args)["meta"])
        except Exception:  # noqa: BLE001  (restore() classifies the failure)
            return {}

    def restore(self, abstract_state, quarantine: bool = False) -> tuple[int, Any, dict] | None:
        """(step, state, sidecar) of the newest checkpoint that restores and matches its checksum; None
        when there is none. A corrupt one is skipped with a warning and, with `quarantine` (the trainer)
        and once a usable one is found, moved to ckpt_corrupt/ so that the step can be saved again and
        never shadows good checkpoints in max_to_keep. Raises, with nothing moved: CheckpointMismatch
        (written for another state), CheckpointUnreadable (the storage failed, again after the retries),
        NoUsableCheckpoint (every checkpoint is corrupt)."""
        if quarantine:
            self.remove_leftovers()
        corrupt = []
        for step in reversed(self.steps()):
            try:
                got = self._read(step, abstract_state)
            except _Corrupt as e:
                warnings.warn(f"checkpoint at step {step} in {self.dir} is unreadable ({e}); "
                              "falling back to the previous one")
                corrupt.append(step)
                continue
            if quarantine:
                for s in corrupt:
                    self._quarantine(s)
            return got
        if corrupt:
            raise NoUsableCheckpoint(
                f"every checkpoint in {self.dir} is corrupt (steps {sorted(corrupt)}); nothing was moved. "
                "Start over with --fresh (sets them aside, starts from step 0) or use a new --workdir")
        return None

    def _read(self, step: int, abstract_state) -> tuple[int, Any, dict]:
        """One checkpoint, its failures classified (classify); a storage failure is tried again."""
        ocp = self._ocp
        gone = [n for n in ("state", "meta") if not (self.dir / str(step) / n).exists()]
        if gone:  # an emptied or half-deleted step folder: no storage failure to wait out
            raise _Corrupt(f"the step folder has no {' or '.join(gone)}/")
        for attempt in range(self.RETRIES + 1):
            try:
                self._check_structure(step, abstract_state)
                out = self.mngr.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
                meta = dict(out["meta"])
                want = meta.get("state_checksum")
                if want is not None and want != state_checksum(out["state"]):
                    raise ChecksumMismatch("restored arrays do not match the checksum saved with them")
                return step, out["state"], meta
            except CheckpointMismatch:
                raise
            except Exception as e:
                kind, why = classify(e), f"{type(e).__name__}: {str(e)[:200]}"
                if kind == "mismatch":
                    raise self._mismatch(step, why) from e
                if kind == "corrupt":
                    raise _Corrupt(why) from e
                if attempt == self.RETRIES:
                    raise CheckpointUnreadable(
                        f"checkpoint at step {step} in {self.dir} could not be read {attempt + 1} times ({why}); "
                        "nothing was moved. Check the storage and run the same command again") from e
                wait = self.BACKOFF_S * 2 ** attempt
                warnings.warn(f"checkpoint at step {step} in {self.dir}: reading failed ({why}); "
                              f"trying again in {wait:g} s")
                time.sleep(wait)
                self.mngr.reload()
        raise AssertionError("unreachable")

    def _check_structure(self, step: int, abstract_state) -> None:
        """The saved leaves against the state's, from orbax's metadata (no array read): a changed dtype
        would otherwise be cast silently and then fail the checksum, as if the bytes were corrupt."""
        md = self.mngr.item_metadata(step)
        saved = md.get("state") if md is not None and hasattr(md, "get") else None
        names = leaf_names(saved) if saved is not None else {}
        if names:  # no metadata: the restore itself finds what is wrong
            diff = state_mismatch(names, leaf_names(abstract_state))
            if diff:
                raise self._mismatch(step, diff)

    def _mismatch(self, step: int, diff: str) -> CheckpointMismatch:
        meta = self._meta(step)  # a sidecar that cannot be read only loses the hint
        code, version = meta.get("code") or {}, meta.get("state_version", 1)
        by = (f"diloco {code.get('diloco', '?')} at commit {code.get('commit') or 'unknown'}" if code
              else "an older version of diloco (before checkpoints recorded their commit)")
        how = f"git checkout {code['commit'].removesuffix('-dirty')}, " if code.get("commit") else ""
        if meta and version != STATE_VERSION:
            diff = f"its state is version {version}, this diloco's is version {STATE_VERSION} ({diff})"
        return CheckpointMismatch(
            f"checkpoint at step {step} in {self.dir} was written by {by} for another training state: {diff}. "
            f"Nothing was moved. Resume it with the code that wrote it ({how}same command), or start over "
            "with --fresh (sets the checkpoints aside) or a new --workdir")

    def _quarantine(self, step: int) -> None:
        import jax

        if jax.process_index() == 0:
            aside = self.dir.parent / "ckpt_corrupt" / f"{step}-{int(time.time())}"
            aside.parent.mkdir(parents=True, exist_ok=True)
            (self.dir / str(step)).rename(aside)
            warnings.warn(f"moved the unreadable checkpoint to {aside}")
        self.mngr.reload()

    def close(self) -> None:
        self.mngr.close()


class _Corrupt(Exception):
    """Inside Checkpointer.restore: this checkpoint's bytes are damaged (skip it)."""
