"""The per-layer DAG of one training run, scheduled on one compute stream and one WAN link.

Every step has 3L − 1 compute nodes run in a fixed order on one stream,

    fwd(0) … fwd(L−1), [bwd_act(L−1)], bwd_param(L−1), …, bwd_act(1), bwd_param(1), bwd_param(0)

(no backward w.r.t. activations for the first layer), and a communication node per layer
whose values are reduced that step, run first-come first-served on one link. A reduction of
layer l issued after step s starts when bwd_param(l) of step s ends and the link is free; its
result is needed by fwd(l) of step s + 1 + τ. Nothing else waits, so compute and
communication overlap wherever these dependencies allow.

Both resources process their nodes in a fixed order, so every end time follows from the
recurrence e_i = max(e_{i−1}, ready_i) + d_i, evaluated per step with numpy as
e_i = S_i + max(e_0, max_{j≤i}(ready_j − S_{j−1})) (S = running sum of durations).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterator

import numpy as np

from diloco.errors import ConfigError
from diloco.outer.schedule import fragment_offset

PATTERNS = ("strided", "sequential")


@dataclasses.dataclass(frozen=True)
class Model:
    """What the simulator needs of a model: depth, size and the pure-compute step time."""

    name: str
    layers: int
    params: float  # spread evenly over the layers
    step_time_s: float


@dataclasses.dataclass(frozen=True)
class Method:
    """One synchronisation scheme. DP: h=1, P=1, τ=0; DiLoCo: P=1, τ=0; Streaming: P>1."""

    name: str
    h: int = 1
    fragments: int = 1
    tau: int = 0
    bits: float | None = None  # bits per reduced element; None -> Assumptions.bits
    pattern: str = "strided"


@dataclasses.dataclass(frozen=True)
class Assumptions:
    """The simulator's unknowns (docs/simulator.md says why each default was chosen)."""

    bits: float = 16.0  # bits per element of non-quantised traffic (bf16)
    allreduce_factor: float = 1.0  # bytes on the link / payload bytes (ring over M=2: 2(M−1)/M)
    latency_s: float = 0.0  # fixed cost per communication node
    fwd: float = 1.0  # relative cost of fwd : bwd_act : bwd_param per layer
    bwd_act: float = 1.0
    bwd_param: float = 1.0
    param_grad_first: bool = False  # bwd_param(l) before bwd_act(l) in the backward order


@dataclasses.dataclass(frozen=True)
class Node:
    """One scheduled node, for Gantt charts and tests."""

    resource: str  # "compute" | "link"
    kind: str  # fwd | bwd_act | bwd_param | reduce
    step: int
    layer: int
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Result:
    cu: float
    wall_s: float
    compute_s: float
    nodes: tuple[Node, ...] = ()


def validate(model: Model, method: Method, assumptions: Assumptions = Assumptions()) -> None:
    """Raise ConfigError naming the field when the combination is impossible."""
    if model.layers < 1:
        raise ConfigError("layers", f"{model.layers} must be >= 1")
    if not model.params > 0:
        raise ConfigError("params", f"{model.params} must be > 0")
    if not model.step_time_s > 0:
        raise ConfigError("step_time", f"{model.step_time_s} must be > 0 seconds")
    if method.h < 1:
        raise ConfigError("h", f"H={method.h} must be >= 1")
    if not 1 <= method.fragments <= model.layers:
        raise ConfigError("fragments", f"P={method.fragments} must be in 1..layers={model.layers}")
    if not 0 <= method.tau <= method.h:
        raise ConfigError("tau", f"tau={method.tau} must be in 0..H={method.h}")
    if method.bits is not None and not method.bits > 0:
        raise ConfigError("bits", f"{method.bits} must be > 0")
    if method.pattern not in PATTERNS:
        raise ConfigError("pattern", f"{method.pattern!r}; valid: {', '.join(PATTERNS)}")
    if min(assumptions.fwd, assumptions.bwd_act, assumptions.bwd_param) < 0:
        raise ConfigError("split", "fwd/bwd_act/bwd_param weights must be >= 0")


def fragment_layers(layers: int, fragments: int, pattern: str = "strided") -> list[np.ndarray]:
    """Layer indices of each fragment: strided p, p+P, … or sequential blocks."""
    idx = np.arange(layers)
    if pattern == "strided":
        return [idx[p::fragments] for p in range(fragments)]
    return list(np.array_split(idx, fragments))


def fragment_offsets(h: int, fragments: int) -> np.ndarray:
    """t_p (diloco.outer.schedule.fragment_offset, halves up as the trainer): fragment p is reduced after steps
    t_p + k·H."""
    return np.array([fragment_offset(p, h, fragments) for p in range(fragments)], dtype=int)


def layer_times(model: Model, a: Assumptions) -> tuple[float, float, float]:
    """Per-layer (fwd, bwd_act, bwd_param) seconds; the 3L − 1 nodes sum to the step time."""
    total = model.layers * (a.fwd + a.bwd_param) + (model.layers - 1) * a.bwd_act
    unit = model.step_time_s / total
    return a.fwd * unit, a.bwd_act * unit, a.bwd_param * unit


def backward_order(layers: int, param_first: bool = False) -> list[tuple[str, int]]:
    """(kind, layer) of the backward nodes in execution order."""
    order = []
    for l in range(layers - 1, -1, -1):
        pair = [("bwd_act", l), ("bwd_param", l)] if l > 0 else [("bwd_param", l)]
        order += pair[::-1] if param_first and l > 0 else pair
    return order


def _serial(start: float, ready: np.ndarray, dur: np.ndarray) -> np.ndarray:
    """End times of nodes run in order on one resource free from `start`."""
    s = np.cumsum(dur)
    slack = np.maximum.accumulate(ready - (s - dur))
    return s + np.maximum(start, slack)


def reduce_schedule(method: Method, layers: int) -> dict[int, np.ndarray]:
    """Step residue (mod H) -> layers reduced after that step, in backward (descending) order."""
    frags = fragment_layers(layers, method.fragments, method.pattern)
    sched: dict[int, list[int]] = {}
    for p, t_p in enumerate(fragment_offsets(method.h, method.fragments)):
        sched.setdefault(int(t_p) % method.h, []).extend(frags[p].tolist())
    return {k: np.array(sorted(v, reverse=True)) for k, v in sched.items()}


def simulate(
    model: Model,
    method: Method,
    gbit_per_s: float,
    assumptions: Assumptions = Assumptions(),
    periods: int = 2,
    warmup_periods: int = 2,
    trace: bool = False,
) -> Result:
    """Steady-state compute utilisation at a WAN bandwidth of `gbit_per_s` (Gbit/s).

    Runs warmup_periods + periods rounds of H steps (at least τ + 2 steps of warm-up) and
    measures CU = compute time / wall time over the last `periods` rounds.
    """
    validate(model, method, assumptions)
    if not gbit_per_s > 0:
        raise ConfigError("bandwidth", f"{gbit_per_s} Gbit/s must be > 0")
    a = assumptions
    L, T = model.layers, model.step_time_s
    tf, ta, tp = layer_times(model, a)
    bits = a.bits if method.bits is None else method.bits
    comm = model.params / L * bits * a.allreduce_factor / (gbit_per_s * 1e9) + a.latency_s

    bwd = backward_order(L, a.param_grad_first)
    bwd_dur = np.array([ta if k == "bwd_act" else tp for k, _ in bwd])
    bwd_end = np.cumsum(bwd_dur)  # offsets from the start of the backward pass
    grad_ready = np.empty(L)
    for (k, l), e in zip(bwd, bwd_end):
        if k == "bwd_param":
            grad_ready[l] = e
    fwd_dur = np.full(L, tf)

    sched = reduce_schedule(method, L)
    warm_steps = max(warmup_periods * method.h, method.tau + 2)
    n_steps = warm_steps + periods * method.h
    need: dict[int, np.ndarray] = {}  # step -> per-layer time fwd(l) must wait for
    now = link = t0 = 0.0
    nodes: list[Node] = []
    for s in range(1, n_steps + 1):
        f_end = _serial(now, need.pop(s, np.full(L, -math.inf)), fwd_dur)
        b0 = f_end[-1]
        now = b0 + bwd_end[-1]
        layers = sched.get(s % method.h)
        if layers is not None:
            c_end = _serial(link, b0 + grad_ready[layers], np.full(len(layers), comm))
            link = c_end[-1]
            due = need.setdefault(s + 1 + method.tau, np.full(L, -math.inf))
            due[layers] = np.maximum(due[layers], c_end)
        if trace:
            nodes += _trace_step(s, f_end, fwd_dur, b0, bwd, bwd_end, bwd_dur)
            if layers is not None:
                nodes += [Node("link", "reduce", s, int(l), e - comm, e) for l, e in zip(layers, c_end)]
        if s == warm_steps:
            t0 = now
    # Steady state: the link carries a round's reductions once per round, so a round lasts at least
    # the link's busy time. With τ close to H (eager) a saturated link's backlog grows for many rounds
    # before compute waits on it; the bound gives the periodic limit without simulating them.
    link_per_period = sum(len(v) for v in sched.values()) * comm
    wall = max(now - t0, periods * link_per_period)
    compute = periods * method.h * T
    return Result(cu=compute / wall, wall_s=wall, compute_s=compute, nodes=tuple(nodes))


def _trace_step(s, f_end, fwd_dur, b0, bwd, bwd_end, bwd_dur) -> Iterator[Node]:
    for l, (e, d) in enumerate(zip(f_end, fwd_dur)):
        yield Node("compute", "fwd", s, l, float(e - d), float(e))
    for (k, l), e, d in zip(bwd, bwd_end, bwd_dur):
        yield Node("compute", k, s, l, float(b0 + e - d), float(b0 + e))


def compute_utilisation(
    model: Model, method: Method, gbit_per_s: float, assumptions: Assumptions = Assumptions()
) -> float:
    """CU in [0, 1] at `gbit_per_s`."""
    return simulate(model, method, gbit_per_s, assumptions).cu
