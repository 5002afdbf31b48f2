"""`diloco sweep --launch slurm` (diloco/slurm.py) and srun's placement (diloco/distributed.py).

The pure parts run in the default tier; the `slurm` tier drives a real one-node cluster (Debian's
slurm-wlm: munged, slurmctld, slurmd, started by scripts/slurm_local.sh as root)."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from diloco import distributed as dist, slurm
from diloco.errors import ConfigError
from diloco.launch import free_port


@pytest.mark.parametrize("nodelist,first", [("vm", "vm"), ("gpu[07-09,12],cpu1", "gpu07"), ("n[1-4]", "n1"),
                                            ("a-b[003]", "a-b003"), ("node1,node2", "node1"), ("x[5]", "x5")])
def test_the_first_host_of_a_slurm_host_list(nodelist, first):
    assert dist.first_host(nodelist) == first


STEP = {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3", "SLURM_STEP_NODELIST": "g[2-3]",
        "SLURM_JOB_ID": "5000", "SLURM_LOCALID": "1"}


def test_srun_places_the_process_and_only_inside_a_step_of_several_tasks():
    assert dist.slurm_placement(STEP) == {dist.ENV_COORD: f"g2:{5000 % 4096 + 61440}", dist.ENV_N: "4", dist.ENV_ID: "3"}
    assert dist.slurm_placement({**STEP, "DILOCO_SLURM_PORT": "7000"})[dist.ENV_COORD] == "g2:7000"
    batch_shell = {k: v for k, v in STEP.items() if k != "SLURM_STEP_ID"}  # `diloco train` without srun
    assert dist.slurm_placement(batch_shell) == {}
    assert dist.slurm_placement({**STEP, "SLURM_STEP_NUM_TASKS": "1"}) == {}
    assert dist.slurm_placement({**STEP, dist.ENV_N: "2"}) == {}  # diloco launch placed it already
    assert dist.local_device_ids({**STEP, dist.ENV_LOCAL_DEVICES: "task"}) == [1]
    assert dist.local_device_ids({dist.ENV_LOCAL_DEVICES: "0,1,2,3"}) == [0, 1, 2, 3]
    assert dist.local_device_ids({}) is None


def test_the_job_script_of_each_layout(tmp_path):
    train = [sys.executable, "-m", "diloco.cli", "train", "--workdir", "/runs/p q"]
    node = slurm.job_script("j", train, tmp_path, slurm.Resources(nodes=2, gpus_per_node=8, partition="gpu"), REPO)
    gpu = slurm.job_script("j", train, tmp_path, slurm.Resources(nodes=2, gpus_per_node=8, per="gpu"), REPO)
    cpu = slurm.job_script("j", train, tmp_path, slurm.Resources(tasks_per_node=2, time="1:00:00"), REPO)
    assert "#SBATCH --ntasks-per-node=1" in node and "#SBATCH --partition=gpu" in node
    assert "export DILOCO_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7" in node  # one process drives the node's 8 GPUs
    assert "#SBATCH --ntasks-per-node=8" in gpu and "export DILOCO_LOCAL_DEVICE_IDS=task" in gpu
    assert "#SBATCH --ntasks-per-node=2" in cpu and "DILOCO_LOCAL_DEVICE_IDS" not in cpu
    assert "#SBATCH --time=1:00:00" in cpu and "#SBATCH --gpus-per-node" not in cpu
    for s in (node, gpu, cpu):
        assert "#SBATCH --requeue" in s and "#SBATCH --signal=B:USR1@120" in s
        assert "'/runs/p q'" in s  # quoted
    bash = subprocess.run(["bash", "-n"], input=cpu, text=True, capture_output=True)
    assert bash.returncode == 0, bash.stderr


def test_an_array_job_runs_the_tasks_point_and_requeues_only_that_task(tmp_path):
    """`--array 2`: one script, task i runs point i. Run by bash with srun and scontrol stubbed: task 1 starts
    point 1's command with its own log folder; steps exiting 130 (a checkpoint after SIGTERM) requeue that task."""
    def sweep_launch(dry_run):
        pts = [{"name": "a"}, {"name": "b c"}, {"name": "d"}]
        (tmp_path / "s" / "d").mkdir(parents=True, exist_ok=True)
        (tmp_path / "s" / "d" / "summary.json").write_text("{}")  # finished: no task
        return slurm.launch(pts, "s", tmp_path, slurm.Resources(tasks_per_node=2, array=2), [],
                            lambda pt, wd, extra: ["train", "--workdir", str(wd)], dry_run=dry_run)
    script = tmp_path / "s" / "slurm" / "array.sh"
    assert sweep_launch(True) == [("a", f"{script} (task 0)"), ("b c", f"{script} (task 1)"), ("d", "done")]
    text = script.read_text()
    assert "#SBATCH --array=0-1%2" in text and f"#SBATCH --output={tmp_path}/s/slurm/%A_%a.out" in text
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "srun").write_text('#!/bin/bash\necho "srun $*" >> "$CALLS"; exit "$SRUN_RC"\n')
    (stubs / "scontrol").write_text('#!/bin/bash\necho "scontrol $*" >> "$CALLS"\n')
    for f in stubs.iterdir():
        f.chmod(0o755)
    for rc, requeued in ((0, False), (130, True)):
        calls = tmp_path / f"calls{rc}"
        env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "CALLS": str(calls), "SRUN_RC": str(rc),
               "SLURM_ARRAY_TASK_ID": "1", "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n1"}
        p = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
        assert p.returncode == rc, p.stdout + p.stderr
        wd = tmp_path / "s" / "b c"
        assert calls.read_text().splitlines() == [
            f"srun --kill-on-bad-exit=1 --output={wd}/slurm/%j-task%t.log train --workdir {wd}",
            *(["scontrol requeue 77"] if requeued else [])]
    p = subprocess.run(["bash", str(script)], env={**env, "SLURM_ARRAY_TASK_ID": "2"}, capture_output=True, text=True)
    assert p.returncode == 2 and "no point for array task 2" in p.stdout


@pytest.mark.parametrize("kw,field", [({"nodes": 0}, "--nodes"), ({"per": "gpu"}, "--per"),
                                      ({"per": "gpu", "gpus_per_node": 4, "tasks_per_node": 2}, "--tasks-per-node"),
                                      ({"gpus_per_node": -1}, "--gpus-per-node"), ({"grace_s": 3}, "--grace"),
                                      ({"array": -1}, "--array")])
def test_impossible_resources_are_one_line_naming_the_option(kw, field):
    with pytest.raises(ConfigError) as e:
        slurm.Resources(**kw).check()
    assert e.value.field == field and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------------
# a real cluster
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if shutil.which("slurmctld") is None or os.geteuid() != 0:
        pytest.skip("needs slurm-wlm (apt-get install slurm-wlm) and root: scripts/slurm_local.sh starts the daemons")
    state = tmp_path_factory.mktemp("slurm")
    env = dict(os.environ, SLURM_LOCAL_PORT=str(free_port()))
    r = subprocess.run(["bash", str(REPO / "scripts" / "slurm_local.sh"), "start", str(state)], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    yield {"SLURM_CONF": str(state / "slurm.conf")}
    subprocess.run(["bash", str(REPO / "scripts" / "slurm_local.sh"), "stop", str(state)], timeout=60)


TINY = {"scale": "tiny", "seq_len": 32, "batch_size": 4, "steps": 300, "H": 4, "layers_per_fragment": 1, "tau": 1,
        "log_every": 2, "eval_every": 100, "eval_batches": 2, "checkpoint_every": 100, "optimizer.warmup_steps": 2}


def _sweep(cluster, tmp_path, root, *opts):
    f = tmp_path / "one.py"
    f.write_text('def get_sweep(arg=""):\n    return {"name": "s", "experiment": "experiments/toy.py:streaming", '
                 '"points": [{}]}\n')
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device per process, as on a cluster
    sets = [a for k, v in TINY.items() for a in ("--set", f"{k}={v}")]
    return subprocess.run([sys.executable, "-m", "diloco.cli", "sweep", str(f), "--root", str(root), "--launch",
                           "slurm", *opts, *sets], capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**env, **cluster, "TF_CPP_MIN_LOG_LEVEL": "3"})


def _squeue(cluster, *args) -> str:
    return subprocess.run(["squeue", "-h", *args], capture_output=True, text=True, env={**os.environ, **cluster}).stdout


def _finish(cluster, wd: Path, job: str, limit_s: float = 600) -> dict:
    deadline, held = time.time() + limit_s, 0
    while time.time() < deadline and not (wd / "summary.json").exists():
        # A requeued job waits 2 min: not in a test. Started in the second its old credential was revoked, slurmd
        # refuses it ("Job credential revoked": whole seconds compared) and the job ends: start it 2 s later.
        held = held + 1 if "BeginTime" in _squeue(cluster, "-j", job, "-o", "%r") else 0
        if held >= 2:
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env={**os.environ, **cluster})
        time.sleep(1)
    while _squeue(cluster, "-j", job).strip() and time.time() < deadline:
        time.sleep(0.5)
    logs = "\n".join(p.read_text() for p in sorted((wd / "slurm").glob("*.out")) + sorted((wd / "slurm").glob("*.log")))
    assert (wd / "summary.json").exists(), logs[-4000:]
    return {"summary": json.loads((wd / "summary.json").read_text()), "logs": logs}


@pytest.mark.slow
@pytest.mark.slurm
def test_a_job_the_cluster_cannot_run_is_refused_before_anything_is_submitted(cluster, tmp_path):
    for opts, why in ((["--partition", "nope"], "invalid partition"),
                      (["--tasks-per-node", "64"], "not available")):
        r = _sweep(cluster, tmp_path, tmp_path / "root", "--tasks-per-node", "2", *opts)
        assert r.returncode == 2, r.stderr
        line = r.stderr.strip().splitlines()[-1]
        assert line.startswith("diloco sweep: bad input: --launch: slurm refuses") and why in line.lower(), r.stderr
        assert _squeue(cluster).strip() == ""


@pytest.mark.slow
@pytest.mark.slurm
def test_two_tasks_train_a_cancelled_job_requeues_and_resumes_bit_identically(cluster, tmp_path):
    """2 processes through srun: an uninterrupted job, and one whose steps get SIGTERM after its first
    metrics row (a preemption): they checkpoint at one step, the job requeues itself, resumes there
    and ends with the uninterrupted job's parameters."""
    ref = _sweep(cluster, tmp_path, tmp_path / "ref", "--tasks-per-node", "2")
    assert ref.returncode == 0, ref.stderr
    a = _finish(cluster, tmp_path / "ref" / "s" / "default", ref.stdout.split()[-1])
    assert "diloco host 1/2" in a["logs"] and a["summary"]["steps"] == 300

    r = _sweep(cluster, tmp_path, tmp_path / "cut", "--tasks-per-node", "2")
    assert r.returncode == 0, r.stderr
    job, wd = r.stdout.split()[-1], tmp_path / "cut" / "s" / "default"
    deadline = time.time() + 300
    while time.time() < deadline and not ((wd / "metrics.jsonl").exists() and (wd / "metrics.jsonl").read_text()):
        time.sleep(0.1)
    subprocess.run(["scancel", "--signal=TERM", job], env={**os.environ, **cluster}, check=True)
    b = _finish(cluster, wd, job)
    assert "requeueing" in b["logs"] and "(restart 1)" in b["logs"], b["logs"][-3000:]
    saved = [l for l in b["logs"].splitlines() if "saved a checkpoint at step" in l]
    assert len(saved) == 2 and saved[0].split("step")[1] == saved[1].split("step")[1]  # both tasks, one step
    step = int(saved[0].split("at step ")[1].split()[0])
    assert 0 < step < 300 and f"resumed {wd} at step {step}" in b["logs"]
    assert b["summary"]["params_sha256"] == a["summary"]["params_sha256"]
    rows = [json.loads(l) for l in (wd / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(2, 301, 2))  # each logged step once
