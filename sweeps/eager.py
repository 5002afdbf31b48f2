"""[EU] Table 2 (overlap variants on DiLoCo, H = 30) and Table 3 (eager on DiLoCo vs Streaming DiLoCo).

  diloco sweep sweeps/eager.py:table2,tiny --root runs -j 2     (8 rows × 8 seeds; `:tiny` is the same)
  diloco sweep sweeps/eager.py:table3,tiny --root runs -j 2     (2 bases × none/swap/mix × 8 seeds)
Rows and bases: experiments/eager.py.
"""
from experiments.eager import ROWS

GROUPS = ("table2", "table3")
SEEDS = 8  # as the claims budget at tiny: 3 left the naive delay and the 2-round cost undecided


def get_sweep(arg: str = "table2,tiny"):
    group, _, scale = arg.partition(",")
    if group not in GROUPS and not scale:  # `sweeps/eager.py:tiny`: Table 2 at that scale
        group, scale = "table2", group
    scale = scale or "tiny"
    if group not in GROUPS:
        raise ValueError(f"sweeps/eager.py:{arg!r}: group must be one of {', '.join(GROUPS)}")
    if group == "table2":
        points = [{"arg": f"{scale},{row},diloco"} for row in ROWS]
    else:
        points = [{"arg": f"{scale},{row},{base}"} for base in ("diloco", "streaming") for row in ("none", "swap", "mix")]
    return {"name": f"eager_{group}_{scale}", "experiment": f"experiments/eager.py:{scale},none", "points": points,
            "seeds": SEEDS}
