"""The runtime side of NVIDIA GPUs (#41): scripts/gpu_check.sh's comparison logic and its CPU-only dry mode end to end
(every phase, the GPU run's code path with the CPU standing in for the GPU); the CUDA 12 lock; the memory preflight
(diloco/devmem.py) against a fake device limit; model.matmul_precision; `diloco launch --comm_device` on GPUs."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, tiny_config

sys.path.insert(0, str(REPO / "scripts"))
import gpu_check  # noqa: E402


def write_run(d: Path, losses: dict[int, float], evals: dict[int, float], sha: str = "a") -> Path:
    d.mkdir(parents=True)
    rows = [{"step": s, "train_loss": v, **({"eval_loss": evals[s]} if s in evals else {})} for s, v in losses.items()]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "summary.json").write_text(json.dumps({"final_eval_loss": evals[max(evals)], "params_sha256": sha}))
    return d


def test_compare_pair_takes_the_worst_row_of_train_and_eval(tmp_path):
    """Hand-computed: |Δ train| at steps 10, 20 = 0.004, 0.003 → 0.004; |Δ eval| at 20 = 0.02 → out of the 0.01 bound;
    steps only one side logged (30) are not compared."""
    g = write_run(tmp_path / "g", {10: 3.000, 20: 2.500, 30: 2.0}, {20: 2.60})
    c = write_run(tmp_path / "c", {10: 3.004, 20: 2.497}, {20: 2.58}, sha="b")
    r = gpu_check.compare_pair(g, c)
    assert r["steps_compared"] == 2
    assert r["max_abs_train_loss_diff"] == pytest.approx(0.004)
    assert r["max_abs_eval_loss_diff"] == pytest.approx(0.02)
    assert r["within_bound"] is False and r["params_sha256_equal"] is False
    near = write_run(tmp_path / "n", {10: 3.001, 20: 2.5}, {20: 2.595})
    assert gpu_check.compare_pair(g, near)["within_bound"] is True


@pytest.mark.slow
def test_dry_mode_runs_every_phase_and_cpu_matches_itself_exactly(tmp_path):
    """`gpu_check.sh --dry`: the five files, both toy sides on the CPU give identical losses (a GPU-vs-CPU gap on the
    device is then the platform's, not the check's), and the bench measured DP (1 replica) and Streaming (2)."""
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    p = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sorted(f.name for f in out.iterdir()) == ["bench.jsonl", "env.txt", "log.txt", "toy_compare.json",
                                                     "verdict.txt"]
    log = (out / "log.txt").read_text()
    for phase in ("setup", "env", "toy", "compare", "bench-dp", "bench-streaming", "verdict"):
        assert f"== phase {phase}: ok" in log, log[-3000:]
    cmp = json.loads((out / "toy_compare.json").read_text())
    for m in ("dp", "diloco", "streaming"):
        r = cmp["methods"][m]
        assert r["steps_compared"] >= 4 and r["eval_rows"] >= 1, r
        assert r["max_abs_train_loss_diff"] == 0 and r["max_abs_eval_loss_diff"] == 0 and r["params_sha256_equal"], r
    rows = [json.loads(x) for x in (out / "bench.jsonl").read_text().splitlines()]
    assert [r["replicas"] for r in rows] == [1, 2]
    for r in rows:
        assert r["ms_per_step"] > 0 and r["compiled_memory"]["predicted_peak"] > 0 and r["model_flops_per_step"] > 0
    verdict = (out / "verdict.txt").read_text()
    assert verdict.count("PASS toy") == 3 and "FAIL" not in verdict and "NOT RUN" not in verdict, verdict
    assert "pkg jax " in (out / "env.txt").read_text()


@pytest.mark.slow
def test_accum_device_check_dry_mode(tmp_path):
    """`gpu_check_accum.sh --dry` (~40 s): both phases run; accum_steps 2 and 4 within the bound on the CPU; the tiny
    1B stand-in refused at half its compiled peak, with gradient accumulation named, and fitting with accum_steps=2."""
    out = tmp_path / "out"
    p = subprocess.run(["bash", "scripts/gpu_check_accum.sh", "--dry"], cwd=REPO, capture_output=True, text=True,
                       env=dict(os.environ, OUT=str(out), PYTHON=sys.executable), timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    log = (out / "log.txt").read_text()
    assert "== phase accum: ok" in log and "== phase refuse: ok" in log, log[-3000:]
    acc = json.loads((out / "accum.json").read_text())
    assert all(r["within_bound"] for r in acc["toy_streaming_highest"].values()), acc
    assert [r["accum_steps"] for r in acc["dp_35m_bf16"]] == [4, 1]
    assert acc["dp_35m_bf16"][0]["predicted_peak"] < acc["dp_35m_bf16"][1]["predicted_peak"]
    ref = json.loads((out / "refuse.json").read_text())
    assert "gradient accumulation (accum_steps=2" in ref["1B_M2_one_gpu"]["refused"]
    assert ref["1B_M2_one_gpu_accum"]["fits"] and ref["1B_M2_one_gpu_accum"]["ce"]


def lock_pins(*files: str) -> dict[str, str]:
    pins = {}
    for f in files:
        for line in (REPO / f).read_text().splitlines():
            if "==" in line and not line.startswith("#"):
                name, version = line.split("#")[0].strip().split("==")
                pins[name.lower().replace("_", "-")] = version
    return pins


@pytest.mark.slow
def test_cuda12_install_resolves_within_the_locks(tmp_path):
    """`pip install -c requirements.lock -c requirements-cuda12.lock '.[cuda12]'` resolves (pip's dry run, no
    download of the wheels), and the two locks pin every package it resolves to: the GPU install is reproducible."""
    report = tmp_path / "report.json"
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--report", str(report), "-c", "requirements.lock", "-c", "requirements-cuda12.lock",
                        ".[cuda12]"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    got = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
           for i in json.loads(report.read_text())["install"]}
    pins = lock_pins("requirements.lock", "requirements-cuda12.lock")
    assert {"jax-cuda12-plugin", "nvidia-cudnn-cu12", "nvidia-nccl-cu12"} <= set(got)
    assert sorted(n for n in got if n not in pins and n != "diloco") == []
    assert {n: v for n, v in got.items() if n in pins and pins[n] != v} == {}


class FakeGPU:
    platform = "gpu"

    def __init__(self, limit):
        self.limit = limit

    def memory_stats(self):
        return {"bytes_limit": self.limit} if self.limit else {}


def test_preflight_refuses_a_program_over_the_device_limit_naming_peak_limit_and_levers(monkeypatch):
    """1B Streaming with 2 replicas on one H200, the compiled numbers (`diloco compile --topology h200:1x1x1 --config
    experiments/c4_scaling.py:1B,streaming_ovl_fp4_h30 --config.vocab=sentencepiece:<T5 32k> --programs inner`, remat
    full as `auto` resolves it there): the inner step's 170,139,193,774 bytes against a pool of 0.90 of 143,771 MiB
    = 126.4 GiB: refused in one line naming the levers, gradient accumulation among them; with accum_steps=16 the
    same compile gives 82,457,307,086 bytes, which passes. A CPU device, or no limit, passes."""
    from types import SimpleNamespace

    from diloco import devmem, resolve
    from diloco.errors import ConfigError
    from experiments import c4_scaling

    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")
    cfg = c4_scaling.get_config("1B,streaming_ovl_fp4_h30")
    limit = int(0.90 * 143771 * 2**20)
    shape = (1, 1, 1, 1)  # both replicas on the one GPU
    plan = SimpleNamespace(remat=resolve.remat(cfg, "gpu", shape, limit)[0], mesh=shape)
    assert plan.remat == "full"
    tr = SimpleNamespace(cfg=cfg, R=2, plan=plan)
    peaks = {"inner": 170139193774, "step+send 0": 150 * 2**30, "eval": 3 * 2**30}
    with pytest.raises(ConfigError) as e:
        devmem.check_fits_device(peaks, tr, FakeGPU(limit))
    line = str(e.value)
    assert "\n" not in line and e.value.field == "batch_size"
    assert "its inner program needs 158.5 GiB per device" in line and "gives 126.4 GiB" in line, line
    assert "replicas=2" in line and "mesh.fsdp" in line and "batch_size (now 512)" in line, line
    assert "gradient accumulation (accum_steps=2, now 1: the step's activations for 128 sequences" in line, line
    assert "remat_policy" not in line and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in line  # full remat; 0.90 already
    cfg.accum_steps = 16
    assert devmem.check_fits_device({"inner": 82457307086}, tr, FakeGPU(limit)) == {
        "peak_bytes": 82457307086, "program": "inner", "bytes_limit": limit}
    assert devmem.check_fits_device(peaks, tr, FakeGPU(None)) is None
    assert devmem.check_fits_device(peaks, tr, SimpleNamespace(platform="cpu")) is None
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    cfg.model.remat_policy = "save_dots"
    cfg.accum_steps = 256  # one sequence per replica at a time: no accumulation lever left
    line = devmem.refusal({"inner": limit + 1}, limit, cfg, 2)
    assert "model.remat_policy=full" in line and "XLA_PYTHON_CLIENT_MEM_FRACTION (the pool is 0.5" in line, line
    assert "accum_steps" not in line


# Compiled per-device peaks of inner steps for H200s (`diloco compile --topology T --json --programs inner --config
# experiments/c4_scaling.py:S,streaming_ovl_fp4_h30 --config.vocab=sentencepiece:<T5 32k> --config.model.remat_policy=P`,
# seq 1024; memory.csv: results/gpu/memory.csv's inner_peak_gib, seq 2048, full): (scale, method, mesh, accum, policy,
# GiB). The first six fitted devmem.ACT_BYTES; the rest were not used in the fit.
COMPILED = [("35M", "streaming", (2, 1, 4), 1, "none", 3.444), ("35M", "streaming", (2, 1, 4), 1, "save_dots", 1.185),
            ("35M", "streaming", (2, 1, 4), 1, "full", 0.804), ("1B", "streaming", (2, 1, 4), 1, "none", 351.265),
            ("1B", "streaming", (2, 1, 4), 1, "save_dots", 73.63), ("1B", "streaming", (2, 1, 4), 1, "full", 25.508),
            ("35M", "streaming", (1, 1, 1), 1, "none", 27.071), ("35M", "streaming", (1, 1, 1), 1, "save_dots", 8.871),
            ("1B", "streaming", (1, 1, 1), 1, "save_dots", 532.351), ("1B", "streaming", (1, 1, 1), 1, "full", 158.454),
            ("1B", "streaming", (1, 1, 1), 16, "full", 76.794), ("35M", "streaming", (2, 1, 4), 4, "none", 1.123),
            ("1B", "streaming", (1, 1, 1), 16, "save_dots", 101.812)]  # what `auto` picks there


def test_remat_estimate_against_compiled_peaks_and_the_choice_it_makes():
    """devmem.estimate_peak against compiles for H200s: exact on the six it was fitted on, 0.85–1.2× on the rest
    (one H200, gradient accumulation, and memory.csv's 35M–10B rows at seq 2048 for 1 to 32 GPUs); 0.5–1.7× on every
    compiled row of results/{gpu,pod}/memory.csv, 0.85–1.2× on its tensor rows but tensor 8's (1B 1.66). And what `auto`
    then picks on an 8-H200 node (pool 90 %): 35M no remat, 1B save_dots, 4B full; on one H200 35M none, 1B full."""
    import csv

    from diloco import devmem, resolve
    from diloco.model.scales import formula_params
    from experiments import c4_scaling

    V = 32128
    for scale, method, mesh, k, policy, gib in COMPILED:
        cfg = c4_scaling.get_config(f"{scale},{method}_ovl_fp4_h30")
        cfg.accum_steps = k
        ratio = devmem.estimate_peak(cfg, policy, mesh, formula_params(scale, V), V) / (gib * devmem.GIB)
        assert 0.85 <= ratio <= 1.2, (scale, mesh, k, policy, ratio)
    names = {"DP": "dp", "DiLoCo": "diloco_h30", "Streaming": "streaming_ovl_fp4_h30"}
    ratios = {}
    for table in ("results/gpu/memory.csv", "results/pod/memory.csv"):
        for row in csv.DictReader((REPO / table).open()):
            if not row["inner_peak_gib"]:
                continue  # a row whose inner step ran out of memory
            cfg = c4_scaling.get_config(f"{row['scale']},{names[row['method']]}")
            cfg.batch_size, cfg.seq_len, cfg.model.attention = int(row["global_batch"]), int(row["seq_len"]), \
                row["attention"]
            axes = dict(re.findall(r"([a-z]+)(\d+)", row["mesh"]))
            mesh = tuple(int(axes.get(a, 1)) for a in ("replica", "data", "fsdp", "tensor"))
            ratios[table[8:11], row["scale"], row["method"], row["chip"], row["mesh"]] = devmem.estimate_peak(
                cfg, "full", mesh, formula_params(row["scale"], V), V) / (float(row["inner_peak_gib"]) * devmem.GIB)
    gpu = [r for k, r in ratios.items() if k[0] == "gpu" and "tensor" not in k[4]]
    tensor = {k: round(r, 2) for k, r in ratios.items() if "tensor" in k[4]}
    assert len(gpu) == 24 and all(0.85 <= r <= 1.2 for r in gpu), gpu
    assert all(0.5 <= r <= 1.7 for r in ratios.values()), ratios
    assert len(tensor) == 7 and all(0.85 <= r <= 1.2 for k, r in tensor.items() if "tensor8" not in k[4]), tensor
    limit = int(151397597184 * 0.90)
    node = {s: resolve.remat(c4_scaling.get_config(f"{s},streaming_ovl_fp4_h30"), "gpu", (2, 1, 4, 1), limit)
            for s in ("35M", "1B", "4B")}
    assert {s: p for s, (p, _) in node.items()} == {"35M": "none", "1B": "save_dots", "4B": "full"}
    assert "save_dots 73.6" in node["1B"][1] and "126.9 GiB limit" in node["1B"][1], node["1B"][1]
    one = {s: resolve.remat(c4_scaling.get_config(f"{s},streaming_ovl_fp4_h30"), "gpu", (1, 1, 1, 1), limit)[0]
           for s in ("35M", "1B")}
    assert one == {"35M": "none", "1B": "full"}
    assert resolve.remat(c4_scaling.get_config("1B,streaming_ovl_fp4_h30"), "tpu")[0] == "full"  # TPU: as before


def test_precompile_reports_each_programs_peak_bytes():
    """A 256×256 float32 matmul holds its argument and its result at once: ≥ 2 × 256 KiB."""
    import jax
    import jax.numpy as jnp

    from diloco.precompile import precompile

    got = precompile([("mm", jax.jit(lambda x: x @ x), (jnp.ones((256, 256), jnp.float32),))], log=lambda m: None)
    assert set(got["peak_bytes"]) == {"mm"} and got["peak_bytes"]["mm"] >= 2 * 256 * 256 * 4


def test_matmul_precision_is_resolved_recorded_and_applied():
    import jax

    from diloco import resolve

    cfg = tiny_config("dp")
    assert cfg.model.matmul_precision == "auto"
    assert resolve.matmul_precision(cfg, "gpu")[0] == "default" and "TF32" in resolve.matmul_precision(cfg, "gpu")[1]
    plan = resolve.resolve(cfg, jax.devices()[:1])
    assert plan.to_json()["matmul_precision"] == "default" and "matmul_precision" in plan.to_json()["why"]
    resolve.apply_matmul_precision(cfg, plan)  # auto: JAX's setting left alone
    assert jax.config.jax_default_matmul_precision is None
    cfg.model.matmul_precision = "highest"
    plan = resolve.resolve(cfg, jax.devices()[:1])
    try:
        resolve.apply_matmul_precision(cfg, plan)
        assert plan.matmul_precision == "highest" and jax.config.jax_default_matmul_precision == "highest"
    finally:
        jax.config.update("jax_default_matmul_precision", None)


def test_launch_refuses_comm_device_on_gpus(capsys):
    from diloco import launch

    assert launch.main(["--processes", "2", "--comm_device", "--gpus", "2", "--", "train"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--comm_device" in err and "in_step" in err and "--gpus 0" in err, err


ACCUM = r"""
import jax, numpy as np, sys
sys.path.insert(0, "tests")
from conftest import tiny_config
from diloco.trainer import Trainer
rng = np.random.default_rng(0)
bs = [rng.integers(2, 200, size=(16, 32), dtype=np.int32) for _ in range(3)]
bs[0][:5, 10:] = 0  # padding spread unevenly over the rows: microbatches hold different token counts
worst = {}
S = {"H": 3, "tau": 1, "layers_per_fragment": 1}
for name, method, over in [("dp data8", "dp", {}), ("streaming data4", "streaming", S),
                           ("streaming fsdp4", "streaming", {**S, "mesh.data": 1, "mesh.fsdp": 4})]:
    runs = []
    for k in (1, 2):
        cfg = tiny_config(method, batch_size=16, accum_steps=k, **over)
        tr = Trainer(cfg, devices=jax.devices())
        st, inner, ces = tr.fresh_state(), tr.inner_step(), []
        for t, b in enumerate(bs, 1):
            st, ce, _ = inner(st, jax.device_put(b.reshape(tr.R, -1, 32), tr.batch_sharding))
            ces.append(np.asarray(ce))
        runs.append((jax.tree_util.tree_leaves(st.params), np.stack(ces),
                     {a: tr.mesh.shape[a] for a in ("replica", "data", "fsdp")}))
    (p1, c1, m), (p2, c2, _) = runs
    worst[name] = (float(np.max(np.abs(c1 - c2))), max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                                                      for a, b in zip(p1, p2)), m)
print(worst)
"""


@pytest.mark.slow
def test_gradient_accumulation_gives_the_whole_batchs_step_on_eight_devices():
    """accum_steps=2 (two microbatches of 4 sequences per replica, one after the other) against the whole batch, on 8
    fake CPU devices: DP over data=8 (the flat token-weighted all-reduce), Streaming over replica 2 × data 4 and
    replica 2 × fsdp 4, with padding so the microbatches weigh differently. Three AdamW steps: every cross-entropy
    within 4 ulp (2e-6: float32's ulp is 4.8e-7 at a loss in [4, 8), the byte vocabulary's ≈ 5.5) and every
    parameter within 2e-6 (float32 summation order; dp data8 measured 1.9e-6, 4 ulp, and 1.9e-7). accum_steps=1 is the unaccumulated program itself
    (tests/test_same_numbers.py's hashes)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", TF_CPP_MIN_LOG_LEVEL="3")
    r = subprocess.run([sys.executable, "-c", ACCUM], capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    import ast

    worst = ast.literal_eval(r.stdout.strip().splitlines()[-1])
    assert [m for _, _, m in worst.values()] == [{"replica": 1, "data": 8, "fsdp": 1},
                                                 {"replica": 2, "data": 4, "fsdp": 1},
                                                 {"replica": 2, "data": 1, "fsdp": 4}]
    print(worst)
    for name, (ce, param, _) in worst.items():
        assert ce <= 2e-6 and param <= 2e-6, (name, ce, param)


def test_accum_steps_must_split_the_batch_in_one_line():
    from diloco.errors import ConfigError
    from diloco.trainer import check_accum

    with pytest.raises(ConfigError, match=r"^accum_steps: 3 does not divide the batch of a replica \(8 sequences\)"):
        tiny_config("streaming", batch_size=16, accum_steps=3)
    cfg = tiny_config("streaming", batch_size=16, accum_steps=4)  # 2 sequences per microbatch, 4 devices a replica
    with pytest.raises(ConfigError, match=r"^accum_steps: 4 microbatches .* over the 4 devices") as e:
        check_accum(cfg, 4)
    assert "\n" not in str(e.value)
    check_accum(cfg, 2)
    check_accum(tiny_config("streaming", batch_size=16, accum_steps=2), 4)
