"""[SD] Fig. 10: heterogeneous workers, τ1 = 1 and τ2 ∈ {1, 2, 5, 10, 20}, α = 0.5 (H = 30).

  diloco sweep sweeps/hetero_tau.py:tiny --root runs
"""
from diloco.sweep import product


def get_sweep(arg: str = "tiny"):
    return {"name": f"hetero_tau_{arg}", "experiment": f"experiments/ablate_tau.py:{arg}",
            "points": product(alpha=[0.5], replica_tau=[f"1,{t2}" for t2 in (1, 2, 5, 10, 20)])}
