"""[SD] Fig. 11: outer-gradient compression — lower precision vs pruning at matched bytes.

  experiments/ablate_compression.py:<scale>,<scheme>
  scheme: fp32 | bf16 | fp8 | fp4 (E3M0) | topk | dare | dropout | int2 (2-bit), and fp4_ef | int2_ef | topk_ef
          (the same with error feedback)
Pruning keeps as many values as fit in FP4's payload (≈0.52 bytes/element with block 256):
values are float32 (+int32 indices for top-k), so top-k keeps 1/16 and DARE/FedDropout 1/8.
"""
from experiments import ablation, common

SCHEMES = {"fp32": ("none", 1.0), "bf16": ("bf16", 1.0), "fp8": ("fp8_e4m3", 1.0), "fp4": ("e3m0", 1.0),
           "topk": ("topk", 1 / 16), "dare": ("dare", 1 / 8), "dropout": ("dropout", 1 / 8),
           "int2": ("int2", 1.0)}
# With error feedback (each replica re-sends what its codec dropped; docs/architecture.md): same bytes.
SCHEMES.update({f"{k}_ef": v for k, v in SCHEMES.items() if k in ("fp4", "int2", "topk")})


def get_config(arg: str = "toy,fp4"):
    a = common.parse(arg, "ablate_compression", ("scale", "scheme"))
    if a["scheme"] not in SCHEMES:
        raise ValueError(f"experiments/ablate_compression.py: scheme {a['scheme']!r} not in {list(SCHEMES)}")
    c = ablation.get_config(a["scale"])
    c.codec, c.codec_keep_fraction = SCHEMES[a["scheme"]]
    c.error_feedback = a["scheme"].endswith("_ef")
    if c.codec == "dropout":
        c.codec_block_size = 64 if a["scale"] in common.TOY_SCALES else 256  # whole units (neurons) dropped
    return c
