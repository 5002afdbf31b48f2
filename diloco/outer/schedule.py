"""The Streaming DiLoCo sync schedule as a pure function of the step.
The algorithm contract these implement is stated once, in docs/architecture.md.

Steps are counted t = 1, 2, … after each inner step. Fragment p (0-based) of P has offset
t_p = round(p·H/P) (halves round up). It sends at t = t_p + k·H (k ≥ 1) and is applied τ steps
later. With per-replica τ_m (heterogeneous workers), the outer optimizer steps the fragment at
t_send + min_m τ_m and replica m merges it at t_send + τ_m. Every fragment does exactly H inner
steps between two of its own sends. DiLoCo is P = 1, τ = 0.
"""
from __future__ import annotations

import dataclasses
import math

from diloco.errors import ConfigError


def fragment_offset(p: int, H: int, P: int) -> int:
    """t_p = round(p·H/P), halves up: the step (mod H) after which fragment p sends (the trainer's, the byte
    calculator's and the simulator's one rule)."""
    return math.floor(p * H / P + 0.5)


@dataclasses.dataclass(frozen=True)
class Schedule:
    H: int
    P: int = 1
    taus: tuple[int, ...] = (0,)  # one τ per replica (all equal unless heterogeneous)

    def __post_init__(self):
        if self.H < 1:
            raise ConfigError("H", f"H={self.H} must be ≥ 1")
        if self.P < 1:
            raise ConfigError("fragments", f"P={self.P} must be ≥ 1")
        if self.P > self.H:
            raise ConfigError("fragments", f"P={self.P} fragments cannot get distinct send steps within "
                              f"H={self.H}; use H ≥ P (e.g. H={self.P}) or fewer fragments")
        for tau in self.taus:
            if not 0 <= tau < self.H:
                raise ConfigError("tau", f"tau={tau} must satisfy 0 ≤ tau < H={self.H}")

    @property
    def tau_min(self) -> int:
        return min(self.taus)

    def offset(self, p: int) -> int:
        return fragment_offset(p, self.H, self.P)

    def sends(self, t: int) -> list[int]:
        """Fragments whose outer gradient is computed and sent after inner step t."""
        return [p for p in range(self.P) if t - self.offset(p) >= self.H and (t - self.offset(p)) % self.H == 0]

    def outer_updates(self, t: int) -> list[int]:
        """Fragments whose averaged outer gradient is applied to the outer params at t."""
        return self.sends(t - self.tau_min) if t - self.tau_min >= 1 else []

    def merges(self, t: int) -> list[tuple[int, tuple[bool, ...]]]:
        """(fragment, replica mask) pairs: which replicas merge which fragment at t."""
        out: dict[int, list[bool]] = {}
        for m, tau in enumerate(self.taus):
            if t - tau < 1:
                continue
            for p in self.sends(t - tau):
                out.setdefault(p, [False] * len(self.taus))[m] = True
        return [(p, tuple(mask)) for p, mask in sorted(out.items())]

    def applies(self, t: int) -> list[int]:
        """Fragments applied at t (homogeneous τ: outer update and merge happen together)."""
        return sorted({p for p, _ in self.merges(t)} | set(self.outer_updates(t)))

    def in_flight(self, t: int) -> list[tuple[int, bool, tuple[bool, ...]]]:
        """Sends at or before t not yet wholly applied after step t: (fragment, outer update still to
        come, replicas whose merge is still to come). Empty when τ = 0 (applied in the send's step)."""
        out = []
        for d in range(max(self.taus)):  # τ < H: at most one send of a fragment is in flight
            if t - d < 1:
                break
            for p in self.sends(t - d):
                mask = tuple(d < tau for tau in self.taus)
                if d < self.tau_min or any(mask):
                    out.append((p, d < self.tau_min, mask))
        return sorted(out)

    def next_sender(self, t: int) -> int:
        """The fragment whose next send comes first at or after step t (FedPart-style training)."""
        def next_send(p: int) -> int:
            o = self.offset(p)
            k = max(1, -(-(t - o) // self.H))
            return o + k * self.H

        return min(range(self.P), key=next_send)

    def table(self, steps: int) -> list[tuple[int, list[int], list[int]]]:
        return [(t, self.sends(t), self.applies(t)) for t in range(1, steps + 1)]


def make_schedule(H: int, P: int, tau: int, replicas: int, replica_tau: str = "") -> Schedule:
    """Schedule from config fields; `replica_tau` is "τ_1,τ_2,…" (one per replica) or empty."""
    if replica_tau:
        try:
            taus = tuple(int(x) for x in replica_tau.split(","))
        except ValueError:
            raise ConfigError("replica_tau", f"{replica_tau!r} must be comma-separated integers, e.g. '1,5'")
        if len(taus) != replicas:
            raise ConfigError("replica_tau", f"{len(taus)} values given for replicas={replicas}; give one τ per replica")
    else:
        taus = (tau,) * replicas
    return Schedule(H=H, P=P, taus=taus)
