"""The figures: loss curves of a sweep's runs and an ablation's final losses (matplotlib, Agg)."""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from diloco.report.tables import ABLATION_RESULT_COLS
from diloco.rundir import read_jsonl


def save_figure(fig, path: Path) -> None:
    """savefig to a temp file beside `path`, then os.replace: readers never see half a PNG."""
    import os
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=Path(path).parent, prefix=f".{Path(path).name}.", suffix=".png")
    os.close(fd)
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


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
            m = pd.DataFrame(read_jsonl(Path(r.workdir) / "metrics.jsonl"))
            if m.empty:
                continue
            line, = ax.plot(m.step, m.train_loss.rolling(3, min_periods=1).mean(), alpha=0.35, lw=1)
            for loss_m in replica_losses(m):  # thin lines per replica (a drifting replica shows before eval)
                ax.plot(m.step, loss_m.rolling(3, min_periods=1).mean(), color=line.get_color(), alpha=0.25, lw=0.5)
            if "eval_loss" in m:
                e = m.dropna(subset=["eval_loss"])
                ax.plot(e.step, e.eval_loss, "o-", color=line.get_color(), label=f"{r.label} (M={r.replicas})")
        ax.set(title=f"{sweep}: scale {s}", xlabel="inner step", ylabel="loss (eval ●, train faint)")
        ax.legend(fontsize=7)
        ax.set_ylim(top=min(ax.get_ylim()[1], 4.5))
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def replica_losses(m: pd.DataFrame) -> list[pd.Series]:
    """Each replica's train loss per metrics row (`train_loss_replicas`, a list per row); [] when the run
    has one replica or predates the column."""
    if "train_loss_replicas" not in m:
        return []
    rows = [v if isinstance(v, list) else None for v in m.train_loss_replicas]
    n = max((len(v) for v in rows if v), default=0)
    if n < 2:
        return []
    return [pd.Series([v[i] if v and len(v) == n else math.nan for v in rows], index=m.index) for i in range(n)]


def _num(v) -> str:
    """2.0 -> '2' (a swept int read back as a float), other values as they are."""
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def ablation_axes(t: pd.DataFrame) -> list[str]:
    """The swept columns of an ablation table: not a result column, except `fragments` when it varies (a sweep
    over the fragment count P: its axis and the result column are one column)."""
    results = set(ABLATION_RESULT_COLS) - {"fragments"}
    return [c for c in t.columns if c not in results and (c != "fragments" or t[c].nunique() > 1)]


def point_labels(t: pd.DataFrame, axes: list[str]) -> list[str]:
    """One bar label per row: `label`/`method` values bare, the other axes as axis=value, ints as ints."""
    return [", ".join(str(v) if c in ("label", "method") else f"{c}={_num(v)}" for c, v in zip(axes, r)
                      if not (isinstance(v, float) and math.isnan(v))) for r in t[axes].itertuples(index=False)]


def plot_ablation(t: pd.DataFrame, sweep: str, path: Path) -> None:
    """x = the first numeric axis, one line per value of the other axes; bars when no axis is numeric."""
    t = t[(t.status == "done") & t.eval_loss.notna()]
    if t.empty:
        return
    plt = _plt()
    axes = ablation_axes(t)
    num = [c for c in axes if pd.to_numeric(t[c], errors="coerce").notna().all() and t[c].nunique() > 1]
    fig, ax = plt.subplots(figsize=(6, 4))
    if num:
        x = num[0]
        rest = [c for c in axes if c != x and t[c].nunique() > 1]
        groups = t.groupby(rest, sort=False) if rest else [("", t)]
        for key, g in groups:
            g = g.assign(x_num=pd.to_numeric(g[x])).sort_values("x_num")
            ax.errorbar(g.x_num, g.eval_loss, yerr=g["eval_loss_std"] if "eval_loss_std" in g else None, fmt="o-",
                        capsize=3, label=", ".join(f"{c}={_num(k)}" for c, k in
                                                   zip(rest, key if isinstance(key, tuple) else (key,))) or None)
        ax.set_xlabel(x)
        xs = pd.to_numeric(t[x])
        if xs.min() > 0 and (x == "H" or xs.max() / xs.min() > 50):
            ax.set_xscale("log")
        if rest:
            ax.legend(fontsize=8)
    else:
        labels = point_labels(t, axes) if axes else t.index
        ax.bar(range(len(t)), t.eval_loss, color="tab:blue",
               yerr=t["eval_loss_std"].fillna(0) if "eval_loss_std" in t else None, capsize=3)
        ax.set_xticks(range(len(t)), labels, rotation=30, ha="right", fontsize=8)
        sd = t["eval_loss_std"].fillna(0) if "eval_loss_std" in t else 0
        lo, hi = (t.eval_loss - sd).min(), (t.eval_loss + sd).max()
        ax.set_ylim(lo - 0.2 * (hi - lo + 1e-3), hi + 0.2 * (hi - lo + 1e-3))
    ax.set(ylabel="final eval loss (± std over seeds)", title=f"{sweep}")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
