"""[SD] Fig. 12: M ∈ {2, 4, 8} with the global batch fixed or the local batch fixed (token budget fixed).

  diloco sweep sweeps/replicas.py:toy --root runs
"""
from diloco.sweep import product


def get_sweep(arg: str = "toy"):
    return {"name": f"replicas_{arg}", "experiment": "experiments/ablate_replicas.py",
            "points": product(arg=[f"{arg},{m},{fx}" for fx in ("global", "local") for m in (2, 4, 8)])}
