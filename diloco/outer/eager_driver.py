"""The outer driver when eager updates or error feedback are on (`config.eager`, `config.error_feedback`).

Same schedule, keys and byte counts as `OuterDriver`; only what a send does changes:
  error feedback only   the send encodes Δ + residual and keeps the new residual (eager_sync.send);
                        outer updates and merges are OuterDriver's own programs, at t + τ as usual
  eager (naive/swap/mix) fragment p's whole round at its send step, in one program per fragment
                        (eager_sync.eager_round: send Δ_m(r), step θᵍ with g_m(r), merge); the schedule
                        has τ = 0, since the delay of D rounds is in the buffers, so nothing is in flight
                        between steps and the drained θᵍ is the state's own (the replicas' mean under
                        swap/mix, Trainer.eval_params)
Exchanges run in their own program after the step (exchange=blocking): a run's numbers do not depend
on where its exchange runs, and the in-step and comm-device placements are not wired for these sends.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from diloco.distributed import aligned_jit
from diloco.outer import eager_sync
from diloco.outer.driver import OuterDriver, replica_finite
from diloco.outer.placement import Check


def wanted(cfg) -> bool:
    """Whether a run's config turns on eager updates or error feedback (then EagerDriver drives it)."""
    return cfg.get("eager", "off") != "off" or bool(cfg.get("error_feedback", False))


class EagerDriver(OuterDriver):
    def __init__(self, sync, schedule, R: int, seed: int, mode: str = "off",
                 constrain: Callable[[Any], Any] | None = None, inner_step: Callable | None = None,
                 check: Check | None = None):
        super().__init__(sync, schedule, R, seed, "blocking", constrain=constrain, inner_step=inner_step,
                         check=check)
        self.mode = mode
        self._own: dict[tuple, Any] = {}

    @property
    def exchange(self) -> str:
        return "blocking"

    def own_program(self, kind: str, p: int):
        """`feedback_send` (state, key, contrib_R) → state, or `eager_round` (the same signature)."""
        if (kind, p) not in self._own:
            sync = self.sync
            if kind == "feedback_send":
                def f(state, key, contrib_R):
                    return state.replace(outer=eager_sync.send(sync, state.params, state.outer, p, key, contrib_R))
            elif kind == "eager_round":
                def f(state, key, contrib_R):
                    params, outer = eager_sync.eager_round(sync, state.params, state.outer, p, key, contrib_R)
                    return state.replace(params=params, outer=outer)
            else:
                raise ValueError(f"unknown outer operation {kind!r}")
            self._own[(kind, p)] = aligned_jit(lambda *a, _f=f: self.constrain(_f(*a)), f"{kind}-{p}",
                                               donate_argnums=(0,))
        return self._own[(kind, p)]

    def programs(self) -> list[tuple]:
        return sorted([*self._jit, *self._own], key=str)

    def after_step(self, state, t: int, contrib: Callable[[int, int], np.ndarray] | None = None
                   ) -> tuple[Any, list[tuple[int, int]]]:
        sent = []
        sends = self.schedule.sends(t)
        finite_R = replica_finite(state.params) if sends and self.check else None
        kind = "feedback_send" if self.mode == "off" else "eager_round"
        for p in sends:
            c = np.ones(self.R, np.float32) if contrib is None else np.asarray(contrib(t, p), np.float32)
            state = self.own_program(kind, p)(state, self.key(t, p), jnp.asarray(c))
            self.placement.checked(state, p, t, finite_R)
            sent.append((p, int(self.bytes_per_replica(p) * (c > 0).sum())))
        if self.mode == "off":
            for p in self.schedule.outer_updates(t):
                state = self.program("update", p)(state)
            for p, mask in self.schedule.merges(t):
                state = self.program("merge", p)(state, jnp.asarray(mask))
        return state, sent
