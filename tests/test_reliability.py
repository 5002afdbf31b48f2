"""Reliability: exact resume (in-process and after SIGKILL/SIGTERM of real processes), checkpoint
atomicity and corruption fallback, numerical faults, replica faults, atomic run records.

Fast by default; the real-subprocess kill/resume matrix is `@pytest.mark.slow` (`pytest -m slow`)."""
from __future__ import annotations

import glob
import json
import os
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

from conftest import REPO, tiny_config
from diloco.checkpoint import Checkpointer, atomic_write_json, state_checksum
from diloco.train import NumericalFault, Trainer, _fault_contrib, _restart_replica, _truncate_metrics, train

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
}


def small_state(seed: float) -> dict:
    return {"params": {"w": jnp.arange(4096, dtype=jnp.float32) * seed, "b": jnp.full((7,), seed, jnp.bfloat16)},
            "step": jnp.asarray(int(seed), jnp.int32), "flag": jnp.asarray([True, False])}


def saved_run(tmp_path: Path, steps=(3, 6), keep: int = 3) -> tuple[Path, dict]:
    ck = Checkpointer(tmp_path, keep)
    for s in steps:
        ck.save(s, small_state(float(s)), {"step": s})
    ck.close()
    return tmp_path, jax.eval_shape(lambda: small_state(1.0))


def restore(workdir: Path, abstract, quarantine=False, keep: int = 3):
    ck = Checkpointer(workdir, keep)
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


def test_flipped_bytes_are_caught_by_the_checksum_not_by_orbax(tmp_path):
    """Orbax reads flipped array bytes back without complaint; only the saved checksum notices."""
    w, abstract = saved_run(tmp_path, steps=(6,))
    flip_bytes(biggest_file(w / "ckpt" / "6" / "state"))
    ck = Checkpointer(w, 3)
    out = ck.mngr.restore(6, args=ck._ocp.args.Composite(state=ck._ocp.args.StandardRestore(abstract),
                                                         meta=ck._ocp.args.JsonRestore()))
    assert state_checksum(out["state"]) != out["meta"]["state_checksum"]
    ck.close()
    _, got, msgs = restore(w, abstract)
    assert got is None and any("checksum" in m for m in msgs), msgs


def test_checksum_sees_one_changed_word_in_any_leaf():
    s = small_state(2.0)
    base = state_checksum(s)
    assert base == state_checksum(jax.tree_util.tree_map(jnp.copy, s))
    for path, changed in (("w", s["params"]["w"].at[4000].add(1e-3)), ("b", s["params"]["b"].at[6].set(0))):
        s2 = {**s, "params": {**s["params"], path: changed}}
        assert state_checksum(s2) != base, path
    swapped = {**s, "params": {**s["params"], "w": s["params"]["w"][::-1]}}  # same words, other places
    assert state_checksum(swapped) != base


def test_interrupted_save_leaves_only_a_tmp_dir_that_is_ignored_and_overwritten(tmp_path):
    """SIGKILL during a save: orbax writes `<step>.orbax-checkpoint-tmp-*` and renames it when done."""
    w, abstract = saved_run(tmp_path)
    shutil.copytree(w / "ckpt" / "6", w / "ckpt" / "9.orbax-checkpoint-tmp-1234")
    os.truncate(biggest_file(w / "ckpt" / "9.orbax-checkpoint-tmp-1234"), 10)
    ck, got, msgs = restore(w, abstract)
    assert got[0] == 6 and ck.steps() == [3, 6] and not msgs
    ck.save(9, small_state(9.0), {"step": 9})
    ck.close()
    _, got, _ = restore(w, abstract)
    assert got[0] == 9 and float(got[1]["params"]["w"][1]) == 9.0


def test_all_checkpoints_corrupt_means_a_fresh_start_not_a_crash(tmp_path):
    w, abstract = saved_run(tmp_path)
    for s in (3, 6):
        CORRUPTIONS["missing_array_metadata"](w / "ckpt" / str(s))
    ck, got, msgs = restore(w, abstract, quarantine=True)
    assert got is None and sum("is unreadable" in m for m in msgs) == 2 and ck.steps() == []
    ck.close()


def test_torn_metrics_line_is_dropped_on_resume(tmp_path):
    p = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "train_loss": 1.0 / s} for s in (2, 4, 6)]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 8, "train_lo')  # SIGKILL mid-write
    _truncate_metrics(p, 6)
    assert [json.loads(l) for l in p.read_text().splitlines()] == rows
    _truncate_metrics(p, 3)  # rows after the restored step go; they are logged again
    assert [json.loads(l)["step"] for l in p.read_text().splitlines()] == [2]
    assert not list(tmp_path.glob(".*.tmp"))


def test_atomic_json_write_never_shows_a_partial_file(tmp_path):
    """A reader polling while a writer rewrites summary.json only ever sees a complete document."""
    p = tmp_path / "summary.json"
    atomic_write_json(p, {"i": -1, "pad": "x" * 100_000})
    code = ("import sys; sys.path.insert(0, %r)\nfrom diloco.checkpoint import atomic_write_json\n"
            "for i in range(200): atomic_write_json(%r, {'i': i, 'pad': 'x' * 100_000})" % (str(REPO), str(p)))
    writer = subprocess.Popen([sys.executable, "-c", code])
    seen = set()
    while writer.poll() is None:
        seen.add(json.loads(p.read_text())["i"])  # raises on a torn read
    assert writer.returncode == 0 and json.loads(p.read_text())["i"] == 199 and len(seen) > 1
    assert not list(tmp_path.glob(".*.tmp"))
