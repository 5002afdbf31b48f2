"""[SD] Table 6: Streaming DiLoCo overlapped FP4 at M ∈ {2, 4} × H ∈ {30, 100}, per scale.

  diloco sweep sweeps/replicas_h.py:toy --root runs     (scales tiny,toy; 'paper' = 35M…1B)
"""
from diloco.sweep import product

PAPER = ["35M", "100M", "200M", "300M", "500M", "1B"]


def get_sweep(arg: str = "toy"):
    scales = {"toy": ["tiny", "toy"], "paper": PAPER}.get(arg, arg.split("+"))
    args = [f"{s},streaming_ovl_fp4_h{h},{m}" for s in scales for m in (2, 4) for h in (30, 100)]
    return {"name": f"replicas_h_{arg}", "experiment": "experiments/c4_scaling.py", "points": product(arg=args)}
