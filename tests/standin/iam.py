"""The project around the stand-in's pods: IAM policies, bucket locations, the accelerator types a zone
offers, TPU nodes outside any queued resource. State in $GCLOUD_STANDIN_DIR/project.json (absent: the
defaults below, a project as `gcloud projects create` leaves it: the default compute service account
has roles/editor, every bucket is in US-EAST5, every zone offers every type, no stray node).

    gcloud config get-value project
    gcloud projects describe P [--format=json]
    gcloud projects get-iam-policy P [--format=json]
    gcloud storage buckets describe gs://B [--format=json]
    gcloud storage buckets get-iam-policy gs://B [--format=json]
    gcloud compute tpus tpu-vm list --zone=Z [--format=json]
    gcloud compute tpus tpu-vm accelerator-types list --zone=Z [--format=json]

With `enforce` set, a VM's gcloud call needing a permission its service account does not hold (by this
module's own table of predefined roles: the stand-in does not import the launcher's) fails with 403,
as the bucket and the TPU API would (faults.refused).
"""
from __future__ import annotations

import json
from pathlib import Path

PROJECT_NUMBER = "123456789012"
DEFAULT_SA = f"{PROJECT_NUMBER}-compute@developer.gserviceaccount.com"
OBJ = ("storage.objects.get", "storage.objects.create", "storage.objects.delete", "storage.objects.list")
ROLES = {"roles/owner": OBJ + ("tpu.queuedResources.delete",), "roles/editor": OBJ + ("tpu.queuedResources.delete",),
         "roles/storage.admin": OBJ, "roles/storage.objectAdmin": OBJ, "roles/storage.objectUser": OBJ,
         "roles/storage.objectViewer": ("storage.objects.get", "storage.objects.list"),
         "roles/storage.objectCreator": ("storage.objects.create",), "roles/tpu.admin": ("tpu.queuedResources.delete",),
         "roles/tpu.viewer": ()}


def default(project: str) -> dict:
    return {"project": {"bindings": [{"role": "roles/editor", "members": [f"serviceAccount:{DEFAULT_SA}"]},
                                     {"role": "roles/owner", "members": ["user:user@example.com"]}]},
            "buckets": {}, "offered": None, "nodes": [], "enforce": False, "projectId": project}


def load(root: Path, project: str = "standin-project") -> dict:
    p = root / "project.json"
    return {**default(project), **(json.loads(p.read_text()) if p.exists() else {})}


def save(root: Path, **changes) -> None:
    (root / "project.json").write_text(json.dumps({**load(root), **changes}, indent=1))


def permissions(state: dict, identity: str, bucket: str | None) -> set[str]:
    """What `identity` may do on `bucket` (project bindings, then the bucket's own)."""
    member = f"serviceAccount:{identity}" if "gserviceaccount" in identity else f"user:{identity}"
    bindings = list(state["project"]["bindings"]) + list(state["buckets"].get(bucket or "", {}).get("bindings", []))
    return {perm for b in bindings if member in b.get("members", []) for perm in ROLES.get(b["role"], ())}


def command(cloud, words: list[str], args: list[str]) -> int | None:
    """Run one of the commands above (None: not one of them). `words` are the leading non-flag words."""
    from standin.gcloud import GcloudError, Usage, _render

    state = load(cloud.root, cloud.config["project"])
    fmt = next((a.split("=", 1)[1] for a in args if a.startswith("--format=")), "json")
    zone = next((a.split("=", 1)[1] for a in args if a.startswith("--zone=")), None)
    pos = [a for a in args if not a.startswith("-")]
    if words[:3] == ["config", "get-value", "project"]:
        print(state["projectId"])
        return 0
    if words[:2] == ["projects", "describe"] or words[:2] == ["projects", "get-iam-policy"]:
        if pos[2:3] != [state["projectId"]]:
            raise GcloudError(f"NOT_FOUND: project {pos[2:3]} (the stand-in's is {state['projectId']})")
        obj = {"projectId": state["projectId"], "projectNumber": PROJECT_NUMBER} if words[1] == "describe" \
            else state["project"]
        print(_render([obj], fmt, "describe"), end="")
        return 0
    if words[:3] in (["storage", "buckets", "describe"], ["storage", "buckets", "get-iam-policy"]):
        if not pos[3:4] or not pos[3].startswith("gs://"):
            raise Usage("give gs://BUCKET")
        b = pos[3][5:].strip("/")
        info = state["buckets"].get(b, {})
        obj = {"name": b, "location": info.get("location", "US-EAST5"), "location_type": "region"} \
            if words[2] == "describe" else {"bindings": info.get("bindings", [])}
        print(_render([obj], fmt, "describe"), end="")
        return 0
    if words[:4] == ["compute", "tpus", "tpu-vm", "list"] or words[:5] == ["compute", "tpus", "tpu-vm",
                                                                             "accelerator-types", "list"]:
        if zone is None:
            raise Usage("--zone is required")
        if words[3] == "list":
            names = [n for r in map(cloud.resource, cloud.names()) if r and r["zone"] == zone for n in r["nodeIds"]]
            names += [n["name"] for n in state["nodes"] if n["zone"] == zone]
            objs = [{"name": f"projects/{state['projectId']}/locations/{zone}/nodes/{n}"} for n in sorted(names)]
        else:
            from diloco.tpu.accelerators import TABLE  # the types that exist; a zone offers a subset

            offered = (state["offered"] or {}).get(zone, list(TABLE)) if state["offered"] is not None else list(TABLE)
            objs = [{"name": f"projects/{state['projectId']}/locations/{zone}/acceleratorTypes/{t}", "type": t}
                    for t in offered]
        print(_render(objs, fmt, "table"), end="")
        return 0
    return None


def refused(root: Path, needs: list[str], identity: str, bucket: str | None) -> str | None:
    state = load(root)
    if not state["enforce"] or not needs:
        return None
    have = permissions(state, identity, bucket)
    missing = [n for n in needs if n not in have]
    return f"HTTPError 403: {identity} does not have {missing[0]} access" if missing else None
