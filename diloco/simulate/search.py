"""Bandwidth needed for a target compute utilisation: exact threshold and the paper's grid value."""
from __future__ import annotations

import bisect
import dataclasses
import math

import numpy as np

from diloco.simulate.dag import Assumptions, Method, Model, compute_utilisation

# The paper's bandwidth sweep (Gbit/s): numpy.logspace(-1, 3, 50). The papers print a grid value
# x as round(round(x, 2), 1) (Python rounding of binary floats): this reproduces all 44 distinct
# published values, where plain round(x, 1) misses 7 (86.85 -> 86.8, 2.947 -> 3.0, …).
GRID = np.logspace(-1, 3, 50)
GRID_RATIO = float(GRID[1] / GRID[0])  # one grid step, ≈ ×1.207


@dataclasses.dataclass(frozen=True)
class Required:
    """Bandwidth needed to reach a target CU."""

    target_cu: float
    exact_gbit_per_s: float  # bisection threshold; inf if above `hi`
    grid_gbit_per_s: float  # smallest grid value reaching the target; inf if none
    grid_index: int  # index into GRID; len(GRID) if none


def grid_index(gbit_per_s: float, grid: np.ndarray = GRID) -> int:
    """Index of the grid point nearest (in log space) to a printed value; len(grid) for >max."""
    if gbit_per_s > grid[-1] * math.sqrt(GRID_RATIO):
        return len(grid)
    return int(np.argmin(np.abs(np.log(grid) - math.log(gbit_per_s))))


def paper_print(gbit_per_s: float) -> float:
    """How the papers print a bandwidth: rounded to 2 decimals, then to 1."""
    return round(round(float(gbit_per_s), 2), 1)


def printed_indices(printed: float, grid: np.ndarray = GRID) -> list[int]:
    """Grid indices the papers would print as `printed` (0.1, 0.2, 0.3, 0.5 are ambiguous)."""
    hits = [i for i, g in enumerate(grid) if paper_print(g) == round(printed, 1)]
    return hits or [grid_index(printed, grid)]


def bisect_bandwidth(cu_at, target: float, lo: float = 1e-3, hi: float = 1e5, rtol: float = 1e-4) -> float:
    """Smallest bandwidth (Gbit/s) with cu_at(bw) >= target, by bisection in log space."""
    if cu_at(hi) < target:
        return math.inf
    if cu_at(lo) >= target:
        return lo
    while hi / lo > 1 + rtol:
        mid = math.sqrt(lo * hi)
        if cu_at(mid) >= target:
            hi = mid
        else:
            lo = mid
    return hi


def required_bandwidth(
    model: Model,
    method: Method,
    target_cu: float,
    assumptions: Assumptions = Assumptions(),
    exact: bool = True,
) -> Required:
    """Exact threshold (bisection) and the grid value the paper would print."""
    if not 0 < target_cu < 1:
        raise ValueError(f"target_cu={target_cu} must be in (0, 1)")
    cache: dict[float, float] = {}

    def cu_at(bw: float) -> float:
        if bw not in cache:
            cache[bw] = compute_utilisation(model, method, bw, assumptions)
        return cache[bw]

    # smallest grid index reaching the target (CU is monotone in bandwidth); len(GRID) if none
    i = bisect.bisect_left(range(len(GRID)), True, key=lambda j: cu_at(float(GRID[j])) >= target_cu)
    grid_bw = float(GRID[i]) if i < len(GRID) else math.inf
    if exact:
        lo = float(GRID[i - 1]) if 0 < i <= len(GRID) else 1e-3
        hi = grid_bw if i < len(GRID) else 1e5
        ex = bisect_bandwidth(cu_at, target_cu, lo=lo, hi=hi)
    else:
        ex = math.nan
    return Required(target_cu, ex, grid_bw, i)
