"""Faults the stand-in injects into its stub `gcloud`, by command and by identity (what the real cloud does
and the idealised stand-in did not): a download or an install that fails the first N times, and a VM
service account that lacks a permission.

    faults.json   [{"match": ["storage", "cp", "tree-"], "times": N, "host": "qr/slice0-worker0" | null,
                    "error": "…"}]   the next N calls whose argv contains every word (substrings) fail
    denied.json   {identity: [permission, …]}  calls made as that identity and needing one of these fail
                  with 403; a host's identity is its resource's --service-account, else DEFAULT_SA
  project.json    (iam.py) with "enforce": what the IAM policies grant decides, by identity
Permissions: gs:// read = storage.objects.get, gs:// write = storage.objects.create, rm =
storage.objects.delete, ls = storage.objects.list, queued-resources delete = tpu.queuedResources.delete.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
from pathlib import Path

from .iam import DEFAULT_SA, refused as iam_refused  # noqa: F401 (DEFAULT_SA: a VM's identity by default)

LAPTOP = "user@example.com"


@contextlib.contextmanager
def _locked(root: Path):
    with open(root / "_faults.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def fail(root: Path, *match: str, times: int = 1, host: str | None = None,
         error: str = "HTTPError 503: service unavailable (injected)") -> None:
    """The next `times` gcloud calls (from `host`, or from anywhere when None) whose argv holds every word fail."""
    with _locked(root):
        p = root / "faults.json"
        rows = json.loads(p.read_text()) if p.exists() else []
        rows.append({"match": list(match), "times": times, "host": host, "error": error})
        p.write_text(json.dumps(rows))


def deny(root: Path, identity: str, *permissions: str) -> None:
    with _locked(root):
        p = root / "denied.json"
        d = json.loads(p.read_text()) if p.exists() else {}
        d[identity] = sorted(set(d.get(identity, [])) | set(permissions))
        p.write_text(json.dumps(d))


def take(root: Path, argv: list[str], host: str | None) -> str | None:
    """The injected error of this call (and one fewer left), or None."""
    p = root / "faults.json"
    if not p.exists():
        return None
    with _locked(root):
        rows = json.loads(p.read_text())
        for r in rows:
            if r["times"] > 0 and (r["host"] is None or r["host"] == host) and \
                    all(any(m in a for a in argv) for m in r["match"]):
                r["times"] -= 1
                p.write_text(json.dumps(rows))
                return r["error"]
    return None


def needs(argv: list[str]) -> list[str]:
    """The permissions a gcloud call needs."""
    words = [a for a in argv if not a.startswith("-")]
    if words[:2] == ["storage", "cp"]:
        srcs, dst = words[2:-1], words[-1] if len(words) > 2 else ""
        return (["storage.objects.get"] if any(s.startswith("gs://") for s in srcs) else []) + \
            (["storage.objects.create"] if dst.startswith("gs://") else [])
    if words[:2] == ["storage", "cat"]:
        return ["storage.objects.get"]
    if words[:2] == ["storage", "rm"]:
        return ["storage.objects.delete"]
    if words[:2] == ["storage", "ls"]:
        return ["storage.objects.list"]
    if "queued-resources" in words and "delete" in words:
        return ["tpu.queuedResources.delete"]
    return []


def refused(root: Path, argv: list[str], identity: str) -> str | None:
    p = root / "denied.json"
    denied = set(json.loads(p.read_text()).get(identity, [])) if p.exists() else set()
    missing = [n for n in needs(argv) if n in denied]
    if missing:
        return f"HTTPError 403: {identity} does not have {missing[0]} access"
    bucket = next((a[5:].split("/", 1)[0] for a in argv if a.startswith("gs://")), None)
    return iam_refused(root, needs(argv), identity, bucket)
