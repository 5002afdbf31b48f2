"""A per-point lock for `diloco sweep`: two sweeps on one root never run the same point at once.

The lock is a file `<workdir>/.lock` created with O_CREAT|O_EXCL, holding `host:pid`. A lock left by a
dead process on this host is stale and taken over (one taker wins the rename); a live one, or one
from another host, means someone else runs the point.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path

LOCK = ".lock"


def alive(pid: int) -> bool:
    """Whether process `pid` of this host exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def acquire_lock(workdir: Path) -> bool:
    """O_CREAT|O_EXCL lock file holding host:pid. A lock of a dead process on this host is stale and
    taken over; a live one (or one from another host) means someone else runs the point."""
    workdir.mkdir(parents=True, exist_ok=True)
    lock = workdir / LOCK
    me = f"{socket.gethostname()}:{os.getpid()}"
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                host, _, pid = lock.read_text().strip().rpartition(":")
            except FileNotFoundError:
                continue  # released meanwhile; try again
            if host == socket.gethostname() and pid.isdigit() and not alive(int(pid)):
                stale = lock.with_name(f"{LOCK}.stale.{os.getpid()}")
                try:
                    os.replace(lock, stale)  # only one taker wins the rename
                    stale.unlink()
                except FileNotFoundError:
                    pass
                continue
            return False
        with os.fdopen(fd, "w") as f:
            f.write(me)
        return True
    return False


def release_lock(workdir: Path) -> None:
    lock = workdir / LOCK
    try:
        if lock.read_text().strip() == f"{socket.gethostname()}:{os.getpid()}":
            lock.unlink()
    except FileNotFoundError:
        pass
