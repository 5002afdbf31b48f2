"""Downstream evaluation: readers, lm-eval prompts, scoring, metrics, CLI, lm-eval adapter."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

for _k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ[_k] = "1"

from conftest import tiny_config  # noqa: E402
from diloco.eval import benchmarks as B, cli, score  # noqa: E402

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
EVAL = SHARED / "data" / "eval"
V = 259  # seqio.ByteVocabulary: 3 specials + 256 bytes


@pytest.fixture
def data() -> Path:
    if not EVAL.is_dir():
        pytest.skip(f"needs the real validation items in {EVAL} (../shared beside the repo)")
    return EVAL


class ByteVocab:
    """seqio.ByteVocabulary's mapping without importing TensorFlow: byte b -> id b + 3."""
    eos_id, vocab_size = 1, V

    def encode(self, s: str) -> list[int]:
        return [b + 3 for b in s.encode("utf-8")]

    def decode(self, ids) -> str:
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", "replace")


def uniform_apply(params, tokens_BxL):
    import jax.numpy as jnp

    return jnp.zeros(tokens_BxL.shape + (V,), jnp.float32)


def bigram_apply(params, tokens_BxL):
    return params["table_VxV"][tokens_BxL]


@pytest.fixture(scope="module")
def tiny():
    import jax
    import jax.numpy as jnp

    from diloco.model import ModelConfig, Transformer

    model = Transformer(ModelConfig.from_scale("tiny", vocab_size=V))
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
    return (lambda p, x: model.apply({"params": p}, x)), params


# ---------------------------------------------------------------- readers and prompts

def test_item_counts_of_shared_files(data):
    assert len(B.load_items("piqa", data)) == 1838
    assert len(B.load_items("arc_easy", data)) == 2376
    assert len(B.load_items("hellaswag", data)) == 1000
    assert len(B.load_docs("arc_easy", data, "train")) == 2251
    assert len(B.load_items("piqa", data, limit=7)) == 7


def test_real_items_parse_as_lm_eval_prompts_them(data):
    piqa = B.load_items("piqa", data)[0]
    assert piqa.query == "Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:"
    assert piqa.choices[1].endswith("ripped jeans material, you will also need to supply it with a "
                                    "water bottle and a food dish.") and piqa.label == 0
    labels = (data / "piqa" / "valid-labels.lst").read_text().split()
    assert [it.label for it in B.load_items("piqa", data)] == [int(x) for x in labels]
    arc = B.load_items("arc_easy", data)
    numeric = [it for it, (_, d) in zip(arc, B.load_docs("arc_easy", data)) if d["answerKey"] == "3"]
    assert numeric and all(it.label == 2 for it in numeric)  # numeric key "3" -> third choice
    assert {len(it.choices) for it in arc} == {3, 4, 5}
    hs = B.load_items("hellaswag", data)[0]
    assert hs.query.startswith("Pole vault: Pole vault is a sport") and hs.query.endswith("A few women")
    assert hs.label == 3 and len(hs.choices) == 4


def test_hellaswag_prompt_hand_built():
    doc = {"activity_label": "Home and Garden", "ctx_a": "[header] How to plant  a tree [title] Dig.",
           "ctx_b": "then You WATER it", "endings": [" [step] Water it. ", "Stop [title] now"], "label": "1"}
    q, choices, label = B.BENCHMARKS["hellaswag"].prompt(doc)
    # capitalize() upper-cases the first letter of ctx_b and lower-cases the rest, like lm-eval.
    assert q == "Home and Garden: How to plant a tree. Dig. Then you water it"
    assert choices == [" Water it.", "Stop. now"] and label == 1  # strip happens before tag removal


def test_hellaswag_all_shared_items_equal_lm_eval_process_docs(data):
    import importlib.util

    import datasets
    import lm_eval

    path = Path(lm_eval.__file__).parent / "tasks" / "hellaswag" / "utils.py"
    spec = importlib.util.spec_from_file_location("lm_eval_hellaswag_utils", path)
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    docs = [d for _, d in B.load_docs("hellaswag", data)]
    theirs = utils.process_docs(datasets.Dataset.from_list(docs))
    ours = B.load_items("hellaswag", data)
    assert [(d["query"], tuple(d["choices"]), d["gold"]) for d in theirs] == \
        [(it.query, it.choices, it.label) for it in ours]


def test_arc_and_piqa_prompts_hand_built():
    q, ch, lab = B.BENCHMARKS["arc_easy"].prompt({"question": "Q?", "choices": {"text": ["x", "y", "z"],
                                             "label": ["1", "2", "3"]}, "answerKey": "2"})
    assert (q, ch, lab) == ("Question: Q?\nAnswer:", ["x", "y", "z"], 1)
    q, ch, lab = B.BENCHMARKS["piqa"].prompt({"goal": "G", "sol1": "a", "sol2": "b", "label": 1})
    assert (q, ch, lab) == ("Question: G\nAnswer:", ["a", "b"], 1)


def _write(path: Path, lines: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))


def test_one_record_is_all_a_new_benchmark_needs(tmp_path, monkeypatch):
    """Loading, checking, prompting and scoring dispatch only through the Benchmark record."""
    def read(files, errors):
        return [(f"{files[0]}:{n}", {"q": q, "a": a, "b": b, "gold": g}) for n, (q, a, b, g)
                in enumerate(json.loads(files[0].read_text()), 1)]

    def check(doc):
        if doc["gold"] not in (0, 1):
            raise ValueError(f"gold {doc['gold']!r} is not 0 or 1")

    toy = B.Benchmark("toy_qa", lambda d: (f"Q: {d['q']}", [d["a"], d["b"]], d["gold"]), check, read,
                      lambda ex, i, info: {}, "validation", "none.yaml",
                      {"validation": [("toy/val.json",)]}, "toy_qa", "write DATA/toy/val.json")
    monkeypatch.setitem(B.BENCHMARKS, "toy_qa", toy)
    _write(tmp_path / "toy/val.json", [[["x", "aa", "bbbbbb", 0], ["y", "cccc", "dd", 1]]])
    items = B.load_items("toy_qa", tmp_path)
    assert [(it.benchmark, it.id, it.query, it.choices, it.label) for it in items] == [
        ("toy_qa", "0", "Q: x", ("aa", "bbbbbb"), 0), ("toy_qa", "1", "Q: y", ("cccc", "dd"), 1)]
    # uniform model: acc picks the shorter choice (index 0, then 1) -> both right
    res = score.evaluate(uniform_apply, {}, ByteVocab(), "toy_qa", str(tmp_path), None, max_len=64)
    assert res["toy_qa"]["n"] == 2 and res["toy_qa"]["acc"] == 1.0
    _write(tmp_path / "toy/val.json", [[["x", "aa", "b", 2]]])
    with pytest.raises(B.MalformedItem, match=r"val.json:1: gold 2 is not 0 or 1"):
        B.load_items("toy_qa", tmp_path)
    with pytest.raises(B.DataNotFound, match=r"To obtain it: write .*/toy/val.json"):
        B.load_items("toy_qa", tmp_path / "absent")


def test_malformed_items_are_reported_with_line_numbers(tmp_path):
    _write(tmp_path / "piqa/valid.jsonl", [{"goal": "g", "sol1": "a", "sol2": "b"}] * 2
           + [{"goal": "g", "sol1": "a"}, {"goal": "g", "sol1": "a", "sol2": "b"}])
    (tmp_path / "piqa/valid-labels.lst").write_text("0\n1\n0\n2\n")
    with pytest.raises(B.MalformedItem) as e:
        B.load_items("piqa", tmp_path)
    msg = str(e.value)
    assert "2 malformed" in msg and "valid.jsonl:3" in msg and "'sol2'" in msg
    assert "valid.jsonl:4" in msg and "label '2' is not 0 or 1" in msg
    good = {"id": "a", "question": {"stem": "s", "choices": [{"text": "x", "label": "A"},
                                                             {"text": "y", "label": "B"}]}, "answerKey": "B"}
    _write(tmp_path / "arc/ARC-Easy-Test.jsonl", [good, dict(good, answerKey="E"), "{not json",
                                                 {"id": "b", "question": {"choices": []}, "answerKey": "A"}])
    with pytest.raises(B.MalformedItem) as e:
        B.load_items("arc_easy", tmp_path)
    msg = str(e.value)
    assert ("ARC-Easy-Test.jsonl:2: answerKey 'E'" in msg and "ARC-Easy-Test.jsonl:3: not valid JSON" in msg
            and "ARC-Easy-Test.jsonl:4: missing field 'stem'" in msg)
    hs = {"activity_label": "a", "ctx_a": "b", "ctx_b": "c", "endings": ["x", "y"], "label": 1}
    _write(tmp_path / "hellaswag/hellaswag_val.jsonl", [hs, dict(hs, label=4)])
    with pytest.raises(B.MalformedItem, match=r"hellaswag_val.jsonl:2: label 4 is not an index"):
        B.load_items("hellaswag", tmp_path)


def test_absent_data_says_where_and_how(tmp_path, monkeypatch):
    with pytest.raises(B.DataNotFound) as e:
        B.load_items("arc_challenge", tmp_path)
    msg = str(e.value)
    assert str(tmp_path / "arc/ARC-Challenge-Test.jsonl") in msg and "ARC-V1-Feb2018.zip" in msg
    assert "tfds.builder('ai2_arc/ARC-Challenge'" in msg and "(TFDS)" in msg
    monkeypatch.delenv(B.ENV_DATA, raising=False)
    with pytest.raises(B.DataNotFound, match="--data_dir PATH or set \\$DILOCO_EVAL_DATA"):
        B.load_items("piqa", None)
    monkeypatch.setenv(B.ENV_DATA, str(tmp_path))
    with pytest.raises(B.DataNotFound, match="piqa/valid-labels.lst"):
        B.load_items("piqa", None)
    with pytest.raises(ValueError, match="unknown task"):
        B.parse_benchmarks("piqa,mmlu")


def test_tfds_layout_is_read(tmp_path):
    tfds = pytest.importorskip("tensorflow_datasets")

    class Piqa(tfds.core.GeneratorBasedBuilder):  # the TFDS `piqa` features, built locally
        VERSION = tfds.core.Version("1.0.0")
        name = "piqa"

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
                "id": tfds.features.Text(), "goal": tfds.features.Text(), "sol1": tfds.features.Text(),
                "sol2": tfds.features.Text(), "label": tfds.features.ClassLabel(num_classes=2)}))

        def _split_generators(self, dl_manager):
            return {"validation": self._generate_examples()}

        def _generate_examples(self):
            for i in range(3):
                yield i, {"id": f"p{i}", "goal": f"goal {i}", "sol1": "a", "sol2": "é", "label": i % 2}

    Piqa(data_dir=str(tmp_path)).download_and_prepare()
    items = sorted(B.load_items("piqa", tmp_path), key=lambda it: it.id)  # TFDS stores hash order
    assert [(it.id, it.query, it.choices, it.label) for it in items] == [
        (f"p{i}", f"Question: goal {i}\nAnswer:", ("a", "é"), i % 2) for i in range(3)]


# ---------------------------------------------------------------- scoring and metrics

def test_item_metrics_hand_computed():
    # acc: argmax ll; acc_norm: argmax ll / len(choice) in characters; ties -> first index.
    m = score.item_metrics([-10.0, -12.0], ["ab", "abcdefgh"], label=1)
    assert (m["pred"], m["pred_norm"], m["acc"], m["acc_norm"]) == (0, 1, 0.0, 1.0)
    m = score.item_metrics([-3.0, -3.0, -6.0], ["x", "y", "zz"], label=0)
    assert (m["pred"], m["pred_norm"]) == (0, 0)
    # "éé" is 2 characters but 4 bytes: per character -2.0 vs -1.5 -> 1 (per byte it would be 0).
    assert score.item_metrics([-4.0, -4.5], ["éé", "abc"], label=1)["pred_norm"] == 1


def test_aggregate_matches_lm_eval_stderr():
    rows = [{"acc": a, "acc_norm": b} for a, b in [(1, 0), (0, 0), (1, 1), (1, 0)]]
    agg = score.aggregate(rows)
    assert agg["n"] == 4 and agg["acc"] == 0.75 and agg["acc_norm"] == 0.25
    assert math.isclose(agg["acc_stderr"], np.std([1, 0, 1, 1], ddof=1) / 2)


def test_encode_pair_moves_trailing_space():
    v = ByteVocab()
    assert score.encode_pair(v.encode, "Answer: ", "yes") == (v.encode("Answer:"), v.encode(" yes"))
    assert score.encode_pair(v.encode, "Q", " a") == (v.encode("Q"), v.encode(" a"))


def test_uniform_model_known_loglikelihoods_and_accuracy(tmp_path):
    """All-zero logits: ll = -(n + 1)·log 259 for an n-byte ASCII choice (the ' ' delimiter is scored),
    so acc picks the shortest choice; acc_norm divides by n only, -(n + 1)/n grows with n, so it
    picks the longest; ties go to index 0."""
    rows = [("g1", "aa", "bbbbbb", 0), ("g2", "cccc", "dd", 1), ("g3", "eee", "f", 0), ("g4", "hh", "ii", 1)]
    _write(tmp_path / "piqa/valid.jsonl", [{"goal": g, "sol1": a, "sol2": b} for g, a, b, _ in rows])
    (tmp_path / "piqa/valid-labels.lst").write_text("".join(f"{l}\n" for *_, l in rows))
    out = tmp_path / "rows.jsonl"
    res = score.evaluate(uniform_apply, {}, ByteVocab(), ["piqa"], str(tmp_path), None, max_len=64,
                         batch_size=3, output=str(out))
    # pred (shortest) 0,1,1,0 ; pred_norm (longest) 1,0,0,0 ; gold 0,1,0,1 -> acc 2/4, acc_norm 1/4
    assert res["piqa"]["n"] == 4 and res["piqa"]["acc"] == 0.5 and res["piqa"]["acc_norm"] == 0.25
    got = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["pred"] for r in got] == [0, 1, 1, 0] and [r["pred_norm"] for r in got] == [1, 0, 0, 0]
    assert got[0]["loglikelihoods"] == pytest.approx([-3 * math.log(V), -7 * math.log(V)], rel=1e-6)
    assert set(got[0]) >= {"task", "id", "loglikelihoods", "continuation_bytes", "label", "pred", "pred_norm"}
    assert got[1]["continuation_bytes"] == [4, 2] and got[1]["id"] == "1" and got[1]["task"] == "piqa"


def test_bigram_model_matches_hand_computation_and_truncation():
    rng = np.random.default_rng(0)
    table = rng.normal(size=(V, V)).astype(np.float32)
    logp = table - np.log(np.exp(table).sum(-1, keepdims=True))
    v = ByteVocab()
    ctx, cont = v.encode("hello world, this is"), v.encode(" a test")
    want = sum(logp[a, b] for a, b in zip((ctx + cont)[:-1], (ctx + cont)[1:]))
    want_cont = sum(logp[a, b] for a, b in zip((ctx + cont)[len(ctx) - 1:-1], cont))
    (ll, greedy), (ll_empty, _) = score.loglikelihood_tokens(
        bigram_apply, {"table_VxV": table}, [(ctx, cont), ([], cont)], max_len=64, batch_size=2)
    assert ll == pytest.approx(want_cont, abs=1e-4) and want != want_cont
    assert ll_empty == pytest.approx(logp[1, cont[0]] + sum(logp[a, b] for a, b in zip(cont[:-1], cont[1:])), abs=1e-4)
    greedy_want = all(int(np.argmax(table[a])) == b for a, b in zip((ctx + cont)[len(ctx) - 1:-1], cont))
    assert greedy == greedy_want
    # a continuation longer than the window is scored in window-sized chunks; for a bigram model
    # (one token of context) that is exact.
    long_cont = v.encode(" " + "xyz" * 30)
    (ll_long, _), = score.loglikelihood_tokens(bigram_apply, {"table_VxV": table}, [(ctx, long_cont)], 16)
    full = ctx + long_cont
    assert ll_long == pytest.approx(sum(logp[a, b] for a, b in zip(full[len(ctx) - 1:-1], long_cont)), abs=1e-3)


def test_left_truncation_and_batch_invariance(tiny):
    apply_fn, params = tiny
    rng = np.random.default_rng(1)
    ctx, cont = list(rng.integers(3, V, 40)), list(rng.integers(3, V, 5))
    others = [(list(rng.integers(3, V, n)), list(rng.integers(3, V, 3))) for n in (3, 11, 30)]
    (ll_trunc, _), = score.loglikelihood_tokens(apply_fn, params, [(ctx, cont)], max_len=16)
    kept = (ctx + cont)[-17:]  # the last max_len + 1 tokens; the model sees them from position 0
    (ll_manual, _), = score.loglikelihood_tokens(apply_fn, params, [(kept[:-5], kept[-5:])], max_len=512)
    assert ll_trunc == pytest.approx(ll_manual, abs=1e-5)
    (ll_full, _), = score.loglikelihood_tokens(apply_fn, params, [(ctx, cont)], max_len=512)
    assert abs(ll_full - ll_trunc) > 1e-4  # truncation really dropped context
    mixed = score.loglikelihood_tokens(apply_fn, params, others + [(ctx, cont)] + others, 512, batch_size=3)
    assert mixed[3][0] == pytest.approx(ll_full, abs=1e-5) and mixed[0] == mixed[4]


# ---------------------------------------------------------------- CLI, summary, live API

def test_cli_writes_rows_and_merges_summary(tmp_path, data, tiny, monkeypatch):
    apply_fn, params = tiny
    monkeypatch.setattr(cli, "load_run", lambda wd, which: cli.LoadedRun(
        apply_fn, params, ByteVocab(), 128, {"params": which, "step": 0, "params_sha256": "-"}))
    (tmp_path / "summary.json").write_text(json.dumps({"final_eval_loss": 2.5, "downstream": {"x": 1}}))
    (tmp_path / "config.json").write_text("{}")  # a run folder (load_run, replaced above, reads the rest)
    out = tmp_path / "items.jsonl"
    rc = cli.main(["--workdir", str(tmp_path), "--tasks", "piqa,arc_easy", "--data_dir", str(data),
                   "--limit", "4", "--output", str(out)])
    assert rc == 0
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["task"] for r in rows] == ["piqa"] * 4 + ["arc_easy"] * 4
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_eval_loss"] == 2.5 and summary["downstream"]["x"] == 1
    assert summary["downstream"]["piqa"]["n"] == 4
    assert summary["downstream"]["arc_easy"]["acc"] == np.mean([r["pred"] == r["label"] for r in rows[4:]])
    assert not list(tmp_path.glob(".summary.json.*"))  # temp file replaced, not left behind
    assert cli.main(["--workdir", str(tmp_path), "--tasks", "arc_challenge", "--data_dir", str(tmp_path)]) == 2


# ---------------------------------------------------------------- lm-eval adapter

def test_native_and_lm_eval_adapter_agree_item_by_item(tmp_path, data, tiny):
    """lm-eval's own default YAMLs (prompts, metrics) over the shared files, offline, vs native."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from diloco.eval import lm_adapter

    apply_fn, params = tiny
    vocab, limit, max_len = ByteVocab(), 6, 128
    names = lm_adapter.write_local_tasks(data, tmp_path / "tasks", ["hellaswag", "piqa", "arc_easy"])
    lm = lm_adapter.DilocoLM.from_params(apply_fn, params, vocab, max_len, batch_size=16)
    res = lm_eval.simple_evaluate(model=lm, tasks=names, limit=limit, num_fewshot=0, log_samples=True,
                                  task_manager=TaskManager(include_path=str(tmp_path / "tasks")))
    for task in ("hellaswag", "piqa", "arc_easy"):
        items = B.load_items(task, data, limit)
        rows = score.score_items(apply_fn, params, vocab, items, [it.query for it in items], max_len, 16)
        samples = sorted(res["samples"][f"{task}_local"], key=lambda s: s["doc_id"])
        assert len(samples) == len(rows) == limit
        for it, row, s in zip(items, rows, samples):
            assert [tuple(a) for a in s["arguments"]] == [(it.query, " " + c) for c in it.choices]
            assert [r[0][0] for r in s["resps"]] == pytest.approx(row["loglikelihoods"], abs=1e-4)
            assert s["acc"] == row["acc"] and s["acc_norm"] == row["acc_norm"] and s["target"] == row["label"]
        agg = score.aggregate(rows)
        assert res["results"][f"{task}_local"]["acc,none"] == pytest.approx(agg["acc"])
        assert res["results"][f"{task}_local"]["acc_norm,none"] == pytest.approx(agg["acc_norm"])


def test_fewshot_contexts_match_lm_eval_sampler(tmp_path, data):
    import lm_eval
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

    from diloco.eval import lm_adapter

    class Constant(LM):
        def loglikelihood(self, requests, disable_tqdm=False):
            return [(-1.0, False)] * len(requests)

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            raise NotImplementedError

        def generate_until(self, requests, disable_tqdm=False):
            raise NotImplementedError

    names = lm_adapter.write_local_tasks(data, tmp_path, ["arc_easy"])
    res = lm_eval.simple_evaluate(model=Constant(), tasks=names, limit=5, num_fewshot=3, fewshot_random_seed=7,
                                  task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True)
    items = B.load_items("arc_easy", data, 5)
    ours = B.fewshot_contexts("arc_easy", items, data, 3, seed=7)
    theirs = [s["arguments"][0][0] for s in sorted(res["samples"]["arc_easy_local"], key=lambda s: s["doc_id"])]
    assert ours == theirs and ours[0].count("\n\n") == 3
    assert B.fewshot_contexts("arc_easy", items, data, 3, seed=8) != ours


def test_loglikelihood_rolling_uniform():
    from diloco.eval import lm_adapter

    class Req:
        def __init__(self, s):
            self.args = (s,)

    lm = lm_adapter.DilocoLM.from_params(uniform_apply, {}, ByteVocab(), max_length=8)
    text = "twenty-one characters"
    (total,) = lm.loglikelihood_rolling([Req(text)])
    assert total == pytest.approx(-len(text.encode()) * math.log(V), rel=1e-6)
    with pytest.raises(NotImplementedError, match="log-likelihoods only"):
        lm.generate_until([])


def test_lm_eval_registry_finds_diloco_and_builtins():
    code = ("import diloco.eval.lm_adapter\nfrom lm_eval.api.registry import get_model\n"
            "print(get_model('diloco').__name__, get_model('dummy').__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["DilocoLM", "DummyLM"]


@pytest.mark.slow
def test_trained_toy_checkpoint_native_vs_lm_eval_cli(tmp_path, data):
    """End to end: train the toy DP run, `diloco eval`, then lm-eval's CLI through the wrapper."""
    wd, env = tmp_path / "run", dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    subprocess.run([sys.executable, "-m", "diloco.cli", "train", "--config", "experiments/toy.py:dp",
                    "--workdir", str(wd), "--config.steps=40", "--no_progress"], check=True, env=env,
                   cwd=Path(__file__).resolve().parents[1])
    out = tmp_path / "native.jsonl"
    assert cli.main(["--workdir", str(wd), "--tasks", "hellaswag,piqa,arc_easy", "--data_dir", str(data),
                     "--limit", "25", "--output", str(out)]) == 0
    native = [json.loads(l) for l in out.read_text().splitlines()]
    subprocess.run([sys.executable, "-m", "diloco.eval.lm_eval_main", "--local_data", str(data), "--model",
                    "diloco", "--model_args", f"workdir={wd}", "--batch_size", "32", "--tasks",
                    "hellaswag_local,piqa_local,arc_easy_local", "--limit", "25", "--log_samples",
                    "--output_path", str(tmp_path / "lm")], check=True, env=env)
    by_task = {}
    for f in (tmp_path / "lm").rglob("samples_*.jsonl"):
        task = f.name.split("samples_")[1].rsplit("_local", 1)[0]
        by_task[task] = sorted((json.loads(l) for l in f.read_text().splitlines()), key=lambda s: s["doc_id"])
    assert set(by_task) == {"hellaswag", "piqa", "arc_easy"}
    for task, samples in by_task.items():
        rows = [r for r in native if r["task"] == task]
        assert len(rows) == len(samples) == 25
        for r, s in zip(rows, samples):
            assert [float(x[0][0]) for x in s["resps"]] == pytest.approx(r["loglikelihoods"], abs=1e-3)
            assert (float(s["acc"]), float(s["acc_norm"])) == (float(r["pred"] == r["label"]), float(r["pred_norm"] == r["label"]))


# ---------------------------------------------------------------- what `diloco eval` scores

@pytest.fixture(scope="module")
def streaming_in_flight(tmp_path_factory):
    """A tiny Streaming run (40 steps, H=10, τ=2) that ends with fragments in flight."""
    from diloco.train import train

    wd = tmp_path_factory.mktemp("streaming_in_flight")
    cfg = tiny_config("streaming", steps=40, H=10, tau=2, layers_per_fragment=1, checkpoint_every=20, eval_every=20)
    summary = train(cfg, wd, progress=False)
    assert summary["drained_fragments"], "the run must end with fragments in flight for this test to mean anything"
    assert summary["final_eval_loss"] != summary["final_eval_loss_undrained"]
    return cfg, wd, summary


def _eval_loss(cfg, apply_fn, params) -> float:
    """The loss of `params` on the run's own eval batches, through the model alone (not the trainer)."""
    import jax
    import jax.numpy as jnp

    from diloco.data import eval_batches
    from diloco.model import loss_fn

    ce = jax.jit(lambda p, x: loss_fn(apply_fn(p, x), x, cfg.model.z_loss)[1]["ce"])
    return float(np.mean([float(ce(params, jnp.asarray(b))) for b in
                          eval_batches(cfg.data, cfg.vocab, cfg.seq_len, cfg.batch_size, cfg.eval_batches)]))


def test_diloco_eval_scores_the_drained_params_the_summary_reports(streaming_in_flight):
    """What `diloco eval` (and lm-eval through the adapter) loads is θᵍ drained: its sha256 is the
    summary's params_sha256 and its loss on the eval batches is final_eval_loss."""
    from diloco.outer.sync import params_sha256

    cfg, wd, summary = streaming_in_flight
    got = cli.load_run(wd)
    assert params_sha256(got.params) == summary["params_sha256"] == got.about["params_sha256"]
    assert got.about["params"] == "drained" and got.about["drained_fragments"] == summary["drained_fragments"]
    assert _eval_loss(cfg, got.apply_fn, got.params) == pytest.approx(summary["final_eval_loss"], rel=1e-6, abs=0)


def test_diloco_eval_undrained_and_one_replica_on_request(streaming_in_flight):
    import jax

    from diloco.outer.sync import params_sha256
    from diloco.eval.runs import load_run

    cfg, wd, summary = streaming_in_flight
    und = cli.load_run(wd, "undrained")
    assert und.about["params"] == "undrained" and params_sha256(und.params) != summary["params_sha256"]
    assert _eval_loss(cfg, und.apply_fn, und.params) == pytest.approx(summary["final_eval_loss_undrained"],
                                                                      rel=1e-6, abs=0)
    _, _, state = load_run(wd)
    rep = cli.load_run(wd, "replica:1")
    for a, b in zip(jax.tree_util.tree_leaves(rep.params), jax.tree_util.tree_leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[1])
    assert rep.about["params_sha256"] == params_sha256(rep.params)


def test_diloco_eval_says_which_params_it_scored(streaming_in_flight, data, capsys):
    _, wd, summary = streaming_in_flight
    assert cli.main(["--workdir", str(wd), "--tasks", "piqa", "--data_dir", str(data), "--limit", "2",
                     "--no_summary"]) == 0
    out = capsys.readouterr().out
    line = out.splitlines()[0]
    assert "drained" in line and summary["params_sha256"] in line and "step 40" in line, out
    assert cli.main(["--workdir", str(wd), "--params", "replica:2", "--tasks", "piqa", "--data_dir", str(data)]) == 2
    err = capsys.readouterr().err
    assert "--params" in err and "replica:0" in err and "replica:1" in err and len(err.strip().splitlines()) == 1


def test_eval_of_a_missing_run_says_the_run_is_missing(tmp_path, capsys):
    """The run is checked before its eval data: a folder with no run says so, not that hellaswag is missing."""
    assert cli.main(["--workdir", str(tmp_path / "nope"), "--data_dir", str(tmp_path / "nodata")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"diloco eval: --workdir {tmp_path / 'nope'}: no run there (no config.json); give the --workdir "
                   "of a `diloco train` run"], err
