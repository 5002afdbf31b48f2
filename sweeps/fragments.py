"""[SD] Fig. 6: fragment size (blocks per fragment) × sequential vs strided, loss and peak bytes.

  diloco sweep sweeps/fragments.py:toy --root runs    (toy: 6 blocks → 1, 2, 3, 6 per fragment)
  diloco sweep sweeps/fragments.py:500M --root …      (18 blocks → 1, 2, 3, 6, 9, 18)
"""
from diloco.sweep import product


def get_sweep(arg: str = "toy"):
    sizes = {"tiny": [1, 3], "toy": [1, 2, 3, 6], "toy-l": [1, 2, 3, 6, 12]}.get(arg, [1, 2, 3, 6, 9, 18])
    return {"name": f"fragments_{arg}", "experiment": f"experiments/ablation.py:{arg}",
            "points": product(layers_per_fragment=sizes, pattern=["strided", "sequential"])}
