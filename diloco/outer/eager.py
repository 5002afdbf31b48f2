"""Eager updates ([EU], arXiv 2502.12996): the exchange of a fragment's round overlaps whole rounds.

Per fragment, round r = 1, 2, … ends at its send step t_p + r·H. Replica m's outer gradient of round r
is Δ_m(r) = θᵍ_m(r−1) − θ_m(end of round r) (its own outer parameters, since they may differ), and
Δ̄(r) = (1/M) Σ_m Δ_m(r). With a delay of D = eager_rounds rounds, Δ̄(r−D) is the newest average that has
arrived at the end of round r. Replica m then steps its own θᵍ_m and its own Nesterov state with

    naive:  g_m(r) = Δ̄(r−D)                                    (the delayed average as is; [EU] Alg. 2)
    swap:   g_m(r) = Δ̄(r−D) + (1/M)(Δ_m(r) − Δ_m(r−D))         (its stale share replaced by its fresh one)
    mix:    g_m(r) = (1/M) Δ_m(r) + ((M−1)/M) Δ̄(r−D)            (one third-party implementation)

and merges θ_m ← α·θ_m + (1−α)·θᵍ_m. Round r ≤ D has no delayed average yet: Δ̄(r−D) = Δ_m(r−D) = 0
(nothing has arrived; swap and mix apply Δ_m(r)/M, naive applies a zero step). Under naive every replica
applies the same g, so θᵍ stays one tree; under swap and mix θᵍ_m and the momentum are per replica.
The mean of the replicas' θᵍ_m is what is evaluated (`consensus`): the Nesterov step is linear in g at a
fixed learning rate, so it is the θᵍ a single optimizer stepping mean_m g_m(r) would hold.

Pure functions (numpy or jax arrays, leading replica axis R) and a float64 reference (`EagerRef`) of
the whole outer loop of one fragment, which the tests check by hand and the trainer against.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from diloco.errors import ConfigError

EAGER_MODES = ("off", "naive", "swap", "mix")
PER_REPLICA_MODES = ("swap", "mix")  # the modes whose θᵍ and Nesterov state differ per replica


def check(mode: str, rounds: int = 1) -> None:
    """ConfigError naming the field when `eager` / `eager_rounds` are not valid."""
    if mode not in EAGER_MODES:
        raise ConfigError("eager", f"{mode!r}; valid: {', '.join(EAGER_MODES)}")
    if isinstance(rounds, bool) or not isinstance(rounds, (int, np.integer)) or rounds < 1:
        raise ConfigError("eager_rounds", f"{rounds!r} must be an integer >= 1 (e.g. --config.eager_rounds=2)")
    if mode == "off" and rounds != 1:
        raise ConfigError("eager_rounds", f"eager_rounds={rounds} needs eager=naive, swap or mix")


def per_replica(mode: str) -> bool:
    """Whether θᵍ and the outer optimizer state are kept per replica under `mode`."""
    return mode in PER_REPLICA_MODES


def applied(mode: str, fresh_Rxn, delayed_avg_n, delayed_own_Rxn):
    """g_m(r), (R, n): what replica m steps its θᵍ_m with at the end of round r.

    fresh_Rxn: Δ_m(r); delayed_avg_n: Δ̄(r−D) (zeros before it exists); delayed_own_Rxn: Δ_m(r−D), the
    replica's own contribution to that average (zeros before it exists). M = R."""
    M = fresh_Rxn.shape[0]
    if mode == "naive":
        return delayed_avg_n[None] + 0 * fresh_Rxn
    if mode == "swap":
        return delayed_avg_n[None] + (fresh_Rxn - delayed_own_Rxn) / M
    if mode == "mix":
        return fresh_Rxn / M + (M - 1) / M * delayed_avg_n[None]
    raise ConfigError("eager", f"{mode!r}: applied() takes naive, swap or mix")


def eval_params_label(mode: str) -> str:
    """What a run evaluates (summary.json `eval_params`)."""
    return "mean of the replicas' outer parameters" if per_replica(mode) else "outer parameters"


def consensus(outer_Rxn):
    """The evaluated θᵍ when replicas' outer parameters differ: their mean over the replica axis."""
    return outer_Rxn.mean(axis=0)


def nesterov(theta, mom, g, lr: float, momentum: float):
    """optax.sgd(lr, momentum, nesterov=True) on one step: m ← g + μm; θ ← θ − lr·(g + μm)."""
    mom = g + momentum * mom
    return theta - lr * (g + momentum * mom), mom


def adam(theta, state, g, lr: float, momentum: float, b2: float = 0.999, eps: float = 1e-8):
    """optax.adam(lr, b1=momentum, b2, eps) on one step; state (m, v, t), 0 at the start."""
    m, v, t = state if isinstance(state, tuple) else (0.0 * g, 0.0 * g, 0)
    m, v, t = momentum * m + (1 - momentum) * g, b2 * v + (1 - b2) * g * g, t + 1
    return theta - lr * (m / (1 - momentum ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps), (m, v, t)


@dataclasses.dataclass
class EagerRef:
    """Float64 reference of one fragment's outer loop under an eager mode (M replicas, shape (n,)).

    round(local_R) takes every replica's θ_m at the end of a round and returns the θ_m they continue
    from (after the merge); `outer` (R, n), `mom` (R, n), `sent` (the Δ_m of each finished round) and
    `applied_log` (g_m per round) are kept for inspection."""

    mode: str
    theta0: np.ndarray
    M: int
    lr: float = 0.7
    momentum: float = 0.9
    alpha: float = 0.0
    rounds: int = 1  # D: the delay in rounds
    step: Callable = nesterov  # the outer optimizer's step (theta, state, g, lr, momentum) → (theta, state)

    def __post_init__(self):
        check(self.mode, self.rounds)
        if self.mode == "off":
            raise ConfigError("eager", "EagerRef models naive, swap or mix")
        t = np.asarray(self.theta0, np.float64)
        self.outer = np.broadcast_to(t, (self.M,) + t.shape).copy()
        self.mom = np.zeros_like(self.outer)
        self.sent: list[np.ndarray] = []
        self.applied_log: list[np.ndarray] = []

    def round(self, local_R) -> np.ndarray:
        local_R = np.asarray(local_R, np.float64)
        fresh = self.outer - local_R
        r = len(self.sent) + 1
        if r > self.rounds:
            own = self.sent[r - 1 - self.rounds]
            avg = own.mean(axis=0)
        else:
            own = np.zeros_like(fresh)
            avg = np.zeros(fresh.shape[1:])
        self.sent.append(fresh)
        g = applied(self.mode, fresh, avg, own)
        self.applied_log.append(g)
        self.outer, self.mom = self.step(self.outer, self.mom, g, self.lr, self.momentum)
        return self.alpha * local_R + (1 - self.alpha) * self.outer

    def in_flight(self) -> list[np.ndarray]:
        """The Δ_m (R, n) of the last D rounds, sent and not yet averaged into anyone's step."""
        return self.sent[len(self.sent) - self.rounds:] if self.sent else []
