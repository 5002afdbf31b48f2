"""`diloco tables --root DIR --out results/`: run records → pandas → the paper's tables (ours beside
theirs, with the difference), bytes tables, loss curves and ablation plots. Reads only
config.json / summary.json / metrics.jsonl / point.json / failed.json; regenerating takes seconds
(Table 3 evaluates a checkpoint once and caches which_params.json in its workdir).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from diloco.errors import ConfigError
from diloco.outer import methods

PAPER_DIR = Path(__file__).resolve().parents[1] / "results" / "paper"
# Spec argument fields of the experiments that take several (experiments/<stem>.py:a,b,c).
SPEC_ARGS = {"c4_scaling": ("scale", "label", "M"), "dolma_overtraining": ("scale", "tokens", "label", "M"),
             "ablate_compression": ("scale", "scheme"), "ablate_replicas": ("scale", "M", "fixed"),
             "ablate_H": ("scale", "variant"), "fedpart": ("scale", "freeze")}
CONFIG_COLS = ("scale", "method", "H", "tau", "replica_tau", "alpha", "codec", "codec_keep_fraction",
               "layers_per_fragment", "pattern", "replicas", "batch_size", "seq_len", "steps", "freeze_non_syncing")
SUMMARY_COLS = ("final_eval_loss", "bytes_exchanged_total", "bytes_peak_per_sync", "syncs", "params", "fragments",
                "tokens", "wall_seconds")
TASKS = ("hellaswag", "piqa", "arc_easy")
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
}


# -- loading -----------------------------------------------------------------------------------------
def _read_json(p: Path):
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def _sweep_order(point: dict, cache: dict) -> dict:
    """{point name: index} in the sweep file's own order (for tables/plots), {} if unavailable."""
    key = (point.get("sweep_file"), point.get("sweep_arg"))
    if key not in cache:
        try:
            from diloco.sweep import load_sweep

            s = load_sweep(f"{key[0]}:{key[1]}" if key[1] else key[0])
            cache[key] = {p["name"]: i for i, p in enumerate(s["points"])}
        except Exception:  # the sweep file moved or changed: fall back to sorting by the axes
            cache[key] = {}
    return cache[key]


def load_runs(root: str | Path) -> pd.DataFrame:
    """One row per run folder (a folder with config.json) anywhere under root."""
    rows, orders = [], {}
    for cfg_path in sorted(Path(root).rglob("config.json")):
        wd = cfg_path.parent
        if "ckpt" in wd.parts:
            continue
        cfg = _read_json(cfg_path) or {}
        if "method" not in cfg:
            continue
        point = _read_json(wd / "point.json") or {}
        summ = _read_json(wd / "summary.json")
        failed = _read_json(wd / "failed.json")
        row = {"sweep": point.get("sweep", wd.parent.name), "point": wd.name, "workdir": str(wd),
               "status": "done" if summ else ("failed" if failed else "incomplete"),
               "spec": point.get("spec", ""), "command": point.get("command", "")}
        row.update({k: cfg.get(k) for k in CONFIG_COLS})
        row["label"] = methods.paper_label(cfg)
        stem, _, arg = row["spec"].partition(":")
        stem = Path(stem).stem
        for name, val in zip(SPEC_ARGS.get(stem, ()), arg.split(",") if arg else ()):
            row[f"arg_{name}"] = val
        if "arg_label" in row:  # the paper's name for the setting (toy twins shrink H 3×)
            row["label"] = methods.label_of(row["arg_label"])
        for k, v in (point.get("point") or {}).items():
            if k != "arg":
                row[f"ax_{k}"] = v
        row["point_index"] = _sweep_order(point, orders).get(wd.name) if point.get("sweep_file") else None
        row["axis_order"] = ",".join(f"ax_{k}" for k in point.get("axes", point.get("point") or {}) if k != "arg")
        if summ:
            row.update({k: summ.get(k) for k in SUMMARY_COLS})
            row["H"] = summ.get("H")  # None for DP
            sizes = summ.get("fragment_sizes") or []
            row["largest_fragment_share"] = max(sizes) / sum(sizes) if sizes else 1.0
            for t in TASKS:
                row[t] = (summ.get("downstream") or {}).get(t, {}).get("acc") if isinstance(
                    (summ.get("downstream") or {}).get(t), dict) else (summ.get("downstream") or {}).get(t)
        if failed:
            row["error"] = (failed.get("error_tail") or "").splitlines()[-1:] or [""]
            row["error"] = row["error"][0][:200]
        rows.append(row)
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    order = {"data_parallel": 0, "diloco": 1, "streaming": 2}
    df["_o"] = [order.get(l.split("_h")[0].split("_")[0] if l != "data_parallel" else l, 3) for l in df.label]
    df["_h"] = pd.to_numeric(df.label.str.rsplit("_h", n=1).str[-1], errors="coerce")
    df = df.sort_values(["sweep", "_o", "_h", "point"], kind="stable").drop(columns=["_o", "_h"])
    df = df.reset_index(drop=True)
    for c in ("final_eval_loss", *TASKS):
        if c not in df:
            df[c] = np.nan
    return df


def metrics(workdir: str) -> pd.DataFrame:
    p = Path(workdir) / "metrics.jsonl"
    rows = []
    if p.exists():
        for line in p.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                break
    return pd.DataFrame(rows)


def paper(name: str) -> pd.DataFrame:
    return pd.read_csv(PAPER_DIR / f"{name}.csv")


# -- formatting --------------------------------------------------------------------------------------
def _cell(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, (float, np.floating)):
        a = abs(v)
        if float(v).is_integer() and a < 1e15:
            return str(int(v))
        return f"{v:.4g}" if a and (a < 1e-3 or a >= 1e6) else f"{v:.4f}".rstrip("0").rstrip(".") if a < 100 else f"{v:.1f}"
    return str(v)


def markdown(df: pd.DataFrame) -> str:
    if df.empty:
        return "_(no runs)_\n"
    return df.map(_cell).to_markdown(index=False, disable_numparse=True) + "\n"


def write_table(df: pd.DataFrame, out: Path, name: str, title: str, notes: str = "") -> None:
    from diloco.rundir import atomic_write_text

    atomic_write_text(out / f"{name}.csv", df.to_csv(index=False))
    atomic_write_text(out / f"{name}.md", f"# {title}\n\n{notes.strip()}\n\n{markdown(df)}")


def save_figure(fig, path: Path) -> None:
    """savefig to a temp file beside `path`, then os.replace: readers never see half a PNG."""
    import os
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=Path(path).parent, prefix=f".{Path(path).name}.", suffix=".png")
    os.close(fd)
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


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
        dp_bytes = g[g.label == "data_parallel"].bytes_exchanged_total.mean()
        diloco_peak = g[g.label.str.startswith("diloco")].bytes_peak_per_sync.mean()
        ref_scale = scale if scale in set(p.scale) else "35M"
        pdp = p[(p.scale == ref_scale) & (p.method == "data_parallel")].eval_loss.mean()
        for _, r in g.iterrows():
            pr = p[(p.scale == ref_scale) & (p.method == r.label)]
            gaps = [_pct(p[(p.scale == s) & (p.method == r.label)].eval_loss.mean(),
                         p[(p.scale == s) & (p.method == "data_parallel")].eval_loss.mean()) for s in p.scale.unique()]
            gaps = [x for x in gaps if not pd.isna(x)]
            row = {"scale": scale, "method": r.label, "H": r.H, "M": r.replicas, "steps": r.steps,
                   "eval_loss": r.final_eval_loss, "gap_to_dp_pct": _pct(r.final_eval_loss, dp),
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
    cached = _read_json(wd / "which_params.json")
    if cached and cached.get("drained_fragments") is not None:  # older caches were not drained
        return cached
    import jax

    from diloco.data import eval_batches
    from diloco.rundir import atomic_write_json
    from diloco.trainer import load_run

    cfg, tr, state = load_run(wd)
    drained = []
    if tr.driver is not None:  # as at the next sync boundary, like the run's final_eval_loss
        _, state, drained = tr.driver.drained(state, int(state.step))
    evals = eval_batches(cfg.data, cfg.vocab, cfg.seq_len, cfg.batch_size // tr.R * tr.R, cfg.eval_batches,
                         data_dir=cfg.data_dir or None)
    ev = tr.eval_fn()
    sets = {"first_replica": jax.tree_util.tree_map(lambda x: x[0], state.params),
            "replica_average": jax.tree_util.tree_map(lambda x: x.mean(0), state.params),
            "outer_params": tr.eval_params(state)}
    res = {k: float(np.mean([float(ev(p, b)) for b in evals])) for k, p in sets.items()}
    res["drained_fragments"] = drained
    atomic_write_json(wd / "which_params.json", res)
    return res


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
    cols = {c: c.split("_", 1)[1] for c in axes}
    t = g[axes].rename(columns=cols)
    if "replica_tau" in t:  # heterogeneous workers "τ1,τ2": plot against τ2
        t.insert(list(t.columns).index("replica_tau"), "tau2",
                 [int(str(v).split(",")[-1]) if str(v).replace(",", "").isdigit() else np.nan for v in t.replica_tau])
        t = t.drop(columns=["replica_tau"])
    t.insert(0, "scale", g.scale.values)
    t["status"] = g.status.values
    t["eval_loss"] = g.final_eval_loss.values
    t["vs_first_pct"] = [_pct(v, ref) for v in g.final_eval_loss]
    t["bytes_total"] = g.get("bytes_exchanged_total")
    t["bytes_peak_per_sync"] = g.get("bytes_peak_per_sync")
    t["fragments"] = g.get("fragments")
    return t.reset_index(drop=True)


# -- plots -------------------------------------------------------------------------------------------
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss_curves(df: pd.DataFrame, sweep: str, path: Path) -> None:
    plt = _plt()
    g = df[(df.sweep == sweep) & (df.status == "done")]
    scales = list(dict.fromkeys(g.scale))
    fig, axs = plt.subplots(1, max(1, len(scales)), figsize=(5.5 * max(1, len(scales)), 4), squeeze=False)
    for ax, s in zip(axs[0], scales):
        for _, r in g[g.scale == s].iterrows():
            m = metrics(r.workdir)
            if m.empty:
                continue
            line, = ax.plot(m.step, m.train_loss.rolling(3, min_periods=1).mean(), alpha=0.35, lw=1)
            if "eval_loss" in m:
                e = m.dropna(subset=["eval_loss"])
                ax.plot(e.step, e.eval_loss, "o-", color=line.get_color(), label=f"{r.label} (M={r.replicas})")
        ax.set(title=f"{sweep}: scale {s}", xlabel="inner step", ylabel="loss (eval ●, train faint)")
        ax.legend(fontsize=7)
        ax.set_ylim(top=min(ax.get_ylim()[1], 4.5))
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def plot_ablation(t: pd.DataFrame, sweep: str, path: Path) -> None:
    """x = the first numeric axis, one line per value of the other axes; bars when no axis is numeric."""
    t = t[(t.status == "done") & t.eval_loss.notna()]
    if t.empty:
        return
    plt = _plt()
    axes = [c for c in t.columns if c not in ("scale", "status", "eval_loss", "vs_first_pct", "bytes_total",
                                               "bytes_peak_per_sync", "fragments")]
    num = [c for c in axes if pd.to_numeric(t[c], errors="coerce").notna().all() and t[c].nunique() > 1]
    fig, ax = plt.subplots(figsize=(6, 4))
    if num:
        x = num[0]
        rest = [c for c in axes if c != x and t[c].nunique() > 1]
        groups = t.groupby(rest, sort=False) if rest else [("", t)]
        for key, g in groups:
            g = g.assign(x_num=pd.to_numeric(g[x])).sort_values("x_num")
            ax.plot(g.x_num, g.eval_loss, "o-", label=", ".join(f"{c}={k}" for c, k in
                                                               zip(rest, key if isinstance(key, tuple) else (key,))) or None)
        ax.set_xlabel(x)
        xs = pd.to_numeric(t[x])
        if xs.min() > 0 and (x == "H" or xs.max() / xs.min() > 50):
            ax.set_xscale("log")
        if rest:
            ax.legend(fontsize=8)
    else:
        labels = [", ".join(str(v) for v in r) for r in t[axes].itertuples(index=False)] if axes else t.index
        ax.bar(range(len(t)), t.eval_loss, color="tab:blue")
        ax.set_xticks(range(len(t)), labels, rotation=30, ha="right", fontsize=8)
        lo, hi = t.eval_loss.min(), t.eval_loss.max()
        ax.set_ylim(lo - 0.2 * (hi - lo + 1e-3), hi + 0.2 * (hi - lo + 1e-3))
    ax.set(ylabel="final eval loss", title=f"{sweep}")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


# -- entry points ------------------------------------------------------------------------------------
def build(root: str | Path, out: str | Path, quiet: bool = False) -> list[Path]:
    """Every table and plot the records under root allow. Returns the written files."""
    import time

    t0 = time.time()
    root, out = Path(root), Path(out)
    if not root.is_dir():
        raise ConfigError("--root", f"{root} is not a directory of runs; run `diloco sweep … --root {root}` first")
    df = load_runs(root)
    if df.empty:
        raise ConfigError("--root", f"no run records (config.json) under {root}")
    out.mkdir(parents=True, exist_ok=True)
    ours = df.drop(columns=[c for c in ("command",) if c in df])
    from diloco.rundir import atomic_write_text

    atomic_write_text(out / "runs.csv", ours.to_csv(index=False))
    tables = [("table5_c4_scaling", "[SD] Table 5 — C4 scaling: ours beside the paper", table5,
               "Eval loss and gap to Data-Parallel (DP) at the same scale. Toy scales are compared with the paper's "
               "smallest scale (35M) and the range of its gaps over 35M…4B; absolute losses are comparable only at "
               "the paper's scales. `dp_bytes_over_ours`: DP's total bytes / this run's; `diloco_peak_over_ours`: "
               "DiLoCo's peak bytes per sync / this run's. Toy twins run H/3 (30→10, 100→33); `H` is the run's."),
              ("table6_replicas_h", "[SD] Table 6 — Streaming DiLoCo overlapped FP4 at M × H", table6,
               "Relative to M=2, H=30 of the same scale (paper: same, at its scale or at 35M for toy runs)."),
              ("table1_dolma_overtraining", "[SD] Table 1/7 — over-training", table1,
               "Gap to DP at the same token budget, and DP's bytes over ours: summed over replicas, and per replica "
               "(`dp_over_ours_per_replica`, the paper's convention: its `paper_dp_over_ours` is the TB-exchanged "
               "ratio). Toy twins: 1×/4×/10× a 100-step tiny budget, H=100 → 33."),
              ("table3_which_params", "[SD] Table 3 — which parameters to evaluate", table3,
               "Eval loss of the first replica, the replica average and the outer parameters θ^g, from the run's "
               "last checkpoint."),
              ("bytes_exchanged", "Bytes exchanged per method (total and peak per sync)", bytes_table,
               "Bytes one replica sends, summed over replicas (DP: bf16 gradients every step). Paper: ≈400× fewer "
               "total bits than DP for Streaming FP4 at H=100 (Table 1, 441 TB / 1.10 TB) and a peak 8× lower than "
               "DiLoCo at 1B (24 blocks / 3 per fragment). Our peak ratio to DiLoCo is the fragment share "
               "(`largest_fragment_share`: its largest fragment / all parameters) times the codec's (E3M0 ≈ 0.52 "
               "bytes per parameter vs FP32's 4).")]
    for name, title, fn, notes in tables:
        t = fn(df)
        if not t.empty:
            write_table(t, out, name, title, notes)
    for sweep in df.sweep.unique():
        g = df[df.sweep == sweep]
        kind = next((k for k in PAPER_SAYS if sweep.startswith(k + "_")), None)
        if sweep.startswith(("c4_scaling", "replicas_h", "dolma")):
            plot_loss_curves(df, sweep, out / f"loss_curves_{sweep}.png")
        elif kind:
            t = ablation_table(g)
            write_table(t, out, f"ablation_{sweep}", f"Ablation {sweep}",
                        f"Paper: {PAPER_SAYS[kind]}\n\n`vs_first_pct`: eval loss relative to the first row.")
            plot_ablation(t, sweep, out / f"ablation_{sweep}.png")
            plot_loss_curves(df, sweep, out / f"loss_curves_{sweep}.png")
    failed = df[df.status != "done"]
    if len(failed):
        write_table(failed[["sweep", "point", "status", *(["error"] if "error" in failed else [])]], out,
                    "failed_runs", "Runs without a summary (failed or unfinished)")
    written = sorted(p for p in out.glob("*") if p.is_file() and p.stat().st_mtime >= t0 - 1)
    if not quiet:
        print(f"diloco tables: {len(df)} run(s) from {root} → {len(written)} file(s) in {out}")
    return written


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="diloco tables", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True, help="folder of sweep outputs (diloco sweep --root)")
    ap.add_argument("--out", default="results", help="where the tables and plots go (default results/)")
    args = ap.parse_args(argv)
    try:
        files = build(args.root, args.out)
    except ConfigError as e:
        print(f"diloco tables: bad input: {e}", file=sys.stderr)
        return 2
    for f in files:
        print(f"  {f}")
    return 0
