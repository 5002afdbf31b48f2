"""`diloco sweep sweeps/<name>.py[:arg] --root DIR`: run every point of a sweep, resumably.

A sweep file defines `get_sweep(arg: str) -> dict` with
  name        folder under --root (default: the file's stem)
  experiment  the spec every point starts from, e.g. "experiments/ablate_tau.py:toy"
  points      list of dicts: config overrides ({"tau": 5, "alpha": 0.5}); the key "arg" replaces the
              spec's argument (after the colon). Build them with product(...) / zip_(...) below.
  seeds       optional K (default 1; `--seeds K` overrides): every point runs for seed 0 … K-1, each its
              own workdir ("<point>" for seed 0, the spec's own seed; "<point>,seed=s" with
              --config.seed=s for s ≥ 1), so raising K later reuses the finished seeds.
A point runs as `python -m diloco.cli train --config SPEC --workdir ROOT/NAME/POINT --config.k=v…` in
its own process: a finished point (summary.json) is skipped, a failing one leaves failed.json with
the error tail and the rest go on, a per-point lock keeps two sweeps on one root off the same point.
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from diloco.config import REPO_ROOT, check_points, make_importable, repo_path
from diloco.errors import ConfigError
from diloco.pointlock import acquire_lock, release_lock
from diloco.rundir import flatten, require_folder
from diloco.sweep_status import read_json
from diloco.tpu import sweep_launch
from diloco import gke, slurm


# -- building points ---------------------------------------------------------------------------------
def product(*groups: list[dict], **axes: list) -> list[dict]:
    """Cartesian product of axes (and of lists of partial points): product(tau=[0, 1], alpha=[0, .5])."""
    lists = [list(g) for g in groups] + [[{k: v} for v in vals] for k, vals in axes.items()]
    for k, vals in axes.items():
        if not isinstance(vals, (list, tuple)) or not vals:
            raise ConfigError(f"sweep.{k}", f"axis {k!r} needs a non-empty list of values, got {vals!r}")
    return [dict(itertools.chain.from_iterable(d.items() for d in combo)) for combo in itertools.product(*lists)]


def zip_(**axes: list) -> list[dict]:
    """Axes zipped element-wise: zip_(codec=["topk", "dare"], codec_keep_fraction=[0.0625, 0.125])."""
    lens = {k: len(v) for k, v in axes.items()}
    if len(set(lens.values())) > 1:
        raise ConfigError("sweep", f"zip_ axes need equal lengths, got {lens}")
    return [dict(zip(axes, vals)) for vals in zip(*axes.values())]


# -- loading a sweep ---------------------------------------------------------------------------------
def _fmt(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def point_name(point: dict) -> str:
    """Stable, filesystem-safe: {"arg": "toy,2,local", "tau": 5} → "toy+2+local,tau=5"."""
    if not point:
        return "default"
    parts = [_fmt(v) if k == "arg" else f"{k}={_fmt(v)}" for k, v in point.items()]
    name = ",".join(re.sub(r"[^A-Za-z0-9._=+-]", "-", p.replace(",", "+")) for p in parts)
    return name[:200]


def seeded_name(name: str, seed: int) -> str:
    """A point's folder for one seed: seed 0 keeps the plain name (the spec's own seed)."""
    return name if seed == 0 else f"{name},seed={seed}"


def base_name(name: str) -> tuple[str, int]:
    """Inverse of seeded_name: "tau=1,seed=2" → ("tau=1", 2); "tau=1" → ("tau=1", 0)."""
    m = re.fullmatch(r"(.*),seed=(\d+)", name)
    return (m.group(1), int(m.group(2))) if m else (name, 0)


def load_sweep(spec: str, seeds: int | None = None) -> dict:
    """`sweeps/x.py[:arg]` → {"name", "experiment", "seeds", "points": [{"name", "spec", "overrides",
    "point", "seed"}]}; `seeds` overrides the sweep file's own K (default 1)."""
    path, _, arg = spec.partition(":")
    p = repo_path(path)
    if not p.is_file():
        raise ConfigError("sweep", f"sweep file {path!r} not found; e.g. diloco sweep sweeps/tau_alpha.py --root runs")
    make_importable(REPO_ROOT)
    mod_spec = importlib.util.spec_from_file_location(f"_sweep_{p.stem}", p)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    if not hasattr(mod, "get_sweep"):
        raise ConfigError("sweep", f"{p} defines no get_sweep(arg) -> dict(experiment=…, points=[…])")
    raw = mod.get_sweep(arg) if arg else mod.get_sweep()
    for k in ("experiment", "points"):
        if k not in raw:
            raise ConfigError(f"sweep.{k}", f"{p}: get_sweep() must return a dict with {k!r}")
    name = raw.get("name") or p.stem
    k = raw.get("seeds", 1) if seeds is None else seeds
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ConfigError("sweep.seeds", f"seeds must be a whole number ≥ 1, got {k!r}; e.g. --seeds 3")
    exp_path, _, exp_arg = raw["experiment"].partition(":")
    base, seen = [], {}
    for pt in raw["points"] or [{}]:
        pt = dict(pt)
        a = pt.get("arg", exp_arg)
        overrides = [f"--config.{k}={_fmt(v)}" for k, v in pt.items() if k != "arg"]
        pname = point_name(pt)
        if pname in seen:
            raise ConfigError("sweep.points", f"two points map to the same folder {pname!r}: {seen[pname]} and {pt}")
        if "seed" in pt:
            raise ConfigError("sweep.points", f"point {pt} sets 'seed'; use the sweep's seeds=K (or --seeds K)")
        seen[pname] = pt
        base.append({"name": pname, "spec": f"{exp_path}:{a}" if a else exp_path, "overrides": overrides,
                     "point": pt})
    # seed-major: every point's seed 0 first, then every point's seed 1, … (a partial run covers all points)
    points = [{**b, "name": seeded_name(b["name"], sd), "seed": sd,
               "overrides": b["overrides"] + ([f"--config.seed={sd}"] if sd else [])}
              for sd in range(k) for b in base]
    return {"name": name, "experiment": raw["experiment"], "points": points, "file": str(p), "arg": arg,
            "seeds": k}


def train_command(point: dict, workdir: Path, extra: list[str] = ()) -> list[str]:
    return [sys.executable, "-m", "diloco.cli", "train", "--config", point["spec"], "--workdir", str(workdir),
            "--no_progress", *point["overrides"], *extra]


def shown(cmd: list[str]) -> str:
    """A command as a user would type it: `diloco train …` rather than this interpreter's path."""
    prefix = [sys.executable, "-m", "diloco.cli"]
    return shlex.join(["diloco", *cmd[len(prefix):]] if cmd[:len(prefix)] == prefix else cmd)


# -- running -----------------------------------------------------------------------------------------
def _tail(path: Path, n: int = 30) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return ""
    keep = [l for l in lines if not l.startswith(("I0000", "W0000", "WARNING: All log"))]
    return "\n".join(keep[-n:])


def _train_in_process(cmd: list[str], log) -> int:
    """`diloco train` in this process (no interpreter/TensorFlow start-up per point); output → log."""
    import traceback
    from contextlib import redirect_stderr, redirect_stdout

    from diloco.train import main as train_main

    with redirect_stdout(log), redirect_stderr(log):
        try:
            return int(train_main(cmd[cmd.index("train") + 1:]) or 0)
        except KeyboardInterrupt:
            return 130
        except Exception:  # a crash of one point must not end the worker
            traceback.print_exc()
            return 1


def stale_fields(point: dict, wd: Path, extra: list[str] = ()) -> list[str]:
    """Config fields whose value in a finished run's config.json differs from what this point's spec
    resolves to now (e.g. a tuned value changed in the experiment file); [] when they agree or when
    either side cannot be read. Fields the record lacks (added to the code after the run) and fields
    now `auto` (decided when the run starts, e.g. model.scan) are not counted: their defaults keep
    earlier runs' numbers."""
    from diloco.config import load_config, to_json

    try:
        old = json.loads((wd / "config.json").read_text())
        new = json.loads(to_json(load_config(point["spec"], [*point["overrides"], *extra], check_data=False)))
    except Exception:  # no record, or a spec that no longer loads: nothing to compare
        return []
    a, b = flatten(old), flatten(new)
    dp = b.get("method") == "dp"  # DP has no outer step: its outer.* do nothing
    stale = sorted(k for k in a if k in b and a[k] != b[k] and b[k] != "auto" and not (dp and k.startswith("outer.")))
    from diloco.resolve import stale_against_record  # a recorded plan is compared instead of the `auto` text

    return stale_against_record(stale, wd / "summary.json", lambda: load_config(
        point["spec"], [*point["overrides"], *extra], check_data=False))


def run_point(sweep: dict, point: dict, root: Path, extra: list[str] = (), env: dict | None = None,
              in_process: bool = False, failed_since: float | None = None, on_start=None) -> dict:
    """Run one point to completion (a subprocess, or this process with in_process=True, main thread
    only). Returns a result row (status done|skipped|locked|failed)."""
    from diloco.rundir import atomic_write_json

    wd = root / sweep["name"] / point["name"]
    row = {"sweep": sweep["name"], "point": point["name"], "workdir": str(wd)}
    if (wd / "summary.json").exists():
        changed = stale_fields(point, wd, extra)
        if changed:  # a record of another config: never overwritten, never passed off as this point
            return {**row, "status": "stale", "changed": changed, **_summary_bits(wd)}
        return {**row, "status": "skipped", **_summary_bits(wd)}
    if not acquire_lock(wd):
        return {**row, "status": "locked"}
    try:
        if (wd / "summary.json").exists():  # finished by another sweep between the check and the lock
            return {**row, "status": "skipped", **_summary_bits(wd)}
        f = wd / "failed.json"
        if failed_since is not None and f.exists() and f.stat().st_mtime >= failed_since:
            return {**row, "status": "locked"}  # another pool worker just tried it; not twice per sweep
        cmd = train_command(point, wd, extra)
        atomic_write_json(wd / "point.json", {"sweep": sweep["name"], "sweep_file": sweep["file"],
                                              "sweep_arg": sweep["arg"], "experiment": sweep["experiment"],
                                              "spec": point["spec"], "point": point["point"],
                                              "seed": point.get("seed", 0), "base_point": base_name(point["name"])[0],
                                              "axes": [k for k in point["point"] if k != "arg"],
                                              "overrides": [*point["overrides"], *extra],
                                              "command": shown(cmd)})
        if on_start is not None:
            on_start()
        t0 = time.time()
        with open(wd / "train.log", "a") as log:
            log.write(f"\n$ {shlex.join(cmd)}\n")
            log.flush()
            if in_process:
                rc = _train_in_process(cmd, log)
            else:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO_ROOT),
                                    env={**os.environ, **(env or {})}).returncode
        secs = round(time.time() - t0, 1)
        if rc == 130:  # interrupted (Ctrl-C / SIGTERM): the run checkpointed itself; stop the sweep
            raise KeyboardInterrupt(f"{wd}: interrupted; rerun the sweep to resume")
        if rc == 0 and (wd / "summary.json").exists():
            (wd / "failed.json").unlink(missing_ok=True)
            return {**row, "status": "done", "seconds": secs, **_summary_bits(wd)}
        err = _tail(wd / "train.log")
        atomic_write_json(wd / "failed.json", {"returncode": rc, "command": shown(cmd), "seconds": secs,
                                               "error_tail": err, "time": time.strftime("%Y-%m-%d %H:%M:%S")})
        return {**row, "status": "failed", "seconds": secs, "returncode": rc,
                "error": (err.splitlines() or [""])[-1][:160]}
    finally:
        release_lock(wd)


def _summary_bits(wd: Path) -> dict:
    s = read_json(wd / "summary.json")
    return {k: s.get(k) for k in ("final_eval_loss", "bytes_exchanged_total", "bytes_peak_per_sync", "wall_seconds")
            } if s else {}


def run_sweep(sweep: dict, root: str | os.PathLike, workers: int = 1, extra: list[str] = (),
              only: str = "", quiet: bool = False, env: dict | None = None, in_process: bool = False) -> list[dict]:
    """Every point of `sweep` under root, `workers` at a time.

    Prints one line when a point starts and one when it ends. "k/n finished" counts the points
    with a summary on disk, so the lines of several workers (or sweeps) on one root agree.
    in_process=True: `workers` long-lived worker processes each train point after point in-process
    (saves the interpreter + TensorFlow start-up per point); the lock files share out the points."""
    root = Path(root)
    pts = [p for p in sweep["points"] if only in p["name"]]
    if in_process and workers > 1:
        return _run_pool(sweep, pts, root, workers, extra, quiet, env)
    n = len(pts)
    console = sys.stdout  # in-process training redirects sys.stdout into a run's train.log meanwhile
    say = (lambda *a: None) if quiet else (lambda msg: print(msg, file=console, flush=True))
    tag = sweep.get("label", sweep["name"])

    took: list[float] = []  # seconds of the points this invocation finished: the ETA's rate

    def finished() -> str:
        k = sum((root / sweep['name'] / p['name'] / 'summary.json').exists() for p in pts)
        return f"{k}/{n} finished" + (f", ETA {eta(took, n - k, workers)}" if took and k < n else "")

    if "label" not in sweep:  # a pool worker: the parent said it
        say(f"[{tag}] {n} point(s) under {root / sweep['name']}, {workers} at a time; {finished()}")

    def one(pt):
        wd = root / sweep["name"] / pt["name"]
        r = run_point(sweep, pt, root, extra, env, in_process, sweep.get("started"),
                      on_start=lambda: say(f"[{tag}] start   {pt['name']}  ({finished()})"))
        if r["status"] in ("locked", "skipped"):  # another worker has it / finished before: nothing changed here
            return r
        took.extend([r["seconds"]] if r["status"] == "done" and r.get("seconds") else [])
        msg = f"[{tag}] {r['status']:<7} {pt['name']}"
        msg += f"  eval_loss={r['final_eval_loss']:.4f}" if r.get("final_eval_loss") is not None else ""
        msg += f"  {r['seconds']:.0f} s" if r.get("seconds") is not None else ""
        msg += f"  ({finished()})"
        if r["status"] == "failed":
            msg += f"  rc={r['returncode']}: {r['error']}  → {wd / 'failed.json'}"
        if r["status"] == "stale":
            msg += (f"  finished with another config ({', '.join(r['changed'][:4])}"
                    f"{', …' if len(r['changed']) > 4 else ''}): kept, not rerun; move {wd} aside to rerun it")
        say(msg)
        return r

    if workers <= 1 or in_process:  # in the main thread: train() installs signal handlers
        return [one(p) for p in pts]
    with ThreadPoolExecutor(max_workers=workers) as ex:
        return list(ex.map(one, pts))


def eta(took: list[float], left: int, workers: int) -> str:
    """h:mm:ss for `left` points at the mean time of those finished so far, `workers` at a time."""
    return time.strftime("%H:%M:%S", time.gmtime(sum(took) / len(took) * -(-left // max(1, workers))))


def _run_pool(sweep: dict, pts: list[dict], root: Path, workers: int, extra: list[str], quiet: bool,
              env: dict | None) -> list[dict]:
    """`workers` processes of `diloco sweep --in-process -j 1` over the same points (locks share them)."""
    from diloco.rundir import atomic_write_json

    before = {p["name"]: (root / sweep["name"] / p["name"] / "summary.json").exists() for p in pts}
    names = root / sweep["name"] / f".points.{os.getpid()}.json"
    atomic_write_json(names, [p["name"] for p in pts])
    spec = sweep["file"] + (f":{sweep['arg']}" if sweep["arg"] else "")
    cmd = [sys.executable, "-m", "diloco.cli", "sweep", spec, "--root", str(root), "--in-process", "-j", "1",
           "--seeds", str(sweep.get("seeds", 1)),
           "--points-file", str(names), *[f"--set={e[len('--config.'):]}" for e in extra]]
    if not quiet:
        done = sum(before.values())
        print(f"[{sweep['name']}] {len(pts)} point(s) under {root / sweep['name']}, {workers} worker processes "
              f"(diloco sweep --in-process); {done}/{len(pts)} finished", flush=True)
    procs = []
    for w in range(workers):
        procs.append(subprocess.Popen(cmd + ["--worker-name", f"w{w}"], cwd=str(REPO_ROOT),
                                      env={**os.environ, **(env or {})},
                                      stdout=subprocess.DEVNULL if quiet else None))
        time.sleep(0.5)  # let the first take the first point
    try:
        for p in procs:
            p.wait()
    except KeyboardInterrupt:
        for p in procs:
            p.terminate()  # train() checkpoints on SIGTERM
        for p in procs:
            p.wait()
        raise
    finally:
        names.unlink(missing_ok=True)
    results = []
    for p in pts:
        wd = root / sweep["name"] / p["name"]
        row = {"sweep": sweep["name"], "point": p["name"], "workdir": str(wd)}
        if (wd / "summary.json").exists():
            results.append({**row, "status": "skipped" if before[p["name"]] else "done", **_summary_bits(wd)})
        else:
            f = read_json(wd / "failed.json")
            results.append({**row, "status": "failed" if f else "incomplete", "returncode": f.get("returncode"),
                            "error": ((f.get("error_tail") or "").splitlines() or [""])[-1][:160]})
    return results


def format_table(results: list[dict]) -> str:
    head = f"{'status':<8} {'eval_loss':>9} {'bytes_total':>12} {'peak/sync':>10} {'wall_s':>7}  point"
    lines = [head, "-" * len(head)]
    for r in results:
        loss_s = "" if r.get("final_eval_loss") is None else f"{r['final_eval_loss']:.4f}"
        lines.append(f"{r['status']:<8} {loss_s:>9} "
                     f"{r.get('bytes_exchanged_total') or '':>12} {r.get('bytes_peak_per_sync') or '':>10} "
                     f"{r.get('wall_seconds') or '':>7}  {r['point']}")
    counts = {s: sum(r["status"] == s for r in results) for s in ("done", "skipped", "stale", "failed", "locked")}
    lines.append(", ".join(f"{v} {k}" for k, v in counts.items() if v) or "nothing to run")
    if counts["stale"]:  # finished, but with another config: not this sweep's numbers (diloco sweep exits 1)
        lines[-1] += f"; {counts['stale']} stale point(s) hold another config's numbers: not this sweep's results"
    return "\n".join(lines)


# -- Cloud TPU ---------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser("diloco sweep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep", help="sweeps/<name>.py[:arg], e.g. sweeps/tau_alpha.py:toy")
    ap.add_argument("--root", required=True, help="folder that gets <sweep name>/<point>/ workdirs")
    ap.add_argument("--workers", "-j", type=int, default=1, help="points run at once (processes)")
    ap.add_argument("--seeds", type=int, default=None,
                    help="run every point for seeds 0…K-1 (default: the sweep file's, else 1); finished seeds are kept")
    ap.add_argument("--only", default="", help="run only points whose folder name contains this")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra --config.KEY=VALUE for "
                    "every point (changes the run: use a new --root)")
    ap.add_argument("--dry-run", "--dry_run", action="store_true", help="print the exact commands, run nothing")
    ap.add_argument("--status", action="store_true", help="one table of the points (done, running, failed, stopped, "
                    "pending; steps, last loss, ETA) from their folders; runs nothing")
    ap.add_argument("--in-process", action="store_true", help="train points inside -j long-lived worker processes "
                    "(saves the start-up per point; a crash still only fails its point unless it kills the interpreter)")
    ap.add_argument("--points-file", help=argparse.SUPPRESS)  # JSON list of point names (pool workers)
    ap.add_argument("--worker-name", default="", help=argparse.SUPPRESS)
    ap.add_argument("--launch", choices=("local", "tpu", "slurm", "gke"), default="local")
    sweep_launch.add_arguments(ap)
    slurm.add_arguments(ap)
    gke.add_arguments(ap)
    return ap


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        sweep, extra = load_sweep(args.sweep, args.seeds), []
        require_folder(args.root, "--root")
        for s in args.set:
            k, eq, v = s.partition("=")
            if not eq or not k:
                raise ConfigError("--set", f"{s!r} must look like KEY=VALUE, e.g. --set steps=50")
            extra.append(f"--config.{k.removeprefix('--config.')}={v}")
        pts = [p for p in sweep["points"] if args.only in p["name"]]
        if not pts:
            names = ", ".join(p["name"] for p in sweep["points"][:6]) + (", …" if len(sweep["points"]) > 6 else "")
            raise ConfigError("--only", f"{args.only!r} matches no point of {sweep['name']} ({names}); give part of a name")
        if args.status:
            from diloco.sweep_status import status_table

            print(status_table(sweep, Path(args.root), pts))
            return 0
        if args.launch == "tpu":  # its preflight checks every point for the pod
            return sweep_launch.launch_tpu(sweep, args, extra, argv)
        if not args.worker_name:  # a pool worker's parent checked them
            check_points(pts, extra)
        if args.launch == "slurm":
            jobs = slurm.launch(pts, sweep["name"], Path(args.root), slurm.from_args(args), extra, train_command,
                                args.dry_run)
            return slurm.report(jobs, Path(args.root), sweep["name"], args.dry_run)
        if args.launch == "gke":
            return gke.launch(pts, sweep["name"], args.root, args, extra, train_command)
        if args.dry_run:
            for pt in pts:
                wd = Path(args.root) / sweep["name"] / pt["name"]
                print(shown(train_command(pt, wd, extra)) + ("  # done" if (wd / "summary.json").exists() else ""))
            return 0
    except ConfigError as e:
        print(f"diloco sweep: bad input: {e}", file=sys.stderr)
        return 2
    if args.points_file:
        keep = set(json.loads(Path(args.points_file).read_text()))
        sweep["points"] = [p for p in sweep["points"] if p["name"] in keep]
    if args.worker_name:
        sweep = {**sweep, "label": f"{sweep['name']} {args.worker_name}",
                 "started": Path(args.points_file).stat().st_mtime - 1}
    try:
        results = run_sweep(sweep, args.root, args.workers, extra, args.only, in_process=args.in_process)
    except KeyboardInterrupt:  # finished points are kept, an interrupted one resumes from its checkpoint
        print("" if args.worker_name else "diloco sweep: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    if args.worker_name:  # a pool worker: the parent prints the table
        return 0
    print(format_table(results))
    return 1 if any(r["status"] in ("failed", "stale") for r in results) else 0
