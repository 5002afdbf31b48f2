"""[SD] Fig. 8 and Fig. 10: overlap τ ∈ {0…20} × merge α ∈ {0, 0.5}, and heterogeneous τ2.

  experiments/ablate_tau.py:<scale>
H is 30 at every scale (the toy twins too) so that τ up to 20 stays legal (τ < H); the sweep sets
--config.tau / --config.alpha, or --config.replica_tau=1,<τ2> with α=0.5 for Fig. 10.
"""
from experiments import ablation


def get_config(arg: str = "toy"):
    c = ablation.get_config(arg)
    c.H = 30
    return c
