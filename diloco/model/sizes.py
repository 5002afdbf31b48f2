"""`diloco sizes`: every named scale with the exact parameter count of the model a run builds
(jax.eval_shape, nothing allocated), at the vocabulary its runs use."""
from __future__ import annotations

import argparse
import json

from diloco.model.scales import (PAPER_VOCAB, SCALES, VOCAB_PAD, formula_params, label_params, padded_vocab,
                                 run_vocab)


def param_count(name: str, vocab_size: int = PAPER_VOCAB) -> int:
    """Exact parameter count of the Flax model at this scale (shape inference only)."""
    import jax
    import jax.numpy as jnp

    from diloco.model.transformer import ModelConfig, Transformer

    if name not in SCALES:
        raise KeyError(f"unknown scale {name!r}; valid: {', '.join(SCALES)}")
    cfg = ModelConfig.from_scale(name, vocab_size=vocab_size, max_seq_len=8)
    shapes = jax.eval_shape(
        lambda: Transformer(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
    )
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(shapes))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="diloco sizes", description=__doc__.splitlines()[0])
    ap.add_argument("--vocab_size", type=int, help="count every scale at this many embedding rows instead of the "
                    "vocabulary its runs use (byte for tiny/toy/toy-l, T5 32k for the paper's scales)")
    ap.add_argument("--json", action="store_true", help="one JSON list for machines")
    args = ap.parse_args(argv)
    rows = []
    for name, s in SCALES.items():
        if args.vocab_size:
            vocab, ids, n_rows = "given", args.vocab_size, args.vocab_size
        else:
            vocab, ids = run_vocab(name)
            n_rows = padded_vocab(ids)
        n = param_count(name, n_rows)
        target = label_params(s.label)
        rows.append(dict(scale=name, layers=s.layers, d_model=s.d_model, heads=s.heads, mlp_dim=s.mlp_dim,
                         vocab=vocab, vocab_ids=ids, embedding_rows=n_rows, params=n,
                         formula=formula_params(name, n_rows), paper_size=s.label if target else None,
                         vs_paper_size=(n / target - 1) if target else None))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    head = (f"{'scale':<6} {'layers':>6} {'d_model':>7} {'heads':>5} {'mlp_dim':>7}  {'vocabulary (ids → rows)':<26}"
            f" {'parameters':>15}  {'paper size':>10} {'difference':>10}")
    print(head)
    for r in rows:
        vocab = f"{r['vocab']} ({r['vocab_ids']:,} → {r['embedding_rows']:,})"
        diff = f"{100 * r['vs_paper_size']:+.1f}%" if r["vs_paper_size"] is not None else ""
        print(f"{r['scale']:<6} {r['layers']:>6} {r['d_model']:>7} {r['heads']:>5} {r['mlp_dim']:>7}  {vocab:<26}"
              f" {r['params']:>15,}  {r['paper_size'] or '':>10} {diff:>10}")
    print("parameters: exact count of the model a run at that scale builds (tied input/output embedding, its rows\n"
          f"  padded to a multiple of {VOCAB_PAD}); paper size: what the scaling-laws paper calls this shape.\n"
          "`diloco simulate --model 1B` uses the Streaming DiLoCo paper's nominal 1e9 (its Table 4 is calibrated on\n"
          "  it); `--model 1B --params 1.27B` simulates this count instead.")
    return 0
