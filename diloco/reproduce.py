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
from diloco.reproduce_results import (BEYOND_PLAN, BEYOND_TABLES, headline, headline_text, merge_headline,
                                      sweep_seconds, write_readme)

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


# -- --full: the claims table at the paper-like budget --------------------------------------------------
FULL_PLAN = [("tune_inner_lr", "sweeps/tune_inner_lr.py:tiny"), ("tune_outer_lr", "sweeps/tune_outer_lr.py:tiny"),
             ("claims_headline", "sweeps/claims.py:headline,tiny"), ("claims_tau_alpha", "sweeps/claims.py:tau_alpha,tiny"),
             ("claims_pattern", "sweeps/claims.py:pattern,toy"), ("claims_table3", "sweeps/claims.py:table3,tiny"),
             ("claims_headline_toy", "sweeps/claims.py:headline,toy")]
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


def parse_args(argv: list[str]):
    """(args, extra --config.KEY=VALUE for every run, taus, alphas), or an exit code after one bad-input line."""
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
    return args, extra, taus, alphas


def load_plan(args, root: Path, out: Path, skip: set[str], taus, alphas, extra) -> tuple[list, float]:
    """The sweeps this invocation runs, [(step name, spec, loaded sweep)] (the τ×α points filtered to
    --taus/--alphas), and its estimated seconds; says both on one line."""
    from diloco import sweep as sw

    plan = FULL_PLAN if args.full else BEYOND_PLAN if args.beyond else [
        ("scaling", f"sweeps/c4_scaling.py:{args.scale}"), ("tau_alpha", f"sweeps/tau_alpha.py:{args.ablation_scale}")]
    loaded = [(name, spec, sw.load_sweep(str(REPO / spec))) for name, spec in plan if name not in skip]
    for name, _, s in loaded:
        if name == "tau_alpha" and not (args.full or args.beyond):
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
    return loaded, est


def sweep_command(args, spec: str, root: Path, extra=()) -> str:
    """The `diloco sweep` command line a step ran (or would run)."""
    return shlex.join(["diloco", "sweep", spec, "--root", str(root), "-j", str(args.workers),
                       *([] if args.process_per_run else ["--in-process"]),
                       *[f"--set={e[len('--config.'):]}" for e in extra]])


def run_plan(args, loaded, root: Path, est: float, extra, steps: list) -> dict:
    """Train every sweep of `loaded` (resuming: finished points are skipped); each one's step appended
    to `steps`. Returns the counts of trained, skipped and failed runs and the steps that trained."""
    from diloco import sweep as sw

    # Runs of one sweep compile the same functions: share them through JAX's persistent cache.
    jax_cache = {k: os.environ.get(k, v) for k, v in (
        ("JAX_COMPILATION_CACHE_DIR", str((root / ".jax_cache").resolve())),
        ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0"), ("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1"))}
    got = {"failed": 0, "trained": 0, "skipped": 0, "fresh": set()}  # fresh: steps that trained new runs
    with Progress(root, loaded, est):
        for name, spec, s in loaded:
            _say(f"{name}: diloco sweep {spec} --root {root} -j {args.workers}")
            res = sw.run_sweep(s, root, args.workers, extra, in_process=not args.process_per_run, env=jax_cache)
            print(sw.format_table(res), flush=True)
            for key, status in (("failed", "failed"), ("trained", "done"), ("skipped", "skipped")):
                got[key] += sum(r["status"] == status for r in res)
            if any(r["status"] == "done" for r in res):
                got["fresh"].add(name)
            steps.append((name, sweep_command(args, spec, root, extra), *sweep_seconds(root, s)))
    return got


def write_results(args, argv, root: Path, out: Path, skip, steps: list, got: dict, t_start: float):
    """The quick job's bytes and simulator steps, `diloco tables`, headline.json, the history line and
    results/README.md. Returns (README path, headline, report.build's result)."""
    from diloco import report
    from diloco.report.write import write_if_changed
    from diloco.rundir import atomic_write_text
    from diloco.sweep_status import read_json

    group = args.full or args.beyond  # a named step group: no quick-job steps (bytes, simulator, τ filter)
    files: list[Path] = []
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
    if got["trained"]:
        got["fresh"].add(tables_step)
    h = merge_headline(headline(root), read_json(out / "headline.json"))  # a --full root adds nothing to it
    if h["scaling"] or h["tau_alpha"]:
        write_if_changed(out / "headline.json", json.dumps(h, indent=1) + "\n", atomic_write_text)
        files.append(out / "headline.json")
    with open(root / "reproduce_history.jsonl", "a") as f:
        f.write(json.dumps({"started": time.strftime("%Y-%m-%d %H:%M", time.localtime(t_start)),
                            "command": "diloco reproduce" + (" " + shlex.join(argv) if argv else ""),
                            "trained": got["trained"], "skipped": got["skipped"], "failed": got["failed"],
                            "minutes": round((time.time() - t_start) / 60, 2)}) + "\n")
    return write_readme(out, root, argv, steps, h, note=args.note, trained=got["fresh"]), h, built


def main(argv: list[str]) -> int:
    parsed = parse_args(argv)
    if isinstance(parsed, int):
        return parsed
    args, extra, taus, alphas = parsed
    root, out = Path(args.root), Path(args.out)
    skip = {s for s in args.skip.split(",") if s}
    t_start = time.time()
    steps: list[tuple[str, str, float, int]] = []
    try:
        loaded, est = load_plan(args, root, out, skip, taus, alphas, extra)
        if args.estimate:
            return 0
        if args.tables_only:
            steps += [(name, sweep_command(args, spec, root), *sweep_seconds(root, s)) for name, spec, s in loaded]
        got = run_plan(args, [] if args.tables_only else loaded, root, est, extra, steps)
        readme, h, built = write_results(args, argv, root, out, skip, steps, got, t_start)
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
    if got["failed"]:
        print(f"{got['failed']} run(s) failed: see {out / 'failed_runs.md'} and each run's failed.json")
    print("=" * 78)
    return 1 if got["failed"] else 0
