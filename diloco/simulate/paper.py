"""Regenerate the papers' "Gbit/s needed for a target CU" tables beside the published values."""
from __future__ import annotations

import csv
import dataclasses
import math
from pathlib import Path

from diloco.errors import ConfigError
from diloco.outer import methods
from diloco.simulate import analytic
from diloco.simulate.dag import Assumptions, Method, Model
from diloco.simulate.presets import EAGER, MODELS, PAPER, make_method
from diloco.simulate.search import GRID, paper_print, printed_indices, required_bandwidth

SOURCES = {
    "sd": "streaming_diloco_v1:table4",  # the 75 cells of [SD] Table 4
    "eu": "eager_updates_v1:table5",  # [EU] Table 5: "inner" (τ = 1) and "outer" (eager, τ = H) rows
    "sl": "scaling_laws_v1:table6",  # [SL] Table 6 DiLoCo-H rows
}
CSV_NAME = "results/paper/compute_utilization.csv"


@dataclasses.dataclass(frozen=True)
class Cell:
    source: str
    model: str
    method: str  # the CSV label, e.g. streaming_ovl_fp4_h100
    h: int | None
    target_cu: float
    gbit_per_s: float  # our grid value (as the paper would print it); inf above the grid
    exact_gbit_per_s: float  # our bisection threshold
    paper_gbit_per_s: float
    steps_off: int  # our grid index − the paper's
    analytic_gbit_per_s: float | None = None  # [SL] App. A estimate (DP and DiLoCo rows)

    @property
    def match(self) -> str:
        if self.steps_off == 0:
            return "exact"
        return "±1" if abs(self.steps_off) == 1 else f"miss ({self.steps_off:+d})"


def find_csv(path: str | Path | None = None) -> Path:
    """The published-values CSV: `path`, ./results/paper/…, or the repository's copy."""
    candidates = [Path(path)] if path else [Path.cwd() / CSV_NAME, Path(__file__).resolve().parents[2] / CSV_NAME]
    for c in candidates:
        if c.is_file():
            return c
    raise ConfigError("paper_csv", f"cannot find {CSV_NAME}; pass --paper-csv PATH")


def read_rows(path: str | Path | None = None, sources: tuple[str, ...] = ("sd", "eu", "sl")) -> list[dict]:
    """Published rows of the chosen sources."""
    wanted = {SOURCES[s] for s in sources}
    with open(find_csv(path), newline="") as f:
        return [r for r in csv.DictReader(f) if r["source"] in wanted]


def method_for(label: str, h: int | None, model: Model) -> Method:
    """CSV method label -> simulator Method of its variant (3 layers per fragment, τ=1 when overlapped;
    `streaming_eager_h<H>` is Streaming + FP4 with τ = H)."""
    if methods.split_h(label)[0] == EAGER:
        return make_method(EAGER, model.layers, h=h or 1)
    variant, _ = methods.from_paper_label(label)
    return make_method(variant.name, model.layers, h=h or 1)


def steps_off(ours: int, row: dict) -> int:
    """Our grid index minus the nearest index the paper's printed value can stand for."""
    candidates = printed_indices(float(row["gbit_per_s"]))
    if "1000.0+" in row.get("note", "") and ours >= min(candidates):  # printed as a lower bound
        return 0
    return min((ours - c for c in candidates), key=abs)


def regenerate(
    assumptions: Assumptions = PAPER,
    sources: tuple[str, ...] = ("sd", "eu", "sl"),
    path: str | Path | None = None,
    exact: bool = True,
) -> list[Cell]:
    """One Cell per published (model, method, H, target) row."""
    cells = []
    for r in read_rows(path, sources):
        model = MODELS[r["model"]]
        h = int(float(r["h"])) if r["h"] else None
        method = method_for(r["method"], h, model)
        target = float(r["target_cu"])
        req = required_bandwidth(model, method, target, assumptions, exact=exact)
        cells.append(
            Cell(
                source=r["source"],
                model=r["model"],
                method=r["method"],
                h=h,
                target_cu=target,
                gbit_per_s=req.grid_gbit_per_s,
                exact_gbit_per_s=req.exact_gbit_per_s,
                paper_gbit_per_s=float(r["gbit_per_s"]),
                steps_off=steps_off(req.grid_index, r),
                analytic_gbit_per_s=analytic_bandwidth(model, method, target, assumptions),
            )
        )
    return cells


def analytic_bandwidth(model: Model, method: Method, target: float, a: Assumptions) -> float | None:
    """[SL] App. A's closed-form Gbit/s for methods it covers (one fragment, no overlap), else None."""
    if method.fragments != 1 or method.tau != 0:
        return None
    bits = a.bits if method.bits is None else method.bits
    return analytic.required_bandwidth(model, method.h, target, bits * a.allreduce_factor, a.latency_s)


def score(cells: list[Cell]) -> dict[str, int]:
    """Counts of exact, within-one-step and total cells."""
    return {
        "exact": sum(c.steps_off == 0 for c in cells),
        "within_one": sum(abs(c.steps_off) <= 1 for c in cells),
        "total": len(cells),
    }


def fmt(x: float | None) -> str:
    """One decimal as the papers print (round to 2 decimals, then 1); '>1000' above the grid."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    return f">{GRID[-1]:.0f}" if math.isinf(x) else f"{paper_print(x):.1f}"
