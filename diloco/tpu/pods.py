"""`python -m diloco.tpu.pods check-up PLAN`: what `launch_tpu.sh up` checks before it uploads or creates.

One pod, one namespace: a launch's coordination lives in ROOT/<sweep>/_pods/<queued resource>/
(diloco/tpu/bundle.py). Two pods may share a root when they run different points (`--only`); `up` refuses
  - when another launch on the same root runs one of this bundle's points and its queued resource still
    exists (both would train the same run folder): naming it, its points and the way out;
  - when this bundle's queued resource exists with another accelerator type or node count (the bundle's
    hosts, processes and mesh would not be the pod's): naming both and the way out.
Exit 0 when `up` may go on, 1 with one line on stderr when refused. Runs `gcloud storage ls|cat` and
`gcloud compute tpus queued-resources describe` (the laptop's credentials, as `up`); creates nothing.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

from diloco.rundir import read_json

LIVE_GONE = ("", "FAILED", "SUSPENDED", "DELETING")  # up recreates (or nobody holds) a resource in these states


def where(plan: dict) -> list[str]:
    return [f"--zone={plan['zone']}"] + ([f"--project={plan['project']}"] if plan.get("project") else [])


def describe(qr: str, plan: dict, run=subprocess.run) -> dict | None:
    """The queued resource as the API shows it (gcloud … describe --format=json), None when it does not exist."""
    r = run(["gcloud", "compute", "tpus", "queued-resources", "describe", qr, *where(plan), "--format=json"],
            capture_output=True, text=True)
    if r.returncode != 0:
        return None
    try:
        return json.loads(r.stdout)
    except ValueError:
        return None


def shape(desc: dict) -> tuple[str, int]:
    """(accelerator type, node count) of a described queued resource."""
    spec = (desc.get("tpu", {}).get("nodeSpec") or [{}])[0]
    nodes = int(spec.get("multisliceParams", {}).get("nodeCount", 1))
    return spec.get("node", {}).get("acceleratorType", "?"), nodes


def check_shape(plan: dict, desc: dict | None) -> str:
    """'' or why the existing resource cannot run this bundle."""
    state = ((desc or {}).get("state") or {}).get("state", "")
    if desc is None or state in LIVE_GONE:
        return ""
    acc, nodes = shape(desc)
    if (acc, nodes) == (plan["accelerator"], int(plan["slices"])):
        return ""
    return (f"queued resource {plan['qr']} exists ({state}) as {nodes}× {acc}, but this bundle is for "
            f"{plan['slices']}× {plan['accelerator']}: its hosts, processes and mesh would not match; `bash "
            f"launch_tpu.sh down` it first, or bundle again with another --tpu name")


def other_launches(plan: dict, run=subprocess.run) -> list[dict]:
    """The plans of the other launches under this launch's ROOT/<sweep>/_pods/ (through gcloud storage, with
    the laptop's credentials, as `up` uploads)."""
    pods = plan["base"].rsplit("/", 1)[0]
    r = run(["gcloud", "storage", "ls", f"{pods}/*/_launch/plan.json"], capture_output=True, text=True)
    out = []
    for url in sorted(r.stdout.split()) if r.returncode == 0 else []:
        if not url.endswith("/_launch/plan.json") or url == f"{plan['base']}/_launch/plan.json":
            continue
        c = run(["gcloud", "storage", "cat", url], capture_output=True, text=True)
        try:
            other = json.loads(c.stdout) if c.returncode == 0 else None
        except ValueError:
            other = None
        if other and other.get("qr") != plan["qr"]:
            out.append(other)
    return out


def check_others(plan: dict, others: list[dict], describe_fn=describe) -> str:
    """'' or the refusal: a live launch of another queued resource that runs one of this bundle's points."""
    mine = {pt["workdir"] for pt in plan["points"]}
    for other in others:
        shared = sorted(pt["name"] for pt in other.get("points", []) if pt.get("workdir") in mine)
        if not shared:
            continue
        desc = describe_fn(other["qr"], other)
        state = ((desc or {}).get("state") or {}).get("state", "")
        if desc is None or state in ("", "DELETING"):
            continue
        return (f"{plan['root']} already holds the live launch of queued resource {other['qr']} ({state}, "
                f"{other.get('zone')}) running {', '.join(shared)}: both pods would train the same run folders; "
                f"`gcloud compute tpus queued-resources delete {other['qr']} {' '.join(where(other))}` (or its "
                f"launch_tpu.sh down) first, split the points with --only, or use another --root")
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m diloco.tpu.pods", description=__doc__.splitlines()[0])
    ap.add_argument("cmd", choices=["check-up"])
    ap.add_argument("plan", help="the bundle's local plan.json")
    args = ap.parse_args(argv)
    plan = read_json(args.plan)
    why = check_shape(plan, describe(plan["qr"], plan)) or check_others(plan, other_launches(plan))
    if why:
        print(f"launch_tpu.sh up: refused: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
