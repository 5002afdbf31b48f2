"""CPU toy scale: `experiments/toy.py:dp|diloco|streaming` (one run ≈ 1–2 minutes on 2 cores).

The argument is a method; `streaming` is the paper's final variant, streaming_ovl_fp4 (3-block
strided fragments, τ=1, α=0.5, E3M0), from diloco/outer/methods.py. H=30 for diloco and streaming."""
from diloco.outer import methods
from experiments import base


def get_config(method: str = "streaming"):
    c = base.get_config()
    c.scale, c.seq_len, c.batch_size, c.steps = "toy", 128, 16, 300
    if method not in methods.DEFAULT_VARIANT:
        raise ValueError(f"experiments/toy.py:{method}: choose dp, diloco or streaming")
    for k, v in methods.VARIANTS[methods.DEFAULT_VARIANT[method]].config_overrides().items():
        c[k] = v
    if method != "dp":
        c.H = 30
    return c
