"""What a Streaming run's compile costs at a paper scale, on this machine (libtpu, no TPU): the run's
distinct programs compiled one after another (1 thread) and side by side (one thread per core), each
mode in its own process, in the same invocation, so the ratio is measured on one machine state.

  python benchmarks/bench_compile.py [--scale 35M] [--topology v5e:2x2] [--modes serial,parallel] [--out FILE.json]

Prints per program its compile seconds (serial mode), the summed and wall seconds of both modes, the
wall time against the inner step's own compile, and what the per-fragment programs of the code
before #32 would have compiled: inner + eval + 4 programs per fragment (fragments 1…P−1 each their
own copy of the shared program; the drained copies, which that code compiled at their first use, not
counted), estimated from the serial seconds of the shared programs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time



def paper_streaming_trainer(scale: str, topology: str):
    """(cfg, devices, Trainer) of the paper-scale Streaming spec on a TPU topology, laid out as the memory
    table lays it out (replicas on the replica axis, FSDP over each replica's chips), with the overlap
    flags `diloco train` sets and JAX's persistent cache off. Uses only names a tree before #32 has too
    (bench_fragment_memory.py runs it against older trees)."""
    from diloco.compile.overlap import use_tpu_overlap_flags

    use_tpu_overlap_flags()  # as `diloco train` and the memory table compile
    os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    import importlib

    T = importlib.import_module("diloco.compile.paper_table")  # the package exports a function of that name
    from diloco.compile.aot import tpu_devices
    from diloco.resolve import mesh_shape
    from diloco.trainer import Trainer

    spm = os.environ.get("DILOCO_SPM")  # the T5 32k SentencePiece model: only its vocabulary size is used
    if not spm:
        sys.exit("bench_compile: set DILOCO_SPM to sentencepiece_cc_all.32000.100extra-sentencepiece.model")
    cfg = T.paper_config(scale, "Streaming", spm)
    devices = tpu_devices(topology)
    cfg.mesh.replica_axis, cfg.mesh.data, cfg.mesh.fsdp = cfg.replicas, 1, -1
    mesh_shape(cfg, len(devices))  # the mesh and batch fit the devices
    return cfg, devices, Trainer(cfg, devices=devices)


def child(scale: str, topology: str, workers: int) -> dict:
    from diloco.compile.aot import compile_trainer

    cfg, devices, tr = paper_streaming_trainer(scale, topology)
    t0 = time.time()
    got = compile_trainer(cfg, devices, tr=tr, workers=workers)
    return {"workers": got["compile"]["workers"], "wall_s": round(time.time() - t0, 1),
            "summed_s": round(got["compile"]["seconds_total"], 1), "P": tr.driver.P,
            "groups": [list(g) for g in tr.sync.frags.groups()],
            "programs": {r["program"]: r["compile_seconds"] for r in got["programs"]},
            "load_after": round(os.getloadavg()[0], 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", default="35M")
    ap.add_argument("--topology", default="v5e:2x2")
    ap.add_argument("--out")
    ap.add_argument("--modes", default="serial,parallel",
                    help="serial,parallel (default) or parallel alone: its per-program seconds stand in for the "
                         "serial ones when the machine has a core per thread")
    ap.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.scale, a.topology, a.child)))
        return
    runs = {}
    for mode, w in (("serial", 1), ("parallel", os.cpu_count() or 1)):
        if mode not in a.modes.split(","):
            continue
        print(f"{a.scale} on {a.topology}: compiling every program, {mode} ({w} thread{'s' * (w > 1)}) …",
              file=sys.stderr, flush=True)
        out = subprocess.run([sys.executable, __file__, "--scale", a.scale, "--topology", a.topology,
                              "--child", str(w)], capture_output=True, text=True, check=True).stdout
        runs[mode] = json.loads(out.strip().splitlines()[-1])
    p = runs["parallel"]
    s = runs.get("serial", p)  # parallel alone: its per-program seconds (one core per thread) stand in
    progs, P = s["programs"], s["P"]
    shared = [g for g in s["groups"] if len(g) > 1]
    kinds = ("step+send", "send", "update", "merge")
    # the code before #32: fragments of a shared layout each compiled their own copy of these four
    before = progs["inner"] + progs["eval"]
    for g in s["groups"]:
        name = f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0])
        before += len(g) * sum(progs.get(f"{k} {name}", 0.0) for k in kinds)
    res = {"scale": a.scale, "topology": a.topology, "P": P, "distinct_programs": len(progs),
           "per_fragment_programs": 4 * P + 2, "shared_groups": shared, "programs_serial_s": progs,
           "serial_wall_s": runs["serial"]["wall_s"] if "serial" in runs else None,
           "parallel_wall_s": p["wall_s"], "parallel_workers": p["workers"],
           "parallel_over_serial": round(p["wall_s"] / runs["serial"]["wall_s"], 3) if "serial" in runs else None,
           "inner_s": progs["inner"], "parallel_wall_over_inner": round(p["wall_s"] / progs["inner"], 2),
           "per_fragment_estimate_s": round(before, 1), "load": [r["load_after"] for r in runs.values()],
           "cores": os.cpu_count()}
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
