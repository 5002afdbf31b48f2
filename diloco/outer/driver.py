"""The only code that turns the schedule into sends, outer updates and merges.

After inner step t the loop calls `OuterDriver.after_step(state, t)`; in this order:
  sends(t)          Δ → encode → exchange → FP32 average, into the pending slot of fragment p
                    (blocking: one jitted program; overlapped: dispatched on the comm devices and
                    landed at the apply, diloco/outer/overlap.py)
  outer_updates(t)  Nesterov step of θᵍ_p with the pending average
  merges(t)         θ_m,p ← α·θ_m,p + (1−α)·θᵍ_p on the replicas whose τ_m has elapsed

Where a send's exchange runs (`exchange`):
  blocking     its own program, right after step t (the loop waits for it)
  comm_device  on a second device per process, landed at the apply (CPU overlap, overlap.py)
  in_step      inside the program of inner step t+1: Δ is taken from that program's input (the
               state after step t, exactly what the blocking send sees), encoded, exchanged and
               averaged beside the forward/backward, which does not depend on it (an optimization
               barrier keeps XLA from fusing Δ into the step: results/pod/overlap.md), so XLA's
               latency-hiding scheduler can put the step's compute under the collective (TPU/GPU;
               one program at a time runs on a chip). Needs τ ≥ 1: the average is in its pending
               slot when step t+1 ends, at or before the apply at t+τ. The whole exchange rides on
               the first step after the send (the schedule never sends two fragments at one step,
               P ≤ H), so the inner-step programs are the plain step plus one per fragment: P+1,
               with P update and P merge programs, 3P+1 in all, none recompiled as t advances.

The math is `OuterSync`'s (diloco/outer/sync.py); this module only schedules and places it.
`state` is the trainer's TrainState (fields `params`, `outer`, …; `replace` makes a new one).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from diloco.distributed import aligned_jit
from diloco.faults import NumericalFault
from diloco.outer.schedule import Schedule
from diloco.outer.sync import OuterSync

# check(state, p, t_send, finite_R): called once fragment p's average is in its pending slot.
Check = Callable[[Any, int, int, Any], None]


EXCHANGES = ("auto", "blocking", "in_step")


class Deferred(NamedTuple):
    """A send after step t whose exchange rides on the next inner step's program (exchange=in_step)."""
    p: int
    t: int
    key: Any
    contrib_R: Any
    finite_R: Any


class OuterDriver:
    def __init__(self, sync: OuterSync, schedule: Schedule, R: int, seed: int, overlap=None,
                 constrain: Callable[[Any], Any] | None = None, in_step: bool = False):
        self.sync, self.schedule, self.R, self.overlap = sync, schedule, R, overlap
        self.constrain = constrain or (lambda state: state)  # pins each program's output to the state's layout
        self.in_step = in_step and overlap is None and schedule.tau_min >= 1
        self.deferred: Deferred | None = None
        self.base_key = jax.random.PRNGKey(seed + 1)
        self._jit: dict[tuple, Any] = {}

    @property
    def exchange(self) -> str:
        return "comm_device" if self.overlap is not None else "in_step" if self.in_step else "blocking"

    def programs(self) -> list[tuple]:
        """Keys of the programs built so far: (kind, fragment, …)."""
        return sorted(self._jit, key=str)

    @property
    def P(self) -> int:
        return self.sync.frags.P

    def bytes_per_replica(self, p: int) -> int:
        return self.sync.bytes_per_replica(p)

    # -- one jitted program per (operation, fragment): 3·P programs, compiled on first use ----------
    def program(self, kind: str, p: int, donate: bool = True):
        """`donate=False`: the state passed in stays valid (drained copies for evaluation)."""
        if (kind, p, donate) not in self._jit:
            sync = self.sync
            if kind == "send":
                def f(state, key, contrib_R):
                    return state.replace(outer=sync.send(state.params, state.outer, p, key, contrib_R))
            elif kind == "update":
                def f(state):
                    return state.replace(outer=sync.update(state.outer, p))
            elif kind == "merge":
                def f(state, mask_R):
                    return state.replace(params=sync.merge(state.params, state.outer, p, mask_R))
            else:
                raise ValueError(f"unknown outer operation {kind!r}")
            self._jit[(kind, p, donate)] = aligned_jit(lambda *a, _f=f: self.constrain(_f(*a)), f"{kind}-{p}",
                                                       donate_argnums=(0,) if donate else ())
        return self._jit[(kind, p, donate)]

    def step_program(self, step: Callable, p: int, variant: Any = None):
        """Inner step + fragment p's exchange in one program: (state, tokens, key, contrib_R, *poison)
        → (state with pending[p] filled, ce_R, finite_R). `step` is the trainer's un-jitted inner step."""
        if ("step+send", p, variant) not in self._jit:
            sync = self.sync

            def f(state, tokens, key, contrib_R, *poison):
                delta_Rxn = sync.delta(state.params, state.outer, p)  # Δ from the step's input
                # The barrier makes Δ a value the step cannot reach into: without it XLA fused Δ's
                # reads of the parameters with the forward pass's (a multi-output fusion with the
                # last matmul), so the exchange waited for the whole forward/backward (seen on TPU
                # with nn.scan). Identity on values: the numbers do not change.
                delta_Rxn, state = jax.lax.optimization_barrier((delta_Rxn, state))
                outer = sync.send_delta(delta_Rxn, state.outer, p, key, contrib_R)
                new, ce_R, fin_R = step(state, tokens, *poison)
                return self.constrain(new.replace(outer=outer)), ce_R, fin_R

            self._jit[("step+send", p, variant)] = aligned_jit(f, f"step+send-{p}", donate_argnums=(0,))
        return self._jit[("step+send", p, variant)]

    def inner_step(self, state, tokens, step_fn, step: Callable, variant: Any = None, poison: tuple = (),
                   check: "Check | None" = None):
        """Run one inner step (`step_fn`, jitted), carrying the deferred exchange if there is one."""
        d, self.deferred = self.deferred, None
        if d is None:
            return step_fn(state, tokens, *poison)
        state, ce_R, fin_R = self.step_program(step, d.p, variant)(state, tokens, d.key, d.contrib_R, *poison)
        if check:
            check(state, d.p, d.t, d.finite_R)
        return state, ce_R, fin_R

    def key(self, t: int, p: int):
        return jax.random.fold_in(jax.random.fold_in(self.base_key, t), p)

    # -- the schedule ------------------------------------------------------------------------------
    def after_step(self, state, t: int, contrib: Callable[[int, int], np.ndarray] | None = None,
                   check: Check | None = None) -> tuple[Any, list[tuple[int, int]]]:
        """Everything the schedule says happens after inner step t: (state, [(p, bytes sent)])."""
        sent = []
        sends = self.schedule.sends(t)
        finite_R = replica_finite(state.params) if sends and check else None  # culprit, pre-merge
        for p in sends:
            c = np.ones(self.R, np.float32) if contrib is None else np.asarray(contrib(t, p), np.float32)
            k = self.key(t, p)
            if self.overlap is not None:
                self.overlap.send(state, p, k, jnp.asarray(c), t, finite_R)
            elif self.in_step:  # exchanged by the next inner step's program
                self.deferred = Deferred(p, t, k, jnp.asarray(c), finite_R)
            else:
                state = self.program("send", p)(state, k, jnp.asarray(c))
                if check:
                    check(state, p, t, finite_R)
            sent.append((p, int(self.bytes_per_replica(p) * (c > 0).sum())))
        for p in self.schedule.outer_updates(t):
            state = self.land(state, p, t, check)
            state = self.program("update", p)(state)
        for p, mask in self.schedule.merges(t):
            state = self.program("merge", p)(state, jnp.asarray(mask))
        return state, sent

    def land(self, state, p: int, t: int | None = None, check: Check | None = None):
        """Fragment p's overlapped exchange, if in flight, into its pending slot."""
        if self.overlap is None:
            return state
        avg, rec = self.overlap.land(p, t)
        if rec is None:
            return state
        state = state.replace(outer=self.sync.with_pending(state.outer, p, avg))
        if check:
            check(state, p, rec.step, rec.finite_R)
        return state

    def drained(self, state, t: int, check: Check | None = None) -> tuple[Any, Any, list[int]]:
        """(state with in-flight exchanges landed, a copy as it will be once every fragment in flight
        after step t is applied — outer step and merges —, those fragments). The first is the run's
        state; the copy is for evaluation (θᵍ at the next sync boundary) and is never trained on."""
        state = self.settle(state, check)
        out, drained = state, []
        for p, update, mask in self.schedule.in_flight(t):
            if update:
                out = self.program("update", p, donate=False)(out)
            if any(mask):
                out = self.program("merge", p, donate=False)(out, jnp.asarray(mask))
            drained.append(p)
        return state, out, drained

    def settle(self, state, check: Check | None = None):
        """Land every exchange still in flight (before a checkpoint or the end of the run); a send
        deferred to the next inner step is exchanged now, by the blocking program (same numbers)."""
        if self.deferred is not None:
            d, self.deferred = self.deferred, None
            state = self.program("send", d.p)(state, d.key, d.contrib_R)
            if check:
                check(state, d.p, d.t, d.finite_R)
        for p in sorted(self.overlap.inflight if self.overlap is not None else ()):
            state = self.land(state, p, None, check)
        return state


@jax.jit
def replica_finite(params_R):
    """(R,) bool on device, not fetched unless a fault is found: which replicas hold only finite values.
    One jitted program: op-by-op jnp on arrays that span processes would be a chain of small
    collective programs, each a chance for processes to disagree on order."""
    leaves = jax.tree_util.tree_leaves(params_R)
    return jnp.stack([jnp.isfinite(x).reshape(x.shape[0], -1).all(1) for x in leaves]).all(0)


@jax.jit
def _count_bad(x):
    return (~jnp.isfinite(x)).sum()


def check_pending_finite(state, p: int, t: int, last_ckpt: int = 0, finite_R=None) -> None:
    """Raise NumericalFault when fragment p's averaged outer gradient (sent at step t) is not finite."""
    pending = state.outer.pending[p]
    n_bad = int(_count_bad(pending))  # one scalar to the host per sync (one program on every process)
    if n_bad:
        try:
            bad = [m for m, ok in enumerate(np.asarray(finite_R)) if not ok]
        except Exception:  # None, or not addressable from this process
            bad = "unknown"
        raise NumericalFault(f"step {t}: the averaged outer gradient of fragment {p} is not finite "
                             f"({n_bad} bad values; non-finite parameters on replica(s) "
                             f"{bad}); the run stopped and the last good checkpoint (step {last_ckpt}) is kept")
