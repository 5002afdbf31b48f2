"""Real links between replica processes: achieved throughput, and measured compute utilisation.

Run under `diloco launch` (one process per replica), usually inside the throttled namespaces of
scripts/netns.sh:

  scripts/netns.sh up 2 100mbit
  diloco launch --processes 2 --netns --comm_device -- netbench throughput --mb 4
  diloco netbench sweep --rates 1mbit,10mbit,100mbit --out results/overlap/trainer   # root: shapes + launches

`throughput` times the all-gather the outer exchange uses (jax.lax.all_gather over `replica` in
shard_map, gloo over TCP). `sweep` runs `diloco train` itself, per rate and variant, and reads compute
utilisation off the runs' timelines (docs/distributed.md); `report` sets it beside the simulator.
Nothing here trains: the measurements are of the trainer.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

from diloco import distributed as dist
from diloco.data.snapshot import SAFE_EXTRACT
from diloco.outer import methods

REPO = Path(__file__).resolve().parents[1]

# -- throughput --------------------------------------------------------------------------------------
def throughput(mb: float, repeats: int = 5) -> dict:
    """Median time of an all-gather of `mb` MB per process over the replica axis: one device per process,
    the comm device when reserved, else each process's only device."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    devices = dist.comm_devices() or [min((d for d in jax.devices() if d.process_index == i), key=lambda d: d.id)
                                      for i in range(jax.process_count())]
    mesh = jax.sharding.Mesh(np.array(devices), ("replica",))
    n = int(mb * 2**20)
    mine = next(d for d in devices if d.process_index == jax.process_index())
    local = jax.device_put(jnp.ones((1, n), jnp.uint8), mine)
    x = jax.make_array_from_single_device_arrays((len(devices), n), NamedSharding(mesh, P("replica")), [local])
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


def shape_links(m: int, rate: str) -> None:
    subprocess.run([str(REPO / "scripts" / "netns.sh"), "up", str(m), rate], check=True, capture_output=True)


def rate_mbit(rate: str) -> float:
    units = {"kbit": 1e-3, "mbit": 1.0, "gbit": 1e3}
    for u, f in units.items():
        if rate.endswith(u):
            return float(rate[: -len(u)]) * f
    raise ValueError(f"rate {rate!r}: use tc units like 500kbit, 10mbit, 1gbit")


def _launch(argv: list[str], out: Path, comm: bool = True) -> int:
    cmd = [sys.executable, "-m", "diloco.cli", "launch", "--processes", "2", "--netns",
           *(["--comm_device"] if comm else []), "--logdir", str(out / "runs" / "logs"), "--", *argv]
    return subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          timeout=1800).returncode


# -- the trainer itself over shaped links (diloco launch -- train) ------------------------------------
# A measurement variant is a variant of diloco/outer/methods.py (the one vocabulary: its config overrides
# and the simulator's method) run a certain way: what the measurement sets on top (DiLoCo's payload in
# bf16, as the simulator prices it; τ) and whether the exchange runs on a comm device (overlapped) or
# blocks (then the simulator models the variant without overlap).
# name -> (methods.VARIANTS name, overrides, comm device)
TRAIN_VARIANTS = {
    "dp": ("dp", dict(replicas=2), False),
    "diloco": ("diloco", dict(codec="bf16"), False),
    "streaming_fp4_blocking": ("streaming_ovl_fp4", {}, False),
    "streaming_fp4_overlap": ("streaming_ovl_fp4", {}, True),
    "streaming_fp4_overlap_tau5": ("streaming_ovl_fp4", dict(tau=5), True),
}


def sim_variant(variant: str) -> tuple[str, int]:
    """(methods variant the simulator runs, its τ): a blocking run is its variant without the overlap
    (streaming_ovl_fp4 → streaming_fp4, τ 0)."""
    name, over, comm = TRAIN_VARIANTS[variant]
    if comm:
        return name, int(over.get("tau", methods.VARIANTS[name].tau))
    return methods.get(name.replace("_ovl", "")).name, 0


def train_args(variant: str, steps: int, H: int, workdir: Path) -> tuple[list[str], bool]:
    """`diloco train` argv of one variant (toy scale, batch 8 × 64 per replica) and its comm flag."""
    name, over, comm = TRAIN_VARIANTS[variant]
    v = methods.VARIANTS[name]
    base = dict(seq_len=64, batch_size=16, steps=steps, H=H, log_every=H, eval_every=steps, eval_batches=2,
                checkpoint_every=steps, codec_block_size=256)
    argv = ["train", "--config", f"experiments/toy.py:{v.method}", "--workdir", str(workdir), "--no_progress"]
    sets = {**base, **{k: x for k, x in v.config_overrides().items() if k != "method"}, **over}
    return argv + [f"--config.{k}={x}" for k, x in sets.items()], comm


def _payload_bytes(summary: dict, n_params: int) -> list[int]:
    from diloco.outer.codecs import encoded_nbytes, make_codec

    if summary["method"] == "dp":  # the jitted step all-reduces the fp32 gradients as one flat vector
        return [4 * n_params]
    codec = make_codec(summary["codec"], 256)
    return [encoded_nbytes(codec, n) for n in summary["fragment_sizes"]]


def train_row(variant: str, rate: str, workdir: Path, H: int, ref_step_s: float | None,
              achieved_mbit: float | None = None) -> dict:
    """One measured point from a finished run's summary and its per-rank timelines."""
    from diloco.timeline import overlap_report, read_timeline

    summ = json.loads((workdir / "summary.json").read_text())
    warm = 5 if variant == "dp" else 2 * H  # every jit (sends, applies, merges) has run once
    reps = [overlap_report(read_timeline(f), warm) for f in sorted((workdir / "timeline").glob("rank*.jsonl"))]
    comm = TRAIN_VARIANTS[variant][2]
    sim_method, sim_tau = sim_variant(variant)
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


def unpack_runs(out: Path) -> bool:
    """OUT/runs.tar.xz (the committed runs' config, metrics, summary and per-rank timelines, one archive
    instead of thousands of JSONL lines in git) unpacked into OUT/runs/ when that folder is missing, so
    `sweep` reads those runs' rows instead of training them again. True when it unpacked."""
    archive = out / "runs.tar.xz"
    if not archive.exists() or (out / "runs").exists():
        return False
    with tarfile.open(archive) as t:
        t.extractall(out, **SAFE_EXTRACT)
    return True


def train_sweep(rates: list[str], variants: list[str], out: Path, steps: int = 120, H: int = 20,
                dp_steps: int = 30) -> list[dict]:
    """Root: for each rate, shape the links and run `diloco launch --netns [--comm_device] -- train` per
    variant; finished runs (summary.json present, OUT/runs.tar.xz unpacked first) are not run again.
    Rows → OUT/train_cu.jsonl."""
    out.mkdir(parents=True, exist_ok=True)
    unpack_runs(out)
    ref_dir = out / "runs" / "dp_reference_1proc"
    if not (ref_dir / "summary.json").exists():  # DP's compute time: the same step with no link
        argv, _ = train_args("dp", dp_steps, H, ref_dir)
        argv += ["--config.replicas=1", "--config.batch_size=8"]
        subprocess.run([sys.executable, "-m", "diloco.cli", *argv], cwd=REPO, check=True,
                       env=dict(os.environ, DILOCO_TIMELINE="1"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    from diloco.timeline import overlap_report, read_timeline

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
                rc = _launch(*train_args(v, dp_steps if v == "dp" else steps, H, wd), out)
                if rc:
                    print(f"{rate} {v}: failed (rc={rc}); logs in {out / 'runs' / 'logs'}", file=sys.stderr)
                    continue
            row = train_row(v, rate, wd, H, ref_step, achieved)
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("rate", "variant", "cu", "sim_cu_at_rate", "overlapped",
                                                  "checkable", "final_eval_loss")}), flush=True)
    from diloco.rundir import atomic_write_text

    old = out / "train_cu.jsonl"  # rows of earlier calls (other rates or variants) are kept
    keep = [json.loads(l) for l in old.read_text().splitlines() if l.strip()] if old.exists() else []
    new = {(r["rate"], r["variant"]) for r in rows}
    rows = [r for r in keep if (r["rate"], r["variant"]) not in new] + rows
    atomic_write_text(old, "".join(json.dumps(r) + "\n" for r in rows))
    return rows


def train_report(out: Path):
    """OUT/train_cu.{csv,md,png} and the 90%-CU bandwidths from OUT/train_cu.jsonl."""
    import pandas as pd

    from diloco.rundir import atomic_write_text

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
    _plot_cu(df, out / "train_cu.png")
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
    ts = sub.add_parser("sweep", help="root: `diloco train` itself over shaped links, per rate and variant")
    ts.add_argument("--rates", default="3mbit,10mbit,30mbit,100mbit,1gbit")
    ts.add_argument("--variants", default=",".join(TRAIN_VARIANTS), help="of " + ", ".join(TRAIN_VARIANTS))
    ts.add_argument("--steps", type=int, default=120)
    ts.add_argument("--H", type=int, default=20)
    ts.add_argument("--dp_steps", type=int, default=30, help="DP exchanges every step: fewer steps at low rates")
    ts.add_argument("--out", default="results/overlap/trainer")
    r = sub.add_parser("report", help="table + plot of a sweep's runs beside the simulator's prediction")
    r.add_argument("--out", default="results/overlap/trainer")
    tl = sub.add_parser("timeline", help="overlap report of a run's timeline/rank*.jsonl (diloco train)")
    tl.add_argument("workdir")
    tl.add_argument("--warmup", type=int, default=0, help="steps to leave out of the CU window (0: up to the first send)")
    h = sub.add_parser("hlo", help="collectives of a compiled send + inner step (XLA_FLAGS=…device_count=2)")
    h.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.cmd == "hlo":
        print(json.dumps(combined_step_collectives(Path(args.out) if args.out else None)))
        return 0
    if args.cmd == "sweep":
        if os.geteuid() != 0:
            print("diloco netbench sweep: needs root to shape links (scripts/netns.sh: ip netns, tc); "
                  "run it with sudo", file=sys.stderr)
            return 2
        bad = [v for v in args.variants.split(",") if v not in TRAIN_VARIANTS]
        if bad:
            print(f"diloco netbench: unknown variant(s) {bad}; valid: {', '.join(TRAIN_VARIANTS)}", file=sys.stderr)
            return 2
        train_sweep(args.rates.split(","), args.variants.split(","), Path(args.out), args.steps, args.H,
                    args.dp_steps)
        train_report(Path(args.out))
        return 0
    if args.cmd == "report":
        train_report(Path(args.out))
        return 0
    if args.cmd == "timeline":
        from diloco.timeline import overlap_report, read_timeline

        files = sorted(Path(args.workdir, "timeline").glob("rank*.jsonl"))
        if not files:
            print(f"diloco netbench: no timeline under {args.workdir}/timeline (multi-process runs write one; "
                  "DILOCO_TIMELINE=1 for a single process)", file=sys.stderr)
            return 2
        for f in files:
            print(json.dumps({"rank": f.stem, **overlap_report(read_timeline(f), args.warmup)}))
        return 0
    if dist.num_processes() < 2:
        print("diloco netbench: run under `diloco launch --processes 2 [--netns] [--comm_device] -- netbench …`",
              file=sys.stderr)
        return 2
    dist.initialize_from_env()
    _write(args.out, throughput(args.mb, args.repeats))
    return 0


# -- report: measured CU beside the simulator's prediction -------------------------------------------
def simulated_cu(row: dict, gbit_per_s: float) -> float:
    """The simulator (physical calibration) for the same model (layers, params), measured step time, bytes and τ."""
    from diloco.simulate import PHYSICAL, Model, compute_utilisation, make_method

    model = Model("toy", layers=row["layers"], params=float(row["params"]), step_time_s=row["step_time_s"])
    bits = 8.0 * sum(row["payload_bytes"]) / row["params"]
    method = make_method(row["method"], row["layers"], h=row["H"] if row["method"] != "dp" else 1,
                         fragments=row["fragments"], tau=row["tau"], bits=bits)
    return compute_utilisation(model, method, gbit_per_s, PHYSICAL)


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


def _plot_cu(df, path: Path) -> None:
    """Measured CU (solid), the simulator at the tc rate (dashed) and at the achieved rate (dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.8))
    for i, (m, sub) in enumerate(df.groupby("variant", sort=False)):
        c = f"C{i}"
        ax.plot(sub.rate_mbit, sub.cu, "o-", color=c, label=f"{m} (measured, diloco train)")
        ax.plot(sub.rate_mbit, sub.sim_cu_at_rate, "--", color=c, alpha=0.7, label=f"{m} (simulator)")
        ax.plot(sub.rate_mbit, sub.sim_cu_at_measured_throughput, ":", color=c, alpha=0.7,
                label=f"{m} (simulator at achieved rate)")
    ax.set_xscale("log")
    ax.set_xlabel("link rate per replica (tc tbf), Mbit/s")
    ax.set_ylabel("compute utilisation")
    ax.axhline(0.9, color="grey", lw=0.5)
    ax.set_ylim(0, 1.02)
    ax.set_title("diloco train, 2 replica processes over throttled veth links (toy scale, 2 shared CPU cores)",
                 fontsize=9)
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
    from diloco.trainer import Trainer

    flat = {"scale": "tiny", "seq_len": 32, "batch_size": 4, "H": 4, "layers_per_fragment": 1, "tau": 1}
    cfg = load_config("experiments/toy.py:streaming", [f"--config.{k}={v}" for k, v in flat.items()])
    tr = Trainer(cfg, devices=jax.devices()[:2])
    step = tr.inner_step(jitted=False)  # the traced step the trainer jits

    def combined(state, toks, key):
        return step(state.replace(outer=tr.sync.send(state.params, state.outer, 0, key, jnp.ones(2))), toks)

    toks = jax.ShapeDtypeStruct((2, 2, 32), jnp.int32, sharding=tr.batch_sharding)
    txt = jax.jit(combined).lower(tr.abstract_state(), toks, jax.random.PRNGKey(0)).compile().as_text()
    pat = r"(all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)(-start|-done)?"
    lines = [l.strip() for l in txt.splitlines() if re.search(r"= \S+ " + pat + r"\(", l)]
    ops = Counter(re.search(r"= \S+ (" + pat + r")\(", l).group(1) for l in lines)
    if path is not None:
        path.write_text(f"# collectives in the compiled HLO of (send of fragment 0 + next inner step), "
                        f"backend={jax.default_backend()}, jax {jax.__version__}\n"
                        + "".join(l[:300] + "\n" for l in lines))
    from diloco.resolve import mesh_dict

    return {"backend": jax.default_backend(), "mesh": mesh_dict(tr.mesh.shape), "ops": dict(ops)}
