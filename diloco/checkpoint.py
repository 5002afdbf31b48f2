"""Orbax checkpoints of the whole training state, with a JSON sidecar for the data position, the
counters and a checksum of every array. The directory may be local or `gs://…` (an epath)."""
from __future__ import annotations

import functools
import os
import time
import warnings
from typing import Any


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
    """Keeps the last `keep` checkpoints in `directory` (a run's ckpt/); restores the newest readable one."""

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
                                                           enable_async_checkpointing=False))

    def steps(self) -> list[int]:
        return sorted(self.mngr.all_steps())

    def save(self, step: int, state, meta: dict) -> None:
        """Orbax writes into a tmp dir and renames it when complete; the sidecar carries a checksum."""
        ocp = self._ocp
        meta = {**meta, "state_checksum": state_checksum(state)}
        self.mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                      meta=ocp.args.JsonSave(meta)), force=True)
        self.mngr.wait_until_finished()

    def restore(self, abstract_state, quarantine: bool = False) -> tuple[int, Any, dict] | None:
        """Newest checkpoint that restores cleanly and matches its checksum; a corrupt one is skipped
        with a warning and, with `quarantine` (the trainer), moved to ckpt_corrupt/ so that the step
        can be saved again and never shadows good checkpoints in max_to_keep."""
        ocp = self._ocp
        for step in reversed(self.steps()):
            try:
                out = self.mngr.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
                meta = dict(out["meta"])
                want = meta.get("state_checksum")
                if want is not None and want != state_checksum(out["state"]):
                    raise ValueError("restored arrays do not match the checksum saved with them")
                return step, out["state"], meta
            except Exception as e:  # truncated / corrupt / missing files, flipped bytes
                warnings.warn(f"checkpoint at step {step} in {self.dir} is unreadable ({type(e).__name__}: "
                              f"{str(e)[:200]}); falling back to the previous one")
                if quarantine:
                    self._quarantine(step)
        return None

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
