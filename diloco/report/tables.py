"""The paper's tables from collapsed run records (ours beside theirs), the bytes table, the ablation
tables, and the checkpoint evaluations behind Table 3.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from diloco.report.records import TASKS, agg_runs, mean_std, paired_gap_pct, paper, read_json

# What [SD] §3.3 states for each ablation (figures only; digest §3e).
PAPER_SAYS = {
    "tau_alpha": "Fig. 8: loss degradation negligible (<0.2%) up to τ = 10; α = 0.5 helps at larger τ; advice τ ≤ 5.",
    "hetero_tau": "Fig. 10: τ1 = 1, τ2 varied, α = 0.5: robust for τ2 < 5.",
    "fragments": "Fig. 6: 3 blocks per fragment chosen as the trade-off; smaller fragments lower the peak bandwidth; "
                 "strided slightly better than sequential.",
    "compression": "Fig. 11: FP32 → FP4 costs no loss; zeroing values (top-k, DARE, FedDropout) at matched bytes is "
                   "clearly worse, worst when random.",
    "replicas": "Fig. 12: more replicas at a fixed token budget cost some loss (fixed global batch: local batch shrinks; "
                "fixed local batch: fewer steps).",
    "H": "Fig. 13: at a fixed number of steps Streaming DiLoCo behaves like DiLoCo as H grows, and is more robust at low H.",
    "fedpart": "§3.3: FedPart-style freezing 3.2145 vs 2.6749 without (+20.2%), 500M, 15 of 18 blocks frozen.",
    # [EU] (arXiv 2502.12996; results/paper/ablations.csv, overlap_type rows)
    "eager_table2": "[EU] Table 2 (500M, H = 30, DiLoCo, eval loss): no overlap 2.67; 1 inner step 2.67; 1 outer step "
                    "delayed (naive) 3.01 (+12.7%); delayed at a lower outer lr 2.73 (+2.2%); eager 2.69 (+0.7%); "
                    "2 outer steps eager 2.73 (+2.2%). Rows here: none, inner, naive, naive_lowlr, swap, mix, swap2, mix2.",
    "eager_table3": "[EU] Table 3 (eval loss): no overlap DiLoCo 2.68, Streaming 2.67; 1-outer-step eager DiLoCo 2.69 "
                    "(+0.4%), Streaming 2.71 (+1.5%): eager costs more on Streaming.",
}
# The columns ablation_table computes; the others are the sweep's axes (a row's key).
ABLATION_RESULT_COLS = ("scale", "status", "n", "eval_loss", "eval_loss_std", "vs_first_pct", "vs_first_pct_unc",
                        "bytes_total", "bytes_peak_per_sync", "fragments")


def _pct(a, b):
    return 100.0 * (a / b - 1.0) if b and not (pd.isna(a) or pd.isna(b)) else np.nan


# -- paper tables ------------------------------------------------------------------------------------
def table5(df: pd.DataFrame) -> pd.DataFrame:
    """[SD] Table 5: per scale and method, ours beside the paper's (gap to DP in %, which is what a
    toy scale can be compared on; absolute losses only where the scale is the paper's)."""
    runs = df[df.sweep.str.startswith("c4_scaling") & (df.status == "done")]
    if runs.empty:
        return pd.DataFrame()
    runs = runs[runs.get("arg_M", pd.Series("2", index=runs.index)).fillna("2").astype(str) == "2"]
    p = paper("c4_scaling")
    p = p[p.source == "streaming_diloco_v1:table5"]
    out = []
    for scale, g in runs.groupby("scale", sort=False):
        dp = g[g.label == "data_parallel"].final_eval_loss.mean()
        dp_losses = next(iter(g[g.label == "data_parallel"].get("losses", pd.Series(dtype=object))), None) or {}
        dp_bytes = g[g.label == "data_parallel"].bytes_exchanged_total.mean()
        diloco_peak = g[g.label.str.startswith("diloco")].bytes_peak_per_sync.mean()
        ref_scale = scale if scale in set(p.scale) else "35M"
        pdp = p[(p.scale == ref_scale) & (p.method == "data_parallel")].eval_loss.mean()
        for _, r in g.iterrows():
            pr = p[(p.scale == ref_scale) & (p.method == r.label)]
            gaps = [_pct(p[(p.scale == s) & (p.method == r.label)].eval_loss.mean(),
                         p[(p.scale == s) & (p.method == "data_parallel")].eval_loss.mean()) for s in p.scale.unique()]
            gaps = [x for x in gaps if not pd.isna(x)]
            gap, unc, _ = paired_gap_pct(r.get("losses") or {}, dp_losses)
            row = {"scale": scale, "method": r.label, "H": r.H, "M": r.replicas, "steps": r.steps,
                   "n": r.get("n", 1), "eval_loss": r.final_eval_loss, "eval_loss_std": r.get("eval_loss_std"),
                   "gap_to_dp_pct": gap if np.isfinite(gap) else _pct(r.final_eval_loss, dp),
                   "gap_to_dp_pct_unc": unc,
                   "paper_scale": ref_scale,
                   "paper_eval_loss": pr.eval_loss.mean() if len(pr) else np.nan,
                   "paper_gap_to_dp_pct": _pct(pr.eval_loss.mean(), pdp) if len(pr) else np.nan,
                   "paper_gap_range_pct": f"{min(gaps):+.2f}…{max(gaps):+.2f}" if gaps else ""}
            row["diff_gap_pp"] = row["gap_to_dp_pct"] - row["paper_gap_to_dp_pct"]
            if scale == ref_scale:
                row["diff_eval_loss"] = r.final_eval_loss - row["paper_eval_loss"]
            for t in TASKS:
                row[t] = r.get(t)
                row[f"paper_{t}"] = pr[t].mean() if len(pr) else np.nan
            row["bytes_total"] = r.bytes_exchanged_total
            row["dp_bytes_over_ours"] = dp_bytes / r.bytes_exchanged_total if r.bytes_exchanged_total else np.nan
            row["bytes_peak_per_sync"] = r.bytes_peak_per_sync
            row["diloco_peak_over_ours"] = diloco_peak / r.bytes_peak_per_sync if r.bytes_peak_per_sync else np.nan
            out.append(row)
    return pd.DataFrame(out)


def table6(df: pd.DataFrame) -> pd.DataFrame:
    """[SD] Table 6: Streaming overlapped FP4 at M × H; relative to M=2, H=30 of the same scale."""
    runs = df[df.sweep.str.startswith(("replicas_h", "c4_scaling")) & (df.status == "done")]
    if runs.empty:
        return pd.DataFrame()
    runs = runs[runs.label.str.startswith("streaming_ovl_fp4")].drop_duplicates(["scale", "label", "replicas"])
    if runs.empty or not (runs.replicas != 2).any():  # nothing beyond Table 5's M=2 column
        return pd.DataFrame()
    p = paper("c4_scaling")
    p = p[p.source == "streaming_diloco_v1:table6"]
    out = []
    for scale, g in runs.groupby("scale", sort=False):
        ref = g[(g.replicas == 2) & g.label.str.endswith("_h30")].final_eval_loss.mean()
        ref_scale = scale if scale in set(p.scale) else "35M"
        pref = p[(p.scale == ref_scale) & (p.method == "streaming_ovl_fp4_m2_h30")].eval_loss.mean()
        for _, r in g.sort_values(["replicas", "label"]).iterrows():
            h = r.label.rsplit("_h", 1)[1]
            plabel = f"streaming_ovl_fp4_m{int(r.replicas)}_h{h}"
            pr = p[(p.scale == ref_scale) & (p.method == plabel)]
            row = {"scale": scale, "method": plabel, "H_run": r.H, "eval_loss": r.final_eval_loss,
                   "vs_m2_h30_pct": _pct(r.final_eval_loss, ref), "paper_scale": ref_scale,
                   "paper_eval_loss": pr.eval_loss.mean() if len(pr) else np.nan,
                   "paper_vs_m2_h30_pct": _pct(pr.eval_loss.mean(), pref) if len(pr) else np.nan}
            row["diff_pp"] = row["vs_m2_h30_pct"] - row["paper_vs_m2_h30_pct"]
            for t in TASKS:
                row[t], row[f"paper_{t}"] = r.get(t), (pr[t].mean() if len(pr) else np.nan)
            out.append(row)
    return pd.DataFrame(out)


def table1(df: pd.DataFrame) -> pd.DataFrame:
    """[SD] Table 1/7: over-training; loss gap to DP and bytes ratio at each token budget."""
    runs = df[df.sweep.str.startswith("dolma") & (df.status == "done")]
    if runs.empty:
        return pd.DataFrame()
    p = paper("dolma_overtraining")
    p = p[p.source.str.startswith("streaming_diloco_v1")]
    tok = {"25B": 25e9, "100B": 100e9, "250B": 250e9}
    out = []
    runs = runs.assign(_tok=runs.arg_tokens.map(tok)).sort_values(["_tok", "replicas"], kind="stable")
    for t, g in runs.groupby("arg_tokens", sort=False):
        dp = g[g.label == "data_parallel"]
        pdp = p[(p.tokens == tok[t]) & (p.method == "data_parallel")]
        for _, r in g.iterrows():
            m = int(r.replicas)
            plabel = "data_parallel" if r.label == "data_parallel" else f"streaming_ovl_fp4_m{m}_h100"
            pr = p[(p.tokens == tok[t]) & (p.method == plabel)]
            row = {"tokens": t, "method": plabel, "steps": r.steps, "eval_loss": r.final_eval_loss,
                   "gap_to_dp_pct": _pct(r.final_eval_loss, dp.final_eval_loss.mean()),
                   "paper_eval_loss": pr.eval_loss.mean(), "paper_gap_to_dp_pct": _pct(pr.eval_loss.mean(),
                                                                                       pdp.eval_loss.mean()),
                   "bytes_total": r.bytes_exchanged_total,
                   "dp_bytes_over_ours": dp.bytes_exchanged_total.mean() / r.bytes_exchanged_total,
                   # the paper counts bytes per replica (its M=4 rows are half its M=2 rows)
                   "dp_over_ours_per_replica": (dp.bytes_exchanged_total.mean() / dp.replicas.mean())
                                               / (r.bytes_exchanged_total / r.replicas),
                   "paper_tb_exchanged": pr.tb_exchanged.mean(),
                   "paper_dp_over_ours": pdp.tb_exchanged.mean() / pr.tb_exchanged.mean()}
            row["diff_gap_pp"] = row["gap_to_dp_pct"] - row["paper_gap_to_dp_pct"]
            for t_ in TASKS:
                row[t_], row[f"paper_{t_}"] = r.get(t_), pr[t_].mean()
            out.append(row)
    return pd.DataFrame(out)


def which_params_eval(workdir: str) -> dict:
    """Eval loss of the first replica, the replica average and the outer θ^g from the last checkpoint,
    drained (fragments in flight applied, as for final_eval_loss); cached in which_params.json."""
    wd = Path(workdir)
    cached = read_json(wd / "which_params.json")
    if cached and cached.get("drained_fragments") is not None:  # older caches were not drained
        return cached
    import jax

    from diloco.data import eval_batches
    from diloco.outer.sync import params_sha256
    from diloco.rundir import atomic_write_json
    from diloco.eval.runs import load_run

    cfg, tr, state = load_run(wd)
    _, state, drained = tr.drained(state, int(state.step))  # as at the next sync boundary, like final_eval_loss
    evals = eval_batches(cfg.data, cfg.vocab, cfg.seq_len, cfg.batch_size // tr.R * tr.R, cfg.eval_batches,
                         data_dir=cfg.data_dir or None)
    ev = tr.eval_fn()
    sets = {"first_replica": jax.tree_util.tree_map(lambda x: x[0], state.params),
            "replica_average": jax.tree_util.tree_map(lambda x: x.mean(0), state.params),
            "outer_params": tr.eval_params(state)}
    res = {k: float(np.mean([float(ev(p, b)) for b in evals])) for k, p in sets.items()}
    res["drained_fragments"] = drained
    res["outer_params_sha256"] = params_sha256(sets["outer_params"])  # summary.json's params_sha256
    atomic_write_json(wd / "which_params.json", res)
    return res


def eval_noise(workdirs: list[str], batches: int = 128) -> pd.DataFrame:
    """How noisy is a fixed eval set of n batches? Per-batch eval losses of each run's final θᵍ (drained)
    on the first `batches` validation batches; for n in 8, 16, 32, 64, …: the standard error of one
    run's mean loss (sd of its per-batch losses / √n) and, for the first two runs, of their paired
    difference (what a gap between two rows carries from the eval set alone), beside the change of the
    mean itself from n to `batches` batches."""
    from diloco.data import eval_batches
    from diloco.eval.runs import load_run

    per = []
    for wd in workdirs:
        cfg, tr, state = load_run(wd)
        _, state, _ = tr.drained(state, int(state.step))
        evals = eval_batches(cfg.data, cfg.vocab, cfg.seq_len, cfg.batch_size // tr.R * tr.R, batches,
                             data_dir=cfg.data_dir or None)
        ev = tr.eval_fn()
        p = tr.eval_params(state)
        per.append(np.array([float(ev(p, b)) for b in evals]))
    rows = []
    n = 8
    while n <= batches:
        row = {"eval_batches": n, "tokens": n * cfg.batch_size * cfg.seq_len}
        for i, x in enumerate(per):
            row[f"run{i}_mean"] = x[:n].mean()
            row[f"run{i}_se"] = x[:n].std(ddof=1) / math.sqrt(n)
            row[f"run{i}_shift_to_all"] = x[:n].mean() - x.mean()
        if len(per) > 1:
            d = 100 * (per[0][:n] / per[1][:n] - 1)
            row["gap_pct"] = 100 * (per[0][:n].mean() / per[1][:n].mean() - 1)
            row["gap_pct_se"] = d.std(ddof=1) / math.sqrt(n)
        rows.append(row)
        n *= 2
    return pd.DataFrame(rows)


def which_params_by_seed(run_records: pd.DataFrame, sweep: str, point: str) -> dict[str, dict[int, float]]:
    """{first_replica | replica_average | outer_params: {seed: eval loss}} over a setting's finished
    seeds (which_params_eval of each); a seed without a readable checkpoint is left out, {} if all are."""
    wps = {}
    for run in agg_runs(run_records, sweep, point):
        try:
            wps[int(run["seed"])] = which_params_eval(run["workdir"])
        except Exception as e:  # no readable checkpoint: that seed is left out
            print(f"diloco tables: which_params {run['workdir']}: {e}", file=sys.stderr)
    return {k: {s: v[k] for s, v in wps.items()} for k in ("first_replica", "replica_average", "outer_params")
            } if wps else {}


def table3(df: pd.DataFrame) -> pd.DataFrame:
    runs = df[df.sweep.str.startswith("which_params") & (df.status == "done")]
    if runs.empty:
        return pd.DataFrame()
    p = paper("which_params").set_index("params_evaluated")
    out = []
    for _, r in runs.iterrows():
        try:
            res = which_params_eval(r.workdir)
        except Exception as e:  # a run without a readable checkpoint still gets a row
            print(f"diloco tables: which_params: {r.workdir}: {e}", file=sys.stderr)
            continue
        for k in ("first_replica", "replica_average", "outer_params"):
            v = res[k]
            out.append({"scale": r.scale, "params_evaluated": k, "eval_loss": v,
                        "vs_outer_pct": _pct(v, res["outer_params"]), "paper_eval_loss": p.eval_loss[k],
                        "paper_vs_outer_pct": _pct(p.eval_loss[k], p.eval_loss["outer_params"]),
                        "paper_hellaswag": p.hellaswag[k]})
    return pd.DataFrame(out)


def table3_outer_lr(agg: pd.DataFrame, run_records: pd.DataFrame) -> pd.DataFrame:
    """Table 3's three evaluations per setting of the claims_table3_* sweeps (the final method at several
    outer lrs), each seed's checkpoint drained; gaps paired by seed (mean ± 2·se). `first_vs_avg_pct`
    is the replicas' spread, the part of the paper's Table 3 that favours θᵍ over one replica. `run_records`:
    the per-run records (load_runs) behind `agg`, for each seed's checkpoint."""
    out = []
    for r in agg[agg.sweep.str.startswith("claims_table3_") & (agg.status == "done")].itertuples():
        ev = which_params_by_seed(run_records, r.sweep, r.point)
        if not ev:
            continue
        row = {"sweep": r.sweep, "outer_lr": float(r.outer_lr), "alpha": float(r.alpha), "tau": int(r.tau),
               "steps": int(r.steps)}
        row["outer_params"], row["outer_params_std"], row["n"] = mean_std(list(ev["outer_params"].values()))
        for name, a, b in (("first_vs_outer", "first_replica", "outer_params"),
                           ("avg_vs_outer", "replica_average", "outer_params"),
                           ("first_vs_avg", "first_replica", "replica_average")):
            row[f"{name}_pct"], row[f"{name}_pct_unc"], _ = paired_gap_pct(ev[a], ev[b])
        out.append(row)
    return pd.DataFrame(out)


def bytes_table(df: pd.DataFrame) -> pd.DataFrame:
    """Total and peak bytes per method, per scale (from the scaling sweeps)."""
    runs = df[df.sweep.str.startswith(("c4_scaling", "dolma")) & (df.status == "done")]
    if runs.empty:
        return pd.DataFrame()
    out = []
    for (sweep, scale), g in runs.groupby(["sweep", "scale"], sort=False):
        dp = g[g.label == "data_parallel"].bytes_exchanged_total.mean()
        dil = g[g.label.str.startswith("diloco")].bytes_peak_per_sync.mean()
        for _, r in g.iterrows():
            out.append({"sweep": sweep, "scale": scale, "setting": r.point, "method": r.label, "H": r.H,
                        "M": r.replicas, "steps": r.steps, "params": r.params, "syncs": r.syncs,
                        "bytes_total": r.bytes_exchanged_total, "bytes_peak_per_sync": r.bytes_peak_per_sync,
                        "largest_fragment_share": r.largest_fragment_share,
                        "dp_total_over_ours": dp / r.bytes_exchanged_total if r.bytes_exchanged_total else np.nan,
                        "diloco_peak_over_ours": dil / r.bytes_peak_per_sync if r.bytes_peak_per_sync else np.nan})
    return pd.DataFrame(out)


def ablation_table(g: pd.DataFrame) -> pd.DataFrame:
    named = [a for a in (g["axis_order"].dropna().iloc[0].split(",") if "axis_order" in g and g["axis_order"].notna().any() else []) if a]
    axes = [c for c in g.columns if c.startswith("arg_") and c != "arg_scale" and g[c].notna().any()]
    axes += named + [c for c in g.columns if c.startswith("ax_") and c not in named and g[c].notna().any()]
    g = g.copy()
    keys = [pd.to_numeric(g[c], errors="coerce").fillna(0) if pd.to_numeric(g[c], errors="coerce").notna().all()
            else g[c].astype(str) for c in axes]
    if "point_index" in g and g.point_index.notna().all():
        g = g.sort_values("point_index", kind="stable")
    elif axes:
        order = pd.DataFrame({f"k{i}": k.values for i, k in enumerate(keys)}).sort_values(
            [f"k{i}" for i in range(len(keys))], kind="stable").index
        g = g.iloc[order]
    ref = g.final_eval_loss.iloc[0]
    ref_losses = g["losses"].iloc[0] if "losses" in g else {}
    cols = {c: c.split("_", 1)[1] for c in axes}
    t = g[axes].rename(columns=cols)
    if "replica_tau" in t:  # heterogeneous workers "τ1,τ2": plot against τ2
        t.insert(list(t.columns).index("replica_tau"), "tau2",
                 [int(str(v).split(",")[-1]) if str(v).replace(",", "").isdigit() else np.nan for v in t.replica_tau])
        t = t.drop(columns=["replica_tau"])
    t.insert(0, "scale", g.scale.values)
    t["status"] = g.status.values
    t["n"] = g.get("n", pd.Series(1, index=g.index)).values
    t["eval_loss"] = g.final_eval_loss.values
    t["eval_loss_std"] = g.get("eval_loss_std", pd.Series(np.nan, index=g.index)).values
    gaps = [paired_gap_pct(l or {}, ref_losses or {}) for l in g.get("losses", pd.Series([{}] * len(g)))]
    t["vs_first_pct"] = [gp[0] if np.isfinite(gp[0]) else _pct(v, ref) for gp, v in zip(gaps, g.final_eval_loss)]
    t["vs_first_pct_unc"] = [gp[1] for gp in gaps]
    t["bytes_total"] = g.get("bytes_exchanged_total")
    t["bytes_peak_per_sync"] = g.get("bytes_peak_per_sync")
    t["fragments"] = g.get("fragments")
    return t.reset_index(drop=True)


# -- [EU] Tables 2 and 3: ours beside theirs --------------------------------------------------------------
# experiments/eager.py's rows → [EU]'s settings (results/paper/ablations.csv); swap and mix are two readings
# of [EU]'s one eager formula (docs/architecture.md), so both sit beside its eager row.
EU_SETTING = {"none": "no_overlap", "inner": "inner_1step", "naive": "outer_1step_delayed",
              "naive_lowlr": "outer_1step_delayed_lower_lr", "swap": "outer_1step_eager", "mix": "outer_1step_eager",
              "swap2": "outer_2step_eager", "mix2": "outer_2step_eager"}


def _eager_rows(g: pd.DataFrame, paper_loss: Callable, paper_ref: float) -> list[tuple]:
    """(record, columns) of g's rows in EU_SETTING's order: the gap to row 'none' paired by seed, and [EU]'s."""
    order = list(EU_SETTING)
    g = g.assign(_o=[order.index(x) if x in order else len(order) for x in g.arg_row]).sort_values("_o")
    ref_losses = next((r.losses or {} for r in g.itertuples() if r.arg_row == "none"), {})
    out = []
    for r in g.itertuples():
        gap, unc, _ = paired_gap_pct(r.losses or {}, ref_losses)
        pl = paper_loss(r)
        out.append((r, {"n": int(r.n), "eval_loss": r.final_eval_loss, "eval_loss_std": r.eval_loss_std,
                        "vs_none_pct": gap, "vs_none_pct_unc": unc, "paper_setting": EU_SETTING.get(r.arg_row, ""),
                        "paper_eval_loss": pl, "paper_vs_none_pct": _pct(pl, paper_ref)}))
    return out


def eager_table2(df: pd.DataFrame) -> pd.DataFrame:
    """[EU] Table 2 (overlap variants on DiLoCo, 500M, H = 30) beside ours (sweeps/eager.py:table2): eval
    loss per row over its seeds and its gap to no overlap, paired by seed; [EU]'s loss and gap."""
    runs = df[df.sweep.str.startswith("eager_table2") & (df.status == "done")]
    if runs.empty or "arg_row" not in runs:
        return pd.DataFrame()
    p = paper("ablations")
    p = p[(p.source == "eager_updates_v1:table2") & (p.metric == "eval_loss")].set_index("setting").value
    out = []
    for (sweep, scale), g in runs.groupby(["sweep", "scale"], sort=False):
        rows = _eager_rows(g, lambda r: p.get(EU_SETTING.get(r.arg_row), np.nan), p.get("no_overlap", np.nan))
        out += [{"scale": scale, "row": r.arg_row, "H": r.H, "M": r.replicas, "steps": r.steps, **x} for r, x in rows]
    return pd.DataFrame(out)


def eager_table3(df: pd.DataFrame) -> pd.DataFrame:
    """[EU] Table 3 (eager on DiLoCo vs on Streaming DiLoCo) beside ours (sweeps/eager.py:table3): per base,
    each row's gap to that base's no overlap, paired by seed; [EU]'s loss and gap."""
    runs = df[df.sweep.str.startswith("eager_table3") & (df.status == "done")]
    if runs.empty or "arg_row" not in runs:
        return pd.DataFrame()
    p = paper("ablations")
    p = p[(p.source == "eager_updates_v1:table3") & (p.metric == "eval_loss")].set_index(["method", "setting"]).value
    out = []
    for (sweep, scale, base), g in runs.groupby(["sweep", "scale", "arg_base"], sort=False):
        rows = _eager_rows(g, lambda r, b=base: p.get((b, EU_SETTING.get(r.arg_row)), np.nan),
                           p.get((base, "no_overlap"), np.nan))
        out += [{"scale": scale, "base": base, "row": r.arg_row, "H": r.H, "fragments": r.fragments, **x}
                for r, x in rows]
    return pd.DataFrame(out)

