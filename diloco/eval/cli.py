"""`diloco eval --workdir DIR --tasks hellaswag,piqa,arc_easy,arc_challenge --data_dir PATH`:
zero-shot acc / acc_norm of a run's outer parameters, lm-eval's way (docs/eval.md)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

from diloco.eval import benchmarks, score


def load_run(workdir: str | Path) -> tuple[Callable, Any, Any, int]:
    """(apply_fn, outer params, vocab, context window) of a run's newest checkpoint."""
    from diloco.trainer import load_eval_params

    cfg, model, params, vocab = load_eval_params(workdir)
    max_len = int(cfg.get("seq_len", 0) or model.cfg.max_seq_len)
    return (lambda p, x: model.apply({"params": p}, x)), params, vocab, max_len


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="diloco eval", description=__doc__)
    ap.add_argument("--workdir", required=True, help="run directory (config.json, ckpt/)")
    ap.add_argument("--tasks", default="hellaswag,piqa,arc_easy,arc_challenge",
                    help=f"comma-separated subset of {','.join(benchmarks.BENCHMARKS)}")
    ap.add_argument("--data_dir", default=None,
                    help=f"original files or a TFDS data_dir (default: ${benchmarks.ENV_DATA})")
    ap.add_argument("--limit", type=int, default=None, help="first N items of each task")
    ap.add_argument("--output", default=None, help="JSONL, one row per item")
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--max_len", type=int, default=None, help="context window (default: seq_len)")
    ap.add_argument("--num_fewshot", type=int, default=0)
    ap.add_argument("--seed", type=int, default=1234, help="few-shot sampling seed (1234 = lm-eval's default)")
    ap.add_argument("--no_summary", action="store_true", help="do not merge into summary.json")
    args = ap.parse_args(argv)
    try:
        names = benchmarks.parse_benchmarks(args.tasks)
        for t in names:  # data problems before the (slow) checkpoint restore
            benchmarks.load_items(t, args.data_dir, args.limit)
        apply_fn, params, vocab, max_len = load_run(args.workdir)
        res = score.evaluate(apply_fn, params, vocab, names, args.data_dir, args.limit,
                             args.max_len or max_len, args.batch_size, args.num_fewshot, args.seed,
                             args.output)
    except (benchmarks.DataNotFound, benchmarks.MalformedItem, FileNotFoundError, ValueError) as e:
        print(f"diloco eval: {e}", file=sys.stderr)
        return 2
    if not args.no_summary:
        score.merge_summary(Path(args.workdir) / "summary.json", res)
    print(f"{'task':<14} {'n':>6} {'acc':>7} {'acc_norm':>8} {'items/s':>8}")
    for t, m in res.items():
        print(f"{t:<14} {m['n']:>6} {m['acc']:>7.4f} {m['acc_norm']:>8.4f} {m['items_per_s']:>8.1f}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
