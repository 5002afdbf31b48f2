"""`diloco compile`: the project's programs compiled for a real TPU topology on this CPU machine (libtpu)."""
import importlib.util

import pytest

from diloco import compile as C
from diloco.errors import ConfigError

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu not installed (pip install -e '.[tpu]')")


def test_hlo_parsing_hand_written():
    hlo = """
  %p0 = f32[2,128]{1,0} parameter(0)
  %p1 = bf16[64]{0} parameter(1)
  %all-gather-start = (bf16[64]{0}, bf16[128]{0}) all-gather-start(%p1), channel_id=1, replica_groups=[2,2]<=[2,2]T(1,0), dimensions={0}, use_global_device_ids=true
  %all-gather-done = bf16[128]{0} all-gather-done(%all-gather-start)
  ROOT %all-reduce = f32[2,128]{1,0} all-reduce(%p0), channel_id=2, replica_groups={{0,1},{2,3}}, use_global_device_ids=true, to_apply=%add
"""
    import numpy as np
    from jax.sharding import Mesh

    class D:
        def __init__(self, i, s):
            self.id, self.slice_index = i, s
    mesh = Mesh(np.array([D(0, 0), D(1, 0), D(2, 1), D(3, 1)], dtype=object).reshape(2, 2), ("replica", "data"))
    rows = C.parse_collectives(hlo, mesh)
    assert [(r["kind"], r["operand_bytes"], r["async"], r["axes"], r["crosses_slices"]) for r in rows] == [
        ("all-gather", 128, True, ["replica"], True),   # groups {0,2},{1,3}: across the replica axis
        ("all-reduce", 1024, False, ["data"], False)]   # groups {0,1},{2,3}: inside a slice
    assert C.shape_bytes("(f32[4]{0}, u8[3]{0}, token[])") == 19


def test_without_libtpu_says_how_to_install(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "libtpu", None)  # import libtpu → ImportError
    with pytest.raises(ConfigError) as e:
        C.tpu_devices("v5e:2x2")
    assert "pip install -e '.[tpu]'" in str(e.value) and "\n" not in str(e.value)


def test_unknown_topology_is_one_line_error():
    with pytest.raises(ConfigError, match=r"^--topology: .*v9z"):
        C.tpu_devices("v9z:2x2")


def test_hlo_mesh_form_replica_groups():
    """XLA's mesh form: mesh['axis_0'=2,'axis_1'=2] {'axis_0'} groups devices {0,2},{1,3}."""
    import numpy as np
    from jax.sharding import Mesh

    class D:
        def __init__(self, i):
            self.id, self.slice_index = i, 0
    mesh = Mesh(np.array([D(i) for i in range(8)], dtype=object).reshape(2, 2, 2), ("replica", "data", "fsdp"))
    hlo = """
  %p = bf16[8]{0} parameter(0)
  %ag = bf16[16]{0} all-gather(%p), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, dimensions={0}
  %ar = bf16[8]{0} all-reduce(%p), channel_id=2, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, to_apply=%add
"""
    rows = C.parse_collectives(hlo, mesh)
    assert [(r["kind"], r["operand_bytes"], r["group_size"], r["axes"]) for r in rows] == [
        ("all-gather", 16, 2, ["replica"]), ("all-reduce", 16, 4, ["data", "fsdp"])]


@needs_libtpu
def test_compile_streaming_step_for_v5e_2x2():
    """tiny Streaming (bf16 codec) on v5e:2x2 = replica 2 × data 2: per-chip memory is reported, and each
    chip gathers over `replica` only its own half of the encoded fragment, so the bytes crossing
    `replica` (per chip × the chips of a replica) are exactly what `bytes_exchanged` counts.
    (Before the exchange was split, each chip's gather carried the whole payload: data-axis-size × the
    counted bytes crossed `replica`.)"""
    import sys
    sys.path.insert(0, "tests")
    from conftest import tiny_config

    cfg = tiny_config("streaming", codec="bf16", batch_size=8)
    rep = C.report(cfg, "v5e:2x2", 1, {"inner", "send 0"})
    assert rep["chips"] == 4 and rep["mesh"] == {"replica": 2, "data": 2, "fsdp": 1}
    assert rep["chip_hbm_bytes"] == 16 * C.GiB
    inner, send = rep["programs"]
    assert inner["memory"]["argument_bytes"] > 0 and inner["peak_bytes_per_chip"] >= inner["memory"]["argument_bytes"]
    assert rep["fits"] and inner["flops"] > 0
    gathers = [c for c in send["collectives"] if c["kind"] == "all-gather" and c["axes"] == ["replica"]]
    assert rep["exchange_shards"][0] == 2
    assert sum(c["operand_bytes"] for c in gathers) * 2 == rep["bytes_per_replica"][0]
    assert all(c["group_size"] == 2 and not c["crosses_slices"] for c in gathers)


@needs_libtpu
def test_topology_libtpu_does_not_know_is_one_line_error():
    with pytest.raises(ConfigError) as e:
        C.tpu_devices("v5e:3x7")
    assert e.value.field == "--topology" and "v5e:3x7" in str(e.value) and "\n" not in str(e.value)


@needs_libtpu
def test_cli_bad_mesh_for_topology_exits_2_before_compiling(capsys):
    rc = C.main(["--config", "experiments/toy.py:streaming", "--topology", "v5e:2x2", "--config.mesh.fsdp=3"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("diloco compile: mesh.fsdp: 3 does not divide") and "\n" not in err


@needs_libtpu
def test_fsdp_by_the_rules_shrinks_per_chip_state():
    """tiny DP on v5e:2x2, data 1 × fsdp 4: the default rules (embed=fsdp) cut each chip's params + AdamW
    moments to a quarter for every leaf with an embed dim (32; all but the q/k norms and AdamW's count),
    so the state per chip is (whole − those leaves) / 4 + those leaves. With rules that shard nothing,
    fsdp 4 keeps the whole state on every chip. (Layout only: nothing is compiled.)"""
    import sys

    import jax
    import numpy as np
    sys.path.insert(0, "tests")
    from conftest import tiny_config

    from diloco.trainer import Trainer

    devs = C.tpu_devices("v5e:2x2")
    whole = C.per_chip_bytes(Trainer(tiny_config("dp", batch_size=8), devices=devs).abstract_state())
    tr = Trainer(tiny_config("dp", batch_size=8, **{"mesh.data": 1, "mesh.fsdp": 4}), devices=devs)
    st = tr.abstract_state()
    # by hand: a leaf with an 'embed' dim of 32 is split 4 ways; q/k norms (head_dim) and the step are not
    repl = sum(int(np.prod(x.shape)) * x.dtype.itemsize for p, x in jax.tree_util.tree_flatten_with_path(st)[0]
               if x.ndim == 0 or tr.names_at(p) is None or "embed" not in tr.names_at(p))
    assert repl < whole / 10
    assert C.per_chip_bytes(st) == (whole - repl) // 4 + repl
    off = Trainer(tiny_config("dp", batch_size=8, **{"mesh.data": 1, "mesh.fsdp": 4, "mesh.rules": "batch=fsdp"}),
                  devices=devs)
    assert C.per_chip_bytes(off.abstract_state()) == whole


@needs_libtpu
@pytest.mark.slow
def test_fsdp_by_the_rules_shrinks_the_compiled_step():
    """The compiled inner step for v5e:2x2 with data 1 × fsdp 4 (default rules) takes less than half the
    argument bytes per chip of fsdp 1 (params + AdamW moments split 4 ways)."""
    import sys
    sys.path.insert(0, "tests")
    from conftest import tiny_config

    devs = C.tpu_devices("v5e:2x2")
    got = C.compile_trainer(tiny_config("dp", batch_size=8, **{"mesh.data": 1, "mesh.fsdp": 4}), devs,
                            {"inner"})["programs"][0]
    base = C.compile_trainer(tiny_config("dp", batch_size=8), devs, {"inner"})["programs"][0]
    assert got["compiled"] and base["compiled"]
    assert got["memory"]["argument_bytes"] < base["memory"]["argument_bytes"] / 2


def test_paper_table_markdown_from_rows(tmp_path):
    """memory.md/.csv written from rows (sorted by scale, method, chip) and read back for resuming."""
    row = dict(scale="1B", method="DP", chip="v5e", topology="v5e:8x8", chips=64, devices=64, mesh="replica1×data1×fsdp64",
               params=1_300_000_000, global_batch=256, seq_len=2048, device_hbm_gib=16.0, state_gib=0.3,
               inner_peak_gib=9.5, eval_peak_gib=2.0, peak_gib=9.5, headroom=0.406, fits=True, step_tflop=4000.0,
               step_seconds=0.79, compile_seconds=100.0, note="")
    small = dict(row, scale="35M", topology="v5e:2x2", chips=4, devices=4, params=35_000_000)
    C.write_table([row, small], str(tmp_path))
    back = C.read_table(tmp_path / "memory.csv")
    assert [r["scale"] for r in back] == ["35M", "1B"] and back[1]["topology"] == "v5e:8x8"
    md = (tmp_path / "memory.md").read_text()
    assert "| 1B | DP | v5e:8x8 | 64 | replica1×data1×fsdp64 | 1,300M | 9.5 | 16.0 | 41% | yes |" in md
