"""Training-step benchmark: ms/step, tokens/s, peak memory and MFU of DP vs DiLoCo vs Streaming.

    python benchmarks/bench_train.py [--scale toy] [--steps 60] [--H 30] [--rounds 10] [--json out.json]

All methods run in one process, interleaved in rounds (--rounds 0: each in its own subprocess, one
after the other, for a clean per-method peak RSS), at equal global batch, on synthetic
tokens (the data pipeline is benchmarked separately), after a warm-up that triggers every
compilation (inner step and every fragment's send/update/merge). MFU is model FLOPs/s over the
matmul peak measured on this machine in the same run (float32 GEMM, best of several sizes).
"outer cost" is the time spent in the schedule's syncs (send, outer update, merge; blocked on)
over the time of the inner steps: what the DiLoCo machinery adds to each step.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

METHODS = {
    "dp": {},
    "diloco": {"H": None},
    "streaming": {"H": None, "layers_per_fragment": 3, "tau": 1, "alpha": 0.5, "codec": "e3m0"},
}


def matmul_peak_flops(seconds: float = 3.0) -> float:
    import jax
    import jax.numpy as jnp

    best = 0.0
    for n in (512, 1024, 2048):
        a = jnp.ones((n, n), jnp.float32)
        f = jax.jit(lambda x: x @ x)
        f(a).block_until_ready()
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 3:
            f(a).block_until_ready()
            reps += 1
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - t0))
    return best


class Bench:
    """One method's Trainer, state and batches, warmed up (every compilation done)."""

    def __init__(self, method: str, scale: str, steps: int, H: int, seq_len: int, batch: int):
        import jax
        import numpy as np

        from diloco.config import load_config
        from diloco.trainer import Trainer

        kw = {k: (H if v is None else v) for k, v in METHODS[method].items()}
        kw.update(scale=scale, seq_len=seq_len, batch_size=batch, steps=10**6)
        cfg = load_config(f"experiments/toy.py:{method}", [f"--config.{k}={v}" for k, v in kw.items()])
        self.method, self.scale, self.batch, self.seq_len = method, scale, batch, seq_len
        self.tr = tr = Trainer(cfg)
        self.state = tr.fresh_state()
        self.inner = tr.inner_step()
        rng = np.random.default_rng(0)
        self.toks = [jax.device_put(rng.integers(2, 250, size=(tr.R, batch // tr.R, seq_len), dtype=np.int32),
                                    tr.batch_sharding) for _ in range(8)]
        self.t = 0
        self.steps = self.syncs = 0
        self.wall = self.cpu = self.t_sync = 0.0
        self.laps: list[float] = []
        for _ in range(2 * H + 2):  # warm-up: every fragment sends and applies once (compiles them all)
            self.t += 1
            self.state, ce, _ = self.inner(self.state, self.toks[self.t % 8])
            self.state, _ = tr.driver.after_step(self.state, self.t) if tr.driver else (self.state, [])
        jax.block_until_ready(self.state)

    def run(self, steps: int) -> None:
        import jax

        tr = self.tr
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            self.t += 1
            self.state, ce, _ = self.inner(self.state, self.toks[self.t % 8])
            float(ce[0])  # the loop reads the loss every step, as train() does (this also ends the step)
            ts = time.perf_counter()
            self.state, sent = tr.driver.after_step(self.state, self.t) if tr.driver else (self.state, [])
            if sent or (tr.schedule and tr.schedule.applies(self.t)):
                jax.block_until_ready(self.state)
            self.t_sync += time.perf_counter() - ts
            self.syncs += len(sent)
        jax.block_until_ready(self.state)
        dt = time.perf_counter() - t0
        self.wall += dt
        self.cpu += time.process_time() - c0
        self.steps += steps
        self.laps.append(dt / steps)

    def row(self) -> dict:
        import statistics

        m, tr = self.tr.mcfg, self.tr
        flops_per_token = 6 * tr.n_params + 12 * m.layers * m.d_model * self.seq_len
        ms = statistics.median(self.laps)
        return {"method": self.method, "scale": self.scale, "params": tr.n_params, "steps": self.steps,
                "syncs": self.syncs, "ms_per_step": 1e3 * ms, "cpu_ms_per_step": 1e3 * self.cpu / self.steps,
                "sync_ms_per_step": 1e3 * self.t_sync / self.steps,
                "outer_overhead": self.t_sync / max(self.wall - self.t_sync, 1e-9),
                "tokens_per_s": self.batch * self.seq_len / ms,
                "model_flops_per_s": flops_per_token * self.batch * self.seq_len / ms,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_one(method: str, scale: str, steps: int, H: int, seq_len: int, batch: int) -> dict:
    """One method alone in this process (for its peak RSS)."""
    b = Bench(method, scale, steps, H, seq_len, batch)
    b.run(steps)
    return b.row()


def run_interleaved(methods: list[str], scale: str, steps: int, H: int, seq_len: int, batch: int,
                    rounds: int) -> list[dict]:
    """All methods in this process, timed in rounds of steps/rounds steps each in a rotating order, so
    machine noise hits them alike; ms/step is the median over rounds."""
    benches = [Bench(m, scale, steps, H, seq_len, batch) for m in methods]
    per = max(1, steps // rounds)
    for r in range(rounds):
        for b in benches[r % len(benches):] + benches[:r % len(benches)]:
            b.run(per)
    return [b.row() for b in benches]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", default="toy")
    ap.add_argument("--steps", type=int, default=60, help="timed steps per method (after warm-up)")
    ap.add_argument("--H", type=int, default=30)
    ap.add_argument("--seq_len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--methods", default="dp,diloco,streaming")
    ap.add_argument("--json", default="")
    ap.add_argument("--rounds", type=int, default=10, help="interleaved rounds (0: one subprocess per method, "
                    "one after the other; gives each method's own peak RSS)")
    ap.add_argument("--_one", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._one:
        print(json.dumps(run_one(a._one, a.scale, a.steps, a.H, a.seq_len, a.batch)))
        return 0
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    rows = []
    if a.rounds:
        rows = run_interleaved(a.methods.split(","), a.scale, a.steps, a.H, a.seq_len, a.batch, a.rounds)
    for method in ([] if a.rounds else a.methods.split(",")):
        cmd = [sys.executable, __file__, "--_one", method, "--scale", a.scale, "--steps", str(a.steps),
               "--H", str(a.H), "--seq_len", str(a.seq_len), "--batch", str(a.batch)]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if out.returncode:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"  {method}: {rows[-1]['ms_per_step']:.1f} ms/step", file=sys.stderr)
    peak = matmul_peak_flops()
    base = next((r for r in rows if r["method"] == "dp"), rows[0])
    print(f"scale={a.scale} params={base['params']:,} global batch={a.batch}x{a.seq_len} H={a.H} "
          f"matmul peak={peak / 1e9:.1f} GFLOP/s (measured)")
    print(("interleaved in one process, median of %d rounds; peak RSS is the process's" % a.rounds) if a.rounds
          else "one subprocess per method")
    print(f"{'method':<10} {'ms/step':>8} {'vs dp':>7} {'CPU vs dp':>9} {'sync ms/step':>12} {'outer cost':>10} "
          f"{'tokens/s':>9} {'MFU':>6} {'peak RSS MB':>11} {'syncs':>5}")
    for r in rows:
        r["mfu"] = r["model_flops_per_s"] / peak
        r["ms_vs_dp"] = r["ms_per_step"] / base["ms_per_step"]
        r["rss_vs_dp"] = r["peak_rss_mb"] / base["peak_rss_mb"]
        r["cpu_vs_dp"] = r["cpu_ms_per_step"] / base["cpu_ms_per_step"]
        print(f"{r['method']:<10} {r['ms_per_step']:>8.1f} {r['ms_vs_dp']:>6.2f}x {r['cpu_vs_dp']:>8.2f}x "
              f"{r['sync_ms_per_step']:>12.2f} "
              f"{100 * r['outer_overhead']:>9.2f}% {r['tokens_per_s']:>9,.0f} "
              f"{100 * r['mfu']:>5.1f}% {r['peak_rss_mb']:>11.0f} {r['syncs']:>5}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"matmul_peak_flops": peak, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
