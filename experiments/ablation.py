"""[SD] §3.3: the ablation model every ablation sweep starts from — 500M on C4 (Chinchilla budget,
11B tokens), Streaming DiLoCo with 3-block strided fragments, overlapped FP4, M=2, H=30.

  experiments/ablation.py:<scale>         500M (paper) | tiny toy toy-l (CPU twins)
The sweeps in sweeps/ vary one thing at a time from here (or from a spec built on it:
experiments/ablate_*.py, fedpart.py) with --config overrides: fragments.py (layers_per_fragment,
pattern), tau_alpha.py, hetero_tau.py (replica_tau), compression.py (codec), H.py, fedpart.py
(freeze_non_syncing). The settings whose batch/steps depend on the axis have their own spec:
experiments/ablate_replicas.py (sweeps/replicas.py).
"""
from experiments import common


def get_config(arg: str = "toy"):
    a = common.parse(arg, "ablation", ("scale",))
    c = common.new()
    common.sized(c, a["scale"])
    return common.method(c, "streaming_ovl_fp4_h30")
