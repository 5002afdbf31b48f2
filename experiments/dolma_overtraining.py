"""[SD] Table 1 / Table 7: 1B over-trained on Dolma (seq 2048, H=100) at 25B / 100B / 250B tokens.

  experiments/dolma_overtraining.py:<scale>,<tokens>,<method>[,<M>]
  scale:  1B (paper) | tiny toy (CPU twins: 1×, 4×, 10× a short toy budget)
  tokens: 25B | 100B | 250B
  method: dp | streaming_ovl_fp4_h100 (the paper's "Ours")
  M:      2 (Table 1) | 4 (Table 7: global batch doubled, steps halved)
Dolma is read as TFDS `dolma` under --config.data_dir, or --config.data=dolma:<glob of .jsonl[.gz]>.
"""
from experiments import common

BUDGET = {"25B": 1, "100B": 4, "250B": 10}  # × the 1B model's 25B-token Chinchilla budget


def get_config(arg: str = "tiny,25B,streaming_ovl_fp4_h100"):
    a = common.parse(arg, "dolma_overtraining", ("scale", "tokens", "method", "replicas"), {"replicas": "2"})
    if a["tokens"] not in BUDGET:
        raise ValueError(f"experiments/dolma_overtraining.py: tokens {a['tokens']!r} not in {list(BUDGET)}")
    c = common.new()
    c.replicas = int(a["replicas"])
    toy = a["scale"] in common.TOY_SCALES
    common.sized(c, a["scale"], replicas=None if a["method"] == "dp" else c.replicas,
                 budget=BUDGET[a["tokens"]] * (0.5 if toy else 1), data="dolma", seq_len=2048)
    if c.replicas == 4 and a["method"] != "dp":  # Table 7: M=4 doubles the global batch, halves the steps
        c.batch_size, c.steps = 2 * c.batch_size, c.steps // 2
    return common.method(c, a["method"])
