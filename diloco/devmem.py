"""Accelerator memory on an NVIDIA GPU: JAX's pool size (XLA_PYTHON_CLIENT_MEM_FRACTION) and the preflight that
refuses a run whose compiled programs would not fit in it, before step 1 (docs/gpu.md).

The peak of a compiled program is what XLA's memory analysis says it holds at once: arguments + outputs − the
outputs aliased to donated arguments + temporaries (on one H200 the 35M inner step's prediction was within 0.1 %
of the allocator's peak_bytes_in_use: results/gpu/README.md). The limit is the device's `bytes_limit`: the pool JAX
preallocates, XLA_PYTHON_CLIENT_MEM_FRACTION of the card (`diloco train` sets 0.90 unless it is set already; JAX's
own default is 0.75). Before anything compiles, `estimate_peak` guesses the inner step's peak per remat policy and
tensor size, from which resolve.py's `auto` remat (on a GPU: `choose_remat`) and `auto` tensor pick."""
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


# What a compiled inner step holds on a GPU beyond its state, per token of the (micro)batch on the device: (bytes per
# vocabulary row, bytes per layer × d_model) for each remat policy. Fitted on the paper's 35M and 1B Streaming
# specs (bf16, cuDNN attention, nn.scan, seq 1024) compiled for h200:1x1x8 (CHANGELOG #41); on the other compiles
# (one H200, accum_steps, results/gpu/memory.csv's 35M–10B at seq 2048) the estimate is 0.85–1.2× the compiled peak.
ACT_BYTES = {"none": (2.327, 112.8), "save_dots": (1.935, 20.51), "full": (1.914, 4.484)}
FIT_SHARE = 0.85  # a policy is chosen when its estimate is at most this share of the device's limit


def estimate_peak(cfg, policy: str, mesh: tuple, n_params: int, vocab_rows: int) -> int:
    """Bytes per device of a run's inner step under remat `policy` on the mesh (replica, data, fsdp[, tensor]): fp32
    parameters, AdamW moments and gradients of the replicas on a device (and the outer θᵍ, momentum and pending Δ)
    over fsdp × tensor, plus ACT_BYTES per token of a microbatch (a second gradient buffer with accum_steps > 1):
    the vocabulary rows (logits) split over tensor, the per-layer residuals not (not even under `sequence=tensor`:
    XLA:TPU keeps them whole, CHANGELOG #40); XLA attention's scores (no fused kernel) add 6 bytes per head ×
    position per layer, heads split over tensor. The one estimate before anything compiles (resolve.py's `auto`
    remat and tensor; the preflight checks the compiled programs): 0.5–1.7× the compiled inner step of every row
    of results/{pod,gpu}/memory.csv (tests/test_gpu_check.py); the largest miss, 1.66× at 1B tensor 8 on H200s, is
    XLA splitting more activations over tensor than it credits (there `auto` tensor errs large)."""
    from diloco.model.scales import SCALES

    s = SCALES[cfg.scale]
    r_axis, data, fsdp = (int(x) for x in mesh[:3])
    tensor = int(mesh[3]) if len(mesh) > 3 else 1
    R = 1 if cfg.method == "dp" else cfg.replicas
    r_dev, k = R // r_axis, int(cfg.get("accum_steps", 1))
    grads = 4 * r_dev * (2 if k > 1 else 1)  # with accumulation: the running sum and a microbatch's
    state = n_params * (12 * r_dev + grads + (0 if R == 1 else 12)) / (fsdp * tensor)
    tokens = cfg.batch_size // R // k * cfg.seq_len * r_dev / (data * fsdp)
    per_vocab, per_layer = ACT_BYTES[policy]
    per_token = per_vocab * vocab_rows / tensor + per_layer * s.layers * s.d_model
    if cfg.model.get("attention", "auto") not in ("auto", "cudnn", "splash") or cfg.model.dtype == "float32":
        per_token += 6 * s.heads / tensor * cfg.seq_len * (s.layers if policy != "full" else 1)
    return int(state + tokens * per_token)


def choose_remat(cfg, mesh: tuple, limit: int, n_params: int, vocab_rows: int) -> tuple[str, str]:
    """(remat policy, why) on a GPU whose pool is `limit` bytes: the first of none, save_dots whose estimated peak
    (estimate_peak) is at most FIT_SHARE of it, else full; the why names the estimates and the limit."""
    est = {p: estimate_peak(cfg, p, mesh, n_params, vocab_rows) for p in ("none", "save_dots", "full")}
    shown = ", ".join(f"{p} {b / GIB:.1f}" for p, b in est.items())
    for p in ("none", "save_dots"):
        if est[p] <= FIT_SHARE * limit:
            return p, (f"GPU memory: {p} fits (estimated peak GiB per device: {shown}; "
                       f"{FIT_SHARE:.0%} of the {limit / GIB:.1f} GiB limit)")
    fits = "only full fits" if est["full"] <= FIT_SHARE * limit else "none fits, full needs least (the preflight decides)"
    return "full", (f"GPU memory: {fits} (estimated peak GiB per device: {shown}; "
                    f"{FIT_SHARE:.0%} of the {limit / GIB:.1f} GiB limit)")


def device_limit(device) -> int | None:
    """What one program may hold on a GPU: the device's bytes_limit, or for a GPU described from a target spec (no
    memory stats: `diloco compile --topology h200:…`) its memory × XLA_PYTHON_CLIENT_MEM_FRACTION; None elsewhere."""
    if device.platform != "gpu":
        return None
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # a deviceless topology's GPU has no allocator
        limit = None
    if limit:
        return int(limit)
    from diloco.compile.gpu import GPU_SPECS, gpu_spec, gpu_usable_bytes

    kind = getattr(device, "device_kind", "")
    chip = next((c for c in GPU_SPECS if f'name: "{kind}"' in gpu_spec(c)), None)
    return gpu_usable_bytes(chip) if chip and kind else None


def refusal(peaks: dict[str, int], limit: int, cfg, replicas: int, remat: str | None = None,
            batch_devices: int = 1) -> str | None:
    """The one line refusing a run whose largest program peak exceeds `limit` (bytes per device), naming the
    program, its peak, the limit and the levers; None when every program fits. `remat`: the plan's policy (default:
    the config's); `batch_devices`: the data×fsdp devices of a replica (a microbatch splits over them)."""
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
    if remat is None:
        remat = "full" if cfg.model.get("remat", False) else cfg.model.get("remat_policy", "auto")
    if remat != "full":
        levers.append("model.remat_policy=full")
    k = int(cfg.get("accum_steps", 1))
    per = cfg.batch_size // replicas
    if per % (2 * k) == 0 and (per // (2 * k)) % batch_devices == 0:
        levers.append(f"gradient accumulation (accum_steps={2 * k}, now {k}: the step's activations for "
                      f"{per // (2 * k)} sequences of a replica at a time, the same batch)")
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
    plan = getattr(trainer, "plan", None)
    line = refusal(peaks, int(limit), trainer.cfg, trainer.R, plan.remat if plan else None,
                   int(plan.mesh[1]) * int(plan.mesh[2]) if plan else 1)
    if line:
        raise ConfigError("batch_size", line)
    name, peak = max(peaks.items(), key=lambda kv: kv[1])
    return {"peak_bytes": peak, "program": name, "bytes_limit": int(limit)}
