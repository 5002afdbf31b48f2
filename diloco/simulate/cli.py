"""`diloco simulate`: compute utilisation of DP / DiLoCo / Streaming DiLoCo over a WAN link.

  diloco simulate --model 10B --method streaming_ovl_fp4 --bandwidth 1,2,5
  diloco simulate --model custom --layers 80 --params 70B --step-time 3 --method diloco --target-cu 95
  diloco simulate --paper-table --out results/simulator        # [SD] Table 4 + [EU] + [SL] rows
  diloco simulate --plots results/simulator                      # Fig. 4, Fig. 9, Fig. 3
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

from diloco.errors import ConfigError
from diloco.outer import methods
from diloco.simulate import paper
from diloco.simulate.dag import PATTERNS, Assumptions, Method, Model, simulate
from diloco.simulate.presets import (
    CALIBRATIONS,
    EAGER,
    EAGER_BASE,
    MODELS,
    allreduce_factor,
    assumptions_for,
    kaplan_step_time,
    known_model_names,
    make_method,
    parse_count,
    scale_model,
)
from diloco.simulate.search import GRID, paper_print, printed_indices, required_bandwidth

DEFAULT_TARGETS = "50,80,90,95,99"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="diloco simulate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("model")
    g.add_argument("--model", default="1B", help=f"1B|10B|100B|<scale>|custom (presets: {', '.join(MODELS)})")
    g.add_argument("--layers", type=int, help="transformer blocks (custom)")
    g.add_argument("--params", help="parameter count, e.g. 7e9 or 7B (custom; overrides a scale's count)")
    g.add_argument("--step-time", type=float, help="pure-compute seconds per step (required for scales/custom)")
    g.add_argument("--tokens-per-step", type=float, help="…or derive the step time by the Kaplan rule from these four")
    g.add_argument("--chips", type=int)
    g.add_argument("--chip-tflops", type=float, help="peak TFLOP/s per chip")
    g.add_argument("--mfu", type=float, default=0.6, help="model FLOPs utilisation (default 0.6, as the paper)")
    g.add_argument("--vocab-size", type=int, default=32000)
    g = ap.add_argument_group("method")
    g.add_argument("--method", default="streaming_ovl_fp4", help="|".join(methods.VARIANTS) + " (diloco/outer/methods.py), or "
                   f"{EAGER} ([EU] 1-outer-step eager overlap: {EAGER_BASE} with tau = H)")
    g.add_argument("--h", type=int, default=100, help="inner steps per outer round H (default 100)")
    g.add_argument("--fragments", type=int, help="number of fragments P (default: layers / layers-per-fragment)")
    g.add_argument("--layers-per-fragment", type=int, default=3)
    g.add_argument("--tau", type=int, help="overlap in inner steps (default 1 for overlapped methods, else 0)")
    g.add_argument("--bits", type=float, help="bits per reduced element (default 4 for fp4, else --payload-bits)")
    g.add_argument("--pattern", default="strided", help="|".join(PATTERNS))
    g = ap.add_argument_group("query")
    g.add_argument("--bandwidth", help="Gbit/s, comma-separated: print CU at each")
    g.add_argument("--target-cu", help=f"targets in %% or fractions (default {DEFAULT_TARGETS}): print Gbit/s needed")
    g.add_argument("--paper-table", action="store_true", help="regenerate [SD] Table 4 (+[EU] inner, [SL] DiLoCo rows)")
    g.add_argument("--sources", default="sd,eu,sl", help="which papers' rows for --paper-table: sd,eu,sl")
    g.add_argument("--paper-csv", help="published values (default results/paper/compute_utilization.csv)")
    g.add_argument("--out", help="with --paper-table: write paper_table.{md,csv,json} into this folder")
    g.add_argument("--plots", help="write Fig. 4 / Fig. 9 / Fig. 3 PNGs into this folder")
    g.add_argument("--gantt", help="write a Gantt chart PNG of the chosen model/method at --bandwidth")
    g.add_argument("--gantt-steps", type=int, default=4)
    g.add_argument("--json", action="store_true", help="machine-readable output")
    g = ap.add_argument_group("assumptions (docs/simulator.md)")
    g.add_argument("--calibration", default="paper", help="paper (fitted to Table 4) | physical")
    g.add_argument("--payload-bits", type=float, help="bits per element of non-FP4 traffic (default 16, bf16)")
    g.add_argument("--traffic-factor", type=float, help="link bits per payload bit (paper 0.84, physical 1.0)")
    g.add_argument("--replicas", type=int, help="set --traffic-factor to a ring all-reduce's 2(M−1)/M")
    g.add_argument("--latency", type=float, help="seconds per communication node (default 0)")
    g.add_argument("--split", help="fwd:bwd_act:bwd_param relative cost per layer (default 1:1:1)")
    g.add_argument("--param-grad-first", action="store_true", help="bwd_param before bwd_act in backward")
    return ap


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        return run(args)
    except ConfigError as e:
        print(f"diloco simulate: --{e.field.replace('_', '-')}: {str(e).split(': ', 1)[1]}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    a = build_assumptions(args)
    if args.paper_table:
        return paper_table(args, a)
    if args.plots:
        return write_plots(Path(args.plots), a)
    model = build_model(args)
    method = build_method(args, model)
    if args.gantt:
        from diloco.simulate.plots import plot_gantt

        bw = parse_floats(args.bandwidth or "1", "bandwidth")[0]
        title = f"{model.name}, {method.name}, {bw:g} Gbit/s"
        first = max(1, method.h - 1) if method.h > 1 else 1
        print(plot_gantt(args.gantt, [(title, model, method, bw)], a, args.gantt_steps, first=first))
        return 0
    rows = []
    if args.bandwidth:
        for bw in parse_floats(args.bandwidth, "bandwidth"):
            rows.append({**describe(model, method), "gbit_per_s": bw, "cu": simulate(model, method, bw, a).cu})
    if args.target_cu or not args.bandwidth:
        for t in parse_targets(args.target_cu or DEFAULT_TARGETS):
            req = required_bandwidth(model, method, t, a)
            row = {**describe(model, method), "target_cu": t, "gbit_per_s": _num(req.grid_gbit_per_s),
                   "exact_gbit_per_s": _num(req.exact_gbit_per_s)}
            if (closed_form := paper.analytic_bandwidth(model, method, t, a)) is not None:
                row["analytic_gbit_per_s"] = _num(closed_form)
            rows.append(row)
    if args.json:
        print(json.dumps({"assumptions": dataclasses.asdict(a), "params_source": params_source(args), "rows": rows},
                         indent=1))
    else:
        print(f"# {model.name}: {model.layers} layers, {model.params:.4g} params ({params_source(args)}), "
              f"{model.step_time_s:g} s/step; "
              f"{method.name} H={method.h} P={method.fragments} tau={method.tau} bits={method.bits or a.bits:g} {method.pattern}")
        for r in rows:
            if "cu" in r:
                print(f"{r['gbit_per_s']:>10g} Gbit/s -> CU {100 * r['cu']:.2f}%")
            else:
                extra = f"  analytic {paper.fmt(_inf(r['analytic_gbit_per_s']))}" if "analytic_gbit_per_s" in r else ""
                print(f"CU {100 * r['target_cu']:>5g}% needs {paper.fmt(_inf(r['exact_gbit_per_s'])):>7} Gbit/s "
                      f"(grid {paper.fmt(_inf(r['gbit_per_s']))}){extra}")
    return 0


def params_source(args) -> str:
    """Which parameter count the simulation uses, said beside it (`diloco sizes` counts differently)."""
    if args.params:
        return "--params"
    if args.model in MODELS:
        from diloco.model import scales

        if args.model not in scales.SCALES:
            return "nominal: the paper's size"
        ours = scales.formula_params(args.model, scales.padded_vocab(scales.run_vocab(args.model)[1]))
        return (f"nominal: the paper's Table 4 size; our {args.model} scale has ≈{ours / 1e9:.3g}B "
                f"(`diloco sizes`): --params {ours / 1e9:.3g}B to use it")
    if args.model == "custom":
        return "--params"
    return f"12·L·d² + V·d at vocab {args.vocab_size:,}, embeddings included"


def build_assumptions(args) -> Assumptions:
    if args.calibration not in CALIBRATIONS:
        raise ConfigError("calibration", f"{args.calibration!r}; valid: {', '.join(CALIBRATIONS)}")
    factor = args.traffic_factor
    if args.replicas is not None:
        factor = allreduce_factor(args.replicas)
    split = {}
    if args.split:
        parts = args.split.split(":")
        if len(parts) != 3:
            raise ConfigError("split", f"{args.split!r} must be three numbers fwd:bwd_act:bwd_param, e.g. 1:1:1")
        f, ba, bp = parse_floats(",".join(parts), "split")
        if min(f, ba, bp) < 0 or f + ba + bp <= 0:
            raise ConfigError("split", f"{args.split!r} must be non-negative and not all zero")
        split = {"fwd": f, "bwd_act": ba, "bwd_param": bp}
    for name, v in (("payload_bits", args.payload_bits), ("traffic_factor", factor)):
        if v is not None and not v > 0:
            raise ConfigError(name, f"{v} must be > 0")
    if args.latency is not None and args.latency < 0:
        raise ConfigError("latency", f"{args.latency} must be >= 0 seconds")
    return assumptions_for(args.calibration, bits=args.payload_bits, allreduce_factor=factor, latency_s=args.latency,
                           param_grad_first=args.param_grad_first or None, **split)


def build_model(args) -> Model:
    name = args.model
    if name in MODELS and not (args.layers or args.params or args.step_time):
        return MODELS[name]
    if name == "custom" or name in MODELS:
        base = MODELS.get(name)
        layers = args.layers or (base.layers if base else None)
        if layers is None:
            raise ConfigError("layers", "--model custom needs --layers, --params and --step-time")
        if args.params is None and base is None:
            raise ConfigError("params", "--model custom needs --params (e.g. 7e9 or 7B)")
        params = parse_count(args.params) if args.params else base.params
        step = step_time(args, params) or (base.step_time_s if base else None)
        if step is None:
            raise ConfigError("step_time", "--model custom needs --step-time SECONDS (or the Kaplan flags)")
        return Model(name, layers=layers, params=params, step_time_s=step)
    if name not in known_model_names():
        raise ConfigError("model", f"unknown model {name!r}; valid: {', '.join(known_model_names())}")
    params = parse_count(args.params) if args.params else None
    step = step_time(args, params)
    if step is None:
        # The parameter count is only needed first for the Kaplan rule; resolve it, then retry.
        step = step_time(args, scale_model(name, 1.0, args.vocab_size).params)
    if step is None:
        raise ConfigError("step_time", f"--model {name} needs --step-time SECONDS (or --tokens-per-step/--chips/--chip-tflops)")
    m = scale_model(name, step, args.vocab_size)
    return dataclasses.replace(m, layers=args.layers or m.layers, params=params or m.params)


def step_time(args, params: float | None) -> float | None:
    if args.step_time is not None:
        if not args.step_time > 0:
            raise ConfigError("step_time", f"{args.step_time} must be > 0 seconds")
        return args.step_time
    kaplan = (args.tokens_per_step, args.chips, args.chip_tflops)
    if all(v is not None for v in kaplan) and params is not None:
        if min(kaplan) <= 0 or not 0 < args.mfu <= 1:
            raise ConfigError("tokens_per_step", "tokens-per-step, chips, chip-tflops must be > 0 and mfu in (0, 1]")
        return kaplan_step_time(params, *kaplan, mfu=args.mfu)
    return None


def build_method(args, model: Model) -> Method:
    if args.layers_per_fragment < 1:
        raise ConfigError("layers_per_fragment", f"{args.layers_per_fragment} must be >= 1")
    return make_method(args.method, model.layers, h=args.h, fragments=args.fragments,
                       layers_per_fragment=args.layers_per_fragment, tau=args.tau, bits=args.bits, pattern=args.pattern)


def describe(model: Model, method: Method) -> dict:
    return {"model": model.name, "method": method.name, "h": method.h, "fragments": method.fragments,
            "tau": method.tau, "bits": method.bits}


def parse_floats(text: str, field: str) -> list[float]:
    try:
        vals = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(field, f"{text!r} must be comma-separated numbers") from None
    if not vals:
        raise ConfigError(field, "needs at least one number")
    if field == "bandwidth" and min(vals) <= 0:
        raise ConfigError(field, f"{text!r}: Gbit/s must be > 0")
    return vals


def parse_targets(text: str) -> list[float]:
    """'95' or '0.95' -> 0.95; every target must lie strictly between 0 and 100%."""
    out = []
    for v in parse_floats(text, "target_cu"):
        t = v / 100 if v > 1 else v
        if not 0 < t < 1:
            raise ConfigError("target_cu", f"{v:g} must be in (0, 100) percent or (0, 1)")
        out.append(t)
    return out


def _num(x: float) -> float | None:
    return None if math.isinf(x) or math.isnan(x) else x


def _inf(x: float | None) -> float:
    return math.inf if x is None else x


def paper_table(args, a: Assumptions) -> int:
    sources = tuple(s.strip() for s in args.sources.split(",") if s.strip())
    bad = [s for s in sources if s not in paper.SOURCES]
    if bad or not sources:
        raise ConfigError("sources", f"{args.sources!r}; valid: {', '.join(paper.SOURCES)} (comma-separated)")
    t0 = time.perf_counter()
    cells = paper.regenerate(a, sources, args.paper_csv)
    secs = time.perf_counter() - t0
    rows = [cell_row(c) for c in cells]
    md = markdown(cells, a, secs)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "paper_table.md").write_text(md)
        (out / "paper_table.json").write_text(json.dumps({"assumptions": dataclasses.asdict(a), "rows": rows}, indent=1) + "\n")
        with open(out / "paper_table.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    if args.json:
        print(json.dumps({"assumptions": dataclasses.asdict(a), "params_source": params_source(args), "rows": rows},
                         indent=1))
    else:
        print(md)
    return 0


def cell_row(c: paper.Cell) -> dict:
    return {
        "source": c.source, "model": c.model, "method": c.method, "h": c.h, "target_cu": c.target_cu,
        "gbit_per_s": _print(c.gbit_per_s), "exact_gbit_per_s": _round(c.exact_gbit_per_s),
        "paper_gbit_per_s": c.paper_gbit_per_s, "grid_steps_off": c.steps_off, "match": c.match,
        "analytic_gbit_per_s": _round(c.analytic_gbit_per_s) if c.analytic_gbit_per_s is not None else None,
    }


def _print(x: float) -> float | None:
    return None if math.isinf(x) else paper_print(x)


def _round(x: float) -> float | None:
    return None if math.isinf(x) or math.isnan(x) else round(x, 3)


def markdown(cells: list[paper.Cell], a: Assumptions, secs: float) -> str:
    """One section per source: ours (grid) / paper per cell, and the score."""
    lines = [
        "# Compute utilisation: Gbit/s needed for a target CU, simulated beside the published values",
        "",
        f"Assumptions: {dataclasses.asdict(a)}. Grid: numpy.logspace(-1, 3, 50). "
        f"Cell = ours (grid value) / paper; `exact` = same grid point, `±1` = one grid step (×1.207) off. "
        f"Regenerated in {secs:.1f} s by `diloco simulate --paper-table --out results/simulator`.",
    ]
    for src in dict.fromkeys(c.source for c in cells):
        sub = [c for c in cells if c.source == src]
        s = paper.score(sub)
        lines += ["", f"## {src}: {s['exact']} exact, {s['within_one']} within one grid step, of {s['total']} cells", ""]
        targets = sorted({c.target_cu for c in sub})
        groups: dict[tuple, list[paper.Cell]] = {}
        for c in sub:
            groups.setdefault((c.model, c.method, c.h), []).append(c)
        rows = []
        for (model, method, h), cs in groups.items():
            by_t = {c.target_cu: c for c in cs}
            rows.append({"model": model, "method": method, "H": h or "",
                         **{f"{100 * t:g}%": f"{paper.fmt(by_t[t].gbit_per_s)} / {paper.fmt(by_t[t].paper_gbit_per_s)}"
                            if t in by_t else "" for t in targets},
                         "match": " ".join(f"{c.steps_off:+d}" for c in cs)})
        lines.append(_md(rows))
        lines += misses(sub, a)
    return "\n".join(lines) + "\n"


def misses(cells: list[paper.Cell], a: Assumptions) -> list[str]:
    """Non-exact cells, with the traffic factor that would land each on the paper's grid point.

    With zero latency CU depends on bandwidth only through traffic_factor / bandwidth, so the exact
    threshold scales linearly with the factor; the paper's printed value v (grid index k) needs a
    threshold in (GRID[k−1], GRID[k]].
    """
    off = [c for c in cells if c.steps_off != 0]
    if not off:
        return []
    rows = []
    for c in off:
        rng = ""
        if a.latency_s == 0 and math.isfinite(c.exact_gbit_per_s):
            ks = printed_indices(c.paper_gbit_per_s)
            lo = GRID[min(ks) - 1] if min(ks) > 0 else 0.0
            hi = GRID[max(ks)]
            f = a.allreduce_factor / c.exact_gbit_per_s
            rng = f"({lo * f:.3f}, {hi * f:.3f}]"
        rows.append({"model": c.model, "method": c.method, "target": f"{100 * c.target_cu:g}%",
                     "ours": paper.fmt(c.gbit_per_s), "exact": f"{c.exact_gbit_per_s:.3f}",
                     "paper": paper.fmt(c.paper_gbit_per_s), "off": f"{c.steps_off:+d}",
                     "factor range that matches": rng})
    return ["", "Cells off the paper's grid point (exact = our bisection threshold; the last column is the "
            "traffic factor range that would put this cell on the paper's value, all else equal):", "", _md(rows)]


def _md(rows: list[dict]) -> str:
    """A markdown table of already formatted cells (pandas + tabulate; numbers are not re-parsed)."""
    import pandas as pd  # lazy: the simulator's other paths do not need pandas

    return pd.DataFrame(rows).to_markdown(index=False, disable_numparse=True)


def write_plots(folder: Path, a: Assumptions) -> int:
    from diloco.simulate import plots
    from diloco.simulate.presets import PHYSICAL

    print(plots.plot_cu_vs_bandwidth(folder / "fig4_cu_vs_bandwidth.png", a=a))
    print(plots.plot_cu_vs_tau(folder / "fig9_cu_vs_tau_100B.png", a=a))
    print(plots.plot_gantt(folder / "fig3_gantt_toy.png", plots.toy_gantt_runs(), PHYSICAL, steps=4))
    m = MODELS["1B"]
    runs = [(f"1B, {methods.VARIANTS[k].title}, {'100' if k == 'dp' else '2'} Gbit/s", m,
             make_method(k, m.layers, h=100), 100.0 if k == "dp" else 2.0) for k in methods.PAPER_VARIANTS]
    print(plots.plot_gantt(folder / "fig3_gantt_1B.png", runs, a, steps=3, first=99))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
