"""End to end against the stand-in (tests/standin/): `diloco sweep … --launch tpu` writes the bundle,
`launch_tpu.sh up` creates a queued resource whose hosts (local process groups with a TPU VM worker's
environment) start their agents (diloco/tpu/agent.py) from the startup script, and the agents run the
real `diloco train` on 2 slices × 2 hosts of v5p-16, the bucket on the GCS emulator. A host is killed
mid-point and repaired like GCE would; the point resumes by itself; stop / start / down; the secret scan.

Why the second point is the reference for the first: both are the same run (same spec, seed, data,
placement on the same four stand-in hosts, same code path under the agents) and differ only in
checkpoint_every (4 vs 100), which writes checkpoints but changes no number; so the killed-and-resumed
point must end with the uninterrupted one's params_sha256 bit for bit. A `diloco launch` run on this
machine would be the same processes without the agent, the bucket and the stand-in's environment — a
weaker comparison for what this test is about.

Placement: one CPU device per host and one replica per host (replicas=4: two per slice, so the replica
axis spans the slices and the outer exchange crosses them). A note on attempts: XLA's CPU collectives
(gloo) give up a rendezvous after 30 s, and on this machine (gVisor, 2 loaded cores) multi-process runs
whose replicas span two processes failed there again and again — `diloco launch --processes 4` of
replicas=2 failed at its first step 2 times out of 2 without any agent, the stand-in's reference point
8 attempts out of 8 (one replica per process: passed). The hosts share the test suite's local JAX
cache (the bucket's cache, loaded from the single-threaded emulator, made the processes arrive > 30 s
apart; the cache on gs:// is tested in tests/test_standin.py). A failed attempt is retried by the agent,
so the test asserts what each attempt was for, not how many ran."""
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from diloco import sweep as sw
from diloco.tpu import agent as A
from diloco.tpu import status as S

pytestmark = pytest.mark.slow
QR, ZONE = "pod-1", "us-east5-a"
FAST = {"poll_s": 2, "log_upload_s": 4, "lost_after_s": 15, "abort_grace_s": 20, "stop_grace_s": 300}
TRAIN = ["scale=tiny", "seq_len=32", "batch_size=16", "replicas=4", "steps=20", "H=4", "log_every=2",
         "eval_every=10", "eval_batches=1", "optimizer.warmup_steps=2"]


def _bundle(tmp_path, gcs, name: str, points: str, accelerator: str, slices: int, *flags: str, **plan) -> tuple[Path, str]:
    """`diloco sweep SWEEP --launch tpu … --out DIR` (in this process), then the test's timing constants in
    plan.json (the keys the agent reads; a user leaves the defaults)."""
    f = tmp_path / f"{name}.py"
    f.write_text(textwrap.dedent(f"""
        def get_sweep(arg=""):
            return {{"name": "{name}", "experiment": "experiments/toy.py:diloco", "points": {points}}}
    """))
    out = tmp_path / f"bundle-{name}"
    argv = [str(f), "--root", gcs.url("runs"), "--launch", "tpu", "--tpu", QR, "--zone", ZONE, "--accelerator",
            accelerator, "--slices", str(slices), "--check-fit", "off", "--out", str(out), *flags]
    for kv in TRAIN:
        argv += ["--set", kv]
    assert sw.main(argv) == 0
    p = json.loads((out / "plan.json").read_text())
    env = {**p["env"], "JAX_COMPILATION_CACHE_DIR": os.environ["JAX_COMPILATION_CACHE_DIR"]}  # see the docstring
    (out / "plan.json").write_text(json.dumps({**p, **FAST, "env": env, **plan}, indent=1))
    return out, p["base"]  # this launch's folder: ROOT/<sweep>/_pods/<qr> (the run folders: ROOT/<sweep>/<point>)


def _sh(script: Path, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    t = time.time()
    r = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "POLL_S": "0.5"})
    print(f"$ launch_tpu.sh {' '.join(args)} → {r.returncode} ({time.time() - t:.0f} s)\n{r.stdout}{r.stderr}")
    return r


def _hosts_can_run_the_project(standin) -> None:
    """The hosts use this interpreter for the agent (DILOCO_TPU_PYTHON: the install is tested elsewhere),
    one CPU device each (see the module docstring)."""
    standin.configure(cpu_devices=1, emulator_env={**standin.config["emulator_env"], "DILOCO_TPU_PYTHON": sys.executable})


def _until(cond, timeout: float, what: str, standin):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(1)
    logs = ""
    for h in standin.hosts(QR) if standin.state(QR) else []:
        for f in ("diloco/agent.log", "startup.log"):
            p = h.home / f
            logs += f"\n--- {h.label} {f}\n" + (p.read_text()[-2500:] if p.exists() else "(none)")
    pytest.fail(f"timed out after {timeout} s waiting for {what}{logs}")


def _complete_steps(gcs, wd: str, processes: int) -> list[int]:
    """Checkpoint steps orbax finalized (commit_success.txt, written last on GCS) holding every process's shards."""
    names = gcs.objects(wd + "/ckpt/")
    steps = {int(m.group(1)) for n in names if (m := re.search(r"/ckpt/(\d+)/commit_success\.txt$", n))}
    return sorted(s for s in steps if all(any(f"/ckpt/{s}/state/ocdbt.process_{i}/" in n for n in names)
                                          for i in range(processes)))


def _exits(gcs, base: str, point: str, n: int) -> dict:
    pre = f"{base}/{point}/_state/attempt-{n}/"
    return {k.rsplit("/", 1)[1][:-5]: json.loads(v) for k, v in gcs.objects(pre).items() if k.endswith(".json")}


def test_a_killed_host_is_waited_for_and_the_point_resumes_to_the_uninterrupted_numbers(standin, gcs, tmp_path):
    A.fresh_reads()
    t0 = time.time()
    _hosts_can_run_the_project(standin)
    out, base = _bundle(tmp_path, gcs, "e2e", '[{"checkpoint_every": 4}, {"checkpoint_every": 100}]', "v5p-16", 2,
                        max_attempts=8)
    p1, p2 = "checkpoint_every=4", "checkpoint_every=100"
    script = out / "launch_tpu.sh"
    assert _sh(script, "up").returncode == 0  # the agents start from the startup script on every host
    root = gcs.url("runs", "e2e")
    wd1, st1 = f"{root}/{p1}", f"{base}/{p1}"  # the run folder; the point's coordination files

    # point 1 runs; a checkpoint exists; point 2 waits
    _until(lambda: _complete_steps(gcs, wd1, 4), 1500, "a complete checkpoint of point 1", standin)
    rep = S.collect(base)
    k = rep["points"][0]["attempt"]
    assert [(p["name"], p["state"]) for p in rep["points"]] == [(p1, "running"), (p2, "waiting")]
    standin.kill_host(QR, 1, 1)  # the VM is lost (maintenance): its agent and its trainer with it
    t_kill = time.time()
    _until(lambda: gcs.exists(f"{st1}/_state/attempt-{k}/abort"), 300, f"the leader's abort of attempt {k}", standin)
    _until(lambda: len(_exits(gcs, base, p1, k)) == 3, 300, "the three live hosts' trainers reaped", standin)
    # the leader's note follows the exits at its next poll: wait until only the lost host is left in it
    _until(lambda: "waiting for the exit of slice1-worker1 lost" in S.collect(base)["points"][0]["note"], 60,
           "the leader to wait only for the lost host", standin)
    r = _sh(script, "status")
    assert r.returncode == 2
    assert re.search(rf"{re.escape(p1)}\s+running\s+attempt {k} .*waiting for the exit of slice1-worker1 lost", r.stdout)
    assert re.search(r"slice1-worker1\s+lost\? running", r.stdout) and f"{p2}  waiting" in r.stdout
    time.sleep(5)
    assert not gcs.exists(f"{st1}/_state/go-{k + 1}.json")  # no attempt without the lost host
    standin.repair_host(QR, 1, 1, fresh=True)  # recreated with a fresh disk: it boots the bundle again, rejoins
    t_repair = time.time()

    # the next attempt resumes from the checkpoint; stop it once it has trained past it
    _until(lambda: S.collect(base)["points"][0]["attempt"] > k, 300, "the next attempt", standin)
    closed = _exits(gcs, base, p1, k)
    assert closed["1-1"]["code"] is None and "restarted during the attempt" in closed["1-1"]["reason"]
    go = json.loads(gcs.read(f"{st1}/_state/go-{k + 1}.json"))
    assert go["time"] >= max(e["time"] for e in closed.values()) and go["time"] > t_repair

    def trained_past_resume():
        try:
            rows = [json.loads(x) for x in gcs.read(f"{wd1}/metrics.jsonl").decode().splitlines() if x.strip()]
            st = json.loads(gcs.read(f"{st1}/_state/status.json"))
        except Exception:  # not there yet, or read while rewritten
            return False
        logs = gcs.objects(f"{st1}/logs/attempt-{st['attempt']}/slice0-worker0.log")
        resumed = [int(m) for v in logs.values() for m in re.findall(rb"resumed .* at step (\d+)", v)]
        return resumed and rows and rows[-1]["step"] > resumed[-1] and st["state"] == "running"

    _until(trained_past_resume, 1200, "a resumed attempt training past its checkpoint", standin)
    before = _complete_steps(gcs, wd1, 4)
    r = _sh(script, "stop", timeout=900)
    assert r.returncode == 0 and "every host has stopped" in r.stdout
    assert not [p for p in standin.processes(QR) if p["slice"] is not None], "an agent or trainer still runs"
    after = _complete_steps(gcs, wd1, 4)
    assert after[-1] > before[-1], (before, after)  # the stop saved a new checkpoint, complete when stop returned
    stopped = S.collect(base)["points"][0]
    assert stopped["state"] == "stopped"
    r = _sh(script, "start")
    assert r.returncode == 0 and r.stdout.count("agent started") == 4, r.stdout

    # point 1 resumes from the stop's checkpoint and finishes; point 2 runs once point 1's chips are free
    _until(lambda: S.exit_code(S.collect(base)) != 2, 2400, "both points to end", standin)
    r = _sh(script, "status")
    assert r.returncode == 0, r.stdout
    rec1 = json.loads(gcs.read(f"{st1}/_state/status.json"))
    last = rec1["attempt"]
    log = gcs.read(f"{st1}/logs/attempt-{last}/slice0-worker0.log").decode()
    assert f"at step {after[-1]}" in log, log[-2000:]
    assert rec1["attempts"][str(stopped["attempt"])]["result"] == "stopped"
    s1, s2 = (json.loads(gcs.read(f"{root}/{p}/summary.json")) for p in (p1, p2))
    assert s1["processes"] == s2["processes"] == 4 and s1["versions"]["devices"] == 4
    assert s1["params_sha256"] == s2["params_sha256"]
    assert s1["final_eval_loss"] == s2["final_eval_loss"]
    for s in (s1, s2):
        assert f"params_sha256 {s['params_sha256']}" in r.stdout
    freed = max(e["time"] for e in _exits(gcs, base, p1, last).values())
    starts = [json.loads(v)["time"] for k_, v in gcs.objects(f"{base}/{p2}/_state/attempt-1/").items()
              if k_.endswith(".start")]
    assert len(starts) == 4 and min(starts) > freed  # every trainer of point 1 was reaped first

    r = _sh(script, "down")
    assert r.returncode == 0 and standin.state(QR) is None
    assert standin.leaks() == []
    print(f"e2e: kill at {t_kill - t0:.0f} s, repair at {t_repair - t0:.0f} s, point 1 attempts {last}, "
          f"end at {time.time() - t0:.0f} s")


def test_a_bad_point_fails_after_its_attempts_with_its_last_log_lines_then_teardown(standin, gcs, tmp_path):
    """A point whose workdir already holds another run: every attempt exits 2 with one line saying so;
    after max_attempts the point is failed and `status` shows the reason and the last log lines. With
    --teardown the leader then deletes the queued resource itself."""
    A.fresh_reads()
    _hosts_can_run_the_project(standin)
    out, base = _bundle(tmp_path, gcs, "bad", '[{}]', "v5litepod-4", 1, "--teardown", max_attempts=2)
    point = json.loads((out / "plan.json").read_text())["points"][0]["name"]
    gcs.write(f"{gcs.url('runs', 'bad')}/{point}/config.json", json.dumps({"scale": "another run"}))
    script = out / "launch_tpu.sh"
    assert _sh(script, "up").returncode == 0
    _until(lambda: standin.state(QR) is None, 900, "the leader's teardown", standin)
    deletes = [i for i in standin.invocations() if "delete" in i["argv"]]
    assert [(i["host"], i["argv"]) for i in deletes] == [(f"{QR}/slice0-worker0", [
        "compute", "tpus", "queued-resources", "delete", QR, f"--zone={ZONE}", "--force", "--quiet", "--async"])]
    r = _sh(script, "status")
    assert r.returncode == 1 and "queued resource pod-1: absent" in r.stdout
    assert re.search(rf"{re.escape(point)}\s+failed\s+attempt 2 \(of at most 2\): slice0-worker0 exited with code 2: "
                     r"diloco train: bad input: workdir: gs://\S+ holds a run with a different config", r.stdout)
    assert "last lines of slice0-worker0's log (attempt 2):" in r.stdout
    assert re.search(r"\n      \| diloco train: bad input: workdir: .* holds a run with a different config", r.stdout)
    st = json.loads(gcs.read(f"{base}/{point}/_state/status.json"))
    assert [st["attempts"][n]["result"] for n in ("1", "2")] == ["failed", "failed"]
    assert standin.leaks() == []


# A stand-in for `diloco train` on one host (plan["program"]): one step per 0.4 s, its progress on gs:// after
# every step (its "checkpoint"), resumed from there; SIGTERM → exit 130; slice0-worker0 writes summary.json.
FAKE_TRAIN = r'''
import json, os, signal, sys, time
from etils import epath
wd = epath.Path(sys.argv[sys.argv.index("--workdir") + 1])
host = os.environ["DILOCO_TPU_SLICE"] + "-" + os.environ["DILOCO_TPU_WORKER"]
n = int(os.environ["DILOCO_TPU_ATTEMPT"])
ckpt = wd / f"progress-{host}.json"
step = json.loads(ckpt.read_text())["step"] if ckpt.exists() else 0
signal.signal(signal.SIGTERM, lambda *_: sys.exit(130))
print(f"fake train {host} attempt {n}: resumed at step {step}", flush=True)
while step < 24:
    time.sleep(0.4)
    step += 1
    ckpt.write_text(json.dumps({"step": step, "attempt": n}))
if host == "0-0":
    (wd / "summary.json").write_text(json.dumps({"final_eval_loss": 1.0, "params_sha256": "cd" * 32}))
'''


def test_two_spot_preemptions_and_a_maintenance_event_leave_the_point_running_under_watch(standin, gcs, tmp_path):
    """The issue's done-when, unattended: `watch` on the laptop; the queued resource (Spot, 2 hosts) is
    SUSPENDED twice mid-point (every VM gone; `status` says `SUSPENDED: run up`), and watch recreates it
    each time; then a host gets a maintenance notice: every host checkpoints, and the next attempt waits
    for that host's reboot. With max_attempts=1 the point still finishes: neither a replaced VM (new boot
    id) nor a maintenance stop is a failure. No human command after `up` and `watch`."""
    A.fresh_reads()
    _hosts_can_run_the_project(standin)
    fake = tmp_path / "fake_train.py"
    fake.write_text(FAKE_TRAIN)
    out, base = _bundle(tmp_path, gcs, "unattended", "[{}]", "v5p-16", 1, "--spot", max_attempts=1,
                        program=[sys.executable, str(fake)], poll_s=0.5, log_upload_s=2, abort_grace_s=5,
                        stop_grace_s=30)
    point = json.loads((out / "plan.json").read_text())["points"][0]["name"]
    wd, st = f"{gcs.url('runs', 'unattended')}/{point}", f"{base}/{point}/_state"
    script = out / "launch_tpu.sh"

    def status():
        try:
            return json.loads(gcs.read(f"{st}/status.json"))
        except Exception:  # not there yet, or read while rewritten
            return {}

    def progressed(attempt: int):  # both hosts trained in this attempt, up to step 2 × attempt at least
        def ok():
            try:
                rows = [json.loads(gcs.read(f"{wd}/progress-{h}.json")) for h in ("0-0", "0-1")]
            except Exception:
                return False
            return all(r["attempt"] == attempt and r["step"] >= 2 * attempt for r in rows) and \
                status().get("attempt") == attempt
        return ok

    assert _sh(script, "up").returncode == 0
    _until(progressed(1), 300, "attempt 1 training", standin)
    standin.set_state(QR, "SUSPENDED")  # Spot preemption: every VM of the resource is gone
    r = _sh(script, "status")
    assert r.returncode == 2 and "SUSPENDED: run up." in r.stdout, r.stdout
    assert re.search(rf"{re.escape(point)}\s+suspended\s+attempt 1", r.stdout)
    assert r.stdout.count("gone with the resource (its last heartbeat") == 2 and "running  heartbeat" not in r.stdout
    watch = subprocess.Popen(["bash", str(script), "watch"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "POLL_S": "0.5", "WATCH_S": "1"})
    try:
        _until(progressed(2), 300, "attempt 2 training after watch recreated the resource", standin)
        standin.set_state(QR, "SUSPENDED")  # the second preemption
        _until(progressed(3), 300, "attempt 3 training after the second recreation", standin)
        standin.maintenance(QR, 0, 1)  # TERMINATE_ON_HOST_MAINTENANCE on slice0-worker1's metadata
        _until(lambda: "waiting for slice0-worker1 to reboot" in status().get("note", ""), 120,
               "every host checkpointed, the leader waiting for the noticed host", standin)
        time.sleep(2)
        assert not gcs.exists(f"{st}/go-4.json")  # no attempt on a host about to go down
        standin.reboot_host(QR, 0, 1)  # the maintenance: the VM restarts, its startup script runs again
        rc = watch.wait(timeout=300)
    finally:
        if watch.poll() is None:
            watch.kill()
        said = watch.stdout.read()
        print(said)
    assert rc == 0 and "every point has ended (status exit 0)" in said, said
    assert said.count("is SUSPENDED: recreating it") == 2, said
    rec = status()
    assert rec["state"] == "finished", rec
    assert [rec["attempts"][k]["result"] for k in ("1", "2", "3", "4")] == ["preempted", "preempted", "stopped",
                                                                              "finished"], rec
    assert "maintenance notice on slice0-worker1 (TERMINATE_ON_HOST_MAINTENANCE)" in rec["attempts"]["3"]["reason"]
    log = gcs.read(f"{base}/{point}/logs/attempt-4/slice0-worker0.log").decode()
    resumed = int(re.search(r"resumed at step (\d+)", log).group(1))
    assert resumed >= 6, log  # the steps of attempts 1-3 (step 6 was seen in attempt 3), kept
    r = _sh(script, "status")
    assert r.returncode == 0 and "preempted: the VM of" in r.stdout
    assert _sh(script, "down").returncode == 0
