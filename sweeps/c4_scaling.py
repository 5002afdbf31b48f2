"""[SD] Table 5: DP, DiLoCo H=30, Streaming DiLoCo overlapped FP4 at H=30 and H=100, per scale (M=2).

  diloco sweep sweeps/c4_scaling.py:toy --root runs            # CPU: scales tiny,toy
  diloco sweep sweeps/c4_scaling.py:paper --root gs://…        # 35M…4B (the paper ran no 4B DiLoCo/H=30)
  diloco sweep sweeps/c4_scaling.py:35M+100M --root …          # any '+'-joined scales
"""
from diloco.sweep import product

METHODS = ["dp", "diloco_h30", "streaming_ovl_fp4_h30", "streaming_ovl_fp4_h100"]
PAPER = ["35M", "100M", "200M", "300M", "500M", "1B", "4B"]


def get_sweep(arg: str = "toy"):
    scales = {"toy": ["tiny", "toy"], "paper": PAPER}.get(arg, arg.split("+"))
    args = [f"{s},{m}" for s in scales for m in METHODS if not (s == "4B" and m in METHODS[1:3])]
    return {"name": f"c4_scaling_{arg}", "experiment": "experiments/c4_scaling.py", "points": product(arg=args)}
