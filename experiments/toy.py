"""CPU toy scale: `experiments/toy.py:dp|diloco|streaming` (one run ≈ 1–2 minutes on 2 cores)."""
from experiments import base


def get_config(method: str = "streaming"):
    c = base.get_config()
    c.scale, c.seq_len, c.batch_size, c.steps = "toy", 128, 16, 300
    c.method = method
    if method == "dp":
        pass
    elif method == "diloco":
        c.H = 30
    elif method == "streaming":  # the paper's final method: 3-block strided fragments, τ=1, E3M0
        c.H, c.layers_per_fragment, c.pattern, c.tau, c.alpha, c.codec = 30, 3, "strided", 1, 0.5, "e3m0"
    else:
        raise ValueError(f"experiments/toy.py:{method}: choose dp, diloco or streaming")
    return c
