"""lm-eval model `diloco`: any lm-eval log-likelihood task against a run's outer parameters.

lm-eval 0.4.13 finds models only in its registry (no plugin entry points), so this module must be
imported first: `python -m diloco.eval.lm_eval_main --model diloco --model_args workdir=DIR …`
(or `import diloco.eval.lm_adapter` before `lm_eval.simple_evaluate(model="diloco", …)`).
`write_local_tasks` turns the original data files into offline lm-eval tasks (`<task>_local`)
that reuse lm-eval's own default YAMLs for prompts and metrics.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

import lm_eval.models  # noqa: F401  (built-ins first: lm-eval imports them only into an empty registry)
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from diloco.eval import benchmarks, score


@register_model("diloco")
class DilocoLM(TemplateLM):
    """model_args: workdir=DIR[,params=drained|undrained|replica:K][,max_length=N][,batch_size=B]; by
    default θᵍ drained, the parameters summary.json reports. Scores with score.loglikelihood_tokens."""

    def __init__(self, workdir: str | None = None, batch_size: int | str = 32,
                 max_length: int | str | None = None, params: str = "drained",
                 live: tuple[Callable, Any, Any, int] | None = None, **_ignored: Any):
        super().__init__()
        self.about: dict | None = None
        if live is None:
            if not workdir:
                raise ValueError("diloco model needs --model_args workdir=DIR (a diloco run directory)")
            from diloco.eval.cli import describe_params, load_run

            live = load_run(workdir, str(params))
            self.about = live.about
            print(f"diloco model: {describe_params(live.about)}", file=sys.stderr, flush=True)
        self.apply_fn, self.params, self.vocab, window = live[:4]
        self._max_length = int(max_length) if max_length else int(window)
        bs = str(batch_size)
        self.batch_size = int(bs) if bs.isdigit() else 32  # "auto" -> 32

    @classmethod
    def from_params(cls, apply_fn: Callable, params: Any, vocab: Any, max_length: int,
                    batch_size: int = 32) -> "DilocoLM":
        return cls(live=(apply_fn, params, vocab, max_length), batch_size=batch_size)

    @property
    def eot_token_id(self) -> int:
        return int(self.vocab.eos_id)

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kw) -> list[int]:
        return list(self.vocab.encode(string))

    def tok_decode(self, tokens, **kw) -> str:
        return self.vocab.decode(list(tokens))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kw):
        pairs = [(ctx, cont) for _, ctx, cont in requests]
        out = score.loglikelihood_tokens(self.apply_fn, self.params, pairs, self.max_length,
                                         self.batch_size, self.eot_token_id)
        for (args, _, _), res in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", args, res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Sum of log p over every token of the string: disjoint max_length windows, EOS first."""
        pairs, owner = [], []
        for i, req in enumerate(requests):
            (string,) = req.args[:1]
            windows = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.eot_token_id,
                max_seq_len=self.max_length, context_len=1)
            for w in map(lm_utils.make_disjoint_window, windows):
                pairs.append(w)
                owner.append(i)
        out = score.loglikelihood_tokens(self.apply_fn, self.params, pairs, self.max_length,
                                         self.batch_size, self.eot_token_id)
        totals = [0.0] * len(requests)
        for i, (ll, _) in zip(owner, out):
            totals[i] += ll
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("the diloco lm-eval model scores log-likelihoods only "
                                  "(multiple-choice / perplexity tasks); generation is not supported")


def write_local_tasks(data_dir: str | os.PathLike | None, out_dir: str | os.PathLike,
                      tasks: list[str] | None = None) -> list[str]:
    """For each task with data under data_dir: out_dir/<task>_local.yaml (+ JSONL per split) that
    `include`s lm-eval's default YAML and swaps only the dataset for the local files. Returns the
    task names to pass to lm-eval together with `--include_path out_dir` (fully offline)."""
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    lm_tasks = Path(lm_eval.__file__).resolve().parent / "tasks"
    names = []
    for task in tasks or list(benchmarks.BENCHMARKS):
        spec = benchmarks.BENCHMARKS[task]
        files = {}
        for split in dict.fromkeys([spec.eval_split, "train", "validation"]):
            try:
                docs = benchmarks.load_docs(task, data_dir, split)
            except benchmarks.DataNotFound:
                if split == spec.eval_split:
                    raise
                continue
            path = out / f"{task}_{split}.jsonl"
            score.write_jsonl(path, (d for _, d in docs))
            files[split] = str(path)
        cfg = {"include": str(lm_tasks / spec.lm_eval_yaml), "task": f"{task}_local",
               "tag": ["diloco_local"], "dataset_path": "json", "dataset_name": None,
               "dataset_kwargs": {"data_files": files},
               "training_split": "train" if "train" in files else None,
               "validation_split": "validation" if "validation" in files else None,
               "test_split": "test" if "test" in files else None}
        (out / f"{task}_local.yaml").write_text(json.dumps(cfg, indent=1) + "\n")  # JSON is YAML
        names.append(f"{task}_local")
    return names
