"""NVIDIA GPU targets for `diloco compile --topology h100|h200|b200:SLICESxHOSTSxGPUS` (no GPU needed).

jax's CUDA plugin describes GPUs from an XLA target spec (`GpuTargetConfigProto` text; the specs XLA
keeps are shipped in gpu_specs/, each with its origin) and compiles for them on this CPU:
`jax.experimental.topologies.get_topology_desc(platform="cuda", topology="1x2x8", target_config=…)`.
The plugin (`gpu-aot` extra) is needed; a GPU is not.

The in-step exchange on GPU: XLA's GPU latency-hiding scheduler issues an async collective only as
early as its latency estimate asks, and lets one collective be in flight at a time. Its estimate of the
exchange's all-gather (NVLink speed) was covered by the optimizer alone, and the gradient reductions
and the layer loops' own collectives kept it from staying open over the step: it was issued after the
forward and backward passes. GPU_OVERLAP_FLAGS price async all-gathers at a slow link's latency and let
eight collectives be in flight; `diloco train` (on a machine with an NVIDIA GPU) and `diloco
compile` set them in XLA_FLAGS (use_gpu_overlap_flags), as they set TPU_OVERLAP_FLAGS in
LIBTPU_INIT_ARGS, and the resolved plan records them on GPU."""

from __future__ import annotations

import glob
import importlib.util
import os
import re
from pathlib import Path

from diloco.errors import ConfigError

SPECS_DIR = Path(__file__).with_name("gpu_specs")
GPU_SPECS = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb", "b200": "b200.txtpb"}
# Dense bf16 TFLOP/s per GPU (NVIDIA's H100/H200 SXM and B200 datasheets, without sparsity).
GPU_PEAK_TFLOPS = {"h100": 989.0, "h200": 989.0, "b200": 2250.0}
# The share of a GPU's memory JAX's pool holds, what a program may use: XLA_PYTHON_CLIENT_MEM_FRACTION,
# which `diloco train` sets to 0.90 unless it is set (diloco/devmem.py; JAX's own default is 0.75).
DEFAULT_MEM_FRACTION = 0.90
GPU_AOT_HINT = ("diloco compile for a GPU target needs jax's CUDA plugin (no GPU): "
                "pip install -c requirements.lock -e '.[gpu-aot]'")
# The in-step exchange's overlap (measured on the compiled toy and 35M step+send for 8 H200s, CHANGELOG #41):
# the latency profile prices every async all-gather at 100 ms (gpu_specs/exchange_latency.pbtxt: XLA's
# own estimate, NVLink speed, is covered by the optimizer alone), and eight collectives may be in flight
# at once (by default one: the all-gather cannot stay open across the gradient reductions or a layer
# loop that runs collectives). 35M step+send 0: the profile alone 0% of the dots under the exchange, with
# a limit of 2 14%, 3 84% (the backward loop), 4 100% (both loops); 1B (two exchange all-gathers, the
# payload and the replica weight): 4 1.4%, 6 74%, 8 100%; the toy's 100% from a limit of 4.
EXCHANGE_PROFILE = SPECS_DIR / "exchange_latency.pbtxt"
GPU_OVERLAP_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_experimental_parallel_collective_overlap_limit=8",
    f"--xla_gpu_pgle_profile_file_or_directory_path={EXCHANGE_PROFILE}",
)


def is_gpu_topology(topology: str) -> bool:
    return topology.split(":")[0] in GPU_SPECS


def gpu_spec(chip: str) -> str:
    """The GpuTargetConfigProto text of a chip (gpu_specs/)."""
    return (SPECS_DIR / GPU_SPECS[chip]).read_text()


def gpu_hbm_bytes(chip: str) -> int:
    """A GPU's memory (the spec's device_memory_size)."""
    return int(re.search(r"device_memory_size:\s*(\d+)", gpu_spec(chip)).group(1))


def gpu_usable_bytes(chip: str, env=None) -> int:
    """What one program may hold on a GPU: its memory × XLA_PYTHON_CLIENT_MEM_FRACTION (0.90 unless
    set, as `diloco train` runs)."""
    env = os.environ if env is None else env
    try:
        frac = float(env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_MEM_FRACTION))
    except ValueError:
        frac = DEFAULT_MEM_FRACTION
    return int(gpu_hbm_bytes(chip) * frac)


def cuda_plugin_installed() -> bool:
    """jax's CUDA plugin (12 or 13) is importable; False without one (no `jax_plugins` package at all)."""
    if importlib.util.find_spec("jax_plugins") is None:  # find_spec of a submodule imports its parent
        return False
    return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") is not None for v in (12, 13))


def gpu_devices(topology: str) -> list:
    """The GPUs of `NAME:SLICESxHOSTSxGPUS` (e.g. h200:1x2x8: two hosts of 8 H200s), described by jax's
    CUDA plugin from the chip's target spec; ConfigError (one line) for a bad name or shape or no plugin."""
    chip, _, shape = topology.partition(":")
    if chip not in GPU_SPECS or not re.fullmatch(r"\d+x\d+x\d+", shape) or "x0" in "x" + shape:
        raise ConfigError("--topology", f"{topology!r}: a GPU target is NAME:SLICESxHOSTSxGPUS with NAME one of "
                          f"{sorted(GPU_SPECS)}, e.g. h200:1x1x8 (one node of 8), h100:1x2x8 (two nodes)")
    if not cuda_plugin_installed():
        raise ConfigError("--topology", GPU_AOT_HINT)
    from jax.experimental import topologies

    try:
        desc = topologies.get_topology_desc(platform="cuda", topology=shape, target_config=gpu_spec(chip))
    except Exception as e:  # the plugin's own message, on one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError("--topology", f"jax's CUDA plugin cannot describe {topology!r}: {first}") from None
    return sorted(desc.devices, key=lambda d: (d.process_index, d.id))


def use_gpu_overlap_flags(env=None, need_gpu: bool = False) -> list[str]:
    """Add GPU_OVERLAP_FLAGS to XLA_FLAGS (a flag the user set, by name, is kept as they set it) when
    jax's CUDA plugin is installed (need_gpu: and this machine has an NVIDIA GPU, as `diloco train`
    asks); return the GPU overlap flags now in XLA_FLAGS. Call it before JAX initialises; the flags are
    XLA's GPU compiler's only (CPU programs do not read them)."""
    env = os.environ if env is None else env
    have = env.get("XLA_FLAGS", "").split()
    names = {f.split("=")[0] for f in have}
    if cuda_plugin_installed() and (not need_gpu or glob.glob("/dev/nvidia[0-9]*")):
        added = [f for f in GPU_OVERLAP_FLAGS if f.split("=")[0] not in names]
        if added:
            env["XLA_FLAGS"] = " ".join(have + added)
        have = have + added
    return [f for f in have if f.split("=")[0] in {g.split("=")[0] for g in GPU_OVERLAP_FLAGS}]


# -- the exchange's window in a compiled step+send program ----------------------------------------
def exchange_window(prog: dict) -> dict:
    """The replica exchange of a compiled `step+send p` (a compile report's program row): its async
    collectives over the `replica` axis, and the compute the schedule runs under the largest of them
    (ops, dot/convolution GFLOP and their share of the program's)."""
    cs = [c for c in prog.get("collectives", []) if "replica" in c["axes"]]
    if not cs:
        return {"collectives": 0, "async": False, "overlapped_ops": 0, "overlapped_flops": 0.0, "share": 0.0}
    big = max(cs, key=lambda c: (c["operand_bytes"], c.get("overlapped_flops", 0.0)))
    total = prog.get("hlo_flops", 0.0)
    return {"collectives": len(cs), "async": all(c["async"] for c in cs), "bytes": big["operand_bytes"],
            "overlapped_ops": big.get("overlapped_ops", 0), "overlapped_flops": big.get("overlapped_flops", 0.0),
            "share": big.get("overlapped_flops", 0.0) / total if total else 0.0}
