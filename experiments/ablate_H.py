"""[SD] Fig. 13: H at a fixed total number of steps, DiLoCo vs Streaming DiLoCo.

  experiments/ablate_H.py:<scale>,<method>     method: diloco | streaming (overlapped FP4)
The sweep sets --config.H.
"""
from experiments import ablation, common


def get_config(arg: str = "toy,streaming"):
    a = common.parse(arg, "ablate_H", ("scale", "method"))
    if a["method"] not in ("diloco", "streaming"):
        raise ValueError(f"experiments/ablate_H.py: method {a['method']!r}; use diloco or streaming")
    c = ablation.get_config(a["scale"])
    if a["method"] == "diloco":
        c.method, c.layers_per_fragment, c.tau, c.alpha, c.codec = "diloco", 0, 0, 0.0, "none"
    return c
