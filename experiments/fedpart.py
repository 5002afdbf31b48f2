"""[SD] §3.3 FedPart-style baseline: only the fragment that syncs next trains, the rest is frozen
(18-layer 500M, 3 blocks per fragment → 83% frozen): 3.2145 vs 2.6749 without freezing.

  experiments/fedpart.py:<scale>,<freeze>     freeze: true | false
No overlap (τ=0), FP32 exchange, as a plain fragment-wise DiLoCo.
"""
from experiments import ablation, common


def get_config(arg: str = "toy,true"):
    a = common.parse(arg, "fedpart", ("scale", "freeze"))
    if a["freeze"] not in ("true", "false"):
        raise ValueError(f"experiments/fedpart.py: freeze={a['freeze']!r}; use true or false")
    c = ablation.get_config(a["scale"])
    c.tau, c.alpha, c.codec = 0, 0.0, "none"
    c.freeze_non_syncing = a["freeze"] == "true"
    if a["scale"] in common.TOY_SCALES:
        c.layers_per_fragment = 1  # toy: 6 one-block fragments → 5/6 = 83% frozen, as the paper's 15/18
    return c
