"""`diloco compile` for NVIDIA GPUs on this CPU: XLA's target specs, the GPU plan of one 8×H200 node, and the
in-step exchange over the step's compute in the GPU schedule. The compiles need jax's CUDA plugin (the
`gpu-aot` extra; no GPU) and run in CI's gpu tier; the rest is pure logic."""
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from diloco import compile as C
from diloco.compile import gpu as G
from diloco.errors import ConfigError

NO_PLUGIN = "jax-cuda12-plugin not installed (pip install -c requirements.lock -e '.[gpu-aot]')"
REPO = Path(__file__).resolve().parents[1]
needs_plugin = pytest.mark.skipif(not G.cuda_plugin_installed(), reason=NO_PLUGIN)


def test_gpu_specs_are_xlas_with_their_origin():
    """The shipped specs are XLA's (memory as XLA's spec gives it, the device names jax reports) and
    each names the XLA file and commit it came from; the field jax-cuda12-plugin 0.10.2 refuses is out."""
    want = {"h100": (84942979072, "NVIDIA H100 80GB HBM3"), "h200": (151397597184, "NVIDIA H200 141GB HBM3e"),
            "b200": (191514411008, "NVIDIA B200")}
    for chip, (mem, name) in want.items():
        text = G.gpu_spec(chip)
        assert G.gpu_hbm_bytes(chip) == mem and f'name: "{name}"' in text
        assert re.search(rf"openxla/xla xla/backends/gpu/target_config/specs/{G.GPU_SPECS[chip]} at commit [0-9a-f]{{40}}",
                         text)
        assert "collective_memory_granularity" not in text.split("gpu_device_info", 1)[1]
    assert G.gpu_usable_bytes("h200", {}) == int(151397597184 * 0.90)  # as `diloco train` sets it
    assert G.gpu_usable_bytes("h200", {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.75"}) == int(151397597184 * 0.75)


@pytest.mark.parametrize("topology", ["h200:8", "h300:1x1x8", "h200:1x0x8", "h200:"])
def test_a_bad_gpu_topology_is_one_line(topology):
    with pytest.raises(ConfigError, match=r"^--topology: .*NAME:SLICESxHOSTSxGPUS") as e:
        G.gpu_devices(topology)
    assert "\n" not in str(e.value)


def test_without_the_cuda_plugin_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError) as e:
        G.gpu_devices("h200:1x1x8")
    assert "'.[gpu-aot]'" in str(e.value) and "\n" not in str(e.value)


def test_gpu_overlap_flags_keep_what_the_user_set(monkeypatch):
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_gpu_experimental_parallel_collective_overlap_limit=1"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # the plugin is installed
    got = G.use_gpu_overlap_flags(env)
    assert got[0] == "--xla_gpu_experimental_parallel_collective_overlap_limit=1"  # the user's, kept
    assert set(got[1:]) == set(G.GPU_OVERLAP_FLAGS) - {"--xla_gpu_experimental_parallel_collective_overlap_limit=8"}
    assert env["XLA_FLAGS"].split()[0] == "--xla_force_host_platform_device_count=8"
    assert G.use_gpu_overlap_flags(env) == got and env["XLA_FLAGS"].count("pgle") == 1  # idempotent
    monkeypatch.setattr(G.glob, "glob", lambda pattern: [])  # `diloco train` on a machine without a GPU
    env2 = {}
    assert G.use_gpu_overlap_flags(env2, need_gpu=True) == [] and env2 == {}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # no plugin: nothing changes
    assert G.use_gpu_overlap_flags(env2) == [] and env2 == {}


def test_custom_calls_keep_cudnn_names_and_the_exchange_window_by_hand():
    """cuDNN's targets carry a `$` (the old pattern stopped at it and lost them); the exchange window
    is the largest collective over `replica` and its share of the program's dot FLOPs."""
    hlo = ('%a = bf16[4]{0} custom-call(%x), custom_call_target="__cudnn$fmhaSoftmax", api_version=X\n'
           '%b = f32[2]{0} custom-call(%y), custom_call_target="tpu_custom_call"\n')
    assert C.custom_calls(hlo) == ["__cudnn$fmhaSoftmax", "tpu_custom_call"]
    prog = {"hlo_flops": 4e9, "collectives": [
        {"axes": ["replica"], "operand_bytes": 100, "async": True, "overlapped_ops": 7, "overlapped_flops": 3e9},
        {"axes": ["replica"], "operand_bytes": 8, "async": True, "overlapped_ops": 0, "overlapped_flops": 0.0},
        {"axes": ["fsdp"], "operand_bytes": 10**6, "async": True, "overlapped_ops": 1, "overlapped_flops": 1e9}]}
    w = G.exchange_window(prog)
    assert (w["collectives"], w["async"], w["bytes"], w["overlapped_ops"], w["share"]) == (2, True, 100, 7, 0.75)
    assert G.exchange_window({"collectives": []})["collectives"] == 0


# -- compiled for one node of 8 H200s (CI's gpu tier) ---------------------------------------------
# Each compile runs `diloco compile --json` in a process of its own: XLA reads XLA_FLAGS (the overlap
# flags the command sets) once per process, when it first compiles.
SPM = "data/vocab/sentencepiece_cc_all.32000.100extra-sentencepiece.model"
H200_USABLE = int(151397597184 * 0.90)


def compile_node(*args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION")}
    r = subprocess.run([sys.executable, "-m", "diloco.cli", "compile", "--topology", "h200:1x1x8", "--json", *args],
                       capture_output=True, text=True, timeout=400, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def windows(rep: dict) -> dict[str, dict]:
    return {p["program"]: G.exchange_window(p) for p in rep["programs"] if p["program"].startswith("step+send")}


@pytest.fixture(scope="module")
def toy_node():
    return compile_node("--config", "experiments/toy.py:streaming")


@pytest.mark.slow
@needs_plugin
def test_toy_streaming_for_8_h200_plan_fit_and_the_exchange_over_the_step(toy_node):
    """Every program of the toy Streaming run for one node of 8 H200s: the plan a GPU gets (fp32 toy:
    XLA's attention, no remat, no scan, the exchange in the step), every program's per-GPU peak under
    the usable share of an H200 (90%, as `diloco train` sets it), every collective async, and in each step+send the exchange's
    all-gather over `replica` is issued before the step's compute and waited for after it: every
    dot of the program is under it (the schedule check the TPU rows run)."""
    rep = toy_node
    res = rep["resolved"]
    assert (res["platform"], res["mesh"], res["attention"], res["remat"], res["scan"], res["exchange"]) == (
        "gpu", {"replica": 2, "data": 4, "fsdp": 1}, "xla", "none", False, "in_step")
    assert "model.dtype=float32" in res["why"]["attention"]
    assert res["xla_flags"] == list(G.GPU_OVERLAP_FLAGS)
    assert rep["usable_bytes"] == H200_USABLE and rep["fits"]
    assert all(p["compiled"] and 0 < p["peak_bytes_per_chip"] <= H200_USABLE for p in rep["programs"])
    assert all(c["async"] for p in rep["programs"] for c in p["collectives"])
    w = windows(rep)
    assert w and all(x["collectives"] and x["async"] for x in w.values())
    for name, x in w.items():
        prog = next(p for p in rep["programs"] if p["program"] == name)
        assert x["overlapped_flops"] == prog["hlo_flops"] > 0, (name, x)


@pytest.mark.slow
@needs_plugin
def test_without_the_overlap_flags_the_exchange_waits_for_the_step():
    """The same step+send compiled with XLA's defaults (--no-overlap-flags): the all-gather is issued
    after the forward and backward, a few percent of the program's dots under it. What the flags buy."""
    rep = compile_node("--config", "experiments/toy.py:streaming", "--programs", "step+send 0", "--no-overlap-flags")
    assert "xla_flags" not in rep["resolved"]
    (x,) = windows(rep).values()
    assert x["async"] and x["share"] < 0.1, x


@pytest.mark.slow
@needs_plugin
def test_sequence_parallelism_turns_the_tensor_all_reduces_into_reduce_scatters():
    """The toy inner step on 8 H200s, replica 2 × fsdp 2 × tensor 2, with and without `sequence=tensor` in
    mesh.rules: without it each sublayer ends in an all-reduce over `tensor`; with it the residual stream is split
    over the sequence, the sublayers end in reduce-scatters over `tensor`, and the step holds fewer temporaries."""
    def inner(rules):
        rep = compile_node("--config", "experiments/toy.py:streaming", "--programs", "inner", "--config.mesh.fsdp=2",
                           "--config.mesh.tensor=2", f"--config.mesh.rules={rules}")
        (p,) = rep["programs"]
        by = lambda kind: sum(c["operand_bytes"] * c["count"] for c in p["collectives"]  # noqa: E731
                              if c["kind"] == kind and c["axes"] == ["tensor"])
        return by("all-reduce"), by("reduce-scatter"), p["memory"]["temp_bytes"]
    ar, rs, temp = inner("batch=data+fsdp,embed=fsdp")
    ar_sp, rs_sp, temp_sp = inner("batch=data+fsdp,embed=fsdp,sequence=tensor")
    assert ar > 0 and ar_sp < 0.1 * ar and rs_sp > rs and temp_sp < temp, (ar, rs, temp, ar_sp, rs_sp, temp_sp)


@pytest.mark.slow
@needs_plugin
def test_35m_streaming_for_8_h200_calls_cudnn_and_overlaps_both_layer_loops(shared_dir):
    """The paper's 35M Streaming spec (bf16, head dim 64: cuDNN's fused attention; nn.scan; FSDP over a
    replica's 4 GPUs; no remat: the memory estimate fits the H200's pool): cuDNN's custom calls are in the compiled step, the peak fits, and the exchange's
    window holds both layer loops (forward and backward): every dot of the program."""
    rep = compile_node("--config", "experiments/c4_scaling.py:35M,streaming_ovl_fp4_h100",
                       f"--config.vocab=sentencepiece:{shared_dir / SPM}", "--programs", "inner,step+send 0,eval")
    res = rep["resolved"]
    assert (res["attention"], res["scan"], res["mesh"], res["exchange"], res["remat"]) == (
        "cudnn", True, {"replica": 2, "data": 1, "fsdp": 4}, "in_step", "none")
    assert res["why"]["remat"].startswith("GPU memory: none fits") and res["device_limit_bytes"] == H200_USABLE
    progs = {p["program"]: p for p in rep["programs"]}
    for name in ("inner", "step+send 0", "eval"):
        assert any(c.startswith("__cudnn$") for c in progs[name]["custom_calls"]), (name, progs[name]["custom_calls"])
    assert rep["fits"] and rep["peak_bytes_per_chip"] <= H200_USABLE
    x = windows(rep)["step+send 0"]
    assert x["async"] and x["overlapped_flops"] == progs["step+send 0"]["hlo_flops"] > 0, x


QUIET = """
import sys
from diloco.noise import quiet_cuda_plugin
if sys.argv[1] == "quiet":
    quiet_cuda_plugin()
import jax
print(jax.devices()[0].platform)
"""


@pytest.mark.slow
@needs_plugin
def test_the_plugin_on_a_machine_without_a_gpu_says_nothing_at_start_up():
    """Every `diloco` command calls quiet_cuda_plugin before its imports: without it the plugin's CUDA loads
    print "Could not find cuda drivers" (absl, before TF_CPP_MIN_LOG_LEVEL is read) into a command's one-line
    answers; with it stderr is empty and JAX still starts (on the CPU)."""
    if os.path.exists("/dev/nvidia0"):
        pytest.skip("this machine has a GPU: the plugin finds its drivers")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    runs = {mode: subprocess.run([sys.executable, "-c", QUIET, mode], capture_output=True, text=True, env=env,
                                 cwd=REPO, timeout=300) for mode in ("loud", "quiet")}
    assert runs["loud"].returncode == 0 and "cuda drivers" in runs["loud"].stderr  # what there is to silence
    assert runs["quiet"].returncode == 0 and runs["quiet"].stdout == "cpu\n" and runs["quiet"].stderr == ""
