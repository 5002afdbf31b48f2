"""`python -m diloco.tpu.pods check-up PLAN`: what `launch_tpu.sh up` checks before it uploads or creates.

One pod, one namespace: a launch's coordination lives in ROOT/<sweep>/_pods/<queued resource>/
(diloco/tpu/bundle.py). Two pods may share a root when they run different points (`--only`); `up` refuses
  - when another launch on the same root runs one of this bundle's points and its queued resource still
    exists (both would train the same run folder): naming it, its points and the way out;
  - when this bundle's queued resource exists with another accelerator type or node count (the bundle's
    hosts, processes and mesh would not be the pod's): naming both and the way out;
  - when a TPU node of one of its node names exists outside it (the queued resource would go FAILED);
  - when the zone does not offer the accelerator type;
  - when the VMs' service account (--service-account, else the project's default compute account) holds
    no role, on the project or the bucket, granting what the hosts do: storage.objects get/create/delete/
    list on the bucket, and tpu.queuedResources.delete with --teardown (predefined roles only: a custom
    role, a policy this account cannot read, a role held only through a condition, a group or domain, or
    possibly a folder or organisation above the project is a warning, not a refusal; DILOCO_IAM_CHECK=warn
    makes any refusal here a warning); a warning when it may not read the other buckets the points read
    (a token store's, a vocabulary's).
It prints the bucket's location beside the zone, with a warning when they differ.
Exit 0 when `up` may go on, 1 with one line on stderr when refused. Runs `gcloud storage ls|cat` and
`gcloud compute tpus queued-resources describe` (the laptop's credentials, as `up`); creates nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from diloco.rundir import read_json

LIVE_GONE = ("", "FAILED", "SUSPENDED", "DELETING")  # up recreates (or nobody holds) a resource in these states


def where(plan: dict) -> list[str]:
    return [f"--zone={plan['zone']}"] + ([f"--project={plan['project']}"] if plan.get("project") else [])


def describe(qr: str, plan: dict, run=subprocess.run) -> dict | None:
    """The queued resource as the API shows it (gcloud … describe --format=json), None when it does not exist."""
    return gcloud_json(["compute", "tpus", "queued-resources", "describe", qr, *where(plan)], run)


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


def gcloud_json(args: list[str], run=subprocess.run):
    """The JSON a gcloud command prints, None when it fails."""
    r = run(["gcloud", *args, "--format=json"], capture_output=True, text=True)
    try:
        return json.loads(r.stdout) if r.returncode == 0 else None
    except ValueError:
        return None


def node_names(plan: dict) -> list[str]:
    return [plan["qr"]] if int(plan["slices"]) == 1 else [f"{plan['qr']}-{i}" for i in range(int(plan["slices"]))]


def check_nodes(plan: dict, desc: dict | None, run=subprocess.run) -> str:
    """'' or the refusal: a node of this launch's name exists while its queued resource does not."""
    if desc is not None:
        return ""
    nodes = gcloud_json(["compute", "tpus", "tpu-vm", "list", *where(plan)], run) or []
    have = {n.get("name", "").rsplit("/", 1)[-1] for n in nodes}
    clash = [n for n in node_names(plan) if n in have]
    if not clash:
        return ""
    return (f"TPU node {clash[0]} already exists in {plan['zone']} outside a queued resource {plan['qr']}: the queued "
            f"resource would go FAILED; `gcloud compute tpus tpu-vm delete {clash[0]} {' '.join(where(plan))}` or "
            f"bundle again with another --tpu")


def check_offered(plan: dict, run=subprocess.run) -> tuple[str, str]:
    """(refusal, warning): the accelerator type among those the zone offers."""
    types = gcloud_json(["compute", "tpus", "tpu-vm", "accelerator-types", "list", *where(plan)], run)
    if types is None:
        return "", f"could not list the accelerator types of {plan['zone']}; not checked"
    offered = sorted({t.get("type") or t.get("name", "").rsplit("/", 1)[-1] for t in types})
    if plan["accelerator"] in offered:
        return "", ""
    gen = plan["accelerator"].split("-")[0]
    same = [t for t in offered if t.startswith(gen + "-")]
    return (f"{plan['zone']} does not offer {plan['accelerator']} (it offers {', '.join(same[:6]) or 'no ' + gen}"
            f"{', …' if len(same) > 6 else ''}); choose a zone that does (`gcloud compute tpus tpu-vm "
            f"accelerator-types list --zone=…`)"), ""


def bucket_of(plan: dict) -> str:
    return plan["base"].removeprefix("gs://").split("/", 1)[0]


def check_location(plan: dict, run=subprocess.run) -> tuple[str, str]:
    """(note, warning): the bucket's location beside the zone."""
    info = gcloud_json(["storage", "buckets", "describe", f"gs://{bucket_of(plan)}"], run)
    if not info:
        return "", f"could not read the location of gs://{bucket_of(plan)}; not checked"
    loc, region = str(info.get("location", "?")).lower(), plan["zone"].rsplit("-", 1)[0]
    note = f"bucket gs://{bucket_of(plan)} is in {loc.upper()}, the pod in {plan['zone']}"
    if loc == region:
        return note, ""
    return note, (f"the bucket (in {loc.upper()}) is not in the pod's region {region}: every checkpoint, log and "
                  "data read crosses regions (latency, and egress billed per GB); a bucket in the pod's region is best")


# predefined roles and what of theirs the hosts need: object get/create/delete/list (D = queued-resource delete)
ALL = frozenset("gcdl")
ROLE_GRANTS = {"roles/owner": ALL | {"D"}, "roles/editor": ALL | {"D"}, "roles/storage.admin": ALL,
               "roles/storage.objectAdmin": ALL, "roles/storage.objectUser": ALL,
               "roles/storage.objectViewer": set("gl"), "roles/storage.objectCreator": set("c"),
               "roles/storage.legacyObjectReader": set("g"), "roles/storage.legacyObjectOwner": set("g"),
               "roles/storage.legacyBucketReader": set("l"), "roles/storage.legacyBucketWriter": set("cdl"),
               "roles/storage.legacyBucketOwner": set("cdl"), "roles/tpu.admin": {"D"}}
PERMS = {"g": "storage.objects.get", "c": "storage.objects.create", "d": "storage.objects.delete",
         "l": "storage.objects.list", "D": "tpu.queuedResources.delete"}


def vm_account(plan: dict, run=subprocess.run) -> tuple[str, str]:
    """(the VMs' service account, the project id) — the default compute account unless --service-account."""
    project = plan.get("project") or run(["gcloud", "config", "get-value", "project"], capture_output=True,
                                         text=True).stdout.strip()
    if plan.get("service_account"):
        return plan["service_account"], project
    info = gcloud_json(["projects", "describe", project], run) if project else None
    number = (info or {}).get("projectNumber")
    return (f"{number}-compute@developer.gserviceaccount.com" if number else ""), project


def grants_of(bindings: list[dict], who) -> set:
    """What the predefined roles of the bindings whose members satisfy `who` grant (gcdlD letters)."""
    return set().union(*(ROLE_GRANTS.get(b.get("role"), set()) for b in bindings if any(map(who, b.get("members", [])))))


def check_account(plan: dict, run=subprocess.run) -> tuple[str, str]:
    """(refusal, warning): the VMs' service account holds roles for what the hosts do. Held only through a
    conditional binding, a group or domain binding, or possibly a folder or organisation above the project
    (inherited roles are not in the project's policy): a warning, not a refusal."""
    sa, project = vm_account(plan, run)
    if not sa:
        return "", "could not tell the VMs' service account (no project number); its roles not checked"
    member = f"serviceAccount:{sa}"
    policies = [gcloud_json(["projects", "get-iam-policy", project], run) if project else None,
                gcloud_json(["storage", "buckets", "get-iam-policy", f"gs://{bucket_of(plan)}"], run)]
    if any(p is None for p in policies):
        return "", f"could not read the IAM policies of project {project} and gs://{bucket_of(plan)}; {sa}'s roles not checked"
    bindings = [b for p in policies for b in p.get("bindings", [])]
    plain = [b for b in bindings if "condition" not in b]
    roles = {b.get("role") for b in plain if member in b.get("members", [])}
    grants = grants_of(plain, lambda m: m == member)
    unknown = sorted(r for r in roles if r not in ROLE_GRANTS and (not r.startswith("roles/") or
                                                                   r.startswith("roles/storage.")))
    need = set(ALL) | ({"D"} if plan.get("teardown") else set())
    missing = [PERMS[k] for k in sorted(need - grants, key="gcdlD".index)]
    if not missing:
        return "", ""
    if unknown:
        return "", (f"{sa} has roles {', '.join(unknown)} this check cannot read; make sure they grant "
                    f"{', '.join(missing)} (docs/distributed.md §9)")
    left = {k for k in need - grants}
    parent = ((gcloud_json(["projects", "describe", project], run) or {}).get("parent") or {}).get("type", "")
    maybe = [why for why, g in (
        ("a conditional binding (its condition is not evaluated here)",
         grants_of([b for b in bindings if "condition" in b], lambda m: m == member)),
        ("a group or domain binding", grants_of(bindings, lambda m: m.split(":")[0] in ("group", "domain"))),
        (f"the {parent} above project {project} (inherited roles are not in its policy)", ALL | {"D"} if parent else set()),
    ) if left <= g]
    if maybe:
        return "", (f"{sa} holds no role granting {', '.join(missing)} directly; it may through {' or '.join(maybe)}: "
                    "make sure, or the hosts cannot fetch the tree or write heartbeats (docs/distributed.md §9)")
    have = ", ".join(sorted(roles)) or "none"
    if missing != [PERMS["D"]]:
        return (f"the VMs' service account {sa} holds no role on project {project} or gs://{bucket_of(plan)} "
                f"granting {', '.join(missing)} (its roles: {have}): the hosts could not fetch the tree or write "
                f"heartbeats; `gcloud storage buckets add-iam-policy-binding gs://{bucket_of(plan)} "
                f"--member={member} --role=roles/storage.objectUser` (DILOCO_IAM_CHECK=warn: a warning)"), ""
    return (f"--teardown: the VMs' service account {sa} cannot delete the queued resource (its roles: {have}); "
            f"`gcloud projects add-iam-policy-binding {project} --member={member} --role=roles/tpu.admin`, or "
            "bundle without --teardown (DILOCO_IAM_CHECK=warn: a warning)"), ""


def read_buckets(plan: dict) -> list[str]:
    """The other buckets the points read (a token store, a vocabulary: gs:// values in their argv)."""
    found = {a.split("gs://", 1)[1].split("/", 1)[0] for pt in plan["points"] for a in pt.get("argv", []) if "gs://" in a}
    return sorted(found - {bucket_of(plan)})


def check_readers(plan: dict, run=subprocess.run) -> list[str]:
    """Warnings: a bucket the points read (the store's, the vocabulary's) whose objects the VMs' account may not
    get and list by any predefined role on it or the project (public buckets: allUsers / allAuthenticatedUsers)."""
    buckets = read_buckets(plan)
    if not buckets:  # nothing else to read: no gcloud call
        return []
    sa, project = vm_account(plan, run)
    member, out = f"serviceAccount:{sa}", []
    proj = (gcloud_json(["projects", "get-iam-policy", project], run) or {}) if project and sa else {}
    for b in buckets if sa else []:
        pol = gcloud_json(["storage", "buckets", "get-iam-policy", f"gs://{b}"], run)
        if pol is None:
            out.append(f"could not read the IAM policy of gs://{b} (a bucket the points read); {sa}'s access not checked")
            continue
        plain = [x for x in proj.get("bindings", []) + pol.get("bindings", []) if "condition" not in x]
        if not set("gl") <= grants_of(plain, lambda m: m in (member, "allUsers", "allAuthenticatedUsers")):
            out.append(f"{sa} holds no role on project {project} or gs://{b} (a bucket the points read) granting "
                       f"storage.objects.get and list directly: `gcloud storage buckets add-iam-policy-binding gs://{b} "
                       f"--member={member} --role=roles/storage.objectViewer`, unless a group or folder grants it")
    return out


def check_up(plan: dict, run=subprocess.run, say=print) -> str:
    """Every check of `up`, in order; '' when it may go on (notes and warnings said on the way)."""
    desc = describe(plan["qr"], plan, run)
    why = check_shape(plan, desc) or check_nodes(plan, desc, run)
    if why:
        return why
    why, offered = check_offered(plan, run)
    if why:
        return why
    note, where_ = check_location(plan, run)
    if note:
        say(f"launch_tpu.sh up: {note}")
    why, account = check_account(plan, run)
    if why and os.environ.get("DILOCO_IAM_CHECK") == "warn":  # the user's override: they know better
        why, account = "", why
    if why:
        return why
    for warning in (offered, where_, account, *check_readers(plan, run)):
        if warning:
            say(f"launch_tpu.sh up: warning: {warning}")
    return check_others(plan, other_launches(plan, run), lambda qr, p: describe(qr, p, run))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m diloco.tpu.pods", description=__doc__.splitlines()[0])
    ap.add_argument("cmd", choices=["check-up"])
    ap.add_argument("plan", help="the bundle's local plan.json")
    args = ap.parse_args(argv)
    plan = read_json(args.plan)
    why = check_up(plan)
    if why:
        print(f"launch_tpu.sh up: refused: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
