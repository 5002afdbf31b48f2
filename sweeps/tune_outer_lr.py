"""Outer lr for DiLoCo (H=30 → 10 at toy scale, M=2) at the claims budget over {0.2 … 1.0} ([SL]'s grid;
0.05 and 0.1 added because 0.2, the grid's edge, won), at the
tuned inner lr ([SL]'s grid; momentum 0.9 Nesterov as the paper; one seed).

  diloco sweep sweeps/tune_outer_lr.py:tiny --root runs/full
The best final eval loss is recorded as experiments/claims.py TUNED[scale]["outer_lr"].
"""
from diloco.sweep import product


def get_sweep(arg: str = "tiny"):
    return {"name": f"tune_outer_lr_{arg}", "experiment": f"experiments/claims.py:{arg},diloco_h30",
            "points": product(**{"outer.lr": [0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0]})}
