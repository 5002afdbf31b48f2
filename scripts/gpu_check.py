"""The phases of the device check of one NVIDIA GPU (issue #41), run by scripts/gpu_check.sh, each time-boxed there.

    python3 scripts/gpu_check.py env     OUT                 versions, devices, memory limit      → OUT/env.txt
    python3 scripts/gpu_check.py compare OUT RUNS [--dry]    toy runs' losses, GPU vs CPU          → OUT/toy_compare.json
    python3 scripts/gpu_check.py bench   OUT SPEC [--steps N] [--dry]  step time, MFU, peak memory  → OUT/bench.jsonl
    python3 scripts/gpu_check.py verdict OUT                 one line per check                   → OUT/verdict.txt

`bench` runs the paper's 35M setting (experiments/c4_scaling.py:35M,<method>: seq 1024, global batch 64, bf16, remat)
on synthetic tokens with the T5 vocabulary's size (32,100 ids; no seqio needed): ms/step (median of laps), MFU against
the chip's dense bf16 peak (datasheet and measured), the compiled inner step's memory prediction against the
allocator's peak, and whether cuDNN's fused attention is in the compiled program. --dry: the CPU path, tiny.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, not an installed diloco

# Dense bf16 matmul peaks by device_kind (vendors' datasheets, SXM parts): the MFU denominator.
BF16_PEAK = {"NVIDIA H200": 989.4e12, "NVIDIA H100 80GB HBM3": 989.4e12, "NVIDIA H100": 989.4e12}
TOY_LOSS_BOUND = 0.01  # nats: |GPU − CPU| of every logged train loss and eval loss at highest matmul precision
T5_VOCAB = 32100  # the paper's SentencePiece vocabulary (32,000 + 100 extra ids)
METHODS = ("dp", "diloco", "streaming")


def write_env(out: Path) -> None:
    """Versions (python, jax, jaxlib, plugins, flax, optax, orbax), devices, memory limit, XLA env → env.txt."""
    from importlib import metadata

    import jax

    lines = [f"date_utc {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}",
             f"python {platform.python_version()} {sys.executable}", f"machine {platform.machine()}"]
    for pkg in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt",
                "flax", "optax", "orbax-checkpoint", "ml-collections", "tensorboardX", "numpy", "nvidia-cudnn-cu13",
                "nvidia-cudnn-cu12", "nvidia-cublas", "nvidia-nccl-cu13"):
        try:
            lines.append(f"pkg {pkg} {metadata.version(pkg)}")
        except metadata.PackageNotFoundError:
            pass
    for d in jax.devices():
        stats = d.memory_stats() or {}
        lines.append(f"device {d.id} {d.platform} {d.device_kind!r} bytes_limit={stats.get('bytes_limit')}")
    for k in sorted(os.environ):
        if k.startswith(("XLA_", "JAX_", "TF_CPP", "CUDA_VISIBLE")):
            lines.append(f"env {k}={os.environ[k]}")
    (out / "env.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def read_rows(workdir: Path) -> dict[int, dict]:
    rows = {}
    with open(workdir / "metrics.jsonl") as f:
        for line in f:
            r = json.loads(line)
            rows[r["step"]] = r
    return rows


def compare_pair(gpu: Path, cpu: Path) -> dict:
    """One method: the largest |GPU − CPU| of the logged train losses and of the eval losses, both sides' finals."""
    g, c = read_rows(gpu), read_rows(cpu)
    steps = sorted(set(g) & set(c))
    d_train = [abs(g[s]["train_loss"] - c[s]["train_loss"]) for s in steps]
    d_eval = [abs(g[s]["eval_loss"] - c[s]["eval_loss"]) for s in steps if "eval_loss" in g[s] and "eval_loss" in c[s]]
    sg, sc = (json.loads((p / "summary.json").read_text()) for p in (gpu, cpu))
    worst = max(d_train + d_eval) if steps else float("inf")
    return {"steps_compared": len(steps), "max_abs_train_loss_diff": max(d_train, default=None),
            "max_abs_eval_loss_diff": max(d_eval, default=None), "eval_rows": len(d_eval),
            "final_eval_loss": {"gpu": sg.get("final_eval_loss"), "cpu": sc.get("final_eval_loss")},
            "final_train_loss": {"gpu": g[steps[-1]]["train_loss"], "cpu": c[steps[-1]]["train_loss"]} if steps else None,
            "params_sha256_equal": sg.get("params_sha256") == sc.get("params_sha256"),
            "resolved": {"gpu": sg.get("resolved"), "cpu": sc.get("resolved")},
            "within_bound": worst <= TOY_LOSS_BOUND}


def compare(out: Path, runs: Path) -> dict:
    """Every toy method run on both sides (runs/<method>-gpu, runs/<method>-cpu) → toy_compare.json; also the
    TF32 run (runs/streaming-gpu-tf32, default matmul precision) against the CPU, when it ran."""
    res = {"bound_nats": TOY_LOSS_BOUND, "precision": "highest (JAX_DEFAULT_MATMUL_PRECISION=highest)", "methods": {}}
    for m in METHODS:
        gpu, cpu = runs / f"{m}-gpu", runs / f"{m}-cpu"
        try:
            res["methods"][m] = compare_pair(gpu, cpu)
        except (OSError, ValueError, KeyError) as e:
            res["methods"][m] = {"error": f"{type(e).__name__}: {e}"[:300], "within_bound": False}
    tf32 = runs / "streaming-gpu-tf32"
    if (tf32 / "summary.json").exists():
        try:
            r = compare_pair(tf32, runs / "streaming-cpu")
            res["streaming_tf32_vs_cpu"] = {k: r[k] for k in ("max_abs_train_loss_diff", "max_abs_eval_loss_diff",
                                                              "final_eval_loss")}
        except (OSError, ValueError, KeyError) as e:
            res["streaming_tf32_vs_cpu"] = {"error": str(e)[:300]}
    (out / "toy_compare.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    for m, r in res["methods"].items():
        print(f"toy {m}: " + (r.get("error") or f"max |Δ train| {r['max_abs_train_loss_diff']:.3g}, max |Δ eval| "
                              f"{r['max_abs_eval_loss_diff']}, final eval {r['final_eval_loss']}, within "
                              f"{TOY_LOSS_BOUND}: {r['within_bound']}"))
    return res


def synthetic_vocab(n: int):
    """Stand-in for diloco.data.get_vocabulary: only the size and special ids are read by the Trainer."""
    class Vocab:
        vocab_size, pad_id, eos_id, unk_id = n, 0, 1, 2
    return lambda spec="byte": Vocab()


def bench_config(spec: str, dry: bool, extra: tuple[str, ...] = ()):
    """The paper's setting of `spec` (or, --dry, its tiny CPU twin), on synthetic tokens of the T5 vocabulary's size."""
    from diloco import trainer
    from diloco.config import load_config

    overrides = ["--config.data=stdlib", "--config.vocab=byte", "--config.steps=100000", *extra]
    cfg = load_config(spec, overrides, check_data=False)
    trainer.get_vocabulary = synthetic_vocab(259 if dry else T5_VOCAB)
    return cfg


def measured_bf16_peak(seconds: float = 1.5) -> float:
    """Best bf16 GEMM rate of this device (8192³ on a GPU, 512³ on CPU): the achievable ceiling."""
    import jax
    import jax.numpy as jnp

    n = 8192 if jax.devices()[0].platform == "gpu" else 512
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        f(a).block_until_ready()
        reps += 1
    return 2 * n ** 3 * reps / (time.perf_counter() - t0)


def compile_inner(tr, state, batch) -> tuple:
    """The inner step compiled ahead of running it: (callable, its memory analysis as dict, cuDNN custom calls)."""
    t0 = time.perf_counter()
    compiled = tr.inner_step().lower(state, batch).compile()
    secs = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    mem = {k: int(getattr(ma, f"{k}_size_in_bytes", 0) or 0) for k in ("argument", "output", "alias", "temp")}
    mem["predicted_peak"] = mem["argument"] + mem["output"] - mem["alias"] + mem["temp"]
    cudnn = sorted(set(re.findall(r'custom_call_target="([^"]*cudnn[^"]*)"', compiled.as_text())))
    return compiled, mem, cudnn, secs


def timed_laps(tr, step, state, toks, t: int, steps: int, laps: int = 5):
    """`steps` inner steps (and the schedule's sends/applies) in `laps` laps: (state, t, per-lap s/step, sync s)."""
    import jax

    per, out, t_sync = max(1, steps // laps), [], 0.0
    if tr.driver is not None:  # the placement's step: with exchange=in_step it carries the parked send (train.py)
        step = tr.placement.step
    for _ in range(laps):
        t0 = time.perf_counter()
        for _ in range(per):
            t += 1
            state, ce, _ = step(state, toks[t % len(toks)])
            float(ce[0])  # the loop reads the loss every step, as train() does
            ts = time.perf_counter()
            if tr.driver is not None:
                state, sent = tr.driver.after_step(state, t)
                if sent or tr.schedule.applies(t):
                    jax.block_until_ready(state)
            t_sync += time.perf_counter() - ts
        jax.block_until_ready(state)
        out.append((time.perf_counter() - t0) / per)
    return state, t, out, t_sync / (per * laps)


def bench(out: Path, spec: str, steps: int, dry: bool) -> dict:
    """bench_one with the resolved plan; if cuDNN's attention fails to compile or run, the error is recorded and
    the setting measured again with XLA's attention (--config.model.attention=xla)."""
    try:
        return bench_one(out, spec, steps, dry)
    except Exception as e:  # noqa: BLE001  (a device check reports every failure and goes on)
        msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:400]
        print(f"bench {spec}: FAILED with the resolved plan: {msg}; again with attention=xla", flush=True)
        return bench_one(out, spec, steps, dry, ("--config.model.attention=xla",), first_error=msg)


def bench_one(out: Path, spec: str, steps: int, dry: bool, extra: tuple[str, ...] = (), first_error: str = "") -> dict:
    """Step time, MFU, peak memory (allocator vs compiled prediction), attention plan of one setting → bench.jsonl."""
    import jax
    import numpy as np

    from diloco.trainer import Trainer

    if dry:
        spec = re.sub(r":35M,", ":tiny,", spec)
    cfg = bench_config(spec, dry, extra)
    tr = Trainer(cfg)
    state = tr.fresh_state()
    rng = np.random.default_rng(0)
    shape = (tr.R, cfg.batch_size // tr.R, cfg.seq_len)
    toks = [jax.device_put(rng.integers(3, 259 if dry else T5_VOCAB, size=shape, dtype=np.int32), tr.batch_sharding)
            for _ in range(4)]
    step, mem, cudnn, compile_s = compile_inner(tr, state, toks[0])
    warm = 2 * cfg.H + 2 if tr.driver is not None else 3  # every fragment sends and applies once (compiles them)
    state, t, _, _ = timed_laps(tr, step, state, toks, 0, warm, laps=1)
    state, t, laps, sync_s = timed_laps(tr, step, state, toks, t, steps)
    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    s = statistics.median(laps)
    m = tr.mcfg
    flops = (6 * tr.n_params + 12 * m.layers * m.d_model * cfg.seq_len) * cfg.batch_size * cfg.seq_len
    peak_dev = BF16_PEAK.get(dev.device_kind)
    measured = measured_bf16_peak()
    row = {"spec": spec, "dry": dry, "device_kind": dev.device_kind, "platform": dev.platform, "params": tr.n_params,
           "replicas": tr.R, "global_batch": cfg.batch_size, "seq_len": cfg.seq_len, "dtype": cfg.model.dtype,
           "resolved": tr.plan.to_json(), "steps_timed": len(laps) * max(1, steps // len(laps)),
           "ms_per_step": 1e3 * s, "ms_per_step_laps": [round(1e3 * x, 3) for x in laps],
           "sync_ms_per_step": 1e3 * sync_s, "tokens_per_s": cfg.batch_size * cfg.seq_len / s,
           "model_flops_per_step": flops, "bf16_peak_datasheet": peak_dev, "bf16_peak_measured": measured,
           "mfu_vs_datasheet": flops / s / peak_dev if peak_dev else None, "mfu_vs_measured": flops / s / measured,
           "inner_compile_s": round(compile_s, 2), "compiled_memory": mem,
           "peak_bytes_in_use": stats.get("peak_bytes_in_use"), "bytes_limit": stats.get("bytes_limit"),
           "cudnn_custom_calls": cudnn, "attention": tr.plan.attention, "overrides": list(extra),
           "error_with_resolved_plan": first_error or None}
    with open(out / "bench.jsonl", "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
    print(f"bench {spec}: {row['ms_per_step']:.2f} ms/step, MFU {row['mfu_vs_measured']:.3f} of measured "
          f"{measured / 1e12:.1f} TFLOP/s, peak in use {row['peak_bytes_in_use']} vs predicted inner "
          f"{mem['predicted_peak']}, attention {tr.plan.attention}, cuDNN calls {cudnn}")
    return row


def verdict_lines(out: Path) -> list[str]:
    """One line per check, from what the phases wrote (a phase that wrote nothing: NOT RUN)."""
    lines = []
    cmp_path = out / "toy_compare.json"
    if cmp_path.exists():
        res = json.loads(cmp_path.read_text())
        for m, r in res["methods"].items():
            ok = "PASS" if r.get("within_bound") else "FAIL"
            lines.append(f"{ok} toy {m} GPU vs CPU (highest precision): " + (r.get("error") or
                         f"max |Δ train loss| {r['max_abs_train_loss_diff']:.3g}, max |Δ eval loss| "
                         f"{r['max_abs_eval_loss_diff']} over {r['steps_compared']} rows (bound {res['bound_nats']})"))
        if "streaming_tf32_vs_cpu" in res:
            lines.append(f"INFO toy streaming TF32 (default precision) vs CPU: {res['streaming_tf32_vs_cpu']}")
    else:
        lines.append("NOT RUN toy GPU vs CPU")
    rows = [json.loads(x) for x in (out / "bench.jsonl").read_text().splitlines()] if (out / "bench.jsonl").exists() else []
    for r in rows:
        pred, peak = r["compiled_memory"]["predicted_peak"], r["peak_bytes_in_use"]
        mfu = f"{r['mfu_vs_datasheet']:.3f}" if r["mfu_vs_datasheet"] else "n/a"
        lines.append(f"INFO bench {r['spec']}: {r['ms_per_step']:.2f} ms/step, MFU {mfu} of datasheet bf16 peak, "
                     f"{r['mfu_vs_measured']:.3f} of measured {r['bf16_peak_measured'] / 1e12:.1f} TFLOP/s; "
                     f"peak in use {peak} B vs compiled inner-step prediction {pred} B "
                     f"({'n/a' if not peak else f'{peak / pred:.2f}x'}); attention {r['attention']}, cuDNN calls "
                     f"{r['cudnn_custom_calls'] or 'none'}; sync {r['sync_ms_per_step']:.2f} ms/step"
                     + (f"; the resolved plan failed first: {r['error_with_resolved_plan']}"
                        if r.get("error_with_resolved_plan") else ""))
        if r["replicas"] > 1:
            lines.append(f"INFO overlap of {r['spec']}: not measurable on one GPU — its {r['replicas']} replicas are "
                         f"one device's vmapped axis, so the exchange is no NCCL collective (nothing to hide); "
                         f"what the DiLoCo machinery costs here: sync {r['sync_ms_per_step']:.2f} ms/step")
    if not rows:
        lines.append("NOT RUN bench")
    return lines


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=("env", "compare", "bench", "verdict"))
    ap.add_argument("out", type=Path)
    ap.add_argument("arg", nargs="?", default="")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dry", action="store_true")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.phase == "env":
        write_env(a.out)
    elif a.phase == "compare":
        res = compare(a.out, Path(a.arg))
        return 0 if all(r.get("within_bound") for r in res["methods"].values()) else 1
    elif a.phase == "bench":
        bench(a.out, a.arg, a.steps, a.dry)
    else:
        lines = verdict_lines(a.out)
        (a.out / "verdict.txt").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
