"""`diloco reproduce`: the paper in miniature, into results/.

With no arguments (embedded corpus, CPU): the toy scaling comparison (DP, DiLoCo H=30, Streaming
DiLoCo overlapped FP4 at H=30 and H=100, at scales tiny and toy), the bytes-exchanged tables, the
simulator's Table 4 and a τ×α ablation (scale tiny), then `diloco tables`. Every training run is a
sweep point under --root, so an interrupted reproduce picks up where it stopped.

  diloco reproduce                                   # ≈ 13 min on 2 CPU cores (--estimate: on yours): a SHORT budget
  diloco reproduce --full                            # the claims table at ≈20 tokens/parameter (hours)
  diloco reproduce --beyond                          # beyond the paper: [EU] eager updates, 2-bit ± error feedback
  diloco reproduce --data c4 --data_dir ~/tensorflow_datasets --scale 35M+100M --root gs://…

The quick job's runs are short (200–240 steps: 4 and 1.5 tokens per parameter, one seed), so its
gaps are not findings. `--full` tunes the inner lr (DP) and outer lr (DiLoCo, M=2), then runs the
claims sweeps (sweeps/claims.py: headline and τ×α at 8 seeds, the pattern ablation on toy and Table 3
by outer lr at 3; then the headline at toy, 3 seeds, ≈20 min a run) and writes results/claims.md; it
estimates the total time up front, shows a progress bar, and resumes where it stopped. `--beyond` runs
what researchers compare Streaming DiLoCo with today (#33: sweeps/eager.py [EU] Tables 2 and 3,
sweeps/compression.py 2-bit ± error feedback, 8 seeds at tiny) under runs/eager. `--note TEXT` keeps a
line on where this invocation's runs came from (e.g. the commit they ran from) beside its steps in
results/steps.json, and README.md shows it; a step that trains new runs drops its old note.
Regenerating never drops a committed table or row (diloco/report/).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

from diloco.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def _say(msg: str) -> None:
    print(f"[reproduce {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def bytes_analytic(out: Path) -> Path:
    """`diloco bytes` for the paper's 1B Dolma run (Table 1's 441 TB vs 1.10 TB)."""
    from diloco.outer import bytes_calc

    runs = [["--scale", "1B", "--tokens", "25B", "--method", "dp"],
            ["--scale", "1B", "--tokens", "25B", "--method", "diloco", "--H", "100"],
            ["--scale", "1B", "--tokens", "25B", "--method", "streaming", "--H", "100"]]
    text = ["# Analytic bytes, paper scale (1B, 25B tokens, M=2, H=100)", "",
            "Made by `diloco bytes` (docs/codecs.md); compare [SD] Table 1: DP 441 TB vs Streaming FP4 1.10 TB "
            "(≈400×), peak 8× below DiLoCo.", ""]
    for a in runs:
        buf = io.StringIO()
        with redirect_stdout(buf):
            bytes_calc.main(a)
        text += [f"## `diloco bytes {' '.join(a)}`", "", "```", buf.getvalue().rstrip(), "```", ""]
    p = out / "bytes_analytic_1B.md"
    p.write_text("\n".join(text))
    return p


def simulator(out: Path) -> list[Path]:
    """[SD] Table 4 by the compute-utilisation simulator (≈15 s); its full table is in paper_table.md."""
    from diloco.simulate import cli as sim_cli

    import re
    import shutil
    import tempfile

    sim = out / "simulator"
    sim.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO()
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        with redirect_stdout(buf):
            rc = sim_cli.main(["--paper-table", "--out", tmp])
        if rc:
            print(buf.getvalue())
            raise RuntimeError(f"diloco simulate --paper-table failed (exit {rc})")
        # the simulator states its own run time: a file that differs only there is not rewritten
        norm = lambda t: re.sub(r"(Regenerated in |\"seconds\": ?)[0-9.]+", r"\1…", t).replace(tmp, str(sim))
        for f in sorted(Path(tmp).iterdir()):
            dst = sim / f.name
            new_text = f.read_text(errors="replace")
            if dst.exists() and norm(dst.read_text(errors="replace")) == norm(new_text):
                continue
            shutil.copyfile(f, dst)
    return [sim / f"paper_table.{e}" for e in ("md", "csv", "json")]


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
        try:
            summ = json.loads((root / s["name"] / p["name"] / "summary.json").read_text())
        except (OSError, ValueError):
            continue
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


def write_readme(out: Path, root: Path, argv: list[str], steps: list[tuple[str, str, float, int]], h: dict,
                 history: list[dict] = (), note: str = "", trained: set[str] = frozenset()) -> Path:
    """results/README.md: the steps (with their runs' training time), every sweep behind a committed table
    (from runs.csv, so sweeps not rerun now stay listed), the headline and every file in out/. No wall-clock
    date: rewriting it from the same records gives the same text (the per-table dates are in provenance.json).
    `note` (--note) is kept in steps.json on each sweep step of this invocation; without one, a step keeps its
    committed note unless it has a new root or is in `trained` (it trained new runs: the note may not
    hold for them). A step group's description (BEYOND_TEXT) and its steps' notes make its own section."""
    import pandas as pd

    shown_argv = _shown_argv(argv)
    cmd = "diloco reproduce" + (" " + shlex.join(shown_argv) if shown_argv else "")
    # steps of earlier invocations (e.g. the quick job's, when this is --full) stay listed
    steps_path = out / "steps.json"
    try:
        known = json.loads(steps_path.read_text())
    except (OSError, ValueError):
        known = {}
    for name, c, secs, n in steps:
        old = known.get(name, {})
        known[name] = {"made_by": cmd, "root": str(root), "command": c, "runs": n, "run_seconds": round(secs)}
        kept = note or (old.get("note") if old.get("root") == str(root) and name not in trained else "")
        if kept and c.startswith("diloco sweep "):  # a note is on runs: a sweep step's
            known[name]["note"] = kept
    text = json.dumps(known, indent=1, sort_keys=True) + "\n"
    if not steps_path.exists() or steps_path.read_text() != text:
        steps_path.write_text(text)
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
    p = out / "README.md"
    text = "\n".join(lines)
    if not p.exists() or p.read_text() != text:
        p.write_text(text)
    return p


# -- --full: the claims table at the paper-like budget --------------------------------------------------
FULL_PLAN = [("tune_inner_lr", "sweeps/tune_inner_lr.py:tiny"), ("tune_outer_lr", "sweeps/tune_outer_lr.py:tiny"),
             ("claims_headline", "sweeps/claims.py:headline,tiny"), ("claims_tau_alpha", "sweeps/claims.py:tau_alpha,tiny"),
             ("claims_pattern", "sweeps/claims.py:pattern,toy"), ("claims_table3", "sweeps/claims.py:table3,tiny"),
             ("claims_headline_toy", "sweeps/claims.py:headline,toy")]
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
# Seconds per training step of one run while two run at once on 2 shared cores (measured: tiny 990 steps
# ≈ 120 s, toy 240 steps ≈ 230 s), used until the root has finished runs of that scale to measure.
SECONDS_PER_STEP = {"tiny": 0.12, "toy": 0.95, "toy-l": 4.0}


def estimate_seconds(root: Path, loaded: list[tuple[str, str, dict]], workers: int,
                     extra: list[str] = (), committed: Path | None = None) -> tuple[float, int]:
    """(wall seconds, runs) left: each unfinished point's steps × seconds per step, measured from the
    finished runs of the same sweep under root, else of the same sweep in the `committed` run records
    (results/runs.csv: a fresh clone's root is empty, and toy's claims runs take 0.35 s/step where its
    quick runs take 0.95), else of the same scale under root (any sweep: specs of one scale differ in
    eval and checkpoint cadence, so per step they can differ 3×), else SECONDS_PER_STEP; over `workers`."""
    import pandas as pd

    from diloco.config import load_config

    by_sweep: dict[str, list[float]] = {}
    by_scale: dict[str, list[float]] = {}
    for p in root.glob("*/*/summary.json"):
        try:
            s = json.loads(p.read_text())
            c = json.loads((p.parent / "config.json").read_text())
            per = float(s["wall_seconds"]) / float(c["steps"])
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
            continue
        by_scale.setdefault(c["scale"], []).append(per)
        by_sweep.setdefault(p.parent.parent.name, []).append(per)
    try:
        rec = pd.read_csv(committed, usecols=["sweep", "status", "steps", "wall_seconds"]) if committed else None
    except (OSError, ValueError):
        rec = None
    if rec is not None:
        rec = rec[(rec.status == "done") & (pd.to_numeric(rec.steps, errors="coerce") > 0)]
        for sweep, g in rec.groupby("sweep"):
            per = (pd.to_numeric(g.wall_seconds, errors="coerce") / pd.to_numeric(g.steps)).dropna().tolist()
            if per and sweep not in by_sweep:
                by_sweep[sweep] = per
    total, n = 0.0, 0
    for _, _, s in loaded:
        for pt in s["points"]:
            if (root / s["name"] / pt["name"] / "summary.json").exists():
                continue
            try:
                cfg = load_config(str(REPO / pt["spec"]), [*pt["overrides"], *extra])
                scale, steps = cfg.scale, cfg.steps
            except Exception:
                scale, steps = "tiny", 1000
            per = sorted(by_sweep.get(s["name"]) or by_scale.get(scale) or [SECONDS_PER_STEP.get(scale, 1.0)])
            total += per[len(per) // 2] * steps + 10.0  # + start-up and compile
            n += 1
    return total / max(1, workers), n


class Progress:
    """A progress bar on one line, redrawn by a thread as run folders get their summary.json."""

    def __init__(self, root: Path, loaded, total_s: float):
        import threading

        self.root, self.loaded, self.total_s, self.t0 = root, loaded, total_s, time.time()
        self.paths = [root / s["name"] / p["name"] / "summary.json" for *_, s in loaded for p in s["points"]]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.last = -1

    def line(self) -> str:
        done = sum(p.exists() for p in self.paths)
        n = len(self.paths)
        w = 30
        fill = int(w * done / max(1, n))
        el = (time.time() - self.t0) / 60
        return f"[{'#' * fill}{'.' * (w - fill)}] {done}/{n} runs, {el:.1f} min elapsed (estimate {self.total_s / 60:.0f} min)"

    def loop(self):
        while not self.stop.wait(15):
            done = sum(p.exists() for p in self.paths)
            if done != self.last:
                self.last = done
                _say(self.line())

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        _say(self.line())


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="diloco reproduce", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="runs/reproduce", help="where the runs go (resumable; default runs/reproduce)")
    ap.add_argument("--out", default="results", help="tables, plots and README.md (default results/)")
    ap.add_argument("--scale", default="tiny+toy", help="'+'-joined scales of the scaling comparison "
                    "(default tiny+toy; paper scales 35M…4B need --data c4)")
    ap.add_argument("--ablation_scale", "--ablation-scale", default="tiny", help="scale of the τ×α ablation")
    ap.add_argument("--data", default="", help="stdlib (default, embedded) | c4 | dolma:<glob> | jsonl:<glob> …")
    ap.add_argument("--data_dir", "--data-dir", default="", help="TFDS data_dir for --data c4")
    ap.add_argument("--workers", "-j", type=int, default=2, help="training processes at once (default 2)")
    ap.add_argument("--skip", default="", help="comma list of steps to skip: scaling,tau_alpha,simulator,bytes")
    ap.add_argument("--taus", default="0,1,2,5,10,20", help="τ values of the τ×α ablation (< H = 30)")
    ap.add_argument("--alphas", default="0,0.5", help="α values of the τ×α ablation")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra --config.KEY=VALUE for every run (e.g. steps=20 for a smoke test; use a new --root)")
    ap.add_argument("--process_per_run", "--process-per-run", action="store_true",
                    help="one process per run (slower start-up) instead of --workers long-lived worker processes")
    ap.add_argument("--full", action="store_true",
                    help="the claims table at ≈20 tokens/parameter (experiments/claims.py): lr tuning, then "
                         "sweeps/claims.py; default root runs/full. Hours on 2 cores; resumable")
    ap.add_argument("--beyond", action="store_true",
                    help="beyond the paper (#33): [EU] Tables 2 and 3 (sweeps/eager.py) and 2-bit ± error feedback "
                         "(sweeps/compression.py:tiny,ef and :tiny) at tiny, 8 seeds; default root runs/eager")
    ap.add_argument("--note", default="", help="where this invocation's runs came from (e.g. the commit they ran "
                    "from): kept in results/steps.json beside its steps and shown in README.md")
    ap.add_argument("--estimate", action="store_true", help="print the plan and time estimate, run nothing")
    ap.add_argument("--tables_only", "--tables-only", action="store_true",
                    help="train nothing: tables, claims and README.md from the runs already under --root")
    args = ap.parse_args(argv)
    if args.full and args.beyond:
        print("diloco reproduce: bad input: --full and --beyond are separate step groups: run one, then the other",
              file=sys.stderr)
        return 2
    if args.full and args.root == "runs/reproduce":
        args.root = "runs/full"
    if args.beyond and args.root == "runs/reproduce":
        args.root = "runs/eager"
    group = args.full or args.beyond  # a named step group: no quick-job steps (bytes, simulator, τ filter)
    from diloco import report, sweep as sw

    root, out = Path(args.root), Path(args.out)
    skip = {s for s in args.skip.split(",") if s}
    extra = []
    if args.data:
        extra.append(f"--config.data={args.data}")
    if args.data_dir:
        extra.append(f"--config.data_dir={args.data_dir}")
    for kv in args.set:
        k, eq, v = kv.partition("=")
        if not (k and eq):
            print(f"diloco reproduce: bad input: --set {kv!r} must look like KEY=VALUE", file=sys.stderr)
            return 2
        extra.append(f"--config.{k}={v}")
    try:
        taus = [int(t) for t in args.taus.split(",") if t]
        alphas = [float(a) for a in args.alphas.split(",") if a]
    except ValueError:
        print("diloco reproduce: bad input: --taus/--alphas must be comma-separated numbers, e.g. --taus 0,1,5", file=sys.stderr)
        return 2
    # Runs of one sweep compile the same functions: share them through JAX's persistent cache.
    jax_cache = {k: os.environ.get(k, v) for k, v in (
        ("JAX_COMPILATION_CACHE_DIR", str((root / ".jax_cache").resolve())),
        ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0"), ("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1"))}
    t_start = time.time()
    steps: list[tuple[str, str, float]] = []
    files: list[Path] = []
    try:
        plan = [("scaling", f"sweeps/c4_scaling.py:{args.scale}"), ("tau_alpha", f"sweeps/tau_alpha.py:{args.ablation_scale}")]
        if args.full:
            plan = FULL_PLAN
        if args.beyond:
            plan = BEYOND_PLAN
        loaded = [(name, spec, sw.load_sweep(str(REPO / spec))) for name, spec in plan if name not in skip]
        for name, _, s in loaded:
            if group:
                break
            if name == "tau_alpha":
                s["points"] = [p for p in s["points"] if int(p["point"]["tau"]) in taus
                               and float(p["point"]["alpha"]) in alphas]
        n = sum(len(s["points"]) for *_, s in loaded)
        counts = ", ".join(f"{s['name']}: {len(s['points'])}" for *_, s in loaded)
        est, left = estimate_seconds(root, loaded, args.workers, extra, committed=out / "runs.csv")
        budget = ("the claims budget: ≈20 tokens/parameter, ≥30 outer rounds per fragment; seeds "
                  + ", ".join(f"{s['name']} {s['seeds']}" for *_, s in loaded) if args.full
                  else "beyond the paper at tiny (200 steps): seeds " + ", ".join(
                      f"{s['name']} {s['seeds']}" for *_, s in loaded) if args.beyond
                  else "a SHORT budget (200–240 steps, one seed): quick to run, its gaps are not findings; "
                       "`diloco reproduce --full` runs the claims table")
        _say(f"{n} training runs ({counts}), {left} left, {args.workers} at a time, under {root}; "
             f"estimated {est / 60:.0f} min of training; then tables → {out}/. Budget: {budget}")
        if args.estimate:
            return 0
        if args.tables_only:
            for name, spec, s in loaded:
                secs, nrun = sweep_seconds(root, s)
                steps.append((name, shlex.join(["diloco", "sweep", spec, "--root", str(root), "-j", str(args.workers),
                                                *([] if args.process_per_run else ["--in-process"])]), secs, nrun))
            loaded = []
        failed = trained = skipped = 0
        fresh: set[str] = set()  # steps that trained new runs
        with Progress(root, loaded, est):
            for name, spec, s in loaded:
                _say(f"{name}: diloco sweep {spec} --root {root} -j {args.workers}")
                res = sw.run_sweep(s, root, args.workers, extra, in_process=not args.process_per_run, env=jax_cache)
                print(sw.format_table(res), flush=True)
                failed += sum(r["status"] == "failed" for r in res)
                trained += sum(r["status"] == "done" for r in res)
                skipped += sum(r["status"] == "skipped" for r in res)
                if any(r["status"] == "done" for r in res):
                    fresh.add(name)
                secs, nrun = sweep_seconds(root, s)
                steps.append((name, shlex.join(["diloco", "sweep", spec, "--root", str(root), "-j", str(args.workers),
                                                *([] if args.process_per_run else ["--in-process"]),
                                                *[f"--set={e[len('--config.'):]}" for e in extra]]), secs, nrun))
        out.mkdir(parents=True, exist_ok=True)
        if "bytes" not in skip and not group:
            _say("bytes: analytic paper-scale check (diloco bytes --scale 1B …)")
            files.append(bytes_analytic(out))
            steps.append(("bytes (analytic, 1B)", "diloco bytes --scale 1B --tokens 25B --method dp|diloco|streaming --H 100",
                          0.0, 0))
        if "simulator" not in skip and not group:
            _say("simulator: diloco simulate --paper-table --out results/simulator  ([SD] Table 4)")
            files += simulator(out)
            steps.append(("simulator Table 4", f"diloco simulate --paper-table --out {out / 'simulator'}", 0.0, 0))
        _say(f"tables: diloco tables --root {root} --out {out}")
        built = report.build(root, out)
        files += built.files
        tables_step = BEYOND_TABLES if args.beyond else "tables and plots"
        steps.append((tables_step, f"diloco tables --root {root} --out {out}", 0.0, 0))
        if trained:
            fresh.add(tables_step)
        from diloco.report.write import write_if_changed
        from diloco.rundir import atomic_write_text

        try:
            committed = json.loads((out / "headline.json").read_text())
        except (OSError, ValueError):
            committed = {}
        h = merge_headline(headline(root), committed)  # a --full root adds nothing to it
        if h["scaling"] or h["tau_alpha"]:
            write_if_changed(out / "headline.json", json.dumps(h, indent=1) + "\n", atomic_write_text)
            files.append(out / "headline.json")
        hist_path = root / "reproduce_history.jsonl"
        with open(hist_path, "a") as f:
            f.write(json.dumps({"started": time.strftime("%Y-%m-%d %H:%M", time.localtime(t_start)),
                                "command": "diloco reproduce" + (" " + shlex.join(argv) if argv else ""),
                                "trained": trained, "skipped": skipped, "failed": failed,
                                "minutes": round((time.time() - t_start) / 60, 2)}) + "\n")
        readme = write_readme(out, root, argv, steps, h, note=args.note, trained=fresh)
    except ConfigError as e:
        print(f"diloco reproduce: bad input: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ndiloco reproduce: interrupted; run the same command to resume (finished runs under {root} are kept)",
              file=sys.stderr)
        return 130
    mins = (time.time() - t_start) / 60
    print("\n" + "=" * 78)
    print(f"diloco reproduce: done in {mins:.1f} min; {readme} lists every generated file")
    print(headline_text(h))
    if built.changed:
        print(f"{len(built.changed)} number(s) differ from the committed ones at the printed precision "
              "(listed above by diloco tables); see docs/experiments.md on what is bit-reproducible")
    if failed:
        print(f"{failed} run(s) failed: see {out / 'failed_runs.md'} and each run's failed.json")
    print("=" * 78)
    return 1 if failed else 0
