"""`python -m diloco.tpu.status BASE`: where a sweep on Cloud TPU stands, read from its bucket.

BASE is a launch folder, ROOT/SWEEP/_pods/QR (gs:// or local); the files are the ones diloco/tpu/agent.py writes. Per point:
  waiting   no attempt yet (what the leader waits for, when it says)
  running   attempt n and the run's last metrics row (or `stopped` after `launch_tpu.sh stop`)
  finished  final_eval_loss and params_sha256 of its summary.json
  failed    the reason and the last lines of the failing host's log
Per host: its agent's state, point and attempt, and how old its heartbeat is (`lost?` when older than
the plan's lost_after_s); a host with no heartbeat yet shows the last lines of its boot log. Exit status: 0 when every point finished, 1 when any failed, 2 otherwise.

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
from diloco.tpu.layout import TIMING, Layout, fresh_reads, hosts, latest_go, load, names, read_text
from diloco.tpu.decide import LEADER, age, boot_tail, label

TAIL = 12  # log lines shown for a failed point


def point_report(L: Layout, pt: dict, all_hosts: list[str]) -> dict:
    name = pt["name"]
    st = load(L.status(name), {}) or {}
    wd = path(pt["workdir"])
    n = latest_go(L, name)
    rep = {"name": name, "state": st.get("state") or ("running" if n else "waiting"), "attempt": n,
           "note": st.get("note", ""), "attempts": st.get("attempts", {})}
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
        rows = read_jsonl(wd / "metrics.jsonl")
        rep["last_row"] = rows[-1] if rows else None
        att = L.attempt(name, n)
        exits = [load(att / f) for f in names(att, "*.json")]
        if len(exits) == len(all_hosts) and any(e.get("stopped") for e in exits):
            rep["state"] = "stopped"
    return rep


def collect(base: str, now: float | None = None) -> dict:
    now = time.time() if now is None else now
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
    return {"base": str(L.base), "plan": plan, "stop": L.stop.exists(), "now": now,
            "points": [point_report(L, pt, all_hosts) for pt in plan["points"]], "hosts": host_rows}


def render(rep: dict) -> str:
    plan = rep["plan"]
    out = [f"sweep {plan['sweep']} in {rep['base']}: {len(plan['points'])} point(s) on {plan['slices']} × "
           f"{plan.get('accelerator', '?')} ({plan['slices'] * plan['hosts_per_slice']} hosts)"]
    if rep["stop"]:
        out.append("stop requested (launch_tpu.sh stop); `launch_tpu.sh start` resumes")
    width = max(len(p["name"]) for p in rep["points"])
    for p in rep["points"]:
        head = f"  {p['name']:<{width}}  {p['state']:<8}"
        ended = [f"attempt {k}: {a.get('reason')}" for k, a in sorted(p["attempts"].items(), key=lambda kv: int(kv[0]))
                 if a.get("result") in ("failed", "stopped")]
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
        out.append(f"{who:<26} {'lost? ' if h['lost'] else ''}{what}  heartbeat {h['age']:.0f} s ago"
                   + (f"  [{b['note']}]" if b.get("note") else ""))
    return "\n".join(out)


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
    args = ap.parse_args(argv)
    fresh_reads()
    if args.busy:
        return 0 if busy(args.base) else 1
    if args.wait_stopped is not None:
        return wait_stopped(args.base, args.wait_stopped)
    rep = collect(args.base)
    print(render(rep))
    return exit_code(rep)


if __name__ == "__main__":
    sys.exit(main())
