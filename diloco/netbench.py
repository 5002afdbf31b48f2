"""Real links between replica processes: achieved throughput, and measured compute utilisation.

Run under `diloco launch` (one process per replica), usually inside the throttled namespaces of
scripts/netns.sh:

  scripts/netns.sh up 2 100mbit
  diloco launch --processes 2 --netns --comm_device -- netbench throughput --mb 4
  diloco launch --processes 2 --netns --comm_device -- netbench cu --out cu.json
  diloco netbench sweep --rates 1mbit,10mbit,100mbit --out results/overlap    # root: shapes + launches

`throughput` times the all-gather the outer exchange uses (jax.lax.all_gather over `replica` in
shard_map, gloo over TCP). `cu` runs the toy model's inner steps with each method's exchange and
reports compute utilisation = wall time without exchange / wall time with it (docs/distributed.md).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from diloco import distributed as dist
from diloco.outer.overlap import Timeline

METHODS = ("dp", "diloco", "streaming", "streaming_overlap", "streaming_overlap_fp4")
# method -> (spec overrides of experiments/toy.py:streaming for the DiLoCo family, codec)
FAMILY = {
    "diloco": dict(fragments=1, layers_per_fragment=0, tau=0, codec="bf16"),
    "streaming": dict(fragments=0, layers_per_fragment=3, tau=0, codec="bf16"),
    "streaming_overlap": dict(fragments=0, layers_per_fragment=3, tau=1, codec="bf16"),
    "streaming_overlap_fp4": dict(fragments=0, layers_per_fragment=3, tau=1, codec="e3m0"),
}


# -- meshes and global arrays over the processes -------------------------------------------------
def exchange_devices() -> list:
    """One device per process: the comm device when reserved, else each process's only device."""
    import jax

    return dist.comm_devices() or [min((d for d in jax.devices() if d.process_index == i), key=lambda d: d.id)
                                   for i in range(jax.process_count())]


def replica_mesh(devices: list):
    import jax

    return jax.sharding.Mesh(np.array(devices), ("replica",))


def stack_local(x_local, mesh):
    """(1, …) on this process's mesh device → global (M, …) sharded on `replica`."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    dev = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    x = jax.device_put(x_local, dev)
    shape = (mesh.devices.size,) + tuple(x.shape[1:])
    return jax.make_array_from_single_device_arrays(shape, NamedSharding(mesh, P("replica")), [x])


def barrier(mesh) -> None:
    """Every process reaches this point before any goes on (a tiny blocking all-gather)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    f = jax.jit(jax.shard_map(lambda a: jax.lax.all_gather(a, "replica", tiled=True), mesh=mesh,
                              in_specs=P("replica"), out_specs=P(), check_vma=False))
    f(stack_local(jnp.zeros((1,), jnp.int32), mesh)).block_until_ready()


def local_value(x_global):
    return x_global.addressable_shards[0].data


# -- throughput --------------------------------------------------------------------------------------
def throughput(mb: float, repeats: int = 5) -> dict:
    """Median time of an all-gather of `mb` MB per process over the replica axis."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    mesh = replica_mesh(exchange_devices())
    n = int(mb * 2**20)
    x = stack_local(jnp.ones((1, n), jnp.uint8), mesh)
    gather = jax.jit(jax.shard_map(lambda a: jax.lax.all_gather(a, "replica", tiled=True)[:, :1], mesh=mesh,
                                   in_specs=P("replica"), out_specs=P(), check_vma=False))
    gather(x).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        gather(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return {"mb_per_process": mb, "processes": jax.process_count(), "seconds": times, "median_s": med,
            "mbit_per_s": n * 8 / 1e6 / med}


# -- compute utilisation -------------------------------------------------------------------------------
def _toy_cfg(method: str, scale: str, H: int, batch: int, seq_len: int, steps: int):
    from diloco.config import load_config

    over = {"scale": scale, "replicas": 1, "batch_size": batch, "seq_len": seq_len, "steps": steps, "H": H,
            "alpha": 0.0, "codec_block_size": 256}
    if method == "dp":
        spec = "experiments/toy.py:dp"
    else:
        spec = "experiments/toy.py:streaming"
        over.update(FAMILY[method])
    return load_config(spec, [f"--config.{k}={v}" for k, v in over.items()])


def _batches(seq_len: int, batch: int, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 250, size=(1, batch, seq_len), dtype=np.int32) for _ in range(n)]


def _exchange_fn(codec, n: int, mesh):
    """The OuterSync exchange (encode → all-gather over `replica` → decode, FP32 average)."""
    import jax

    from diloco.outer.sync import OuterSync

    sync = OuterSync(None, codec, None, 0.0, mesh)  # only _exchange is used: frags/tx unused
    return jax.jit(lambda d, k, w: sync._exchange(d, k, w))


_CACHE: dict = {}


class FamilyLoop:
    """Inner steps of one replica on this process; fragment exchanges on the comm devices."""

    def __init__(self, method: str, scale: str, H: int, batch: int, seq_len: int, steps: int, exchange: bool):
        import jax
        import jax.numpy as jnp

        from diloco.outer.codecs import make_codec
        from diloco.train import Trainer

        from diloco.outer.schedule import make_schedule

        self.cfg = c = _toy_cfg(method, scale, H, batch, seq_len, steps)
        dev = (dist.compute_devices() or exchange_devices())[jax.process_index()]
        key = ("trainer", c.fragments, c.layers_per_fragment, scale, batch, seq_len, steps)
        if key not in _CACHE:  # the jitted pieces do not depend on τ or the codec: compile once
            _CACHE[key] = Trainer(c, "/tmp/unused", need_data=False, devices=[dev])
        self.tr = _CACHE[key]
        self.dev, self.exchange, self.jax, self.jnp = dev, exchange, jax, jnp
        self.mesh = replica_mesh(exchange_devices())
        frags = self.tr.sync.frags
        self.schedule = make_schedule(c.H, frags.P, c.tau, 1, "")
        self.codec = make_codec(c.codec, c.codec_block_size, c.codec_rounding)
        self.xfn = [_CACHE.setdefault(("x", key, c.codec, p), _exchange_fn(self.codec, frags.sizes[p], self.mesh))
                    for p in range(frags.P)]
        self.delta = [_CACHE.setdefault(("d", key, p), jax.jit(functools.partial(self._delta, p=p)))
                      for p in range(frags.P)]
        self.inner = self.tr.inner_step_fn()
        self.pending: dict[int, Any] = {}

    def _delta(self, params_R, outer, p: int):
        f = self.tr.sync.frags
        return f.flatten(outer["params"], p)[None] - self.jax.vmap(lambda t: f.flatten(t, p))(params_R)

    def send(self, state, t: int, p: int, ev: Timeline):
        jax, jnp = self.jax, self.jnp
        d = self.delta[p](state["params"], state["outer"])
        if not self.exchange:
            self.pending[p] = d[0]
            return
        key = jax.random.fold_in(jax.random.PRNGKey(1 + jax.process_index()), t * 64 + p)
        args = (stack_local(d, self.mesh), stack_local(key[None], self.mesh),
                stack_local(jnp.ones((1,), jnp.float32), self.mesh))
        ev.add("exchange_start", step=t, fragment=p)
        out = self.xfn[p](*args)
        ev.watch(out, "exchange_end", step=t, fragment=p)
        self.pending[p] = out

    def apply(self, state, t: int, p: int, ev: Timeline):
        avg = self.pending.pop(p)
        if self.exchange:
            w0 = time.perf_counter()
            avg = local_value(avg)
            avg.block_until_ready()
            ev.add("apply_wait", step=t, fragment=p, waited_s=time.perf_counter() - w0)
        avg = self.jax.device_put(avg, self.dev)
        pend = list(state["outer"]["pending"])
        pend[p] = avg
        return self.tr._sync_fn("update", p)({**state, "outer": {**state["outer"], "pending": pend}})

    def precompile(self, batch: np.ndarray) -> None:
        """Compile every jitted piece (and run each exchange once) outside the timed window."""
        jax, tr, P = self.jax, self.tr, self.tr.sync.frags.P
        state, _, _ = self.inner(tr.fresh_state(), jax.device_put(batch, tr.batch_sharding))
        ev = Timeline()
        for p in range(P):
            self.send(state, 0, p, ev)
            state = self.apply(state, 0, p, ev)
            state = tr._sync_fn("merge", p)(state, self.jnp.ones((1,), bool))
        jax.block_until_ready(state)

    def run(self, batches: list[np.ndarray], warmup: int, ev: Timeline) -> float:
        """Wall seconds of the steps after `warmup` (which fill the pipeline)."""
        jax, tr = self.jax, self.tr
        self.precompile(batches[0])
        state = tr.fresh_state()
        sh = tr.batch_sharding
        start, compute = None, []
        for t, b in enumerate(batches, start=1):
            if t == warmup + 1:  # the replicas start the timed window together
                barrier(self.mesh)
                start = time.perf_counter()
            t0 = ev.add("step_start", step=t)
            state, ce_R, _ = self.inner(state, jax.device_put(b, sh))
            np.asarray(ce_R)
            t1 = ev.add("step_end", step=t)
            if start is not None:
                compute.append(t1 - t0)
            for p in self.schedule.sends(t):
                self.send(state, t, p, ev)
            for p in self.schedule.outer_updates(t):
                state = self.apply(state, t, p, ev)
            for p, mask in self.schedule.merges(t):
                state = tr._sync_fn("merge", p)(state, self.jnp.asarray(mask))
        jax.block_until_ready(state)
        return time.perf_counter() - start, compute

    def payload_bytes(self) -> list[int]:
        from diloco.outer.codecs import encoded_nbytes

        return [encoded_nbytes(self.codec, n) for n in self.tr.sync.frags.sizes]


class DPLoop:
    """Data-parallel: every step's gradients (bf16) are averaged across the processes, blocking."""

    def __init__(self, scale: str, batch: int, seq_len: int, steps: int, exchange: bool):
        import jax
        import optax
        from jax.flatten_util import ravel_pytree

        from diloco.outer.codecs import make_codec
        from diloco.train import Trainer

        self.cfg = _toy_cfg("dp", scale, 1, batch, seq_len, steps)
        dev = (dist.compute_devices() or exchange_devices())[jax.process_index()]
        self.tr = Trainer(self.cfg, "/tmp/unused", need_data=False, devices=[dev])
        self.jax, self.dev, self.exchange = jax, dev, exchange
        self.mesh = replica_mesh(exchange_devices())
        tr = self.tr
        shapes = jax.eval_shape(tr._init_params)
        _, self.unravel = ravel_pytree(jax.tree_util.tree_map(lambda x: np.zeros(x.shape, x.dtype), shapes))
        self.n = tr.n_params
        self.xfn = _exchange_fn(make_codec("bf16"), self.n, self.mesh)

        def grad(params, tokens):
            g = jax.grad(lambda p: tr._loss(p, tokens)[0])(params)
            return ravel_pytree(g)[0][None]

        def apply(params, opt, g_n):
            upd, opt = tr.tx.update(self.unravel(g_n), opt, params)
            return optax.apply_updates(params, upd), opt

        self.grad, self.apply = jax.jit(grad), jax.jit(apply, donate_argnums=(0, 1))

    def run(self, batches: list[np.ndarray], warmup: int, ev: Timeline) -> float:
        jax, jnp = self.jax, self.jax.numpy
        if self.exchange:  # compile and run the exchange once outside the timed window
            z = jnp.zeros((1, self.n), jnp.float32)
            k = jax.random.PRNGKey(0)[None]
            self.xfn(stack_local(z, self.mesh), stack_local(k, self.mesh),
                     stack_local(jnp.ones((1,), jnp.float32), self.mesh)).block_until_ready()
        params = jax.device_put(self.tr._init_params(), self.dev)
        opt = jax.jit(self.tr.tx.init)(params)
        key = jax.random.PRNGKey(0)
        start, compute = None, []
        for t, b in enumerate(batches, start=1):
            if t == warmup + 1:
                barrier(self.mesh)
                start = time.perf_counter()
            t0 = ev.add("step_start", step=t)
            g = self.grad(params, jax.device_put(b[0], self.dev))
            g.block_until_ready()
            t1 = time.perf_counter()
            if self.exchange:
                ev.add("exchange_start", step=t, fragment=0)
                out = self.xfn(stack_local(g, self.mesh), stack_local(key[None], self.mesh),
                               stack_local(jnp.ones((1,), jnp.float32), self.mesh))
                g_n = jax.device_put(local_value(out), self.dev)
                g_n.block_until_ready()
                ev.add("exchange_end", step=t, fragment=0)
            else:
                g_n = g[0]
            t2 = time.perf_counter()
            params, opt = self.apply(params, opt, g_n)
            jax.block_until_ready(params)
            t3 = ev.add("step_end", step=t)
            if start is not None:
                compute.append((t1 - t0) + (t3 - t2))
        return time.perf_counter() - start, compute

    def payload_bytes(self) -> list[int]:
        return [2 * self.n]


def make_loop(method: str, scale: str, H: int, batch: int, seq_len: int, steps: int, exchange: bool):
    if method == "dp":
        return DPLoop(scale, batch, seq_len, steps, exchange)
    return FamilyLoop(method, scale, H, batch, seq_len, steps, exchange)


def measure_cu(method: str, scale: str = "toy", H: int = 20, batch: int = 8, seq_len: int = 64,
               rounds: int = 2, dp_steps: int = 12, seed: int = 0, reference: bool = False) -> dict:
    """The same steps without, then with the exchange.

    cu: time in compute (inner steps; DP: gradient + update) / wall time, within the exchange run,
    so that load from other processes on the machine cancels out. cu_ratio: wall without / wall
    with the exchange (sensitive to that load). step_time_s: median compute time of one step."""
    steps = dp_steps if method == "dp" else rounds * H
    warmup = 2 if method == "dp" else H - 1  # timing starts (after a barrier) at the step of the first send
    batches = _batches(seq_len, batch, steps + warmup, seed)
    out: dict[str, Any] = {"method": method, "scale": scale, "H": H, "measured_steps": steps}
    walls, comp = {False: float("nan")}, {False: [float("nan")]}
    loop = make_loop(method, scale, H, batch, seq_len, steps + warmup, True)
    for exchange in (False, True) if reference else (True,):
        loop.exchange = exchange
        ev = Timeline()
        walls[exchange], comp[exchange] = loop.run(batches, warmup, ev)
        if exchange:
            out["events"], out["t0_monotonic"] = ev.rows, ev.t0  # perf_counter: one clock per machine
    out.update(wall_no_exchange_s=walls[False], wall_s=walls[True], compute_s=sum(comp[True]),
               cu=sum(comp[True]) / walls[True], cu_no_exchange=sum(comp[False]) / walls[False],
               cu_ratio=walls[False] / walls[True], step_time_s=float(np.median(comp[True])),
               step_time_no_exchange_s=float(np.median(comp[False])),
               params=loop.tr.n_params, layers=loop.tr.mcfg.layers,
               payload_bytes=loop.payload_bytes(),
               fragments=1 if method == "dp" else loop.tr.sync.frags.P,
               tau=0 if method == "dp" else loop.cfg.tau, codec="bf16" if method == "dp" else loop.cfg.codec)
    return out


# -- sweep over shaped links (root) ------------------------------------------------------------------
REPO = Path(__file__).resolve().parents[1]


def shape_links(m: int, rate: str) -> None:
    subprocess.run([str(REPO / "scripts" / "netns.sh"), "up", str(m), rate], check=True, capture_output=True)


def rate_mbit(rate: str) -> float:
    units = {"kbit": 1e-3, "mbit": 1.0, "gbit": 1e3}
    for u, f in units.items():
        if rate.endswith(u):
            return float(rate[: -len(u)]) * f
    raise ValueError(f"rate {rate!r}: use tc units like 500kbit, 10mbit, 1gbit")


def sweep(rates: list[str], methods: list[str], out: Path, repeats: int, extra: list[str],
          first_repeat: int = 0) -> list[dict]:
    """Appends to OUT/raw.jsonl; repeat r of a rate writes OUT/raw/RATE_rR/."""
    out.mkdir(parents=True, exist_ok=True)
    old = out / "raw.jsonl"
    rows = [json.loads(l) for l in old.read_text().splitlines() if l.strip()] if old.exists() else []
    for rep in range(first_repeat, first_repeat + repeats):
        for rate in rates:
            shape_links(2, rate)
            bench = out / "raw" / f"{rate}_r{rep}"
            bench.mkdir(parents=True, exist_ok=True)
            tp = _launch(["netbench", "throughput", "--mb", str(min(4.0, rate_mbit(rate) / 8)), "--out",
                          str(bench / "throughput.json")], out)
            _launch(["netbench", "cu", "--methods", ",".join(methods), "--out", str(bench), *extra], out)
            for method in methods:
                f = bench / f"{method}.json"
                if f.exists():
                    r = json.loads(f.read_text())
                    r.pop("events", None)
                    r.update(rate=rate, rate_mbit=rate_mbit(rate), repeat=rep)
                    if tp == 0:
                        r["netbench_mbit_per_s"] = json.loads((bench / "throughput.json").read_text())["mbit_per_s"]
                    rows.append(r)
                    print(json.dumps({k: r[k] for k in ("rate", "method", "cu", "step_time_s")}), flush=True)
            (out / "raw.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _launch(argv: list[str], out: Path) -> int:
    cmd = [sys.executable, "-m", "diloco.cli", "launch", "--processes", "2", "--netns", "--comm_device",
           "--logdir", str(out / "raw" / "logs"), "--", *argv]
    return subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          timeout=1800).returncode


# -- the trainer itself over shaped links (diloco launch -- train) ------------------------------------
# variant -> (experiments/toy.py method, overrides, comm device, simulator method, simulator τ)
TRAIN_VARIANTS = {
    "dp": ("dp", dict(replicas=2), False, "dp", 0),
    "diloco": ("streaming", dict(fragments=1, layers_per_fragment=0, tau=0, codec="bf16"), False, "diloco", 0),
    "streaming_fp4_blocking": ("streaming", dict(tau=1), False, "streaming", 0),
    "streaming_fp4_overlap": ("streaming", dict(tau=1), True, "streaming_overlap_fp4", 1),
    "streaming_fp4_overlap_tau5": ("streaming", dict(tau=5), True, "streaming_overlap_fp4", 5),
}


def train_args(variant: str, steps: int, H: int, workdir: Path) -> tuple[list[str], bool]:
    """`diloco train` argv of one variant (toy scale, batch 8 × 64 per replica) and its comm flag."""
    method, over, comm, _, _ = TRAIN_VARIANTS[variant]
    base = dict(seq_len=64, batch_size=16, steps=steps, H=H, log_every=H, eval_every=steps, eval_batches=2,
                checkpoint_every=steps, codec_block_size=256)
    argv = ["train", "--config", f"experiments/toy.py:{method}", "--workdir", str(workdir), "--no_progress"]
    return argv + [f"--config.{k}={v}" for k, v in {**base, **over}.items()], comm


def _payload_bytes(summary: dict, n_params: int) -> list[int]:
    from diloco.outer.codecs import encoded_nbytes, make_codec

    if summary["method"] == "dp":  # the jitted step all-reduces the fp32 gradients as one flat vector
        return [4 * n_params]
    codec = make_codec(summary["codec"], 256)
    return [encoded_nbytes(codec, n) for n in summary["fragment_sizes"]]


def train_row(variant: str, rate: str, workdir: Path, H: int, ref_step_s: float | None,
              achieved_mbit: float | None = None) -> dict:
    """One measured point from a finished run's summary and its per-rank timelines."""
    from diloco.outer.overlap import overlap_report, read_timeline

    summ = json.loads((workdir / "summary.json").read_text())
    warm = 5 if variant == "dp" else 2 * H  # every jit (sends, applies, merges) has run once
    reps = [overlap_report(read_timeline(f), warm) for f in sorted((workdir / "timeline").glob("rank*.jsonl"))]
    _, _, comm, sim_method, sim_tau = TRAIN_VARIANTS[variant]
    row = {"variant": variant, "rate": rate, "rate_mbit": rate_mbit(rate), "comm_device": comm,
           "cu_ranks": [r.get("cu") for r in reps], "step_time_s": float(np.median([r["median_step_s"] for r in reps])),
           "wall_s": float(np.mean([r["wall_s"] for r in reps])), "steps_measured": reps[0]["steps_measured"],
           "exchanges": reps[0]["exchanges"], "checkable": reps[0]["checkable"], "overlapped": reps[0]["overlapped"],
           "apply_wait_s": reps[0]["apply_wait_s"], "final_eval_loss": summ["final_eval_loss"],
           "params_sha256": summ["params_sha256"], "bytes_exchanged_total": summ["bytes_exchanged_total"],
           "method": sim_method, "tau": sim_tau, "H": H if variant != "dp" else 1,
           "fragments": summ["fragments"] or 1, "params": summ["params"], "layers": 6,
           "payload_bytes": _payload_bytes(summ, summ["params"])}
    if variant == "dp":  # the step's all-reduce sits inside the jitted step: compute is the no-link step time
        row["step_time_s"] = ref_step_s
        row["cu"] = row["steps_measured"] * ref_step_s / row["wall_s"]
    else:
        row["cu"] = float(np.mean(row["cu_ranks"]))
    row["sim_cu_at_rate"] = simulated_cu(row, row["rate_mbit"] / 1e3)
    row["netbench_mbit_per_s"] = achieved_mbit
    row["sim_cu_at_measured_throughput"] = simulated_cu(row, achieved_mbit / 1e3) if achieved_mbit else None
    return row


def train_sweep(rates: list[str], variants: list[str], out: Path, steps: int = 120, H: int = 20,
                dp_steps: int = 30) -> list[dict]:
    """Root: for each rate, shape the links and run `diloco launch --netns [--comm_device] -- train` per
    variant; finished runs (summary.json present) are not run again. Rows → OUT/train_cu.jsonl."""
    out.mkdir(parents=True, exist_ok=True)
    ref_dir = out / "runs" / "dp_reference_1proc"
    if not (ref_dir / "summary.json").exists():  # DP's compute time: the same step with no link
        argv, _ = train_args("dp", dp_steps, H, ref_dir)
        argv += ["--config.replicas=1", "--config.batch_size=8"]
        subprocess.run([sys.executable, "-m", "diloco.cli", *argv], cwd=REPO, check=True,
                       env=dict(os.environ, DILOCO_TIMELINE="1"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    from diloco.outer.overlap import overlap_report, read_timeline

    ref_step = overlap_report(read_timeline(ref_dir / "timeline" / "rank0.jsonl"), 5)["median_step_s"]
    rows = []
    for rate in rates:
        shaped = False
        tp = out / "runs" / rate / "throughput.json"  # what the shaped link achieves for the exchange's all-gather
        if not tp.exists():
            shape_links(2, rate)
            shaped = True
            tp.parent.mkdir(parents=True, exist_ok=True)
            _launch(["netbench", "throughput", "--mb", str(min(4.0, rate_mbit(rate) / 8)), "--out", str(tp)], out)
        achieved = json.loads(tp.read_text())["mbit_per_s"] if tp.exists() else None
        for v in variants:
            wd = out / "runs" / rate / v
            if not (wd / "summary.json").exists():
                if not shaped:
                    shape_links(2, rate)
                    shaped = True
                shutil.rmtree(wd, ignore_errors=True)  # a half-finished run: its timeline would be mixed
                argv, comm = train_args(v, dp_steps if v == "dp" else steps, H, wd)
                cmd = [sys.executable, "-m", "diloco.cli", "launch", "--processes", "2", "--netns",
                       *(["--comm_device"] if comm else []), "--logdir", str(out / "runs" / "logs"), "--", *argv]
                rc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    timeout=1800).returncode
                if rc:
                    print(f"{rate} {v}: failed (rc={rc}); logs in {out / 'runs' / 'logs'}", file=sys.stderr)
                    continue
            row = train_row(v, rate, wd, H, ref_step, achieved)
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("rate", "variant", "cu", "sim_cu_at_rate", "overlapped",
                                                  "checkable", "final_eval_loss")}), flush=True)
    from diloco.checkpoint import atomic_write_text

    old = out / "train_cu.jsonl"  # rows of earlier calls (other rates or variants) are kept
    keep = [json.loads(l) for l in old.read_text().splitlines() if l.strip()] if old.exists() else []
    new = {(r["rate"], r["variant"]) for r in rows}
    rows = [r for r in keep if (r["rate"], r["variant"]) not in new] + rows
    atomic_write_text(old, "".join(json.dumps(r) + "\n" for r in rows))
    return rows


def train_report(out: Path):
    """OUT/train_cu.{csv,md,png} and the 90%-CU bandwidths from OUT/train_cu.jsonl."""
    import pandas as pd

    from diloco.checkpoint import atomic_write_text

    rows = [json.loads(l) for l in (out / "train_cu.jsonl").read_text().splitlines() if l.strip()]
    df = pd.DataFrame(rows)
    order = {v: i for i, v in enumerate(TRAIN_VARIANTS)}
    df = df.sort_values(["variant", "rate_mbit"], key=lambda c: c.map(order) if c.name == "variant" else c)
    cols = ["variant", "rate", "netbench_mbit_per_s", "comm_device", "step_time_s", "cu", "sim_cu_at_rate",
            "sim_cu_at_measured_throughput", "wall_s", "overlapped", "checkable", "apply_wait_s", "final_eval_loss",
            "bytes_exchanged_total"]
    df[cols + ["params_sha256"]].round(4).to_csv(out / "train_cu.csv", index=False)
    cross = []
    for v, sub in df.groupby("variant", sort=False):
        cross.append({"variant": v, "measured_mbit_for_90pct": cross90(list(sub.rate_mbit), list(sub.cu)),
                      "simulated_mbit_for_90pct": cross90(list(sub.rate_mbit), list(sub.sim_cu_at_rate)),
                      "simulated_at_achieved_mbit_for_90pct": cross90(
                          list(sub.rate_mbit), list(sub.sim_cu_at_measured_throughput.fillna(0.0))),
                      "distinct_final_params": sub.params_sha256.nunique()})
    cross = pd.DataFrame(cross)
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, r in df.iterrows():
        md.append("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    md += ["", "| variant | tc rate for 90% CU: measured | simulator | simulator at achieved rate "
           "| distinct final params across rates |", "|---|---|---|---|---|"]
    for _, r in cross.iterrows():
        f = lambda x: "never" if x is None or x != x else f"{x:.3g}"
        md.append(f"| {r.variant} | {f(r.measured_mbit_for_90pct)} | {f(r.simulated_mbit_for_90pct)} "
                  f"| {f(r.simulated_at_achieved_mbit_for_90pct)} | {r.distinct_final_params} |")
    atomic_write_text(out / "train_cu.md", "\n".join(md) + "\n")
    _plot_cu(df, "variant", "measured, diloco train", "sim_cu_at_measured_throughput", "simulator at achieved rate",
             "diloco train, 2 replica processes over throttled veth links (toy scale, 2 shared CPU cores)",
             out / "train_cu.png")
    print(df[cols].to_string(index=False))
    print(cross.to_string(index=False))
    return df, cross


# -- CLI -----------------------------------------------------------------------------------------------
def _write(path: str | None, obj: dict) -> None:
    if path and dist.is_primary():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(obj, indent=1) + "\n")
    if dist.is_primary():
        print(json.dumps({k: v for k, v in obj.items() if k != "events"}))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="diloco netbench", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("throughput", help="all-gather of --mb MB per process, under diloco launch")
    a.add_argument("--mb", type=float, default=4.0)
    a.add_argument("--repeats", type=int, default=5)
    a.add_argument("--out", default=None)
    c = sub.add_parser("cu", help="compute utilisation of one method, under diloco launch")
    c.add_argument("--methods", default=",".join(METHODS), help="comma-separated, of " + ", ".join(METHODS))
    c.add_argument("--scale", default="toy")
    c.add_argument("--H", type=int, default=20)
    c.add_argument("--batch", type=int, default=8)
    c.add_argument("--seq_len", type=int, default=64)
    c.add_argument("--rounds", type=int, default=2)
    c.add_argument("--dp_steps", type=int, default=12)
    c.add_argument("--out", default=None, help="a directory: one METHOD.json each")
    c.add_argument("--reference", action="store_true", help="also time the same steps without exchange")
    s = sub.add_parser("sweep", help="root: shape the links (scripts/netns.sh) and run cu at each rate")
    s.add_argument("--rates", default="1mbit,3mbit,10mbit,30mbit,100mbit,300mbit,1gbit")
    s.add_argument("--methods", default=",".join(METHODS))
    s.add_argument("--repeats", type=int, default=1)
    s.add_argument("--first_repeat", type=int, default=0, help="index of the first repeat (to add repeats later)")
    s.add_argument("--out", default="results/overlap")
    r = sub.add_parser("report", help="table + plot of a sweep beside the simulator's prediction")
    r.add_argument("--out", default="results/overlap")
    ts = sub.add_parser("trainsweep", help="root: `diloco train` itself over shaped links, per rate and variant")
    ts.add_argument("--rates", default="3mbit,10mbit,30mbit,100mbit,1gbit")
    ts.add_argument("--variants", default=",".join(TRAIN_VARIANTS), help="of " + ", ".join(TRAIN_VARIANTS))
    ts.add_argument("--steps", type=int, default=120)
    ts.add_argument("--H", type=int, default=20)
    ts.add_argument("--dp_steps", type=int, default=30, help="DP exchanges every step: fewer steps at low rates")
    ts.add_argument("--out", default="results/overlap/trainer")
    tl = sub.add_parser("timeline", help="overlap report of a run's timeline/rank*.jsonl (diloco train)")
    tl.add_argument("workdir")
    tl.add_argument("--warmup", type=int, default=0, help="steps to leave out of the CU window (0: up to the first send)")
    h = sub.add_parser("hlo", help="collectives of a compiled send + inner step (XLA_FLAGS=…device_count=2)")
    h.add_argument("--out", default=None)
    args, extra = ap.parse_known_args(argv)
    if args.cmd == "hlo":
        print(json.dumps(combined_step_collectives(Path(args.out) if args.out else None)))
        return 0
    if args.cmd in ("sweep", "trainsweep") and os.geteuid() != 0:
        print(f"diloco netbench {args.cmd}: needs root to shape links (scripts/netns.sh: ip netns, tc); "
              "run it with sudo", file=sys.stderr)
        return 2
    if args.cmd == "trainsweep":
        bad = [v for v in args.variants.split(",") if v not in TRAIN_VARIANTS]
        if bad:
            print(f"diloco netbench: unknown variant(s) {bad}; valid: {', '.join(TRAIN_VARIANTS)}", file=sys.stderr)
            return 2
        train_sweep(args.rates.split(","), args.variants.split(","), Path(args.out), args.steps, args.H,
                    args.dp_steps)
        train_report(Path(args.out))
        return 0
    if args.cmd == "timeline":
        from diloco.outer.overlap import overlap_report, read_timeline

        files = sorted(Path(args.workdir, "timeline").glob("rank*.jsonl"))
        if not files:
            print(f"diloco netbench: no timeline under {args.workdir}/timeline (multi-process runs write one; "
                  "DILOCO_TIMELINE=1 for a single process)", file=sys.stderr)
            return 2
        for f in files:
            print(json.dumps({"rank": f.stem, **overlap_report(read_timeline(f), args.warmup)}))
        return 0
    if args.cmd == "report":
        g, cross = report(Path(args.out))
        print(g.to_string(index=False))
        print(cross.to_string(index=False))
        return 0
    if args.cmd == "sweep":
        sweep(args.rates.split(","), args.methods.split(","), Path(args.out), args.repeats, extra, args.first_repeat)
        return 0
    if dist.num_processes() < 2:
        print("diloco netbench: run under `diloco launch --processes 2 [--netns] [--comm_device] -- netbench …`",
              file=sys.stderr)
        return 2
    dist.initialize_from_env()
    if args.cmd == "throughput":
        _write(args.out, throughput(args.mb, args.repeats))
    else:
        for m in args.methods.split(","):
            if m not in METHODS:
                print(f"diloco netbench: unknown method {m!r}; valid: {', '.join(METHODS)}", file=sys.stderr)
                return 2
            r = measure_cu(m, args.scale, args.H, args.batch, args.seq_len, args.rounds, args.dp_steps,
                           reference=args.reference)
            _write(f"{args.out}/{m}.json" if args.out else None, r)
            if args.out and not dist.is_primary():  # every rank's timeline, for the replicas' skew
                import jax

                Path(args.out).mkdir(parents=True, exist_ok=True)  # rank 0 may not have made it yet
                Path(f"{args.out}/{m}.rank{jax.process_index()}.json").write_text(json.dumps(r))
    return 0


# -- report: measured CU beside the simulator's prediction -------------------------------------------
def simulated_cu(row: dict, gbit_per_s: float, overhead_s: float = 0.0) -> float:
    """The simulator for the same model (layers, params), measured step time, bytes and τ;
    `overhead_s` per exchange is spread over its layers as the simulator's per-node latency."""
    import dataclasses

    from diloco.simulate import PHYSICAL, Model, compute_utilisation, make_method

    model = Model("toy", layers=row["layers"], params=float(row["params"]), step_time_s=row["step_time_s"])
    bits = 8.0 * sum(row["payload_bytes"]) / row["params"]
    method = make_method(row["method"], row["layers"], h=row["H"] if row["method"] != "dp" else 1,
                         fragments=row["fragments"], tau=row["tau"], bits=bits)
    layers_per_exchange = max(1, row["layers"] // max(1, row["fragments"]))
    a = dataclasses.replace(PHYSICAL, latency_s=overhead_s / layers_per_exchange)
    return compute_utilisation(model, method, gbit_per_s, a)


def exchange_overhead_s(raw: Path, method: str) -> float | None:
    """Median exchange duration minus its wire time at the fastest rate swept: the fixed cost of
    one exchange here (encode/decode on a shared CPU, dispatch, gloo, the two processes' skew)."""
    best = None
    for d in raw.glob("*_r*"):
        f, tp = d / f"{method}.json", d / "throughput.json"
        if f.exists() and tp.exists():
            mbit = json.loads(tp.read_text())["mbit_per_s"]
            if best is None or mbit > best[0]:
                best = (mbit, f)
    if best is None:
        return None
    r = json.loads(best[1].read_text())
    starts = {(e["step"], e["fragment"]): e["t"] for e in r["events"] if e["kind"] == "exchange_start"}
    durs = [e["t"] - starts[(e["step"], e["fragment"])] for e in r["events"]
            if e["kind"] == "exchange_end" and (e["step"], e["fragment"]) in starts and e["step"] > 0]
    wire = 8 * float(np.mean(r["payload_bytes"])) / (best[0] * 1e6)
    return max(0.0, float(np.median(durs)) - wire) if durs else None


def cross90(rates: list[float], cus: list[float], target: float = 0.9) -> float | None:
    """Smallest rate where CU reaches `target`, interpolated in log(rate); None if never."""
    pts = sorted(zip(rates, cus))
    for (r0, c0), (r1, c1) in zip([(None, None)] + pts[:-1], pts):
        if c1 >= target:
            if r0 is None or c0 is None:
                return r1
            f = (target - c0) / (c1 - c0)
            return float(np.exp(np.log(r0) + f * (np.log(r1) - np.log(r0))))
    return None


def report(out: Path) -> "Any":
    import pandas as pd

    rows = [json.loads(l) for l in (out / "raw.jsonl").read_text().splitlines() if l.strip()]
    df = pd.DataFrame(rows)
    g = df.groupby(["method", "rate", "rate_mbit"], as_index=False).agg(
        cu=("cu", "median"), cu_ratio=("cu_ratio", "median"), cu_no_exchange=("cu_no_exchange", "median"),
        step_time_s=("step_time_s", "median"), netbench_mbit_per_s=("netbench_mbit_per_s", "median"),
        repeats=("cu", "size"))
    first = {m: next(r for r in rows if r["method"] == m) for m in g["method"].unique()}
    over = {m: exchange_overhead_s(out / "raw", m) or 0.0 for m in first}
    sim, sim_eff, sim_over = [], [], []
    for _, r in g.iterrows():
        base = {**first[r["method"]], "step_time_s": r["step_time_s"]}
        sim.append(simulated_cu(base, r["rate_mbit"] / 1e3))
        eff = r["netbench_mbit_per_s"] if r["netbench_mbit_per_s"] == r["netbench_mbit_per_s"] else r["rate_mbit"]
        sim_eff.append(simulated_cu(base, eff / 1e3))
        sim_over.append(simulated_cu(base, eff / 1e3, over[r["method"]]))
    g["sim_cu_at_rate"], g["sim_cu_at_measured_throughput"] = sim, sim_eff
    g["exchange_overhead_s"] = [over[m] for m in g["method"]]
    g["sim_cu_throughput_and_overhead"] = sim_over
    order = {m: i for i, m in enumerate(METHODS)}
    g = g.sort_values(["method", "rate_mbit"], key=lambda c: c.map(order) if c.name == "method" else c)
    g.round(4).to_csv(out / "cu_vs_bandwidth.csv", index=False)
    cross = []
    for m, sub in g.groupby("method", sort=False):
        cross.append({"method": m, "measured_mbit_for_90pct": cross90(list(sub.rate_mbit), list(sub.cu)),
                      "simulated_mbit_for_90pct": cross90(list(sub.rate_mbit), list(sub.sim_cu_at_rate)),
                      "simulated_with_overhead_mbit_for_90pct":
                          cross90(list(sub.rate_mbit), list(sub.sim_cu_throughput_and_overhead))})
    pd.DataFrame(cross).to_csv(out / "bandwidth_for_90pct.csv", index=False)
    cols = ["method", "rate", "netbench_mbit_per_s", "step_time_s", "cu", "sim_cu_at_rate",
            "sim_cu_at_measured_throughput", "sim_cu_throughput_and_overhead", "repeats"]
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, r in g.iterrows():
        md.append("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    (out / "cu_vs_bandwidth.md").write_text("\n".join(md) + "\n")
    _plot(g, out / "cu_vs_bandwidth.png")
    return g, pd.DataFrame(cross)


def _plot(g, path: Path) -> None:
    _plot_cu(g, "method", "measured", "sim_cu_throughput_and_overhead", "sim., achieved rate + overhead",
             "toy model, 2 replica processes over throttled veth links (2 shared CPU cores)", path)


def _plot_cu(df, key: str, measured: str, dotted: str, dotted_label: str, title: str, path: Path) -> None:
    """Measured CU (solid), the simulator at the tc rate (dashed) and a second simulator curve (dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.8))
    for i, (m, sub) in enumerate(df.groupby(key, sort=False)):
        c = f"C{i}"
        ax.plot(sub.rate_mbit, sub.cu, "o-", color=c, label=f"{m} ({measured})")
        ax.plot(sub.rate_mbit, sub.sim_cu_at_rate, "--", color=c, alpha=0.7, label=f"{m} (simulator)")
        ax.plot(sub.rate_mbit, sub[dotted], ":", color=c, alpha=0.7, label=f"{m} ({dotted_label})")
    ax.set_xscale("log")
    ax.set_xlabel("link rate per replica (tc tbf), Mbit/s")
    ax.set_ylabel("compute utilisation")
    ax.axhline(0.9, color="grey", lw=0.5)
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6.5, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- what XLA:CPU makes of a combined step (send + next inner step in one program) ----------------
def combined_step_collectives(path: Path | None = None) -> dict:
    """Compile fragment 0's send fused with the next inner step on a (replica=2) mesh; count the
    collective ops of the compiled HLO (async ones appear as *-start / *-done pairs).
    Needs two devices: run with XLA_FLAGS=--xla_force_host_platform_device_count=2."""
    import re
    from collections import Counter

    import jax
    import jax.numpy as jnp

    from diloco.config import load_config
    from diloco.train import Trainer

    flat = {"scale": "tiny", "seq_len": 32, "batch_size": 4, "H": 4, "layers_per_fragment": 1, "tau": 1}
    cfg = load_config("experiments/toy.py:streaming", [f"--config.{k}={v}" for k, v in flat.items()])
    tr = Trainer(cfg, "/tmp/unused", need_data=False, devices=jax.devices()[:2])
    step = tr.inner_step_fn()._fun  # the Python step the trainer jits

    def combined(state, toks, key):
        outer = tr.sync.send(state["params"], state["outer"], 0, key, jnp.ones(2))
        return step({**state, "outer": outer}, toks)

    toks = jax.ShapeDtypeStruct((2, 2, 32), jnp.int32, sharding=tr.batch_sharding)
    txt = jax.jit(combined).lower(tr.abstract_state(), toks, jax.random.PRNGKey(0)).compile().as_text()
    pat = r"(all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)(-start|-done)?"
    lines = [l.strip() for l in txt.splitlines() if re.search(r"= \S+ " + pat + r"\(", l)]
    ops = Counter(re.search(r"= \S+ (" + pat + r")\(", l).group(1) for l in lines)
    if path is not None:
        path.write_text(f"# collectives in the compiled HLO of (send of fragment 0 + next inner step), "
                        f"backend={jax.default_backend()}, jax {jax.__version__}\n"
                        + "".join(l[:300] + "\n" for l in lines))
    return {"backend": jax.default_backend(), "mesh": dict(tr.mesh.shape), "ops": dict(ops)}


def timeline_plot(run_json: Path, path: Path, window: tuple[int, int] | None = None) -> None:
    """Gantt of one `netbench cu` run: inner steps (compute device) vs exchanges (comm device)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = json.loads(Path(run_json).read_text())
    ev = r["events"]
    st: dict[int, dict] = {}
    for e in ev:
        if e["kind"] in ("step_start", "step_end"):
            st.setdefault(e["step"], {})[e["kind"]] = e["t"]
    starts = {(e["step"], e["fragment"]): e["t"] for e in ev if e["kind"] == "exchange_start"}
    ends = {(e["step"], e["fragment"]): e["t"] for e in ev if e["kind"] == "exchange_end"}
    sends = sorted(k for k in starts if k in ends and k[0] > r["H"])
    lo, hi = window or (sends[0][0] - 2, sends[min(2, len(sends) - 1)][0] + 3)
    fig, ax = plt.subplots(figsize=(9, 2.6))
    for s, v in st.items():
        if lo <= s <= hi and len(v) == 2:
            ax.barh(1, v["step_end"] - v["step_start"], left=v["step_start"], color="C0", edgecolor="white")
            ax.text((v["step_start"] + v["step_end"]) / 2, 1, str(s), ha="center", va="center", fontsize=6, color="w")
    for k in sends:
        if lo <= k[0] <= hi:
            ax.barh(0, ends[k] - starts[k], left=starts[k], color=f"C{1 + k[1]}", edgecolor="black")
            ax.text(starts[k], -0.45, f"send p{k[1]} @t={k[0]}", fontsize=6)
    for e in ev:
        if e["kind"] == "apply_wait" and lo <= e["step"] <= hi:
            ax.axvline(e["t"], color="red", lw=0.8)
    ax.set_yticks([0, 1], ["exchange\n(comm device)", "inner steps\n(compute device)"])
    ax.set_xlabel("seconds (process 0); red: apply of a fragment (waits only if its exchange has not ended)")
    what = "the exchange runs during the next inner step" if r["tau"] else "the apply waits for the exchange"
    ax.set_title(f"{r['method']} (tau={r['tau']}, codec {r['codec']}): {what}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
