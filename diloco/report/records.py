"""Run records (config.json, summary.json, point.json, failed.json under a root) as one pandas row per
run, folded over seeds, with the statistics the tables print (mean ± std, paired gaps), and the paper's
numbers (results/paper/*.csv).
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pandas as pd

from diloco.outer import methods
from diloco.sweep import base_name
from diloco.sweep_status import read_json

REPO = Path(__file__).resolve().parents[2]  # diloco/report/records.py → the repository
PAPER_DIR = REPO / "results" / "paper"
# Spec argument fields of the experiments that take several (experiments/<stem>.py:a,b,c).
SPEC_ARGS = {"c4_scaling": ("scale", "label", "M"), "claims": ("scale", "label", "M"),
             "dolma_overtraining": ("scale", "tokens", "label", "M"), "ablate_compression": ("scale", "scheme"),
             "ablate_replicas": ("scale", "M", "fixed"), "ablate_H": ("scale", "variant"),
             "fedpart": ("scale", "freeze"), "eager": ("scale", "row", "base")}
CONFIG_COLS = ("data", "vocab", "scale", "method", "H", "tau", "replica_tau", "alpha", "codec", "codec_keep_fraction",
               "layers_per_fragment", "pattern", "replicas", "batch_size", "seq_len", "steps", "freeze_non_syncing")
SUMMARY_COLS = ("data_store", "final_eval_loss", "bytes_exchanged_total", "bytes_peak_per_sync", "syncs", "params",
                "fragments", "tokens", "wall_seconds")
TASKS = ("hellaswag", "piqa", "arc_easy")


# -- loading -----------------------------------------------------------------------------------------
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


def data_order(cfg: dict, summ: dict | None) -> str:
    """How a run's batches were ordered: 'store' (every spec read through a token store by global index, #30:
    summary.json says data_order, or the run read tokens:) or the per-host shard reader's order before #30;
    '' for an unfinished run of a corpus spec (its record does not say)."""
    if (summ or {}).get("data_order") or str(cfg.get("data", "")).startswith("tokens:"):
        return "store"
    return "per-host shards (before #30)" if summ else ""


def load_runs(root: str | Path) -> pd.DataFrame:
    """One row per run folder (a folder with config.json) anywhere under root."""
    rows, orders = [], {}
    for cfg_path in sorted(Path(root).rglob("config.json")):
        wd = cfg_path.parent
        if "ckpt" in wd.parts:
            continue
        cfg = read_json(cfg_path)
        if "method" not in cfg:
            continue
        point = read_json(wd / "point.json")
        summ = read_json(wd / "summary.json")
        failed = read_json(wd / "failed.json")
        base, seed = base_name(wd.name)
        sf = point.get("sweep_file", "")
        if sf:
            sf = str(Path(sf).relative_to(REPO)) if Path(sf).is_absolute() and REPO in Path(sf).parents else sf
            sf += f":{point['sweep_arg']}" if point.get("sweep_arg") else ""
        row = {"sweep": point.get("sweep", wd.parent.name), "point": wd.name, "workdir": str(wd),
               "base_point": point.get("base_point", base), "seed": point.get("seed", cfg.get("seed", seed)),
               "sweep_file": sf,
               "finished": time.strftime("%Y-%m-%d %H:%M", time.gmtime((wd / "summary.json").stat().st_mtime))
               if summ else "",
               "status": "done" if summ else ("failed" if failed else "incomplete"),
               "spec": point.get("spec", ""), "command": point.get("command", "")}
        row.update({k: cfg.get(k) for k in CONFIG_COLS})
        row["data_order"] = data_order(cfg, summ)
        row["outer_lr"] = (cfg.get("outer") or {}).get("lr") if cfg.get("method") != "dp" else None
        row["label"] = methods.paper_label(cfg)
        stem, _, arg = row["spec"].partition(":")
        stem = Path(stem).stem
        for name, val in zip(SPEC_ARGS.get(stem, ()), arg.split(",") if arg else ()):
            row[f"arg_{name}"] = val
        if "arg_label" in row:  # the setting's H as the paper names it (toy twins shrink H 3×); the variant
            row["label"] = methods.paper_label(cfg, methods.split_h(row["arg_label"])[1])  # is what ran
        for k, v in (point.get("point") or {}).items():
            if k != "arg":
                row[f"ax_{k}"] = v
        row["point_index"] = _sweep_order(point, orders).get(wd.name) if point.get("sweep_file") else None
        row["axis_order"] = ",".join(f"ax_{k}" for k in point.get("axes", point.get("point") or {}) if k != "arg")
        if summ:
            row.update({k: summ.get(k) for k in SUMMARY_COLS})
            row["H"] = summ.get("H")  # None for DP
            row["tokens_per_param"] = summ["tokens"] / summ["params"] if summ.get("tokens") and summ.get("params") else None
            sizes = summ.get("fragment_sizes") or []
            row["largest_fragment_share"] = max(sizes) / sum(sizes) if sizes else 1.0
            for t in TASKS:
                row[t] = (summ.get("downstream") or {}).get(t, {}).get("acc") if isinstance(
                    (summ.get("downstream") or {}).get(t), dict) else (summ.get("downstream") or {}).get(t)
        if failed:
            row["error"] = ((failed.get("error_tail") or "").splitlines() or [""])[-1][:200]
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


# -- seeds: mean ± std, paired gaps ---------------------------------------------------------------------
# A row of a table is one setting (a sweep point) over its seeds. Its eval loss is printed as
# mean ± sample standard deviation (ddof=1) over the n seeds. A gap between two settings is the mean
# over seeds of the per-seed gap (paired: seed s of both rows shares its initialisation and data
# order). In the tables (paired_gap_pct) its uncertainty is twice the standard error of
# that mean, 2·sd/√n (≈ a 95 % interval for large n, too narrow for n = 2–3), and a gap is called a
# difference only when |gap| > it; with fewer than 2 paired seeds it is never called one. The claims'
# verdicts use Student's t instead (t_quantile, paired_stats, welch, seeds_needed below).
def mean_std(values) -> tuple[float, float, int]:
    """(mean, sample std with ddof=1 — NaN below 2 values, n) of the finite values."""
    v = np.array([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    if not len(v):
        return np.nan, np.nan, 0
    return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else np.nan, len(v)


def paired_stats(a: dict, b: dict, pct: bool = True) -> tuple[float, float, int]:
    """(mean, sample sd, n) of the per-seed differences over the seeds both have: 100·(a_s/b_s − 1) in %
    (pct), else a_s − b_s; sd is NaN below 2 seeds, mean NaN with none."""
    common = sorted(set(a) & set(b))
    d = [100.0 * (a[s] / b[s] - 1.0) for s in common if b[s]] if pct else [a[s] - b[s] for s in common]
    return mean_std(d)


def paired_gap_pct(a: dict, b: dict) -> tuple[float, float, int]:
    """Gap of a over b in %, paired by seed: (mean of 100·(a_s/b_s − 1), 2·sd/√n, n); the uncertainty
    is NaN with fewer than 2 shared seeds (then n=1 gives the one gap, n=0 NaN)."""
    m, sd, n = paired_stats(a, b)
    return m, (2.0 * sd / math.sqrt(n) if n > 1 else np.nan), n


# -- the claims' intervals: Student's t ----------------------------------------------------------------
# A claim's interval is mean ± t·SE, two-sided at CONFIDENCE, with t from Student's t distribution at
# df = n − 1 for n paired seeds: exact for normally distributed per-seed differences, whatever n. With
# n = 2 t is 12.71 (±2·SE would be a 70 % interval), n = 3: 4.30, n = 8: 2.36, → 1.96 as n grows.
# Not a paired bootstrap: with 2–8 seeds a bootstrap has only a handful of distinct resamples (3 at
# n = 2) and its percentile interval is narrower than even ±2·SE (it treats the sample's spread as the
# truth), which is the over-confidence we are removing.
CONFIDENCE = 0.95  # two-sided, of every claims interval (results/claims.md says so in its header)
POWER = 0.8  # of seeds_needed


def t_quantile(df: float, confidence: float = CONFIDENCE) -> float:
    """The two-sided critical value t_{(1+confidence)/2, df} (df = 1: 12.706; 2: 4.303; 7: 2.365)."""
    from scipy import stats

    return float(stats.t.ppf(0.5 + confidence / 2, df))


def welch(m1: float, s1: float, n1: int, m2: float, s2: float, n2: int) -> tuple[float, float, float]:
    """(m1 − m2, its standard error √(s1²/n1 + s2²/n2), Welch–Satterthwaite degrees of freedom) for two
    independent means (e.g. one gap at two scales: different runs, nothing to pair)."""
    a, b = s1 ** 2 / n1, s2 ** 2 / n2
    df = (a + b) ** 2 / (a ** 2 / (n1 - 1) + b ** 2 / (n2 - 1)) if a + b > 0 else float(min(n1, n2) - 1)
    return m1 - m2, math.sqrt(a + b), df


def seeds_needed(mean: float, sd: float, lo: float, hi: float, power: float = POWER,
                 cap: int = 10_000) -> int | None:
    """The smallest number of paired seeds n for which the claims' t-interval (mean ± t_{n−1}·sd/√n) would
    decide [lo, hi] with probability ≥ power, if the true mean and sd are the observed ones: a standard
    power calculation (the one-sample t-test's, exact through the noncentral t). Deciding means the
    interval clears the band's edge(s) on the side the mean is: inside the band it must clear both
    finite edges (agrees; power ≥ 1 − P(miss lo) − P(miss hi), conservative), outside it the nearer edge
    (disagrees). None when no n ≤ cap does (e.g. the mean sits on an edge) or sd is unknown. By hand:
    mean 0, sd 1, band (−∞, 0.5] (effect size 0.5) needs 34 seeds, (−∞, 1] needs 10 — the textbook
    one-sample values, ≈ ((z₀.₉₇₅ + z₀.₈)/d)² + z₀.₉₇₅²/2."""
    from scipy import stats

    if not (np.isfinite(mean) and np.isfinite(sd)) or sd < 0:
        return None
    n = np.arange(2, cap + 1)
    df = n - 1
    tc = stats.t.ppf(0.5 + CONFIDENCE / 2, df)

    def clears(dist: float) -> np.ndarray:  # P(the interval lies beyond an edge `dist` ≥ 0 from the mean)
        if sd == 0:
            return np.full(n.shape, float(dist > 0))
        return stats.nct.sf(tc, df, dist * np.sqrt(n) / sd)

    if lo < mean < hi:
        p = 1.0 - sum(1.0 - clears(d) for d in (mean - lo, hi - mean) if np.isfinite(d))
    else:
        p = clears(mean - hi if mean >= hi else lo - mean)
    ok = np.flatnonzero(p >= power)
    return int(n[ok[0]]) if len(ok) else None


def collapse(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (sweep, base point): its seeds' runs folded. final_eval_loss becomes the mean over
    the finished seeds, with eval_loss_std, n (finished seeds), seeds ("0,1,2") and losses ({seed:
    loss}, for paired gaps); other columns are seed 0's (or the first run's)."""
    if df.empty:
        return df
    rows = []
    for (_, _), g in df.groupby(["sweep", "base_point"], sort=False):
        g = g.sort_values("seed", kind="stable")
        done = g[g.status == "done"]
        first = (done if len(done) else g).iloc[0].to_dict()
        losses = {int(r.seed): float(r.final_eval_loss) for r in done.itertuples()
                  if r.final_eval_loss is not None and np.isfinite(r.final_eval_loss)}
        m, sd, n = mean_std(losses.values())
        first.update(point=first["base_point"], final_eval_loss=m, eval_loss_std=sd, n=n, losses=losses,
                     seeds=",".join(str(k) for k in losses), status="done" if n else first["status"],
                     finished=max((f for f in done.get("finished", pd.Series(dtype=str)) if f), default=""))
        for t in TASKS:
            if t in done:
                first[t] = mean_std(done[t].tolist())[0] if done[t].notna().any() else np.nan
        rows.append(first)
    return pd.DataFrame(rows).reset_index(drop=True)


def paper(name: str) -> pd.DataFrame:
    return pd.read_csv(PAPER_DIR / f"{name}.csv")


def agg_runs(runs: pd.DataFrame | None, sweep: str, base_point: str) -> list[dict]:
    """[{seed, workdir}] of the finished runs in `runs` (load_runs) behind one row of collapse()."""
    if runs is None or runs.empty:
        return []
    g = runs[(runs.sweep == sweep) & (runs.base_point == base_point) & (runs.status == "done")]
    return g[["seed", "workdir"]].to_dict("records")
