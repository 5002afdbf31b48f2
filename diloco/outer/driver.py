"""The only code that turns the schedule into sends, outer updates and merges, for every rule.

After inner step t the loop calls `OuterDriver.after_step(state, t)`; in this order:
  sends(t)          the rule's send of fragment p (diloco/outer/rules.py: local → exchange → land, the
                    average into fragment p's pending slot), placed by `self.placement` (now, on step
                    t+1's program, or local here and the exchange on the comm devices;
                    diloco/outer/placement.py). A rule that does its round in its send (eager) lands
                    fragment p's previous average first.
  outer_updates(t)  the placement lands fragment p's average, then the outer-optimizer step of θᵍ_p
  merges(t)         θ_m,p ← α·θ_m,p + (1−α)·θᵍ_p on the replicas whose τ_m has elapsed

Every program is per fragment layout (`Fragments.groups`), for every rule: the inner-step programs are
the plain step plus one step+send per layout, with one send / local / land / update / merge per layout,
none recompiled as t advances.

The math is `OuterSync`'s (diloco/outer/sync.py) and the rule's; this module only schedules it, its
placement places it. `state` is the trainer's TrainState (fields `params`, `outer`, …).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from diloco.distributed import aligned_jit
from diloco.faults import NumericalFault
from diloco.outer import rules
from diloco.outer.placement import PLACEMENTS, Check
from diloco.outer.schedule import Schedule
from diloco.outer.sync import OuterSync


class OuterDriver:
    def __init__(self, sync: OuterSync, schedule: Schedule, R: int, seed: int, placement: str = "blocking",
                 overlap=None, constrain: Callable[[Any], Any] | None = None,
                 pin: Callable[[Any], Any] | None = None, inner_step: Callable | None = None,
                 check: Check | None = None, rule=None):
        """`placement`: where each send's exchange runs (diloco/outer/placement.py; `comm_device` takes
        the `overlap` exchange); `inner_step(active, jitted=True)`: the trainer's inner step; `check`:
        the pending check, called once per send when its average has landed; `rule`: what a send does
        (diloco/outer/rules.py; Plain when None)."""
        self.rule = rule if rule is not None else rules.Plain()
        if placement == "in_step" and schedule.tau_min < 1 and not self.rule.round_in_send:
            raise ValueError("the in_step placement needs tau ≥ 1 (the average lands on the next step)")
        self.sync, self.schedule, self.R = sync, schedule, R
        self.constrain = constrain or (lambda state: state)  # pins each program's output to the state's layout
        self.pin = pin or (lambda x: x)                      # the same for a fragment's averaged Δ (its subtree)
        kw = {"overlap": overlap} if placement == "comm_device" else {}
        self.placement = PLACEMENTS[placement](self, inner_step, check, **kw)
        self.base_key = jax.random.PRNGKey(seed + 1)
        self._jit: dict[tuple, Any] = {}

    @property
    def exchange(self) -> str:
        """The placement's name: blocking | in_step | comm_device."""
        return self.placement.name

    @property
    def check(self) -> Check | None:
        return self.placement.check

    @property
    def overlap(self):
        return getattr(self.placement, "overlap", None)

    def programs(self) -> list[tuple]:
        """Keys of the programs built so far: (kind, fragment layout, …): one per layout, not per fragment."""
        return sorted(self._jit, key=str)

    def run_programs(self, step: Callable) -> list[tuple[str, Any, tuple[str, ...], int]]:
        """(name, program, its arguments by name, fragment) of every fragment program a run executes,
        one per fragment layout (named by its fragments: `send 0`, `merge 1-7`): `step+send` (in_step:
        the send after step t rides on step t+1's program; `step` is the trainer's un-jitted inner
        step), `send` (blocking; with in_step the deferred send a settle runs), `local` and (a rule with
        buffers) `land` (comm_device), `update`, `merge`, and when a fragment can be in flight at an
        evaluation (τ > 0) the undonated update/merge copies `drained` runs; a rule that does its round
        in its send has no update or merge. Argument names: state, batch, key, contrib, mask, pending
        (compile/aot.run_programs gives them values, abstract or real)."""
        out, taus = [], self.schedule.taus
        for group in self.sync.frags.groups():
            p, g = group[0], group_name(group)
            if self.exchange == "in_step":
                out.append((f"step+send {g}", self.step_program(step, p), ("state", "batch", "key", "contrib"), p))
            if self.exchange == "comm_device":
                out.append((f"local {g}", self.program("local", p), ("state", "key", "contrib"), p))
                if not self.rule.stateless:
                    out.append((f"land {g}", self.program("land", p), ("state", "pending"), p))
            else:
                out.append((f"send {g}", self.program("send", p), ("state", "key", "contrib"), p))
            if self.rule.round_in_send:
                continue
            out += [(f"update {g}", self.program("update", p), ("state",), p),
                    (f"merge {g}", self.program("merge", p), ("state", "mask"), p)]
            if min(taus) > 0:
                out.append((f"update {g} (drained copy)", self.program("update", p, donate=False), ("state",), p))
            if max(taus) > 0:
                out.append((f"merge {g} (drained copy)", self.program("merge", p, donate=False), ("state", "mask"), p))
        return out

    @property
    def P(self) -> int:
        return self.sync.frags.P

    def bytes_per_replica(self, p: int) -> int:
        return self.sync.bytes_per_replica(p)

    # -- one jitted program per (operation, fragment layout), compiled once for all its fragments ---
    def program(self, kind: str, p: int, donate: bool = True) -> "FragmentProgram":
        """Fragment p's `send` / `update` / `merge`: (state, …) → state. The jitted program is shared by
        every fragment of p's layout (`Fragments.groups`: fragments 1…P−1 of the paper's runs): it
        takes p's row starts as an argument, so P fragments compile 1 + (1 when the embeddings' fragment
        differs) programs per kind, not P. `donate=False`: the state passed in stays valid (drained
        copies for evaluation)."""
        layout = self.sync.frags.layout(p)
        k = (kind, layout, donate)
        if k not in self._jit:
            sync, rep = self.sync, p  # traced for the first fragment asked for; the others pass their starts
            group = next(g for g in sync.frags.groups() if p in g)
            shared = len(group) > 1  # a fragment alone in its layout keeps static rows (no dynamic slices)
            rule, pin = self.rule, self.pin
            if kind in ("send", "local", "land"):  # fragment p's view (rules.view); its pending slot donated
                def f(state0, pending, starts, *rest):
                    starts = starts if shared else None
                    st = state0.replace(outer=state0.outer.replace(pending=(pending,)))
                    if kind == "land":
                        return self.constrain(st.replace(outer=rule.land(st.outer, *rest)))
                    if kind == "local":
                        params_R, v, target = rule.local(sync, st.params, st.outer, rep, *rest, starts)
                        return target if rule.stateless else (self.constrain(st.replace(params=params_R, outer=v)),
                                                              target)
                    params_R, v = rules.send(rule, sync, st.params, st.outer, rep, *rest, starts, pin)
                    return v.pending[0] if rule.stateless else self.constrain(st.replace(params=params_R, outer=v))
                donate_argnums = () if not donate else (0, 1) if not rule.stateless else (1,) if kind == "send" else ()
            elif kind == "update":  # the state without pending, fragment p's optax state as its only opt
                def f(state1, pending, starts):
                    starts = starts if shared else None
                    params, opt_p = sync.outer_step(state1.outer.params, state1.outer.opt[0], pending, rep, starts)
                    return self.constrain(state1.replace(outer=state1.outer.replace(params=params, opt=(opt_p,))))
                donate_argnums = (0,) if donate else ()
            elif kind == "merge":
                def f(state, starts, mask_R):
                    starts = starts if shared else None
                    return self.constrain(state.replace(params=sync.merge(state.params, state.outer, rep, mask_R,
                                                                          starts)))
                donate_argnums = (0,) if donate else ()
            else:
                raise ValueError(f"unknown outer operation {kind!r}")
            f.__name__ = program_name(kind, group)  # what JAX's compile logs and events name it
            self._jit[k] = aligned_jit(f, f"{kind}-{group_name(group)}", donate_argnums=donate_argnums)
        return FragmentProgram(kind, p, self._jit[k], self.sync, self.rule.stateless)

    def step_program(self, step: Callable, p: int, variant: Any = None) -> "FragmentProgram":
        """Inner step + fragment p's exchange in one program: (state, tokens, key, contrib_R, *poison)
        → (state with pending[p] filled, ce_R, finite_R). `step` is the trainer's un-jitted inner step.
        Shared by the fragments of p's layout, like `program`."""
        k = ("step+send", self.sync.frags.layout(p), variant)
        if k not in self._jit:
            sync, rep = self.sync, p
            group = next(g for g in self.sync.frags.groups() if p in g)
            shared = len(group) > 1  # alone in its layout: static rows

            rule = self.rule

            def f(state, pending, tokens, starts, key, contrib_R, *poison):
                starts = starts if shared else None
                params_R, v, target = rule.local(sync, state.params, state.outer.replace(pending=(pending,)),
                                                 rep, key, contrib_R, starts)  # from the step's input
                # The barrier makes the payload a value the step cannot reach into: without it XLA fused Δ's
                # reads of the parameters with the forward pass's (a multi-output fusion with the
                # last matmul), so the exchange waited for the whole forward/backward (seen on TPU
                # with nn.scan). The payload crosses it as the exchange reads it (`sync.wire`): a flat
                # vector laid end to end after the barrier put its gathers after the step on TPU.
                # Identity on values: the numbers do not change.
                target, state = jax.lax.optimization_barrier((sync.wire(target, rep),
                                                              state.replace(params=params_R, outer=v)))
                avg = sync.exchanged(target, key, contrib_R, rep)
                new, ce_R, fin_R = step(state, tokens, *poison)
                # The flat average is cut into θᵍ's pieces after the step: that regather (within a replica)
                # waits for the exchange, and XLA:GPU otherwise waited for it before the step's compute.
                new, avg = jax.lax.optimization_barrier((new, avg))
                return self.constrain(new.replace(outer=rule.land(new.outer, self.pin(sync.as_subtree(avg, rep))))), ce_R, fin_R

            f.__name__ = program_name("step+send", group)
            self._jit[k] = aligned_jit(f, f"step+send-{group_name(group)}", donate_argnums=(0, 1))
        return FragmentProgram("step+send", p, self._jit[k], self.sync, self.rule.stateless)

    def key(self, t: int, p: int):
        return jax.random.fold_in(jax.random.fold_in(self.base_key, t), p)

    # -- the schedule ------------------------------------------------------------------------------
    def after_step(self, state, t: int, contrib: Callable[[int, int], np.ndarray] | None = None
                   ) -> tuple[Any, list[tuple[int, int]]]:
        """Everything the schedule says happens after inner step t: (state, [(p, bytes sent)])."""
        sent = []
        sends = self.schedule.sends(t)
        finite_R = replica_finite(state.params) if sends and self.check else None  # culprit, pre-merge
        for p in sends:
            c = np.ones(self.R, np.float32) if contrib is None else np.asarray(contrib(t, p), np.float32)
            if self.rule.round_in_send:  # the previous round's average in the buffers before this round reads them
                state = self.placement.land(state, p, t)
            state = self.placement.send(state, p, t, self.key(t, p), jnp.asarray(c), finite_R)
            sent.append((p, int(self.bytes_per_replica(p) * (c > 0).sum())))
        if self.rule.round_in_send:
            return state, sent
        for p in self.schedule.outer_updates(t):
            state = self.placement.land(state, p, t)
            state = self.program("update", p)(state)
        for p, mask in self.schedule.merges(t):
            state = self.program("merge", p)(state, jnp.asarray(mask))
        return state, sent

    def drained(self, state, t: int) -> tuple[Any, Any, list[int]]:
        """(state with in-flight exchanges landed, a copy as it will be once every fragment in flight
        after step t is applied — outer step and merges —, those fragments). The first is the run's
        state; the copy is for evaluation (θᵍ at the next sync boundary) and is never trained on."""
        state = self.placement.settle(state)
        out, drained = state, []
        for p, update, mask in self.schedule.in_flight(t):
            if update:
                out = self.program("update", p, donate=False)(out)
            if any(mask):
                out = self.program("merge", p, donate=False)(out, jnp.asarray(mask))
            drained.append(p)
        return state, out, drained


class FragmentProgram:
    """Fragment p's view of a program shared by its layout: called (and lowered, for `diloco compile`)
    with the whole state, it passes p's row starts and p's own slots of the outer state to the shared
    jitted program and writes its results back into p's slots. Only tuples are rearranged here."""

    def __init__(self, kind: str, p: int, jitted, sync: OuterSync, stateless: bool = True):
        self.kind, self.p, self.jitted, self.sync, self.stateless = kind, p, jitted, sync, stateless
        self.starts = np.asarray(sync.frags.starts(p))

    def args(self, state, *rest) -> tuple:
        """The shared program's arguments for fragment p. Every kind but update and merge takes the state
        with fragment p's slots of the outer state (rules.view) less its pending slot, plus that slot
        alone, donated where the program writes a new one over it (no second (n_p,) buffer beside the
        old one); `update` reads p's pending slot and optax state; `merge` takes the whole state."""
        outer, p = state.outer, self.p
        pending = outer.pending[p]
        if self.kind == "update":  # p's optax state as the only opt
            bare = state.replace(outer=outer.replace(pending=()))
            return bare.replace(outer=bare.outer.replace(opt=(outer.opt[p],))), pending, self.starts
        if self.kind == "merge":
            return (state, self.starts, *rest)
        v = state.replace(outer=rules.view(outer, p).replace(pending=()))
        if self.kind == "step+send":
            tokens, *rest = rest
            return (v, pending, tokens, self.starts, *rest)
        return (v, pending, self.starts, *rest)

    def __call__(self, state, *rest):
        out = self.jitted(*self.args(state, *rest))
        p, outer = self.p, state.outer
        if self.kind == "update":
            return out.replace(outer=out.outer.replace(opt=outer.opt[:p] + out.outer.opt + outer.opt[p + 1:],
                                                       pending=outer.pending))
        if self.kind == "merge":
            return out
        if self.kind == "send" and self.stateless:  # the average alone
            return state.replace(outer=self.sync.with_pending(outer, p, out))
        if self.kind == "local":  # (state, payload); a rule without buffers: the payload alone
            return (state, out) if self.stateless else (self.merged(state, out[0]), out[1])
        if self.kind == "step+send":
            return (self.merged(state, out[0]), *out[1:])
        return self.merged(state, out)

    def merged(self, state, new):
        """`new` (a program's output on fragment p's view) written back into the whole state."""
        return new.replace(outer=rules.put(state.outer, self.p, new.outer))

    def lower(self, state, *rest):
        return self.jitted.lower(*self.args(state, *rest))


def program_name(kind: str, group: tuple[int, ...]) -> str:
    """A fragment program's function name: `step_send_fragments_1_7`, `merge_fragment_0`."""
    g = group_name(group).replace("-", "_").replace(",", "_")
    return f"{kind.replace('+', '_')}_fragment{'s' if len(group) > 1 else ''}_{g}"


def group_name(group: tuple[int, ...]) -> str:
    """Fragments sharing a program, as a name: `3`, `1-7`, `0,2`."""
    if len(group) > 1 and list(group) == list(range(group[0], group[-1] + 1)):
        return f"{group[0]}-{group[-1]}"
    return ",".join(map(str, group))


@jax.jit
def replica_finite(params_R):
    """(R,) bool on device, not fetched unless a fault is found: which replicas hold only finite values.
    One jitted program: op-by-op jnp on arrays that span processes would be a chain of small
    collective programs, each a chance for processes to disagree on order."""
    leaves = jax.tree_util.tree_leaves(params_R)
    return jnp.stack([jnp.isfinite(x).reshape(x.shape[0], -1).all(1) for x in leaves]).all(0)


@jax.jit
def _count_bad(tree):
    return sum((~jnp.isfinite(x)).sum() for x in jax.tree_util.tree_leaves(tree))


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
