"""Log-likelihood scoring in JAX and lm-eval's multiple-choice metrics.

apply_fn(params, tokens_BxL) -> logits_BxLxV (float). Requests are (context_ids, continuation_ids);
each is left-truncated to the last max_len + 1 tokens, fed as tokens[:-1], and scored on the
continuation's positions (lm-eval's HF causal-LM convention; docs/eval.md).
"""
from __future__ import annotations

import functools
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from diloco.eval import benchmarks
from diloco.rundir import atomic_write_text, write_jsonl

ApplyFn = Callable[[Any, Any], Any]
Pair = tuple[Sequence[int], Sequence[int]]


def encode_pair(encode: Callable[[str], list[int]], context: str, continuation: str
                ) -> tuple[list[int], list[int]]:
    """lm-eval's causal rule: trailing spaces of the context move to the continuation; the whole
    string is encoded once and split after len(encode(context)) tokens."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = list(encode(context + continuation)), list(encode(context))
    return ctx, whole[len(ctx):]


def _bucket(n: int, max_len: int) -> int:
    return min(max_len, max(16, 1 << (n - 1).bit_length()))


@functools.lru_cache(maxsize=8)
def _scorer(apply_fn: ApplyFn):
    import jax
    import jax.numpy as jnp

    @jax.jit
    def score(params, tokens_BxL, targets_BxL, mask_BxL):
        logits_BxLxV = apply_fn(params, tokens_BxL).astype(jnp.float32)
        logp_BxLxV = jax.nn.log_softmax(logits_BxLxV, axis=-1)
        tgt_BxL = jnp.take_along_axis(logp_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
        ll_B = jnp.sum(jnp.where(mask_BxL, tgt_BxL, 0.0), axis=-1)
        hit_BxL = jnp.argmax(logits_BxLxV, axis=-1) == targets_BxL
        greedy_B = jnp.all(hit_BxL | ~mask_BxL, axis=-1)
        return ll_B, greedy_B

    return score


def loglikelihood_tokens(apply_fn: ApplyFn, params: Any, pairs: Sequence[Pair], max_len: int,
                         batch_size: int = 32, prefix_id: int = 1) -> list[tuple[float, bool]]:
    """[(sum log p(continuation | context), continuation is the greedy decode)] per pair.

    An empty context is replaced by [prefix_id] (EOS, as lm-eval does). Each request keeps its last
    max_len + 1 tokens. A continuation longer than max_len (where lm-eval's HF model stops with an
    assertion) is scored in consecutive chunks of max_len tokens, each a request of its own whose
    context is everything before it; the chunks' log-likelihoods add up.
    Identical requests are scored once; requests are sorted longest first and right-padded (token 0)
    to a power-of-two length, so each distinct length compiles once and padding cannot leak into a
    causal model.
    """
    keys: list[list[tuple[tuple[int, ...], int]]] = []
    for ctx, cont in pairs:
        ctx, cont = list(ctx) or [prefix_id], list(cont)
        if not cont:
            raise ValueError("empty continuation: nothing to score")
        parts = []
        for a in range(0, len(cont), max_len):
            piece = cont[a:a + max_len]
            parts.append((tuple((ctx + cont[:a] + piece)[-(max_len + 1):]), len(piece)))
        keys.append(parts)
    order = sorted({k for parts in keys for k in parts}, key=lambda k: (-len(k[0]), k[0], k[1]))
    score = _scorer(apply_fn)
    results: dict[tuple[tuple[int, ...], int], tuple[float, bool]] = {}
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        L = _bucket(len(chunk[0][0]) - 1, max_len)
        tokens_BxL = np.zeros((batch_size, L), np.int32)
        targets_BxL = np.zeros((batch_size, L), np.int32)
        mask_BxL = np.zeros((batch_size, L), bool)
        for b, (whole, n_cont) in enumerate(chunk):
            n = len(whole) - 1
            tokens_BxL[b, :n] = whole[:-1]
            targets_BxL[b, :n] = whole[1:]
            mask_BxL[b, n - n_cont:n] = True
        ll_B, greedy_B = score(params, tokens_BxL, targets_BxL, mask_BxL)
        ll_B, greedy_B = np.asarray(ll_B), np.asarray(greedy_B)
        for b, key in enumerate(chunk):
            results[key] = (float(ll_B[b]), bool(greedy_B[b]))
    out = []
    for parts in keys:
        rs = [results[k] for k in parts]
        out.append((rs[0][0] if len(rs) == 1 else float(sum(r[0] for r in rs)), all(r[1] for r in rs)))
    return out


# ---------------------------------------------------------------- metrics (lm-eval's definitions)

def item_metrics(lls: Sequence[float], choices: Sequence[str], label: int) -> dict[str, Any]:
    """pred = argmax ll; pred_norm = argmax ll / len(choice) in characters (lm-eval `acc_norm`,
    the choice without the leading delimiter); first index wins ties (np.argmax)."""
    lls_C = np.asarray(lls, np.float64)
    chars_C = np.array([float(len(c)) for c in choices])
    with np.errstate(divide="ignore", invalid="ignore"):
        pred_norm = int(np.argmax(lls_C / chars_C))
    pred = int(np.argmax(lls_C))
    return {"pred": pred, "pred_norm": pred_norm, "acc": float(pred == label),
            "acc_norm": float(pred_norm == label)}


def aggregate(rows: Sequence[dict]) -> dict[str, float]:
    """Mean acc / acc_norm and lm-eval's stderr of the mean (sample std, ddof=1, / sqrt n)."""
    n = len(rows)
    out: dict[str, float] = {"n": n}
    for m in ("acc", "acc_norm"):
        x = np.array([r[m] for r in rows], np.float64)
        out[m] = float(x.mean()) if n else float("nan")
        out[f"{m}_stderr"] = float(x.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    return out


def score_items(apply_fn: ApplyFn, params: Any, vocab: Any, items: Sequence[benchmarks.Item],
                contexts: Sequence[str], max_len: int, batch_size: int = 32) -> list[dict]:
    """One row per item: task, id, loglikelihoods, continuation_bytes, label, pred, pred_norm…"""
    pairs, spans = [], []
    for it, ctx in zip(items, contexts):
        spans.append((len(pairs), len(it.choices)))
        pairs += [encode_pair(vocab.encode, ctx, " " + c) for c in it.choices]
    out = loglikelihood_tokens(apply_fn, params, pairs, max_len, batch_size, vocab.eos_id)
    rows = []
    for it, (s, n) in zip(items, spans):
        lls = [ll for ll, _ in out[s:s + n]]
        rows.append({"task": it.benchmark, "id": it.id, "loglikelihoods": lls,
                     "continuation_bytes": [len(c.encode("utf-8")) for c in it.choices],
                     "continuation_chars": [len(c) for c in it.choices],
                     "label": it.label, **item_metrics(lls, it.choices, it.label)})
    return rows


def evaluate(apply_fn: ApplyFn, params: Any, vocab: Any, tasks: list[str] | str,
             data_dir: str | None, limit: int | None, max_len: int, batch_size: int = 32,
             num_fewshot: int = 0, seed: int = 0, output: str | None = None
             ) -> dict[str, dict[str, float]]:
    """Zero-shot (or k-shot) acc / acc_norm of `params` on each task: {"piqa": {"acc": …}}.

    data_dir: original files or a TFDS data_dir (None: $DILOCO_EVAL_DATA). output: a JSONL with
    one row per item. Raises DataNotFound / MalformedItem rather than reporting a zero.
    """
    names = benchmarks.parse_benchmarks(tasks)
    loaded = {t: benchmarks.load_items(t, data_dir, limit) for t in names}  # fail before scoring
    results, all_rows = {}, []
    for t in names:
        items = loaded[t]
        t0 = time.perf_counter()
        contexts = benchmarks.fewshot_contexts(t, items, data_dir, num_fewshot, seed)
        rows = score_items(apply_fn, params, vocab, items, contexts, max_len, batch_size)
        results[t] = dict(aggregate(rows), num_fewshot=num_fewshot,
                          items_per_s=len(items) / max(time.perf_counter() - t0, 1e-9))
        all_rows += rows
    if output:
        write_jsonl(output, all_rows)
    return results


# ---------------------------------------------------------------- files

def merge_summary(path: str | os.PathLike, downstream: dict[str, Any]) -> dict:
    """summary.json["downstream"][task] = metrics, keeping every other key; temp file + os.replace."""
    path = Path(path)
    summary = json.loads(path.read_text()) if path.exists() else {}
    summary.setdefault("downstream", {}).update(downstream)
    atomic_write_text(path, json.dumps(summary, indent=1, sort_keys=True) + "\n")
    return summary
