"""Per-replica training losses: metrics.jsonl `train_loss_replicas` (a list per row), TensorBoard, plots."""
import json

import jax.numpy as jnp
import numpy as np
import pandas as pd

from conftest import tiny_config
from diloco.train import Counters, LossWindow, train
from diloco.trainer import Trainer


class _NoFaults:
    skip_bad_batches = False


def test_identical_replicas_log_equal_losses_whose_mean_is_the_train_loss():
    """DiLoCo, H = 1, M = 2, both replicas fed the same tokens: every step's two losses are equal, and
    the logged per-replica means average to the logged train loss."""
    cfg = tiny_config("diloco", H=1, replicas=2, batch_size=4)
    tr = Trainer(cfg)
    state, inner = tr.fresh_state(), tr.inner_step()
    win = LossWindow(tr, _NoFaults(), Counters(), [], lambda: 0)
    rng = np.random.default_rng(0)
    for t in range(1, 5):
        b = rng.integers(2, 200, size=(2, 32), dtype=np.int32)
        state, ce_R, fin_R = inner(state, jnp.asarray(np.stack([b, b])))
        state, _ = tr.driver.after_step(state, t)
        win.add(t, ce_R, fin_R)
    win.flush()
    steps = [row for row in win.losses_R]
    assert len(steps) == 4 and all(a == b for a, b in steps)
    per, mean = win.take_replica_means(), win.take_mean()
    assert per[0] == per[1] and abs(np.mean(per) - mean) <= 1e-6 * mean
    assert win.take_replica_means() is None  # consumed with the row


def test_every_metrics_row_carries_per_replica_losses(tmp_path):
    """A real run (M = 2, different data per replica), stopped after step 3 and resumed: each row's list has
    M entries whose mean is its train_loss, also for row 4, whose window (steps 3–4) straddles the
    checkpoint (the per-replica losses of step 3 are saved with it); TensorBoard gets one scalar per
    replica and the plot reader one curve per replica."""
    import pytest

    cfg = tiny_config("diloco", H=2, steps=6, log_every=2, eval_every=4, checkpoint_every=3)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, tmp_path / "run", progress=False, stop_after=3)
    train(cfg, tmp_path / "run", progress=False)
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 6]
    for r in rows:
        assert len(r["train_loss_replicas"]) == 2
        assert abs(np.mean(r["train_loss_replicas"]) - r["train_loss"]) <= 1e-6 * r["train_loss"]
    assert any(r["train_loss_replicas"][0] != r["train_loss_replicas"][1] for r in rows)
    from diloco.report.plots import replica_losses
    from diloco.rundir import read_jsonl

    curves = replica_losses(pd.DataFrame(read_jsonl(tmp_path / "run" / "metrics.jsonl")))
    assert len(curves) == 2 and curves[1].tolist() == [r["train_loss_replicas"][1] for r in rows]
    events = b"".join(p.read_bytes() for p in (tmp_path / "run" / "tb").glob("events*"))
    if events:  # tensorboardX installed: the tags are plain strings in the event records
        assert b"train_loss/replica_0" in events and b"train_loss/replica_1" in events
