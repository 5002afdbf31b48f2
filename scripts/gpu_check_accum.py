"""Device check of gradient accumulation and the memory preflight on one NVIDIA GPU (issue #41), the phases of
scripts/gpu_check_accum.sh, each time-boxed there.

    python3 scripts/gpu_check_accum.py accum  OUT [--dry]   accum_steps 1 vs 2 vs 4 on the GPU          → OUT/accum.json
    python3 scripts/gpu_check_accum.py refuse OUT [--dry]   1B Streaming, 2 replicas on the one GPU     → OUT/refuse.json

`accum`: the toy Streaming spec (float32, 2 replicas vmapped on the device) at JAX_DEFAULT_MATMUL_PRECISION=highest,
three inner steps on fixed tokens (padding in some rows) with accum_steps 1, 2 and 4: the largest |Δ cross-entropy|
and |Δ parameter| against accum_steps=1 (bound ACCUM_BOUND); then the paper's 35M DP step (bf16) with accum_steps 4
and 1: the compiled prediction and the allocator's peak of each (4 first: the allocator's peak only grows).
`refuse`: the paper's 1B Streaming spec with both replicas on this GPU (T5-sized synthetic vocabulary): the plan
(`auto` remat against the device's real bytes_limit), the inner step compiled from shapes (nothing allocated), and
the preflight's one line (devmem.check_fits_device) — expected: refused; then accum_steps=16 compiled, checked, and
when it fits one step run: the allocator's peak against the prediction. --dry: the CPU path, tiny scales, the limit
half the compiled peak.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, not an installed diloco
import gpu_check  # noqa: E402  (bench_config, compile_inner: the same settings as the device check)

ACCUM_BOUND = 1e-5  # |Δ| of cross-entropy and parameters after 3 steps, float32 at highest precision


def toy_runs(dry: bool) -> dict:
    import jax
    import numpy as np

    from diloco import trainer
    from diloco.config import load_config
    from diloco.trainer import Trainer

    trainer.get_vocabulary = gpu_check.synthetic_vocab(259)  # the byte vocabulary's size, without seqio
    rng = np.random.default_rng(0)
    toks = [rng.integers(2, 250, size=(16, 64), dtype=np.int32) for _ in range(3)]
    toks[0][:5, 20:] = 0
    runs = {}
    for k in (1, 2, 4):
        cfg = load_config("experiments/toy.py:streaming", ["--config.batch_size=16", "--config.seq_len=64",
                                                           f"--config.accum_steps={k}"] +
                          (["--config.scale=tiny"] if dry else []), check_data=False)
        tr = Trainer(cfg, devices=jax.devices()[:1])
        st, step, ces = tr.fresh_state(), tr.inner_step(), []
        for b in toks:
            st, ce, _ = step(st, jax.device_put(b.reshape(tr.R, -1, 64), tr.batch_sharding))
            ces.append(np.asarray(ce))
        runs[k] = (np.stack(ces), [np.asarray(x) for x in jax.tree_util.tree_leaves(st.params)])
    res = {}
    for k in (2, 4):
        res[f"accum{k}_vs_1"] = {
            "max_abs_ce_diff": float(np.max(np.abs(runs[k][0] - runs[1][0]))),
            "max_abs_param_diff": max(float(np.max(np.abs(a - b))) for a, b in zip(runs[k][1], runs[1][1]))}
        res[f"accum{k}_vs_1"]["within_bound"] = all(v <= ACCUM_BOUND for v in res[f"accum{k}_vs_1"].values())
    return res


def memory_35m(dry: bool) -> list[dict]:
    import jax
    import numpy as np

    from diloco.trainer import Trainer

    rows = []
    for k in (4, 1):
        cfg = gpu_check.bench_config("experiments/c4_scaling.py:" + ("tiny" if dry else "35M") + ",dp", dry,
                                     (f"--config.accum_steps={k}",))
        tr = Trainer(cfg)
        state = tr.fresh_state()
        b = np.random.default_rng(0).integers(3, 259 if dry else gpu_check.T5_VOCAB,
                                              size=(1, cfg.batch_size, cfg.seq_len), dtype=np.int32)
        batch = jax.device_put(b, tr.batch_sharding)
        step, mem, _, secs = gpu_check.compile_inner(tr, state, batch)
        t0 = time.perf_counter()
        for _ in range(3):
            state, ce, _ = step(state, batch)
        jax.block_until_ready(state)
        stats = jax.devices()[0].memory_stats() or {}
        rows.append({"accum_steps": k, "remat": tr.plan.remat, "predicted_peak": mem["predicted_peak"],
                     "peak_bytes_in_use": stats.get("peak_bytes_in_use"), "ce_step3": float(ce[0]),
                     "ms_per_step": 1e3 * (time.perf_counter() - t0) / 3, "compile_s": round(secs, 2)})
        del state, step
    return rows


def accum(out: Path, dry: bool) -> int:
    res = {"toy_streaming_highest": toy_runs(dry)}
    print("accum toy:", json.dumps(res["toy_streaming_highest"]), flush=True)
    res["dp_35m_bf16"] = memory_35m(dry)
    print("accum 35M:", json.dumps(res["dp_35m_bf16"]), flush=True)
    (out / "accum.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0 if all(r["within_bound"] for r in res["toy_streaming_highest"].values()) else 1


class HalfLimit:
    """--dry: a GPU stand-in whose pool is half the compiled peak (so the preflight has something to refuse)."""
    platform = "gpu"

    def __init__(self, limit: int):
        self.limit = limit

    def memory_stats(self):
        return {"bytes_limit": self.limit}


def one_spec(k: int, dry: bool, limit: int | None) -> dict:
    """1B Streaming (M = 2 on the one device) with accum_steps=k: plan, compiled peak, the preflight's answer."""
    import jax

    from diloco import devmem
    from diloco.errors import ConfigError
    from diloco.trainer import Trainer

    spec = "experiments/c4_scaling.py:" + ("tiny" if dry else "1B") + ",streaming_ovl_fp4_h30"
    cfg = gpu_check.bench_config(spec, dry, (f"--config.accum_steps={k}",))
    tr = Trainer(cfg, devices=jax.devices()[:1])
    state = tr.abstract_state()
    batch = jax.ShapeDtypeStruct((tr.R, cfg.batch_size // tr.R, cfg.seq_len), "int32", sharding=tr.batch_sharding)
    t0 = time.perf_counter()
    compiled = tr.inner_step().lower(state, batch).compile()
    peak = devmem.program_peak(compiled)
    device = jax.devices()[0] if limit is None else HalfLimit(limit or peak // 2)
    row = {"accum_steps": k, "replicas": tr.R, "resolved": tr.plan.to_json(), "compile_s": round(time.perf_counter()
                                                                                                - t0, 1),
           "compiled_peak": peak, "bytes_limit": device.memory_stats().get("bytes_limit")}
    try:
        row["fits"] = devmem.check_fits_device({"inner": peak}, tr, device)
        row["refused"] = None
    except ConfigError as e:
        row["refused"], row["fits"] = str(e), None
    print(f"refuse accum_steps={k}: peak {peak / 2**30:.1f} GiB, limit {row['bytes_limit'] / 2**30:.1f} GiB, "
          f"remat {tr.plan.remat}: " + (row["refused"] or "fits"), flush=True)
    row["trainer"] = tr
    return row


def refuse(out: Path, dry: bool) -> int:
    import jax
    import numpy as np

    first = one_spec(1, dry, 0 if dry else None)
    res = {"1B_M2_one_gpu": {k: v for k, v in first.items() if k != "trainer"}}
    (out / "refuse.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    acc = one_spec(16 if not dry else 2, dry, first["compiled_peak"] if dry else None)  # dry: the limit k=1 needs
    tr = acc.pop("trainer")
    if acc["fits"]:  # run it: the allocator's peak against the compiled prediction
        cfg = tr.cfg
        state = tr.fresh_state()
        b = np.random.default_rng(0).integers(3, 259 if dry else gpu_check.T5_VOCAB,
                                              size=(tr.R, cfg.batch_size // tr.R, cfg.seq_len), dtype=np.int32)
        t0 = time.perf_counter()
        state, ce, fin = tr.inner_step()(state, jax.device_put(b, tr.batch_sharding))
        jax.block_until_ready(state)
        acc["first_step_s"] = round(time.perf_counter() - t0, 2)
        acc["ce"] = [float(x) for x in ce]
        acc["peak_bytes_in_use"] = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
        print(f"refuse accum run: first step {acc['first_step_s']} s (compile included), ce {acc['ce']}, peak in use "
              f"{acc['peak_bytes_in_use']} vs compiled {acc['compiled_peak']}", flush=True)
    res["1B_M2_one_gpu_accum"] = acc
    (out / "refuse.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    return 0 if first["refused"] and acc["fits"] else 1


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=("accum", "refuse"))
    ap.add_argument("out", type=Path)
    ap.add_argument("--dry", action="store_true")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    return accum(a.out, a.dry) if a.phase == "accum" else refuse(a.out, a.dry)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
