"""`python -m diloco.tpu.agent --plan gs://B/ROOT/SWEEP/_launch/plan.json`: the driver on every TPU host.

startup.sh starts one agent on every host of every slice, in the unpacked tree; together they run
the sweep's points in order with nothing needed from the laptop. All coordination is files in the
bucket under BASE = plan["base"], each written whole (diloco.rundir), read fresh on every poll:

  BASE/_pod/hosts/<s>-<w>.json                   every host, every poll_s: its heartbeat
                                                 {point, attempt, state, pid, child, note, time, boot (this
                                                 boot's id), tree (the sha256 startup.sh verified), event}
  BASE/_pod/logs/slice<s>-worker<w>.agent.log    the agent's own log
  BASE/_pod/boot/slice<s>-worker<w>.log          the host's boot log (startup.sh uploads it)
  BASE/_pod/maintenance/<s>-<w>.json             a host's maintenance notice {event, point, attempt, time, boot}
  BASE/<point>/_state/go-<n>.json                the leader: every host runs attempt n now
  BASE/<point>/_state/attempt-<n>/<s>-<w>.start  a host started its child for attempt n {time, pid, boot}
  BASE/<point>/_state/attempt-<n>/<s>-<w>.json   a host's child was reaped (its chips are free):
                                                 {code, reason, stopped, killed (by this agent), time,
                                                 replaced (closed on another boot than it started on)}
  BASE/<point>/_state/attempt-<n>/abort          the leader: end attempt n (the reason)
  BASE/<point>/_state/status.json                the leader: waiting|running|finished|failed, every
                                                 attempt's result and reason, what it waits for
  BASE/<point>/logs/attempt-<n>/slice<s>-worker<w>.log   the child's output, every log_upload_s
                                                 and at its exit; a later attempt has its own folder
  BASE/_launch/control/stop                      the laptop's `stop`

The leader is slice 0 worker 0. It keeps nothing in memory that is not in the bucket, so a restarted
leader continues where the last one was. For the first point not finished or failed it:
  - writes go-<n> once every host's heartbeat is fresh and idle and every host has written its exit
    for attempt n-1 (so the next attempt, or the next point, starts only on free chips);
  - writes abort when a host's child exits non-zero or a host's heartbeat is older than lost_after_s;
    and when a host reports a maintenance notice (the VM's metadata `maintenance-event` turned from NONE
    while its child ran): then every host SIGTERMs its child with the stop grace, so all save a
    checkpoint together, and the attempt is not counted;
  - writes abort when every host heartbeats but the run's metrics.jsonl has not grown for too long (stalled);
  - fails the point when a host has been lost for lost_give_up × lost_after_s (it never came back);
  - when every host has exited: finished (all 0 and the run's summary.json), else the next attempt,
    or failed once max_attempts attempts have failed (an attempt ended by a stop is not counted, one
    whose VM was replaced or rebooted — a new boot id — counts toward max_preemptions instead);
  - starts no attempt while the hosts' heartbeats name different trees, nor after a maintenance stop
    until the noticed host has rebooted (or its event reads NONE again; maintenance_wait_s at most).
    A lost host's exit is written by its own agent when the repaired VM reruns startup.sh and the
    agent rejoins (its start marker without an exit: the child was lost with the VM).
Every host (the leader too) runs the point's argv as `python -m diloco.cli ARGV` in its own process
group and SIGTERMs it on abort, on stop, or (followers) when the leader's heartbeat is stale: SIGKILL
follows after abort_grace_s (abort; a lost peer means no checkpoint can be saved together) or
stop_grace_s (stop; `diloco train` saves a checkpoint on SIGTERM). On stop an agent exits once its
child is reaped; it also exits when every point is finished or failed (the leader first deletes the
queued resource when plan["teardown"]).

Host identity: DILOCO_TPU_SLICE / DILOCO_TPU_WORKER when set (the stand-in sets them; so may a user),
else what a TPU VM knows: MEGASCALE_SLICE_ID (environment, else the `tpu-env` metadata attribute;
0 on a single slice) and the metadata attribute `agent-worker-number` (as JAX's own cluster
detection reads them). The child's environment: the agent's, plan["env"], DILOCO_TPU_ATTEMPT=n, and
DILOCO_DISTRIBUTED=auto unless DILOCO_COORDINATOR is set (the stand-in's explicit job placement).
Times are each host's wall clock (GCE keeps them in sync); heartbeat ages compare them.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable

from diloco.errors import ConfigError
from diloco.rundir import atomic_write_json, atomic_write_text, path
from diloco.tpu.decide import (LEADER, MAINTENANCE, HostView, Limits, PointView, age, decide, host_decide, label,  # noqa: F401
                                next_status)
from diloco.tpu.host import free_chips, maintenance_event, raise_nofile
from diloco.tpu.layout import TIMING, Layout, fresh_reads, hosts, limits, load, load_plan, read_view  # noqa: F401

ENV_SLICE, ENV_WORKER, ENV_ATTEMPT = "DILOCO_TPU_SLICE", "DILOCO_TPU_WORKER", "DILOCO_TPU_ATTEMPT"
METADATA = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/"


# -- host identity ---------------------------------------------------------------------------------------
def metadata(key: str, timeout: float = 5.0) -> str | None:
    """A TPU VM's metadata attribute (None off GCE)."""
    req = urllib.request.Request(METADATA + key, headers={"Metadata-Flavor": "Google"})
    for _ in range(3):
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.read().decode()
        except OSError:
            time.sleep(0.5)
    return None


def identity(env=None, meta: Callable[[str], str | None] = metadata) -> tuple[int, int]:
    """(slice, worker) of this host (see the module docstring)."""
    env = os.environ if env is None else env
    if env.get(ENV_SLICE) is not None or env.get(ENV_WORKER) is not None:
        return int(env.get(ENV_SLICE, "0")), int(env[ENV_WORKER])
    s = env.get("MEGASCALE_SLICE_ID")
    if s is None:
        tpu_env = meta("tpu-env") or ""
        s = next((line.split(":", 1)[1].strip().strip("'\"") for line in tpu_env.splitlines()
                  if line.split(":", 1)[0].strip() == "MEGASCALE_SLICE_ID"), None)
    w = meta("agent-worker-number")
    if w is None or not w.strip().isdigit():
        raise ConfigError(ENV_WORKER, "not a TPU VM (no metadata attribute agent-worker-number) and "
                          f"{ENV_SLICE}/{ENV_WORKER} are unset; set them to this host's slice and worker")
    return int(s or 0), int(w)


# -- the loop (I/O) --------------------------------------------------------------------------------------
def boot_id() -> str:
    """This boot of this machine: a new one after a reboot or on a replaced VM. DILOCO_BOOT_ID overrides
    it (the stand-in's hosts share this machine's kernel; it gives each boot of each host its own)."""
    if os.environ.get("DILOCO_BOOT_ID"):
        return os.environ["DILOCO_BOOT_ID"]
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def start_ticks(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), None when it is gone: pid + this + boot id
    name one process, not a later one that reuses the pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class Agent:
    def __init__(self, plan: dict, slice_: int, worker: int, work: Path, say=print,
                 watch: Callable[[], str | None] | None = None):
        self.plan, self.me = plan, f"{slice_}-{worker}"
        self.hosts = hosts(plan)
        if self.me not in self.hosts:
            raise ConfigError(ENV_WORKER, f"this host is slice {slice_} worker {worker}, but the plan has "
                              f"{plan['slices']} slice(s) of {plan['hosts_per_slice']} host(s)")
        self.lead = self.me == LEADER
        self.L = Layout(plan["base"])
        self.work = Path(work)
        self.work.mkdir(parents=True, exist_ok=True)
        self._say = say
        self.final: set[str] = set()  # points known finished or failed
        self.child: subprocess.Popen | None = None
        self.child_of: tuple[str, int] | None = None
        self.child_log: Path | None = None
        self.kill: tuple[str, float, bool] | None = None  # (reason, SIGKILL deadline, stopping)
        self.killed_hard = False
        self.state, self.note, self.point, self.attempt = "idle", "", None, 0
        self.last_upload = 0.0
        self.signalled: str | None = None
        self.t0 = time.time()
        self.watch = watch  # the VM's maintenance-event (None: not watched)
        self.last_event = watch() if watch else None
        self.boot, self.tree = boot_id(), os.environ.get("DILOCO_TREE_SHA256")  # startup.sh: the tree it unpacked
        self.rows: dict[tuple[str, int], tuple[int, list[float]]] = {}  # leader: metrics.jsonl size, when it grew

    # -- small I/O helpers
    def say(self, msg: str) -> None:
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {label(self.me)}: {msg}"
        self._say(line)
        with open(self.work / "agent.log", "a", encoding="utf-8") as f:
            f.write(line + "\n")

    def upload(self, local: Path, remote) -> None:
        if local.exists():
            atomic_write_text(remote, local.read_text(encoding="utf-8", errors="replace"))

    def upload_logs(self, now: float, force: bool = False) -> None:
        if not force and now - self.last_upload < float(self.plan["log_upload_s"]):
            return
        self.last_upload = now
        if self.child_of is not None and self.child_log is not None:
            self.upload(self.child_log, self.L.log(*self.child_of, self.me))
        self.upload(self.work / "agent.log", self.L.agent_log(self.me))

    def identity_fields(self) -> dict:
        """What a heartbeat says of this host beyond its state: its boot, its tree, its maintenance-event."""
        return {"boot": self.boot, "tree": self.tree, "event": self.last_event}

    def heartbeat(self, now: float) -> None:
        atomic_write_json(self.L.beat(self.me), {
            "host": self.me, "point": self.point, "attempt": self.attempt, "state": self.state,
            "pid": os.getpid(), "child": self.child.pid if self.child else None, "note": self.note,
            "leader": self.lead, "time": now, **self.identity_fields()})

    def current_point(self) -> dict | None:
        for pt in self.plan["points"]:
            if pt["name"] in self.final:
                continue
            if (load(self.L.status(pt["name"]), {}) or {}).get("state") in ("finished", "failed"):
                self.final.add(pt["name"])
                continue
            return pt
        return None

    # -- the child
    def local_log(self, point: str, n: int) -> Path:
        return self.work / "logs" / point / f"attempt-{n}.log"

    def child_env(self, n: int) -> dict[str, str]:
        env = dict(os.environ, **{k: str(v) for k, v in self.plan["env"].items()})
        env[ENV_ATTEMPT] = str(n)
        env["EPATH_USE_TF"] = "false"  # one gs:// client (gcsfs) on every host, the one the tests run
        env.setdefault("PYTHONUNBUFFERED", "1")
        if "DILOCO_COORDINATOR" not in env:
            env.setdefault("DILOCO_DISTRIBUTED", "auto")  # a TPU pod: JAX finds its peers from the metadata
        return env

    def start(self, pt: dict, n: int, now: float) -> None:
        atomic_write_json(self.L.attempt(pt["name"], n) / f"{self.me}.start", {"time": now, "pid": os.getpid(),
                                                                              "boot": self.boot})
        program = self.plan.get("program") or [sys.executable, "-m", "diloco.cli"]
        cmd = [*program, *pt["argv"]]
        log = self.local_log(pt["name"], n)
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            self.child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=self.child_env(n), start_new_session=True)
        self.child_of, self.child_log, self.kill, self.killed_hard = (pt["name"], n), log, None, False
        atomic_write_json(self.work / "child.json", {"pid": self.child.pid, "boot": boot_id(),
                                                     "ticks": start_ticks(self.child.pid), "point": pt["name"],
                                                     "attempt": n})
        self.say(f"{pt['name']} attempt {n}: started pid {self.child.pid}: {' '.join(cmd)}")

    def signal_child(self, sig: int) -> None:
        try:
            os.killpg(self.child.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def reap(self, now: float) -> None:
        """The child has exited: kill what is left of its group, upload its log, write the exit."""
        rc = self.child.returncode
        self.signal_child(signal.SIGKILL)  # anything it left behind holds no chip either
        point, n = self.child_of
        for line in free_chips():
            self.say(line)
        if self.kill:
            reason = self.kill[0] + ("; SIGKILL after the grace period" if self.killed_hard else "")
        elif rc == 0:
            reason = "exited 0"
        else:
            reason = f"exited with code {rc}" + (f": {last_line(self.child_log)}" if last_line(self.child_log) else "")
        self.upload(self.child_log, self.L.log(point, n, self.me))
        stopping = bool(self.kill and self.kill[2])
        atomic_write_json(self.L.attempt(point, n) / f"{self.me}.json",
                          {"code": rc, "reason": reason, "stopped": stopping and rc != 0, "killed": bool(self.kill),
                           "time": now})
        self.say(f"{point} attempt {n}: child exited with code {rc} ({reason})")
        (self.work / "child.json").unlink(missing_ok=True)
        self.child, self.child_of, self.kill = None, None, None

    def close(self, point: str, n: int, reason: str, stopping: bool, now: float) -> None:
        """The exit of an attempt this host has no child for (lost with the VM, or never started). Started on
        another boot: the VM was replaced or rebooted (Spot, repair, maintenance), which is not a failure."""
        log = self.local_log(point, n)
        self.upload(log, self.L.log(point, n, self.me))  # what the lost child had written, if it survived
        boot = (load(self.L.attempt(point, n) / f"{self.me}.start", {}) or {}).get("boot")
        replaced = bool(boot) and boot != self.boot
        if "restarted" in reason:
            reason += " (the VM was replaced or rebooted: a new boot id)" if replaced else \
                " (the same boot: the agent died, the VM did not)"
        atomic_write_json(self.L.attempt(point, n) / f"{self.me}.json",
                          {"code": None, "reason": reason, "stopped": stopping, "killed": False, "replaced": replaced,
                           "time": now})
        self.say(f"{point} attempt {n}: {reason}")

    def kill_orphan(self) -> None:
        """A child an earlier agent on this host started (the agent died, the VM did not): end it."""
        rec = load(self.work / "child.json")
        if not rec:
            return
        pid = int(rec["pid"])
        if rec.get("boot") == boot_id() and rec.get("ticks") is not None and start_ticks(pid) == rec["ticks"]:
            self.say(f"killing pid {pid}, a child of an earlier agent ({rec['point']} attempt {rec['attempt']})")
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline = time.time() + 30
            while start_ticks(pid) == rec["ticks"] and time.time() < deadline:
                time.sleep(0.1)
        (self.work / "child.json").unlink(missing_ok=True)

    # -- one poll
    def rows_seen(self, pt: dict, v: PointView) -> tuple[float, ...]:
        """When the leader saw the run's metrics.jsonl change during attempt go (its size: a row rewrites it),
        since this agent first looked; () while no attempt runs."""
        if not v.go or v.abort is not None or len(v.exits) == len(v.hosts):
            return ()
        try:
            size = path(pt["workdir"]).joinpath("metrics.jsonl").stat().length
        except OSError:  # FileNotFoundError: no row yet
            size = -1
        key = (pt["name"], v.go)
        if key not in self.rows:
            self.rows = {key: (size, [])}  # what is there now may be an earlier attempt's: the baseline
        elif size != self.rows[key][0]:
            self.rows[key] = (size, (self.rows[key][1] + [v.now])[-50:])
        return tuple(self.rows[key][1])

    def lead_point(self, pt: dict, v: PointView) -> PointView:
        v = dataclasses.replace(v, rows=self.rows_seen(pt, v))
        a = decide(v, int(self.plan["max_attempts"]), float(self.plan["lost_after_s"]), float(self.plan["boot_wait_s"]),
                   limits(self.plan))
        st = next_status(v.status, a, v)
        if a.kind == "go":
            atomic_write_json(self.L.status(pt["name"]), st)
            atomic_write_json(self.L.go(pt["name"], a.attempt), {"attempt": a.attempt, "time": v.now,
                                                                   "after": a.reason})
            self.say(f"{pt['name']}: go attempt {a.attempt}" + (f" (attempt {v.go}: {a.reason})" if v.go else ""))
            return dataclasses.replace(v, go=a.attempt, abort=None, exits={}, starts=frozenset(), status=st)
        if a.kind == "abort":
            atomic_write_text(self.L.attempt(pt["name"], a.attempt) / "abort", a.reason)
            self.say(f"{pt['name']}: abort attempt {a.attempt}: {a.reason}")
            v = dataclasses.replace(v, abort=a.reason)
        elif a.kind in ("finish", "fail"):
            self.say(f"{pt['name']}: {'finished' if a.kind == 'finish' else 'failed'}: {a.reason}")
            self.final.add(pt["name"])
        if st != v.status:
            atomic_write_json(self.L.status(pt["name"]), st)
        return dataclasses.replace(v, status=st)

    def step(self, now: float | None = None) -> bool:
        """One poll: read, decide, act, heartbeat. False when the agent is done."""
        now = time.time() if now is None else now
        stop = self.L.stop.exists() or self.signalled is not None
        if self.child is not None and self.child.poll() is not None:
            self.reap(now)
        self.notice(now)
        pt = self.current_point()
        if pt is not None:
            v = read_view(self.L, pt, self.hosts, self.me, now, stop, self.t0)
            if self.lead:  # its own heartbeat is what it knows now, not what it wrote a poll ago
                beats = {**v.beats, self.me: {"state": "idle" if self.child is None else "running", "time": now,
                                              **self.identity_fields()}}
                v = self.lead_point(pt, dataclasses.replace(v, beats=beats))
                if pt["name"] in self.final:
                    pt = self.current_point()
                    v = read_view(self.L, pt, self.hosts, self.me, now, stop, self.t0) if pt else v
            hv = HostView(pt["name"] if pt else None, v.go, self.me in v.exits, self.me in v.starts, v.abort, stop,
                          None if self.lead else age(v.beats.get(LEADER), now), self.child_of, self.kill is not None)
        else:
            hv = HostView(None, stop=stop, child=self.child_of, killing=self.kill is not None)
        what, why = host_decide(hv, float(self.plan["lost_after_s"]))
        if what == "kill":
            stopping = why == "stop requested" or why.startswith(f"attempt aborted: {MAINTENANCE}")
            grace = float(self.plan["stop_grace_s" if stopping else "abort_grace_s"])
            self.kill = (why, now + grace, stopping)
            self.signal_child(signal.SIGTERM)
            self.say(f"{self.child_of[0]} attempt {self.child_of[1]}: SIGTERM ({why}); SIGKILL in {grace:.0f} s")
        elif what == "run" and self.kill and now > self.kill[1] and not self.killed_hard:
            self.signal_child(signal.SIGKILL)
            self.killed_hard = True
            self.say(f"{self.child_of[0]} attempt {self.child_of[1]}: SIGKILL (still running after the grace period)")
        elif what == "close":
            self.close(pt["name"], v.go, why, stop, now)
        elif what == "start":
            self.start(pt, v.go, now)
        self.point, self.attempt = (self.child_of if self.child_of else (hv.point, hv.go))
        self.state = ("stopping" if self.kill else "running") if self.child else \
            ("stopped" if stop else "done") if what == "exit" else "idle"
        self.note = why
        if what == "exit":
            self.say(f"exiting: {why}")
        self.upload_logs(now, force=what in ("exit", "close"))
        self.heartbeat(now)
        if what == "exit" and self.lead and pt is None and self.plan.get("teardown") and not stop:
            self.teardown()
        return what != "exit"

    def notice(self, now: float) -> None:
        """A new maintenance notice while this host runs a child: tell the leader (it checkpoints every host)."""
        ev = self.watch() if self.watch else None
        if ev is None or ev == self.last_event:
            return
        self.last_event = ev
        if ev != "NONE" and self.child_of is not None:
            atomic_write_json(self.L.maintenance(self.me), {"event": ev, "point": self.child_of[0],
                                                            "attempt": self.child_of[1], "time": now, "boot": self.boot})
            self.say(f"maintenance notice {ev} during {self.child_of[0]} attempt {self.child_of[1]}: "
                     "asking the leader to checkpoint every host now")

    def teardown(self) -> None:
        """Every point is finished or failed: delete the queued resource (this VM goes with it), once the
        other hosts have said they are done (or after lost_after_s)."""
        p = self.plan
        deadline = time.time() + float(p["lost_after_s"])
        while time.time() < deadline:
            beats = [load(self.L.beat(h)) or {} for h in self.hosts]
            if all(b.get("state") == "done" or age(b, time.time()) > float(p["lost_after_s"]) for b in beats):
                break
            time.sleep(float(p["poll_s"]))
        cmd = ["gcloud", "compute", "tpus", "queued-resources", "delete", p["qr"], f"--zone={p['zone']}",
               *([f"--project={p['project']}"] if p.get("project") else []), "--force", "--quiet", "--async"]
        self.say("teardown: " + " ".join(cmd))
        r = subprocess.run(cmd, capture_output=True, text=True)
        self.say(f"teardown: exit {r.returncode} {(r.stdout + r.stderr).strip()[-500:]}")
        self.upload_logs(time.time(), force=True)

    def run(self) -> int:
        def on_signal(signum, _):
            self.signalled = signal.Signals(signum).name

        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, on_signal)
        self.say(f"agent pid {os.getpid()} for sweep {self.plan['sweep']} ({len(self.plan['points'])} points, "
                 f"{len(self.hosts)} hosts){' — the leader' if self.lead else ''}; work folder {self.work}")
        self.kill_orphan()
        while True:
            try:
                if not self.step():
                    return 0
            except Exception as e:  # a bucket hiccup must not end the agent: say it, try again next poll
                self.say(f"error in this poll (retrying): {type(e).__name__}: {e}")
            time.sleep(float(self.plan["poll_s"]))


def last_line(log: Path | None) -> str:
    """The line of a child's log that best says why it ended: the last exception (or `diloco …:` line),
    else the last line naming an error (never a frame of a stack trace), else the last line."""
    if log is None or not log.exists():
        return ""
    lines = [ln.strip() for ln in log.read_text(encoding="utf-8", errors="replace").splitlines()
             if ln.strip() and not re.match(r"\s*(@ |\*\*\* Check failure|File \"|\^)", ln)]
    raised = [ln for ln in lines if re.match(r"([\w.]+(Error|Exception|Fault|Interrupt)|diloco \w+):", ln)]
    said = [ln for ln in lines if re.search(r"error|exception|fail|fatal", ln, re.IGNORECASE)]
    return (raised or said or lines or [""])[-1][-300:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m diloco.tpu.agent", description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True, help="BASE/_launch/plan.json (gs:// or a local folder)")
    ap.add_argument("--work", default=None, help="local folder for logs and the child's pid "
                    "(default ~/.diloco-agent/SWEEP)")
    args = ap.parse_args(argv)
    os.environ["EPATH_USE_TF"] = "false"
    fresh_reads()
    raise_nofile()
    try:
        plan = load_plan(args.plan)
        s, w = identity()
        work = Path(args.work or Path.home() / ".diloco-agent" / plan["sweep"])
        mdir = os.environ.get("DILOCO_METADATA_DIR")  # the stand-in's metadata server; on a VM its own
        watch = (lambda: maintenance_event(mdir)) if mdir or os.environ.get(ENV_WORKER) is None else None
        agent = Agent(plan, s, w, work, say=lambda line: print(line, flush=True), watch=watch)
    except ConfigError as e:
        print(f"diloco agent: bad input: {e}", file=sys.stderr)
        return 2
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
