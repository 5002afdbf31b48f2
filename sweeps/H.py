"""[SD] Fig. 13: H ∈ {5, 10, 30, 100} at a fixed number of steps, DiLoCo vs Streaming DiLoCo.

  diloco sweep sweeps/H.py:toy --root runs
"""
from diloco.sweep import product


def get_sweep(arg: str = "toy"):
    return {"name": f"H_{arg}", "experiment": "experiments/ablate_H.py",
            "points": product(arg=[f"{arg},diloco", f"{arg},streaming"], H=[5, 10, 30, 100])}
