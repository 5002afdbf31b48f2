"""[SD] Fig. 8: overlap τ ∈ {0, 1, 2, 5, 10, 20} × merge α ∈ {0, 0.5} (H = 30).

  diloco sweep sweeps/tau_alpha.py:tiny --root runs -j 2       (500M in the paper)
"""
from diloco.sweep import product


def get_sweep(arg: str = "tiny"):
    return {"name": f"tau_alpha_{arg}", "experiment": f"experiments/ablate_tau.py:{arg}",
            "points": product(tau=[0, 1, 2, 5, 10, 20], alpha=[0.0, 0.5])}
