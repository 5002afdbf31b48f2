"""What `diloco reproduce` writes besides the runs' tables: the headline numbers (results/headline.json,
`headline`, `merge_headline`) and results/README.md (`write_readme`: the steps, every sweep behind a
committed table, the headline, every generated file)."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

from diloco.sweep_status import read_json

REPO = Path(__file__).resolve().parents[1]

# -- --beyond: what researchers compare Streaming DiLoCo with today (#33), default root runs/eager ----------
BEYOND_PLAN = [("eager_table2", "sweeps/eager.py:table2,tiny"), ("eager_table3", "sweeps/eager.py:table3,tiny"),
               ("compression_ef", "sweeps/compression.py:tiny,ef"), ("compression", "sweeps/compression.py:tiny")]
BEYOND_TABLES = "tables and plots (--beyond)"
BEYOND_TITLE = "[EU] eager updates and 2-bit ± error feedback (#33, `diloco reproduce --beyond`)"
BEYOND_TEXT = ("`table2_eager.md` / `table3_eager.md`: [EU] (arXiv 2502.12996) Tables 2 and 3 beside ours; "
               "`ablation_compression_ef_tiny.md`: FP32, FP4, 2-bit (int2), each ± error feedback; "
               "`ablation_compression_tiny.md`: the compression ablation with its int2 and error-feedback rows; "
               "verdicts in `claims.md`. Made by the steps `eager_table2`, `eager_table3`, `compression_ef` and "
               "`compression` (commands in the Steps table; seeds, runs and data order per sweep in the list "
               "of sweeps), then `diloco tables` over their root.")


def _ratio(a, b) -> float | None:
    return float(a) / float(b) if b and a == a and b == b else None  # None for 0 or NaN (a run without syncs)


def headline(root: Path) -> dict:
    """The acceptance numbers: Streaming's gap to DP, bytes ratio, peak ratio; τ/α trends."""
    from diloco.report import load_runs

    df = load_runs(root)
    df = df[df.status == "done"]
    out: dict = {"scaling": [], "tau_alpha": {}}
    sc = df[df.sweep.str.startswith("c4_scaling")]
    for scale, g in sc.groupby("scale", sort=False):
        by = {r.label: r for r in g.itertuples()}
        dp, dil = by.get("data_parallel"), next((r for k, r in by.items() if k.startswith("diloco")), None)
        for lab, r in by.items():
            if not lab.startswith("streaming") or dp is None:
                continue
            out["scaling"].append({
                "scale": scale, "method": lab, "H": r.H, "eval_loss": r.final_eval_loss, "dp_eval_loss": dp.final_eval_loss,
                "diloco_eval_loss": dil.final_eval_loss if dil else None,
                "gap_to_dp_pct": 100 * (r.final_eval_loss / dp.final_eval_loss - 1),
                "bytes_ratio_to_dp": _ratio(r.bytes_exchanged_total, dp.bytes_exchanged_total),
                "peak_ratio_to_diloco": _ratio(r.bytes_peak_per_sync, dil.bytes_peak_per_sync) if dil else None})
    ta = df[df.sweep.str.startswith("tau_alpha")]
    for r in ta.itertuples():
        out["tau_alpha"].setdefault(f"alpha={float(r.alpha):g}", {})[int(r.tau)] = r.final_eval_loss
    return out


def merge_headline(new: dict, old: dict) -> dict:
    """The committed headline with what this root regenerated: a scaling row replaces the committed row
    of its (scale, method) in place, a τ×α loss the committed value of its (α, τ); rows and values this
    root has no runs for are kept (as every other table merges: diloco/report/write.py)."""
    key = lambda r: (r["scale"], r["method"])
    fresh = {key(r): r for r in new.get("scaling", [])}
    scaling = [fresh.pop(key(r), r) for r in old.get("scaling", [])] + list(fresh.values())
    tau_alpha = {a: {str(t): v for t, v in d.items()} for a, d in old.get("tau_alpha", {}).items()}
    for a, d in new.get("tau_alpha", {}).items():
        tau_alpha.setdefault(a, {}).update({str(t): v for t, v in d.items()})
    return {"scaling": scaling, "tau_alpha": tau_alpha}


def headline_text(h: dict) -> str:
    lines = []
    for s in h["scaling"]:
        peak = f"×{s['peak_ratio_to_diloco']:.3f} (1/{1 / s['peak_ratio_to_diloco']:.1f})" \
            if s["peak_ratio_to_diloco"] else "n/a (no sync)"
        b = s["bytes_ratio_to_dp"] or 0.0
        lines.append(f"  {s['scale']:>5} {s['method']:<24} eval {s['eval_loss']:.4f} (DP {s['dp_eval_loss']:.4f}): "
                     f"gap to DP {s['gap_to_dp_pct']:+.2f}%, total bytes vs DP "
                     f"{f'×{b:.4f} (1/{1 / b:.0f})' if b else '0 (no sync)'}, peak vs DiLoCo {peak}")
    for a, d in sorted(h["tau_alpha"].items()):
        d = {int(t): v for t, v in d.items()}  # JSON keys are strings
        if not d:
            continue
        base = d.get(0, d[min(d)])
        pts = ", ".join(f"τ={t}: {v:.4f} ({100 * (v / base - 1):+.2f}%)" for t, v in sorted(d.items()))
        lines.append(f"  τ×α {a}: {pts}")
    al = {a: {int(t): v for t, v in d.items()} for a, d in h["tau_alpha"].items()}
    if "alpha=0" in al and "alpha=0.5" in al:
        common = sorted(set(al["alpha=0"]) & set(al["alpha=0.5"]))
        diff = ", ".join(f"τ={t}: {al['alpha=0.5'][t] - al['alpha=0'][t]:+.4f}" for t in common)
        lines.append(f"  α=0.5 minus α=0 (negative = α=0.5 better): {diff}")
    return "\n".join(lines)


def _md(rows: list[dict]) -> str:
    import pandas as pd

    from diloco.report import markdown

    return markdown(pd.DataFrame(rows)).rstrip("\n")


def sweep_seconds(root: Path, s: dict) -> tuple[float, int]:
    """(training seconds summed over the runs' own summaries, runs with a summary) of a loaded sweep:
    the cost of the runs, not of this invocation (a rerun that skips everything costs 1 s)."""
    secs, n = 0.0, 0
    for p in s["points"]:
        summ = read_json(root / s["name"] / p["name"] / "summary.json")
        if summ:
            secs += float(summ.get("wall_seconds") or 0.0)
            n += 1
    return secs, n


def _shown_argv(argv: list[str]) -> list[str]:
    """argv as the README names the invocation: without --tables-only and --note (its text is shown apart)."""
    shown, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--tables-only", "--tables_only"):
            continue
        elif a == "--note":
            skip = True
        elif not a.startswith("--note="):
            shown.append(a)
    return shown


def _group_section(title: str, text: str, names: list[str], known: dict) -> list[str]:
    """A README section for a step group: its description, then each distinct note of its steps."""
    lines = ["", f"## {title}", "", text]
    notes: dict[str, list[str]] = {}
    for n in names:
        if known.get(n, {}).get("note"):
            notes.setdefault(known[n]["note"], []).append(n)
    for note, ns in notes.items():
        lines += ["", "The run records of " + ", ".join(f"`{n}`" for n in ns) + f": {note}"]
    return lines


def recorded_sweeps(out: Path, root: Path) -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
    """From out/runs.csv: sweep → (its spec, the root its runs were under), and sweep → "(8 seeds, 64 runs;
    data order: …)"."""
    import pandas as pd

    sweeps: dict[str, tuple[str, str]] = {}  # sweep → (spec, root its runs were under)
    counts: dict[str, str] = {}  # sweep → "(8 seeds, 64 runs; data order: …)"
    runs_csv = out / "runs.csv"
    if runs_csv.exists():
        try:
            df = pd.read_csv(runs_csv)
            for sweep, g in df.groupby("sweep", sort=False):
                k = g["seed"].nunique() if "seed" in g else 0
                orders = g["data_order"].dropna().unique() if "data_order" in g else []
                counts[sweep] = (f" ({k} seed{'s' * (k != 1)}, " if k else " (") + f"{len(g)} run{'s' * (len(g) != 1)}" + (
                    f"; data order: {orders[0]}" if len(orders) == 1 else "") + ")"
            for r in df.itertuples():
                wd = Path(str(getattr(r, "workdir", "")))
                where = str(wd.parent.parent) if wd.parts else str(root)
                f = getattr(r, "sweep_file", "")
                if not (isinstance(f, str) and f):  # older records: <stem>_<arg> → sweeps/<stem>.py:<arg>
                    stem, _, arg = r.sweep.rpartition("_")
                    f = f"sweeps/{stem}.py:{arg}" if stem and (REPO / "sweeps" / f"{stem}.py").exists() else ""
                sweeps.setdefault(r.sweep, (f, where))
        except (OSError, ValueError, AttributeError):
            pass
    return sweeps, counts


def write_readme(out: Path, root: Path, argv: list[str], steps: list[tuple[str, str, float, int]], h: dict,
                 history: list[dict] = (), note: str = "", trained: set[str] = frozenset()) -> Path:
    """results/README.md: the steps (with their runs' training time), every sweep behind a committed table
    (from runs.csv, so sweeps not rerun now stay listed), the headline and every file in out/. No wall-clock
    date: rewriting it from the same records gives the same text (the per-table dates are in provenance.json).
    `note` (--note) is kept in steps.json on each sweep step of this invocation; without one, a step keeps its
    committed note unless it has a new root or is in `trained` (it trained new runs: the note may not
    hold for them). A step group's description (BEYOND_TEXT) and its steps' notes make its own section."""
    from diloco.report.write import write_if_changed

    shown_argv = _shown_argv(argv)
    cmd = "diloco reproduce" + (" " + shlex.join(shown_argv) if shown_argv else "")
    # steps of earlier invocations (e.g. the quick job's, when this is --full) stay listed
    steps_path = out / "steps.json"
    known = read_json(steps_path)
    for name, c, secs, n in steps:
        old = known.get(name, {})
        known[name] = {"made_by": cmd, "root": str(root), "command": c, "runs": n, "run_seconds": round(secs)}
        kept = note or (old.get("note") if old.get("root") == str(root) and name not in trained else "")
        if kept and c.startswith("diloco sweep "):  # a note is on runs: a sweep step's
            known[name]["note"] = kept
    write_if_changed(steps_path, json.dumps(known, indent=1, sort_keys=True) + "\n", Path.write_text)
    made = sorted({(v["made_by"], v.get("root", "")) for v in known.values()})
    lines = ["# results/ — generated", "",
             "Made by " + "; ".join(f"`{m}` (run records under `{r}`)" for m, r in made) + ". Regenerate the "
             f"tables alone with `diloco tables --root ROOT --out {out}` (they merge: nothing committed is dropped). "
             "`results/paper/` holds the paper's numbers these are compared with (not generated). `claims.md`: "
             "each claim of the paper the toy scale can test, with a verdict. `provenance.json`: for every table, "
             "which runs it came from and when they finished.", "",
             "## Steps", "",
             "`run seconds`: the training time recorded by the runs themselves (summed; runs of earlier invocations "
             "included), not the time of this invocation, which skips finished runs.", "",
             _md([{"step": name, "made by": f"`{v['made_by']}`", "command": f"`{v['command']}`", "runs": v["runs"],
                   "run seconds": v["run_seconds"]} for name, v in sorted(known.items())])]
    sweeps, counts = recorded_sweeps(out, root)
    if sweeps:
        lines += ["", "## Sweeps in the records", "",
                  "Every sweep behind a table here (each run's exact command is in its `point.json`; `runs.csv` "
                  "has one row per run, kept even when its folder is not under this root):", ""]
        lines += [f"- `{name}`" + (f": `diloco sweep {spec} --root {where}`" if spec else "") + counts.get(name, "")
                  for name, (spec, where) in sorted(sweeps.items())]
    beyond = [n for n, _ in BEYOND_PLAN] + [BEYOND_TABLES]
    if any(n in known for n in beyond):
        lines += _group_section(BEYOND_TITLE, BEYOND_TEXT, [n for n in beyond if n in known], known)
    rest = [n for n, v in known.items() if v.get("note") and n not in beyond]
    if rest:
        lines += _group_section("Notes on the steps", "Where the runs of these steps came from (`diloco reproduce "
                                "--note`, kept in steps.json).", rest, known)
    if h.get("scaling") or h.get("tau_alpha"):
        lines += ["", "## Headline (toy scale, the quick budget)", "", "```", headline_text(h), "```"]
    lines += ["", "## Files", ""]
    for f in sorted(p for p in out.rglob("*") if p.is_file() and p.name != "README.md" and "paper" not in p.parts
                    and "overlap" not in p.parts):
        lines.append(f"- `{f.relative_to(out)}`")
    lines += [""]
    write_if_changed(out / "README.md", "\n".join(lines), Path.write_text)
    return out / "README.md"
