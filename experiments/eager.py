"""[EU] Tables 2 and 3: eager updates (the exchange overlaps a whole outer round) beside no overlap and
the 1-inner-step overlap, on DiLoCo (Table 2) and on Streaming DiLoCo (Table 3).

  experiments/eager.py:<scale>,<row>[,<base>]
  row:  none          no overlap (τ = 0)
        inner         1-inner-step overlap (τ = 1; on DiLoCo: Streaming with one fragment, α = 0, FP32)
        naive         1 outer step, the delayed average applied as is (eager=naive)
        naive_lowlr   the same at outer lr 0.2 ([EU]'s lowered value is not stated; half of 0.4)
        swap, mix     1 outer step, eager (both readings of the formula, docs/architecture.md)
        swap2, mix2   2 outer steps, eager (eager_rounds=2)
  base: diloco        DiLoCo H = 30, M = 2 (Table 2; [EU]'s numbers match plain DiLoCo)
        streaming     Streaming DiLoCo, 3-block strided fragments, FP4 (E3M0), α = 0.5 (Table 3)
At the CPU twins (tiny, toy) H = 30 becomes 10 (experiments/common.py toy_H).
"""
from experiments import common

ROWS = {
    "none": {},
    "inner": {"tau": 1},
    "naive": {"eager": "naive"},
    "naive_lowlr": {"eager": "naive", "outer.lr": 0.2},
    "swap": {"eager": "swap"},
    "mix": {"eager": "mix"},
    "swap2": {"eager": "swap", "eager_rounds": 2},
    "mix2": {"eager": "mix", "eager_rounds": 2},
}
BASES = ("diloco", "streaming")


def get_config(arg: str = "tiny,swap"):
    a = common.parse(arg, "eager", ("scale", "row", "base"), {"base": "diloco"})
    if a["row"] not in ROWS:
        raise ValueError(f"experiments/eager.py:{arg!r}: row {a['row']!r} not in {list(ROWS)}")
    if a["base"] not in BASES:
        raise ValueError(f"experiments/eager.py:{arg!r}: base {a['base']!r} not in {list(BASES)}")
    c = common.new()
    common.sized(c, a["scale"])
    row = dict(ROWS[a["row"]])
    if a["base"] == "diloco":
        common.method(c, "diloco_h30")
        if row.get("tau"):  # DiLoCo with overlap: Streaming's machinery with one fragment
            c.method, c.fragments, c.layers_per_fragment, c.alpha, c.codec = "streaming", 1, 0, 0.0, "none"
    else:
        common.method(c, "streaming_ovl_fp4_h30" if row.get("tau") else "streaming_fp4_h30")
        row.pop("tau", None)
    for k, v in row.items():
        if "." in k:
            group, key = k.split(".")
            c[group][key] = v
        else:
            c[k] = v
    return c
