"""The closed-form compute utilisation of the scaling-laws paper ([SL] App. A), for cross-checks of the
simulator: one cross-datacenter reduction every H steps, never overlapped, CU = H·T / (H·T + comm) with
comm = N·bits / W + ε, and its inverse, the bandwidth W at which CU reaches a target.
"""
from __future__ import annotations

import math

from diloco.simulate.dag import Model


def cu(model: Model, h: int, gbit_per_s: float, link_bits_per_param: float = 16.0, latency_s: float = 0.0) -> float:
    """CU of one cross-datacenter reduction every H steps, never overlapped: H·T / (H·T + comm)."""
    comm = model.params * link_bits_per_param / (gbit_per_s * 1e9) + latency_s
    return h * model.step_time_s / (h * model.step_time_s + comm)


def required_bandwidth(
    model: Model, h: int, target_cu: float, link_bits_per_param: float = 16.0, latency_s: float = 0.0
) -> float:
    """Closed-form inverse of `cu`: the Gbit/s at which CU = target (inf if latency alone is too much)."""
    budget = h * model.step_time_s * (1 / target_cu - 1) - latency_s
    if budget <= 0:
        return math.inf
    return model.params * link_bits_per_param / budget / 1e9
