"""Reliability: exact resume (in-process and after SIGKILL/SIGTERM of real processes), checkpoint
atomicity and corruption fallback, numerical faults, replica faults, atomic run records.

Fast by default; the real-subprocess kill/resume matrix is `@pytest.mark.slow` (`pytest -m slow`)."""
from __future__ import annotations

import errno
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from etils import epath

from conftest import REPO, tiny_config
from diloco import checkpoint
from diloco.checkpoint import (CheckpointMismatch, CheckpointUnreadable, Checkpointer, NoUsableCheckpoint, classify,
                               state_checksum, state_mismatch)
from diloco.faults import Faults, NumericalFault
from diloco.rundir import atomic_write_json, code_version, truncate_jsonl
from diloco.train import train
from diloco.eval.runs import load_run
from diloco.trainer import Trainer

TIMING = ("seconds", "tokens_per_s")  # the only metrics fields allowed to differ between two runs


# ---------------------------------------------------------------------------------------------------
# helpers (pure where possible)
def metric_rows(workdir: Path) -> list[dict]:
    return [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines() if l.strip()]


def without_timing(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def ckpt_steps(workdir: Path) -> list[int]:
    d = workdir / "ckpt"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def biggest_file(step_dir: Path) -> Path:
    files = [Path(f) for f in glob.glob(str(step_dir / "**"), recursive=True) if os.path.isfile(f)]
    return max(files, key=lambda f: f.stat().st_size)


def flip_bytes(path: Path, n: int = 16) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        old = f.read(n)
        f.seek(path.stat().st_size // 2)
        f.write(bytes(b ^ 0xFF for b in old))


CORRUPTIONS = {  # name -> what a crash, a full disk or a bad sector can do to the newest checkpoint
    "truncated_array_file": lambda d: os.truncate(biggest_file(d / "state"), biggest_file(d / "state").stat().st_size // 3),
    "flipped_array_bytes": lambda d: flip_bytes(biggest_file(d / "state")),
    "missing_array_metadata": lambda d: os.remove(d / "state" / "_METADATA"),
    "truncated_sidecar": lambda d: os.truncate(d / "meta" / "metadata", 7),
    "every_file_empty": lambda d: [os.truncate(f, 0) for f in glob.glob(str(d / "**"), recursive=True)
                                   if os.path.isfile(f)],
    "deleted_state": lambda d: shutil.rmtree(d / "state"),  # a half-deleted step
    "empty_step_folder": lambda d: [shutil.rmtree(f) if f.is_dir() else f.unlink() for f in d.iterdir()],
}


def small_state(seed: float) -> dict:
    return {"params": {"w": jnp.arange(4096, dtype=jnp.float32) * seed, "b": jnp.full((7,), seed, jnp.bfloat16)},
            "step": jnp.asarray(int(seed), jnp.int32), "flag": jnp.asarray([True, False])}


def saved_run(tmp_path: Path, steps=(3, 6), keep: int = 3) -> tuple[Path, dict]:
    ck = Checkpointer(tmp_path / "ckpt", keep)
    for s in steps:
        ck.save(s, small_state(float(s)), {"step": s})
    ck.close()
    return tmp_path, jax.eval_shape(lambda: small_state(1.0))


def restore(workdir: Path, abstract, quarantine=False, keep: int = 3):
    ck = Checkpointer(workdir / "ckpt", keep)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        got = ck.restore(abstract, quarantine=quarantine)
    return ck, got, [str(w.message) for w in ws]


# ---------------------------------------------------------------------------------------------------
# checkpoint atomicity and corruption (fast: a small pytree, no model)
@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt_newest_checkpoint_falls_back_with_a_warning(tmp_path, kind):
    w, abstract = saved_run(tmp_path)
    CORRUPTIONS[kind](w / "ckpt" / "6")
    ck, got, msgs = restore(w, abstract, quarantine=True)
    assert got is not None and got[0] == 3, kind
    np.testing.assert_array_equal(np.asarray(got[1]["params"]["w"]), np.asarray(small_state(3.0)["params"]["w"]))
    assert any("step 6" in m and "unreadable" in m for m in msgs), msgs
    assert any("ckpt_corrupt" in m for m in msgs), msgs
    # quarantined, so step 6 can be written again (no StepAlreadyExistsError) and is then the newest
    assert ck.steps() == [3] and len(list((w / "ckpt_corrupt").iterdir())) == 1
    ck.save(6, small_state(6.5), {"step": 6})
    ck.close()
    _, got, msgs = restore(w, abstract)
    assert got[0] == 6 and float(got[1]["params"]["b"][0]) == 6.5 and not msgs


def test_a_full_disk_removes_the_partial_checkpoint_keeps_the_last_good_one_and_resumes_after_freeing(tmp_path):
    """A real full disk (a 600 KiB tmpfs, where this test may mount one), else ENOSPC raised by orbax's save."""
    from diloco.checkpoint import DiskFull

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    real = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", mnt], capture_output=True).returncode == 0
    try:
        w, abstract = saved_run(mnt, steps=(3,))
        ck = Checkpointer(w / "ckpt", 3)
        if real:
            (mnt / "fill").write_bytes(bytes(shutil.disk_usage(mnt).free - 8_000))
        else:
            def full(step, **_):
                (w / "ckpt" / f"{step}.orbax-checkpoint-tmp").mkdir()
                raise ValueError(f"RESOURCE_EXHAUSTED: {OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))}")
            ck.mngr.save = full
        with pytest.raises(DiskFull, match=r"no space left .* step 6; its partial files were removed, the previous "
                                           r"checkpoints \[3\] are kept"):
            ck.save(6, small_state(6.0), {"step": 6})
        assert sorted(p.name for p in (w / "ckpt").iterdir()) == ["3"]
        if real:
            (mnt / "fill").unlink()
        else:
            del ck.mngr.save
        ck.save(6, small_state(6.0), {"step": 6})
        ck.close()
        _, got, msgs = restore(w, abstract)
        assert got[0] == 6 and float(got[1]["params"]["b"][0]) == 6.0 and not msgs
    finally:
        if real:
            subprocess.run(["umount", mnt])


def test_flipped_bytes_are_caught_by_the_checksum_not_by_orbax(tmp_path):
    """Orbax reads flipped array bytes back without complaint; only the saved checksum notices."""
    w, abstract = saved_run(tmp_path, steps=(6,))
    flip_bytes(biggest_file(w / "ckpt" / "6" / "state"))
    ck = Checkpointer(w / "ckpt", 3)
    out = ck.mngr.restore(6, args=ck._ocp.args.Composite(state=ck._ocp.args.StandardRestore(abstract),
                                                         meta=ck._ocp.args.JsonRestore()))
    assert state_checksum(out["state"]) != out["meta"]["state_checksum"]
    ck.close()
    with warnings.catch_warnings(record=True) as ws, pytest.raises(NoUsableCheckpoint):
        warnings.simplefilter("always")
        Checkpointer(w / "ckpt", 3).restore(abstract)
    assert any("do not match the checksum" in str(m.message) for m in ws), [str(m.message) for m in ws]


def test_checksum_sees_one_changed_word_in_any_leaf():
    s = small_state(2.0)
    base = state_checksum(s)
    assert base == state_checksum(jax.tree_util.tree_map(jnp.copy, s))
    for path, changed in (("w", s["params"]["w"].at[4000].add(1e-3)), ("b", s["params"]["b"].at[6].set(0))):
        s2 = {**s, "params": {**s["params"], path: changed}}
        assert state_checksum(s2) != base, path
    swapped = {**s, "params": {**s["params"], "w": s["params"]["w"][::-1]}}  # same words, other places
    assert state_checksum(swapped) != base


def test_interrupted_save_leaves_a_tmp_dir_that_readers_ignore_and_resume_removes(tmp_path, capsys):
    """SIGKILL during a save: orbax writes `<step>.orbax-checkpoint-tmp-*` and renames it when done. A reader
    (diloco eval: no quarantine) ignores the leftover; the trainer's resume removes it with one line on stderr,
    every byte of the real checkpoints untouched; the step is saved again."""
    w, abstract = saved_run(tmp_path)
    tmp = w / "ckpt" / "9.orbax-checkpoint-tmp-1234"
    shutil.copytree(w / "ckpt" / "6", tmp)
    os.truncate(biggest_file(tmp), 10)
    real = lambda: {p.relative_to(w): p.read_bytes() for s in ("3", "6") for p in (w / "ckpt" / s).rglob("*") if p.is_file()}
    before = real()
    ck, got, msgs = restore(w, abstract)
    ck.close()
    assert got[0] == 6 and ck.steps() == [3, 6] and not msgs and tmp.is_dir()
    capsys.readouterr()
    ck, got, msgs = restore(w, abstract, quarantine=True)  # as the trainer resumes
    assert got[0] == 6 and not msgs and not tmp.exists() and real() == before
    assert capsys.readouterr().err == ("diloco train: removed 1 unfinished checkpoint folder(s) of a save that was "
                                       "stopped: 9.orbax-checkpoint-tmp-1234\n")
    ck.save(9, small_state(9.0), {"step": 9})
    ck.close()
    _, got, _ = restore(w, abstract)
    assert got[0] == 9 and float(got[1]["params"]["w"][1]) == 9.0


def test_all_checkpoints_corrupt_stops_the_run_and_moves_nothing(tmp_path):
    """Resume never silently means start over: with every checkpoint corrupt the restore raises (the
    CLI exits 4) and the checkpoints stay where they are until --fresh sets them aside."""
    w, abstract = saved_run(tmp_path)
    for s in (3, 6):
        CORRUPTIONS["missing_array_metadata"](w / "ckpt" / str(s))
    ck = Checkpointer(w / "ckpt", 3)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        with pytest.raises(NoUsableCheckpoint, match=r"every checkpoint in .* is corrupt \(steps \[3, 6\]\); "
                                                     r"nothing was moved.*--fresh"):
            ck.restore(abstract, quarantine=True)
    assert sum("is unreadable" in str(m.message) for m in ws) == 2
    assert ck.steps() == [3, 6] and ckpt_steps(w) == [3, 6] and not (w / "ckpt_corrupt").exists()
    ck.close()


# ---------------------------------------------------------------------------------------------------
# a good checkpoint is never thrown away: another state structure, a storage error
def with_leaf(tree, name: str, leaf) -> dict:
    return {**tree, "params": {**tree["params"], name: leaf}}


@pytest.mark.parametrize("change,named", [
    ("version", "its state is version 1, this diloco's is version 5 (the state has params.c that the checkpoint"),
    ("gained", "the state has params.c that the checkpoint lacks"),
    ("lost", "the checkpoint has params.b that the state lacks"),
    ("shape", "params.w is float32[4096] in the checkpoint, float32[4097] in the state"),
    ("dtype", "params.b is bfloat16[7] in the checkpoint, float32[7] in the state"),  # orbax would cast it
])
def test_a_checkpoint_of_another_state_stops_naming_what_differs_and_moves_nothing(tmp_path, change, named,
                                                                                    monkeypatch):
    if change == "version":  # written before checkpoints recorded their state version (version 1)
        monkeypatch.setattr(checkpoint, "STATE_VERSION", 1)
    w, abstract = saved_run(tmp_path)
    monkeypatch.undo()
    changed = {"version": lambda a: with_leaf(a, "c", jax.ShapeDtypeStruct((3,), jnp.float32)),
               "gained": lambda a: with_leaf(a, "c", jax.ShapeDtypeStruct((3,), jnp.float32)),
               "lost": lambda a: {**a, "params": {"w": a["params"]["w"]}},
               "shape": lambda a: with_leaf(a, "w", jax.ShapeDtypeStruct((4097,), jnp.float32)),
               "dtype": lambda a: with_leaf(a, "b", jax.ShapeDtypeStruct((7,), jnp.float32))}[change](abstract)
    ck = Checkpointer(w / "ckpt", 3)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointMismatch) as e:
            ck.restore(changed, quarantine=True)
    msg = str(e.value)
    assert msg.startswith(f"checkpoint at step 6 in {w / 'ckpt'} was written by diloco ") and named in msg, msg
    commit = code_version()["commit"]
    assert commit and f"at commit {commit}" in msg and f"git checkout {commit.removesuffix('-dirty')}" in msg
    assert "Nothing was moved" in msg and "--fresh" in msg and "\n" not in msg and not ws
    assert ckpt_steps(w) == [3, 6] and not (w / "ckpt_corrupt").exists()
    assert ck.restore(abstract, quarantine=True)[0] == 6  # the same checkpoint, for the state it was written for
    ck.close()


def test_state_mismatch_lists_the_first_differing_leaves():
    saved = {f"p.{i}": ((2,), "float32") for i in range(5)}
    assert state_mismatch(saved, dict(saved)) is None
    wanted = {**{k: v for k, v in saved.items() if k != "p.0"}, "p.3": ((3,), "float32"),
              **{f"q.{i}": ((), "int32") for i in range(5)}}
    assert state_mismatch(saved, wanted) == (
        "the state has q.0, q.1, q.2 (+2 more) that the checkpoint lacks; the checkpoint has p.0 that the "
        "state lacks; p.3 is float32[2] in the checkpoint, float32[3] in the state")


@pytest.mark.parametrize("exc,kind", [
    (ValueError("OUT_OF_RANGE: Error reading \"params.w/0\" in OCDBT database: Requested byte range"), "corrupt"),
    (ValueError("FAILED_PRECONDITION: Error reading: Truncated Zstd-compressed stream"), "corrupt"),
    (FileNotFoundError("Metadata file (named _METADATA) does not exist"), "corrupt"),
    (json.JSONDecodeError("Expecting value", "", 0), "corrupt"),
    (ValueError("UNAVAILABLE: error reading gs://b/ckpt/6/state: HTTP 503"), "unreadable"),
    (ValueError("DEADLINE_EXCEEDED: read of gs://b/ckpt/6/state/d/0 timed out"), "unreadable"),
    (OSError(5, "Input/output error"), "unreadable"),
    (ConnectionResetError(104, "Connection reset by peer"), "unreadable"),
    (PermissionError(13, "Permission denied"), "unreadable"),
    (RuntimeError("something nobody has seen"), "unreadable"),  # not known to be corrupt: never moved
    (ValueError("Structure mismatch: Target path ('c',) not found in metadata_tree."), "mismatch"),
])
def test_restore_errors_are_classified(exc, kind):
    try:  # chained as orbax chains TensorStore's status under its own message
        try:
            raise exc
        except Exception as inner:
            raise Exception("Encountered error while reading array index") from inner
    except Exception as e:
        assert classify(e) == kind


def failing_first_reads(monkeypatch, under: Path, n: int, error: Exception, name: str = "") -> list[str]:
    """The first `n` reads of files under `under` whose path contains `name` fail with `error` (as a
    flaky disk or gs:// would)."""
    cls = type(epath.Path(str(under)))
    real, failed = cls.read_text, []

    def read_text(self, *a, **k):
        if str(self).startswith(str(under)) and name in str(self) and len(failed) < n:
            failed.append(str(self))
            raise error
        return real(self, *a, **k)
    monkeypatch.setattr(cls, "read_text", read_text)
    return failed


@pytest.mark.parametrize("name", ["6/state/_METADATA", "6/state/array_metadatas", "6/meta/metadata"])
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's reader coroutines, abandoned
def test_a_transient_storage_error_is_retried_and_the_checkpoint_restored_in_place(tmp_path, monkeypatch, name):
    """The first read of each file that a restore needs (the array tree, the arrays' metadata, the
    sidecar) fails once: the restore tries again and succeeds; nothing is moved."""
    w, abstract = saved_run(tmp_path)
    monkeypatch.setattr(Checkpointer, "BACKOFF_S", 0.01)
    ck = Checkpointer(w / "ckpt", 3)
    failed = failing_first_reads(monkeypatch, w / "ckpt", 1, OSError(errno.EIO, "Input/output error"), name)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        got = ck.restore(abstract, quarantine=True)
    assert len(failed) == 1 and got[0] == 6
    np.testing.assert_array_equal(np.asarray(got[1]["params"]["w"]), np.asarray(small_state(6.0)["params"]["w"]))
    said = [str(m.message) for m in ws]
    assert len(said) == 1 and "reading failed (OSError: [Errno 5] Input/output error); trying again" in said[0]
    assert ckpt_steps(w) == [3, 6] and not (w / "ckpt_corrupt").exists()
    ck.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's reader coroutines, abandoned
def test_a_storage_error_that_persists_stops_after_the_retries_and_moves_nothing(tmp_path, monkeypatch):
    w, abstract = saved_run(tmp_path)
    monkeypatch.setattr(Checkpointer, "BACKOFF_S", 0.01)
    ck = Checkpointer(w / "ckpt", 3)
    failed = failing_first_reads(monkeypatch, w / "ckpt", 100, ValueError("UNAVAILABLE: gs://b/ckpt: HTTP 503"),
                                 "6/state/_METADATA")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with pytest.raises(CheckpointUnreadable, match=r"step 6 .* could not be read 5 times \(ValueError: "
                                                       r"UNAVAILABLE.*nothing was moved"):
            ck.restore(abstract, quarantine=True)
    assert len(failed) == Checkpointer.RETRIES + 1
    assert ckpt_steps(w) == [3, 6] and not (w / "ckpt_corrupt").exists()
    ck.close()


def test_cli_stops_at_a_checkpoint_of_another_state_and_fresh_sets_it_aside(tmp_path, monkeypatch, capsys):
    """The code changed (the state gained a parameter) under a run folder: `diloco train` exits 4 with
    one line naming the leaf, nothing moved; `--fresh` keeps the old checkpoints in set_aside/ and trains."""
    from diloco import train as train_mod

    cfg_args = cli_train(tmp_path, "diloco", eval_batches=1, H=3)[4:]  # the arguments after `diloco train`
    assert train_mod.main(cfg_args) == 0
    before = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    rows = metric_rows(tmp_path)
    real = Trainer.abstract_state

    def gained(self):
        st = real(self)
        extra = jax.ShapeDtypeStruct((self.R, 3), jnp.float32, sharding=self.replica_sharding)
        return st.replace(params={**st.params, "adapter": extra})
    monkeypatch.setattr(Trainer, "abstract_state", gained)
    capsys.readouterr()
    assert train_mod.main(cfg_args) == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("diloco train: checkpoint at step 6 ") and \
        "the state has params.adapter that the checkpoint lacks" in err[0] and "--fresh" in err[0], err
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == before and metric_rows(tmp_path) == rows
    assert train_mod.main(cfg_args + ["--fresh"]) == 0
    (aside,) = (tmp_path / "set_aside").iterdir()
    assert sorted(p.name for p in (aside / "ckpt").iterdir()) == before and metric_rows(aside) == rows
    assert ckpt_steps(tmp_path) == [3, 6] and without_timing(metric_rows(tmp_path)) == without_timing(rows)


def test_torn_metrics_line_is_dropped_on_resume(tmp_path):
    p = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "train_loss": 1.0 / s} for s in (2, 4, 6)]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 8, "train_lo')  # SIGKILL mid-write
    truncate_jsonl(p, 6)
    assert [json.loads(l) for l in p.read_text().splitlines()] == rows
    truncate_jsonl(p, 3)  # rows after the restored step go; they are logged again
    assert [json.loads(l)["step"] for l in p.read_text().splitlines()] == [2]
    assert not list(tmp_path.glob(".*.tmp"))


def test_atomic_json_write_never_shows_a_partial_file(tmp_path):
    """A reader polling while a writer rewrites summary.json only ever sees a complete document."""
    p = tmp_path / "summary.json"
    atomic_write_json(p, {"i": -1, "pad": "x" * 100_000})
    code = ("import sys; sys.path.insert(0, %r)\nfrom diloco.rundir import atomic_write_json\n"
            "for i in range(200): atomic_write_json(%r, {'i': i, 'pad': 'x' * 100_000})" % (str(REPO), str(p)))
    writer = subprocess.Popen([sys.executable, "-c", code])
    seen = set()
    while writer.poll() is None:
        seen.add(json.loads(p.read_text())["i"])  # raises on a torn read
    assert writer.returncode == 0 and json.loads(p.read_text())["i"] == 199 and len(seen) > 1
    assert not list(tmp_path.glob(".*.tmp"))


# ---------------------------------------------------------------------------------------------------
# exact resume, in-process (stop_after = SIGTERM during that step)
STREAM = dict(H=4, layers_per_fragment=1, tau=2, steps=40, checkpoint_every=10, log_every=1, eval_every=20,
              eval_batches=1)


@pytest.fixture(scope="module")
def streaming_whole(tmp_path_factory) -> tuple[dict, Path]:
    wd = tmp_path_factory.mktemp("whole")
    return train(tiny_config("streaming", **STREAM), wd, progress=False), wd


def test_resume_twice_at_a_checkpoint_step_then_mid_flight_is_exact(tmp_path, streaming_whole):
    """Stop at step 10 (a checkpoint step: the stop must not save twice), resume, stop at 15 (fragments
    in flight, τ=2), resume, finish: params, bytes and every metrics row equal the uninterrupted run's."""
    whole, wd = streaming_whole
    cfg = tiny_config("streaming", **STREAM)
    for stop in (10, 15):
        with pytest.raises(KeyboardInterrupt, match=f"saved a checkpoint at step {stop}"):
            train(cfg, tmp_path, progress=False, stop_after=stop)
        assert max(ckpt_steps(tmp_path)) == stop and [r["step"] for r in metric_rows(tmp_path)][-1] == stop
    resumed = train(cfg, tmp_path, progress=False)
    assert resumed["params_sha256"] == whole["params_sha256"]
    for k in ("bytes_exchanged_total", "syncs", "bytes_per_fragment", "final_eval_loss", "skipped_batches"):
        assert resumed[k] == whole[k], k
    assert without_timing(metric_rows(tmp_path)) == without_timing(metric_rows(wd))


@pytest.mark.slow
def test_corrupt_newest_checkpoint_resumes_from_the_previous_one_exactly(tmp_path, streaming_whole):
    whole, _ = streaming_whole
    cfg = tiny_config("streaming", **STREAM)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, tmp_path, progress=False, stop_after=23)
    assert ckpt_steps(tmp_path) == [20, 23]
    flip_bytes(biggest_file(tmp_path / "ckpt" / "23" / "state"))
    with warnings.catch_warnings(record=True) as ws:  # both expected warnings, nothing left for pytest to print
        warnings.simplefilter("always", UserWarning)
        resumed = train(cfg, tmp_path, progress=False)
    said = [str(w.message) for w in ws if issubclass(w.category, UserWarning)]
    assert len(said) == 2 and re.search(r"step 23 .* unreadable", said[0]), said
    assert said[1].startswith(f"moved the unreadable checkpoint to {tmp_path / 'ckpt_corrupt' / '23-'}"), said
    assert resumed["params_sha256"] == whole["params_sha256"]
    assert len(list((tmp_path / "ckpt_corrupt").iterdir())) == 1


# ---------------------------------------------------------------------------------------------------
# numerical faults
def fault_cfg(method: str, **faults):
    extra = {"H": 3} if method != "dp" else {}
    return tiny_config(method, steps=6, checkpoint_every=3, eval_batches=1, **extra,
                       **{f"faults.{k}": v for k, v in faults.items()})


@pytest.mark.parametrize("method,value,replica", [("diloco", "nan", 1),
                                                   pytest.param("dp", "inf", 0, marks=pytest.mark.slow)])
def test_non_finite_loss_stops_naming_step_and_replica_and_keeps_last_good_checkpoint(tmp_path, method, value,
                                                                                         replica):
    cfg = fault_cfg(method, nan_step=5, nan_replica=replica, nan_value=value)
    with pytest.raises(NumericalFault, match=rf"step 5: non-finite loss or gradient on replica\(s\) \[{replica}\].*"
                                             r"last good checkpoint \(step 3\) is kept"):
        train(cfg, tmp_path, progress=False)
    assert ckpt_steps(tmp_path) == [3]
    assert [r["step"] for r in metric_rows(tmp_path)] == [2, 3, 4]  # flushed, parseable, nothing after
    _, _, state = load_run(tmp_path)
    assert int(state.step) == 3 and all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(state))


@pytest.mark.slow
def test_nan_policy_skip_drops_the_bad_batch_and_finishes(tmp_path):
    s = train(fault_cfg("diloco", nan_step=2, nan_replica=0, nan_policy="skip"), tmp_path, progress=False)
    assert s["skipped_batches"] == 1 and np.isfinite(s["final_eval_loss"])
    assert all(np.isfinite(r["train_loss"]) for r in metric_rows(tmp_path))  # the NaN is not averaged in


@pytest.mark.slow
def test_non_finite_outer_gradient_stops_naming_the_fragment_and_replica(tmp_path):
    cfg = fault_cfg("diloco", nan_step=3, nan_replica=1, nan_target="outer")
    with pytest.raises(NumericalFault, match=r"step 3: the averaged outer gradient of fragment 0 is not finite"
                                             r".*replica\(s\) \[1\].*checkpoint \(step 0\)"):
        train(cfg, tmp_path, progress=False)
    assert ckpt_steps(tmp_path) == []


@pytest.mark.slow
def test_cli_numerical_fault_exits_3_with_the_message(tmp_path):
    r = subprocess.run(cli_train(tmp_path, "dp", steps=4, checkpoint_every=2, eval_batches=1,
                                 **{"faults.nan_step": 3}), capture_output=True, text=True, cwd=REPO, timeout=600)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "step 3: non-finite loss or gradient on replica(s) [0]" in r.stderr
    assert "last good checkpoint (step 2) is kept" in r.stderr


# ---------------------------------------------------------------------------------------------------
# replica faults (the knobs, at the level of the trainer's own jitted pieces)
def batches(n: int, B: int = 4, L: int = 32, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 200, size=(B, L), dtype=np.int32) for _ in range(n)]


def host(tree):
    return jax.tree_util.tree_map(np.asarray, tree)


def dev(tree):
    return jax.tree_util.tree_map(jnp.asarray, tree)


def replica(tree, m: int):
    return jax.tree_util.tree_map(lambda x: np.asarray(x[m]), tree)


def assert_trees_equal(a, b) -> None:
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def trees_differ(a, b) -> bool:
    return any(not np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def test_missed_sync_contributes_nothing_and_still_receives_the_average(tmp_path):
    cfg = tiny_config("diloco", H=2, **{"faults.miss_sync_replica": 1, "faults.miss_sync_step": 2})
    tr = Trainer(cfg)
    inner, st = tr.inner_step(), tr.fresh_state()
    for b in batches(2):
        st, _, _ = inner(st, jnp.asarray(b.reshape(2, -1, 32)))
    before = host(st)
    garbage = before.replace(params=jax.tree_util.tree_map(lambda x: x.copy(), before.params))
    for x in jax.tree_util.tree_leaves(garbage.params):
        x[1] += 1.0  # whatever replica 1 holds must not matter
    contrib = Faults(cfg, tr.R).contrib
    a, sent = tr.driver.after_step(dev(before), 2, contrib=contrib)
    b, _ = tr.driver.after_step(dev(garbage), 2, contrib=contrib)
    assert_trees_equal(a.outer.params, b.outer.params)
    for m in (0, 1):  # α = 0: both replicas, the one that missed included, now hold θ^g
        assert_trees_equal(replica(a.params, m), a.outer.params)
    assert sent == [(0, tr.sync.bytes_per_replica(0))]  # one replica's payload crossed
    ok, sent_ok = tr.driver.after_step(dev(garbage), 2)  # without the fault replica 1 counts
    assert trees_differ(ok.outer.params, a.outer.params) and sent_ok[0][1] == 2 * sent[0][1]
    assert contrib(3, 0).tolist() == [1.0, 0.0] and contrib(4, 0).tolist() == [1.0, 1.0]  # one window of H


def test_slower_replica_merges_tau_steps_later(tmp_path):
    cfg = tiny_config("streaming", H=4, layers_per_fragment=3, tau=0, replica_tau="0,2", alpha=0.0, codec="none")
    tr = Trainer(cfg)
    inner, st, fr = tr.inner_step(), tr.fresh_state(), tr.sync.frags
    seen = []
    for t, b in enumerate(batches(7), 1):
        st, _, _ = inner(st, jnp.asarray(b.reshape(2, -1, 32)))
        st, _ = tr.driver.after_step(st, t)
        g = np.asarray(fr.flatten(st.outer.params, 0))
        seen.append([np.array_equal(np.asarray(fr.flatten(replica(st.params, m), 0)), g) for m in (0, 1)])
    assert tr.schedule.sends(4) == [0]
    assert seen[3] == [True, False] and seen[4] == [False, False] and seen[5] == [False, True]


def test_restarted_replica_starts_from_the_outer_params_with_fresh_optimizer(tmp_path):
    cfg = tiny_config("diloco", H=3, **{"faults.restart_replica": 1, "faults.restart_step": 2})
    tr = Trainer(cfg)
    inner, st = tr.inner_step(), tr.fresh_state()
    for b in batches(2):
        st, _, _ = inner(st, jnp.asarray(b.reshape(2, -1, 32)))
    before = host(st)
    after = host(Faults(cfg, tr.R).restart_replica(tr, dev(before)))
    assert_trees_equal(replica(after.params, 1), before.outer.params)
    counts = {jax.tree_util.keystr(k): int(v[1]) for k, v in jax.tree_util.tree_leaves_with_path(after.opt)
              if "count" in jax.tree_util.keystr(k)}
    assert sorted(counts.values()) == [0, 2]  # Adam's bias correction restarts; the lr schedule goes on at step 2
    moments = [v[1] for k, v in jax.tree_util.tree_leaves_with_path(after.opt) if "count" not in jax.tree_util.keystr(k)]
    assert moments and all(not np.any(x) for x in moments)  # fresh first and second moments
    assert_trees_equal(replica(after.params, 0), replica(before.params, 0))
    assert_trees_equal(replica(after.opt, 0), replica(before.opt, 0))
    assert trees_differ(replica(before.params, 1), before.outer.params)


@pytest.mark.slow
def test_training_continues_through_replica_faults_and_replicas_reconverge(tmp_path):
    faults = {"miss_sync_replica": 1, "miss_sync_step": 3, "restart_replica": 0, "restart_step": 4}
    cfg = fault_cfg("diloco", **faults)
    s = train(cfg, tmp_path, progress=False)
    assert np.isfinite(s["final_eval_loss"]) and s["syncs"] == 2
    assert s["bytes_exchanged_total"] == 3 * s["bytes_peak_per_sync"]  # 2 syncs × 2 replicas − 1 missed
    _, _, st = load_run(tmp_path)
    assert int(st.step) == 6  # a sync step, α = 0: both replicas hold θ^g again
    for m in (0, 1):
        assert_trees_equal(replica(st.params, m), st.outer.params)


# ---------------------------------------------------------------------------------------------------
# real processes: SIGTERM / SIGINT / SIGKILL, then the same command resumes
def cli_train(workdir: Path, method: str, **overrides) -> list[str]:
    """The command line of tiny_config(method, **overrides): the same config, in its own process."""
    flat = {"scale": "tiny", "seq_len": 32, "batch_size": 4, "steps": 6, "log_every": 2, "eval_every": 3,
            "eval_batches": 2, "checkpoint_every": 3, "optimizer.warmup_steps": 2, **overrides}
    return [sys.executable, "-m", "diloco.cli", "train", "--config", f"experiments/toy.py:{method}",
            "--workdir", str(workdir), "--no_progress", *[f"--config.{k}={v}" for k, v in flat.items()]]


def wait_for(pred, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    t0 = time.time()
    while not pred():
        if proc.poll() is not None:
            raise AssertionError(f"process ended (rc {proc.returncode}) before the condition held")
        if time.time() - t0 > timeout:
            proc.kill()
            raise AssertionError("timed out")
        time.sleep(0.02)


def last_logged_step(workdir: Path) -> int:
    try:
        lines = (workdir / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (FileNotFoundError, ValueError, KeyError):
        return 0  # missing, or a line being written


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, stdout=open(log, "ab"), stderr=subprocess.STDOUT)


@pytest.mark.parametrize("sig", ["SIGTERM", pytest.param("SIGINT", marks=pytest.mark.slow)])
def test_preemption_signal_saves_exits_130_and_the_same_command_resumes_exactly(tmp_path, sig, streaming_whole):
    whole, whole_dir = streaming_whole  # the same config, run in-process without interruption
    cmd = cli_train(tmp_path / "cut", "streaming", **STREAM)
    p = start(cmd, tmp_path / "cut.log")
    wait_for(lambda: last_logged_step(tmp_path / "cut") >= 13, p)  # after the step-10 checkpoint
    p.send_signal(getattr(signal, sig))
    assert p.wait(timeout=300) == 130
    out = (tmp_path / "cut.log").read_text()
    said = [l for l in out.splitlines() if "saved a checkpoint" in l]  # one line, once
    assert len(said) == 1 and re.fullmatch(rf"diloco train: {sig}: saved a checkpoint at step \d+ in \S+/ckpt; "
                                           "run the same command to resume", said[0]), out[-3000:]
    stopped = max(ckpt_steps(tmp_path / "cut"))
    assert 13 <= stopped < 40 and last_logged_step(tmp_path / "cut") == stopped  # metrics flushed up to it
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0 and f"resumed {tmp_path / 'cut'} at step {stopped}" in r.stderr, r.stderr[-3000:]
    cut = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert cut["params_sha256"] == whole["params_sha256"]
    assert without_timing(metric_rows(tmp_path / "cut")) == without_timing(metric_rows(whole_dir))


KILL_CASES = {"dp": {}, "diloco": {"H": 4}, "streaming": dict(H=4, layers_per_fragment=1, tau=2)}


@pytest.mark.slow
@pytest.mark.parametrize("method", list(KILL_CASES))
def test_sigkill_twice_after_checkpoints_then_resume_is_exact(tmp_path, method):
    """SIGKILL (no handler runs) a few steps after a checkpoint, twice in a row, then finish."""
    kw = dict(KILL_CASES[method], steps=60, checkpoint_every=10, eval_every=20, log_every=1, eval_batches=1)
    cmd = cli_train(tmp_path / "cut", method, **kw)
    killed_at, newest_ckpt = [], []
    for kill_after in (13, 34):
        p = start(cmd, tmp_path / "cut.log")
        wait_for(lambda: last_logged_step(tmp_path / "cut") >= kill_after, p)
        p.kill()
        p.wait()
        assert not (tmp_path / "cut" / "summary.json").exists()
        killed_at.append(last_logged_step(tmp_path / "cut"))
        newest_ckpt.append(max(ckpt_steps(tmp_path / "cut")))
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    log = (tmp_path / "cut.log").read_text() + r.stderr
    resumed_at = [int(x.split()[-1]) for x in log.splitlines() if x.startswith("resumed ")]
    assert resumed_at == newest_ckpt and resumed_at[0] >= 10 and resumed_at[1] >= 30, (resumed_at, newest_ckpt)
    assert all(0 <= k - c <= 10 for k, c in zip(killed_at, resumed_at))  # lost: only steps since the checkpoint
    print(f"{method}: killed at {killed_at}, resumed at {resumed_at}, steps recomputed "
          f"{[k - c for k, c in zip(killed_at, resumed_at)]}")
    assert subprocess.run(cli_train(tmp_path / "whole", method, **kw), cwd=REPO, capture_output=True).returncode == 0
    cut, whole = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("cut", "whole"))
    assert cut["params_sha256"] == whole["params_sha256"]
    assert cut["bytes_exchanged_total"] == whole["bytes_exchanged_total"]
    assert without_timing(metric_rows(tmp_path / "cut")) == without_timing(metric_rows(tmp_path / "whole"))


# ---------------------------------------------------------------------------------------------------
# two sweep processes on one root
SWEEP = '''
def get_sweep(arg=""):
    return {"name": "two", "experiment": "experiments/toy.py:diloco", "points": [{"H": h} for h in (1, 2, 3)]}
'''


@pytest.mark.slow
def test_two_sweeps_on_one_root_run_every_point_exactly_once(tmp_path):
    sweep = tmp_path / "two.py"
    sweep.write_text(SWEEP)
    sets = [f"--set={k}={v}" for k, v in {"scale": "tiny", "seq_len": 32, "batch_size": 4, "steps": 6, "log_every": 2,
                                          "eval_every": 3, "eval_batches": 1, "checkpoint_every": 3}.items()]
    cmd = [sys.executable, "-m", "diloco.cli", "sweep", str(sweep), "--root", str(tmp_path / "root"), *sets]
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    points = sorted((tmp_path / "root" / "two").iterdir())
    assert [p.name for p in points] == ["H=1", "H=2", "H=3"]
    done = [line.split()[-1] for out in outs for line in out.splitlines() if line.startswith("done ")]
    assert sorted(done) == ["H=1", "H=2", "H=3"], outs  # each point trained by exactly one of the two
    for wd in points:
        assert (wd / "train.log").read_text().count("\n$ ") == 1  # one training command ever started here
        assert not (wd / "failed.json").exists() and not (wd / ".lock").exists()
        for f in ("summary.json", "config.json", "point.json"):
            json.loads((wd / f).read_text())
        rows = metric_rows(wd)
        assert [r["step"] for r in rows] == [2, 3, 4, 6]
        assert json.loads((wd / "summary.json").read_text())["H"] == int(wd.name[2:])
        assert not list(wd.glob(".*.tmp"))
