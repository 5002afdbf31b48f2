"""Where a fragment's exchange runs: one protocol, three placements (config `exchange`, resolved once in
diloco/resolve.py). The numbers never depend on the placement (tests/test_train.py checks every one
against blocking bit for bit): every placement uses the same Δ (`OuterSync.delta`), keys and exchange
(`OuterSync.exchange`), and writes the average into fragment p's pending slot only through
`OuterSync.with_pending`.

The loop (diloco/train.py) and the driver (diloco/outer/driver.py) call, for inner step t:

  step(state, tokens, active, poison)   inner step t; it carries the exchange a placement parked at the
                                         send after step t−1 (in_step), else it is the plain step
  send(state, p, t, key, contrib_R, finite_R)   the send of fragment p after step t
  land(state, p, t)                      fragment p's average in its pending slot, before its outer
                                         update at t (the apply, τ steps after the send)
  settle(state)                          every exchange in flight landed (a checkpoint, the end of a
                                         run, a drained evaluation): a checkpoint never holds one

  blocking      send: its own program right after step t (the loop waits for it); land, settle: nothing
  in_step       send: parked; step t+1's program exchanges it beside the forward/backward (Δ from
                that program's input, the state after step t, behind an optimization barrier), so XLA's
                latency-hiding scheduler can put the step's compute under the collective (TPU/GPU).
                Needs τ ≥ 1. settle: a parked send runs as the blocking program (same numbers)
  comm_device   send: the rule's local program here, its payload's exchange dispatched on a second
                device per process (diloco/outer/overlap.py), returns at once; land: waits for it at the
                apply (CPU multi-process runs, `--comm_device`)

The pending check (`check(state, p, t_send, finite_R)`, the loop's NumericalFault on a non-finite
average) is given once, at construction, and called once per send, when its average has landed.
A new placement is a subclass with its own `send`/`step`/`land`/`settle` and a row in PLACEMENTS. Every
rule (diloco/outer/rules.py) runs under every placement: the driver's `send` and `step+send` programs are
the rule's local + exchange + land, and comm_device runs the rule's `local` program on the compute devices,
the exchange on the comm devices and the rule's `land` when it has arrived.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

# check(state, p, t_send, finite_R): called once fragment p's average is in its pending slot.
Check = Callable[[Any, int, int, Any], None]


class Parked(NamedTuple):
    """A send after step t whose exchange rides on the next inner step's program (in_step)."""
    p: int
    t: int
    key: Any
    contrib_R: Any
    finite_R: Any


class Blocking:
    """Each send's exchange in its own program, right after the step."""
    name = "blocking"

    def __init__(self, driver, inner_step: Callable | None = None, check: Check | None = None):
        """`driver`: the OuterDriver whose programs run the sends; `inner_step(active, jitted=True)`: the
        trainer's inner step; `check`: the pending check (None: none)."""
        self.driver, self.inner_step, self.check = driver, inner_step, check

    def checked(self, state, p: int, t: int, finite_R) -> None:
        if self.check is not None:
            self.check(state, p, t, finite_R)

    def step(self, state, tokens, active: int | None = None, poison: tuple = ()):
        return self.inner_step(active)(state, tokens, *poison)

    def send(self, state, p: int, t: int, key, contrib_R, finite_R=None):
        state = self.driver.program("send", p)(state, key, contrib_R)
        self.checked(state, p, t, finite_R)
        return state

    def land(self, state, p: int, t: int | None = None):
        return state

    def settle(self, state):
        return state

    def in_flight(self) -> list[int]:
        """Fragments whose exchange has not landed yet."""
        return []


class InStep(Blocking):
    """A send's exchange inside the program of the next inner step."""
    name = "in_step"

    def __init__(self, driver, inner_step: Callable | None = None, check: Check | None = None):
        super().__init__(driver, inner_step, check)
        self.parked: Parked | None = None

    def send(self, state, p: int, t: int, key, contrib_R, finite_R=None):
        self.unrun(t + 1, "another send")
        self.parked = Parked(p, t, key, contrib_R, finite_R)  # exchanged by step t+1's program
        return state

    def land(self, state, p: int, t: int | None = None):
        if t is not None:
            self.unrun(t, f"fragment {p}'s apply")
        if self.parked is not None and self.parked.p == p:
            raise RuntimeError(f"fragment {p}'s send after step {self.parked.t} is still parked at its apply: "
                               "its exchange rides on the next inner step (placement.step), run before the apply")
        return state

    def unrun(self, t: int, what: str) -> None:
        """Fail loudly when a send parked before step t was never carried by a step: the inner step ran
        without the placement (Trainer.inner_step instead of placement.step), so its average never landed."""
        if self.parked is not None and self.parked.t < t:
            raise RuntimeError(f"{what} at step {t}: fragment {self.parked.p}'s send after step {self.parked.t} was "
                               "never exchanged; with exchange=in_step drive the inner step with placement.step, "
                               "which carries it (Trainer.inner_step does not)")

    def step(self, state, tokens, active: int | None = None, poison: tuple = ()):
        d, self.parked = self.parked, None
        if d is None:
            return super().step(state, tokens, active, poison)
        program = self.driver.step_program(self.inner_step(active, jitted=False), d.p, active)
        state, ce_R, fin_R = program(state, tokens, d.key, d.contrib_R, *poison)
        self.checked(state, d.p, d.t, d.finite_R)
        return state, ce_R, fin_R

    def settle(self, state):
        if self.parked is not None:
            d, self.parked = self.parked, None
            state = super().send(state, d.p, d.t, d.key, d.contrib_R, d.finite_R)
        return state

    def in_flight(self) -> list[int]:
        return [self.parked.p] if self.parked is not None else []


class CommDevice(Blocking):
    """A send's exchange on the comm devices (diloco/outer/overlap.py OverlappedExchange), waited for at
    its apply."""
    name = "comm_device"

    def __init__(self, driver, inner_step: Callable | None = None, check: Check | None = None, overlap=None):
        super().__init__(driver, inner_step, check)
        self.overlap = overlap

    def send(self, state, p: int, t: int, key, contrib_R, finite_R=None):
        state, payload = self.driver.program("local", p)(state, key, contrib_R)
        self.overlap.send(state, p, key, contrib_R, t, finite_R, delta=payload)
        return state

    def land(self, state, p: int, t: int | None = None):
        avg, rec = self.overlap.land(p, t)
        if rec is None:  # nothing in flight (a resumed run's checkpoint holds it in pending)
            return state
        if self.driver.rule.stateless:  # into the pending slot, no program
            state = state.replace(outer=self.driver.sync.with_pending(state.outer, p, avg))
        else:
            state = self.driver.program("land", p)(state, avg)
        self.checked(state, p, rec.step, rec.finite_R)
        return state

    def settle(self, state):
        for p in self.in_flight():
            state = self.land(state, p, None)
        return state

    def in_flight(self) -> list[int]:
        """In send order: settle lands and checks them in the order they were sent."""
        return sorted(self.overlap.inflight, key=lambda p: self.overlap.inflight[p].step)


PLACEMENTS = {c.name: c for c in (Blocking, InStep, CommDevice)}
