"""The real training loop (train()) with the real data loader: which rows each replica gets, and
that with M=1, outer lr 1, momentum 0 (α=0, τ=0, no codec) the DiLoCo family ends at DP's parameters."""
import json

import jax
import numpy as np
import pytest

from conftest import tiny_config
from diloco.checkpoint import Checkpointer
from diloco.data import reader, store
from diloco.data.reader import StoreBatches
from diloco.errors import ConfigError
from diloco.train import train
from diloco.eval.runs import load_run
from diloco.trainer import Trainer


def record_inner_batches(monkeypatch) -> list:
    """The (R, B, L) tokens of every jitted inner step train() runs, in order."""
    seen, real_fn = [], Trainer.inner_step

    def rec_fn(self, active=None, jitted=True):
        f = real_fn(self, active, jitted)
        if not jitted:
            return f

        def g(state, tokens, *rest):
            seen.append(np.array(tokens))
            return f(state, tokens, *rest)
        return g

    monkeypatch.setattr(Trainer, "inner_step", rec_fn)
    return seen


def test_replicas_get_different_rows_that_together_cover_the_global_batch_once(tmp_path, monkeypatch):
    seen_global, real_next = [], StoreBatches.__next__

    def rec_next(self):
        b = real_next(self)
        seen_global.append(np.array(b))  # one process: its rows are the whole global batch
        return b

    monkeypatch.setattr(StoreBatches, "__next__", rec_next)
    seen_replica = record_inner_batches(monkeypatch)
    cfg = tiny_config("diloco", replicas=2, batch_size=4, steps=4, H=2, eval_every=4, checkpoint_every=4)
    train(cfg, tmp_path / "run", progress=False)
    assert len(seen_replica) == 4 and len(seen_global) >= 4
    for glob, per in zip(seen_global, seen_replica):
        R, B, L = per.shape
        assert (R, B * R, L) == (2, glob.shape[0], glob.shape[1])
        rows = [tuple(r) for r in per.reshape(R * B, L)]
        assert sorted(rows) == sorted(tuple(r) for r in glob)  # the global batch, each row once
        assert not any(np.array_equal(per[0, i], per[1, j]) for i in range(B) for j in range(B))
    # and the next step's rows are new ones
    assert not np.array_equal(seen_replica[0], seen_replica[1])


def test_M1_outer_lr1_momentum0_ends_with_dp_parameters(tmp_path):
    """θᵍ ← θᵍ − 1·(θᵍ − θ) = θ at every sync and the merge (α=0) puts it back: the replica of DiLoCo and
    of Streaming (P=3 staggered fragments) ends where DP ends, through train() and the real data loader;
    DiLoCo's θᵍ too (its last sync is the last step). Streaming's θᵍ of fragments 1, 2 is that of their
    last sync (steps 4, 5 of 6), so it is not compared."""
    common = dict(replicas=1, steps=6, H=3, eval_every=6, checkpoint_every=6)
    runs = {"dp": tiny_config("dp", **common),
            "diloco": tiny_config("diloco", **common, **{"outer.lr": 1.0, "outer.momentum": 0.0}),
            "streaming": tiny_config("streaming", **common, tau=0, alpha=0.0, codec="none", layers_per_fragment=1,
                                     **{"outer.lr": 1.0, "outer.momentum": 0.0})}
    params, outer = {}, {}
    for name, cfg in runs.items():
        assert cfg.optimizer.to_dict() == runs["dp"].optimizer.to_dict()
        s = train(cfg, tmp_path / name, progress=False)
        if name == "streaming":
            assert s["fragments"] == 3
        _, tr, state = load_run(tmp_path / name)
        params[name] = [np.asarray(x)[0] for x in jax.tree_util.tree_leaves(state.params)]  # replica 0 of 1
        outer[name] = [np.asarray(x) for x in jax.tree_util.tree_leaves(tr.eval_params(state))]
    start = [np.asarray(x) for x in jax.tree_util.tree_leaves(Trainer(runs["dp"]).init_params())]
    for name in ("diloco", "streaming"):
        worst = max(float(np.max(np.abs(x - y))) for x, y in zip(params["dp"], params[name]))
        assert worst < 1e-5, (name, worst)
    worst = max(float(np.max(np.abs(x - y))) for x, y in zip(params["dp"], outer["diloco"]))
    assert worst < 1e-5, worst
    assert max(float(np.max(np.abs(x - y))) for x, y in zip(params["dp"], start)) > 1e-3  # training moved them


def test_a_run_on_a_token_store_logs_its_batch_hashes_and_refuses_another_store_before_restoring(tmp_path, monkeypatch, gcs):
    """train() on tokens:gs://… (the storage emulator): replicas get disjoint rows, every metrics row's data_hash
    is the reader's pure function of the step; resumed after another corpus was tokenized to the same path, it
    stops with one ConfigError naming both fingerprints, before the model state is read."""
    from test_store import make_text_corpus

    a = gcs.url("stores", "run")
    store.tokenize(make_text_corpus(tmp_path / "ca", n_train=4, size=20_000), "byte", a, workers=1, progress=False)
    seen = record_inner_batches(monkeypatch)
    cfg = tiny_config("diloco", replicas=2, batch_size=4, steps=4, H=2, log_every=1, eval_every=4,
                      checkpoint_every=2, data=f"tokens:{a}")
    train(cfg, tmp_path / "run", progress=False)
    it = reader.StoreBatches(a, 32, 4, cfg.seed)
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["data_hash"] for r in rows] == [it.batch_hash(t, t + 1) for t in range(4)]
    for t, per in enumerate(seen):  # replica r holds rows r·2, r·2+1 of the global batch
        assert np.array_equal(per.reshape(4, 32), it.read(t))
    monkeypatch.setattr(Checkpointer, "restore", lambda *a, **k: pytest.fail("the model state was read"))
    fa = store.read_manifest(a)["fingerprint"]
    store.tokenize(make_text_corpus(tmp_path / "cb", n_train=4, size=21_000), "byte", a, workers=1, progress=False)
    fb = store.read_manifest(a)["fingerprint"]  # another corpus tokenized to the path the run was started on
    assert fa != fb
    with pytest.raises(ConfigError, match=f"token store {fa} .*this run reads {fb}"):
        train(cfg, tmp_path / "run", progress=False)


def test_a_checkpoint_of_the_per_host_reader_is_refused_in_one_line_before_the_model_is_read(tmp_path, monkeypatch):
    """A run folder written before #30 (config.json with data_readers, a checkpoint whose data state is the per-host
    shard reader's {epoch, shard, pos, batches}): resuming stops with one ConfigError on `data` saying the order
    changed and what to do, before the model state is restored; its config.json is left as it was. diloco sweep
    counts such a finished point as finished (not stale: data_readers is a key the spec no longer has)."""
    from diloco.sweep import stale_fields

    old_state = {"version": 1, "data": "stdlib", "vocab": "byte", "split": "train", "seed": 0, "pack": True,
                 "shuffle": True, "seq_len": 32, "num_shards": 30, "content": "0123456789abcdef", "epoch": 0,
                 "shard": 0, "pos": 256, "batches": 2}
    real_save = Checkpointer.save
    monkeypatch.setattr(Checkpointer, "save", lambda self, step, state, meta: real_save(self, step, state,
                                                                                       {**meta, "data": old_state}))
    cfg = tiny_config("dp", steps=2, eval_every=2, checkpoint_every=2, log_every=2)
    wd = tmp_path / "run"
    train(cfg, wd, progress=False)
    monkeypatch.setattr(Checkpointer, "save", real_save)
    rec = json.loads((wd / "config.json").read_text())
    (wd / "config.json").write_text(json.dumps({**rec, "data_readers": 0}))  # as the older code wrote it
    before = (wd / "config.json").read_text()
    point = {"spec": "experiments/toy.py:dp", "overrides": [f"--config.{k}={v}" for k, v in
             {"scale": "tiny", "seq_len": 32, "batch_size": 4, "steps": 2, "log_every": 2, "eval_every": 2,
              "eval_batches": 2, "checkpoint_every": 2, "optimizer.warmup_steps": 2}.items()]}
    assert stale_fields(point, wd) == []  # the finished point stays finished
    assert stale_fields(point, wd, ["--config.steps=3"]) == ["steps"]  # (a changed value is still seen)
    monkeypatch.setattr(Checkpointer, "restore", lambda *a, **k: pytest.fail("the model state was read"))
    with pytest.raises(ConfigError) as e:
        train(cfg, wd, progress=False)
    msg = str(e.value)
    assert e.value.field == "data" and "\n" not in msg, msg
    assert "per-host shard reader" in msg and "another order" in msg and "--fresh" in msg
    assert (wd / "config.json").read_text() == before


def test_runs_rows_say_which_data_order_a_run_read(tmp_path):
    """runs.csv's data_order (diloco/report/records.py): a finished run recorded before #30 (no data_order in its
    summary, a corpus spec) read the per-host shard order; one that says so, or read tokens:, the store's."""
    from diloco.report.records import load_runs

    cases = {"old": ({"data": "stdlib", "data_readers": 0}, {"final_eval_loss": 5.0}),
             "new": ({"data": "stdlib"}, {"final_eval_loss": 5.0, "data_order": "store"}),
             "old_store": ({"data": "tokens:gs://b/s"}, {"final_eval_loss": 5.0}),
             "unfinished": ({"data": "stdlib"}, None)}
    for name, (cfg, summ) in cases.items():
        wd = tmp_path / "sw" / name
        wd.mkdir(parents=True)
        (wd / "config.json").write_text(json.dumps({"method": "dp", "scale": "tiny", **cfg}))
        if summ:
            (wd / "summary.json").write_text(json.dumps(summ))
    got = dict(zip(*(load_runs(tmp_path)[c] for c in ("point", "data_order"))))
    assert got == {"old": "per-host shards (before #30)", "new": "store", "old_store": "store", "unfinished": ""}
