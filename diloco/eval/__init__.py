"""Downstream multiple-choice evaluation (HellaSwag, PIQA, ARC), computed as lm-eval computes it.

`evaluate(apply_fn, params, vocab, tasks, data_dir, limit, max_len)` scores live parameters;
`diloco eval --workdir DIR …` scores a run's outer parameters (cli.py); lm_adapter.py registers the
`diloco` model with lm-eval. Conventions: docs/eval.md. jax / tfds / lm_eval are imported lazily.
"""
from diloco.eval.score import encode_pair, evaluate, loglikelihood_tokens, merge_summary
from diloco.eval.tasks import TASKS, DataNotFound, Item, MalformedItem, load_items

__all__ = ["evaluate", "encode_pair", "loglikelihood_tokens", "merge_summary", "TASKS",
           "DataNotFound", "MalformedItem", "Item", "load_items"]
