"""Items/s of native downstream scoring (diloco.eval) for a toy model.

  python benchmarks/bench_eval.py [--data_dir ../shared/data/eval] [--scale toy] [--limit 200]
      [--max_len 128] [--batch_size 32] [--workdir RUN]   # RUN: score a run's checkpoint instead

Reports compile+first pass and a second (warm) pass separately; items/s counts multiple-choice
items (each is 2-5 log-likelihood requests).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_data = os.environ.get("DILOCO_EVAL_DATA") or str(Path(__file__).resolve().parents[2] / "shared/data/eval")
    ap.add_argument("--data_dir", default=default_data)
    ap.add_argument("--tasks", default="hellaswag,piqa,arc_easy")
    ap.add_argument("--scale", default="toy")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--max_len", type=int, default=128)
    ap.add_argument("--batch_size", type=int, default=32)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from diloco.eval import benchmarks, evaluate

    if args.workdir:
        from diloco.eval.cli import load_run

        apply_fn, params, vocab = load_run(args.workdir)[:3]
    else:
        from diloco.data import get_vocabulary
        from diloco.model import ModelConfig, Transformer

        vocab = get_vocabulary("byte")
        model = Transformer(ModelConfig.from_scale(args.scale, vocab_size=vocab.vocab_size))
        params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
        apply_fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    n_req = {t: sum(len(it.choices) for it in benchmarks.load_items(t, args.data_dir, args.limit))
             for t in args.tasks.split(",")}
    out = {"backend": jax.default_backend(), "devices": len(jax.devices()), "scale": args.scale,
           "workdir": args.workdir, "max_len": args.max_len, "batch_size": args.batch_size}
    for label in ("cold", "warm"):
        t0 = time.perf_counter()
        res = evaluate(apply_fn, params, vocab, args.tasks, args.data_dir, args.limit, args.max_len,
                       args.batch_size)
        dt = time.perf_counter() - t0
        n = sum(r["n"] for r in res.values())
        out[label] = {"items": n, "requests": sum(n_req.values()), "seconds": round(dt, 2),
                      "items_per_s": round(n / dt, 1), "requests_per_s": round(sum(n_req.values()) / dt, 1),
                      "per_task_items_per_s": {t: round(r["items_per_s"], 1) for t, r in res.items()}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
