"""[SD] Table 5 (M=2) and Table 6 (M=2, 4): C4, Chinchilla-optimal, 35M…4B.

  experiments/c4_scaling.py:<scale>,<method>[,<M>]
  scale:  35M 100M 200M 300M 500M 1B 4B (paper) | tiny toy toy-l (CPU twins, embedded corpus)
  method: dp | diloco_h30 | streaming_ovl_fp4_h30 | streaming_ovl_fp4_h100 (also streaming_h30, streaming_ovl_h30)
  M:      replicas (2 default; Table 6 also 4). The global batch stays fixed ([SL]: B/M per replica).
"""
from experiments import common


def get_config(arg: str = "toy,streaming_ovl_fp4_h30"):
    a = common.parse(arg, "c4_scaling", ("scale", "method", "replicas"), {"replicas": "2"})
    c = common.new()
    c.replicas = int(a["replicas"])
    common.sized(c, a["scale"], replicas=None if a["method"] == "dp" else c.replicas)
    return common.method(c, a["method"])
