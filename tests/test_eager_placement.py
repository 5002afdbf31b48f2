"""Eager updates and error feedback under every exchange placement: the blocking numbers, bit for bit
(tests/test_train.py::test_every_exchange_placement_gives_the_blocking_numbers for plain sends)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

SCRIPT = r"""
import json, sys
import jax, numpy as np
sys.path.insert(0, "tests")
from conftest import tiny_config
from diloco.trainer import Trainer
kws = json.loads(sys.argv[1])
d = jax.devices()
rng = np.random.default_rng(0)
bs = [rng.integers(2, 200, size=(8, 32), dtype=np.int32) for _ in range(10)]
def run(kw, name, settle_at=()):
    checks, now = [], [0]
    cfg = tiny_config("streaming", H=4, steps=10, batch_size=8, layers_per_fragment=1,
                      exchange="blocking" if name == "comm_device" else name, **kw)
    tr = Trainer(cfg, devices=d[:2], comm_devices=d[2:] if name == "comm_device" else None,
                 check=lambda s, p, ts, f: checks.append((now[0], p, ts)))
    assert tr.driver.exchange == name and tr.plan.exchange == name, (tr.driver.exchange, tr.plan.why)
    st = tr.fresh_state()
    for t, b in enumerate(bs, 1):
        now[0] = t
        st, _, _ = tr.placement.step(st, jax.device_put(b.reshape(2, 4, 32), tr.batch_sharding))
        st, _ = tr.driver.after_step(st, t)
        if t in settle_at:  # a checkpoint: nothing may stay in flight
            st = tr.placement.settle(st)
            assert tr.placement.in_flight() == []
    st = tr.placement.settle(st)
    return tr, st, checks
for kw in kws:
    _, ref_st, ref_checks = run(kw, "blocking")
    ref = [np.asarray(x) for x in jax.tree_util.tree_leaves(ref_st)]
    assert len(ref_checks) == 5 and all(t == ts for t, p, ts in ref_checks)  # blocking: checked at the send
    ex = ref_st.outer.extra
    if ex.residual is not None:  # the codec is lossy: the residual the placements must carry is not 0
        assert all(np.abs(np.asarray(r)).max() > 0 for r in ex.residual)
    # settled at 4 and 9 (checkpoints): the sends of 5, 7 and 8 still ride on the next step (in_step), land
    # before their fragment's next round or at the apply (comm_device: 5's lands at 9 before 9's send)
    for placement, settle_at in (("in_step", (4, 9)), ("comm_device", (4, 9))):
        tr, st, checks = run(kw, placement, settle_at)
        got = [np.asarray(x) for x in jax.tree_util.tree_leaves(st)]
        for x, y in zip(ref, got, strict=True):
            np.testing.assert_array_equal(x, y)
        # one check per send, in the send order, once its average landed (at or after the send)
        assert [(p, ts) for _, p, ts in checks] == [(p, ts) for _, p, ts in ref_checks], (checks, ref_checks)
        assert all(t >= ts for t, p, ts in checks)
        kinds = {k[0] for k in tr.driver.programs()}
        if placement == "in_step":  # the send rides on the next step; a settle runs a parked one alone
            assert f"step+{tr.driver.send_kind}" in kinds and tr.driver.send_kind in kinds
            assert [t for t, p, ts in checks if t != ts + 1] == [4, 9]  # settled at the send's own step
        if placement == "comm_device":  # local half on the compute devices, the exchange on the comm devices
            assert tr.driver.send_kind not in kinds and {"local", "land"} <= kinds
            assert all(t > ts for t, p, ts in checks) or settle_at
    print("checked", kw, flush=True)
print("OK")
"""
CASES = [dict(eager="swap", error_feedback=True, codec="e3m0", tau=0, alpha=0.5),   # eager + a non-zero residual
         dict(error_feedback=True, codec="int2", tau=1, alpha=0.5)]                    # error feedback alone, τ = 1


@pytest.mark.slow
def test_eager_and_error_feedback_under_every_placement_give_the_blocking_numbers():
    """Streaming, P = 3, H = 4, 10 steps on 4 fake CPU devices (2 compute, 2 comm; a subprocess): eager
    swap with error feedback and error feedback alone (τ = 1) end bit-identical to the blocking exchange
    under in_step and comm_device, with checkpoints settling at steps 4 and 9; the pending
    check runs once per send, in send order, when its average has landed (in_step: on the next step;
    comm_device: before the fragment's next round, or at its apply)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", TF_CPP_MIN_LOG_LEVEL="3")
    r = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CASES)], capture_output=True,
                       text=True, cwd=REPO, env=env)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def test_eager_in_step_gives_the_blocking_numbers():
    """In-process, one device: DiLoCo (H = 2) with eager swap and E3M0 error feedback, 5 steps; in_step
    (each send on the next step's program) ends bit-identical to blocking, with a non-zero residual. One
    trainer, its placement swapped (the inner step and the blocking send compile once)."""
    import jax
    import numpy as np

    from conftest import tiny_config
    from diloco.outer.placement import InStep
    from diloco.trainer import Trainer

    bs = [np.random.default_rng(t).integers(2, 200, size=(2, 2, 32), dtype=np.int32) for t in range(5)]
    tr = Trainer(tiny_config("diloco", H=2, steps=5, eager="swap", error_feedback=True, codec="e3m0"))
    out = {}
    for name in ("blocking", "in_step"):
        if name == "in_step":
            tr.driver.placement = InStep(tr.driver, tr.inner_step)
        st = tr.fresh_state()
        for t, b in enumerate(bs, 1):
            st, _, _ = tr.placement.step(st, jax.numpy.asarray(b))
            st, _ = tr.driver.after_step(st, t)
        st = tr.placement.settle(st)
        assert np.abs(np.asarray(st.outer.extra.residual[0])).max() > 0
        out[name] = [np.asarray(x) for x in jax.tree_util.tree_leaves(st)]
    assert {k[0] for k in tr.driver.programs()} == {"eager_round", "step+eager_round"}
    for x, y in zip(out["blocking"], out["in_step"], strict=True):
        np.testing.assert_array_equal(x, y)


def test_eager_in_step_is_accepted_at_tau_0_and_error_feedback_alone_is_not():
    """Eager reads a round's average D rounds later, so in_step carries it at τ = 0; error feedback alone
    applies it τ steps after the send, so in_step needs τ ≥ 1 (one line naming `exchange`)."""
    from diloco.config import load_config
    from diloco.errors import ConfigError

    base = ["--config.method=streaming", "--config.tau=0", "--config.exchange=in_step"]
    cfg = load_config("experiments/toy.py:streaming", base + ["--config.eager=swap"])
    assert cfg.exchange == "in_step"
    with pytest.raises(ConfigError) as e:
        load_config("experiments/toy.py:streaming", base + ["--config.error_feedback=true"])
    assert e.value.field == "exchange" and "tau ≥ 1" in str(e.value)
