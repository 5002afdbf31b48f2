"""Accelerator memory on an NVIDIA GPU: JAX's pool size (XLA_PYTHON_CLIENT_MEM_FRACTION) and the preflight that
refuses a run whose compiled programs would not fit in it, before step 1 (docs/gpu.md).

The peak of a compiled program is what XLA's memory analysis says it holds at once: arguments + outputs − the
outputs aliased to donated arguments + temporaries (on one H200 the 35M inner step's prediction was within 0.1 %
of the allocator's peak_bytes_in_use: results/gpu/README.md). The limit is the device's `bytes_limit`: the pool JAX
preallocates, XLA_PYTHON_CLIENT_MEM_FRACTION of the card (`diloco train` sets 0.90 unless it is set already; JAX's
own default is 0.75)."""
from __future__ import annotations

import os

from diloco.errors import ConfigError

MEM_FRACTION = "0.90"  # of the card's memory: leaves ~14 GB of an H200 to the CUDA context, cuDNN and NCCL buffers
GIB = 2 ** 30


def use_gpu_memory_fraction() -> str:
    """XLA_PYTHON_CLIENT_MEM_FRACTION for this process unless already set (the user's wins), before JAX starts its
    GPU client; no effect on CPU or TPU. Returns the fraction in effect."""
    return os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", MEM_FRACTION)


def program_peak(compiled) -> int:
    """Bytes a compiled program holds at once on one device (XLA's memory analysis; 0 where there is none)."""
    ma = compiled.memory_analysis()
    if ma is None:
        return 0
    held = (int(ma.argument_size_in_bytes) + int(ma.output_size_in_bytes) - int(ma.alias_size_in_bytes)
            + int(ma.temp_size_in_bytes))
    return max(held, int(getattr(ma, "peak_memory_in_bytes", 0) or 0))


def refusal(peaks: dict[str, int], limit: int, cfg, replicas: int) -> str | None:
    """The one line refusing a run whose largest program peak exceeds `limit` (bytes per device), naming the
    program, its peak, the limit and the levers; None when every program fits."""
    if not peaks:
        return None
    name, peak = max(peaks.items(), key=lambda kv: kv[1])
    if peak <= limit:
        return None
    frac = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "")
    try:
        f = float(frac) if frac else 0.75
    except ValueError:
        f = 0.75
    levers = []
    if replicas > 1:
        levers.append(f"fewer replicas on these GPUs (replicas={replicas}: each holds its own parameters and AdamW "
                      "moments) or more GPUs per replica (mesh.fsdp)")
    else:
        levers.append("more GPUs (mesh.fsdp shards the state over them)")
    if cfg.model.get("remat_policy", "auto") != "full" and not cfg.model.get("remat", False):
        levers.append("model.remat_policy=full")
    levers.append(f"a smaller batch_size (now {cfg.batch_size})")
    if f < float(MEM_FRACTION):
        levers.append(f"a larger XLA_PYTHON_CLIENT_MEM_FRACTION (the pool is {f:g} of the card's "
                      f"≈ {limit / f / GIB:.0f} GiB)")
    return (f"a {cfg.scale} {cfg.method} run does not fit this GPU: its {name} program needs {peak / GIB:.1f} GiB "
            f"per device (XLA's compiled memory analysis) but the device gives {limit / GIB:.1f} GiB "
            f"(bytes_limit); levers: " + "; ".join(levers))


def check_fits_device(peaks: dict[str, int], trainer, device) -> dict | None:
    """On a GPU: ConfigError (field `batch_size`) when a program's peak exceeds the device's bytes_limit, else
    {"peak_bytes", "program", "bytes_limit"} for the record; None where the device reports no limit (CPU)."""
    if device.platform != "gpu" or not peaks:
        return None
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        return None
    line = refusal(peaks, int(limit), trainer.cfg, trainer.R)
    if line:
        raise ConfigError("batch_size", line)
    name, peak = max(peaks.items(), key=lambda kv: kv[1])
    return {"peak_bytes": peak, "program": name, "bytes_limit": int(limit)}
