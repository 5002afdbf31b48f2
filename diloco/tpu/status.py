"""`python -m diloco.tpu.status BASE`: where a sweep on Cloud TPU stands, read from its bucket.

BASE is a launch folder, ROOT/SWEEP/_pods/QR (gs:// or local); the files are the ones diloco/tpu/agent.py writes. Per point:
  waiting   no attempt yet (what the leader waits for, when it says)
  running   attempt n and the run's last metrics row (or `stopped` after `launch_tpu.sh stop`)
  finished  final_eval_loss and params_sha256 of its summary.json
  failed    the reason and the last lines of the failing host's log
and, once it has started: steps done/total (metrics.jsonl's last row, config.json's steps), its time on the pod
(the sum of its attempts, status.json), the ETA (seconds per step so far × steps left), the last eval loss and
its cost so far: that time × the pod's price per hour (diloco/tpu/prices.py: chips × a list price of the
plan's capacity class; an estimate). When every point has ended and the queued resource is still ACTIVE
(`--qr-state`, which `launch_tpu.sh status` passes) or a host still heartbeats, it says the pod is still billing.
Per host: its agent's state, point and attempt, and how old its heartbeat is (`lost?` when older than
the plan's lost_after_s); a host with no heartbeat yet shows the last lines of its boot log. When `--qr-state` is
SUSPENDING, SUSPENDED or FAILED it says so first (`SUSPENDED: run up.`), a running point shows as suspended and
every host as gone with the resource. Exit status: 0 when every point finished, 1 when any failed, 2 otherwise.

`--wait-stopped SECONDS` (what `launch_tpu.sh stop` runs after writing the stop marker): wait until
every host's agent has stopped (its child reaped: a SIGTERMed `diloco train` has saved its
checkpoint) or is lost; exit 0 then, 1 if SECONDS pass first. `--busy` (`launch_tpu.sh down`): exit 0
when some host runs a point now (a fresh heartbeat saying so), 1 otherwise.
"""
from __future__ import annotations

import argparse
import sys
import time

from diloco.rundir import path, read_jsonl
from diloco.sweep_status import hms
from diloco.tpu import prices
from diloco.tpu.layout import TIMING, Layout, fresh_reads, hosts, latest_go, load, names, read_text
from diloco.tpu.decide import LEADER, age, boot_tail, label

TAIL = 12  # log lines shown for a failed point
GONE = ("SUSPENDING", "SUSPENDED", "FAILED")  # the queued resource's states without VMs: heartbeats are history


def on_pod_s(attempts: dict, now: float) -> float:
    """Seconds a point has held the pod: the sum over its attempts of (ended, or now) − started."""
    return sum(max(0.0, float(a.get("ended", now)) - float(a["started"])) for a in attempts.values() if "started" in a)


def progress(rows: list[dict], steps, finished: bool) -> dict:
    """step (of steps), the ETA (the run's seconds per step so far × the steps left) and the last eval loss."""
    row = rows[-1] if rows else {}
    step = steps if finished and steps else row.get("step", 0)
    eta = None
    if not finished and isinstance(steps, int) and step and row.get("seconds"):
        eta = float(row["seconds"]) / step * max(0, steps - step)
    evals = [r["eval_loss"] for r in rows if r.get("eval_loss") is not None]
    return {"step": step, "steps": steps, "eta_s": eta, "eval_loss": evals[-1] if evals else None}


def point_report(L: Layout, pt: dict, all_hosts: list[str], now: float | None = None) -> dict:
    name = pt["name"]
    st = load(L.status(name), {}) or {}
    wd = path(pt["workdir"])
    n = latest_go(L, name)
    rep = {"name": name, "state": st.get("state") or ("running" if n else "waiting"), "attempt": n,
           "note": st.get("note", ""), "attempts": st.get("attempts", {})}
    rep["on_pod_s"] = on_pod_s(rep["attempts"], time.time() if now is None else now)
    started = bool(n) or rep["state"] == "finished"
    rows = read_jsonl(wd / "metrics.jsonl") if started else []
    if started:
        rep.update(progress(rows, (load(wd / "config.json", {}) or {}).get("steps"), rep["state"] == "finished"))
    if rep["state"] == "finished":
        s = load(wd / "summary.json", {}) or {}
        rep.update(final_eval_loss=s.get("final_eval_loss"), params_sha256=s.get("params_sha256"))
    elif rep["state"] == "failed":
        rep["reason"] = st.get("reason", "")
        att = L.attempt(name, n)
        exits = {h: load(att / f"{h}.json") for h in all_hosts if f"{h}.json" in names(att, "*.json")}
        # the host whose failure ended the attempt: not one this agent killed after it, the earliest
        bad = sorted((e.get("killed", False), e.get("time", 0), h) for h, e in exits.items() if e.get("code") != 0)
        h = bad[0][2] if bad else all_hosts[0]
        log = read_text(L.log(name, n, h)) or ""
        rep.update(log_host=label(h), log_tail=log.splitlines()[-TAIL:])
    elif rep["state"] == "running":
        rep["last_row"] = rows[-1] if rows else None
        att = L.attempt(name, n)
        exits = [load(att / f) for f in names(att, "*.json")]
        if len(exits) == len(all_hosts) and any(e.get("stopped") for e in exits):
            rep["state"] = "stopped"
    return rep


def collect(base: str, now: float | None = None, price: float | None = None, qr_state: str | None = None) -> dict:
    now = at = time.time() if now is None else now  # at: the points' clock (a test's own); now: the heartbeats'
    L = Layout(base)
    plan = load(L.base / "_launch" / "plan.json")
    if plan is None:
        raise SystemExit(f"diloco status: {L.base}/_launch/plan.json not found: is {base} a launch folder (ROOT/SWEEP/_pods/QR)?")
    all_hosts = hosts(plan)
    lost_after = float(plan.get("lost_after_s", TIMING["lost_after_s"]))
    host_rows = []
    beats = {h: load(L.beat(h)) for h in all_hosts}
    now = max(now, time.time())  # after the reads: a heartbeat written meanwhile is not from the future
    for h in all_hosts:
        b = beats[h]
        a = max(0.0, age(b, now))
        boot = boot_tail(read_text(L.boot_log(h)), 2) if b is None else []
        host_rows.append({"host": h, "label": label(h), "leader": h == LEADER, "beat": b, "age": a, "boot": boot,
                          "lost_after": lost_after,
                          "lost": b is not None and a > lost_after and b.get("state") not in ("stopped", "done")})
    rate, priced = prices.per_hour(plan, price)
    return {"base": str(L.base), "plan": plan, "stop": L.stop.exists(), "now": now, "qr_state": qr_state,
            "per_hour": rate, "priced": priced, "hosts": host_rows,
            "points": [point_report(L, pt, all_hosts, at) for pt in plan["points"]]}


def cost(rep: dict, seconds: float) -> str:
    return "$—" if rep["per_hour"] is None else f"${rep['per_hour'] * seconds / 3600:,.2f}"


def watch_line(rep: dict, p: dict) -> str:
    """'step 120/1000  on pod 0:10:00  ETA 1:13:20  $7.00  eval_loss 3.21' of a point that has started."""
    out = [f"step {p['step']}/{p['steps'] if p['steps'] is not None else '?'}", f"on pod {hms(p['on_pod_s'])}"]
    out += [f"ETA {hms(p['eta_s'])}"] if p["state"] in ("running", "stopped") else []
    out += [cost(rep, p["on_pod_s"])] + ([f"eval_loss {p['eval_loss']:.4g}"] if p.get("eval_loss") is not None else [])
    return "  ".join(out)


def billing_line(rep: dict) -> str | None:
    """The warning that every point has ended while the pod is still up (and billed), else None."""
    if any(p["state"] not in ("finished", "failed") for p in rep["points"]):
        return None
    if rep["qr_state"] is not None:
        if rep["qr_state"] != "ACTIVE":
            return None
        why = f"queued resource {rep['plan']['qr']} is still ACTIVE"
    else:
        up = [h["label"] for h in rep["hosts"] if h["beat"] is not None and h["age"] <= h["lost_after"]]
        if not up:
            return None
        why = f"{len(up)} host(s) still send heartbeats"
    rate = "" if rep["per_hour"] is None else f" ≈ ${rep['per_hour']:,.2f}/h"
    return f"every point has ended but {why}: the pod is still billing{rate}; `launch_tpu.sh down` deletes it"


def render(rep: dict) -> str:
    plan = rep["plan"]
    out = [f"sweep {plan['sweep']} in {rep['base']}: {len(plan['points'])} point(s) on {plan['slices']} × "
           f"{plan.get('accelerator', '?')} ({plan['slices'] * plan['hosts_per_slice']} hosts)"]
    rate = f"${rep['per_hour']:,.2f}/h: {rep['priced']}" if rep["per_hour"] is not None else f"n/a: {rep['priced']}"
    out.append(f"pod cost {rate}")
    if rep["stop"]:
        out.append("stop requested (launch_tpu.sh stop); `launch_tpu.sh start` resumes")
    gone = rep["qr_state"] in GONE
    if gone:
        out.append(f"{rep['qr_state']}: run up. Queued resource {plan['qr']} has no VMs now (Spot preemption, "
                   "maintenance or a failure): `launch_tpu.sh up` recreates it and every point resumes from its "
                   "checkpoint (`launch_tpu.sh watch` does this by itself)")
    width = max(len(p["name"]) for p in rep["points"])
    for p in rep["points"]:
        shown = "suspended" if gone and p["state"] == "running" else p["state"]
        head, at = f"  {p['name']:<{width}}  {shown:<8}", len(out)
        ended = [f"attempt {k}: {a.get('reason')}" for k, a in sorted(p["attempts"].items(), key=lambda kv: int(kv[0]))
                 if a.get("result") in ("failed", "stopped", "preempted")]
        history = f" (earlier: {'; '.join(ended)})" if ended and p["state"] != "failed" else ""
        if p["state"] == "finished":
            out.append(f"{head}  final_eval_loss {p['final_eval_loss']}  params_sha256 {p['params_sha256']}{history}")
        elif p["state"] == "failed":
            out.append(f"{head}  {p['reason']}")
            if p["attempt"]:  # attempt 0: it never started (the reason holds the boot log's last lines)
                out.append(f"      last lines of {p['log_host']}'s log (attempt {p['attempt']}):")
                out += [f"      | {line}" for line in p["log_tail"]] or ["      | (no log)"]
        elif p["state"] in ("running", "stopped"):
            row = p.get("last_row")
            metrics = "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in (row or {}).items()
                                if k in ("step", "train_loss", "eval_loss", "tokens_per_s"))
            note = f"  [{p['note']}]" if p["note"] and p["note"] != "running" else ""
            out.append(f"{head}  attempt {p['attempt']}  {metrics or 'no metrics row yet'}{note}{history}")
        else:
            out.append(f"{head}  {p['note']}".rstrip())
        if "step" in p:
            out.insert(at + 1, "      " + watch_line(rep, p))
    out.append("hosts:")
    for h in rep["hosts"]:
        b = h["beat"]
        who = f"  {h['label']}{' (leader)' if h['leader'] else ''}"
        if b is None:
            out.append(f"{who:<26} no heartbeat yet" + ("; its boot log (_pod/boot/) ends:" if h["boot"] else
                                                         "; no boot log in the bucket yet"))
            out += [f"      | {line}" for line in h["boot"]]
            continue
        what = f"{b.get('state')}" + (f" {b.get('point')} attempt {b.get('attempt')}" if b.get("point") else "")
        if gone:
            out.append(f"{who:<26} gone with the resource (its last heartbeat, {h['age']:.0f} s ago: {what})")
            continue
        out.append(f"{who:<26} {'lost? ' if h['lost'] else ''}{what}  heartbeat {h['age']:.0f} s ago"
                   + (f"  [{b['note']}]" if b.get("note") else ""))
    billing = billing_line(rep)
    return "\n".join(out + ([billing] if billing else []))


def exit_code(rep: dict) -> int:
    states = [p["state"] for p in rep["points"]]
    return 1 if "failed" in states else 0 if all(s == "finished" for s in states) else 2


def wait_stopped(base: str, timeout: float, poll: float = 2.0, say=print) -> int:
    """0 once every host's agent has stopped, finished or is lost; 1 after `timeout` seconds."""
    deadline = time.time() + timeout
    while True:
        rep = collect(base)
        left = [h["label"] for h in rep["hosts"] if h["beat"] is not None and not h["lost"]
                and h["beat"].get("state") not in ("stopped", "done")]
        if not left:
            lost = [h["label"] for h in rep["hosts"] if h["lost"]]
            say("every host has stopped" + (f" (lost: {', '.join(lost)})" if lost else ""))
            return 0
        if time.time() > deadline:
            say(f"still running after {timeout:.0f} s: {', '.join(left)}")
            return 1
        time.sleep(poll)


def busy(base: str) -> bool:
    """Some host is running (or stopping) a point now, by a fresh heartbeat."""
    return any(h["beat"] is not None and not h["lost"] and h["age"] <= float(h["lost_after"])
               and h["beat"].get("state") in ("running", "stopping") for h in collect(base)["hosts"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m diloco.tpu.status", description=__doc__.splitlines()[0])
    ap.add_argument("base", help="ROOT/SWEEP/_pods/QR, e.g. gs://bucket/runs/my_sweep/_pods/dl-1b")
    ap.add_argument("--wait-stopped", type=float, default=None, metavar="SECONDS",
                    help="wait until every host's agent has stopped (after the stop marker)")
    ap.add_argument("--busy", action="store_true", help="exit 0 when some host runs a point now, 1 otherwise")
    ap.add_argument("--price", type=float, default=None, metavar="USD",
                    help="price per chip-hour for the cost estimate (default: diloco/tpu/prices.py's list price)")
    ap.add_argument("--qr-state", default=None, help="the queued resource's state (launch_tpu.sh status passes it)")
    args = ap.parse_args(argv)
    if args.price is not None and not args.price >= 0:
        ap.error(f"--price {args.price}: give the USD per chip-hour, a number >= 0")
    fresh_reads()
    if args.busy:
        return 0 if busy(args.base) else 1
    if args.wait_stopped is not None:
        return wait_stopped(args.base, args.wait_stopped)
    rep = collect(args.base, price=args.price, qr_state=args.qr_state)
    print(render(rep))
    return exit_code(rep)


if __name__ == "__main__":
    sys.exit(main())
