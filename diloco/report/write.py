"""Writing tables without losing rows: markdown cells, merging with the committed CSV, provenance, and
the comparison of regenerated numbers with the committed ones.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd


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
    """The table as markdown; a column X with a companion X_std (sample std over seeds) or X_unc (a
    gap's uncertainty, 2·SE) prints as one cell "X ± companion" (just X when the companion is NaN)."""
    if df.empty:
        return "_(no runs)_\n"
    df = df.drop(columns=[c for c in ("losses",) if c in df])
    t = df.map(_cell)
    for c in list(df.columns):
        for suf in ("_std", "_unc"):
            if c.endswith(suf) and c[:-len(suf)] in df:
                base = c[:-len(suf)]
                t[base] = [f"{b} ± {u}" if b and u else b for b, u in zip(t[base], t[c])]
                t = t.drop(columns=[c])
    return t.to_markdown(index=False, disable_numparse=True) + "\n"


# Each table's row key: merge_committed keeps the committed rows whose key this build does not write.
KEYS = {"table5_c4_scaling": ("scale", "method", "M"), "table6_replicas_h": ("scale", "method"),
        "table1_dolma_overtraining": ("tokens", "method"), "table3_which_params": ("scale", "params_evaluated"),
        "table3_outer_lr": ("sweep", "outer_lr"), "bytes_exchanged": ("sweep", "scale", "setting"),
        "table2_eager": ("scale", "row"), "table3_eager": ("scale", "base", "row"), "claims": ("claim",), "runs": ("sweep", "point")}


def merge_committed(new: pd.DataFrame, old_csv: Path, key: tuple[str, ...]) -> tuple[pd.DataFrame, int]:
    """new plus the rows of the committed CSV whose key is not in new (so a regeneration from a partial
    set of records drops nothing). Returns (table, rows kept from the committed one)."""
    if not old_csv.exists() or not key or any(k not in new for k in key):
        return new, 0
    try:
        old = pd.read_csv(old_csv)
    except (OSError, ValueError, pd.errors.EmptyDataError):
        return new, 0
    if any(k not in old for k in key):
        return new, 0
    ks = lambda d: pd.Series(["\x1f".join(_cell(x) for x in r) for r in d[list(key)].itertuples(index=False)],
                             index=d.index, dtype=object)
    have = set(ks(new)) if len(new) else set()
    kept = old[~ks(old).isin(have)] if len(old) else old
    if kept.empty:
        return new, 0
    return pd.concat([new, kept], ignore_index=True), len(kept)


def provenance(runs: pd.DataFrame, root: Path, kept: int) -> dict:
    done = runs[runs.status == "done"] if len(runs) else runs
    fin = [f for f in done.get("finished", pd.Series(dtype=str)) if isinstance(f, str) and f]
    return {"runs": int(len(done)), "sweeps": sorted(set(done.sweep)) if len(done) else [], "root": str(root),
            "finished_first": min(fin) if fin else "", "finished_last": max(fin) if fin else "",
            "rows_kept_from_committed": kept,
            "run_seconds": round(float(pd.to_numeric(done.get("wall_seconds"), errors="coerce").sum()), 1)
            if len(done) else 0.0}


def provenance_text(pv: dict) -> str:
    s = (f"Sources: {pv['runs']} run(s) of {', '.join(f'`{x}`' for x in pv['sweeps']) or 'no sweep'} under "
         f"`{pv['root']}`, finished {pv['finished_first']} … {pv['finished_last']} UTC "
         f"({pv['run_seconds']:.0f} s of training in those runs).")
    if pv["rows_kept_from_committed"]:
        s += (f" {pv['rows_kept_from_committed']} row(s) kept from the committed table: their runs are not under "
              "this root (see results/provenance.json for where they came from).")
    return s


def _values(runs: pd.DataFrame, col: str, default=None) -> str:
    vals = runs[col].dropna().unique().tolist() if col in runs else []
    vals = sorted({_cell(v) for v in vals} or ({_cell(default)} if default is not None else set()))
    return "/".join(vals[:6]) + ("/…" if len(vals) > 6 else "") if vals else "—"


SEED_INTERVAL = "mean ± sample std over seeds, gaps paired by seed ± 2 SE"


def describe(runs: pd.DataFrame, title: str = "", interval: str = SEED_INTERVAL) -> str:
    """The header line saying what a table is: corpus (name + store fingerprint), vocabulary, scale, steps,
    H, α, codec, M, tokens per parameter, seeds n and the interval. Runs recorded before these columns
    existed read the defaults they ran with (data=stdlib, vocab=byte)."""
    done = runs[runs.status == "done"] if "status" in runs else runs
    if done.empty:
        return ""
    data = _values(done, "data", "stdlib")
    fp = _values(done, "data_store") if "data_store" in done and done.data_store.notna().any() else "not recorded"
    tpp = (pd.to_numeric(done.get("tokens"), errors="coerce") / pd.to_numeric(done.get("params"), errors="coerce"))
    tpp = "/".join(sorted({f"{v:.3g}" for v in tpp.dropna()})[:6]) or "—"
    by = [c for c in ("sweep", "base_point") if c in done]
    n = done.groupby(by).size() if by else pd.Series([len(done)])
    n = f"{n.min()}" if n.min() == n.max() else f"{n.min()}–{n.max()}"
    c4 = " (not C4: the paper's C4 numbers are only beside ours)" if "C4" in title and "c4" not in data else ""
    outer = done[done.method != "dp"] if "method" in done and (done.method != "dp").any() else done  # DP has no H
    return (f"What it is: corpus `{data}`{c4} (store {fp}), vocab {_values(done, 'vocab', 'byte')}, scale "
            f"{_values(done, 'scale')}, steps {_values(done, 'steps')}, H {_values(outer, 'H')}, α "
            f"{_values(outer, 'alpha')}, codec {_values(outer, 'codec')} (DP aside), M {_values(done, 'replicas')}, tokens per "
            f"parameter {tpp}; seeds n = {n} per setting; interval: {interval}.")


def write_table(df: pd.DataFrame, out: Path, name: str, title: str, notes: str = "",
                key: tuple[str, ...] | None = None, runs: pd.DataFrame | None = None, root: Path | None = None,
                prov: dict | None = None, interval: str = SEED_INTERVAL) -> dict:
    """CSV + markdown; with `key`, rows of the committed CSV not regenerated are kept; with `runs`, the
    markdown says which runs the table came from and when. Files whose text is unchanged are not
    rewritten. Returns the provenance entry."""
    from diloco.rundir import atomic_write_text

    kept = 0
    if key:
        df, kept = merge_committed(df, out / f"{name}.csv", key)
    pv = provenance(runs if runs is not None else pd.DataFrame(), root or Path("."), kept)
    src = f"\n\n{provenance_text(pv)}" if runs is not None else ""
    what = describe(runs, title, interval) if runs is not None and len(runs) else ""
    head = f"# {title}\n\n" + (f"{what}\n\n" if what else "")
    write_if_changed(out / f"{name}.csv", df.to_csv(index=False), atomic_write_text)
    write_if_changed(out / f"{name}.md", f"{head}{notes.strip()}{src}\n\n{markdown(df)}", atomic_write_text)
    if prov is not None:
        prov[name] = pv
    return pv


def write_if_changed(path: Path, text: str, writer) -> None:
    try:
        if path.read_text() == text:
            return
    except OSError:
        pass
    writer(path, text)


def compare_committed(old: pd.DataFrame, new: pd.DataFrame, key: tuple[str, ...], col: str = "eval_loss") -> list[str]:
    """Rows whose printed `col` (4 decimals, as the markdown) differs between the committed table and
    the regenerated one: 'key: committed → now'."""
    if old is None or new is None or old.empty or new.empty or col not in old or col not in new \
            or any(k not in old or k not in new for k in key):
        return []
    ks = lambda d: [", ".join(_cell(x) for x in r) for r in d[list(key)].itertuples(index=False)]
    o = dict(zip(ks(old), old[col]))
    lines = []
    for k, v in zip(ks(new), new[col]):
        if k in o and _cell(o[k]) != _cell(v):
            lines.append(f"{k}: {_cell(o[k])} → {_cell(v)}")
    return lines
