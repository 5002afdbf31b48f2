"""How a claims row is judged: a row's interval is mean ± t·SE of its paired per-seed gaps, Student's t at
95 % (two-sided, df = n − 1; records.py says, above CONFIDENCE, why t and not ±2·SE or a bootstrap), and
its verdict says where that interval lies against the band the paper's claim stands for.

claims.csv keeps, besides the interval, what decides it (`n`, `ours_gap_pct` = the mean, `ours_sd_pct` =
the per-seed sd, `ours_se_pct`, `ours_df`), so a row whose runs are not under the root is re-judged from
the CSV alone when the rule changes (`rejudge`; rows written before these columns existed carried ±2·SE
in `ours_unc_pct`, from which sd = unc·√n/2). `changed_from` says how a verdict moved from the table it
replaces (`mark_changes`), `seeds_needed` how many seeds would decide an inconclusive row
(records.seeds_needed), and a row with fewer seeds than its sweep plans says so ("n=2 < 3 planned").
"""
from __future__ import annotations

import functools
import math
import re

import numpy as np
import pandas as pd

from diloco.report.records import REPO, seeds_needed, t_quantile


def verdict(gap: float, unc: float, lo: float, hi: float) -> str:
    """The paper's claim as a band [lo, hi] for a gap: 'agrees' when the whole interval gap ± unc lies
    in the band, 'disagrees' when it lies wholly outside, else 'inconclusive'; with no uncertainty
    (n < 2 seeds) always 'inconclusive (n<2)'."""
    if gap is None or not np.isfinite(gap):
        return "no runs"
    if unc is None or not np.isfinite(unc):
        return "inconclusive (n<2)"
    if lo <= gap - unc and gap + unc <= hi:
        return "agrees"
    if gap + unc < lo or gap - unc > hi:
        return "disagrees"
    return "inconclusive"


def judge(mean: float, se: float, df: float, lo: float, hi: float) -> tuple[float, str]:
    """(half-width t_{df}·se of the 95 % interval, verdict) — NaN and 'inconclusive (n<2)' without an SE."""
    ci = t_quantile(df) * se if se is not None and np.isfinite(se) and df and df > 0 else np.nan
    return ci, verdict(mean, ci, lo, hi)


def _fmt_gap(g: float, u: float, n: int, planned: int | None = None, unit: str = "%") -> str:
    if g is None or not np.isfinite(g):
        return ""
    s = f"{g:+.2f}{unit}"
    short = f" < {planned} planned" if planned and n < planned else ""
    return s + (f" ± {u:.2f}{unit}" if u is not None and np.isfinite(u) else "") + f" (n={n}{short})"


def _band(lo: float, hi: float) -> str:
    f = lambda x: "−∞" if x == -np.inf else "+∞" if x == np.inf else f"{x:+g}%"
    return f"[{f(lo)}, {f(hi)}]"


def _parse_band(text) -> tuple[float, float] | None:
    """_band's text back to (lo, hi); None for a band that is not an interval of the gap (the bytes rows)."""
    m = re.fullmatch(r"\[(\S+), (\S+)\]", str(text))
    if not m:
        return None
    try:
        return tuple(-np.inf if x == "−∞" else np.inf if x == "+∞" else float(x.rstrip("%")) for x in m.groups())
    except ValueError:
        return None


@functools.lru_cache(maxsize=None)
def _sweep_seeds(group: str, scale: str) -> int | None:
    from diloco.sweep import load_sweep

    try:
        return load_sweep(f"{REPO / 'sweeps' / 'claims.py'}:{group},{scale}")["seeds"]
    except Exception:  # a group or scale sweeps/claims.py no longer has: no plan to compare with
        return None


def planned_seeds(runs: str) -> int | None:
    """Seeds sweeps/claims.py plans for the claims sweeps a row's `runs` names (the fewest, for a row
    made of two); None when it names none."""
    got = [_sweep_seeds(g, s) for g, s in re.findall(r"claims_(headline|tau_alpha|pattern|table3)_([A-Za-z0-9-]+)",
                                                       str(runs))]
    got = [k for k in got if k]
    return min(got) if got else None


def _needed_text(v: str, mean: float, sd: float, band: tuple[float, float]) -> str:
    if v != "inconclusive" or not np.isfinite(sd):
        return ""
    k = seeds_needed(mean, sd, *band)
    return str(k) if k is not None else "> 10000"


def finish(row: dict) -> dict:
    """Interval, verdict, `ours` text, seeds planned and seeds needed of a row from its mean, se, df, sd,
    n and band; rows whose band is not a gap's interval (bytes) are returned as they are."""
    band = _parse_band(row.get("band_for_verdict"))
    mean = row.get("ours_gap_pct")
    if band is None or mean is None or not np.isfinite(mean):
        return row
    n = int(row["n"])
    planned = planned_seeds(row.get("runs", ""))
    ci, v = judge(mean, row.get("ours_se_pct", np.nan), row.get("ours_df", np.nan), *band)
    row.update(ours=_fmt_gap(mean, ci, n, planned), ours_ci_pct=ci, verdict=v, seeds_planned=planned,
               seeds_needed=_needed_text(v, mean, row.get("ours_sd_pct", np.nan), band))
    return row


def rejudge(row: dict) -> dict:
    """A committed row whose runs are not under the root, judged again by today's rule from its CSV
    columns; a row from before `ours_sd_pct` (±2·SE in `ours_unc_pct`): sd = unc·√n/2, df = n − 1."""
    row = dict(row)
    unc = row.pop("ours_unc_pct", np.nan)
    n = int(row["n"]) if pd.notna(row.get("n")) else 0
    row["n"] = n
    sd = row.get("ours_sd_pct", np.nan)
    if not pd.notna(sd) and n >= 2 and pd.notna(unc):
        sd = unc * math.sqrt(n) / 2
        row.update(ours_sd_pct=sd, ours_se_pct=sd / math.sqrt(n), ours_df=n - 1)
    return finish(row)


def claim_row(claim, source, runs, mean, sd, n, band, paper_txt, note="", se=None, df=None) -> dict:
    """A claims row from the mean, sd and n of paired per-seed gaps (or an explicit se and df)."""
    if se is None:
        se = sd / math.sqrt(n) if n > 1 and np.isfinite(sd) else np.nan
        df = n - 1 if n > 1 else np.nan
    return finish({"claim": claim, "paper_source": source, "ours": "", "ours_gap_pct": mean, "ours_ci_pct": np.nan,
                   "ours_sd_pct": sd, "ours_se_pct": se, "ours_df": df, "n": n, "seeds_planned": None,
                   "paper": paper_txt, "band_for_verdict": _band(*band), "verdict": "", "changed_from": "",
                   "seeds_needed": "", "runs": runs, "note": note})


def mark_changes(c: pd.DataFrame, old: pd.DataFrame | None) -> pd.DataFrame:
    """`changed_from` of each row against the table it replaces: 'before → now' where the verdict moved;
    the old note kept where neither the verdict nor the `ours` cell moved (a rebuild from the same runs
    says the same); blank otherwise."""
    c = c.copy()
    prev = {} if old is None or old.empty else {r["claim"]: r for r in old.to_dict("records")}
    marks = []
    for r in c.itertuples():
        o = prev.get(r.claim)
        if o is None:
            marks.append("")
        elif str(o.get("verdict")).split(" (")[0] != r.verdict.split(" (")[0]:  # '(n<2)' is no verdict of its own
            marks.append(f"{o.get('verdict')} → {r.verdict}")
        elif o.get("ours") == r.ours and isinstance(o.get("changed_from"), str):
            marks.append(o["changed_from"])
        else:
            marks.append("")
    c["changed_from"] = marks
    return c
