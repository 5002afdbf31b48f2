"""[SD] Table 3: one Streaming DiLoCo run; `diloco tables` evaluates θ_1, the replica mean and θ^g.

  diloco sweep sweeps/which_params.py:toy --root runs      (500M in the paper)
"""


def get_sweep(arg: str = "toy"):
    return {"name": f"which_params_{arg}", "experiment": f"experiments/which_params.py:{arg}", "points": [{}]}
