"""Fault injection (`cfg.faults`, docs/reliability.md): the loop asks, these answer.

  contrib(t, p)            per-replica weights of a send: 0 for a replica that misses its syncs
  poison(t, target)        () or a per-replica multiplier (1, nan or inf) for the loss or the params
  restart_replica(state)   replica m restarts from θᵍ with fresh AdamW moments
"""
from __future__ import annotations

import sys

import numpy as np


class NumericalFault(RuntimeError):
    """A non-finite loss, gradient or averaged outer gradient stopped the run."""


class Faults:
    def __init__(self, cfg, R: int):
        self.f, self.R, self.H, self.replicas = cfg.faults, R, cfg.H, cfg.replicas

    @property
    def skip_bad_batches(self) -> bool:
        return self.f.nan_policy == "skip"

    def contrib(self, t: int, p: int) -> np.ndarray:
        c = np.ones(self.replicas, np.float32)
        f = self.f
        if f.miss_sync_replica >= 0 and f.miss_sync_step and f.miss_sync_step <= t < f.miss_sync_step + self.H:
            c[f.miss_sync_replica] = 0.0
        return c

    def poison(self, t: int, target: str) -> tuple:
        """faults.nan_step: () on other steps, else a per-replica multiplier (1, or nan/inf for nan_replica)."""
        f = self.f
        if f.nan_step != t or f.nan_target != target:
            return ()
        s = np.ones(self.R, np.float32)
        s[f.nan_replica] = np.nan if f.nan_value == "nan" else np.inf
        print(f"step {t}: injecting {f.nan_value} into replica {f.nan_replica}'s {target} (faults.nan_step)",
              file=sys.stderr)
        import jax.numpy as jnp

        return (jnp.asarray(s),)

    def restart_due(self, t: int) -> bool:
        return self.f.restart_replica >= 0 and t == self.f.restart_step

    def restart_replica(self, trainer, state):
        """Replica m loses its state and restarts from the outer params: fresh AdamW moments (and bias
        correction), but the learning-rate schedule continues at the global step (no second warm-up)."""
        import jax
        import optax

        m = self.f.restart_replica
        g = state.outer.params
        params = jax.tree_util.tree_map(lambda x, gx: x.at[m].set(gx), state.params, g)
        is_sched = lambda x: isinstance(x, optax.ScaleByScheduleState)
        fresh = jax.tree_util.tree_map(lambda f, o: o if is_sched(f) else f, jax.vmap(trainer.tx.init)(params),
                                       state.opt, is_leaf=is_sched)
        opt = jax.tree_util.tree_map(lambda o, f: o.at[m].set(f[m]), state.opt, fresh)
        return state.replace(params=params, opt=opt)

    def poison_params(self, state, t: int):
        """faults.nan_target=outer: a replica's params go bad just before the step's sends."""
        import jax

        for v in self.poison(t, "outer"):
            state = state.replace(params=jax.tree_util.tree_map(
                lambda x: x * v.reshape((-1,) + (1,) * (x.ndim - 1)).astype(x.dtype), state.params))
        return state
