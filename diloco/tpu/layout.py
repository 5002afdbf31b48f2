"""The bucket side of a launch, shared by the agents (diloco/tpu/agent.py) and `status`: the plan, where
every coordination file is (Layout; the files are listed in agent.py's docstring), and a fresh read of
them into a decide.PointView."""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from diloco.errors import ConfigError
from diloco.rundir import path, read_json
from diloco.tpu.decide import LEADER, Limits, PointView, boot_tail, label

# plan.json keys the agents read beyond the sweep's own, with their defaults (bundle.py's schema)
TIMING = {"poll_s": 10.0, "log_upload_s": 30.0, "lost_after_s": 120.0, "abort_grace_s": 60.0, "stop_grace_s": 900.0}


# -- the plan and where things are ---------------------------------------------------------------------
def load_plan(p: str) -> dict:
    """plan.json with the defaults filled in; a ConfigError naming the field when it cannot be used."""
    plan = read_json(p)
    if plan is None:
        raise ConfigError("--plan", f"{p} does not exist; `launch_tpu.sh up` uploads it to BASE/_launch/plan.json")
    for key in ("base", "sweep", "slices", "hosts_per_slice", "points"):
        if key not in plan:
            raise ConfigError(f"plan.{key}", f"missing from {p}; regenerate it with `diloco sweep … --launch tpu`")
    for key, default in {**TIMING, "max_attempts": 3, "teardown": False, "env": {}, "boot_wait_s": 1800.0,
                         **dataclasses.asdict(Limits())}.items():
        plan.setdefault(key, default)
    if int(plan["max_attempts"]) < 1:
        raise ConfigError("plan.max_attempts", f"{plan['max_attempts']} must be ≥ 1")
    names = [pt["name"] for pt in plan["points"]]
    if len(set(names)) != len(names):
        raise ConfigError("plan.points", f"point names repeat: {names}")
    return plan


def limits(plan: dict) -> Limits:
    """The leader's bounds (decide.Limits) from plan.json."""
    return Limits(**{f.name: type(f.default)(plan[f.name]) for f in dataclasses.fields(Limits) if f.name in plan})


def hosts(plan: dict) -> list[str]:
    return [f"{s}-{w}" for s in range(int(plan["slices"])) for w in range(int(plan["hosts_per_slice"]))]


class Layout:
    """The bucket's paths of one sweep (see the module docstring)."""

    def __init__(self, base: str):
        self.base = path(base)

    def beat(self, host: str):
        return self.base / "_pod" / "hosts" / f"{host}.json"

    def agent_log(self, host: str):
        return self.base / "_pod" / "logs" / f"{label(host)}.agent.log"

    def boot_log(self, host: str):
        return self.base / "_pod" / "boot" / f"{label(host)}.log"

    def maintenance(self, host: str):
        return self.base / "_pod" / "maintenance" / f"{host}.json"

    @property
    def stop(self):
        return self.base / "_launch" / "control" / "stop"

    def state(self, point: str):
        return self.base / point / "_state"

    def status(self, point: str):
        return self.state(point) / "status.json"

    def go(self, point: str, n: int):
        return self.state(point) / f"go-{n}.json"

    def attempt(self, point: str, n: int):
        return self.state(point) / f"attempt-{n}"

    def log(self, point: str, n: int, host: str):
        return self.base / point / "logs" / f"attempt-{n}" / f"{label(host)}.log"


def fresh_reads() -> None:
    """Every read asks the bucket: gcsfs otherwise keeps directory listings for ever, and a cached
    listing hides files other hosts wrote since (and gives stale sizes to reads)."""
    import fsspec.config

    fsspec.config.conf.setdefault("gcs", {})["use_listings_cache"] = False


def names(folder, pattern: str) -> list[str]:
    try:
        return [p.name for p in path(folder).glob(pattern)]
    except FileNotFoundError:
        return []


def latest_go(layout: Layout, point: str) -> int:
    ns = [int(n[3:-5]) for n in names(layout.state(point), "go-*.json") if n[3:-5].isdigit()]
    return max(ns, default=0)


def load(p, default: Any = None) -> Any:
    """read_json, again when a read raced a rewrite: gcsfs reads an object in ranges of the size it saw
    first, so a file replaced meanwhile by a longer one reads torn (seen on the emulator)."""
    for i in range(5):
        try:
            return read_json(p, default)
        except (json.JSONDecodeError, UnicodeDecodeError):
            time.sleep(0.1 * (i + 1))
    return read_json(p, default)


def read_text(p) -> str | None:
    p = path(p)
    try:
        return p.read_text() if p.exists() else None
    except FileNotFoundError:
        return None


def read_view(layout: Layout, point: dict, all_hosts: list[str], me: str, now: float, stop: bool,
              since: float = 0.0) -> PointView:
    """The leader reads every host's files; a follower only its own and the leader's heartbeat."""
    name = point["name"]
    lead = me == LEADER
    go = latest_go(layout, name)
    att = layout.attempt(name, go)
    exits, starts, abort = {}, set(), None
    if go:
        files = set(names(att, "*"))
        abort = read_text(att / "abort") if "abort" in files else None
        for h in all_hosts if lead else [me]:
            if f"{h}.json" in files:
                exits[h] = load(att / f"{h}.json")
            if f"{h}.start" in files:
                starts.add(h)
    beats = {}
    for h in all_hosts if lead else [LEADER]:
        b = load(layout.beat(h))
        if b is not None:
            beats[h] = b
    summary = lead and path(point["workdir"]).joinpath("summary.json").exists()
    boot = {h: boot_tail(read_text(layout.boot_log(h))) for h in all_hosts if lead and h not in beats}
    notices = {}  # a notice of this attempt: a record of an earlier life of the point (its _state removed) is not
    started = float((load(layout.go(name, go), {}) or {}).get("time", 0)) if lead and go else 0.0
    for f in names(layout.base / "_pod" / "maintenance", "*.json") if lead and go else []:
        rec = load(layout.base / "_pod" / "maintenance" / f) or {}
        if (rec.get("point"), rec.get("attempt")) == (name, go) and float(rec.get("time", 0)) >= started:
            notices[f[:-5]] = rec
    return PointView(tuple(all_hosts), go, abort, exits, frozenset(starts), beats, bool(summary),
                     load(layout.status(name), {}) or {}, stop, now, since, boot, notices)
