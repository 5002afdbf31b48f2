"""Peak per chip and compile seconds of chosen programs of a paper-scale Streaming run (libtpu, no TPU),
compiled one after another with whatever `diloco` comes first on PYTHONPATH — so the shared fragment
programs can be set beside the per-fragment programs of an older tree (a `git worktree` of it):

  PYTHONPATH=.        python benchmarks/bench_fragment_memory.py 10B v5p:2x4x4 'step+send 1-15,send 1-15' out_new.json
  PYTHONPATH=/wt/old  python benchmarks/bench_fragment_memory.py 10B v5p:2x4x4 'step+send 1,send 1' out_old.json

(program names as `diloco compile` prints them for that tree). Used for #32's 10B comparison."""
import json
import os
import sys
import time

import diloco
from bench_compile import paper_streaming_trainer  # this folder is on sys.path when the script runs


def main(scale: str, topology: str, programs: str, out: str) -> None:
    from diloco.compile.aot import compile_trainer

    cfg, devices, tr = paper_streaming_trainer(scale, topology)
    t0 = time.time()
    try:
        got = compile_trainer(cfg, devices, set(programs.split(",")), tr=tr, workers=1)
    except TypeError:  # a tree before #32 compiles one after another anyway
        got = compile_trainer(cfg, devices, set(programs.split(",")), tr=tr)
    res = {"code": os.path.dirname(diloco.__file__), "scale": scale, "topology": topology,
           "wall": round(time.time() - t0, 1), "load": os.getloadavg()[0],
           "programs": {r["program"]: {"peak_gib": round(r["peak_bytes_per_chip"] / 2**30, 3),
                                       "compile_seconds": r["compile_seconds"]}
                        for r in got["programs"] if r["compiled"]}}
    print(json.dumps(res, indent=1))
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:5])
