"""`diloco tables --root DIR --ref KEY=VALUE --pairs AXIS,…`: the comparisons a researcher chooses, per
sweep, each paired by seed with a Student-t interval and a yes/no on significance.

  --ref method=dp        every other setting of the sweep against the one setting where method is dp
  --pairs tau,fragments  along each named axis: every value against the axis's first value, the sweep's
                         other axes held fixed (τ=2 vs τ=0 at P=1, and at P=2; then P=2 vs P=1 at each τ)

A key is a swept axis (a sweep point's key), a spec argument (experiments/<stem>.py's fields) or a config
field (tau, H, method, …). A gap is 100·(a_s/b_s − 1) per shared seed s; its interval is the mean ± t·SE,
t at df = n − 1, two-sided at records.CONFIDENCE (95 %); it is significant when the interval excludes 0.
Fewer than 2 shared seeds: no interval, nothing claimed.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from diloco.errors import ConfigError
from diloco.report.records import CONFIDENCE, paired_stats, t_quantile

COLUMNS = ["sweep", "by", "setting", "vs", "n", "gap_pct", "ci_low_pct", "ci_high_pct", "significant"]


def t_interval(a: dict, b: dict) -> tuple[float, float, float, int]:
    """(mean gap %, interval low, high, n) of a over b paired by seed: mean ± t_{n−1}·sd/√n at CONFIDENCE;
    the interval is NaN below 2 shared seeds (the mean too with none)."""
    m, sd, n = paired_stats(a, b)
    if n < 2:
        return m, np.nan, np.nan, n
    half = t_quantile(n - 1) * sd / math.sqrt(n)
    return m, m - half, m + half, n


def significant(lo: float, hi: float) -> str:
    """'yes' when the interval excludes 0, 'no' when it holds it, 'n<2' when there is none."""
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return "n<2"
    return "yes" if lo > 0 or hi < 0 else "no"


def norm(v) -> str | None:
    """A value as a key compares it: 2, 2.0 and "2" are "2"; True and "true" are "true"; None/NaN is None."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    if isinstance(v, (bool, np.bool_)):
        return "true" if v else "false"
    s = str(v).strip()
    try:
        f = float(s)
    except ValueError:
        return s.lower() if s.lower() in ("true", "false") else s
    return str(int(f)) if f.is_integer() else repr(f)


def parse_ref(text: str) -> dict[str, str]:
    """"method=dp,tau=0" → {"method": "dp", "tau": "0"}; one line naming the fix otherwise."""
    out = {}
    for part in (p for p in text.split(",") if p.strip()):
        k, eq, v = part.partition("=")
        if not eq or not k.strip() or not v.strip():
            raise ConfigError("--ref", f"{text!r} must look like KEY=VALUE[,KEY=VALUE], e.g. --ref method=dp")
        out[k.strip()] = v.strip()
    if not out:
        raise ConfigError("--ref", "is empty; e.g. --ref method=dp")
    return out


def column(g: pd.DataFrame, key: str, flag: str) -> str:
    """The column of `key` in one sweep's rows: its swept axis (ax_), spec argument (arg_) or config field."""
    for c in (f"ax_{key}", f"arg_{key}", key):
        if c in g and g[c].notna().any():
            return c
    keys = sorted({c.split("_", 1)[1] for c in g if c.startswith(("ax_", "arg_")) and g[c].notna().any()})
    where = f"sweep {g.sweep.iloc[0]!r}" if g.sweep.nunique() == 1 else "any sweep under --root"
    raise ConfigError(flag, f"{key!r} is not an axis or config field of {where}"
                      f"{' (its axes: ' + ', '.join(keys) + ')' if keys else ''}; e.g. tau, H, method")


def values(g: pd.DataFrame, key: str) -> pd.Series:
    """Each setting's value of `key` as --ref reads it: the swept axis where the point sets it, else the spec
    argument, else the config field (a DP point swept as method=dp beside points that do not sweep method)."""
    column(g, key, "--ref")
    v = pd.Series(None, index=g.index, dtype=object)
    for c in (f"ax_{key}", f"arg_{key}", key):
        if c in g:
            v = v.where(v.notna(), g[c].astype(object))
    return v.map(norm)


def axes(g: pd.DataFrame) -> list[str]:
    """The sweep's axis columns (swept keys and spec arguments but the scale) that vary or are set."""
    return [c for c in g if c.startswith(("ax_", "arg_")) and c != "arg_scale" and g[c].notna().any()]


def _row(sweep: str, by: str, a, b) -> dict:
    m, lo, hi, n = t_interval(a.losses or {}, b.losses or {})
    return {"sweep": sweep, "by": by, "setting": a.point, "vs": b.point, "n": n, "gap_pct": m,
            "ci_low_pct": lo, "ci_high_pct": hi, "significant": significant(lo, hi)}


def ref_mask(g: pd.DataFrame, ref: dict[str, str]) -> pd.Series:
    """Which settings of one sweep match every KEY=VALUE of ref."""
    hit = pd.Series(True, index=g.index)
    for k, v in ref.items():
        hit &= values(g, k) == norm(v)
    return hit


def against_ref(g: pd.DataFrame, ref: dict[str, str]) -> list[dict]:
    """Every setting of one sweep against the one setting matching all of ref; [] when none matches."""
    hit = ref_mask(g, ref)
    if hit.sum() > 1:
        names = ", ".join(g[hit].point.head(4))
        raise ConfigError("--ref", f"{_show(ref)} matches {int(hit.sum())} settings of sweep {g.sweep.iloc[0]!r} "
                          f"({names}); add KEY=VALUE to name one")
    if not hit.any():
        return []
    b = next(g[hit].itertuples())
    return [_row(b.sweep, "ref " + _show(ref), a, b) for a in g[~hit].itertuples()]


def along(g: pd.DataFrame, key: str) -> list[dict]:
    """Along one axis of one sweep: each value against the first (in the sweep file's order, else the smallest),
    the other axes fixed."""
    col = column(g, key, "--pairs")
    g = g[g[col].notna()]
    num = pd.to_numeric(g[col], errors="coerce")
    if "point_index" in g and g.point_index.notna().all():
        g = g.sort_values("point_index", kind="stable")
    elif num.notna().all():
        g = g.iloc[np.argsort(num.to_numpy(), kind="stable")]
    rest = [c for c in axes(g) if c != col]
    keys = g[rest].map(norm).astype(str).agg("|".join, axis=1) if rest else pd.Series("", index=g.index)
    out = []
    for _, grp in g.groupby(keys, sort=False):
        first = norm(grp[col].iloc[0])
        b = next(grp[grp[col].map(norm) == first].itertuples())
        out += [_row(b.sweep, key, a, b) for a in grp[grp[col].map(norm) != first].itertuples()]
    return out


def _has(g: pd.DataFrame, key: str) -> bool:
    return any(c in g and g[c].notna().any() for c in (f"ax_{key}", f"arg_{key}", key))


def _show(ref: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in ref.items())


def compare_table(agg: pd.DataFrame, ref: dict[str, str] | None, pairs: list[str]) -> pd.DataFrame:
    """The chosen comparisons over collapsed records (records.collapse), sweep by sweep; a --ref that
    matches no setting of any sweep, or an unknown key, is one line (ConfigError)."""
    done = agg[agg.status == "done"]
    if done.empty:
        raise ConfigError("--root", "no finished setting to compare; finish some points first (diloco sweep --status)")
    for k in ref or {}:
        column(done, k, "--ref")  # a key no sweep has is refused once, not per sweep
    for k in pairs:
        column(done, k, "--pairs")
    rows, paired, matched = [], [], False
    for sweep in done.sweep.unique():
        g = done[done.sweep == sweep]
        if ref and all(_has(g, k) for k in ref):
            matched |= bool(ref_mask(g, ref).any())
            rows += against_ref(g, ref)
        paired += [r for key in pairs if _has(g, key) for r in along(g, key)]
    if ref and not matched:
        k = next(iter(ref))
        seen = sorted({v for v in values(done, k).dropna()})
        raise ConfigError("--ref", f"{_show(ref)} matches no finished setting under --root ({k} is "
                          f"{', '.join(seen[:8])}{', …' if len(seen) > 8 else ''}); e.g. --ref {k}={seen[0]}")
    rows += paired
    if pairs and not paired:
        raise ConfigError("--pairs", f"{','.join(pairs)}: no axis has two values among the finished settings")
    return pd.DataFrame(rows, columns=COLUMNS)


NOTES = (f"Gaps of `setting` over `vs` in %, paired by seed (mean of 100·(a_s/b_s − 1) over the n shared seeds); "
         f"`ci_*`: the {CONFIDENCE:.0%} Student-t interval, mean ± t(n−1)·SE; `significant`: yes when the interval "
         "excludes 0 (n<2: no interval, nothing claimed). `by`: the reference (--ref) or the axis (--pairs) the "
         "pair differs in, the sweep's other axes held fixed.")
