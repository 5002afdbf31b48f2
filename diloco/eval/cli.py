"""`diloco eval --workdir DIR --tasks hellaswag,piqa,arc_easy,arc_challenge --data_dir PATH`:
zero-shot acc / acc_norm of a run's θᵍ drained (the parameters summary.json reports; --params for the
undrained θᵍ or one replica), lm-eval's way (docs/eval.md)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, NamedTuple

from diloco.checkpoint import CheckpointError
from diloco.eval import benchmarks, score


class LoadedRun(NamedTuple):
    apply_fn: Callable
    params: Any
    vocab: Any
    max_len: int
    about: dict  # which parameters (drained | undrained | replica:K), step, params_sha256


def load_run(workdir: str | Path, params: str = "drained") -> LoadedRun:
    """A run's newest checkpoint, ready to score: by default θᵍ drained, whose sha256 is summary.json's
    params_sha256 (diloco.eval.runs.load_eval_params)."""
    from diloco.eval.runs import load_eval_params

    cfg, model, p, vocab, about = load_eval_params(workdir, params)
    max_len = int(cfg.get("seq_len", 0) or model.cfg.max_seq_len)
    return LoadedRun(lambda q, x: model.apply({"params": q}, x), p, vocab, max_len, about)


def describe_params(about: dict) -> str:
    """One line: which parameters of a run are being scored, at which step, and their sha256."""
    which, frags = about["params"], about.get("drained_fragments") or []
    what = {"drained": f"θᵍ drained (fragments in flight {frags} applied), the params summary.json reports"
                       if frags else "θᵍ (no fragment in flight), the params summary.json reports",
            "undrained": "θᵍ undrained (as checkpointed, fragments in flight not applied)"}.get(
        which, f"replica {which[8:]}'s inner parameters")
    return f"params: {what}; step {about['step']}; params_sha256 {about['params_sha256']}"


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
    ap.add_argument("--params", default="drained", metavar="drained|undrained|replica:K",
                    help="which parameters of the run: θᵍ drained (default: the fragments in flight applied, "
                         "summary.json's params_sha256 and final_eval_loss), θᵍ undrained (as checkpointed), "
                         "or replica K's inner parameters (Table 3-style comparisons)")
    ap.add_argument("--no_summary", action="store_true",
                    help="do not merge into summary.json (only drained results are ever merged)")
    args = ap.parse_args(argv)
    try:
        if args.limit is not None and args.limit < 1:
            raise ValueError(f"--limit {args.limit}: give a number of items ≥ 1, or leave it out for every item")
        names = benchmarks.parse_benchmarks(args.tasks)
        from diloco import rundir

        if not (rundir.RunDir(args.workdir) / "config.json").exists():  # the run first: then its eval data
            raise FileNotFoundError(f"--workdir {args.workdir}: no run there (no config.json); give the --workdir "
                                    "of a `diloco train` run")
        for t in names:  # data problems before the (slow) checkpoint restore
            benchmarks.load_items(t, args.data_dir, args.limit)
        run = load_run(args.workdir, args.params)
        print(describe_params(run.about), flush=True)
        res = score.evaluate(run.apply_fn, run.params, run.vocab, names, args.data_dir, args.limit,
                             args.max_len or run.max_len, args.batch_size, args.num_fewshot, args.seed,
                             args.output)
    except (benchmarks.DataNotFound, benchmarks.MalformedItem, FileNotFoundError, ValueError) as e:
        print(f"diloco eval: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:  # a checkpoint of another state, unreadable storage, all corrupt
        print(f"diloco eval: {e}", file=sys.stderr)
        return 4
    if not args.no_summary and run.about["params"] == "drained":  # summary.json describes θᵍ drained
        score.merge_summary(Path(args.workdir) / "summary.json", res)
    elif not args.no_summary:
        print(f"diloco eval: --params {args.params}: not merged into summary.json (it reports θᵍ drained)",
              file=sys.stderr)
    print(f"{'task':<14} {'n':>6} {'acc':>7} {'acc_norm':>8} {'items/s':>8}")
    for t, m in res.items():
        print(f"{t:<14} {m['n']:>6} {m['acc']:>7.4f} {m['acc_norm']:>8.4f} {m['items_per_s']:>8.1f}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
