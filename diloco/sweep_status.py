"""`diloco sweep SWEEP --root DIR --status`: one table of the sweep's points, read from their folders, nothing run.

A point is done (summary.json), running (its sweep lock `.lock` is held by a live process, or by another
host), failed (failed.json), stopped (started, no summary, nobody on it: the next `diloco sweep` resumes it
from its checkpoint) or pending (never started). Steps are metrics.jsonl's last row against config.json's
steps; a running point's ETA is its seconds per step so far times the steps left; the sweep's ETA adds the
points left at the mean time of the finished ones (at -j 1).
"""
from __future__ import annotations

import json
import socket
from pathlib import Path

from diloco.pointlock import LOCK, alive
from diloco.rundir import read_jsonl


def read_json(p: Path) -> dict:
    """A run record's JSON ({} when it is missing or unreadable, e.g. being written)."""
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}


def last_row(wd: Path) -> dict:
    """metrics.jsonl's last whole row ({} when there is none; a line being appended is skipped)."""
    return (read_jsonl(wd / "metrics.jsonl") or [{}])[-1]


def holder(wd: Path) -> str:
    """'' when nobody runs the point, else who does (pid on this host, or host:pid of another)."""
    try:
        host, _, pid = (wd / LOCK).read_text().strip().rpartition(":")
    except OSError:
        return ""
    if host != socket.gethostname():
        return f"{host}:{pid}"
    return f"pid {pid}" if pid.isdigit() and alive(int(pid)) else ""


def point_status(wd: Path) -> dict:
    """{status, step, steps, loss, eval_loss, seconds, eta_s} of one point's folder."""
    summ, row, cfg = read_json(wd / "summary.json"), last_row(wd), read_json(wd / "config.json")
    steps = cfg.get("steps")
    step = steps if summ and steps else row.get("step", 0)
    who = "" if summ else holder(wd)
    if summ:
        status = "done"
    elif who:
        status = "running"
    elif (wd / "failed.json").exists():
        status = "failed"
    else:
        status = "stopped" if cfg or row else "pending"
    secs = summ.get("wall_seconds") if summ else row.get("seconds")
    eta_s = None
    if status == "running" and steps and step and secs:
        eta_s = secs / step * max(0, steps - step)
    return {"status": status, "step": step, "steps": steps, "loss": row.get("train_loss"),
            "eval_loss": summ.get("final_eval_loss") if summ else row.get("eval_loss"), "seconds": secs,
            "eta_s": eta_s, "holder": who}


def hms(s: float | None) -> str:
    if s is None:
        return "—"
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def status_table(sweep: dict, root: Path, points: list[dict]) -> str:
    """The table `diloco sweep --status` prints: one line per point, then the counts and the sweep's ETA."""
    def num(v):
        return "—" if v is None else f"{v:.4f}"

    head = f"{'status':<8} {'steps':>11} {'loss':>7} {'eval':>7} {'ETA':>8}  point"
    lines = [head, "-" * len(head)]
    rows = [(p["name"], point_status(root / sweep["name"] / p["name"])) for p in points]
    for name, r in rows:
        steps = f"{r['step'] or 0}/{r['steps'] if r['steps'] else '?'}"
        who = f"  ({r['holder']})" if r["holder"] else ""
        lines.append(f"{r['status']:<8} {steps:>11} {num(r['loss']):>7} {num(r['eval_loss']):>7} "
                     f"{hms(r['eta_s']):>8}  {name}{who}")
    count = {s: sum(r["status"] == s for _, r in rows) for s in ("done", "running", "failed", "stopped", "pending")}
    took = [r["seconds"] for _, r in rows if r["status"] == "done" and r["seconds"]]
    left = len(rows) - count["done"] - count["running"]
    tail = f"{len(rows)} point(s) under {root / sweep['name']}: " + ", ".join(f"{v} {k}" for k, v in count.items() if v)
    if left and took:
        eta = sum(r["eta_s"] or 0 for _, r in rows) + left * sum(took) / len(took)
        tail += f"; ETA {hms(eta)} at -j 1 ({left} left at the mean {hms(sum(took) / len(took))} of {len(took)} done)"
    elif count["running"]:
        tail += f"; ETA {hms(max(r['eta_s'] or 0 for _, r in rows))}"
    return "\n".join(lines + [tail])
