"""[SD] §3.3: FedPart-style frozen fragments vs the same fragment-wise run without freezing.

  diloco sweep sweeps/fedpart.py:toy --root runs
"""
from diloco.sweep import product


def get_sweep(arg: str = "toy"):
    return {"name": f"fedpart_{arg}", "experiment": "experiments/fedpart.py",
            "points": product(arg=[f"{arg},false", f"{arg},true"])}
