"""The pod-side driver (diloco/tpu/agent.py) and `status`: decisions by table, then agents as real
processes on a local root (etils.epath serves local folders and gs:// alike) running a stand-in for
`diloco train` (the plan's `program`), fast enough for the default tier. The same agents with the
real `diloco train` on a GCS emulator and a stub gcloud: tests/test_tpu_e2e.py."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from diloco.rundir import atomic_write_json, atomic_write_text, read_json
from diloco.tpu import agent as A
from diloco.tpu import status as S

H4 = ("0-0", "0-1", "1-0", "1-1")
NOW = 1000.0


def beat(state="idle", ago=2.0, **kw):
    return {"state": state, "time": NOW - ago, **kw}


def ex(code, reason="", stopped=False):
    return {"code": code, "reason": reason or f"exited with code {code}", "stopped": stopped}


def view(go=0, exits=None, beats=None, abort=None, summary=False, status=None, stop=False, starts=()):
    beats = {h: beat("running" if go and h not in (exits or {}) else "idle") for h in H4} if beats is None else beats
    return A.PointView(H4, go, abort, exits or {}, frozenset(starts), beats, summary, status or {}, stop, NOW)


def all_exit(code=0, **over):
    return {h: over.get(h, ex(code)) for h in H4}


FAILED = {"attempts": {"1": {"result": "failed", "reason": "x"}, "2": {"result": "failed", "reason": "y"}}}
DECIDE = [
    # (what the bucket says, the leader's action kind, attempt, words the reason must contain)
    ("fresh sweep, every host idle", view(), "go", 1, []),
    ("a host never heartbeat yet", view(beats={h: beat() for h in H4[:3]}), "wait", 0,
     ["slice1-worker1 (no heartbeat yet)"]),
    ("a host still busy with the last point", view(beats={**{h: beat() for h in H4}, "1-0": beat("running")}),
     "wait", 0, ["slice1-worker0 (running)"]),
    ("attempt running", view(go=1), "wait", 1, ["running"]),
    ("one exit 1 → abort with its reason", view(go=1, exits={"1-0": ex(1, "exited with code 1: boom")}),
     "abort", 1, ["slice1-worker0 exited with code 1: boom"]),
    ("an exit 0 alone is no reason to abort", view(go=1, exits={"0-1": ex(0)}), "wait", 1, ["running"]),
    ("stale heartbeat → host lost", view(go=1, beats={**{h: beat("running") for h in H4}, "1-1": beat("running", 121)}),
     "abort", 1, ["slice1-worker1 lost"]),
    ("aborted, a host not yet reaped", view(go=1, abort="r", exits={h: ex(1) for h in H4[:3]}), "wait", 1,
     ["waiting for the exit of slice1-worker1"]),
    ("aborted, the lost host not back", view(go=1, abort="r", exits={h: ex(1) for h in H4[:3]},
                                            beats={**{h: beat() for h in H4[:3]}, "1-1": beat("running", 500)}),
     "wait", 1, ["slice1-worker1 lost"]),
    ("all exited 0 + summary → finished", view(go=1, exits=all_exit(0), summary=True), "finish", 1, []),
    ("all exited 0, no summary → next attempt", view(go=1, exits=all_exit(0)), "go", 2, ["no summary.json"]),
    ("one exit 1, every host idle → next attempt with the reason",
     view(go=1, abort="slice1-worker0 exited with code 1: boom", exits=all_exit(130, **{"1-0": ex(1)})),
     "go", 2, ["slice1-worker0 exited with code 1: boom"]),
    ("attempt over but a host not idle yet", view(go=1, abort="r", exits=all_exit(1),
                                                 beats={**{h: beat() for h in H4}, "0-1": beat("running")}),
     "wait", 1, ["slice0-worker1 (running)"]),
    ("attempts exhausted → failed", view(go=3, abort="boom again", exits=all_exit(1), status=FAILED), "fail", 3,
     ["attempt 3 (of at most 3): boom again"]),
    ("a stopped attempt does not count",
     view(go=3, abort="z", exits=all_exit(1), status={"attempts": {**FAILED["attempts"], "2": {"result": "stopped"}}}),
     "go", 4, ["z"]),
    ("stop marker while running: wait, no abort", view(go=1, exits={"1-0": ex(130, stopped=True)}, stop=True),
     "wait", 1, ["stop requested"]),
    ("stop marker, all stopped: no new attempt", view(go=1, exits=all_exit(130, **{h: ex(130, stopped=True)
                                                                                 for h in H4}), stop=True),
     "wait", 1, ["stop requested"]),
    ("after a stop, the restarted pod resumes; the stopped attempt is not counted",
     view(go=3, exits={h: ex(130, stopped=True) for h in H4}, status=FAILED), "go", 4, ["stopped"]),
    ("a restarted leader mid-point: waits on the running attempt, never re-issues it",
     view(go=2, exits={"1-1": ex(0)}, status={"state": "running", "attempt": 2, "attempts": {"1": {"result": "failed"}}}),
     "wait", 2, ["running"]),
]


@pytest.mark.parametrize("case", DECIDE, ids=[c[0] for c in DECIDE])
def test_decide(case):
    _, v, kind, attempt, words = case
    a = A.decide(v, max_attempts=3, lost_after_s=120)
    assert (a.kind, a.attempt) == (kind, attempt), a
    for w in words:
        assert w in a.reason, (w, a.reason)


LIM = A.Limits(max_preemptions=2, lost_give_up=10, stall_rows=5, stall_min_s=60, maintenance_wait_s=600)
GONE = {**{h: beat("running") for h in H4}, "1-1": beat("running", 1300)}  # slice1-worker1 silent since t = -300
LONG_AGO = NOW - 5000  # the leader's agent started long before
NOTICE = {"0-1": {"event": "TERMINATE_ON_HOST_MAINTENANCE", "boot": "b1", "time": NOW - 60}}
MAINT = dict(go=1, abort="maintenance notice on slice0-worker1 (TERMINATE_ON_HOST_MAINTENANCE): checkpointing now",
             exits={h: ex(130, stopped=True) for h in H4})
TREES = {h: beat(tree="a" * 64) for h in H4[:3]}


def idle_beats(**over):
    return {h: beat(**over.get(h, {})) for h in H4}


PREEMPTED = {"attempts": {"1": {"result": "preempted"}, "2": {"result": "preempted"}}}
BOUNDS = [
    # (what the bucket says, the leader's action kind, attempt, words the reason must contain, how the attempt
    # that ended is recorded); limits LIM
    ("a replaced VM: the attempt is preempted, not counted (2 failed of 3 before)",
     dict(go=3, exits=all_exit(130, **{"1-1": {**ex(None, "restarted during the attempt"), "replaced": True}}),
          abort="slice1-worker1 restarted", status=FAILED), "go", 4, ["preempted: the VM of slice1-worker1"], "preempted"),
    ("the same boot: the agent died, the VM did not → a failure, the 3rd",
     dict(go=3, exits=all_exit(130, **{"1-1": ex(None, "restarted during the attempt")}), abort="slice1-worker1 "
          "restarted", status=FAILED), "fail", 3, ["attempt 3 (of at most 3): slice1-worker1 restarted"], "failed"),
    ("a third preemption exceeds max_preemptions 2",
     dict(go=3, exits=all_exit(130, **{"0-0": {**ex(None), "replaced": True}}), status=PREEMPTED), "fail", 3,
     ["preempted 3 times (more than max_preemptions 2)"], "preempted"),
    ("a lost host, silent 1300 s > 10 × 120 s: the point fails", dict(go=1, beats=GONE, since=LONG_AGO), "fail", 1,
     ["slice1-worker1 lost for 1300 s (10 × lost_after_s): it never came back"], "failed"),
    ("… silent 1300 s but the leader's agent started 200 s ago: only lost", dict(go=1, beats=GONE, since=NOW - 200),
     "abort", 1, ["slice1-worker1 lost"], None),
    ("… and waiting for it to go again", dict(beats={**idle_beats(), "1-1": beat(ago=1300)}, since=LONG_AGO), "fail",
     0, ["slice1-worker1 lost for 1300 s"], None),
    ("rows every 10-20 s, none for 870 s > max(5 × 20, 60): stalled", dict(go=1, rows=(100.0, 110.0, 130.0)), "abort",
     1, ["stalled: no new metrics row for 870 s", "limit 100 s: 5 × the longest gap between rows so far, 20 s"], None),
    ("the last row 50 s ago: running", dict(go=1, rows=(100.0, 110.0, 130.0, 950.0)), "wait", 1, ["running"], None),
    ("one row only: no interval known yet", dict(go=1, rows=(100.0,)), "wait", 1, ["running"], None),
    ("short gaps, the floor stall_min_s 60 s holds", dict(go=1, rows=(920.0, 921.0, 930.0)), "abort", 1,
     ["no new metrics row for 70 s", "limit 60 s"], None),
    ("hosts on two trees: no go, one line naming both", dict(beats={**TREES, "1-1": beat(tree="b" * 64)}), "wait", 0,
     ["hosts run different trees: slice0-worker0, slice0-worker1, slice1-worker0 aaaaaaaaaaaa; slice1-worker1 "
      "bbbbbbbbbbbb: `launch_tpu.sh stop`, then `start`"], None),
    ("one tree everywhere: go", dict(beats={**TREES, "1-1": beat(tree="a" * 64)}), "go", 1, [], None),
    ("after a maintenance stop, the noticed host on its old boot: wait",
     dict(**MAINT, maintenance=NOTICE, beats=idle_beats(**{"0-1": {"boot": "b1"}})), "wait", 1,
     ["waiting for slice0-worker1 to reboot after its maintenance notice"], None),
    ("… rebooted (a new boot id): go, not counted", dict(**MAINT, maintenance=NOTICE, status={"attempts": FAILED[
        "attempts"]}, beats=idle_beats(**{"0-1": {"boot": "b2"}})), "go", 2, ["maintenance notice"], "stopped"),
    ("… or its maintenance-event is NONE again (migrated): go",
     dict(**MAINT, maintenance=NOTICE, beats=idle_beats(**{"0-1": {"boot": "b1", "event": "NONE"}})), "go", 2, [],
     "stopped"),
    ("… or maintenance_wait_s passed: go", dict(**MAINT, maintenance={"0-1": {**NOTICE["0-1"], "time": NOW - 700}},
                                                beats=idle_beats(**{"0-1": {"boot": "b1"}})), "go", 2, [], "stopped"),
]


@pytest.mark.parametrize("case", BOUNDS, ids=[c[0] for c in BOUNDS])
def test_decide_preemptions_deadlines_stalls_trees_and_maintenance(case):
    _, kw, kind, attempt, words, ended = case
    kw = dict(kw)
    fields = {k: kw.pop(k) for k in ("since", "rows", "maintenance") if k in kw}
    v = A.dataclasses.replace(view(**kw), **fields)
    a = A.decide(v, max_attempts=3, lost_after_s=120, lim=LIM)
    assert (a.kind, a.attempt) == (kind, attempt), a
    for w in words:
        assert w in a.reason, (w, a.reason)
    if ended:
        assert A.next_status(v.status, a, v)["attempts"][str(v.go)]["result"] == ended


def test_a_stale_maintenance_record_does_not_belong_to_the_attempt(tmp_path):
    """A notice for (point, attempt) written before that attempt's go (the point's _state was removed and its
    attempts count from 1 again) is not this attempt's: it does not abort it."""
    base = tmp_path / "sweep"
    plan = A.load_plan(str(_plan(base, ["a"])))
    L = A.Layout(str(base))
    atomic_write_json(L.go("a", 1), {"attempt": 1, "time": 500.0})
    atomic_write_json(L.maintenance("0-1"), {"event": "TERMINATE_ON_HOST_MAINTENANCE", "point": "a", "attempt": 1,
                                             "time": 400.0, "boot": "b"})
    assert A.read_view(L, plan["points"][0], A.hosts(plan), "0-0", 600.0, False).maintenance == {}
    atomic_write_json(L.maintenance("0-1"), {**read_json(L.maintenance("0-1")), "time": 550.0})
    assert A.read_view(L, plan["points"][0], A.hosts(plan), "0-0", 600.0, False).maintenance["0-1"]["time"] == 550.0


CHILD = ("p", 1)
HOST = [
    # (view, (what, words in why))
    (A.HostView("p", 1, child=CHILD, leader_age=3), ("run", "")),
    (A.HostView("p", 1, child=CHILD, abort="boom"), ("kill", "attempt aborted: boom")),
    (A.HostView("p", 1, child=CHILD, stop=True), ("kill", "stop requested")),
    (A.HostView("p", 1, child=CHILD, leader_age=121), ("kill", "the leader (slice0-worker0) is lost")),
    (A.HostView("p", 1, child=CHILD, leader_age=121, killing=True), ("run", "waiting")),
    (A.HostView("p", 2, child=CHILD), ("kill", "moved on to p attempt 2")),
    (A.HostView("p", 1), ("start", "")),
    (A.HostView("p", 1, started=True), ("close", "restarted during the attempt")),
    (A.HostView("p", 1, abort="boom"), ("close", "aborted before it started: boom")),
    (A.HostView("p", 1, stop=True), ("close", "stop requested before it started")),
    (A.HostView("p", 1, exited=True, stop=True), ("exit", "stop requested")),
    (A.HostView("p", 1, exited=True, abort="x", leader_age=500), ("idle", "")),
    (A.HostView("p", 0), ("idle", "")),
    (A.HostView(None), ("exit", "every point is finished or failed")),
]


@pytest.mark.parametrize("v,want", HOST)
def test_host_decide(v, want):
    what, why = A.host_decide(v, lost_after_s=120)
    assert what == want[0] and want[1] in why, (what, why)


def test_status_record_of_a_retried_attempt_is_idempotent():
    v = view(go=1, abort="slice1-worker0 exited with code 1: boom", exits=all_exit(130, **{"1-0": ex(1)}),
             status={"state": "running", "attempt": 1, "attempts": {"1": {"started": 900.0}}})
    a = A.decide(v, 3, 120)
    st = A.next_status(v.status, a, v)
    assert st["state"] == "running" and st["attempt"] == 2
    assert st["attempts"]["1"] == {"started": 900.0, "ended": NOW, "result": "failed",
                                   "reason": "slice1-worker0 exited with code 1: boom",
                                   "exits": {"0-0": 130, "0-1": 130, "1-0": 1, "1-1": 130}}
    assert st["attempts"]["2"] == {"started": NOW}
    later = A.dataclasses.replace(v, now=NOW + 50, status=st)
    assert A.next_status(st, a, later) == st  # a leader restarted between status and go-2 writes the same


def test_identity_from_overrides_then_tpu_metadata():
    assert A.identity({"DILOCO_TPU_SLICE": "1", "DILOCO_TPU_WORKER": "3"}, lambda k: None) == (1, 3)
    meta = {"agent-worker-number": "2", "tpu-env": "ACCELERATOR_TYPE: 'v5p-16'\nMEGASCALE_SLICE_ID: '1'\n"}
    assert A.identity({}, meta.get) == (1, 2)
    assert A.identity({"MEGASCALE_SLICE_ID": "0"}, meta.get) == (0, 2)  # the environment wins, as in JAX
    assert A.identity({}, {"agent-worker-number": "0"}.get) == (0, 0)  # one slice: no MEGASCALE_* at all
    with pytest.raises(A.ConfigError, match="DILOCO_TPU_WORKER"):
        A.identity({}, lambda k: None)


def test_plan_errors_name_the_field(tmp_path):
    with pytest.raises(A.ConfigError, match="--plan"):
        A.load_plan(str(tmp_path / "nope.json"))
    atomic_write_json(tmp_path / "p.json", {"base": "x", "sweep": "s", "slices": 1, "points": []})
    with pytest.raises(A.ConfigError, match="plan.hosts_per_slice"):
        A.load_plan(str(tmp_path / "p.json"))
    plan = A.load_plan(str(_plan(tmp_path / "b", ["a"])))
    with pytest.raises(A.ConfigError, match="plan has 1 slice"):
        A.Agent(plan, 1, 0, tmp_path / "w")


def test_status_shows_steps_time_on_the_pod_eta_cost_and_eval_loss_and_a_finished_pod_still_billing(tmp_path):
    """By hand: 2 × v5p-16 = 16 chips × $4.20 (on-demand list price) = $67.20/h. a finished after 3600 s on the pod
    → $67.20. b: attempt 1 ran 600 s, attempt 2 since 6000 s (now 7800 s) → 2400 s, $44.80; 500 s for 250 of
    1000 steps → ETA 750 × 2 s = 0:25:00; its last eval loss 3.5 (the last row has none). c has not started."""
    base = tmp_path / "sweep"
    plan = read_json(_plan(base, ["a", "b", "c"], slices=2))
    L, now = S.Layout(str(base)), 7800.0
    for name, st, steps, rows in [
            ("a", {"state": "finished", "attempt": 1, "attempts": {"1": {"started": 1000, "ended": 4600}}}, 100,
             [{"step": 100, "seconds": 3000.0, "eval_loss": 2.9}]),
            ("b", {"state": "running", "attempt": 2, "attempts": {"1": {"started": 5000, "ended": 5600, "result": "failed",
             "reason": "x"}, "2": {"started": 6000}}}, 1000, [{"step": 100, "seconds": 200.0, "eval_loss": 3.5},
                                                              {"step": 250, "seconds": 500.0, "train_loss": 3.4}])]:
        atomic_write_json(L.status(name), st)
        atomic_write_json(L.go(name, st["attempt"]), {"attempt": st["attempt"], "time": 0})
        atomic_write_json(base / name / "config.json", {"steps": steps})
        atomic_write_text(base / name / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    atomic_write_json(base / "a" / "summary.json", {"final_eval_loss": 2.9, "params_sha256": "ab" * 32})
    rep = S.collect(str(base), now=now)
    a, b, c = rep["points"]
    assert rep["per_hour"] == pytest.approx(67.2) and (a["on_pod_s"], b["on_pod_s"], c["on_pod_s"]) == (3600, 2400, 0)
    assert (b["step"], b["steps"], b["eta_s"], b["eval_loss"]) == (250, 1000, 1500.0, 3.5) and "step" not in c
    text = S.render(rep)
    assert "pod cost $67.20/h: 16 chips × $4.20/chip-h (on-demand list price of 2025-06; an estimate)" in text
    assert "      step 100/100  on pod 1:00:00  $67.20  eval_loss 2.9\n" in text
    assert "      step 250/1000  on pod 0:40:00  ETA 0:25:00  $44.80  eval_loss 3.5\n" in text
    assert "still billing" not in text and S.billing_line(rep) is None
    # every point ended: the queued resource, when launch_tpu.sh passes its state, or fresh heartbeats say it bills
    for name in ("b", "c"):
        atomic_write_json(L.status(name), {"state": "failed", "attempt": 0, "reason": "r", "attempts": {}})
    assert "still ACTIVE: the pod is still billing ≈ $67.20/h" in S.render(S.collect(str(base), now=now, qr_state="ACTIVE"))
    assert S.billing_line(S.collect(str(base), now=now, qr_state="absent")) is None
    assert S.billing_line(S.collect(str(base), now=now)) is None  # no host heartbeats
    atomic_write_json(L.beat("0-0"), {"state": "done", "time": time.time()})
    assert "1 host(s) still send heartbeats" in S.billing_line(S.collect(str(base)))
    # spot: no price in the table, so the cost is n/a unless --price gives one
    atomic_write_json(base / "_launch" / "plan.json", {**plan, "capacity": "spot"})
    rep = S.collect(str(base), now=now)
    assert rep["per_hour"] is None and "pod cost n/a: no spot price for v5p" in S.render(rep) and "$—" in S.render(rep)
    assert S.collect(str(base), now=now, price=1.5)["per_hour"] == pytest.approx(24.0)


# -- agents as processes ---------------------------------------------------------------------------------
# The stand-in for `diloco train` on one host: records when it ran, fails where told, SIGTERM → exit 130
# (as train does after saving a checkpoint); process 0 writes summary.json when it ends well.
FAKE = r'''
import json, os, signal, sys, time
from pathlib import Path
a = dict(zip(sys.argv[1::2], sys.argv[2::2]))
wd = Path(a["--workdir"]); wd.mkdir(parents=True, exist_ok=True)
host = os.environ["DILOCO_TPU_SLICE"] + "-" + os.environ["DILOCO_TPU_WORKER"]
n = int(os.environ["DILOCO_TPU_ATTEMPT"])
t0 = time.time()
def done(code, what):
    (wd / f"run-{host}-{n}.json").write_text(json.dumps({"start": t0, "end": time.time(), "code": code, "what": what}))
    print(f"fake {host} attempt {n}: {what}", flush=True)
    os._exit(code)
if a.get("--ignore-term") == host:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, lambda *_: done(130, "SIGTERM: saved a checkpoint"))
print(f"fake {host} attempt {n}: started", flush=True)
if a.get("--fail") in (f"{host}:{n}", f"{host}:*"):
    time.sleep(0.3)
    done(1, "boom")
secs = [float(s) for s in a.get("--seconds", "1").split(",")]
time.sleep(secs[min(n, len(secs)) - 1])
if host == "0-0":
    (wd / "summary.json").write_text(json.dumps({"final_eval_loss": 1.25, "params_sha256": "ab" * 32}))
done(0, "done")
'''
FAST = {"poll_s": 0.1, "log_upload_s": 0.5, "lost_after_s": 5, "abort_grace_s": 2, "stop_grace_s": 20}


def _plan(base: Path, points, slices=1, hosts_per_slice=2, args=None, **kw) -> Path:
    fake = base.parent / "fake_train.py"
    fake.write_text(FAKE)
    args = args or {}
    plan = {"version": 1, "sweep": base.name, "base": str(base), "qr": "qr", "zone": "z", "project": "",
            "accelerator": "v5p-16", "slices": slices, "hosts_per_slice": hosts_per_slice, "max_attempts": 3,
            "teardown": False, "env": {"FAKE_ENV": "1"}, "program": [sys.executable, str(fake)], **FAST, **kw,
            "points": [{"name": p, "workdir": str(base / p), "argv": ["--workdir", str(base / p), *args.get(p, [])]}
                       for p in points]}
    atomic_write_json(base / "_launch" / "plan.json", plan)
    return base / "_launch" / "plan.json"


class Pod:
    """Agents as local processes, one per host (what startup.sh starts on each TPU VM)."""

    def __init__(self, plan: Path, tmp: Path):
        self.plan, self.tmp = plan, tmp
        p = read_json(plan)
        self.base, self.hosts = Path(p["base"]), A.hosts(p)
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, *hosts, **extra_env):
        for h in hosts or self.hosts:
            s, w = h.split("-")
            env = dict(os.environ, DILOCO_TPU_SLICE=s, DILOCO_TPU_WORKER=w, **extra_env)
            out = open(self.tmp / f"agent-{h}.out", "ab")
            self.procs[h] = subprocess.Popen(
                [sys.executable, "-m", "diloco.tpu.agent", "--plan", str(self.plan), "--work", str(self.tmp / f"work-{h}")],
                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO, start_new_session=True)
            out.close()

    def kill(self, h):
        """The VM goes away: its agent and its child, at once."""
        child = read_json(self.tmp / f"work-{h}" / "child.json")
        os.killpg(self.procs[h].pid, signal.SIGKILL)
        if child:
            os.killpg(child["pid"], signal.SIGKILL)
        self.procs[h].wait()

    def wait(self, timeout=90):
        deadline = time.time() + timeout
        for h, p in self.procs.items():
            try:
                assert p.wait(max(1, deadline - time.time())) == 0, self.out(h)
            except subprocess.TimeoutExpired:
                self.close()
                pytest.fail(f"agent {h} still running after {timeout} s:\n" + self.outs())

    def out(self, h) -> str:
        return (self.tmp / f"agent-{h}.out").read_text()

    def outs(self) -> str:
        return "\n".join(f"--- {h}\n{self.out(h)[-3000:]}" for h in self.procs)

    def close(self):
        for h, p in self.procs.items():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            child = read_json(self.tmp / f"work-{h}" / "child.json")
            if child:
                try:
                    os.killpg(child["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def status(self, point):
        return read_json(self.base / point / "_state" / "status.json", {})

    def runs(self, point) -> dict:
        return {f.stem[4:]: json.loads(f.read_text()) for f in (self.base / point).glob("run-*.json")}


def until(cond, timeout=60, what="", pod=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    pytest.fail(f"timed out after {timeout} s waiting for {what}\n" + (pod.outs() if pod else ""))


@pytest.fixture
def pod(tmp_path):
    pods = []

    def make(*a, **kw):
        p = Pod(_plan(tmp_path / "sweep", *a, **kw), tmp_path)
        pods.append(p)
        return p

    yield make
    for p in pods:
        p.close()


def test_a_failing_host_is_retried_and_the_next_point_starts_on_free_chips(pod):
    """2 slices × 2 hosts. Point a: slice1-worker0 fails in attempt 1 → abort → the others' children
    get SIGTERM → attempt 2 on all four → finished. Point b starts only after every a child exited."""
    p = pod(["a", "b"], slices=2, hosts_per_slice=2,
            args={"a": ["--fail", "1-0:1", "--seconds", "30,1"], "b": ["--seconds", "0.5"]})
    p.start()
    p.wait()
    a, b = p.status("a"), p.status("b")
    assert (a["state"], a["attempt"], b["state"], b["attempt"]) == ("finished", 2, "finished", 1)
    assert a["attempts"]["1"]["result"] == "failed"
    assert a["attempts"]["1"]["reason"] == "slice1-worker0 exited with code 1: fake 1-0 attempt 1: boom"
    assert a["attempts"]["1"]["exits"] == {"0-0": 130, "0-1": 130, "1-0": 1, "1-1": 130}
    att1 = p.base / "a" / "_state" / "attempt-1"
    for h in ("0-0", "0-1", "1-1"):
        e = read_json(att1 / f"{h}.json")
        assert e["reason"].startswith("attempt aborted: slice1-worker0 exited with code 1") and not e["stopped"]
    runs_a, runs_b = p.runs("a"), p.runs("b")
    assert sorted(runs_a) == sorted(f"{h}-{n}" for h in H4 for n in (1, 2))
    # the next attempt and the next point start only after every child of the previous one was reaped
    assert min(r["start"] for k, r in runs_a.items() if k.endswith("-2")) > \
        max(r["end"] for k, r in runs_a.items() if k.endswith("-1"))
    assert min(r["start"] for r in runs_b.values()) > max(r["end"] for r in runs_a.values())
    # logs per attempt and host; attempt 2 did not overwrite attempt 1
    logs = p.base / "a" / "logs"
    assert "boom" in (logs / "attempt-1" / "slice1-worker0.log").read_text()
    assert "SIGTERM" in (logs / "attempt-1" / "slice0-worker1.log").read_text()
    assert "attempt 2: done" in (logs / "attempt-2" / "slice1-worker0.log").read_text()
    assert "attempt 2" not in (logs / "attempt-1" / "slice1-worker0.log").read_text()
    beats = {h: read_json(p.base / "_pod" / "hosts" / f"{h}.json") for h in H4}
    assert {b["state"] for b in beats.values()} == {"done"}
    assert "abort attempt 1: slice1-worker0 exited with code 1" in (p.base / "_pod" / "logs" /
                                                                   "slice0-worker0.agent.log").read_text()
    rep = S.collect(str(p.base))
    text = S.render(rep)
    assert S.exit_code(rep) == 0
    assert f"a  finished  final_eval_loss 1.25  params_sha256 {'ab' * 32} (earlier: attempt 1: slice1-worker0 " \
           "exited with code 1" in text
    assert f"b  finished  final_eval_loss 1.25  params_sha256 {'ab' * 32}\n" in text


def test_a_lost_host_is_waited_for_and_its_rejoining_agent_resumes_the_point(pod):
    """slice0-worker1 dies with its child (a VM lost to maintenance): the leader sees its heartbeat go
    stale, aborts, waits; the repaired host's agent rejoins, closes the lost attempt, attempt 2 runs."""
    p = pod(["a", "b"], args={"a": ["--seconds", "60,1"], "b": ["--seconds", "0.2"]})
    p.start()
    att1 = p.base / "a" / "_state" / "attempt-1"
    log1 = p.base / "a" / "logs" / "attempt-1" / "slice0-worker1.log"
    until(lambda: log1.exists() and "started" in log1.read_text(), what="a log upload while running", pod=p)
    rep = S.collect(str(p.base))
    assert [(x["name"], x["state"]) for x in rep["points"]] == [("a", "running"), ("b", "waiting")]
    assert "a  running   attempt 1  no metrics row yet" in S.render(rep)
    p.kill("0-1")
    t_kill = time.time()
    until(lambda: (att1 / "abort").exists(), what="the abort", pod=p)
    assert time.time() - t_kill >= FAST["lost_after_s"] - 0.5  # noticed by the stale heartbeat, not before
    assert "slice0-worker1 lost" in (att1 / "abort").read_text()
    until(lambda: (att1 / "0-0.json").exists(), what="the leader's child reaped", pod=p)
    assert read_json(att1 / "0-0.json")["code"] == 130
    time.sleep(1.0)
    rep = S.collect(str(p.base))
    text = S.render(rep)
    assert not (p.base / "a" / "_state" / "go-2.json").exists()  # no new attempt without the lost host
    assert "attempt 1 aborted; waiting for the exit of slice0-worker1 lost" in text
    assert [h["lost"] for h in rep["hosts"]] == [False, True]
    assert "slice0-worker1" in text and "lost? running a attempt 1" in text
    p.start("0-1")  # the repaired VM reruns startup.sh
    p.wait()
    e = read_json(att1 / "0-1.json")
    assert e["code"] is None and "restarted during the attempt" in e["reason"]
    a = p.status("a")
    assert (a["state"], a["attempt"]) == ("finished", 2)
    assert "slice0-worker1 lost" in a["attempts"]["1"]["reason"]
    assert p.status("b")["state"] == "finished"
    assert "fake 0-1 attempt 1: started" in log1.read_text()


def test_stop_waits_for_every_child_then_start_resumes_without_counting_the_stop(pod):
    """The stop marker: every agent SIGTERMs its child (train saves a checkpoint) and exits after
    reaping it; `status --wait-stopped` returns only then. Started again, the point resumes; with
    max_attempts=1 it still finishes (a stopped attempt is not a failed one)."""
    p = pod(["a"], max_attempts=1, args={"a": ["--seconds", "60,1"]})
    p.start()
    att1 = p.base / "a" / "_state" / "attempt-1"
    logs = [p.base / "a" / "logs" / "attempt-1" / f"{A.label(h)}.log" for h in p.hosts]
    until(lambda: all(f.exists() and "started" in f.read_text() for f in logs), what="both running", pod=p)
    assert S.busy(str(p.base))  # `launch_tpu.sh down` refuses now
    atomic_write_text(p.base / "_launch" / "control" / "stop", "stop\n")
    assert S.wait_stopped(str(p.base), timeout=30, poll=0.1, say=lambda s: None) == 0
    for h in p.hosts:  # what the child saved on SIGTERM is there when the wait returns
        assert p.runs("a")[f"{h}-1"]["what"] == "SIGTERM: saved a checkpoint"
        assert read_json(att1 / f"{h}.json") == {**read_json(att1 / f"{h}.json"), "code": 130, "stopped": True}
    p.wait(timeout=10)  # the agents exit after a stop
    assert not S.busy(str(p.base))
    rep = S.collect(str(p.base))
    assert rep["points"][0]["state"] == "stopped" and S.exit_code(rep) == 2
    assert "stop requested (launch_tpu.sh stop)" in S.render(rep)
    (p.base / "_launch" / "control" / "stop").unlink()  # `launch_tpu.sh start` removes the marker
    p.start()
    p.wait()
    a = p.status("a")
    assert (a["state"], a["attempt"]) == ("finished", 2) and a["attempts"]["1"]["result"] == "stopped"


def test_attempts_exhausted_fail_the_point_with_its_log_and_the_sweep_goes_on(pod, capsys):
    """A host fails every attempt: after max_attempts the point is failed (reason recorded, last log
    lines in status) and the next point runs. A child that ignores SIGTERM is SIGKILLed after the
    abort grace period."""
    p = pod(["bad", "good"], max_attempts=2,
            args={"bad": ["--fail", "0-1:*", "--ignore-term", "0-0", "--seconds", "60"], "good": ["--seconds", "0.2"]})
    p.start()
    p.wait()
    bad = p.status("bad")
    assert (bad["state"], bad["attempt"]) == ("failed", 2)
    assert bad["reason"] == "attempt 2 (of at most 2): slice0-worker1 exited with code 1: fake 0-1 attempt 2: boom"
    e = read_json(p.base / "bad" / "_state" / "attempt-2" / "0-0.json")
    assert e["code"] == -signal.SIGKILL and e["reason"].endswith("SIGKILL after the grace period")
    assert p.status("good")["state"] == "finished"
    assert S.main([str(p.base)]) == 1
    text = capsys.readouterr().out
    assert "bad   failed    attempt 2 (of at most 2): slice0-worker1 exited with code 1" in text
    assert "last lines of slice0-worker1's log (attempt 2):\n      | fake 0-1 attempt 2: started\n" \
           "      | fake 0-1 attempt 2: boom" in text, text
    assert "good  finished" in text


def test_a_failed_point_runs_again_once_its_state_is_removed_and_finished_points_do_not(pod):
    """docs/distributed.md §9 step 5, "when a point fails": fix the cause (here: a new plan), remove the
    point's _state, start the agents again. The failed point runs from attempt 1 and finishes; the
    finished point is not run again."""
    p = pod(["bad", "good"], max_attempts=1, args={"bad": ["--fail", "0-1:*"], "good": ["--seconds", "0.2"]})
    p.start()
    p.wait()
    assert (p.status("bad")["state"], p.status("good")["state"]) == ("failed", "finished")
    good_runs = p.runs("good")
    plan = read_json(p.plan)
    plan["points"][0]["argv"] = ["--workdir", plan["points"][0]["workdir"], "--seconds", "0.2"]  # the fix
    atomic_write_json(p.plan, plan)
    shutil.rmtree(p.base / "bad" / "_state")  # gcloud storage rm -r gs://…/bad/_state
    p.start()
    p.wait()
    bad = p.status("bad")
    assert (bad["state"], bad["attempt"]) == ("finished", 1) and list(bad["attempts"]) == ["1"], bad
    assert {h: r["code"] for h, r in p.runs("bad").items()} == {"0-0-1": 0, "0-1-1": 0}
    assert p.runs("good") == good_runs and p.status("good")["state"] == "finished"


def test_teardown_deletes_the_queued_resource_once_every_point_is_done(pod, tmp_path):
    """plan teardown: after the last point the leader (and only it) runs gcloud's delete, once."""
    calls = tmp_path / "gcloud-calls.jsonl"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "gcloud").write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                                   f"open({str(calls)!r}, 'a').write(json.dumps([os.environ['DILOCO_TPU_WORKER'], "
                                   "sys.argv[1:]]) + '\\n')\n")
    (bindir / "gcloud").chmod(0o755)
    p = pod(["a"], teardown=True, project="proj", args={"a": ["--seconds", "0.2"]})
    p.start(PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}")
    p.wait()
    assert [json.loads(line) for line in calls.read_text().splitlines()] == [
        ["0", ["compute", "tpus", "queued-resources", "delete", "qr", "--zone=z", "--project=proj", "--force",
               "--quiet", "--async"]]]
    assert "teardown: exit 0" in (p.base / "_pod" / "logs" / "slice0-worker0.agent.log").read_text()


@pytest.mark.parametrize("boot,ended", [("b1", "failed"), ("b2", "preempted")])
def test_a_restarted_leader_continues_from_the_bucket(tmp_path, monkeypatch, boot, ended):
    """The leader's agent dies mid-point (its child with it) and comes back: from the bucket alone it
    closes its own lost attempt, aborts, waits for the follower, and starts attempt 2 — never attempt 1
    again. On the boot it started the attempt on (b1) the agent died, not the VM: a failed attempt; on a
    new boot (b2: the leader's VM was lost and replaced) the attempt is preempted, not counted."""
    base = tmp_path / "sweep"
    plan = A.load_plan(str(_plan(base, ["a"])))
    L = A.Layout(str(base))
    atomic_write_json(L.go("a", 1), {"attempt": 1})
    atomic_write_json(L.status("a"), {"state": "running", "attempt": 1, "attempts": {"1": {"started": 1.0}}})
    atomic_write_json(L.attempt("a", 1) / "0-0.start", {"boot": "b1"})
    atomic_write_json(L.attempt("a", 1) / "0-1.start", {"boot": "f1"})
    t = time.time()
    atomic_write_json(L.beat("0-1"), {"state": "running", "time": t})
    monkeypatch.setenv("DILOCO_TPU_SLICE", "0")
    monkeypatch.setenv("DILOCO_TPU_WORKER", "0")
    monkeypatch.setenv("DILOCO_BOOT_ID", boot)
    leader = A.Agent(plan, 0, 0, tmp_path / "w", say=lambda s: None)
    assert leader.step(t)
    closed = read_json(L.attempt("a", 1) / "0-0.json")
    assert closed["code"] is None and closed["replaced"] == (ended == "preempted")  # the child was lost
    assert leader.step(t)
    assert "slice0-worker0 restarted during the attempt" in (L.attempt("a", 1) / "abort").read_text()
    assert leader.step(t) and not L.go("a", 2).exists()  # the follower has not exited
    atomic_write_json(L.attempt("a", 1) / "0-1.json", ex(130, "attempt aborted"))
    atomic_write_json(L.beat("0-1"), {"state": "idle", "time": t})
    assert leader.step(t)
    assert L.go("a", 2).exists() and leader.child_of == ("a", 2)
    leader.child.wait(30)
    assert read_json(L.status("a"))["attempts"]["1"]["result"] == ended


@pytest.mark.parametrize("log,want", [
    ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n    f()\nValueError: boom\n",
     "ValueError: boom"),
    ("step 2\ndiloco train: bad input: tau: 9 must be < H=4\n", "diloco train: bad input: tau: 9 must be < H=4"),
    ("jax.errors.JaxRuntimeError: UNKNOWN: Gloo context initialization failed\nF1201 client.h:80] Terminating\n"
     "*** Check failure stack trace: ***\n    @     0x7f82cd50cd5b  std::_Function_handler<>::_M_invoke()\n"
     "    @     0x7f82f6e9e1f5  (unknown)\n", "jax.errors.JaxRuntimeError: UNKNOWN: Gloo context initialization failed"),
    ("E1201 rpc.cc:1] Polled an error from coordination service\n    @     0x7f  (unknown)\n",
     "E1201 rpc.cc:1] Polled an error from coordination service"),
    ("step 2\nstep 4\n", "step 4"),
    ("", ""),
])
def test_the_exit_reason_is_the_line_that_says_why(tmp_path, log, want):
    (tmp_path / "a.log").write_text(log)
    assert A.last_line(tmp_path / "a.log") == want


def test_a_maintenance_notice_checkpoints_every_host_now_and_the_attempt_is_not_counted(pod, tmp_path):
    """slice0-worker1's metadata says TERMINATE_ON_HOST_MAINTENANCE while point a runs: the leader aborts
    the attempt as a stop (every child SIGTERMed: train saves a checkpoint), the attempt is not counted,
    and with max_attempts=1 the point still finishes in attempt 2 (the notice is not acted on twice)."""
    p = pod(["a"], max_attempts=1, args={"a": ["--seconds", "60,1"]})
    md = tmp_path / "metadata-0-1"
    md.mkdir()
    p.start("0-0")
    p.start("0-1", DILOCO_METADATA_DIR=str(md), DILOCO_BOOT_ID="boot-1")
    logs = [p.base / "a" / "logs" / "attempt-1" / f"{A.label(h)}.log" for h in p.hosts]
    until(lambda: all(f.exists() and "started" in f.read_text() for f in logs), what="both running", pod=p)
    (md / "maintenance-event").write_text("TERMINATE_ON_HOST_MAINTENANCE\n")
    # every child saved; the next attempt waits for the noticed host's reboot (its new boot id), not a moment less
    until(lambda: "waiting for slice0-worker1 to reboot" in p.status("a").get("note", ""), what="the wait", pod=p)
    time.sleep(1.0)
    assert not (p.base / "a" / "_state" / "go-2.json").exists()
    p.kill("0-1")
    p.start("0-1", DILOCO_METADATA_DIR=str(md), DILOCO_BOOT_ID="boot-2")  # the VM is back after its maintenance
    p.wait(timeout=120)
    a = p.status("a")
    assert (a["state"], a["attempt"]) == ("finished", 2), a
    assert a["attempts"]["1"]["result"] == "stopped"
    assert a["attempts"]["1"]["abort"] == ("maintenance notice on slice0-worker1 (TERMINATE_ON_HOST_MAINTENANCE): "
                                           "checkpointing now")
    for h in p.hosts:
        assert p.runs("a")[f"{h}-1"]["what"] == "SIGTERM: saved a checkpoint"
    assert "maintenance notice TERMINATE_ON_HOST_MAINTENANCE during a attempt 1" in p.out("0-1")
