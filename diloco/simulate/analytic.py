"""The analytic wall-clock model of the scaling-laws paper ([SL] App. A), for cross-checks.

No overlap: wall = compute + communication, with
    compute            = 6·N·D / (R·Q)
    all-reduce (once)  = 2·N·(1 − 1/R) / W + ε              (bandwidth-optimal ring)
    DP                 = [2N(1 − 1/R)/W1 + ε1] · T
    DiLoCo, M = 1      = DP × (1 + 1/H)
    DiLoCo, M ≥ 2      = [2N(1 − M/R)/W0 + ε0] · T + [2N(1 − 1/R)/W1 + ε1] · T/H
N counts bits on the wire here (parameters × bits per parameter).
"""
from __future__ import annotations

import dataclasses
import math

from diloco.simulate.dag import Model


@dataclasses.dataclass(frozen=True)
class Network:
    gbit_per_s: float
    latency_s: float


# [SL] App. A: inside a datacenter the network is always "high".
NETWORKS = {
    "high": Network(400.0, 1e-4),
    "medium": Network(100.0, 1e-3),
    "low": Network(10.0, 1e-2),
}
CHIP_FLOPS = 300e12  # [SL]: per-chip throughput Q between TPU v5e and v6e at 50% utilisation


def allreduce_s(bits: float, nodes: int, net: Network) -> float:
    """Bandwidth-optimal all-reduce of `bits` over `nodes` participants."""
    return 2 * bits * (1 - 1 / nodes) / (net.gbit_per_s * 1e9) + net.latency_s


def compute_s(params: float, tokens: float, chips: int, chip_flops: float = CHIP_FLOPS) -> float:
    """6·N·D / (R·Q)."""
    return 6 * params * tokens / (chips * chip_flops)


def wall_clock_s(
    params: float,
    tokens: float,
    steps: int,
    chips: int,
    method: str = "dp",
    h: int = 1,
    replicas: int = 1,
    cross: Network = NETWORKS["low"],
    inside: Network = NETWORKS["high"],
    bits_per_param: float = 16.0,
    chip_flops: float = CHIP_FLOPS,
) -> dict[str, float]:
    """{'compute_s', 'comm_s', 'total_s'} of a run of `steps` steps under [SL]'s bounds."""
    if method not in ("dp", "diloco"):
        raise ValueError(f"method={method!r}; valid: dp, diloco")
    bits = params * bits_per_param
    comp = compute_s(params, tokens, chips, chip_flops)
    if method == "dp":
        comm = allreduce_s(bits, chips, cross) * steps
    elif replicas == 1:
        comm = allreduce_s(bits, chips, cross) * steps * (1 + 1 / h)
    else:
        inner = (2 * bits * (1 - replicas / chips) / (inside.gbit_per_s * 1e9) + inside.latency_s) * steps
        comm = inner + allreduce_s(bits, chips, cross) * steps / h
    return {"compute_s": comp, "comm_s": comm, "total_s": comp + comm}


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
