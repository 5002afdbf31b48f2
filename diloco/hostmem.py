"""Host memory: what a CPU run's training state needs and what this host (or its cgroup) can still give,
checked before anything is allocated."""
from __future__ import annotations

import jax
import numpy as np

from diloco.errors import ConfigError


def state_bytes(trainer) -> int:
    """Bytes the training state takes on the trainer's devices, from shapes and shardings alone
    (jax.eval_shape; nothing allocated): parameters and AdamW moments of every replica, the outer θᵍ,
    momentum and pending Δ for the DiLoCo family; a leaf held whole on several devices counts on each."""
    total = 0
    for x in jax.tree_util.tree_leaves(trainer.abstract_state()):
        per_device = int(np.prod(x.sharding.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
        total += per_device * len(x.sharding.device_set)
    return total


def host_memory_available() -> tuple[int, str] | None:
    """(bytes this process can still take, where that figure comes from): /proc/meminfo's MemAvailable,
    or the cgroup's limit less its usage (not counting reclaimable page cache) when that is lower."""
    def read(path: str) -> str | None:
        try:
            with open(path) as f:
                return f.read()
        except OSError:
            return None

    found = []
    meminfo = read("/proc/meminfo") or ""
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            found.append((int(line.split()[1]) * 1024, "MemAvailable"))
    for limit_f, usage_f, stat_f, inactive in (
            ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat", "inactive_file"),
            ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes",
             "/sys/fs/cgroup/memory/memory.stat", "total_inactive_file")):
        limit, usage = (read(limit_f) or "").strip(), (read(usage_f) or "").strip()
        if not limit.isdigit() or not usage.isdigit() or int(limit) >= 1 << 60:  # "max" / no limit
            continue
        stat = dict(l.split()[:2] for l in (read(stat_f) or "").splitlines() if len(l.split()) >= 2)
        cache = int(stat.get(inactive, "0")) if stat.get(inactive, "0").isdigit() else 0
        found.append((int(limit) - int(usage) + cache, f"cgroup limit {int(limit) / 2**30:.1f} GiB less its usage"))
    return min(found) if found else None


def check_fits_host(trainer) -> None:
    """On a CPU backend (every device is this host's memory), a run whose state alone exceeds the
    memory available is refused before anything is allocated: ConfigError naming `scale`."""
    if trainer.mesh.devices.flat[0].platform != "cpu":
        return
    avail = host_memory_available()
    need = state_bytes(trainer)
    if avail is None or need <= avail[0]:
        return
    cfg, gib = trainer.cfg, 2 ** 30
    parts = ("parameters and AdamW moments" + (f" of {trainer.R} replicas" if trainer.R > 1 else "")
             + (", outer θᵍ, momentum and pending Δ" if trainer.driver is not None else ""))
    raise ConfigError("scale", f"a {cfg.scale} {cfg.method} run's training state alone is {need / gib:.1f} GiB "
                      f"({parts}; {trainer.n_params:,} parameters) but this host has {avail[0] / gib:.1f} GiB "
                      f"available ({avail[1]}); on CPU use a smaller scale (e.g. --config.scale=toy); for TPU "
                      f"slices, `diloco compile --config … --topology v5p:2x2x2` reports the per-chip memory")
