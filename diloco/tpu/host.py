"""Host hygiene of a TPU VM, for the agent (diloco/tpu/agent.py).

raise_nofile  the open-file limit to the hard limit, for the agent and every child it starts (the
              startup-script service's soft limit is 1024; orbax/tensorstore on GCS, gRPC and tf.data
              exhaust it on TPU hosts)
maintenance_event  the VM's metadata `instance/maintenance-event` (NONE, TERMINATE_ON_HOST_MAINTENANCE, …)
free_chips    after a child is reaped: end any process still holding a TPU device of this VM, then
              remove libtpu's lock file when no process holds it open, so the next attempt does not fail with "TPU already in use"
"""
from __future__ import annotations

import glob
import os
import resource
import signal
import time
from pathlib import Path

LIBTPU_LOCK = "/tmp/libtpu_lockfile"
MAINTENANCE_URL = "http://metadata.google.internal/computeMetadata/v1/instance/maintenance-event"
TPU_DEVICES = ("/dev/accel*", "/dev/vfio/[0-9]*")  # v4/v5e (accel), v5p/v6e (vfio)


def raise_nofile() -> tuple[int, int]:
    """Soft RLIMIT_NOFILE := hard (inherited by children); the (soft, hard) now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def holders(devices: list[str], proc: str = "/proc") -> dict[int, str]:
    """{pid: device} of the processes (other than this one) with one of `devices` open."""
    want = {os.path.realpath(d) for d in devices}
    out = {}
    for pid in os.listdir(proc):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            for fd in os.listdir(f"{proc}/{pid}/fd"):
                target = os.path.realpath(f"{proc}/{pid}/fd/{fd}")
                if target in want:
                    out[int(pid)] = target
                    break
        except OSError:
            continue
    return out


def free_chips(lockfile: str = LIBTPU_LOCK, devices: tuple[str, ...] = TPU_DEVICES, wait_s: float = 10.0) -> list[str]:
    """SIGKILL what still holds a TPU device, wait for it to go, remove a stale libtpu lock file; what it did."""
    said = []
    found = sorted({f for pattern in devices for f in glob.glob(pattern)})
    left = holders(found) if found else {}
    for pid, dev in left.items():
        said.append(f"pid {pid} still holds {dev} after the child was reaped: SIGKILL")
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.time() + wait_s
    while left and time.time() < deadline:
        left = {p: d for p, d in left.items() if Path(f"/proc/{p}").exists() and not _zombie(p)}
        time.sleep(0.05)
    if left:
        said.append(f"still holding a TPU device after {wait_s:.0f} s: pids {sorted(left)}")
    if os.path.lexists(lockfile):
        users = holders([lockfile])
        if users:  # a live libtpu holds it (another user's process on a shared machine): not stale
            said.append(f"{lockfile} is held by pids {sorted(users)}: left in place")
            return said
        try:
            os.unlink(lockfile)
            said.append(f"removed the stale {lockfile}")
        except OSError as e:
            said.append(f"cannot remove {lockfile}: {e}")
    return said


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def maintenance_event(folder: str | None = None, timeout: float = 2.0) -> str | None:
    """The metadata server's maintenance-event (from `folder`/maintenance-event when given: the stand-in's
    metadata server); None when it cannot be read."""
    if folder:
        p = Path(folder) / "maintenance-event"
        return p.read_text().strip() if p.exists() else "NONE"
    import urllib.request

    req = urllib.request.Request(MAINTENANCE_URL, headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read().decode().strip()
    except OSError:
        return None
