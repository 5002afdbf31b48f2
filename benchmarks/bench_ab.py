"""Step time of two source trees side by side: DP, DiLoCo and Streaming of tree A vs tree B in one run.

    git archive 7a157fb | tar -x -C /tmp/old; git archive HEAD | tar -x -C /tmp/new
    python benchmarks/bench_ab.py /tmp/old /tmp/new [--scale toy] [--steps 120] [--rounds 20] [--json out.json]

One long-lived worker process per tree (its own `diloco` first on sys.path, its own
benchmarks/bench_train.py's `Bench`: every method built and warmed up, every compilation done), then
`--rounds` rounds in which each (tree, method) runs steps/rounds timed steps, in an order that rotates
the methods and alternates the trees, so machine noise hits both alike. ms/step is the median over
rounds of each (tree, method); B/A is the ratio of the medians.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = r"""
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/benchmarks"]
import diloco, bench_train
assert diloco.__file__.startswith(sys.argv[1]), diloco.__file__
scale, steps, H, seq_len, batch = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
benches = {m: bench_train.Bench(m, scale, steps, H, seq_len, batch) for m in sys.argv[7].split(",")}
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    m, n = line.split()
    b = benches[m]
    b.run(int(n))
    print(json.dumps({"lap": b.laps[-1], "sync": b.t_sync / b.steps}), flush=True)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--scale", default="toy")
    ap.add_argument("--steps", type=int, default=120, help="timed steps per (tree, method)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--H", type=int, default=30)
    ap.add_argument("--seq_len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--methods", default="dp,diloco,streaming")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    methods = a.methods.split(",")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH="")
    trees = {name: os.path.abspath(p) for name, p in (("A", a.a), ("B", a.b))}
    procs = {}
    for name, tree in trees.items():  # built one after the other: compiles do not share the cores
        procs[name] = subprocess.Popen(
            [sys.executable, "-c", WORKER, tree, a.scale, str(a.steps), str(a.H), str(a.seq_len), str(a.batch),
             a.methods], cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        json.loads(procs[name].stdout.readline())
    laps = {(t, m): [] for t in trees for m in methods}
    per = max(1, a.steps // a.rounds)
    for r in range(a.rounds):
        order = methods[r % len(methods):] + methods[:r % len(methods)]
        for m in order:
            for t in (("A", "B") if (r + methods.index(m)) % 2 == 0 else ("B", "A")):
                procs[t].stdin.write(f"{m} {per}\n")
                procs[t].stdin.flush()
                laps[t, m].append(json.loads(procs[t].stdout.readline())["lap"])
    for p in procs.values():
        p.stdin.close()
        p.wait()
    rows = []
    print(f"A = {trees['A']}\nB = {trees['B']}\nscale={a.scale} batch={a.batch}x{a.seq_len} H={a.H}, "
          f"{a.rounds} rounds of {per} steps per (tree, method); ms/step = median over rounds")
    print(f"{'method':<10} {'A ms/step':>10} {'B ms/step':>10} {'B/A':>7}")
    for m in methods:
        ma, mb = (1e3 * statistics.median(laps[t, m]) for t in ("A", "B"))
        rows.append({"method": m, "a_ms": ma, "b_ms": mb, "b_over_a": mb / ma,
                     "a_laps": laps["A", m], "b_laps": laps["B", m]})
        print(f"{m:<10} {ma:>10.2f} {mb:>10.2f} {mb / ma:>7.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"trees": trees, "args": vars(a), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
