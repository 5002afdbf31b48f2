"""[SD] Fig. 12: M = 2 → 4 → 8 replicas at a fixed token budget.

  experiments/ablate_replicas.py:<scale>,<M>,<fixed>
  fixed: global (global batch fixed, local batch = B/M shrinks) | local (local batch fixed: global
         batch grows M/2×, steps shrink 2/M×)
"""
from experiments import ablation, common


def get_config(arg: str = "toy,2,global"):
    a = common.parse(arg, "ablate_replicas", ("scale", "replicas", "fixed"))
    if a["fixed"] not in ("global", "local"):
        raise ValueError(f"experiments/ablate_replicas.py: fixed={a['fixed']!r}; use global or local")
    c = ablation.get_config(a["scale"])
    m = int(a["replicas"])
    c.replicas = m
    if a["fixed"] == "local":  # per-replica batch stays what it is at M=2
        c.batch_size, c.steps = c.batch_size * m // 2, max(1, c.steps * 2 // m)
    return c
