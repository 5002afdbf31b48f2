"""Replicas across TPU slices: the hybrid mesh, and which collectives cross slices (libtpu topologies on CPU)."""
import importlib.util

import numpy as np
import pytest

from diloco import distributed as dist

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu not installed (pip install -e '.[tpu]')")


def test_one_slice_keeps_the_device_order():
    class D:  # CPU devices have no slice_index
        def __init__(self, i):
            self.id = i

    devs = [D(i) for i in range(8)]
    assert [d.id for d in dist.device_grid(devs, (2, 2, 2)).reshape(-1)] == list(range(8))


@needs_libtpu
def test_two_slices_put_replicas_on_slices_and_dp_data_across_them():
    from diloco.compile import tpu_devices

    devs = tpu_devices("v5e:2x2", 2)
    slice_of = np.vectorize(lambda d: d.slice_index)
    grid = slice_of(dist.device_grid(devs, (2, 2, 2)))
    assert (grid[0] == 0).all() and (grid[1] == 1).all()  # replica r lives in slice r
    dp = slice_of(dist.device_grid(devs, (1, 4, 2)))  # DP: the slices split the data axis
    assert (dp[0, :2] == 0).all() and (dp[0, 2:] == 1).all()


@pytest.mark.slow
@needs_libtpu
@pytest.mark.parametrize("method", ["streaming", "diloco"])
def test_only_the_outer_exchange_crosses_slices(method):
    """`diloco compile --slices 2`: the inner step stays inside a slice; the sends cross (DCN). Evaluation,
    whose batch spans every chip, crosses only to add up its loss: all-reduces of at most 512 B (one
    padded buffer of the scalar sums), never a parameter or activation."""
    from diloco.compile import report
    from diloco.config import load_config

    cfg = load_config(f"experiments/toy.py:{method}", ["--config.mesh.data=2", "--config.mesh.fsdp=2"], check_data=False)
    rep = report(cfg, "v5e:2x2", slices=2)
    crossing = [c for c in rep["collectives"] if c["crosses_slices"]]
    assert any(c["program"].startswith("send") for c in crossing), "the outer exchange must cross slices"
    assert not [c for c in crossing if c["program"] == "inner"], "the inner step must stay inside a slice"
    ev = [c for c in crossing if c["program"] == "eval"]
    assert all(c["kind"].endswith("all-reduce") and c["operand_bytes"] <= 512 for c in ev), ev
