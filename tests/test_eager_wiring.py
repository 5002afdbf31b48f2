"""Eager updates and error feedback in `diloco train`: same numbers when off, resume, bytes, evaluation θ."""
import shutil

import jax
import numpy as np
import pytest

from conftest import tiny_config
from diloco.config import load_config, validate
from diloco.errors import ConfigError
from diloco.train import train
from diloco.trainer import Trainer

STREAM = dict(H=4, layers_per_fragment=1, tau=0, codec="e3m0", steps=9, checkpoint_every=3, eval_every=9)


def test_lossless_error_feedback_is_the_plain_run_bit_for_bit(tmp_path):
    """codec=none: the residual stays 0 and the run's numbers are error_feedback=false's (DiLoCo, H = 2)."""
    kw = dict(H=2, steps=4, checkpoint_every=4, eval_every=4)
    plain = train(tiny_config("diloco", **kw), tmp_path / "plain", progress=False)
    ef = train(tiny_config("diloco", error_feedback=True, **kw), tmp_path / "ef", progress=False)
    assert ef["params_sha256"] == plain["params_sha256"]
    assert ef["bytes_exchanged_total"] == plain["bytes_exchanged_total"]


def _kill_after_checkpoint(cfg, tmp_path):
    """The run to the end, and the same run 'killed' after its step-6 checkpoint (its newest checkpoint and
    summary removed, as SIGKILL after step 8 leaves them), then rerun: (whole summary, resumed summary)."""
    whole = train(cfg, tmp_path / "whole", progress=False)
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "whole", cut)
    ckpt = cut / "ckpt"
    for p in ckpt.iterdir():
        if p.name.startswith("9"):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    (cut / "summary.json").unlink()
    assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == ["6"]
    return whole, train(cfg, cut, progress=False)


@pytest.mark.parametrize("mode", ["swap", "naive"])
def test_eager_with_error_feedback_resumes_bit_identically(tmp_path, mode, capsys):
    """Streaming, P = 3, E3M0 with error feedback (a non-zero residual at the checkpoint), eager: the rerun
    from the step-6 checkpoint ends with the uninterrupted run's parameters; bytes are E3M0's, unchanged
    by error feedback and by eager (the same sends)."""
    from diloco.outer import codecs

    cfg = tiny_config("streaming", eager=mode, error_feedback=True, **STREAM)
    tr = Trainer(cfg)
    whole, resumed = _kill_after_checkpoint(cfg, tmp_path)
    assert "at step 6" in capsys.readouterr().err  # from the checkpoint after the sends of steps 4 and 5
    assert resumed["params_sha256"] == whole["params_sha256"]
    # E3M0's bytes of each send (fragment sizes from the run), the same as without eager / error feedback
    e3m0 = codecs.make_codec("e3m0")
    sends = [p for t in range(1, 10) for p in tr.schedule.sends(t)]
    assert sends and whole["bytes_exchanged_total"] == sum(
        2 * codecs.encoded_nbytes(e3m0, whole["fragment_sizes"][p]) for p in sends)
    assert whole["eval_params"] == ("mean of the replicas' outer parameters" if mode == "swap" else "outer parameters")
    assert whole["eager"] == mode and whole["error_feedback"] is True and whole["drained_fragments"] == []
    st = tr.fresh_state()
    assert st.outer.extra is not None and len(st.outer.extra.residual) == tr.sync.frags.P


def test_eager_swap_evaluates_the_mean_of_the_replicas_outer_params(tmp_path):
    """After a swap round the replicas' θᵍ_m differ; eval_params is their mean, fragment by fragment."""
    cfg = tiny_config("diloco", eager="swap", H=2, steps=4)
    tr = Trainer(cfg)
    state = tr.fresh_state()
    inner = tr.inner_step()
    rng = np.random.default_rng(0)
    for t in range(1, 5):
        b = rng.integers(2, 200, size=(tr.R, 2, 32), dtype=np.int32)
        state, _, _ = inner(state, jax.numpy.asarray(b))
        state, _ = tr.driver.after_step(state, t)
    outer_R = np.asarray(state.outer.extra.outer[0])
    assert not np.array_equal(outer_R[0], outer_R[1])
    got = np.asarray(tr.sync.frags.flatten(tr.eval_params(state), 0))
    np.testing.assert_allclose(got, outer_R.mean(0), rtol=0, atol=1e-7)
    _, drained, frags = tr.drained(state, 4)
    assert frags == [] and np.array_equal(np.asarray(tr.sync.frags.flatten(tr.eval_params(drained), 0)), got)


def test_eager_sweep_points_validate():
    from diloco.sweep import load_sweep

    for group in ("table2", "table3"):
        s = load_sweep(f"sweeps/eager.py:{group},tiny")
        assert len(s["points"]) == (8 if group == "table2" else 6) * 8  # × 8 seeds
        assert s["name"] == f"eager_{group}_tiny"
        for p in s["points"]:
            validate(load_config(p["spec"], p["overrides"]), check_data=False)
    assert load_sweep("sweeps/eager.py:tiny")["name"] == "eager_table2_tiny"


@pytest.mark.slow
def test_eager_swap_with_feedback_on_a_replica_mesh_matches_one_device(tmp_path):
    """The buffers laid out on a `replica` mesh axis of 2 (one CPU device per replica, a subprocess):
    the same final eval loss as with both replicas on one device (to float32 rounding of the layouts)."""
    import json
    import os
    import subprocess
    import sys

    from conftest import REPO

    over = dict(eager="swap", error_feedback=True, H=4, layers_per_fragment=1, tau=0, codec="e3m0", steps=8,
                checkpoint_every=8, eval_every=8)
    one = train(tiny_config("streaming", **over), tmp_path / "one", progress=False)
    script = (f"import sys, json; sys.path.insert(0, 'tests'); from conftest import tiny_config; "
              f"from diloco.train import train; s = train(tiny_config('streaming', **{over!r}), {str(tmp_path / 'two')!r},"
              f" progress=False); print(json.dumps([s['mesh'], s['final_eval_loss']]))")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", TF_CPP_MIN_LOG_LEVEL="3")
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    mesh, loss = json.loads(r.stdout.strip().splitlines()[-1])
    assert mesh["replica"] == 2 and one["mesh"]["replica"] == 1
    assert abs(loss - one["final_eval_loss"]) <= 1e-5 * one["final_eval_loss"]


@pytest.mark.slow
def test_sigkill_with_a_residual_and_eager_buffers_in_the_checkpoint_resumes_bit_identically(tmp_path):
    """A real `diloco train` process (Streaming, P = 3, eager swap, E3M0 with error feedback) SIGKILLed
    (no handler runs) a few steps after its step-8 checkpoint, mid-round: that checkpoint holds a
    non-zero residual, the delayed averages and per-replica θᵍ_m that differ; the same command resumes
    from it and ends with the uninterrupted run's params_sha256, bytes and metrics rows."""
    import json
    import signal
    import subprocess
    import sys
    import time

    from conftest import REPO
    from diloco.eval.runs import load_run

    kw = dict(eager="swap", error_feedback=True, codec="e3m0", H=4, layers_per_fragment=1, tau=0, steps=20,
              checkpoint_every=8, log_every=1, eval_every=20, eval_batches=1)
    flat = {"scale": "tiny", "seq_len": 32, "batch_size": 4, "optimizer.warmup_steps": 2, **kw}  # = tiny_config
    cut = tmp_path / "cut"
    cmd = [sys.executable, "-m", "diloco.cli", "train", "--config", "experiments/toy.py:streaming", "--workdir",
           str(cut), "--no_progress", *[f"--config.{k}={v}" for k, v in flat.items()]]

    def logged() -> int:
        try:
            return json.loads((cut / "metrics.jsonl").read_text().splitlines()[-1])["step"]
        except (FileNotFoundError, IndexError, ValueError, KeyError):
            return 0

    p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "cut.log", "wb"))
    t0 = time.time()
    while logged() < 10:
        assert p.poll() is None, (tmp_path / "cut.log").read_text()[-3000:]
        assert time.time() - t0 < 300, "timed out"
        time.sleep(0.02)
    p.send_signal(signal.SIGKILL)
    p.wait()
    killed_at = logged()
    ckpts = sorted(int(d.name) for d in (cut / "ckpt").iterdir() if d.name.isdigit())
    assert not (cut / "summary.json").exists() and max(ckpts) < killed_at < 20, (ckpts, killed_at)
    _, tr, st = load_run(cut)  # what the resume reads
    assert int(st.step) == max(ckpts) >= 8
    ex = st.outer.extra
    assert all(np.abs(np.asarray(r)).max() > 0 for r in ex.residual)        # error feedback owes something
    assert all(np.abs(np.asarray(a)).max() > 0 for a in ex.avg)             # the delayed averages, pending
    assert not np.array_equal(*np.asarray(ex.outer[0]))                      # swap: θᵍ_m differ per replica
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0 and f"at step {max(ckpts)}" in r.stderr, r.stderr[-3000:]
    whole = train(tiny_config("streaming", **kw), tmp_path / "whole", progress=False)
    resumed = json.loads((cut / "summary.json").read_text())
    assert resumed["params_sha256"] == whole["params_sha256"]
    assert resumed["bytes_exchanged_total"] == whole["bytes_exchanged_total"]
    rows = lambda d: [{k: v for k, v in json.loads(l).items() if k not in ("seconds", "tokens_per_s")}
                      for l in (d / "metrics.jsonl").read_text().splitlines() if l.strip()]
    assert rows(cut) == rows(tmp_path / "whole")


def test_eager_in_step_is_accepted_at_tau_0_and_error_feedback_alone_is_not():
    """Eager reads a round's average D rounds later, so in_step carries it at τ = 0; error feedback alone
    applies it τ steps after the send, so in_step needs τ ≥ 1 (one line naming `exchange`)."""
    base = ["--config.method=streaming", "--config.tau=0", "--config.exchange=in_step"]
    cfg = load_config("experiments/toy.py:streaming", base + ["--config.eager=swap"])
    assert cfg.exchange == "in_step"
    with pytest.raises(ConfigError) as e:
        load_config("experiments/toy.py:streaming", base + ["--config.error_feedback=true"])
    assert e.value.field == "exchange" and "tau ≥ 1" in str(e.value)
