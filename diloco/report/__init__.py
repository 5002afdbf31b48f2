"""`diloco tables --root DIR --out results/`: run records → pandas → the paper's tables (ours beside
theirs, with the difference), bytes tables, loss curves and ablation plots. Reads only
config.json / summary.json / metrics.jsonl / point.json / failed.json; regenerating takes seconds
(Table 3 evaluates a checkpoint once and caches which_params.json in its workdir).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pandas as pd

from diloco.errors import ConfigError
from diloco.report.claims import claims_table, write_claims
from diloco.report.compare import NOTES as COMPARE_NOTES, compare_table, parse_ref
from diloco.report.judge import verdict
from diloco.report.plots import plot_ablation, plot_loss_curves
from diloco.report.records import POWER, PAPER_DIR, collapse, load_runs, read_json
from diloco.report.tables import (ABLATION_RESULT_COLS, PAPER_SAYS, ablation_table, bytes_table, eager_table2,
                                  eager_table3, eval_noise, table1, table3, table3_outer_lr, table5, table6,
                                  which_params_eval)
from diloco.report.write import KEYS, compare_committed, markdown, write_if_changed, write_table

# the names other code and the tests use as `report.<name>`, besides build and main
__all__ = ["build", "Built", "main", "PAPER_DIR", "load_runs", "markdown", "which_params_eval",
           "ablation_table", "plot_ablation", "verdict"]


@dataclass(frozen=True)
class Built:
    """What `build` did: the files it wrote (or found unchanged) and, per table, the numbers that differ
    from the committed ones at the printed precision ('table: key: committed → now')."""
    files: list[Path]
    changed: list[str] = field(default_factory=list)


SEEDS_NOTE = ("Rows are settings over their seeds: `eval_loss` is mean ± sample std over `n` seeds; gaps are "
              "paired by seed, ± twice their standard error (a gap is a difference only when it exceeds "
              "that; with n = 1 no uncertainty is printed and none is claimed).")


def paper_tables(df: pd.DataFrame) -> list[tuple]:
    """(file name, title, table function of the collapsed records, sweep prefixes, notes) of the paper's tables."""
    return [("table5_c4_scaling", "[SD] Table 5 — C4 scaling: ours beside the paper", table5, ("c4_scaling",),
             "Eval loss and gap to Data-Parallel (DP) at the same scale. Toy scales are compared with the paper's "
             "smallest scale (35M) and the range of its gaps over 35M…4B; absolute losses are comparable only at "
             "the paper's scales. `dp_bytes_over_ours`: DP's total bytes / this run's; `diloco_peak_over_ours`: "
             "DiLoCo's peak bytes per sync / this run's. Toy twins run H/3 (30→10, 100→33); `H` is the run's."),
            ("table6_replicas_h", "[SD] Table 6 — Streaming DiLoCo overlapped FP4 at M × H", table6,
             ("replicas_h", "c4_scaling"),
             "Relative to M=2, H=30 of the same scale (paper: same, at its scale or at 35M for toy runs)."),
            ("table1_dolma_overtraining", "[SD] Table 1/7 — over-training", table1, ("dolma",),
             "Gap to DP at the same token budget, and DP's bytes over ours: summed over replicas, and per replica "
             "(`dp_over_ours_per_replica`, the paper's convention: its `paper_dp_over_ours` is the TB-exchanged "
             "ratio). Toy twins: 1×/4×/10× a 100-step tiny budget, H=100 → 33."),
            ("table3_which_params", "[SD] Table 3 — which parameters to evaluate", table3, ("which_params",),
             "Eval loss of the first replica, the replica average and the outer parameters θ^g, from the run's "
             "last checkpoint (θ^g drained: fragments in flight applied)."),
            ("table3_outer_lr", "[SD] Table 3 at the claims budget, by outer lr",
             partial(table3_outer_lr, run_records=df), ("claims_table3",),
             "The final method (Streaming, overlap τ=1, FP4, α=0.5, H=10) at outer lr 0.1 (tuned), 0.4 (the "
             "paper's) and 1.0; `outer_params`: θ^g's eval loss (drained). Gaps are paired by seed, ± twice "
             "their standard error: `first_vs_outer_pct` is Table 3's comparison, `first_vs_avg_pct` the "
             "replicas' spread (paper: first replica 2.77, replica average 2.68: +3.36 %)."),
            ("table2_eager", "[EU] Table 2 — overlapping a whole outer round (DiLoCo): ours beside [EU]",
             eager_table2, ("eager_table2",),
             "[EU] (arXiv 2502.12996) Table 2: 500M, H = 30, M = 2; ours: sweeps/eager.py:table2 (experiments/"
             "eager.py rows; toy H = 10). `vs_none_pct`: gap to no overlap, paired by seed. [EU]'s one eager "
             "formula is read two ways (swap, mix: docs/architecture.md), both beside its eager row; "
             "naive_lowlr is outer lr 0.2 ([EU]'s lowered value is not stated)."),
            ("table3_eager", "[EU] Table 3 — eager on DiLoCo vs on Streaming DiLoCo: ours beside [EU]",
             eager_table3, ("eager_table3",),
             "[EU] Table 3 (500M, H = 30); ours: sweeps/eager.py:table3 (DiLoCo; Streaming with 3 one-block "
             "fragments, FP4, α = 0.5; toy H = 10). `vs_none_pct`: gap to the same base without overlap, paired "
             "by seed; `paper_vs_none_pct` likewise from [EU]'s losses."),
            ("bytes_exchanged", "Bytes exchanged per method (total and peak per sync)", bytes_table,
             ("c4_scaling", "dolma"),
             "Bytes one replica sends, summed over replicas (DP: bf16 gradients every step). Paper: ≈400× fewer "
             "total bits than DP for Streaming FP4 at H=100 (Table 1, 441 TB / 1.10 TB) and a peak 8× lower than "
             "DiLoCo at 1B (24 blocks / 3 per fragment). Our peak ratio to DiLoCo is the fragment share "
             "(`largest_fragment_share`: its largest fragment / all parameters) times the codec's (E3M0 ≈ 0.52 "
             "bytes per parameter vs FP32's 4).")]


@dataclass
class _Build:
    """One build's inputs and what it has written so far."""
    df: pd.DataFrame
    agg: pd.DataFrame
    out: Path
    root: Path
    prov: dict
    old5: pd.DataFrame | None
    touched: list[Path] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)

    def table(self, t: pd.DataFrame, name: str, title: str, notes: str, key, runs: pd.DataFrame, exts=("csv", "md"),
              **kw):
        write_table(t, self.out, name, title, notes, key=key, runs=runs, root=self.root, prov=self.prov, **kw)
        self.touched += [self.out / f"{name}.{e}" for e in exts]


def _paper(b: _Build) -> None:
    for name, title, fn, prefixes, notes in paper_tables(b.df):
        t = fn(b.agg)
        if t.empty:
            continue
        if name == "table5_c4_scaling" and b.old5 is not None:
            b.changed += [f"{name}: {c}" for c in compare_committed(b.old5, t, KEYS[name])]
        b.table(t, name, title, notes + "\n\n" + SEEDS_NOTE, KEYS[name], b.df[b.df.sweep.str.startswith(prefixes)])


def _sweeps(b: _Build) -> None:
    """Loss curves of the scaling sweeps; every other sweep (whatever its name) its ablation table and plot."""
    df, out = b.df, b.out
    for sweep in b.agg.sweep.unique():
        curves = out / f"loss_curves_{sweep}.png"
        if sweep.startswith(("c4_scaling", "replicas_h", "dolma")):
            plot_loss_curves(df[df.seed == 0] if "seed" in df else df, sweep, curves)
            b.touched.append(curves)
            continue
        t = ablation_table(b.agg[b.agg.sweep == sweep])
        axes = tuple(c for c in t.columns if c not in ABLATION_RESULT_COLS)
        old = out / f"ablation_{sweep}.csv"
        if old.exists():
            try:
                b.changed += [f"ablation_{sweep}: {c}" for c in compare_committed(pd.read_csv(old), t, axes)]
            except (OSError, ValueError):
                pass
        kind = next((k for k in PAPER_SAYS if sweep.startswith(k + "_")), None)
        paper_says = f"Paper: {PAPER_SAYS[kind]}\n\n" if kind else ""
        b.table(t, f"ablation_{sweep}", f"Ablation {sweep}",
                f"{paper_says}`vs_first_pct`: eval loss relative to the first row.\n\n{SEEDS_NOTE}", axes,
                df[df.sweep == sweep], exts=("csv", "md", "png"))
        plot_ablation(t, sweep, out / f"ablation_{sweep}.png")
        plot_loss_curves(df[(df.sweep == sweep) & (df.seed == 0)], sweep, curves)
        b.touched.append(curves)


def _claims(b: _Build, quiet: bool) -> None:
    c = claims_table(b.agg, b.old5, run_records=b.df)
    if c.empty and not (b.out / "claims.csv").exists():  # committed rows are judged again even with no new one
        return
    df = b.df
    c = write_claims(c, b.out, df[df.sweep.str.startswith(("claims_", "c4_scaling", "eager_", "compression_ef"))],
                     b.root, b.prov)
    b.touched += [b.out / "claims.md", b.out / "claims.csv"]
    for r in ([] if quiet else c.itertuples()):
        if r.changed_from:
            print(f"diloco tables: claims: verdict {r.changed_from}: {r.claim}")
        if r.seeds_needed:
            print(f"diloco tables: claims: inconclusive at n={r.n}, {r.seeds_needed} seeds would decide it "
                  f"({POWER:.0%} power): {r.claim}")


def _failed(b: _Build) -> None:
    """failed_runs.csv: this root's runs without a summary, and the committed ones not finished since."""
    df, fr = b.df, b.out / "failed_runs.csv"
    failed, old = df[df.status != "done"], pd.DataFrame()
    if fr.exists():  # a committed failure that has finished since (under this root) is no longer one
        try:
            old = pd.read_csv(fr)
            gone = set(zip(df[df.status == "done"].sweep, df[df.status == "done"].point)) | set(
                zip(failed.sweep, failed.point))
            old = old[[(a, p) not in gone for a, p in zip(old.sweep, old.point)]]
        except (OSError, ValueError, AttributeError):
            old = pd.DataFrame()
        if old.empty and not len(failed):
            fr.unlink()
            (b.out / "failed_runs.md").unlink(missing_ok=True)
    if len(failed) or not old.empty:
        cols = ["sweep", "point", "status", *(["error"] if "error" in failed else [])]
        write_table(pd.concat([failed[cols], old], ignore_index=True), b.out,
                    "failed_runs", "Runs without a summary (failed or unfinished)")
        b.touched += [fr, b.out / "failed_runs.md"]


def _compare(b: _Build, ref: dict | None, pairs: list[str], quiet: bool) -> None:
    t = compare_table(b.agg, ref, pairs)
    what = " ".join(([f"--ref {','.join(f'{k}={v}' for k, v in ref.items())}"] if ref else [])
                    + ([f"--pairs {','.join(pairs)}"] if pairs else []))
    b.table(t, "compare", f"Comparisons ({what})", COMPARE_NOTES, None, b.df,
            interval="gaps paired by seed, mean ± t(n−1)·SE, 95 % Student-t")
    if not quiet:
        print(markdown(t), end="")


def build(root: str | Path, out: str | Path, quiet: bool = False, ref: dict | None = None,
          pairs: list[str] = ()) -> Built:
    """Every table and plot the records under root allow, merged with what out/ already holds (a table
    or row this build does not regenerate is kept); with ref/pairs also compare.csv/.md (report/compare.py)."""
    t0 = time.time()
    root, out = Path(root), Path(out)
    if not root.is_dir():
        raise ConfigError("--root", f"{root} is not a directory of runs; run `diloco sweep … --root {root}` first")
    df = load_runs(root)
    if df.empty:
        raise ConfigError("--root", f"no run records (config.json) under {root}")
    agg = collapse(df)
    if ref or pairs:  # bad input is refused before anything is written
        compare_table(agg, ref, list(pairs))
    out.mkdir(parents=True, exist_ok=True)
    from diloco.rundir import atomic_write_json

    old5 = pd.read_csv(out / "table5_c4_scaling.csv") if (out / "table5_c4_scaling.csv").exists() else None
    b = _Build(df, agg, out, root, read_json(out / "provenance.json") or {}, old5)
    b.table(df.drop(columns=[c for c in ("command",) if c in df]), "runs", "Every run record (one row per run)", "",
            KEYS["runs"], df, exts=("csv",))
    (out / "runs.md").unlink(missing_ok=True)  # runs.csv only (the markdown would be huge)
    _paper(b)
    _sweeps(b)
    _claims(b, quiet)
    _failed(b)
    if ref or pairs:
        _compare(b, ref, list(pairs), quiet)
    write_if_changed(out / "provenance.json", json.dumps(b.prov, indent=1, sort_keys=True) + "\n",
                     lambda p, t: atomic_write_json(p, json.loads(t)))
    b.touched.append(out / "provenance.json")
    if b.changed and not quiet:
        print("diloco tables: numbers that differ from the committed ones at the printed precision:")
        for line in b.changed:
            print(f"  {line}")
    written = sorted(p for p in set(b.touched) if p.exists())
    if not quiet:
        print(f"diloco tables: {len(df)} run(s) from {root} → {len(written)} file(s) in {out} "
              f"({time.time() - t0:.0f} s)")
    return Built(written, b.changed)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="diloco tables", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True, help="folder of sweep outputs (diloco sweep --root)")
    ap.add_argument("--out", default=None, help="where the tables and plots go (default: --root itself; the "
                    "repository's committed results/ only when named)")
    ap.add_argument("--ref", default="", metavar="KEY=VALUE[,…]",
                    help="compare every setting with this one (e.g. method=dp), paired by seed, 95 %% t-interval")
    ap.add_argument("--pairs", default="", metavar="AXIS[,…]", help="compare along these axes (e.g. tau,fragments): "
                    "each value with the axis's first, the other axes fixed; both write compare.csv/.md")
    ap.add_argument("--eval-noise", nargs="+", metavar="WORKDIR",
                    help="instead: the eval-set noise vs eval_batches of these runs' final θᵍ (first two: their gap)")
    ap.add_argument("--eval-noise-batches", type=int, default=128)
    args = ap.parse_args(argv)
    if args.eval_noise:
        t = eval_noise(args.eval_noise, args.eval_noise_batches)
        print(markdown(t), end="")
        return 0
    try:
        from diloco.rundir import require_folder

        require_folder(args.out or args.root, "--out")
        ref = parse_ref(args.ref) if args.ref else None
        built = build(args.root, args.out or args.root, ref=ref, pairs=[p.strip() for p in args.pairs.split(",") if p.strip()])
    except ConfigError as e:
        print(f"diloco tables: bad input: {e}", file=sys.stderr)
        return 2
    for f in built.files:
        print(f"  {f}")
    return 0
