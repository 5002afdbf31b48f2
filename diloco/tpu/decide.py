"""The decisions of the agents (diloco/tpu/agent.py), pure: what the leader does next for a point
(`decide`, and the status record it writes, `next_status`) and what one host does (`host_decide`), from
a view of the bucket read at one moment. Tested as tables (tests/test_tpu_agent.py)."""
from __future__ import annotations

import dataclasses
import json

LEADER = "0-0"
MAINTENANCE = "maintenance notice"  # an abort for this reason checkpoints like a stop and is not counted


@dataclasses.dataclass(frozen=True)
class Limits:
    """The leader's bounds beyond max_attempts (plan.json keys of the same names; layout.TIMING's defaults)."""
    max_preemptions: int = 20      # attempts ended by a replaced VM (Spot, repair, reboot) before the point fails
    lost_give_up: float = 10.0     # a lost host not back after this many × lost_after_s fails the point
    stall_rows: float = 5.0        # no new metrics row for this many × the longest gap so far: stalled
    stall_min_s: float = 1800.0    # … and never sooner than this (a checkpoint or eval may take long)
    maintenance_wait_s: float = 1800.0  # after a maintenance stop, wait this long at most for the host's reboot


def label(host: str) -> str:
    s, w = host.split("-")
    return f"slice{s}-worker{w}"


# -- what the hosts see --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PointView:
    """One point's state in the bucket as read at `now` (exits and starts of attempt `go` only)."""
    hosts: tuple[str, ...]
    go: int = 0                                    # the latest attempt the leader started (0: none)
    abort: str | None = None                       # attempt `go`'s abort reason
    exits: dict[str, dict] = dataclasses.field(default_factory=dict)   # host → exit record
    starts: frozenset[str] = frozenset()           # hosts that started a child for attempt `go`
    beats: dict[str, dict] = dataclasses.field(default_factory=dict)   # host → heartbeat
    summary: bool = False                          # the run's summary.json exists
    status: dict = dataclasses.field(default_factory=dict)             # status.json (the leader's record)
    stop: bool = False
    now: float = 0.0
    since: float = 0.0                             # when the leader's agent started
    boot: dict[str, list] = dataclasses.field(default_factory=dict)    # host without heartbeat → boot log tail
    maintenance: dict[str, dict] = dataclasses.field(default_factory=dict)  # host → its notice during attempt go
    rows: tuple[float, ...] = ()                   # when the leader saw metrics rows land during attempt go


def boot_tail(text: str | None, n: int = 3) -> list[str]:
    return [ln.strip() for ln in (text or "").splitlines() if ln.strip()][-n:]


def age(beat: dict | None, now: float) -> float:
    return float("inf") if not beat else now - float(beat.get("time", 0))


# -- the leader's decision (pure) ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Action:
    kind: str            # wait | go | abort | finish | fail
    attempt: int = 0
    reason: str = ""     # why (abort, fail, the previous attempt's end for go); what it waits for


def failures(v: PointView) -> list[str]:
    return [f"{label(h)} {v.exits[h].get('reason') or 'exited with code %s' % v.exits[h].get('code')}"
            for h in v.hosts if h in v.exits and v.exits[h].get("code") != 0]


def stopped(v: PointView) -> bool:
    return any(e.get("stopped") for e in v.exits.values())


def replaced(v: PointView) -> list[str]:
    """Hosts whose VM was replaced or rebooted during attempt `go` (their agent found a new boot id)."""
    return [h for h in v.hosts if (v.exits.get(h) or {}).get("replaced")]


def result(v: PointView) -> str:
    """How attempt `go` ended once every host has exited (not finished): stopped, preempted or failed."""
    return "stopped" if stopped(v) else "preempted" if replaced(v) else "failed"


def attempts_used(v: PointView, kind: str = "failed") -> int:
    """Attempts up to `go` that ended `kind`: failed ones count against max_attempts, preempted ones against
    max_preemptions; an attempt ended by a stop counts against neither."""
    earlier = v.status.get("attempts", {})
    used = sum(1 for k, a in earlier.items() if int(k) < v.go and a.get("result", "failed") == kind)
    return used + (1 if v.go and result(v) == kind else 0)


def lost_for(v: PointView, h: str) -> float:
    """How long host h has been silent as far as this leader can tell (not before its own agent started)."""
    return v.now - max(float((v.beats.get(h) or {}).get("time", 0)), v.since)


def stalled(v: PointView, lim: Limits) -> str:
    """'' or why attempt `go` is stalled: its hosts heartbeat but no metrics row has landed for too long."""
    if len(v.rows) < 2:  # the first rows follow compiles and restores: no interval is known before
        return ""
    gap = max(b - a for a, b in zip(v.rows, v.rows[1:]))
    quiet, limit = v.now - v.rows[-1], max(lim.stall_rows * gap, lim.stall_min_s)
    if quiet <= limit:
        return ""
    return (f"stalled: no new metrics row for {quiet:.0f} s while every host heartbeats (limit {limit:.0f} s: "
            f"{lim.stall_rows:g} × the longest gap between rows so far, {gap:.0f} s, at least {lim.stall_min_s:.0f} s)")


def go_blocker(v: PointView, lim: Limits) -> str:
    """'' or what the next go waits for once every host is idle: hosts on different trees, or a host that
    had a maintenance notice in the attempt that just ended and has not rebooted (or cleared it) yet."""
    trees: dict = {}
    for h in v.hosts:
        trees.setdefault((v.beats.get(h) or {}).get("tree"), []).append(label(h))
    if len(trees) > 1:
        return ("hosts run different trees: " + "; ".join(f"{', '.join(hs)} {(t or 'unknown')[:12]}"
                                                          for t, hs in sorted(trees.items(), key=lambda kv: kv[1]))
                + ": `launch_tpu.sh stop`, then `start` (every host then runs the bucket's current bundle)")
    if not (v.abort or "").startswith(MAINTENANCE):
        return ""
    for h, rec in sorted(v.maintenance.items()):
        b = v.beats.get(h) or {}
        if b.get("boot") == rec.get("boot") and b.get("event") != "NONE" and \
                v.now - float(rec.get("time", 0)) < lim.maintenance_wait_s:
            return (f"waiting for {label(h)} to reboot after its maintenance notice ({rec.get('event')}; at most "
                    f"{lim.maintenance_wait_s:.0f} s)")
    return ""


def decide(v: PointView, max_attempts: int, lost_after_s: float, boot_wait_s: float = float("inf"),
           lim: Limits = Limits()) -> Action:
    """What the leader does next for this point. A host that has sent no heartbeat boot_wait_s after the
    leader's agent started fails the point (its boot log's last lines in the reason): chips bill meanwhile;
    so does a host lost for lim.lost_give_up × lost_after_s."""
    n = v.go
    lost = {h for h in v.hosts if age(v.beats.get(h), v.now) > lost_after_s}
    gone_for_good = [h for h in sorted(lost) if h in v.beats and lost_for(v, h) > lim.lost_give_up * lost_after_s]

    def gone(h: str) -> str:
        return f"{label(h)} lost (no heartbeat for {lost_after_s:.0f} s)" if h in v.beats else \
            f"{label(h)} (no heartbeat yet)"

    if gone_for_good and not v.stop:
        return Action("fail", n, "; ".join(
            f"{label(h)} lost for {lost_for(v, h):.0f} s ({lim.lost_give_up:g} × lost_after_s): it never came back; "
            "repair or recreate the pod (`launch_tpu.sh down`, `up`), remove the point's _state, `start`"
            for h in gone_for_good))
    if n:
        missing = [h for h in v.hosts if h not in v.exits]
        if missing:
            if v.stop:
                return Action("wait", n, f"stop requested; waiting for {', '.join(map(label, missing))} to stop")
            if v.abort is None:
                why = failures(v) + [gone(h) for h in missing if h in lost]
                if not why and v.maintenance:  # every host saves now, together, as on a stop
                    return Action("abort", n, f"{MAINTENANCE} on " + ", ".join(
                        f"{label(h)} ({e.get('event')})" for h, e in sorted(v.maintenance.items()))
                        + ": checkpointing now")
                why = why or [w for w in [stalled(v, lim)] if w]
                return Action("abort", n, "; ".join(why)) if why else Action("wait", n, "running")
            return Action("wait", n, f"attempt {n} aborted; waiting for the exit of "
                          + ", ".join(gone(h) if h in lost else label(h) for h in missing))
        if all(e.get("code") == 0 for e in v.exits.values()) and v.summary:
            return Action("finish", n, "every host exited 0")
        if result(v) == "failed" and attempts_used(v) >= max_attempts:
            return Action("fail", n, f"attempt {n} (of at most {max_attempts}): {ended_reason(v)}")
        if result(v) == "preempted" and attempts_used(v, "preempted") > lim.max_preemptions:
            return Action("fail", n, f"preempted {attempts_used(v, 'preempted')} times (more than max_preemptions "
                          f"{lim.max_preemptions}): {ended_reason(v)}")
    if v.stop:
        return Action("wait", n, "stop requested")
    never = [h for h in v.hosts if h not in v.beats]
    if never and v.now - v.since > boot_wait_s:
        return Action("fail", n, "; ".join(
            f"{label(h)} never started (no heartbeat {boot_wait_s:.0f} s after the leader's agent started): "
            + (f"last boot log lines: {' | '.join(v.boot[h])}" if v.boot.get(h) else
               "no boot log in the bucket (see docs/distributed.md §9: the VM's service account, its journal)")
            for h in never))
    busy = [gone(h) if h in lost else f"{label(h)} ({v.beats[h].get('state')})" for h in v.hosts
            if h in lost or v.beats[h].get("state") != "idle"]
    if busy:
        return Action("wait", n, f"waiting for {', '.join(busy)} to be idle")
    blocker = go_blocker(v, lim)
    if blocker:
        return Action("wait", n, blocker)
    return Action("go", n + 1, ended_reason(v) if n else "")


def ended_reason(v: PointView) -> str:
    if stopped(v):
        return v.abort if v.abort and v.abort.startswith(MAINTENANCE) else "stopped"
    if replaced(v):
        return (f"preempted: the VM of {', '.join(map(label, replaced(v)))} was replaced or rebooted during the "
                "attempt (a new boot id): not counted against max_attempts")
    if v.abort:
        return v.abort
    return "; ".join(failures(v)) or "every host exited 0 but the run wrote no summary.json"


def next_status(old: dict, a: Action, v: PointView) -> dict:
    """status.json after the leader's action; the same action twice gives the same record."""
    st = json.loads(json.dumps(old or {}))
    atts = st.setdefault("attempts", {})
    if v.go and a.kind in ("go", "finish", "fail"):  # attempt v.go is over: how it ended
        rec = atts.setdefault(str(v.go), {})
        rec.update(result="finished" if a.kind == "finish" else result(v),
                   reason="" if a.kind == "finish" else ended_reason(v),
                   exits={h: (v.exits.get(h) or {}).get("code") for h in v.hosts})
        rec.setdefault("ended", v.now)
    if a.kind == "go":
        atts.setdefault(str(a.attempt), {}).setdefault("started", v.now)
        st.update(state="running", attempt=a.attempt, note="")
    elif a.kind == "abort":
        atts.setdefault(str(a.attempt), {})["abort"] = a.reason
        st.update(state="running", attempt=a.attempt, note=f"aborting: {a.reason}")
    elif a.kind == "finish":
        st.update(state="finished", attempt=v.go, note="", reason="")
    elif a.kind == "fail":
        st.update(state="failed", attempt=v.go, note="", reason=a.reason)
    else:
        st.update(state="running" if v.go else "waiting", attempt=v.go, note=a.reason)
    return st


# -- a host's decision (pure) --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class HostView:
    point: str | None                  # the first point not finished or failed (None: none left)
    go: int = 0
    exited: bool = False               # this host's exit for attempt `go` is written
    started: bool = False              # … and its start marker
    abort: str | None = None
    stop: bool = False
    leader_age: float | None = None    # seconds since the leader's heartbeat; None on the leader
    child: tuple[str, int] | None = None   # (point, attempt) of this host's live child
    killing: bool = False              # its SIGTERM was sent


def host_decide(v: HostView, lost_after_s: float) -> tuple[str, str]:
    """(what this host does, why): run | kill | close | start | idle | exit."""
    if v.child is not None:
        if v.killing:
            return "run", "waiting for the child to exit"
        if v.stop:
            return "kill", "stop requested"
        if v.abort:
            return "kill", f"attempt aborted: {v.abort}"
        if v.child != (v.point, v.go):
            return "kill", f"the leader moved on to {v.point} attempt {v.go}"
        if v.leader_age is not None and v.leader_age > lost_after_s:
            return "kill", f"the leader ({label(LEADER)}) is lost: heartbeat {v.leader_age:.0f} s old"
        return "run", ""
    if v.go and not v.exited and (v.started or v.abort or v.stop):  # an exit without a child to reap
        return "close", ("restarted during the attempt; its child was lost with the VM" if v.started
                         else f"aborted before it started: {v.abort}" if v.abort
                         else "stop requested before it started")
    if v.stop:
        return "exit", "stop requested"
    if v.point is None:
        return "exit", "every point is finished or failed"
    if v.go and not v.exited:
        return "start", ""
    return "idle", ""
