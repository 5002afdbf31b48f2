"""`diloco sweep … --launch slurm`: one batch job per point on a SLURM cluster.

Each point gets `<root>/<sweep>/<point>/slurm/job.sh` (kept beside its run, so `sbatch job.sh` by hand
resubmits it) and is submitted with `sbatch`. Every job is first asked of the scheduler with
`sbatch --test-only`: a bad partition, or a job that would never fit, is refused in one line before
anything is submitted.

Layout. `--per node`: one process per node that drives all its GPUs (`--gpus-per-node G`); `--per gpu`:
one process per GPU (G tasks per node, each told its GPU by SLURM_LOCALID). On CPUs `--tasks-per-node`
sets the processes. Every process joins one JAX job: diloco/distributed.py reads srun's variables
(SLURM_NTASKS, SLURM_PROCID, SLURM_STEP_NODELIST, SLURM_JOB_ID) the way it reads `diloco launch`'s.

Stopping and requeueing. A step signalled with SIGTERM (a preemption, `scancel --signal=TERM`, or the
time limit: the batch shell gets SIGUSR1 `--grace` seconds before it and passes SIGTERM on) makes every
process save a checkpoint at a step they agree on and exit 130; the batch script then requeues the job
(`scontrol requeue`), which resumes from that checkpoint bit-identically. A plain `scancel` (SIGTERM to
the batch shell too) checkpoints the same way and leaves the job cancelled: the same sweep command
submits it again and it resumes. Logs: `slurm/<jobid>.out` (the batch shell) and
`slurm/<jobid>-task<N>.log` per process. `--array [P]`: the points as one job array instead
(`<root>/<sweep>/slurm/array.sh`, task i the i-th point not done, at most P running; each task requeues
alone; batch shell logs `<root>/<sweep>/slurm/<arrayjob>_<i>.out`). Run folders and the token store must be on a path every node
sees.
"""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from diloco.errors import ConfigError

REQUEUE_ON = 130  # diloco train's exit after a SIGTERM checkpoint


@dataclass(frozen=True)
class Resources:
    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    per: str = "node"  # or "gpu"
    partition: str = ""
    time: str = ""
    account: str = ""
    grace_s: int = 120
    extra: tuple[str, ...] = ()  # raw sbatch options, e.g. "--constraint=h100"
    array: int | None = None  # the points as one job array, at most this many running (0: no limit)

    def check(self) -> "Resources":
        for name, v in (("--nodes", self.nodes), ("--tasks-per-node", self.tasks_per_node)):
            if v < 1:
                raise ConfigError(name, f"{v} must be ≥ 1")
        if self.gpus_per_node < 0:
            raise ConfigError("--gpus-per-node", f"{self.gpus_per_node} must be ≥ 0")
        if self.per not in ("node", "gpu"):
            raise ConfigError("--per", f"{self.per!r} must be node or gpu")
        if self.per == "gpu":
            if self.gpus_per_node < 1:
                raise ConfigError("--per", "--per gpu needs --gpus-per-node G (one process per GPU)")
            if self.tasks_per_node not in (1, self.gpus_per_node):
                raise ConfigError("--tasks-per-node", f"--per gpu runs one process per GPU: "
                                  f"{self.gpus_per_node} per node, not {self.tasks_per_node}; drop --tasks-per-node")
        if self.array is not None and self.array < 0:
            raise ConfigError("--array", f"{self.array} must be ≥ 0 (0: no limit on tasks running at once)")
        if self.grace_s < 10:
            raise ConfigError("--grace", f"{self.grace_s} s leaves no time to save a checkpoint; give ≥ 10")
        return self

    @property
    def tasks(self) -> int:
        return self.gpus_per_node if self.per == "gpu" else self.tasks_per_node


def sbatch_options(name: str, logs: Path, r: Resources, out: str = "%j.out") -> list[str]:
    opts = [f"--job-name={name}", f"--output={logs}/{out}", f"--nodes={r.nodes}", f"--ntasks-per-node={r.tasks}",
            "--requeue", "--open-mode=append", f"--signal=B:USR1@{r.grace_s}"]
    opts += [f"--gpus-per-node={r.gpus_per_node}"] * (r.gpus_per_node > 0)
    opts += [f"--{k}={v}" for k, v in (("partition", r.partition), ("time", r.time), ("account", r.account)) if v]
    return opts + list(r.extra)


def job_script(name: str, train: list[str], workdir: Path, r: Resources, cwd: Path) -> str:
    """The batch script of one point: srun starts the processes; a signal is passed on as SIGTERM
    (checkpoint, exit 130) and the job requeues itself unless the batch shell itself was cancelled."""
    return batch_script(name, [(workdir, train)], workdir / "slurm", r, cwd)


def batch_script(name: str, runs: list[tuple[Path, list[str]]], logs: Path, r: Resources, cwd: Path) -> str:
    """job_script's text for one run, or with r.array for every run as one job array: task i runs runs[i]
    (its batch shell logs to logs/<array job>_<i>.out; its processes, as a lone job's, to <workdir>/slurm/)."""
    env = {"TF_CPP_MIN_LOG_LEVEL": "3"}
    if r.gpus_per_node:  # per node: all its GPUs (JAX alone would give each process GPU SLURM_LOCALID)
        env["DILOCO_LOCAL_DEVICE_IDS"] = ",".join(map(str, range(r.gpus_per_node))) if r.per == "node" else "task"
    if r.array is None:
        opts, pick = sbatch_options(name, logs, r), [f"wd={shlex.quote(str(runs[0][0]))}; train=({shlex.join(runs[0][1])})"]
    else:
        opts = [*sbatch_options(name, logs, r, "%A_%a.out"), f"--array=0-{len(runs) - 1}" + f"%{r.array}" * (r.array > 0)]
        pick = ['case "$SLURM_ARRAY_TASK_ID" in',
                *(f"  {i}) wd={shlex.quote(str(wd))}; train=({shlex.join(t)}) ;;" for i, (wd, t) in enumerate(runs)),
                '  *) echo "diloco: no point for array task $SLURM_ARRAY_TASK_ID"; exit 2 ;;', "esac"]
    lines = ["#!/bin/bash", *(f"#SBATCH {o}" for o in opts),
             "# written by `diloco sweep --launch slurm` (diloco/slurm.py); `sbatch` this file to resubmit",
             "set -u", f"cd {shlex.quote(str(cwd))}",
             *(f"export {k}={shlex.quote(v)}" for k, v in env.items()), *pick,
             'stop=""; pid=""',
             "pass_on() { stop=$1; [ -n \"$pid\" ] && kill -TERM \"$pid\" 2>/dev/null; }",
             "trap 'pass_on time' USR1", "trap 'pass_on cancel' TERM",
             "echo \"diloco: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST\"",
             'srun --kill-on-bad-exit=1 --output="$wd/slurm/%j-task%t.log" "${train[@]}" &',
             "pid=$!",
             'while kill -0 "$pid" 2>/dev/null; do wait "$pid"; done  # a trap ends `wait` early',
             'wait "$pid"; rc=$?',
             f'if [ "$rc" -eq {REQUEUE_ON} ] && [ "$stop" != cancel ]; then',
             '  echo "diloco: interrupted at a checkpoint (${stop:-steps signalled}); requeueing"; scontrol requeue "$SLURM_JOB_ID"',
             "fi", 'exit "$rc"', ""]
    return "\n".join(lines)


def sbatch(args: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["sbatch", *args], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise ConfigError("--launch", "slurm: sbatch is not on PATH; run on a SLURM login node") from None


def ask_scheduler(script: Path) -> None:
    """The scheduler's own answer to "could this job ever run?" (`sbatch --test-only`), as one line."""
    p = sbatch(["--test-only", str(script)])
    if p.returncode != 0:
        why = " ".join(l.strip() for l in p.stderr.splitlines() if l.strip() and "test-only" not in l)
        raise ConfigError("--launch", f"slurm refuses {script}: {why or 'sbatch --test-only failed'}; "
                          "change --partition/--nodes/--tasks-per-node/--gpus-per-node/--time")


def submit(script: Path) -> str:
    p = sbatch(["--parsable", str(script)])
    if p.returncode != 0:
        raise ConfigError("--launch", f"sbatch {script} failed: {p.stderr.strip()}")
    return p.stdout.strip().split(";")[0]


def launch(points: list[dict], sweep_name: str, root: Path, r: Resources, extra: list[str],
           train_command, dry_run: bool = False) -> list[tuple[str, str]]:
    """Writes every point's job script (with r.array: one array script, ROOT/<sweep>/slurm/array.sh, task i
    the i-th point not done), asks the scheduler about all of them, then submits them.
    [(point name, job id (array: <job>_<task>) or 'done' or the script path on a dry run)]."""
    from diloco.config import REPO_ROOT

    r.check()
    runs = []  # (point name, workdir, train command) of the points not done
    for pt in points:
        wd = (root / sweep_name / pt["name"]).resolve()
        if not (wd / "summary.json").exists():
            (wd / "slurm").mkdir(parents=True, exist_ok=True)
            runs.append((pt["name"], wd, train_command(pt, wd, extra)))

    def tag(n: str) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]", "_", f"diloco-{sweep_name}-{n}")[:120]

    if r.array is not None and runs:
        logs = (root / sweep_name / "slurm").resolve()
        logs.mkdir(parents=True, exist_ok=True)
        scripts = [(logs / "array.sh", batch_script(tag("array"), [(wd, t) for _, wd, t in runs], logs, r, REPO_ROOT))]
    else:
        scripts = [(wd / "slurm" / "job.sh", job_script(tag(n), t, wd, r, REPO_ROOT)) for n, wd, t in runs]
    for s, text in scripts:
        s.write_text(text)
    if not dry_run:
        for s, _ in scripts:
            ask_scheduler(s)
    ids = [str(s) if dry_run else submit(s) for s, _ in scripts]
    if r.array is not None and runs:
        ids = [f"{ids[0]} (task {i})" if dry_run else f"{ids[0]}_{i}" for i in range(len(runs))]
    got = {n: i for (n, _, _), i in zip(runs, ids)}
    return [(pt["name"], got.get(pt["name"], "done")) for pt in points]


def add_arguments(ap) -> None:
    g = ap.add_argument_group("--launch slurm (one batch job per point; diloco/slurm.py)")
    g.add_argument("--partition", default="", help="SLURM partition (default: the cluster's)")
    g.add_argument("--nodes", type=int, default=1, help="nodes per point")
    g.add_argument("--tasks-per-node", type=int, default=1, help="processes per node (CPU runs)")
    g.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node")
    g.add_argument("--per", choices=("node", "gpu"), default="node", help="one process per node (all its GPUs) "
                   "or per GPU")
    g.add_argument("--time", default="", help="time limit, e.g. 04:00:00 (the job requeues itself before it)")
    g.add_argument("--account", default="", help="SLURM account")
    g.add_argument("--grace", type=int, default=120, help="seconds before the time limit to checkpoint")
    g.add_argument("--sbatch", action="append", default=[], metavar="OPTION", help="a raw sbatch option, repeatable")
    g.add_argument("--array", nargs="?", type=int, const=0, default=None, metavar="P", help="the points not done as "
                   "one job array (sbatch --array), at most P tasks at once (no P: no limit)")


def from_args(args) -> Resources:
    return Resources(args.nodes, args.tasks_per_node, args.gpus_per_node, args.per, args.partition, args.time,
                     args.account, args.grace, tuple(args.sbatch), args.array)


def report(jobs: list[tuple[str, str]], root: Path, sweep_name: str, dry_run: bool) -> int:
    for name, job in jobs:
        print(f"{name}\t{job}")
    if dry_run:
        print("# dry run: job scripts written, nothing submitted", file=sys.stderr)
    else:
        print(f"submitted {sum(j != 'done' for _, j in jobs)} job(s); `squeue --me` watches them, "
              f"`diloco tables --root {root / sweep_name}` reads the results", file=sys.stderr)
    return 0
