"""Downstream multiple-choice evaluation (HellaSwag, PIQA, ARC), computed as lm-eval computes it.

`evaluate(apply_fn, params, vocab, tasks, data_dir, limit, max_len)` scores live parameters;
`diloco eval --workdir DIR …` scores a run's outer parameters (cli.py); lm_adapter.py registers the
`diloco` model with lm-eval; benchmarks.py holds one `Benchmark` record per benchmark. Conventions: docs/eval.md. jax / tfds / lm_eval are imported lazily.
"""
from diloco.eval.benchmarks import BENCHMARKS, Benchmark, DataNotFound, Item, MalformedItem, load_items
from diloco.eval.score import encode_pair, evaluate, loglikelihood_tokens, merge_summary

__all__ = ["evaluate", "encode_pair", "loglikelihood_tokens", "merge_summary", "BENCHMARKS", "Benchmark",
           "DataNotFound", "MalformedItem", "Item", "load_items"]
