"""[SD] Table 1 / 7: 1B on Dolma at 25B / 100B / 250B tokens; DP and Streaming (M = 2, 4).

  diloco sweep sweeps/dolma_overtraining.py:tiny --root runs      (CPU twin)
  diloco sweep sweeps/dolma_overtraining.py:1B --root …  --set data_dir=…
"""
from diloco.sweep import product


def get_sweep(arg: str = "tiny"):
    runs = [("dp", 2), ("streaming_ovl_fp4_h100", 2), ("streaming_ovl_fp4_h100", 4)]
    args = [f"{arg},{tok},{m},{M}" for tok in ("25B", "100B", "250B") for m, M in runs]
    return {"name": f"dolma_overtraining_{arg}", "experiment": "experiments/dolma_overtraining.py",
            "points": product(arg=args)}
