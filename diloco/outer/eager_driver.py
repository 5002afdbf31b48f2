"""The outer driver when eager updates or error feedback are on (`config.eager`, `config.error_feedback`).

Same schedule, keys and byte counts as `OuterDriver`; only what a send does changes:
  error feedback only   the send encodes Δ + residual and keeps the new residual (eager_sync.send);
                        outer updates and merges are OuterDriver's own programs, at t + τ as usual
  eager (naive/swap/mix) fragment p's whole round at its send step (eager_sync.eager_round: send Δ_m(r),
                        step θᵍ with g_m(r), merge); the schedule has τ = 0, since the delay of D rounds
                        is in the buffers, so the drained θᵍ is the state's own (the replicas' mean under
                        swap/mix, Trainer.eval_params)

A send is two halves (eager_sync.local, eager_sync.land) with the exchange of what `local` says to
encode between them; `land` only writes the exchanged average where round r + D (eager) or the apply
τ steps later (error feedback alone) reads it. Every placement of diloco/outer/placement.py runs them,
with the same numbers:
  blocking     one program per send, right after the step (`send`: local + exchange + land)
  in_step      parked; step t+1's program runs local, then the exchange beside the inner step (the
               step reads only local's output, behind an optimization barrier) and land. Eager runs at
               any τ (the average is read H·D steps later); error feedback alone needs τ ≥ 1, as without it
  comm_device  local in its own program on the compute devices, the exchange dispatched on the comm
               devices (diloco/outer/overlap.py), landed at the apply (error feedback alone) or, under
               eager, before fragment p's next round (H steps later) or at a settle
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from diloco.distributed import aligned_jit
from diloco.outer import eager_sync
from diloco.outer.driver import OuterDriver, replica_finite
from diloco.outer.placement import PLACEMENTS, Check, CommDevice


def wanted(cfg) -> bool:
    """Whether a run's config turns on eager updates or error feedback (then EagerDriver drives it)."""
    return cfg.get("eager", "off") != "off" or bool(cfg.get("error_feedback", False))


class OwnProgram:
    """An EagerDriver program with the FragmentProgram interface the placements, the precompile and
    `diloco compile` use (`jitted`, `args`, call, `lower`): it takes the whole state."""

    def __init__(self, kind: str, p: int, jitted):
        self.kind, self.p, self.jitted = kind, p, jitted

    def args(self, state, *rest) -> tuple:
        return (state, *rest)

    def __call__(self, state, *rest):
        return self.jitted(state, *rest)

    def lower(self, state, *rest):
        return self.jitted.lower(state, *rest)


class EagerCommDevice(CommDevice):
    """comm_device for these sends: `local` on the compute devices, the exchange of its target on the comm
    devices, `land` when it has arrived."""

    def send(self, state, p: int, t: int, key, contrib_R, finite_R=None):
        state, target = self.driver.own_program("local", p)(state, key, contrib_R)
        self.overlap.send(state, p, key, contrib_R, t, finite_R, delta=target)
        return state

    def land(self, state, p: int, t: int | None = None):
        avg, rec = self.overlap.land(p, t)
        if rec is None:  # nothing in flight
            return state
        state = self.driver.own_program("land", p)(state, avg)
        self.checked(state, p, rec.step, rec.finite_R)
        return state

    def in_flight(self) -> list[int]:
        """In send order (under eager one lands only before its fragment's next round): settle lands and
        checks them in the order they were sent."""
        return sorted(self.overlap.inflight, key=lambda p: self.overlap.inflight[p].step)


class EagerDriver(OuterDriver):
    def __init__(self, sync, schedule, R: int, seed: int, mode: str = "off", placement: str = "blocking",
                 overlap=None, constrain: Callable[[Any], Any] | None = None, inner_step: Callable | None = None,
                 check: Check | None = None):
        if placement == "in_step" and mode == "off" and schedule.tau_min < 1:
            raise ValueError("the in_step placement needs tau ≥ 1 (the average lands on the next step)")
        super().__init__(sync, schedule, R, seed, "blocking", constrain=constrain, inner_step=inner_step,
                         check=check)
        if placement == "comm_device":
            self.placement = EagerCommDevice(self, inner_step, check, overlap=overlap)
        elif placement != "blocking":
            self.placement = PLACEMENTS[placement](self, inner_step, check)
        self.mode = mode
        self.send_kind = "feedback_send" if mode == "off" else "eager_round"
        self._own: dict[tuple, Any] = {}

    def own_program(self, kind: str, p: int, variant: Any = None, step: Callable | None = None):
        """Fragment p's jitted programs (state, …) → …: `feedback_send` / `eager_round` (state, key,
        contrib_R) → state, the whole send; `local` (state, key, contrib_R) → (state, target) and `land`
        (state, avg_n) → state, its two halves; `step+<send kind>` (state, tokens, key, contrib_R, *poison)
        → (state, ce_R, finite_R): inner step `step` with the send riding on it (in_step)."""
        k = (kind, p, variant)
        if k not in self._own:
            sync, constrain = self.sync, self.constrain
            if kind in ("feedback_send", "eager_round"):
                def f(state, key, contrib_R):
                    params, outer, target = eager_sync.local(sync, state.params, state.outer, p, key, contrib_R)
                    outer = eager_sync.land(outer, p, sync.average(target, key, contrib_R))
                    return constrain(state.replace(params=params, outer=outer))
            elif kind == "local":
                def f(state, key, contrib_R):
                    params, outer, target = eager_sync.local(sync, state.params, state.outer, p, key, contrib_R)
                    return constrain(state.replace(params=params, outer=outer)), target
            elif kind == "land":
                def f(state, avg_n):
                    return constrain(state.replace(outer=eager_sync.land(state.outer, p, avg_n)))
            elif kind.startswith("step+"):
                def f(state, tokens, key, contrib_R, *poison):
                    params, outer, target = eager_sync.local(sync, state.params, state.outer, p, key, contrib_R)
                    # the step reads only local's output: the exchange can run under its compute (TPU/GPU)
                    target, params, outer = jax.lax.optimization_barrier((target, params, outer))
                    avg_n = sync.average(target, key, contrib_R)
                    new, ce_R, fin_R = step(state.replace(params=params, outer=outer), tokens, *poison)
                    return constrain(new.replace(outer=eager_sync.land(new.outer, p, avg_n))), ce_R, fin_R
            else:
                raise ValueError(f"unknown outer operation {kind!r}")
            f.__name__ = f"{kind.replace('+', '_')}_fragment_{p}"
            self._own[k] = OwnProgram(kind, p, aligned_jit(f, f"{kind}-{p}", donate_argnums=(0,)))
        return self._own[k]

    def program(self, kind: str, p: int, donate: bool = True):
        """`send` is this driver's whole send (feedback_send / eager_round); update and merge OuterDriver's."""
        if kind == "send":
            return self.own_program(self.send_kind, p)
        return super().program(kind, p, donate)

    def step_program(self, step: Callable, p: int, variant: Any = None):
        """Inner step + fragment p's send in one program (the in_step placement)."""
        return self.own_program(f"step+{self.send_kind}", p, variant, step)

    def programs(self) -> list[tuple]:
        return sorted([*self._jit, *self._own], key=str)

    def run_programs(self, step: Callable) -> list[tuple[str, Any, tuple[str, ...], int]]:
        """OuterDriver.run_programs for these sends, which are per fragment (`own_program`), not per
        layout: per fragment p its send as the placement runs it — `send p` (blocking, and the settle
        of in_step), `step+send p` (in_step), `local p` + `land p` (comm_device) — and, with error
        feedback alone, the shared update/merge programs of OuterDriver (under eager the round does
        its own outer step and merge: no update or merge runs)."""
        out = []
        for p in range(self.P):
            if self.exchange == "in_step":
                out.append((f"step+send {p}", self.step_program(step, p), ("state", "batch", "key", "contrib"), p))
            if self.exchange == "comm_device":
                out += [(f"local {p}", self.own_program("local", p), ("state", "key", "contrib"), p),
                        (f"land {p}", self.own_program("land", p), ("state", "pending"), p)]
            else:
                out.append((f"send {p}", self.program("send", p), ("state", "key", "contrib"), p))
        if self.mode == "off":
            out += [x for x in super().run_programs(step) if not x[0].startswith(("send ", "step+send "))]
        return out

    def after_step(self, state, t: int, contrib: Callable[[int, int], np.ndarray] | None = None
                   ) -> tuple[Any, list[tuple[int, int]]]:
        sent = []
        sends = self.schedule.sends(t)
        finite_R = replica_finite(state.params) if sends and self.check else None
        for p in sends:
            c = np.ones(self.R, np.float32) if contrib is None else np.asarray(contrib(t, p), np.float32)
            if self.mode != "off":  # the previous round's average in the buffers before this round reads them
                state = self.placement.land(state, p, t)
            state = self.placement.send(state, p, t, self.key(t, p), jnp.asarray(c), finite_R)
            sent.append((p, int(self.bytes_per_replica(p) * (c > 0).sum())))
        if self.mode == "off":
            for p in self.schedule.outer_updates(t):
                state = self.placement.land(state, p, t)
                state = self.program("update", p)(state)
            for p, mask in self.schedule.merges(t):
                state = self.program("merge", p)(state, jnp.asarray(mask))
        return state, sent
