"""Ahead-of-time compilation of a Trainer's programs for a TPU topology described by libtpu (no TPU
needed): per-chip memory, FLOPs and collectives of each program, the report and its text form."""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

import numpy as np

from diloco.compile.gpu import exchange_window, gpu_devices, gpu_hbm_bytes, gpu_usable_bytes, is_gpu_topology
from diloco.compile.hlo import annotate_overlap, custom_calls, entry_flops, parse_collectives
from diloco.compile.overlap import overlap_report
from diloco.errors import ConfigError
from diloco.outer.driver import group_name
from diloco.precompile import compile_parallel, compile_workers, programs

GiB = 1 << 30
# HBM per chip (Cloud TPU system architecture pages): v4 32 GiB, v5e 16 GiB, v5p 95 GiB, v6e 32 GiB.
# XLA keeps a little for itself (the usable limit it reports is ≈ 0.25 GiB lower).
CHIP_HBM_BYTES = {"v4": 32 * GiB, "v5e": 16 * GiB, "v5p": 95 * GiB, "v6e": 32 * GiB}
INSTALL_HINT = "diloco compile needs libtpu (it compiles for TPU on this machine): pip install -e '.[tpu]'"


# -- topology ------------------------------------------------------------------------------------
def tpu_devices(topology: str, slices: int = 1) -> list:
    """The devices of a TPU topology described by libtpu (no TPU needed), slice by slice."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu's lock
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")          # no GCE metadata server here
    chip = topology.split(":")[0]
    if chip not in CHIP_HBM_BYTES:
        raise ConfigError("--topology", f"{topology!r}: unknown chip {chip!r}; use NAME:SHAPE with NAME one of "
                          f"{sorted(CHIP_HBM_BYTES)}, e.g. v5e:2x2, v5p:2x2x2, v4:2x2x2")
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise ConfigError("--topology", INSTALL_HINT) from None
    from jax.experimental import topologies

    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=topology, num_slices=slices)
    except Exception as e:  # libtpu's own message, on one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError("--topology", f"libtpu does not know {topology!r} (slices={slices}): {first}") from None
    return sorted(desc.devices, key=lambda d: (getattr(d, "slice_index", 0), d.id))


# -- compiling the trainer's programs ------------------------------------------------------------
def per_chip_bytes(tree) -> int:
    """Bytes one chip holds of a tree of sharded ShapeDtypeStructs (the largest shard per leaf)."""
    import jax

    total = 0
    for x in jax.tree_util.tree_leaves(tree):
        shard = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += int(np.prod(shard)) * np.dtype(x.dtype).itemsize
    return total


def compile_one(name: str, jitted, args, mesh, hlo_dir: str | None = None) -> dict:
    """Lower and compile one program; its memory, FLOPs and collectives (hlo_dir: also write its
    scheduled HLO text there, as `diloco compile --hlo-dir` does)."""
    t0 = time.time()
    lowered = jitted.lower(*args) if not hasattr(jitted, "compile") else jitted  # or lowered already
    try:
        compiled = lowered.compile()
    except Exception as e:  # XLA's RESOURCE_EXHAUSTED: does not fit
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return {"program": name, "compiled": False, "error": msg[:500], "compile_seconds": time.time() - t0,
                "fits": False}
    secs = time.time() - t0
    ma = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else (cost or {})
    mem = {"argument_bytes": int(ma.argument_size_in_bytes), "output_bytes": int(ma.output_size_in_bytes),
           "alias_bytes": int(ma.alias_size_in_bytes), "temp_bytes": int(ma.temp_size_in_bytes),
           "code_bytes": int(ma.generated_code_size_in_bytes)}
    peak = int(getattr(ma, "peak_memory_in_bytes", 0) or 0)
    mem["peak_bytes"] = max(peak, mem["argument_bytes"] + mem["output_bytes"] - mem["alias_bytes"]
                            + mem["temp_bytes"])
    hlo = compiled.as_text()
    if hlo_dir:  # `--hlo-dir`: the scheduled program, to read what the report summarises
        Path(hlo_dir).mkdir(parents=True, exist_ok=True)
        (Path(hlo_dir) / (re.sub(r"[^\w.+-]+", "_", name) + ".hlo.txt")).write_text(hlo)
    return {"program": name, "compiled": True, "compile_seconds": round(secs, 3), "memory": mem,
            "flops": float(cost.get("flops", 0.0)),  # XLA's cost analysis: a while body (nn.scan) counted once
            "hlo_flops": entry_flops(hlo),  # dots/convolutions from the HLO, loop bodies × trip count
            # custom kernels in the program (tpu_custom_call: a Pallas/Mosaic kernel such as splash attention;
            # __cudnn$fmhaSoftmax…: cuDNN's fused attention — `$` is part of the name)
            "custom_calls": custom_calls(hlo),
            "collectives": annotate_overlap(parse_collectives(hlo, mesh), hlo)}


def trainer_programs(tr) -> list[tuple]:
    """`diloco.precompile.programs` with abstract arguments (ShapeDtypeStructs in the run's shardings): what
    `diloco compile` and the memory table compile. Nothing is allocated."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    cfg, mesh = tr.cfg, tr.mesh
    repl = NamedSharding(mesh, P())
    state = tr.abstract_state()
    L = cfg.seq_len
    batch = jax.ShapeDtypeStruct((tr.R, cfg.batch_size // tr.R, L), jnp.int32, sharding=tr.batch_sharding)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=repl)
    contrib = jax.ShapeDtypeStruct((tr.R,), jnp.float32, sharding=repl)
    mask = jax.ShapeDtypeStruct((tr.R,), jnp.bool_, sharding=repl)
    eparams = state.outer.params if state.outer is not None else jax.tree_util.tree_map_with_path(
        lambda path, x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=eval_param_sharding(tr, x, path)),
        state.params)
    ebatch = jax.ShapeDtypeStruct((cfg.batch_size // tr.R * tr.R, L), jnp.int32, sharding=eval_batch_sharding(tr))
    return programs(tr, state, batch, key, contrib, mask, (eparams, ebatch),
                        inner=jax.jit(tr.inner_step(jitted=False), donate_argnums=(0,)))


def compile_trainer(cfg, devices, only: set[str] | None = None, hlo_dir: str | None = None, tr=None,
                    workers: int | None = None) -> dict:
    """Build the Trainer on `devices` (or take `tr`, built for `cfg`) and compile its programs (all,
    or those named in `only`; each one's HLO text written under `hlo_dir` when given), in parallel
    (`compile_workers`); `compile` says how many programs, their summed and the wall seconds."""
    from diloco.trainer import Trainer

    tr = Trainer(cfg, devices=devices) if tr is None else tr
    todo = trainer_programs(tr)
    state = todo[0][2][0]
    state_bytes = per_chip_bytes(state)
    eval_param_bytes = per_chip_bytes(todo[-1][2][0])
    todo = [t for t in todo if only is None or t[0] in only]
    t0 = time.time()
    out = compile_parallel(todo, lambda name, fn, args: compile_one(name, fn, args, tr.mesh, hlo_dir), workers)
    wall = time.time() - t0
    for r in out:
        if r["compiled"]:
            # programs run one after another while the whole state stays resident: eval's arguments
            # are only θᵍ, so the rest of the state is added to its peak.
            resident = state_bytes - eval_param_bytes if r["program"] == "eval" else 0
            r["memory"]["resident_bytes"] = resident
            r["peak_bytes_per_chip"] = r["memory"]["peak_bytes"] + resident
    return {"trainer": tr, "state_bytes_per_chip": state_bytes, "programs": out,
            "compile": {"programs": len(out), "seconds_total": sum(r["compile_seconds"] for r in out),
                        "seconds_wall": wall, "workers": compile_workers(workers, len(out)),
                        "cpus": os.cpu_count()}}


def eval_batch_sharding(tr):
    """The eval batch's sharding (diloco/sharding.py Layout)."""
    return tr.layout.eval_batch_sharding


def eval_param_sharding(tr, x, path=None):
    """DP's evaluated parameters (one replica's, no replica axis): laid out by the logical rules like θᵍ."""
    names = tr.layout.names_at(path) if path is not None else None
    return tr.layout.outer_param_sharding(x.shape[1:], names)


def report(cfg, topology: str, slices: int = 1, only: set[str] | None = None, hlo_dir: str | None = None) -> dict:
    from diloco.resolve import mesh_shape

    chip, gpu = topology.split(":")[0], is_gpu_topology(topology)
    if gpu and slices != 1:
        raise ConfigError("--slices", f"{slices}: a GPU target gives its nodes in the topology (h200:1x2x8), not --slices")
    devices = gpu_devices(topology) if gpu else tpu_devices(topology, slices)
    mesh_shape(cfg, len(devices))  # the mesh and batch fit the devices
    hbm = gpu_hbm_bytes(chip) if gpu else CHIP_HBM_BYTES[chip]
    limit = gpu_usable_bytes(chip) if gpu else hbm  # a GPU program gets JAX's preallocated share
    got = compile_trainer(cfg, devices, only, hlo_dir)
    tr, progs = got["trainer"], got["programs"]
    for r in progs:
        if r["compiled"]:
            r["fits"] = r["peak_bytes_per_chip"] <= limit
    peak = max((r.get("peak_bytes_per_chip", 0) for r in progs), default=0)
    colls = [dict(c, program=r["program"]) for r in progs for c in r.get("collectives", [])]
    from diloco.resolve import mesh_dict

    return {"topology": topology, "slices": slices, "chips": len(devices), "chip_kind": devices[0].device_kind,
            "chip_hbm_bytes": hbm, "usable_bytes": limit, "mesh": mesh_dict(tr.mesh.shape), "params": tr.n_params, "method": cfg.method,
            "H": cfg.H, "tau": cfg.tau, "exchange": tr.driver.exchange if tr.driver is not None else "dp",
            "resolved": tr.plan.to_json(),  # every `auto` as this compile resolved it (diloco/resolve.py)
            "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", ""), "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "scale": cfg.scale, "state_bytes_per_chip": got["state_bytes_per_chip"], "peak_bytes_per_chip": peak,
            "model_flops_per_chip": (model_flops_per_step(cfg, tr.n_params) / len(devices)
                                     if tr.mcfg.scan else None),  # cost analysis undercounts a scan
            "fits": all(r["fits"] for r in progs), "programs": progs, "collectives": colls,
            "compile": got["compile"],
            "fragment_groups": [list(g) for g in tr.sync.frags.groups()] if tr.driver is not None else [],
            "bytes_per_replica": ({p: tr.driver.bytes_per_replica(p) for p in range(tr.driver.P)}
                                  if tr.driver is not None else {}),
            "wire_bytes_per_replica": ({p: tr.sync.wire_bytes_per_replica(p) for p in range(tr.driver.P)}
                                       if tr.driver is not None else {}),
            # chips of a replica that split each fragment's exchange (1: every chip moves all of it), and
            # whether each encodes the blocks it holds ("chips") or a slice of the canonical vector ("flat")
            "exchange_shards": ({p: tr.sync.shards(tr.sync.frags.sizes[p]) for p in range(tr.driver.P)}
                                if tr.driver is not None else {}),
            "exchange_wire": ({p: "chips" if tr.sync.chip_wire(p) else "flat" for p in range(tr.driver.P)}
                              if tr.driver is not None else {})}


def _group(g: list[int]) -> str:
    return f"fragments {group_name(tuple(g))}" if len(g) > 1 else f"fragment {g[0]}"


def _gb(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 4 else f"{n / (1 << 20):.2f} MiB"


def text_report(rep: dict) -> str:
    lines = [f"{rep['method']} {rep['scale']} ({rep['params']:,} params) on {rep['topology']}"
             f"{' ×' + str(rep['slices']) + ' slices' if rep['slices'] > 1 else ''}: {rep['chips']} chips "
             f"({rep['chip_kind']}, {_gb(rep['chip_hbm_bytes'])} HBM each), mesh {rep['mesh']}",
             f"state per chip {_gb(rep['state_bytes_per_chip'])}; peak per chip {_gb(rep['peak_bytes_per_chip'])} "
             f"→ {'fits' if rep['fits'] else 'DOES NOT FIT'}", "",
             f"{'program':<10} {'args':>10} {'temp':>10} {'out':>10} {'peak':>10} {'fits':>5} {'compile s':>9} "
             f"{'GFLOP':>10}  collectives"]
    for r in rep["programs"]:
        if not r["compiled"]:
            lines.append(f"{r['program']:<10} did not compile: {r['error']}")
            continue
        m = r["memory"]
        agg: dict[tuple, list[int]] = {}
        for c in r["collectives"]:
            k = (c["kind"], "×".join(c["axes"]) or "-", c["crosses_slices"], c["async"])
            agg.setdefault(k, [0, 0])
            agg[k][0] += c.get("count", 1)  # runs per step (a collective in a layer loop: once per layer)
            agg[k][1] += c["operand_bytes"] * c.get("count", 1)
        cs = "; ".join(f"{n}× {kind}{' async' if asy else ''} over {ax}{' (DCN)' if dcn else ''}: {b:,} B"
                       for (kind, ax, dcn, asy), (n, b) in agg.items())
        lines.append(f"{r['program']:<10} {_gb(m['argument_bytes']):>10} {_gb(m['temp_bytes']):>10} "
                     f"{_gb(m['output_bytes']):>10} {_gb(r['peak_bytes_per_chip']):>10} {'yes' if r['fits'] else 'NO':>5} "
                     f"{r['compile_seconds']:>9.1f} {r['flops'] / 1e9:>10.2f}  {cs or '-'}")
    c = rep.get("compile")
    if c:
        groups = rep.get("fragment_groups") or []
        lines += ["", f"{c['programs']} distinct programs"
                  + (f" for {sum(map(len, groups))} fragments (shared: {'; '.join(map(_group, groups))})" if groups else "")
                  + f"; compile {c['seconds_total']:.1f} s summed, {c['seconds_wall']:.1f} s wall on "
                  f"{c['workers']} threads ({c['cpus']} cores)"]
    ov = overlap_report(rep)
    if ov:
        lines += ["", ov]
    if is_gpu_topology(rep["topology"]):
        lines += ["", f"usable per GPU {_gb(rep['usable_bytes'])} (XLA_PYTHON_CLIENT_MEM_FRACTION of {_gb(rep['chip_hbm_bytes'])})"]
        for r in rep["programs"]:
            w = exchange_window(r) if r["compiled"] and r["program"].startswith("step+send") else None
            if w and w["collectives"]:
                lines.append(f"  {r['program']}: replica exchange {'async' if w['async'] else 'SYNC'}, under it "
                             f"{w['overlapped_ops']} ops, {w['overlapped_flops'] / 1e9:.3f} GFLOP "
                             f"({100 * w['share']:.1f}% of the program's)")
        lines += ["", f"exchange {rep.get('exchange')}; XLA_FLAGS: {rep.get('xla_flags') or '(none)'}"]
    else:
        lines += ["", f"exchange {rep.get('exchange')}; LIBTPU_INIT_ARGS: {rep.get('libtpu_init_args') or '(none)'}"]
    res = rep.get("resolved") or {}
    lines += [f"resolved {k}: {res[k]}" + (f"  ({res['why'][k]})" if k in res.get("why", {}) else "")
              for k in ("platform", "mesh", "attention", "remat", "scan", "exchange") if k in res]
    return "\n".join(lines)


# -- model FLOPs (the report's model_flops_per_chip; the paper table's step time) ------------------
def model_flops_per_step(cfg, n_params: int) -> float:
    """Model FLOPs of one training step (the MFU convention: 6 per parameter per token, plus the
    attention scores' 12·layers·d_model·seq per token; rematerialisation is not counted)."""
    from diloco.model.scales import SCALES

    s = SCALES[cfg.scale]
    return float(cfg.batch_size * cfg.seq_len) * (6.0 * n_params + 12.0 * s.layers * s.d_model * cfg.seq_len)
