"""Inner lr for DP at the claims budget, over powers of √2 around 3e-3 ([SL]'s procedure, one seed).

  diloco sweep sweeps/tune_inner_lr.py:tiny --root runs/full
The best final eval loss is recorded as experiments/claims.py TUNED[scale]["inner_lr"].
"""
from diloco.sweep import product

LRS = [round(3e-3 * 2 ** (k / 2), 6) for k in range(-2, 4)]  # 1.5e-3 … 8.49e-3


def get_sweep(arg: str = "tiny"):
    return {"name": f"tune_inner_lr_{arg}", "experiment": f"experiments/claims.py:{arg},dp",
            "points": product(**{"optimizer.lr": LRS})}
