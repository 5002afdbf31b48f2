"""[SD] Fig. 11: FP32 / bf16 / FP8 / FP4 outer gradients vs top-k, DARE and FedDropout at FP4's bytes;
beyond the paper, 2-bit (int2) and FP4 / int2 / top-k with error feedback.

  diloco sweep sweeps/compression.py:toy --root runs
  diloco sweep sweeps/compression.py:tiny,ef --root runs     (FP32, FP4, 2-bit, each ± error feedback where lossy;
                                                              8 seeds: the claims rows for error feedback)
"""
from diloco.sweep import product

EF_SCHEMES = ["fp32", "fp4", "fp4_ef", "int2", "int2_ef"]


def get_sweep(arg: str = "toy"):
    scale, _, group = arg.partition(",")
    if group == "ef":
        return {"name": f"compression_ef_{scale}", "experiment": "experiments/ablate_compression.py",
                "points": product(arg=[f"{scale},{s}" for s in EF_SCHEMES]), "seeds": 8}
    if group:
        raise ValueError(f"sweeps/compression.py:{arg!r}: the group after the scale must be 'ef' (or none)")
    schemes = ["fp32", "bf16", "fp8", "fp4", "topk", "dare", "dropout", "int2", "fp4_ef", "int2_ef", "topk_ef"]
    return {"name": f"compression_{arg}", "experiment": "experiments/ablate_compression.py",
            "points": product(arg=[f"{arg},{s}" for s in schemes])}
