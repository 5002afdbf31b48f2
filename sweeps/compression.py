"""[SD] Fig. 11: FP32 / bf16 / FP8 / FP4 outer gradients vs top-k, DARE and FedDropout at FP4's bytes;
beyond the paper, 2-bit (int2) and FP4 / int2 / top-k with error feedback.

  diloco sweep sweeps/compression.py:toy --root runs
"""
from diloco.sweep import product


def get_sweep(arg: str = "toy"):
    schemes = ["fp32", "bf16", "fp8", "fp4", "topk", "dare", "dropout", "int2", "fp4_ef", "int2_ef", "topk_ef"]
    return {"name": f"compression_{arg}", "experiment": "experiments/ablate_compression.py",
            "points": product(arg=[f"{arg},{s}" for s in schemes])}
