"""`python -m diloco.eval.lm_eval_main [--local_data DIR] <lm_eval CLI args>`: lm_eval's own CLI
with the `diloco` model registered (lm-eval 0.4.13 has no plugin entry points for models).

--local_data DIR writes offline `<task>_local` tasks (hellaswag_local, piqa_local, arc_easy_local,
arc_challenge_local) for the data found under DIR and adds them with --include_path, e.g.
  python -m diloco.eval.lm_eval_main --local_data ../shared/data/eval \
      --model diloco --model_args workdir=runs/toy --tasks piqa_local,arc_easy_local --limit 100
"""
from __future__ import annotations

import sys
import tempfile


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from diloco.eval import lm_adapter  # registers "diloco"
    from diloco.eval import benchmarks

    if "--local_data" in argv:
        i = argv.index("--local_data")
        data_dir, argv = argv[i + 1], argv[:i] + argv[i + 2:]
        available = []
        for b in benchmarks.BENCHMARKS.values():
            try:
                benchmarks.locate(b.name, benchmarks.resolve_data_dir(data_dir), b.eval_split)
                available.append(b.name)
            except benchmarks.DataNotFound:
                pass
        out = tempfile.mkdtemp(prefix="diloco_lm_eval_tasks_")
        names = lm_adapter.write_local_tasks(data_dir, out, available)
        print(f"diloco: local lm-eval tasks {', '.join(names)} in {out}", file=sys.stderr)
        argv += ["--include_path", out]
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *argv]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
