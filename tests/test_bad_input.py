"""Bad input, table-driven: every bad config or data file fails before training, with ConfigError naming
the field and a message that says what was wrong. Malformed eval items name file:line."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from conftest import tiny_config
from diloco.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Bad:
    id: str
    overrides: dict | Callable[[Path], dict]  # a dict, or a function of tmp_path that writes files first
    field: str
    message: str  # regex searched in str(error)
    method: str = "streaming"
    devices: int | None = None  # also validate the mesh for this many devices (what a run does at start-up)


# -- bad data files (each writer returns the overrides that point at it) -------------------------------
def write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def jsonl(tmp: Path, text: bytes | str) -> dict:
    return {"data": f"jsonl:{write(tmp / 'd' / 'a.jsonl', text)}"}


def text_files(tmp: Path, contents: list[bytes]) -> dict:
    for i, c in enumerate(contents):
        write(tmp / "t" / f"doc{i}.txt", c)
    return {"data": f"text:{tmp / 't' / '*.txt'}"}


def piqa_dir(tmp: Path, items: list[str], labels: str) -> dict:
    write(tmp / "eval" / "piqa" / "valid.jsonl", "".join(i + "\n" for i in items))
    write(tmp / "eval" / "piqa" / "valid-labels.lst", labels)
    return {"downstream.tasks": "piqa", "downstream.data_dir": str(tmp / "eval")}


PIQA_OK = json.dumps({"goal": "open a jar", "sol1": "twist the lid", "sol2": "eat the lid"})

BAD = [
    # config values
    Bad("unknown_key", {"nonsense_key": 1}, "nonsense_key", r"unknown config key 'nonsense_key'"),
    Bad("unknown_nested_key", {"model.nonsense": 1}, "model.nonsense", r"unknown config key 'model.nonsense'"),
    Bad("misspelt_key", {"optimizer.lrr": 1}, "optimizer.lrr", r"unknown config key 'optimizer.lrr'; did you mean optimizer.lr\?"),
    Bad("group_not_value", {"optimizer": 1}, "optimizer", r"is a group of keys, not a value; set one of optimizer\.\{.*lr,"),
    Bad("wrong_type", {"steps": "ten"}, "steps", r"^steps: 'ten' is not an integer; e.g. --config.steps=300$"),
    Bad("non_boolean", {"model.remat": "maybe"}, "model.remat", r"'maybe' is not a boolean; use true or false"),
    Bad("zero_steps", {"steps": 0}, "steps", r"0 is out of range; use a value ≥ 1"),
    Bad("unknown_scale", {"scale": "70B"}, "scale", r"'70B' is not one of"),
    Bad("seq_len_over_scale", {"seq_len": 4096}, "seq_len", r"4096 exceeds scale 'tiny'"),
    Bad("batch_not_divisible", {"batch_size": 5}, "batch_size", r"global batch 5 is not divisible by replicas=2"),
    Bad("alpha_range", {"alpha": 1.5}, "alpha", r"1.5 is out of range; use a value in \[0, 1\]"),
    Bad("tau_not_below_H", {"tau": 30, "H": 30}, "tau", r"tau=30 must satisfy 0 ≤ tau < H=30"),
    Bad("replica_tau_not_ints", {"replica_tau": "1,x"}, "replica_tau", r"comma-separated integers"),
    Bad("replica_tau_count", {"replica_tau": "1,2,3"}, "replica_tau", r"3 values given for replicas=2"),
    Bad("codec", {"codec": "fp3"}, "codec", r"fp3"),
    Bad("pattern", {"pattern": "random"}, "pattern", r"'random' is not one of"),
    Bad("too_many_fragments", {"fragments": 9, "layers_per_fragment": 0}, "fragments", r"9"),
    Bad("outer_lr", {"outer.lr": 0.0}, "outer.lr", r"0.0 is out of range; use a value > 0"),
    Bad("outer_name", {"outer.name": "lion"}, "outer.name", r"'lion' is not one of nesterov, sgd, adam"),
    Bad("outer_name_eager", {"outer.name": "adam", "eager": "swap", "tau": 0}, "outer.name", r"linear in Δ"),
    Bad("inner_lr", {"optimizer.lr": -1.0}, "optimizer.lr", r"-1.0 is out of range; use a value > 0"),
    Bad("dtype", {"model.dtype": "int8"}, "model.dtype", r"'int8' is not one of"),
    Bad("diloco_with_tau", {"tau": 1}, "method", r"diloco is P=1, tau=0", method="diloco"),
    Bad("spec_arg", {}, "config", r"experiments/toy.py:stream: choose dp, diloco or streaming", method="stream"),
    Bad("retired_data_readers", {"data_readers": 2}, "data_readers", r"unknown config key"),  # gone with #30
    Bad("dp_grad_dtype", {"dp_grad_dtype": "int8"}, "dp_grad_dtype", r"'int8' is not one of", method="dp"),
    Bad("remat_policy", {"model.remat_policy": "some"}, "model.remat_policy", r"'some' is not one of"),
    Bad("splash_seq_len", {"model.attention": "splash"}, "model.attention",
        r"splash tiles the sequence by 128; seq_len=32 is not a multiple"),
    Bad("scan", {"model.scan": "maybe"}, "model.scan", r"'maybe' is not one of auto, true, false"),
    Bad("eval_drain", {"eval_drain": "never"}, "eval_drain", r"'never' is not one of final, every"),
    Bad("in_step_without_tau", {"exchange": "in_step", "tau": 0}, "exchange", r"needs tau ≥ 1 \(got tau=0\)"),
    Bad("mesh_rules", {"mesh.rules": "batch"}, "mesh.rules", r"'batch' is not name=axis"),
    Bad("mesh_rules_axis", {"mesh.rules": "embed=model"}, "mesh.rules", r"'model' is not a mesh axis"),
    Bad("mesh_rules_name", {"mesh.rules": "embedding=fsdp"}, "mesh.rules", r"'embedding' is not a logical axis"),
    Bad("mesh_rules_twice", {"mesh.rules": "embed=fsdp,embed=data"}, "mesh.rules", r"'embed' is given twice"),
    Bad("mesh_rules_replica", {"mesh.rules": "batch=replica"}, "mesh.rules", r"'replica' is not a mesh axis inside"),
    Bad("mesh_fsdp_not_divisor", {"mesh.fsdp": 3, "batch_size": 16}, "mesh.fsdp", r"3 does not divide the 8 devices",
        method="dp", devices=8),
    Bad("mesh_product", {"mesh.data": 2, "mesh.fsdp": 2, "batch_size": 16}, "mesh.fsdp", r"= 4 ≠ the 8 devices",
        method="dp", devices=8),
    Bad("mesh_zero", {"mesh.data": 0}, "mesh.data", r"0 must be ≥ 1, or -1", devices=2),
    Bad("mesh_both_remaining", {"mesh.data": -1, "mesh.fsdp": -1}, "mesh.fsdp",
        r"mesh.data and mesh.fsdp are both -1", devices=2),
    Bad("mesh_data_not_divisor", {"mesh.data": 2, "mesh.fsdp": 2}, "mesh.data",
        r"2 does not divide the 1 devices of one replica", devices=2),
    Bad("mesh_tensor_not_heads", {"mesh.tensor": 4, "batch_size": 8}, "mesh.tensor",
        r"4 does not divide the 2 heads .*; use mesh.tensor=2", devices=8),
    Bad("replica_axis", {"mesh.replica_axis": 3}, "mesh.replica_axis", r"3 must divide both the 1 devices and replicas=2",
        devices=1),
    Bad("eager_rounds_without_eager", {"eager_rounds": 2}, "eager_rounds", r"eager_rounds=2 needs eager=naive"),
    Bad("eager_unknown", {"eager": "eagre"}, "eager", r"'eagre' is not one of off, naive, swap, mix"),
    Bad("eager_rounds_zero", {"eager": "swap", "eager_rounds": 0}, "eager_rounds", r"0 is out of range; use a value ≥ 1"),
    Bad("eager_rounds_not_int", {"eager": "mix", "eager_rounds": 1.5}, "eager_rounds", r"'1.5' is not an integer"),
    Bad("eager_with_tau", {"eager": "swap", "tau": 1}, "tau", r"eager=swap applies a round's average eager_rounds·H"),
    Bad("error_feedback_on_dp", {"error_feedback": True}, "error_feedback",
        r"applies to the outer exchange of method=diloco or streaming, not dp", method="dp"),
    # fault knobs
    Bad("nan_policy", {"faults.nan_policy": "ignore"}, "faults.nan_policy", r"'ignore' is not one of"),
    Bad("nan_replica", {"faults.nan_step": 2, "faults.nan_replica": 5}, "faults.nan_replica",
        r"5 is not a replica index in 0..1"),
    Bad("nan_step_past_end", {"faults.nan_step": 999}, "faults.nan_step", r"999 must be a step in 1..steps=6"),
    Bad("nan_outer_on_dp", {"faults.nan_step": 2, "faults.nan_target": "outer"}, "faults.nan_target",
        r"'outer' needs method diloco or streaming", method="dp"),
    Bad("nan_value", {"faults.nan_value": "zero"}, "faults.nan_value", r"'zero' is not one of nan, inf"),
    Bad("miss_sync_without_step", {"faults.miss_sync_replica": 1}, "faults.miss_sync_step",
        r"set faults.miss_sync_step ≥ 1"),
    Bad("restart_on_dp", {"faults.restart_replica": 0, "faults.restart_step": 2}, "faults.restart_replica",
        r"replica faults need method diloco or streaming", method="dp"),
    Bad("restart_replica_index", {"faults.restart_replica": 2, "faults.restart_step": 2},
        "faults.restart_replica", r"2 must be -1 \(off\) or a replica index in 0..1"),
    # vocabularies and corpora
    Bad("vocab_unknown", {"vocab": "wordpiece"}, "vocab", r"unknown vocab 'wordpiece'"),
    Bad("vocab_not_a_model", lambda t: {"vocab": f"sentencepiece:{write(t / 'junk.model', 'junk')}"}, "vocab",
        r"is not a SentencePiece model"),
    Bad("vocab_missing_file", {"vocab": "sentencepiece:/nonexistent/spm.model"}, "vocab", r"not found"),
    Bad("data_unknown", {"data": "bogus"}, "data", r"unknown data spec 'bogus'"),
    Bad("data_missing_files", {"data": "jsonl:/nonexistent/*.jsonl"}, "data", r"matches no file"),
    Bad("c4_not_prepared", {"data": "c4", "data_dir": "/nonexistent/tfds"}, "data_dir",
        r"no prepared TFDS 'c4' dataset under '/nonexistent/tfds'.*tfds build c4/en"),
    Bad("jsonl_empty_file", lambda t: jsonl(t, b""), "data", r"empty corpus"),
    Bad("jsonl_not_json", lambda t: jsonl(t, "this is not json\n"), "data", r"first line is not JSON"),
    Bad("jsonl_non_utf8", lambda t: jsonl(t, b'{"text": "caf\xe9"}\n'), "data", r"first line is not JSON"),
    Bad("jsonl_no_text_field", lambda t: jsonl(t, '{"content": "hello"}\n'), "data",
        r"records need a string 'text' field \(first record has \['content'\]\)"),
    Bad("jsonl_text_not_string", lambda t: jsonl(t, '{"text": 42}\n'), "data", r"string 'text' field"),
    Bad("text_non_utf8", lambda t: text_files(t, [b"fine", b"caf\xe9 latin-1"]), "data", r"is not UTF-8 text"),
    Bad("text_all_empty", lambda t: text_files(t, [b"", b""]), "data", r"empty corpus: all 2 file\(s\)"),
    Bad("text_no_validation_split", lambda t: text_files(t, [b"only one small document"]), "data",
        r"the 'validation' split of .* is empty"),
    # downstream evaluation (runs late in a run, so it is checked up front)
    Bad("eval_task_unknown", {"downstream.tasks": "hellaswag2"}, "downstream.tasks", r"unknown task\(s\) \['hellaswag2'\]"),
    Bad("eval_every_negative", {"downstream.every": -1}, "downstream.every", r"-1 is out of range; use a value ≥ 0"),
    Bad("eval_data_missing", {"downstream.tasks": "piqa", "downstream.data_dir": "/nonexistent/eval"},
        "downstream.data_dir", r"piqa \(validation split\): no data under /nonexistent/eval"),
    Bad("eval_item_bad_label", lambda t: piqa_dir(t, [PIQA_OK, PIQA_OK], "0\n7\n"), "downstream.data_dir",
        r"1 malformed item.*valid.jsonl:2.*label '7' is not 0 or 1"),
    Bad("eval_item_not_json", lambda t: piqa_dir(t, [PIQA_OK, "{oops"], "0\n1\n"), "downstream.data_dir",
        r"valid.jsonl:2: not valid JSON"),
    Bad("eval_item_missing_field", lambda t: piqa_dir(t, [json.dumps({"goal": "g", "sol1": "a"})], "1\n"),
        "downstream.data_dir", r"valid.jsonl:1.*missing field 'sol2'"),
    Bad("eval_labels_count", lambda t: piqa_dir(t, [PIQA_OK, PIQA_OK], "0\n"), "downstream.data_dir",
        r"1 labels for 2 items"),
]


@pytest.mark.parametrize("case", BAD, ids=[b.id for b in BAD])
def test_bad_config_or_data_names_field_and_says_what_is_wrong(case: Bad, tmp_path):
    from diloco.eval.benchmarks import check_downstream
    from diloco.resolve import mesh_shape

    overrides = case.overrides(tmp_path) if callable(case.overrides) else case.overrides
    with pytest.raises(ConfigError) as e:  # what a run checks before it builds anything
        cfg = tiny_config(case.method, **overrides)
        check_downstream(cfg.downstream)
        if case.devices:
            mesh_shape(cfg, case.devices)
    assert e.value.field == case.field, str(e.value)
    assert "\n" not in str(e.value) or case.field == "downstream.data_dir", str(e.value)  # items: a line each
    assert re.search(case.message, str(e.value), re.S), str(e.value)


def validator_fields() -> set[str]:
    """Every field diloco/config.py and resolve.py can name in a ConfigError, read from their source: the
    string given to ConfigError(...) or _one_of(cfg, ...), and the strings a `for` loop feeds to
    ConfigError(<loop var>)."""
    import ast

    from diloco import config, resolve

    def name(call: ast.Call) -> str | None:
        return call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", None)

    def text(node) -> list[str]:
        return [node.value] if isinstance(node, ast.Constant) and isinstance(node.value, str) else []

    fields: set[str] = set()
    source = "\n".join(Path(m.__file__).read_text() for m in (config, resolve))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and name(node) == "ConfigError" and node.args:
            fields.update(text(node.args[0]))
        elif isinstance(node, ast.Call) and name(node) == "_one_of" and len(node.args) > 1:
            fields.update(text(node.args[1]))
        elif isinstance(node, ast.For) and isinstance(node.iter, ast.Tuple):
            targets = [t.id for t in (node.target.elts if isinstance(node.target, ast.Tuple) else [node.target])
                       if isinstance(t, ast.Name)]
            for c in ast.walk(node):
                if isinstance(c, ast.Call) and name(c) == "ConfigError" and c.args \
                        and isinstance(c.args[0], ast.Name) and c.args[0].id in targets:
                    i = targets.index(c.args[0].id)
                    for e in node.iter.elts:
                        fields.update(text(e.elts[i] if isinstance(e, ast.Tuple) else e))
    return fields


def test_every_field_the_validator_names_has_a_row():
    """The table is the validator's: each field diloco/config.py can reject is a row above (a new check
    without a row fails here), and the reading of the source found the checks (not an empty set)."""
    fields = validator_fields()
    assert {"seq_len", "batch_size", "mesh.fsdp", "mesh.data", "model.attention", "config"} <= fields
    assert sorted(fields - {b.field for b in BAD}) == []
    assert len({b.id for b in BAD}) == len(BAD)


# -- bad input outside the config values -----------------------------------------------------------
# -- what a user sees on the command line: one line, the dotted field, no escapes ------------------------
@pytest.mark.parametrize("args,expected", [
    (["--config.optimizer.lrr=1"],
     "diloco train: bad input: optimizer.lrr: unknown config key 'optimizer.lrr'; did you mean optimizer.lr?"),
    (["--config.H=abc"], "diloco train: bad input: H: 'abc' is not an integer; e.g. --config.H=30"),
    ([":stream"], "diloco train: bad input: config: experiments/toy.py:stream: choose dp, diloco or streaming"),
], ids=["misspelt_key", "not_an_int", "bad_spec_arg"])
def test_command_line_bad_input_is_one_clear_line(args, expected, tmp_path, capsys):
    from diloco.train import main

    spec = "experiments/toy.py" + (args[0] if args[0].startswith(":") else ":streaming")
    rest = [a for a in args if not a.startswith(":")]
    assert main(["--config", spec, "--workdir", str(tmp_path / "run"), *rest]) == 2
    err = capsys.readouterr().err
    assert err == expected + "\n"
    assert not (tmp_path / "run").exists()  # nothing was started


def test_tables_out_a_file_and_eval_limit_negative_are_one_line(tmp_path, capsys):
    from diloco.cli import run

    (tmp_path / "f").write_text("x")
    (tmp_path / "runs").mkdir()
    assert run(["tables", "--root", str(tmp_path / "runs"), "--out", str(tmp_path / "f" / "t")]) == 2
    assert run(["eval", "--workdir", str(tmp_path), "--limit", "-1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"diloco tables: bad input: --out: {tmp_path / 'f'} is a file, not a folder; give a folder",
        "diloco eval: --limit -1: give a number of items ≥ 1, or leave it out for every item"]


def test_a_spec_that_fails_to_import_names_the_file(tmp_path):
    from diloco.config import load_config

    (tmp_path / "broken.py").write_text("import no_such_module_here\n")
    with pytest.raises(ConfigError, match=r"broken.py could not be loaded: ModuleNotFoundError: No module named "
                                          r"'no_such_module_here'$") as e:
        load_config(str(tmp_path / "broken.py"))
    assert e.value.field == "config"


def test_missing_spec_file():
    from diloco.config import load_config

    with pytest.raises(ConfigError, match=r"spec file 'experiments/nope.py' not found") as e:
        load_config("experiments/nope.py:dp")
    assert e.value.field == "config"


def test_override_without_config_prefix():
    from diloco.config import load_config

    with pytest.raises(ConfigError, match="unknown flag; overrides look like --config.key=value") as e:
        load_config("experiments/toy.py:dp", ["--steps=3"])
    assert e.value.field == "--steps"


def test_resuming_a_workdir_with_a_different_config(tmp_path):
    from diloco.config import to_json
    from diloco.train import train

    (tmp_path / "config.json").write_text(to_json(tiny_config("dp", steps=5)))
    with pytest.raises(ConfigError, match=r"holds a run with a different config \(steps: 5 → 6\); use a new "
                                          r"--workdir") as e:
        train(tiny_config("dp", steps=6), tmp_path, progress=False)
    assert e.value.field == "workdir"


def test_a_key_added_to_the_code_since_a_run_is_no_change_at_its_default():
    """A record written before a key existed resumes when the new config has that key at its default
    (the old code behaved as the default does); at another value it is a change, named."""
    from diloco.rundir import config_changes

    defaults = {"model": {"matmul_precision": "auto", "scan": "auto"}, "steps": 10}
    old = {"model": {"scan": "auto"}, "steps": 10, "data_readers": 4}  # data_readers: retired
    assert config_changes(old, {"model": {"matmul_precision": "auto", "scan": "auto"}, "steps": 10}, defaults) == []
    assert config_changes(old, {"model": {"matmul_precision": "highest", "scan": "auto"}, "steps": 10}, defaults) == [
        'model.matmul_precision: (none) → "highest"']
    assert config_changes({**old, "gone": 1}, {"model": {"scan": "auto"}, "steps": 12}, defaults) == [
        "gone: 1 → (none)", "steps: 10 → 12"]


def test_malformed_eval_items_of_every_benchmark_name_file_and_line(tmp_path):
    from diloco.eval import benchmarks as B

    hs = {"activity_label": "a", "ctx_a": "b", "ctx_b": "c", "endings": ["x", "y"], "label": 1}
    write(tmp_path / "hellaswag" / "hellaswag_val.jsonl", json.dumps(hs) + "\n" + json.dumps({**hs, "label": 4}) + "\n")
    arc = {"id": "q", "question": {"stem": "s", "choices": [{"text": "a", "label": "A"}, {"text": "b", "label": "B"}]},
           "answerKey": "C"}
    write(tmp_path / "arc" / "ARC-Easy-Test.jsonl", json.dumps(arc) + "\n")
    with pytest.raises(B.MalformedItem, match=r"hellaswag_val.jsonl:2: label 4 is not an index into 2 endings"):
        B.load_docs("hellaswag", tmp_path)
    with pytest.raises(B.MalformedItem, match=r"ARC-Easy-Test.jsonl:1: answerKey 'C' is not one of"):
        B.load_docs("arc_easy", tmp_path)


def test_documents_shorter_than_the_sequence_are_packed_not_padded(tmp_path):
    """Not an error: short documents are concatenated (EOS-separated) into full rows."""
    from diloco.data import TokenBatches

    overrides = text_files(tmp_path, [f"doc {i}".encode() for i in range(40)])
    it = TokenBatches(overrides["data"], "byte", seq_len=32, batch_size=4, seed=0)
    x = next(it)
    assert x.shape == (4, 32) and not np.any(x == 0) and (x == 1).sum() >= 4 * 32 // 8


def test_shared_eval_data_is_accepted(shared_dir):
    """The positive control: the real validation items in their original schemas pass the same checks."""
    tiny_config("streaming", **{"downstream.tasks": "piqa,hellaswag,arc_easy",
                                "downstream.data_dir": str(shared_dir / "data" / "eval")})


def test_exchange_in_step_needs_tau_at_least_one():
    from conftest import tiny_config

    with pytest.raises(ConfigError, match=r"exchange.*needs tau ≥ 1 \(got tau=0\)"):
        tiny_config("streaming", tau=0, exchange="in_step")
    with pytest.raises(ConfigError, match=r"exchange.*not one of"):
        tiny_config("streaming", exchange="fused")


# -- a run too big for this host's memory (CPU backend) -------------------------------------------------
def test_state_bytes_by_hand_and_the_refusal_at_the_memory_available(monkeypatch):
    """tiny DiLoCo, M=2: 4 bytes × n × (3 per replica: params, AdamW mu, nu + 3 outer: θᵍ, momentum, pending Δ)
    plus the int32 counters (AdamW and schedule counts per replica, the step); refused at one byte less."""
    from diloco import hostmem as T
    from diloco.trainer import Trainer

    tr = Trainer(tiny_config("diloco", replicas=2))
    n, R = tr.n_params, 2
    counters = 4 * (2 * R + 1)
    need = T.state_bytes(tr)
    assert need == 4 * n * (3 * R + 3) + counters, (need, n)
    monkeypatch.setattr(T, "host_memory_available", lambda: (need, "MemAvailable"))
    T.check_fits_host(tr)  # exactly enough: allowed
    monkeypatch.setattr(T, "host_memory_available", lambda: (need - 1, "MemAvailable"))
    with pytest.raises(ConfigError) as e:
        T.check_fits_host(tr)
    gib = need / 2**30
    assert e.value.field == "scale" and "\n" not in str(e.value)
    assert str(e.value).startswith(f"scale: a tiny diloco run's training state alone is {gib:.1f} GiB (parameters "
                                   f"and AdamW moments of 2 replicas, outer θᵍ, momentum and pending Δ; {n:,} "
                                   f"parameters) but this host has {gib:.1f} GiB available (MemAvailable)")
    assert "diloco compile --config" in str(e.value)


def test_host_memory_available_reads_meminfo_and_a_cgroup_limit(monkeypatch, tmp_path):
    from diloco import hostmem as T

    files = {"/proc/meminfo": "MemTotal: 24683652 kB\nMemAvailable: 17217240 kB\n",
             "/sys/fs/cgroup/memory/memory.limit_in_bytes": str(8 * 2**30),
             "/sys/fs/cgroup/memory/memory.usage_in_bytes": str(7 * 2**30),
             "/sys/fs/cgroup/memory/memory.stat": f"cache 5\ntotal_inactive_file {2**29}\n"}
    real_open = open

    def fake_open(path, *a, **k):
        if path in files:
            (tmp_path / "f").write_text(files[path])
            return real_open(tmp_path / "f", *a, **k)
        if str(path).startswith(("/proc/", "/sys/")):
            raise FileNotFoundError(path)
        return real_open(path, *a, **k)
    monkeypatch.setattr("builtins.open", fake_open)
    assert T.host_memory_available() == (2**30 + 2**29, "cgroup limit 8.0 GiB less its usage")
    files["/sys/fs/cgroup/memory/memory.limit_in_bytes"] = "9223372036854771712"  # no limit
    assert T.host_memory_available() == (17217240 * 1024, "MemAvailable")


def test_a_paper_scale_on_cpu_is_refused_before_anything_is_allocated(tmp_path):
    """`diloco train … --config.scale=10B` on a CPU host: exit 2, one line with the estimate, the memory
    available and the pointer to `diloco compile`; the process never grew (nothing allocated) and no
    run folder was made."""
    import subprocess
    import sys

    wd = tmp_path / "run"
    code = ("import resource, sys\nfrom diloco.cli import run\n"
            f"rc = run(['train', '--config', 'experiments/toy.py:streaming', '--workdir', {str(wd)!r}, "
            "'--config.scale=10B', '--no_progress'])\n"
            "print('maxrss_kb', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\nsys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       cwd=Path(__file__).resolve().parents[1])
    lines = [l for l in r.stderr.splitlines() if l.startswith(("diloco", "maxrss_kb"))]
    assert r.returncode == 2 and len(lines) == 2, r.stderr[-3000:]
    assert re.fullmatch(r"diloco train: bad input: scale: a 10B streaming run's training state alone is "
                        r"\d+\.\d GiB \(parameters and AdamW moments of 2 replicas, outer θᵍ, momentum and "
                        r"pending Δ; [\d,]+ parameters\) but this host has \d+\.\d GiB available \(.*\); on CPU "
                        r"use a smaller scale .*`diloco compile --config … --topology v5p:2x2x2` reports the "
                        r"per-chip memory", lines[0]), lines[0]
    need_gib = float(re.search(r"alone is (\d+\.\d) GiB", lines[0]).group(1))
    assert need_gib > 300  # ≈ 10e9 parameters × 4 bytes × 9 copies
    assert int(lines[1].split()[1]) < 2 * 2**20  # peak RSS under 2 GiB: the state was never allocated
    assert not wd.exists()


def test_importing_the_library_after_jax_is_as_quiet_as_the_cli():
    """With libtpu installed and no TPU here, `import jax` then `from diloco.trainer import Trainer` (a
    notebook's order) must not bring libtpu's "could not determine TPU accelerator type" block."""
    import glob
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu not installed (pip install -e '.[tpu]'): nothing would print the block")
    if any(glob.glob(p) for p in ("/dev/accel*", "/dev/vfio/[0-9]*")):
        pytest.skip("this machine has a TPU: libtpu is meant to start here")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TPU_ACCELERATOR_TYPE")}
    for order in ("import jax\nfrom diloco.trainer import Trainer", "from diloco.trainer import Trainer\nimport jax"):
        r = subprocess.run([sys.executable, "-c", order + "\nimport jax.numpy as jnp\nprint(jnp.ones(2).sum(), "
                            "jax.devices()[0].platform)"], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0 and r.stdout.split() == ["2.0", "cpu"], r.stderr[-2000:]
        assert "TPU" not in r.stderr and "libtpu" not in r.stderr, r.stderr[-2000:]
