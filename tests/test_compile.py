"""`diloco compile`: the project's programs compiled for a real TPU topology on this CPU machine (libtpu)."""
import importlib.util
import os

import pytest
from conftest import tiny_config

from diloco import compile as C
from diloco.errors import ConfigError

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu not installed (pip install -e '.[tpu]')")


def fake_mesh(slices: list[int], shape: tuple, axes: tuple):
    """A Mesh of stand-in devices 0, 1, … with the given slice indices (parse_collectives reads only these)."""
    import numpy as np
    from jax.sharding import Mesh

    class D:
        def __init__(self, i, s):
            self.id, self.slice_index = i, s
    return Mesh(np.array([D(i, s) for i, s in enumerate(slices)], dtype=object).reshape(shape), axes)


def test_hlo_parsing_hand_written():
    hlo = """
  %p0 = f32[2,128]{1,0} parameter(0)
  %p1 = bf16[64]{0} parameter(1)
  %all-gather-start = (bf16[64]{0}, bf16[128]{0}) all-gather-start(%p1), channel_id=1, replica_groups=[2,2]<=[2,2]T(1,0), dimensions={0}, use_global_device_ids=true
  %all-gather-done = bf16[128]{0} all-gather-done(%all-gather-start)
  ROOT %all-reduce = f32[2,128]{1,0} all-reduce(%p0), channel_id=2, replica_groups={{0,1},{2,3}}, use_global_device_ids=true, to_apply=%add
"""
    rows = C.parse_collectives(hlo, fake_mesh([0, 0, 1, 1], (2, 2), ("replica", "data")))
    assert [(r["kind"], r["operand_bytes"], r["async"], r["axes"], r["crosses_slices"]) for r in rows] == [
        ("all-gather", 128, True, ["replica"], True),   # groups {0,2},{1,3}: across the replica axis
        ("all-reduce", 1024, False, ["data"], False)]   # groups {0,1},{2,3}: inside a slice
    assert C.shape_bytes("(f32[4]{0}, u8[3]{0}, token[])") == 19


def test_without_libtpu_says_how_to_install(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "libtpu", None)  # import libtpu → ImportError
    with pytest.raises(ConfigError) as e:
        C.tpu_devices("v5e:2x2")
    assert "pip install -e '.[tpu]'" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("topology", ["v9z:2x2", pytest.param("v5e:3x7", marks=needs_libtpu)])
def test_unknown_topology_is_one_line_error(topology):
    """v9z: no such chip; v5e:3x7: a shape libtpu does not know."""
    with pytest.raises(ConfigError) as e:
        C.tpu_devices(topology)
    assert e.value.field == "--topology" and "\n" not in str(e.value)
    assert str(e.value).startswith("--topology: ") and topology in str(e.value)


def test_hlo_mesh_form_replica_groups():
    """XLA's mesh form: mesh['axis_0'=2,'axis_1'=2] {'axis_0'} groups devices {0,2},{1,3}."""
    mesh = fake_mesh([0] * 8, (2, 2, 2), ("replica", "data", "fsdp"))
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
    import jax
    import numpy as np

    from diloco.trainer import Trainer

    devs = C.tpu_devices("v5e:2x2")
    whole = C.per_chip_bytes(Trainer(tiny_config("dp", batch_size=8), devices=devs).abstract_state())
    tr = Trainer(tiny_config("dp", batch_size=8, **{"mesh.data": 1, "mesh.fsdp": 4}), devices=devs)
    st = tr.abstract_state()
    # by hand: a leaf with an 'embed' dim of 32 is split 4 ways; q/k norms (head_dim) and the step are not
    repl = sum(int(np.prod(x.shape)) * x.dtype.itemsize for p, x in jax.tree_util.tree_flatten_with_path(st)[0]
               if x.ndim == 0 or tr.layout.names_at(p) is None or "embed" not in tr.layout.names_at(p))
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
    devs = C.tpu_devices("v5e:2x2")
    got = C.compile_trainer(tiny_config("dp", batch_size=8, **{"mesh.data": 1, "mesh.fsdp": 4}), devs,
                            {"inner"})["programs"][0]
    base = C.compile_trainer(tiny_config("dp", batch_size=8), devs, {"inner"})["programs"][0]
    assert got["compiled"] and base["compiled"]
    assert got["memory"]["argument_bytes"] < base["memory"]["argument_bytes"] / 2


def test_paper_table_markdown_from_rows(tmp_path):
    """memory.md/.csv written from rows (sorted by scale, method, chip) and read back for resuming. A row
    compiled with every program of the run names its peak program; a row from before #25 (inner + eval,
    no flags) gets those columns filled as what it compiled and its fit is shown as inner+eval's only."""
    row = dict(scale="1B", method="DP", chip="v5e", topology="v5e:8x8", chips=64, devices=64, mesh="replica1×data1×fsdp64",
               params=1_300_000_000, global_batch=256, seq_len=2048, device_hbm_gib=16.0, state_gib=0.3,
               inner_peak_gib=9.5, eval_peak_gib=2.0, peak_gib=9.5, headroom=0.406, fits=True, step_tflop=4000.0,
               step_seconds=0.79, compile_seconds=100.0, note="", programs="inner, eval",
               program_peaks_gib="inner=9.5; eval=2.0", peak_program="inner", compiled_with=C.compiled_with())
    small = dict(scale="35M", method="DP", chip="v5e", topology="v5e:2x2", chips=4, devices=4, mesh="replica1×data1×fsdp4",
                 params=35_000_000, global_batch=32, seq_len=2048, device_hbm_gib=16.0, state_gib=0.1,
                 inner_peak_gib=1.4, eval_peak_gib=1.5, peak_gib=1.5, headroom=0.906, fits=True, step_tflop=18.8,
                 step_seconds=0.06, compile_seconds=60.0, note="")  # a row as committed before #25
    C.write_table([row, small], str(tmp_path))
    back = C.read_table(tmp_path / "memory.csv")
    assert [r["scale"] for r in back] == ["35M", "1B"] and back[1]["topology"] == "v5e:8x8"
    assert back[0]["programs"] == "inner, eval" and back[0]["peak_program"] == "eval"
    assert back[0]["program_peaks_gib"] == "inner=1.4; eval=1.5" and back[0]["compiled_with"] == C.COMPILED_BEFORE
    assert back[1]["compiled_with"] == C.compiled_with()
    md = (tmp_path / "memory.md").read_text()
    assert ("| 1B | DP | v5e:8x8 | 64 | replica1×data1×fsdp64 | 1,300M | 9.5 | inner | 16.0 | 41% | yes | distinct |"
            in md)
    assert "| 35M | DP | v5e:2x2 | 4 | replica1×data1×fsdp4 | 35M | 1.5 | eval | 16.0 | 91% | inner+eval: yes | inner+eval |" in md
    assert "Rows marked `distinct`: 1 of 2" in md and " ".join(C.TPU_OVERLAP_FLAGS) in md


def test_compiled_with_names_the_flags_and_versions():
    """`overlap flags` only when every project flag is in LIBTPU_INIT_ARGS; the versions are the installed ones."""
    import importlib.metadata

    import jax

    tail = f"; jax {jax.__version__}, libtpu {importlib.metadata.version('libtpu') if importlib.util.find_spec('libtpu') else 'none'}"
    assert C.compiled_with(list(C.TPU_OVERLAP_FLAGS)) == "distinct run programs, overlap flags" + tail
    assert C.compiled_with([]) == "distinct run programs, no overlap flags" + tail
    assert C.compiled_with(list(C.TPU_OVERLAP_FLAGS[1:])) == ("distinct run programs, LIBTPU_INIT_ARGS="
                                                             + " ".join(C.TPU_OVERLAP_FLAGS[1:]) + tail)
    assert C.parse_peaks("inner=81.97; eval=25.8; step+send 3=80.9") == {"inner": 81.97, "eval": 25.8,
                                                                           "step+send 3": 80.9}


@needs_libtpu
def test_table_programs_are_the_distinct_programs_of_a_run():
    """tiny Streaming (τ=1) on v5e:2x2: the exchange rides on the step (in_step on TPU), so a run executes
    inner, step+send/send/update/merge per fragment layout plus the undonated update/merge copies an
    evaluation with a fragment in flight runs, and eval. Without nn.scan every block is its own leaf, so
    every fragment has its own layout (6P + 2 programs); with nn.scan (the paper's scales) fragments
    1…P−1 share one program per kind and the one holding the embeddings has its own: 6·2 + 2, whatever
    P. The table compiles all of them. DiLoCo (τ=0: blocking send, nothing in flight) has no step+send
    and no drained copies; DP only
    inner and eval."""
    from diloco.trainer import Trainer

    devs = C.tpu_devices("v5e:2x2")
    kinds = ("step+send", "send", "update", "merge")
    tr = Trainer(tiny_config("streaming", codec="bf16", batch_size=8, tau=1, layers_per_fragment=1),
                 devices=devs)
    P = tr.driver.P
    assert tr.driver.exchange == "in_step" and P >= 3 and tr.sync.frags.groups() == tuple((p,) for p in range(P))
    copies = ("update", "merge")  # τ = 1: a fragment is in flight at an evaluation, drained by undonated copies
    per = lambda g: [f"{k} {g}" for k in kinds] + [f"{k} {g} (drained copy)" for k in copies]
    assert [n for n, _, _ in C.trainer_programs(tr)] == ["inner"] + [n for p in range(P) for n in per(p)] + ["eval"]
    assert C.table_programs(tr) == [n for n, _, _ in C.trainer_programs(tr)]
    sc = Trainer(tiny_config("streaming", codec="bf16", batch_size=8, tau=1, layers_per_fragment=1,
                             **{"model.scan": True}), devices=devs)
    assert sc.driver.P == P and sc.sync.frags.groups() == ((0,), tuple(range(1, P)))
    assert C.table_programs(sc) == ["inner"] + [n for g in ("0", f"1-{P - 1}") for n in per(g)] + ["eval"]
    dl = Trainer(tiny_config("diloco", batch_size=8), devices=devs)
    assert dl.driver.exchange == "blocking" and C.table_programs(dl) == ["inner", "send 0", "update 0", "merge 0", "eval"]
    dp = Trainer(tiny_config("dp", batch_size=8), devices=devs)
    assert C.table_programs(dp) == ["inner", "eval"]


def _committed_rows():
    from pathlib import Path

    return C.read_table(Path(__file__).parent.parent / "results" / "pod" / "memory.csv")


def test_committed_memory_rows_are_consistent():
    """Every row of results/pod/memory.csv records what it compiled; a row compiled with the run's programs
    has its peak = the largest of its programs' peaks, named, headroom and fits decided on that peak
    (≥10% of device HBM free), compiled with the overlap flags; a row from before (inner + eval, no
    flags) is not shown as a run's fit in memory.md."""
    from pathlib import Path

    rows = _committed_rows()
    assert len({C.row_id(r)[:3] for r in rows}) == len(C.PAPER_SCALES) * len(C.PAPER_METHODS) * len(C.SLICES)
    md = (Path(__file__).parent.parent / "results" / "pod" / "memory.md").read_text()
    for r in rows:
        peaks = C.parse_peaks(r["program_peaks_gib"])
        assert set(peaks) <= set(r["programs"].split(", ")) and ({"inner", "eval"} <= set(peaks) or r["fits"] == "False"), r
        if r["peak_gib"] == "":  # a program ran out of HBM in the compile (the note names it): no peak to check
            continue
        top = max(peaks, key=peaks.get)
        assert r["peak_program"] == top and float(r["peak_gib"]) == peaks[top], r
        assert float(r["headroom"]) == pytest.approx(1 - peaks[top] / (hbm := float(r["device_hbm_gib"])), abs=6e-4), r
        assert (r["fits"] == "True") == (peaks[top] <= (1 - C.TABLE_HEADROOM) * hbm and set(peaks) == set(r["programs"].split(", "))), r
        cell = f"| {r['scale']} | {r['method']} | {r['topology']} | {r['chips']} | {r['mesh']} |"
        line = next(x for x in md.splitlines() if x.startswith(cell))
        kind = C.compiled_kind(r)
        if kind == "inner+eval":
            assert r["programs"] == "inner, eval" and "| inner+eval: " in line and "| inner+eval |" in line, line
        elif kind == "largest fragment":
            assert "| largest fragment: " in line and "| largest fragment |" in line, line
        else:
            assert r["compiled_with"].startswith(("distinct run programs, overlap flags; ", "run programs, overlap "
                                                  "flags; " if r["method"] != "Streaming" else "-")), r
            assert r["distinct_programs"] in ("", str(len(r["programs"].split(", ")))), r
            assert f"| {'yes' if r['fits'] == 'True' else 'NO'} | distinct |" in line, line


@needs_libtpu
def test_committed_memory_rows_compiled_every_program_of_the_run(shared_dir):
    """The fit claimed for a row covers what a run executes: its programs are exactly `table_programs`
    of the Trainer built for its config on its slice — each kind of program the run's Trainer has
    (`trainer_programs`: Streaming's step+send, DiLoCo's whole-model send/update/merge), for the
    largest fragment. (Building the Trainers compiles nothing.)"""
    from diloco.resolve import mesh_shape
    from diloco.trainer import Trainer

    spm = str(shared_dir / "data" / "vocab" / "sentencepiece_cc_all.32000.100extra-sentencepiece.model")
    run = [r for r in _committed_rows() if C.compiled_kind(r) == "distinct"]
    assert run, "no row of results/pod/memory.csv is compiled with the run's programs"
    seen = {}
    for r in run:
        if (r["scale"], r["method"]) not in seen:
            cfg = C.paper_config(r["scale"], r["method"], spm)
            R = 1 if cfg.method == "dp" else cfg.replicas
            devs = C.tpu_devices(r["topology"])
            cfg.mesh.replica_axis, cfg.mesh.data, cfg.mesh.fsdp = R if R > 1 else 0, 1, -1
            mesh_shape(cfg, len(devs))  # the mesh and batch fit the devices
            tr = Trainer(cfg, devices=devs)
            every = [n for n, _, _ in C.trainer_programs(tr)]
            seen[r["scale"], r["method"]] = C.table_programs(tr), {n.split(" ")[0] for n in every}
        want, kinds = seen[r["scale"], r["method"]]
        got = r["programs"].split(", ")
        if r["fits"] == "True":
            assert got == want, (r["scale"], r["method"], r["chip"], got, want)
        assert {n.split(" ")[0] for n in want} == kinds
        assert ("step+send" in kinds) == (r["method"] == "Streaming") and ("send" in kinds) == (r["method"] != "DP")


@needs_libtpu
@pytest.mark.slow
def test_a_fresh_compile_of_a_memory_row_equals_the_committed_row(shared_dir, tmp_path):
    """`diloco compile --paper-table` run afresh (its own process, so the overlap flags are set before
    libtpu starts, as `diloco train` sets them) for 35M Streaming on v5e: the same slice, the same
    programs (step+send included) and every program's peak equal to the committed row's to the
    table's rounding (0.001 GiB)."""
    import subprocess
    import sys

    spm = shared_dir / "data" / "vocab" / "sentencepiece_cc_all.32000.100extra-sentencepiece.model"
    env = {k: v for k, v in __import__("os").environ.items() if k != "LIBTPU_INIT_ARGS"}
    out = subprocess.run([sys.executable, "-m", "diloco.cli", "compile", "--paper-table", "--out", str(tmp_path),
                          "--scales", "35M", "--methods", "Streaming", "--chips", "v5e", "--spm", str(spm),
                          "--cache", "none"], env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-2000:]
    (fresh,) = C.read_table(tmp_path / "memory.csv")
    (committed,) = [r for r in _committed_rows() if (r["scale"], r["method"], r["chip"]) == ("35M", "Streaming", "v5e")]
    assert fresh["compiled_with"].startswith("distinct run programs, overlap flags; ")
    assert fresh["compiled_with"] == committed["compiled_with"]
    assert any(p.startswith("step+send ") for p in fresh["programs"].split(", "))
    for k in ("topology", "mesh", "programs", "peak_program", "fits"):
        assert fresh[k] == committed[k], k
    a, b = C.parse_peaks(fresh["program_peaks_gib"]), C.parse_peaks(committed["program_peaks_gib"])
    assert a.keys() == b.keys() and all(abs(a[p] - b[p]) <= 0.001 for p in a), (a, b)


# -- exchange=in_step: what the scheduled program runs under each collective (issue #15) ----------
SCHEDULED_HLO = """
HloModule m, is_scheduled=true

%conv_fusion (p.0: f32[2,10,3], p.1: f32[3,3,5]) -> f32[2,10,5] {
  %p.0 = f32[2,10,3]{2,1,0} parameter(0)
  %p.1 = f32[3,3,5]{2,1,0} parameter(1)
  ROOT %conv = f32[2,10,5]{2,1,0} convolution(%p.0, %p.1), window={size=3 pad=1_1}, dim_labels=b0f_0io->b0f
}

ENTRY %main (a: f32[4,8], b: f32[8,16], x: f32[2,10,3], k: f32[3,3,5], g: bf16[64]) -> f32[4,16] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[8,16]{1,0} parameter(1)
  %x = f32[2,10,3]{2,1,0} parameter(2)
  %k = f32[3,3,5]{2,1,0} parameter(3)
  %g = bf16[64]{0} parameter(4)
  %tok = token[] after-all()
  %ag-start = (bf16[64]{0}, bf16[128]{0}) all-gather-start(%g), channel_id=1, replica_groups={{0,1}}, dimensions={0}
  %dot.1 = f32[4,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %send = (bf16[64]{0}, u32[], token[]) send(%g, %tok), channel_id=2, is_host_transfer=true, frontend_attributes={_xla_host_transfer_rendezvous="ag_0",_xla_megascale_transfer_type="ALL_GATHER"}
  %fusion.1 = f32[2,10,5]{2,1,0} fusion(%x, %k), kind=kOutput, calls=%conv_fusion, backend_config={"estimated_cycles":"100"}
  %recv = (bf16[128]{0}, u32[], token[]) recv(%tok), channel_id=3, is_host_transfer=true, frontend_attributes={_xla_host_transfer_rendezvous="ag_0",_xla_megascale_transfer_type="ALL_GATHER"}
  %dot.2 = f32[4,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}, backend_config={"estimated_cycles":"7"}
  %ag-done = bf16[128]{0} all-gather-done(%ag-start)
  %send-done = token[] send-done(%send), channel_id=2, is_host_transfer=true
  %dot.3 = f32[4,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %recv-done = (bf16[128]{0}, token[]) recv-done(%recv), channel_id=3, is_host_transfer=true
  %ar = f32[4,16]{1,0} all-reduce(%dot.3), channel_id=4, replica_groups={{0,1}}, to_apply=%conv_fusion
  ROOT %out = f32[4,16]{1,0} add(%ar, %dot.1)
}
"""


def test_overlap_of_hand_written_schedule():
    """By hand: a [4,8]·[8,16] dot is 2·4·16·8 = 1024 FLOPs. The convolution (batch 2, 10 positions,
    window 3 with pad 1, 3 → 5 features) has 10·3 − 2 = 28 valid (output, tap) pairs, so
    2 · 2 · 5 · 3 · 28 = 1680 FLOPs (not 2·100·3·3 = 1800: the two padded taps are not work).
    all-gather-start … done has dot.1, fusion.1, dot.2 under it: 1024 + 1680 + 1024 = 3728 FLOPs
    (send/recv are not compute). The DCN transfer runs from its later issue (recv) to its earlier
    done (send-done): only dot.2, 1024 FLOPs, 7 cycles; the received data is in hand at recv-done. The plain all-reduce is synchronous: 0."""
    sched = C.scheduled_overlap(SCHEDULED_HLO)
    assert sched["ag-start"] == {"async": True, "done": "ag-done", "overlapped_ops": 3,
                                 "overlapped_flops": 3728.0, "overlapped_cycles": 107, "window": [6, 12]}
    assert sched["send"] == {"async": True, "done": "recv-done", "overlapped_ops": 1,
                             "overlapped_flops": 1024.0, "overlapped_cycles": 7, "window": [10, 13]}
    assert sched["ar"]["async"] is False and sched["ar"]["overlapped_flops"] == 0.0
    rows = C.annotate_overlap(C.parse_collectives(SCHEDULED_HLO), SCHEDULED_HLO)
    assert [(r["kind"], r["async"], r["overlapped_flops"]) for r in rows] == [
        ("all-gather", True, 3728.0), ("dcn-all-gather", True, 1024.0), ("all-reduce", False, 0.0)]


KERNEL_HLO = """HloModule m

ENTRY %main (a: f32[4,8], b: f32[8,16], g: bf16[64]) -> f32[4,16] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[8,16]{1,0} parameter(1)
  %g = bf16[64]{0} parameter(2)
  %tok = token[] after-all()
  %send = (bf16[64]{0}, u32[], token[]) send(%g, %tok), channel_id=2, is_host_transfer=true, frontend_attributes={_xla_host_transfer_rendezvous="ag_0"}
  %recv = (bf16[128]{0}, u32[], token[]) recv(%tok), channel_id=3, is_host_transfer=true, frontend_attributes={_xla_host_transfer_rendezvous="ag_0"}
  %kernel = f32[4,16]{1,0} custom-call(%a, %b), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "x",
"xprof_metadata":"{\\"block_q\\": 128
}}, metadata={op_name="splash"}
  %dot.1 = f32[4,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %send-done = token[] send-done(%send), channel_id=2, is_host_transfer=true
  %recv-done = (bf16[128]{0}, token[]) recv-done(%recv), channel_id=3, is_host_transfer=true
  ROOT %out = f32[4,16]{1,0} add(%kernel, %dot.1)
}
"""


def test_a_kernel_attribute_with_newlines_does_not_end_the_computation():
    """A Pallas kernel's custom call (splash attention) carries metadata with newlines in it, so
    a line of the module may begin with "}}": the computation goes on to its lone "}". Under the
    transfer: the kernel and dot.1 (2·4·16·8 = 1024 FLOPs; a kernel's own FLOPs are unknown)."""
    comps, entry = C.hlo_computations(KERNEL_HLO)
    assert [n for n, _, _, _ in comps[entry]][-4:] == ["dot.1", "send-done", "recv-done", "out"]
    assert C.scheduled_overlap(KERNEL_HLO)["send"] == {"async": True, "done": "recv-done", "overlapped_ops": 2,
                                                       "overlapped_flops": 1024.0, "overlapped_cycles": 0,
                                                       "window": [5, 8]}


LOOP_HLO = """HloModule m

%body (p: (s32[], f32[256])) -> (s32[], f32[256]) {
  %p = (s32[], f32[256]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %g = f32[256]{0} get-tuple-element(%p), index=1
  %ar = f32[256]{0} all-reduce(%g), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  ROOT %t = (s32[], f32[256]) tuple(%i, %ar)
}

%cond (p: (s32[], f32[256])) -> pred[] {
  %p = (s32[], f32[256]) parameter(0)
  %n = s32[] constant(24)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %c = pred[] compare(%i, %n), direction=LT
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (x: (s32[], f32[256]), y: f32[64]) -> f32[64] {
  %x = (s32[], f32[256]) parameter(0)
  %y = f32[64]{0} parameter(1)
  %w = (s32[], f32[256]) while(%x), condition=%cond, body=%body
  ROOT %ar2 = f32[64]{0} all-reduce(%y), channel_id=2, replica_groups={{0,1}}, to_apply=%add
}
"""


def test_a_collective_in_a_layer_loop_counts_once_per_layer():
    """The gradient reduction of a scanned model sits in the loop body: 24 runs of 1,024 B per step (the
    trip count from the loop's condition `i < 24`: libtpu's scheduled text has no known_trip_count),
    and the entry's own all-reduce once (256 B). DP's predicted CU puts every run on the link: with
    4 chips per slice, (24·1024 + 256) · 4 = 99,328 B per step."""
    rows = {r["name"]: r for r in C.parse_collectives(LOOP_HLO)}
    assert (rows["ar"]["count"], rows["ar"]["operand_bytes"]) == (24, 1024)
    assert (rows["ar2"]["count"], rows["ar2"]["operand_bytes"]) == (1, 256)
    dcn = [dict(r, crosses_slices=True) for r in rows.values()]
    rep = {"topology": "v5p:2x2x1", "chips": 8, "slices": 2, "method": "dp", "H": None,
           "programs": [{"program": "inner", "compiled": True, "flops": 1e12, "collectives": dcn}]}
    assert C.predict_cu(rep, 1.0)["exchanges"][0]["link_bytes"] == 99_328


def test_predicted_cu_by_hand():
    """One slice pair of 4 chips each, a 6e12-FLOP step at MFU 0.5 × 100 TFLOP/s = 0.12 s, H = 10.
    Fragment 0's step+send moves 1e8 B/chip → 4e8 B on the link = 3.2 s at 1 Gbit/s, with 2e13 FLOPs
    (0.4 s) under it: 2.8 s exposed, CU = 1.2 / (1.2 + 2.8) = 0.3. At 10 Gbit/s 0.32 s < 0.4 s: CU 1.
    The blocking send program is not counted when its step+send is there."""
    dcn = {"kind": "dcn-all-gather", "crosses_slices": True, "operand_bytes": 10 ** 8, "async": True,
           "overlapped_flops": 2e13}
    rep = {"topology": "v5p:2x2x1", "chips": 8, "slices": 2, "method": "streaming", "H": 10, "programs": [
        {"program": "inner", "compiled": True, "flops": 6e12, "collectives": []},
        {"program": "step+send 0", "compiled": True, "flops": 7e12, "collectives": [dcn]},
        {"program": "send 0", "compiled": True, "flops": 1e9, "collectives": [dict(dcn, overlapped_flops=0.0)]}]}
    p = C.predict_cu(rep, 1.0, mfu=0.5, peak_tflops=100)
    assert [e["program"] for e in p["exchanges"]] == ["step+send 0"]
    assert p["exchanges"][0]["exposed_s"] == pytest.approx(2.8) and p["cu"] == pytest.approx(0.3)
    assert C.predict_cu(rep, 10.0, mfu=0.5, peak_tflops=100)["cu"] == 1.0
    # FP4's block scales in a window of their own after the step (nothing under it): 2.5e7 B/chip → 1e8 B
    # on the link = 0.8 s exposed on top, whatever is under the codes' window: CU = 1.2 / (1.2 + 3.6)
    codes = dict(dcn, window=[10, 900])
    scales = dict(dcn, operand_bytes=2.5 * 10 ** 7, overlapped_flops=0.0, window=[950, 960])
    split = dict(rep, programs=[rep["programs"][0], {"program": "step+send 0", "compiled": True, "flops": 7e12,
                                                      "collectives": [codes, scales]}])
    p2 = C.predict_cu(split, 1.0, mfu=0.5, peak_tflops=100)
    assert p2["exchanges"][0]["exposed_s"] == pytest.approx(2.8 + 0.8) and p2["cu"] == pytest.approx(1.2 / 4.8)
    # the scales issued with the codes but waited for before the compute (as libtpu scheduled 4B): the
    # link carries them first (0.8 s, nothing under them: the stall), then the codes, 4.0 s in all,
    # against 0.4 s under the codes: the worst wait is max(0.8 − 0, 4.0 − 0.4) = 3.6 s
    early = dict(scales, window=[11, 20])
    p3 = C.predict_cu(dict(split, programs=[rep["programs"][0], dict(split["programs"][1],
                                                                        collectives=[codes, early])]), 1.0,
                      mfu=0.5, peak_tflops=100)
    assert p3["exchanges"][0]["exposed_s"] == pytest.approx(3.6)
    big = dict(codes, overlapped_flops=6e14)  # 12 s of compute under the codes: only the scales stall
    p4 = C.predict_cu(dict(split, programs=[rep["programs"][0], dict(split["programs"][1],
                                                                        collectives=[big, early])]), 1.0,
                      mfu=0.5, peak_tflops=100)
    assert p4["exchanges"][0]["exposed_s"] == pytest.approx(0.8)
    failed = dict(rep, programs=[{"program": "step+send 0", "compiled": False, "error": "RESOURCE_EXHAUSTED"}])
    assert C.predict_cu(failed, 1.0)["cu"] is None  # the report (with the compile error) is still printed
    assert C.parse_bandwidth("1Gbit,10, 100Gbit/s") == [1.0, 10.0, 100.0]
    with pytest.raises(ConfigError, match=r"^--bandwidth: 'fast'"):
        C.parse_bandwidth("fast")


def test_tpu_overlap_flags_keep_what_the_user_set(monkeypatch):
    env = {"LIBTPU_INIT_ARGS": "--xla_tpu_enable_latency_hiding_scheduler=false --my_flag=1"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # as on a TPU VM
    flags = C.use_tpu_overlap_flags(env)
    assert flags[:2] == ["--xla_tpu_enable_latency_hiding_scheduler=false", "--my_flag=1"]
    assert set(flags[2:]) == set(C.TPU_OVERLAP_FLAGS) - {"--xla_tpu_enable_latency_hiding_scheduler=true"}
    assert env["LIBTPU_INIT_ARGS"] == " ".join(flags)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # no libtpu: nothing changes
    env2 = {}
    assert C.use_tpu_overlap_flags(env2) == [] and env2 == {}


def _two_slice(method: str, tau: int, programs: set[str], **kw):
    C.use_tpu_overlap_flags()
    cfg = tiny_config(method, **{"codec": "bf16", "batch_size": 8, "exchange": "in_step", "tau": tau, **kw})
    return C.report(cfg, "v5e:2x2", 2, programs)


@needs_libtpu
@pytest.mark.parametrize("tensor", [1, 2])
def test_two_slice_exchange_has_the_step_under_it_with_splash_attention_and_scan(tensor):
    """The same as the paper's scales run it: 128-token sequences (TPU's default attention is then the
    Pallas splash kernel), blocks under nn.scan (the forward and backward are two while loops) and the
    FP4 codec. The kernel's custom call (metadata with newlines in it) must not hide the rest of the
    schedule, and Δ must not be fused into the forward pass (driver.step_program's barrier; without
    it the payload waited for both loops and nothing was under the exchange), nor laid end to end after
    the step (the barrier takes `sync.wire`'s vector): it is async and every dot/convolution of the
    program outside the kernel is under it, with tensor 2 too (its collectives in the step)."""
    rep = _two_slice("streaming", 1, {"step+send 0"}, codec="e3m0", seq_len=128, **{"model.scan": True, "mesh.tensor": tensor})
    (prog,) = rep["programs"]
    assert "tpu_custom_call" in prog["custom_calls"] and (tensor == 1 or any(
        "tensor" in c["axes"] and not c["crosses_slices"] for c in prog["collectives"]))
    dcn = [c for c in prog["collectives"] if c["crosses_slices"]]
    assert dcn and all(c["async"] for c in dcn)
    # only the exchange crosses the slices (the average is cut into θᵍ's pieces within each replica), and
    # every dot/convolution of the program is under each of its transfers (the kernel's own are not counted)
    assert {c["kind"] for c in dcn} <= {"dcn-all-gather", "dcn-all-reduce"}
    assert all(c["overlapped_flops"] == prog["hlo_flops"] > 0 for c in dcn)


@needs_libtpu
@pytest.mark.parametrize("tau", [1, pytest.param(5, marks=pytest.mark.slow)])
def test_two_slice_in_step_exchange_is_async_with_the_step_under_it(tau):
    """tiny Streaming, replicas across two v5e:2x2 slices, exchange=in_step: fragment 0's exchange
    rides on the inner step's program; every collective crossing the slices is asynchronous
    (megascale send/recv … send-done/recv-done) and has the step's compute scheduled under it."""
    rep = _two_slice("streaming", tau, {"step+send 0"})
    assert rep["exchange"] == "in_step" and rep["mesh"] == {"replica": 2, "data": 4, "fsdp": 1}
    (prog,) = rep["programs"]
    dcn = [c for c in prog["collectives"] if c["crosses_slices"]]
    assert dcn and any(c["kind"] == "dcn-all-gather" and c["axes"] == ["replica"] for c in dcn)
    assert all(c["async"] and c["overlapped_flops"] > 0 for c in dcn)
    # the all-gathered payload is this chip's share of the counted bytes (4 chips per replica)
    gathered = sum(c["operand_bytes"] for c in dcn if c["kind"] == "dcn-all-gather")
    assert gathered * 4 == rep["bytes_per_replica"][0]
    assert "--xla_tpu_enable_latency_hiding_scheduler=true" in rep["libtpu_init_args"]


@needs_libtpu
def test_two_slice_dp_gradient_reduction_has_nothing_under_it():
    """DP across the same two slices, reported the same way: its gradient reduction crosses the
    slices as an async megascale transfer, but the update needs it, so no compute is scheduled
    under it (the contrast with the in_step exchange above)."""
    rep = _two_slice("dp", 0, {"inner"})
    (prog,) = rep["programs"]
    dcn = [c for c in prog["collectives"] if c["crosses_slices"]]
    assert [c["kind"] for c in dcn] == ["dcn-all-reduce"]
    assert dcn[0]["overlapped_flops"] == 0.0 and dcn[0]["overlapped_ops"] == 0
    assert prog["flops"] > 0


def test_predicted_cu_of_a_scanned_model_uses_model_flops_and_the_share_under_the_exchange():
    """A scanned model's cost analysis counts one layer, so the report carries model FLOPs: 6e12 per
    chip at 0.5 × 100 TFLOP/s = 0.12 s per step. Half of step+send's own HLO FLOPs (1e12 of 2e12) sit
    under the 4e8-B transfer (3.2 s at 1 Gbit/s): 0.06 s hidden, 3.14 s exposed, H = 10:
    CU = 1.2 / (1.2 + 3.14)."""
    dcn = {"kind": "dcn-all-gather", "crosses_slices": True, "operand_bytes": 10 ** 8, "async": True,
           "overlapped_flops": 1e12}
    rep = {"topology": "v5p:2x2x1", "chips": 8, "slices": 2, "method": "streaming", "H": 10,
           "model_flops_per_chip": 6e12, "programs": [
               {"program": "inner", "compiled": True, "flops": 5e11, "hlo_flops": 2e12, "collectives": []},
               {"program": "step+send 0", "compiled": True, "flops": 5e11, "hlo_flops": 2e12, "collectives": [dcn]}]}
    p = C.predict_cu(rep, 1.0, mfu=0.5, peak_tflops=100)
    assert p["step_s"] == pytest.approx(0.12)
    assert p["exchanges"][0]["overlapped_s"] == pytest.approx(0.06)
    assert p["cu"] == pytest.approx(1.2 / (1.2 + 3.14))


@needs_libtpu
def test_paper_35m_streaming_compiles_for_v5e_2x2_with_its_defaults(shared_dir):
    """The 35M Streaming spec as a user runs it (every default on auto: nn.scan, remat, the splash
    kernel, FP4 e3m0 outer gradients) on v5e:2x2 = replica 2 × fsdp 2, 4 sequences of 2048 per chip:
    the inner step fits a v5e chip with the Pallas kernel compiled in (a Mosaic custom call), and
    fragment 1's send gathers over `replica` only each chip's half of the encoded fragment, so the
    bytes crossing `replica` are what `bytes_exchanged` counts, plus the zeros that round the fragment up
    to whole 256-element blocks per chip (≤ 2 × (128 + 4) bytes)."""
    spm = shared_dir / "data" / "vocab" / "sentencepiece_cc_all.32000.100extra-sentencepiece.model"
    cfg = C.paper_config("35M", "Streaming", str(spm))
    cfg.mesh.replica_axis, cfg.mesh.data, cfg.mesh.fsdp = 2, 1, -1
    cfg.batch_size = 16
    rep = C.report(cfg, "v5e:2x2", 1, {"inner", "send 1"})
    inner, send = rep["programs"]
    assert rep["mesh"] == {"replica": 2, "data": 1, "fsdp": 2} and inner["compiled"] and send["compiled"]
    assert "tpu_custom_call" in inner["custom_calls"]  # splash attention, compiled for TPU
    assert rep["state_bytes_per_chip"] < inner["peak_bytes_per_chip"] < 0.9 * 16 * C.GiB
    assert rep["exchange_shards"][1] == 2
    gathers = [c for c in send["collectives"] if c["axes"] == ["replica"]]
    assert gathers and all(c["kind"] in ("all-gather", "all-reduce") and c["group_size"] == 2 for c in gathers)
    # XLA may lower a small gather (the block scales) as an all-reduce of the gathered buffer, to which
    # each chip contributes its own part: operand / group size
    wire = 2 * sum(c["operand_bytes"] / (1 if c["kind"] == "all-gather" else c["group_size"]) for c in gathers)
    assert wire == rep["wire_bytes_per_replica"][1] + 2 * 4  # + each chip's f32 replica weight beside it
    assert 0 < wire - rep["bytes_per_replica"][1] <= 2 * (128 + 4)  # fragment 1 does not divide: padded


@needs_libtpu
def test_toy_dp_compiles_with_splash_on_four_chips_and_writes_no_persistent_cache(tmp_path, capsys):
    """DP at toy scale on v5e:2x2 (data 4, fsdp 1) resolves splash attention; its evaluation is traced
    outside any shard_map, so the kernel must find the mesh there (it did not: "Mosaic kernels cannot
    be automatically partitioned"). And `diloco compile` turns JAX's persistent compilation cache off
    (deviceless TPU executables cannot be read back: the next compile warned "PjRtCompiler must be
    constructed with a Client" for each; its seconds must be compiles): with a cache configured, as a
    user's would be, nothing is written to it."""
    import jax

    from diloco import cli

    keys = ("jax_enable_compilation_cache", "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    before = {k: getattr(jax.config, k) for k in keys}
    env = os.environ.get("JAX_ENABLE_COMPILATION_CACHE")
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    try:
        rc = cli.run(["compile", "--config", "experiments/toy.py:dp", "--topology", "v5e:2x2",
                      "--programs", "inner,eval"])
    finally:
        for k, v in before.items():
            jax.config.update(k, v)
        os.environ.pop("JAX_ENABLE_COMPILATION_CACHE", None) if env is None else os.environ.update(
            JAX_ENABLE_COMPILATION_CACHE=env)
    out = capsys.readouterr().out
    assert rc == 0 and "resolved attention: splash" in out and "\neval " in out, out
    assert not (tmp_path / "jax").exists() or not list((tmp_path / "jax").iterdir())
