"""Start-up and exit of `diloco train`, as a user sees them from the shell.

    python benchmarks/bench_startup.py [--spec experiments/toy.py:streaming] [--repeats 3] [--json out.json]

Each repeat starts `python -m diloco.cli train … --config.log_every=1` in a fresh process and a fresh
workdir and reports:
  time to first step  process start → the first metrics row (written right after step 1)
  exit lag            the summary JSON on stdout → the process has exited
  total               process start → exit
  CPU to first step   user + system CPU seconds the process used until then (Linux /proc): on a machine
                      shared with other work, what the wall time would roughly be with the cores to itself
The first repeat can be cold (token cache and JAX's compilation cache empty: pass --cold to empty
them first, in a temporary $DILOCO_CACHE); the rest are warm. Timings on a shared machine are noisy:
quote the median of several repeats.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a live process, all its threads (None where /proc is absent)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)


def one_run(spec: str, steps: int, workdir: Path, env: dict, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "diloco.cli", "train", "--config", spec, "--workdir", str(workdir), "--no_progress",
           f"--config.steps={steps}", "--config.log_every=1", f"--config.eval_every={steps}",
           f"--config.checkpoint_every={steps}"]
    metrics = workdir / "metrics.jsonl"
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=str(REPO), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first_step, cpu, summary_at, lines = [None], [None], [None], []

    def watch_metrics():
        while proc.poll() is None and first_step[0] is None:
            if metrics.exists() and metrics.stat().st_size > 0:
                first_step[0] = time.perf_counter() - t0
                cpu[0] = cpu_seconds(proc.pid)
                return
            time.sleep(0.01)

    def read_stdout():
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("{") and summary_at[0] is None:
                summary_at[0] = time.perf_counter()

    threads = [threading.Thread(target=watch_metrics, daemon=True), threading.Thread(target=read_stdout, daemon=True)]
    for t in threads:
        t.start()
    err = proc.stderr.read()
    rc = proc.wait(timeout=timeout)
    end = time.perf_counter()
    for t in threads:
        t.join(timeout=5)
    if rc != 0 or summary_at[0] is None:
        raise RuntimeError(f"exit {rc}: {' '.join(cmd)}\n{err[-2000:]}")
    return {"time_to_first_step_s": round(first_step[0], 2), "cpu_to_first_step_s": cpu[0],
            "exit_lag_s": round(end - summary_at[0], 2),
            "total_s": round(end - t0, 2), "stderr_lines": len([l for l in err.splitlines() if l.strip()])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default="experiments/toy.py:streaming")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="the first repeat starts with empty token and compile caches")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        if args.cold:
            env["DILOCO_CACHE"] = str(Path(tmp) / "cache")
            env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the project puts it under $DILOCO_CACHE
        runs = []
        for i in range(args.repeats):
            r = one_run(args.spec, args.steps, Path(tmp) / f"run{i}", env, args.timeout)
            r["cache"] = "cold" if args.cold and i == 0 else "warm"
            runs.append(r)
            print(f"run {i} ({r['cache']}): first step after {r['time_to_first_step_s']:.2f} s "
                  f"({r['cpu_to_first_step_s']} s CPU), "
                  f"exit {r['exit_lag_s']:.2f} s after the summary, total {r['total_s']:.2f} s, "
                  f"{r['stderr_lines']} stderr line(s)", flush=True)
    warm = [r for r in runs if r["cache"] == "warm"]
    if warm:
        print(f"warm median: first step {statistics.median(r['time_to_first_step_s'] for r in warm):.2f} s, "
              f"exit lag {statistics.median(r['exit_lag_s'] for r in warm):.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"spec": args.spec, "steps": args.steps, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
