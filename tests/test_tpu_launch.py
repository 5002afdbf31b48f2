"""`diloco sweep … --launch tpu` on the laptop side: accelerator names, every check before billing
(one line, exit 2, nothing created), the launch bundle (exact tree, plan.json, scripts), and every
gcloud command line the scripts can run, parsed by the real gcloud CLI where it is installed."""
import json
import re
import signal
import time
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

from diloco import sweep as sw
from diloco.config import REPO_ROOT
from diloco.errors import ConfigError
from diloco.tpu import accelerators, bundle, preflight


# -- accelerator types -------------------------------------------------------------------------------
@pytest.mark.parametrize("name,chips,hosts,topology", [
    ("v4-8", 4, 1, "v4:2x2x1"), ("v4-32", 16, 4, "v4:2x2x4"), ("v4-384", 192, 48, "v4:4x4x12"),
    ("v5p-8", 4, 1, "v5p:2x2x1"), ("v5p-16", 8, 2, "v5p:2x2x2"), ("v5p-64", 32, 8, "v5p:2x4x4"),
    ("v5p-384", 192, 48, "v5p:4x4x12"), ("v5p-12288", 6144, 1536, "v5p:16x16x24"),
    ("v5litepod-1", 1, 1, "v5e:1x1"), ("v5litepod-8", 8, 1, "v5e:2x4"), ("v5litepod-16", 16, 4, "v5e:4x4"),
    ("v5litepod-256", 256, 64, "v5e:16x16"), ("v6e-4", 4, 1, "v6e:2x2"), ("v6e-32", 32, 8, "v6e:4x8"),
])
def test_accelerator_types_give_chips_and_hosts(name, chips, hosts, topology):
    s = accelerators.parse(name)
    assert (s.chips, s.hosts, s.topology) == (chips, hosts, topology)


@pytest.mark.parametrize("name,neighbours", [
    ("v5p-48", "v5p-16, v5p-32, v5p-64, v5p-128"), ("v5litepod-24", "v5litepod-8, v5litepod-16, v5litepod-32"),
    ("v4-12", "v4-8, v4-16, v4-32"), ("v6e-2", "v6e-1, v6e-4, v6e-8"), ("v5p-12800", "v5p-12288"),
])
def test_invalid_accelerator_is_refused_with_valid_neighbours(name, neighbours):
    with pytest.raises(ConfigError) as e:
        accelerators.parse(name)
    assert e.value.field == "--accelerator" and neighbours in str(e.value), str(e.value)


def test_other_names_are_refused_and_v5e_is_named_as_cloud_tpu_names_it():
    for bad in ("v5e-16", "tpu-8", "v5p", ""):
        with pytest.raises(ConfigError, match="not a TPU type"):
            accelerators.parse(bad)
    with pytest.raises(ConfigError, match="v5litepod-16"):
        accelerators.parse("v5e-16")


def test_every_3d_slice_is_a_torus_of_its_chips_with_4_chips_per_host():
    for s in accelerators.TABLE.values():
        dims = [int(x) for x in s.topology.split(":")[1].split("x")]
        assert int(s.name.split("-")[1]) == s.chips * accelerators.CORES_PER_CHIP[s.generation]
        assert s.chips == dims[0] * dims[1] * (dims[2] if len(dims) == 3 else 1)
        if len(dims) == 3:  # A ≤ B ≤ C (libtpu writes the one-host slice 2x2x1), all ≤ 4 or all multiples of 4
            assert dims == sorted(dims) or dims == [2, 2, 1], s
            assert all(d <= 4 for d in dims) or all(d % 4 == 0 for d in dims), s
        single_host = s.chips <= 8 and s.generation in ("v5litepod", "v6e") or s.chips == 4
        assert (s.hosts, s.chips_per_host) == ((1, s.chips) if single_host else (s.chips // 4, 4)), s


# -- helpers -----------------------------------------------------------------------------------------
def _write_sweep(tmp_path, experiment: str, points: str = "[{}]", name: str = "t") -> Path:
    p = tmp_path / f"{name}.py"
    p.write_text(textwrap.dedent(f"""
        def get_sweep(arg=""):
            return {{"name": "{name}", "experiment": "{experiment}", "points": {points}}}
    """))
    return p


RECORDER = """#!/usr/bin/env python3
# a recording stand-in for gcloud: appends its argv to $GCLOUD_LOG; queued-resource state in $GCLOUD_STATE
import json, os, sys
a = sys.argv[1:]
with open(os.environ["GCLOUD_LOG"], "a") as f:
    f.write(json.dumps(a) + "\\n")
state = os.environ["GCLOUD_STATE"]
cur = open(state).read().strip() if os.path.exists(state) else ""
if "describe" in a:
    if not cur:
        sys.exit("ERROR: NOT_FOUND")
    print(cur)
elif "create" in a:
    open(state, "w").write(os.environ.get("GCLOUD_AFTER_CREATE", "ACTIVE"))
elif "delete" in a and "queued-resources" in a:
    open(state, "w").write("")
elif a[:2] == ["storage", "ls"]:
    print(os.environ.get("GCLOUD_LS", ""), end="")
"""


@pytest.fixture
def recorder(tmp_path, monkeypatch):
    """A gcloud on PATH that only records; the log path (absent while nothing was called)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "gcloud").write_text(RECORDER)
    (bindir / "gcloud").chmod(0o755)
    log = tmp_path / "gcloud.log"
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("GCLOUD_LOG", str(log))
    monkeypatch.setenv("GCLOUD_STATE", str(tmp_path / "qr-state"))
    return log


TPU = ["--launch", "tpu", "--tpu", "pod-1", "--zone", "us-east5-a"]


def _refused(capsys, tmp_path, recorder, argv) -> str:
    out = tmp_path / "bundle"
    assert sw.main([*argv, *TPU, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert not recorder.exists(), "gcloud was called"
    assert not out.exists(), "a bundle was written"
    return err


# -- every bad input before billing: one line, exit 2, nothing created ------------------------------
TINY, GS = "experiments/c4_scaling.py:tiny,dp", ["--root", "gs://bkt/r"]
REFUSALS = [  # (experiment, points, argv after the sweep file ({tmp}: this test's folder), what the one line says)
    (TINY, "[{}]", [*GS, "--accelerator", "v5p-48"], ["--accelerator: 'v5p-48'", "v5p-32, v5p-64"]),
    (TINY, "[{}]", [*GS, "--accelerator", "v5litepod-24"], ["v5litepod-16, v5litepod-32"]),
    # a v5p-384 slice is 48 hosts, one process each; 48 and 32 divide neither way
    ("experiments/c4_scaling.py:tiny,diloco_h30", '[{"replicas": 32, "batch_size": 96}]', [*GS, "--accelerator",
     "v5p-384"], ["diloco sweep: bad input: replicas: point replicas=32,batch_size=96: 1× v5p-384 is 48 hosts",
                  "48 processes do not divide replicas=32"]),
    (TINY, "[{}]", [*GS, "--accelerator", "v5p-8", "--set", "vocab=sentencepiece:{tmp}/none.model"],
     ["vocab: point default: sentencepiece model '{tmp}/none.model' not found"]),
    (TINY, "[{}]", ["--root", "{tmp}/runs", "--accelerator", "v5p-8"], ["--root", "use a gs://bucket/… root"]),
    (TINY, '[{"batch_size": 6}]', [*GS, "--accelerator", "v5p-16"], ["batch_size: point batch_size=6:",
                                                                      "--set batch_size=8"]),
    ("{tmp}/exp.py", "[{}]", [*GS, "--accelerator", "v5p-8"], ["config: point default: spec",
                                                                "not in the tree shipped to the workers"]),
]


@pytest.mark.parametrize("experiment, points, argv, says", REFUSALS)
def test_bad_input_is_refused_in_one_line_before_anything(tmp_path, capsys, recorder, experiment, points, argv, says):
    fill = lambda x: x.replace("{tmp}", str(tmp_path))  # noqa: E731
    (tmp_path / "exp.py").write_text((REPO_ROOT / "experiments" / "base.py").read_text())  # a spec outside the tree
    err = _refused(capsys, tmp_path, recorder, [str(_write_sweep(tmp_path, fill(experiment), points)), *map(fill, argv)])
    assert all(fill(x) in err for x in says), err


def test_a_tfds_point_is_refused_on_any_slice_naming_the_store_to_make(tmp_path, capsys, recorder):
    """c4, c4:<dir> and dolma (TFDS) would be tokenized on the TPU hosts: refused before anything (no gcloud, no
    bundle), on one host as on four, naming `diloco data tokenize` and --set data=tokens:gs://…; a store on this
    machine's disk is refused too."""
    f = _write_sweep(tmp_path, "experiments/c4_scaling.py:35M,dp")
    argv = [str(f), "--root", "gs://bkt/r", "--set", "vocab=byte"]
    for acc, over, src in [("v5p-8", [], "c4"), ("v5p-32", ["data_dir=gs://bkt/tfds"], "c4 --data_dir gs://bkt/tfds"),
                           ("v5p-8", ["data=c4:gs://bkt/tfds/c4/en/3.0.1"], "c4:gs://bkt/tfds/c4/en/3.0.1"),
                           ("v5p-16", ["data=dolma", "data_dir=gs://bkt/tfds"], "dolma --data_dir gs://bkt/tfds")]:
        sets = [x for kv in over for x in ("--set", kv)]
        err = _refused(capsys, tmp_path, recorder, [*argv, "--accelerator", acc, *sets])
        name = src.split(":")[0].split(" ")[0]
        assert err.startswith(f"diloco sweep: bad input: data: point default: data={src.split(' ')[0]!r} has no token "
                              "store yet and a pod's TPU hosts do not tokenize a TFDS corpus"), err
        assert (f"`diloco data tokenize --data {src} --vocab byte --out gs://BUCKET/stores/{name}`, then launch with "
                f"--set data=tokens:gs://BUCKET/stores/{name}") in err, err
    err = _refused(capsys, tmp_path, recorder, [*argv, "--accelerator", "v5p-8", "--set", f"data=tokens:{tmp_path}/st"])
    assert f"data: point default: the token store '{tmp_path}/st' is on this machine's disk" in err


def test_the_pod_rule_is_the_multi_process_rule_of_prepare_and_needs_no_io(tmp_path):
    """preflight applies prepare.self_preparable (what `diloco train` lets each process of a multi-process run
    tokenize itself) from the spec alone: it must agree with the kind specs.parse_data resolves (TFDS or not)."""
    from diloco.data import prepare, specs

    for d in ("c4/en/3.0.1", "dolma/v1/1.0"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "dataset_info.json").write_text("{}")
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "a.txt").write_text("x\n")
    cases = [("c4", str(tmp_path)), (f"c4:{tmp_path}/c4/en/3.0.1", None), ("dolma", str(tmp_path)),
             (f"dolma:{tmp_path}/*.jsonl", None), (f"jsonl:{tmp_path}/*.jsonl", None), (f"text:{tmp_path}/*.txt", None),
             ("stdlib", None)]
    got = {c: (prepare.self_preparable(c), specs.parse_data(c, d).kind != "tfds") for c, d in cases}
    assert all(a == b for a, b in got.values()) and sum(a for a, _ in got.values()) == 4, got
    assert prepare.corpus_of("tokens:jsonl:x/*.jsonl") == "jsonl:x/*.jsonl" and prepare.corpus_of("tokens:gs://b/s") is None


def test_downstream_items_outside_the_shipped_tree_are_refused(tmp_path, capsys, recorder):
    f = _write_sweep(tmp_path, "experiments/toy.py:diloco")
    argv = [str(f), "--root", "gs://bkt/r", "--accelerator", "v5p-8", "--set", "downstream.tasks=hellaswag",
            "--set", "downstream.every=10"]
    for data_dir, says in [("", "is unset"), ("gs://bkt/eval", "is on gs://"), (str(tmp_path), "is not a folder of "
                           "the shipped tree"), ("no/such/folder", "is not a folder of the shipped tree")]:
        err = _refused(capsys, tmp_path, recorder, [*argv, "--set", f"downstream.data_dir={data_dir}"])
        assert "downstream.data_dir: point default: downstream.tasks='hellaswag'" in err and says in err, err
        assert "`diloco eval`" in err
    import ml_collections

    cfg = ml_collections.ConfigDict({"downstream": {"tasks": "hellaswag", "data_dir": "evaldata/"}})
    preflight.check_downstream(cfg, "p", {"evaldata/hellaswag/validation.jsonl", "README.md"})  # in the tree: ok
    with pytest.raises(ConfigError, match="downstream.data_dir"):
        preflight.check_downstream(cfg, "p", {"evaldata_old/hellaswag/validation.jsonl"})
    cfg.downstream.tasks = ""
    preflight.check_downstream(cfg, "p", set())  # nothing scored during training: nothing to check


def _tiny_spm(path):
    """A real (30-piece, character) SentencePiece model: the vocabulary check loads the file."""
    import io

    import sentencepiece

    buf = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(["the quick brown fox jumps over a lazy dog"] * 20),
                                             model_writer=buf, vocab_size=30, model_type="char", minloglevel=2)
    path.write_bytes(buf.getvalue())
    return path


def _paper_point(tmp_path, scale: str, method: str) -> list[str]:
    vocab = _tiny_spm(tmp_path / "spm.model")
    f = _write_sweep(tmp_path, f"experiments/c4_scaling.py:{scale},{method}")
    return [str(f), "--root", "gs://bkt/r", "--set", "data=tokens:gs://bkt/stores/c4-t5", "--set",
            f"vocab=sentencepiece:{vocab}"]


def test_a_point_that_does_not_fit_hbm_is_refused_with_the_smallest_slice_that_fits(tmp_path, capsys, recorder):
    # the committed results/pod/memory.csv: 1B DiLoCo (2 replicas) needs more than v5litepod-16's 8 chips per
    # replica at its batch; the slice the refusal names passes every local check
    import re

    argv = _paper_point(tmp_path, "1B", "diloco_h30")
    err = _refused(capsys, tmp_path, recorder, [*argv, "--accelerator", "v5litepod-16"])
    assert err.startswith("diloco sweep: bad input: --accelerator: point default does not fit: 8 chips per replica")
    best = re.search(r"use --accelerator (v5litepod-\d+)$", err).group(1)
    assert accelerators.parse(best).chips > 16
    assert sw.main([*argv, "--accelerator", best, *TPU, "--out", str(tmp_path / "b"), "--dry-run"]) == 0
    assert not recorder.exists()  # a dry run touches neither gcloud nor the bucket


ROW = {"global_batch": "256", "seq_len": "2048", "peak_gib": "8.0", "device_hbm_gib": "16.0", "fits": "True"}
TABLE = [  # hand-written rows in memory.csv's format: the smallest slice that fits each, at 256 × 2048 tokens
    {**ROW, "scale": "1B", "method": "DiLoCo", "chip": "v5e", "topology": "v5e:4x8", "chips": "32",
     "mesh": "replica2×data1×fsdp16"},
    {**ROW, "scale": "1B", "method": "DP", "chip": "v5p", "topology": "v5p:2x2x1", "chips": "4",
     "mesh": "replica1×data1×fsdp4"},
    {**ROW, "scale": "4B", "method": "DP", "chip": "v5p", "topology": "v5p:2x2x4", "chips": "16",
     "mesh": "replica1×data1×fsdp16", "global_batch": "512"}]


@pytest.mark.parametrize("point,acc,slices,verdict,says", [
    # 1B: 512 × 1024 tokens a step (= 256 × 2048); the row: 16 chips per replica, 16,384 tokens per chip
    ("1B,diloco_h30", "v5litepod-32", 1, "fits", "v5e:4x8: 8.0 GiB of 16.0"),
    ("1B,diloco_h30", "v5litepod-16", 2, "fits", ""),  # 32 chips in all: 16 per replica
    ("1B,diloco_h30", "v5litepod-16", 1, "too big", "8 chips per replica on 1× v5litepod-16, and the smallest v5e "
     "slice that fits with ≥10% HBM headroom gives 16 (1B DiLoCo on v5e:4x8: 8.0 GiB of 16.0 per device); use "
     "--accelerator v5litepod-32"),
    ("1B,diloco_h30 --config.batch_size=128", "v5litepod-16", 1, "unknown", "differs from the memory table's row"),
    ("1B,dp", "v5p-8", 1, "fits", ""),  # 4 chips, 131,072 tokens per chip: the row itself
    ("4B,dp", "v5p-16", 1, "too big", "use --accelerator v5p-32"),  # 1024 × 1024 tokens over 8 chips
    ("4B,dp", "v5p-32", 1, "fits", ""),
    ("1B,diloco_h30", "v6e-8", 1, "unknown", "no row for 1B DiLoCo on v6e"),
    ("tiny,dp", "v5p-8", 1, "unknown", "no row for tiny DP on v5p"),
])
def test_fit_verdicts_from_a_memory_table(point, acc, slices, verdict, says):
    from diloco.config import load_config

    spec, *over = point.split(" ")
    cfg = load_config(f"experiments/c4_scaling.py:{spec}", over, check_data=False)
    got, why = preflight.fit_from_table(cfg, accelerators.parse(acc), slices, TABLE)
    assert got == verdict and says in why, why


@pytest.mark.parametrize("tokens,batch,steps,refused,warned", [
    (459 * 512, 512, 10, "459 train rows of seq_len 512, fewer than one global batch of 512", ""),  # the 459-row store
    (512 * 512, 512, 1, "", ""),                                  # one batch exactly, read once
    (512 * 512, 512, 3, "", "3.0× the 262,144 train tokens"),     # three passes over it
    (700_000_000, 512, 1_000_000, "", "≈ 374 times"),             # 2.6e11 tokens read from a 7e8-token store
])
def test_a_store_smaller_than_a_batch_is_refused_and_one_smaller_than_the_run_warned(tokens, batch, steps, refused,
                                                                                     warned):
    """By hand: rows = tokens // seq_len; the run reads steps × batch × seq_len tokens."""
    cfg = preflight.load_config("experiments/toy.py:diloco", ["--config.seq_len=512", f"--config.batch_size={batch}", f"--config.steps={steps}"],
                                check_data=False)
    if refused:
        with pytest.raises(ConfigError, match=refused):
            preflight.check_store_size(cfg, "p", "gs://b/s", tokens)
        return
    warning = preflight.check_store_size(cfg, "p", "gs://b/s", tokens)
    assert (warned in warning) if warned else warning == "", warning


def test_the_committed_memory_table_is_read():
    rows = preflight.memory_table()
    assert {(r["scale"], r["method"], r["chip"]) for r in rows} >= {("1B", "Streaming", "v5p"), ("35M", "DP", "v5e")}


# -- the bundle --------------------------------------------------------------------------------------
def _git(repo, *a):
    subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t"})


def test_the_tree_is_the_working_tree_as_on_disk_and_its_sha_is_stable(tmp_path):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / ".gitignore").write_text("ignored.txt\nbuild/\n")
    (repo / "pkg" / "a.py").write_text("A = 1\n")
    (repo / "run.sh").write_text("#!/bin/sh\n")
    (repo / "run.sh").chmod(0o755)
    (repo / "gone.py").write_text("x\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "c")
    (repo / "pkg" / "a.py").write_text("A = 2  # dirty\n")  # modified, not committed
    (repo / "new.py").write_text("untracked, not ignored\n")
    (repo / "ignored.txt").write_text("ignored\n")
    (repo / "build").mkdir()
    (repo / "build" / "x").write_text("ignored dir\n")
    (repo / "gone.py").unlink()  # tracked, deleted on disk
    (repo / "out").mkdir()
    (repo / "out" / "bundle.txt").write_text("the bundle folder itself\n")
    assert bundle.tree_files(repo, exclude=repo / "out") == [".gitignore", "pkg/a.py", "run.sh"]  # tracked only
    files = bundle.tree_files(repo, exclude=repo / "out", ship=("new.py",))  # an untracked file, listed
    assert files == [".gitignore", "new.py", "pkg/a.py", "run.sh"]
    d1, d2 = tmp_path / "d1", tmp_path / "d2"
    d1.mkdir(), d2.mkdir()
    t1, sha1 = bundle.write_tree(files, d1, repo)
    os.utime(repo / "pkg" / "a.py", (1, 1))  # times and owners are not content
    t2, sha2 = bundle.write_tree(files, d2, repo)
    assert sha1 == sha2 and t1.name == t2.name == f"tree-{sha1[:12]}.tar.gz" and t1.read_bytes() == t2.read_bytes()
    assert bundle.sha256_file(t1) == sha1
    with tarfile.open(t1) as tar:
        assert tar.getnames() == files
        assert tar.extractfile("pkg/a.py").read() == b"A = 2  # dirty\n"
        assert tar.getmember("run.sh").mode == 0o755 and tar.getmember("new.py").mode == 0o644
    (repo / "new.py").write_text("changed\n")
    assert bundle.write_tree(files, d2, repo)[1] != sha1


def test_not_a_git_checkout_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="not a git checkout"):
        bundle.tree_files(tmp_path)


@pytest.fixture(scope="module")
def dry_bundle(tmp_path_factory):
    """A dry run of a two-point multislice sweep with every capacity/identity flag."""
    tmp = tmp_path_factory.mktemp("dry")
    f = _write_sweep(tmp, "experiments/c4_scaling.py:tiny,diloco_h30", '[{"tau": 0}, {"H": 10}]', name="two")
    out = tmp / "bundle"
    argv = [str(f), "--root", "gs://bkt/runs", *TPU, "--accelerator", "v5p-16", "--slices", "2", "--project", "proj",
            "--spot", "--valid-until", "6h", "--service-account", "sa@proj.iam.gserviceaccount.com", "--network",
            "net", "--subnetwork", "sub", "--internal-ips", "--max-attempts", "4", "--teardown", "--out", str(out),
            "--set", "steps=8", "--dry-run"]
    r = subprocess.run([sys.executable, "-m", "diloco.cli", "sweep", *argv], capture_output=True, text=True,
                       cwd=tmp, timeout=600)
    assert r.returncode == 0, r.stderr
    return out, r.stdout, argv


def test_plan_json_is_the_contract(dry_bundle):
    out, stdout, _ = dry_bundle
    plan = json.loads((out / "plan.json").read_text())
    tar = next(out.glob("tree-*.tar.gz"))
    base, ns = "gs://bkt/runs/two", "gs://bkt/runs/two/_pods/pod-1"
    assert {k: plan[k] for k in ("version", "sweep", "base", "root", "qr", "zone", "project", "accelerator", "slices",
                                 "hosts_per_slice", "chips_per_host", "max_attempts", "teardown")} == {
        "version": 1, "sweep": "two", "base": ns, "root": base, "qr": "pod-1", "zone": "us-east5-a", "project": "proj",
        "accelerator": "v5p-16", "slices": 2, "hosts_per_slice": 2, "chips_per_host": 4, "max_attempts": 4,
        "teardown": True}
    assert plan["tree"] == {"url": f"{ns}/_launch/{tar.name}", "sha256": bundle.sha256_file(tar)}
    assert plan["lock_sha256"] == bundle.sha256_file(REPO_ROOT / "requirements.lock")
    assert (out / "requirements.lock").read_bytes() == (REPO_ROOT / "requirements.lock").read_bytes()
    assert plan["points"] == [
        {"name": "tau=0", "workdir": f"{base}/tau=0",
         "argv": ["train", "--config", "experiments/c4_scaling.py:tiny,diloco_h30", "--workdir", f"{base}/tau=0",
                  "--no_progress", "--config.tau=0", "--config.steps=8"]},
        {"name": "H=10", "workdir": f"{base}/H=10",
         "argv": ["train", "--config", "experiments/c4_scaling.py:tiny,diloco_h30", "--workdir", f"{base}/H=10",
                  "--no_progress", "--config.H=10", "--config.steps=8"]}]
    assert plan["env"]["JAX_COMPILATION_CACHE_DIR"] == f"{ns}/_launch/jax-cache"
    assert plan["env"]["EPATH_USE_TF"] == "false"
    assert plan["lost_after_s"] > 0 and plan["stop_grace_s"] > 0
    assert "# dry run: nothing created" in stdout


def test_the_shipped_tree_is_this_checkout_as_on_disk(dry_bundle):
    out, _, _ = dry_bundle
    with tarfile.open(next(out.glob("tree-*.tar.gz"))) as tar:
        names = tar.getnames()
        assert names == bundle.tree_files(exclude=out)
        assert "diloco/tpu/agent.py" in names or (REPO_ROOT / "diloco/tpu/agent.py").exists() is False
        assert tar.extractfile("diloco/tpu/bundle.py").read() == (REPO_ROOT / "diloco/tpu/bundle.py").read_bytes()
        assert not [n for n in names if n.startswith(("build/", "runs/")) or "__pycache__" in n]


def test_scripts_carry_every_flag_and_no_secret(dry_bundle):
    out, _, _ = dry_bundle
    launch, startup = (out / "launch_tpu.sh").read_text(), (out / "startup.sh").read_text()
    assert "WHERE=(--zone=us-east5-a --project=proj)" in launch
    assert "NODES=(--node-count=2 --node-prefix=pod-1)" in launch and "TRACK=()" in launch
    assert ("CREATE_FLAGS=(--spot --valid-until-duration=6h --service-account=sa@proj.iam.gserviceaccount.com "
            "--network=net --subnetwork=sub --internal-ips)") in launch
    assert "SSH_FLAGS=(--tunnel-through-iap)" in launch
    plan = json.loads((out / "plan.json").read_text())
    assert f"TREE_SHA256={plan['tree']['sha256']}" in startup and "LAUNCH=gs://bkt/runs/two/_pods/pod-1/_launch" in startup
    assert f"ENV_KEY={plan['lock_sha256'][:12]}" in startup  # the environment is keyed on the lock only
    for text in (launch, startup, (out / "plan.json").read_text()):
        for k, v in os.environ.items():
            if any(w in k.upper() for w in ("TOKEN", "SECRET", "KEY", "PASSWORD", "CREDENTIAL")) and len(v) >= 8:
                assert v not in text, k
        assert "BEGIN PRIVATE KEY" not in text and "access_token" not in text


@pytest.mark.parametrize("name", ["launch_tpu.sh", "startup.sh", "bootstrap.sh"])
def test_scripts_pass_bash_n_and_shellcheck(dry_bundle, name):
    path = dry_bundle[0] / name
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    r = subprocess.run(["shellcheck", "-x", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_best_effort_uses_gcloud_alpha_and_one_slice_a_node_id(tmp_path):
    f = _write_sweep(tmp_path, "experiments/c4_scaling.py:tiny,dp")
    out = tmp_path / "b"
    assert sw.main([str(f), "--root", "gs://bkt/r", *TPU, "--accelerator", "v5litepod-4", "--best-effort",
                    "--out", str(out), "--dry-run"]) == 0
    text = (out / "launch_tpu.sh").read_text()
    assert "TRACK=(alpha)" in text and "CREATE_FLAGS=(--best-effort)" in text and "NODES=(--node-id=pod-1)" in text
    assert "RUNTIME=v2-alpha-tpuv5-lite" in text


def test_the_tpu_extra_pins_the_pair_the_lock_pins():
    import tomllib

    extra = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["tpu"]
    lock = dict(line.split("==") for line in (REPO_ROOT / "requirements.lock").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    pins = dict(p.split("==") for p in extra if "==" in p)
    assert set(pins) >= {"jax", "jaxlib", "libtpu"}
    assert {k: lock[k] for k in pins} == pins


# -- every gcloud line the launch script can run, parsed by the real gcloud -------------------------
def _run_script(script: Path, tmp_path, *args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "POLL_S": "0", **(env or {})})


@pytest.mark.skipif(os.geteuid() != 0, reason="startup.sh re-runs itself with sudo when not root")
def test_start_sees_through_a_stale_pid_file_and_an_unreaped_agent(dry_bundle, tmp_path):
    """startup.sh starts the agent unless one runs. A pid file naming another live process (after a reboot
    the pid is someone else's) or an agent that exited but is not reaped yet (a zombie: `kill -0` calls it
    alive) does not count as running; an agent does."""
    text = (dry_bundle[0] / "startup.sh").read_text()
    tree = re.search(r"^TREE=(\S+)$", text, re.M).group(1).strip("'")
    home = tmp_path / "home"
    src = home / "diloco" / tree.removesuffix(".tar.gz")
    src.mkdir(parents=True)
    (src / ".unpacked").touch()  # the tree is there: no download
    agent = tmp_path / "python"  # stands for the env's interpreter: its command line names the agent
    agent.write_text("#!/bin/sh\nsleep 300\n")
    agent.chmod(0o755)
    env = {"HOME": str(home), "DILOCO_TPU_PYTHON": str(agent)}
    pid_file = home / "diloco" / "agent.pid"
    started: list[int] = []

    def start(expect: str) -> int:
        r = _run_script(dry_bundle[0] / "startup.sh", tmp_path, env=env)
        assert r.returncode == 0 and expect in r.stdout, r.stdout + r.stderr
        pid = int(pid_file.read_text())
        started.append(pid)
        return pid

    other = subprocess.Popen(["sleep", "300"])
    zombie = subprocess.Popen([str(agent), "-m", "diloco.tpu.agent"])
    try:
        pid_file.write_text(f"{other.pid}\n")
        first = start("agent started")
        assert first != other.pid
        assert start(f"the agent already runs (pid {first})") == first
        os.killpg(first, signal.SIGKILL)
        zombie.kill()  # not waited for: a zombie until reaped
        deadline = time.time() + 10
        while open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z" and time.time() < deadline:
            time.sleep(0.05)
        pid_file.write_text(f"{zombie.pid}\n")
        assert start("agent started") not in (first, zombie.pid)
    finally:
        for p in (other, zombie):
            p.kill()
            p.wait()
        for pid in started:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_up_creates_waits_and_recreates_a_suspended_resource(dry_bundle, tmp_path, recorder):
    script = dry_bundle[0] / "launch_tpu.sh"
    r = _run_script(script, tmp_path, "up", env={"GCLOUD_AFTER_CREATE": "ACTIVE"})
    assert r.returncode == 0 and "pod-1 is ACTIVE" in r.stdout, r.stderr
    calls = [json.loads(line) for line in recorder.read_text().splitlines()]
    ns = "gs://bkt/runs/two/_pods/pod-1"
    cp = calls.index(next(c for c in calls if c[:2] == ["storage", "cp"]))
    assert calls[cp][-1] == f"{ns}/_launch/"
    assert sorted(Path(p).name for p in calls[cp][2:-1]) == sorted(p.name for p in dry_bundle[0].iterdir()
                                                                    if p.name != bundle.MARKER)
    assert calls[cp + 1] == ["storage", "rm", f"{ns}/_launch/control/stop"]
    # before the upload (diloco.tpu.pods): this resource's shape, nodes of its names, the types the zone offers,
    # the bucket's location, the VMs' account's roles, the other launches on the root
    assert calls[:cp] == [
        ["compute", "tpus", "queued-resources", "describe", "pod-1", "--zone=us-east5-a", "--project=proj", "--format=json"],
        ["compute", "tpus", "tpu-vm", "list", "--zone=us-east5-a", "--project=proj", "--format=json"],
        ["compute", "tpus", "tpu-vm", "accelerator-types", "list", "--zone=us-east5-a", "--project=proj", "--format=json"],
        ["storage", "buckets", "describe", "gs://bkt", "--format=json"],
        ["projects", "get-iam-policy", "proj", "--format=json"],
        ["storage", "buckets", "get-iam-policy", "gs://bkt", "--format=json"],
        ["storage", "ls", "gs://bkt/runs/two/_pods/*/_launch/plan.json"]]
    create = next(c for c in calls if "create" in c)
    assert create == ["compute", "tpus", "queued-resources", "create", "pod-1", "--zone=us-east5-a", "--project=proj",
                      "--accelerator-type=v5p-16", "--runtime-version=v2-alpha-tpuv5", "--node-count=2",
                      "--node-prefix=pod-1", f"--metadata-from-file=startup-script={dry_bundle[0]}/bootstrap.sh", "--spot",
                      "--valid-until-duration=6h", "--service-account=sa@proj.iam.gserviceaccount.com",
                      "--network=net", "--subnetwork=sub", "--internal-ips"]
    (tmp_path / "qr-state").write_text("SUSPENDED")
    recorder.unlink()
    r = _run_script(script, tmp_path, "up")
    assert r.returncode == 0 and "pod-1 is SUSPENDED: deleting it" in r.stdout
    verbs = [c[3] for c in map(json.loads, recorder.read_text().splitlines()) if c[:3] == ["compute", "tpus", "queued-resources"]]
    assert verbs.count("delete") == verbs.count("create") == 1 and verbs.index("delete") < verbs.index("create")


@pytest.mark.parametrize("after,rc,says", [("FAILED", 1, "pod-1 is FAILED"), ("SUSPENDING", 1, "pod-1 is SUSPENDING"),
                                           ("WAITING_FOR_RESOURCES", 1, "still WAITING_FOR_RESOURCES after 0s")])
def test_up_reports_failure_and_gives_up_waiting_after_its_bound(dry_bundle, tmp_path, recorder, after, rc, says):
    r = _run_script(dry_bundle[0] / "launch_tpu.sh", tmp_path, "up", env={"GCLOUD_AFTER_CREATE": after, "UP_WAIT_S": "0"})
    assert r.returncode == rc and says in r.stderr, (r.stdout, r.stderr)


def test_down_refuses_while_a_point_runs_unless_forced(dry_bundle, tmp_path, recorder):
    script = dry_bundle[0] / "launch_tpu.sh"
    busy = {"DILOCO_PYTHON": shutil.which("true")}  # `status --busy` exits 0: a point runs
    r = _run_script(script, tmp_path, "down", env=busy)
    assert r.returncode == 1 and "a point is running on pod-1" in r.stderr and not recorder.exists()
    r = _run_script(script, tmp_path, "down", "--force", env=busy)
    assert r.returncode == 0
    assert json.loads(recorder.read_text()) == ["compute", "tpus", "queued-resources", "delete", "pod-1",
                                                "--zone=us-east5-a", "--project=proj", "--force", "--quiet"]


def test_usage_and_logs_without_logs(dry_bundle, tmp_path, recorder):
    script = dry_bundle[0] / "launch_tpu.sh"
    r = _run_script(script, tmp_path, "run")
    assert r.returncode == 2 and "usage: bash" in r.stderr
    r = _run_script(script, tmp_path, "logs", "tau=0")
    assert r.returncode == 1 and "no logs yet under gs://bkt/runs/two/_pods/pod-1/tau=0/logs/" in r.stderr


REAL_GCLOUD = shutil.which("gcloud", path="/usr/bin:/usr/local/bin:/usr/lib/google-cloud-sdk/bin")


@pytest.mark.slow
@pytest.mark.skipif(not REAL_GCLOUD or not shutil.which("unshare"), reason="needs the Google Cloud CLI and unshare")
def test_every_generated_gcloud_line_parses_with_the_real_gcloud(dry_bundle, tmp_path, recorder):
    """Each command line the script runs goes through the real gcloud's argument parser, in a network
    namespace with no network and an empty configuration: it must fail for want of an account or a
    project, never for an unknown flag or a missing argument (gcloud's exit 2)."""
    script = dry_bundle[0] / "launch_tpu.sh"
    recorder_env = {"DILOCO_PYTHON": shutil.which("false"), "GCLOUD_LS": "gs://bkt/runs/two/_pods/pod-1/tau=0/logs/attempt-1/\n"}
    _run_script(script, tmp_path, "up")  # its checks run the project's Python (diloco.tpu.pods)
    for args in (["start"], ["status"], ["logs", "tau=0"], ["boot"], ["stop"], ["down"]):
        _run_script(script, tmp_path, *args, env=recorder_env)
    f = _write_sweep(tmp_path, "experiments/c4_scaling.py:tiny,dp", name="one")
    assert sw.main([str(f), "--root", "gs://bkt/r", *TPU, "--accelerator", "v5litepod-4", "--best-effort", "--out", str(tmp_path / "one"), "--dry-run"]) == 0
    _run_script(tmp_path / "one" / "launch_tpu.sh", tmp_path, "up")
    calls = {tuple(json.loads(line)) for line in recorder.read_text().splitlines()}
    assert {c[3] for c in calls if c[1:3] == ("tpus", "queued-resources") or c[2:4] == ("tpus", "queued-resources")} \
        >= {"create", "describe", "delete", "ssh"}
    cfg = tmp_path / "cloudsdk"
    cfg.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "CLOUDSDK_CONFIG": str(cfg), "CLOUDSDK_CORE_DISABLE_PROMPTS": "1",
           "CLOUDSDK_CORE_CHECK_GCE_METADATA": "false", "CLOUDSDK_COMPONENT_MANAGER_DISABLE_UPDATE_CHECK": "1",
           "CLOUDSDK_CORE_DISABLE_USAGE_REPORTING": "true", "GCE_METADATA_HOST": "127.0.0.1:9",
           "GCE_METADATA_IP": "127.0.0.1:9"}
    from concurrent.futures import ThreadPoolExecutor

    def parse(call):
        return call, subprocess.run(["unshare", "--net", REAL_GCLOUD, *call], capture_output=True, text=True, env=env,
                                    timeout=300)

    with ThreadPoolExecutor(4) as ex:
        for call, r in ex.map(parse, sorted(calls)):
            assert r.returncode != 2 and "unrecognized arguments" not in r.stderr and "invalid choice" not in r.stderr, \
                (call, r.stderr)
            assert "active account" in r.stderr or "[project]" in r.stderr or "credential" in r.stderr.lower() or \
                call[:2] == ("config", "get-value") and r.returncode == 0, (call, r.stderr)  # needs no account


# -- against the stand-in of Cloud TPU and Cloud Storage (tests/standin/) ---------------------------
TRACE_ENV = "exec 19>>\"$DILOCO_TRACE\"; BASH_XTRACEFD=19; PS4='+${BASH_SOURCE##*/}:${LINENO}: '; set -x\n"
NOT_RUN = __import__("re").compile(r"^\s*(#.*|(;;|esac|fi|done|else|then|do|\})(\s*;;)?|[^\s()]+(\s*\|\s*[^\s()]+)*\)"
                                   r"|[A-Za-z_]\w*\(\)\s*\{\s*(#.*)?)?\s*$")  # (a function's header and closing brace too)


def executable_lines(text: str) -> set[int]:
    """Line numbers bash's xtrace reports when they run: not blank, comments, `;;`, closers or case
    patterns; a command continued with `\\` counts once, at its first line."""
    out, cont = set(), False
    for i, line in enumerate(text.splitlines(), 1):
        if not cont and i > 1 and not NOT_RUN.fullmatch(line):
            out.add(i)
        cont = line.rstrip().endswith("\\")
    return out


def traced_lines(trace: Path, names: tuple[str, ...]) -> set[int]:
    import re

    got = set()
    for line in trace.read_text(errors="replace").splitlines() if trace.exists() else []:
        m = re.match(r"\++([^:]+):(\d+): ", line)
        if m and m.group(1) in names:
            got.add(int(m.group(2)))
    return got


@pytest.fixture
def traced(tmp_path, standin):
    """Bash on the laptop and on every stand-in host traces each line it runs (file:line) to a file;
    the hosts run this interpreter as the agent's (DILOCO_TPU_PYTHON: no install)."""
    trace = tmp_path / "trace.txt"
    benv = tmp_path / "bash_env"
    benv.write_text(TRACE_ENV)
    extra = {"BASH_ENV": str(benv), "DILOCO_TRACE": str(trace), "DILOCO_TPU_PYTHON": sys.executable,
             "DILOCO_BOOT_BACKOFF_S": "0"}
    standin.configure(emulator_env={**standin.config["emulator_env"], **extra})
    return trace, {**extra, "DILOCO_TPU_PYTHON": ""}


def _sh(script: Path, *args, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    r = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "POLL_S": "0.2", **env})
    print(f"$ launch_tpu.sh {' '.join(args)} → {r.returncode}\n{r.stdout}{r.stderr}")
    return r


def _gcloud_calls(standin) -> list[list[str]]:
    return [i["argv"] for i in standin.invocations() if i["host"] is None]


def test_a_c4_pod_point_is_refused_before_the_bucket_or_the_cloud_is_touched(standin, gcs, tmp_path, capsys):
    """A C4 point on a 2-host v5p-16, its TFDS dataset_info.json on gs:// (all the old preflight asked for): one
    line naming the field, the point and the store to make; the stand-in holds no queued resource, saw no gcloud
    call, and the bucket holds only the dataset (no probe, no bundle)."""
    vocab = _tiny_spm(tmp_path / "spm.model")
    gcs.write(gcs.url("tfds/c4/en/3.0.1/dataset_info.json"), '{"name": "c4"}')
    f = _write_sweep(tmp_path, "experiments/c4_scaling.py:35M,dp")
    out = tmp_path / "bundle"
    argv = [str(f), "--root", gcs.url("runs"), *TPU, "--accelerator", "v5p-16", "--out", str(out),
            "--set", f"data_dir={gcs.url('tfds')}", "--set", f"vocab=sentencepiece:{vocab}"]
    assert sw.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("diloco sweep: bad input: data: point default: data='c4' "), err
    assert (f"`diloco data tokenize --data c4 --data_dir {gcs.url('tfds')} --vocab sentencepiece:{vocab} --out "
            "gs://BUCKET/stores/c4`, then launch with --set data=tokens:gs://BUCKET/stores/c4") in err, err
    assert standin.names() == [] and standin.state("pod-1") is None and not _gcloud_calls(standin)
    assert not out.exists() and list(gcs.objects()) == ["tfds/c4/en/3.0.1/dataset_info.json"]


def _store_on_gcs(gcs, tmp_path, url: str, vocab: str, n_train: int = 2) -> None:
    """A small store on the emulator (byte vocabulary), its manifest then re-signed for `vocab`: the preflight
    reads only the manifest, and the tests have no SentencePiece model to tokenize with."""
    from diloco.data import store
    from test_store import make_text_corpus

    store.tokenize(make_text_corpus(tmp_path / "corpus", n_train=n_train, n_val=1, size=1600), "byte", url, workers=1,
                   progress=False)
    man = store.read_manifest(url)
    assert 1024 <= man["splits"]["validation"]["tokens"] < 2048  # rows of the point's seq_len 1024, not of 2048
    man["vocab"] = store.vocab_identity(vocab)
    man["fingerprint"] = store.fingerprint(man)
    gcs.write(f"{url}/{store.MANIFEST}", json.dumps(man))


def test_the_bucket_checks_refuse_before_anything_and_up_stages_the_vocabulary(standin, gcs, tmp_path, capsys):
    """A point on a token store on gs:// that is not there, was tokenized with another vocabulary, or is too
    short for the point's seq_len; a gs:// vocabulary that is not there; a bucket that does not exist: one line
    each, no gcloud call, no bundle, nothing left in the bucket. With the store right everything passes, and
    `up` creates the queued resource and uploads the bundle with the staged vocabulary the points' argv name."""
    vocab = _tiny_spm(tmp_path / "spm.model")
    f = _write_sweep(tmp_path, "experiments/c4_scaling.py:35M,dp")
    out, url = tmp_path / "bundle", gcs.url("stores/c4-t5")
    argv = [str(f), "--root", gcs.url("runs"), *TPU, "--accelerator", "v5p-16", "--out", str(out),
            "--set", f"data=tokens:{url}", "--set", f"vocab=sentencepiece:{vocab}"]

    def refused() -> str:
        assert sw.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and not out.exists() and not _gcloud_calls(standin), err
        assert not [n for n in gcs.objects() if "probe" in n], "the probe object was left behind"
        assert standin.names() == []
        return err

    err = refused()
    assert f"data: point default: no token store at '{url}'" in err and "`diloco data tokenize --data" in err, err
    _store_on_gcs(gcs, tmp_path, url, "byte")
    err = refused()
    assert f"vocab: point default: the token store {url} was tokenized with a byte vocabulary" in err, err
    _store_on_gcs(gcs, tmp_path, url, f"sentencepiece:{vocab}", n_train=6)  # 9 train rows of 1024
    objects = sorted(gcs.objects())
    argv += ["--set", "seq_len=2048"]  # longer than the validation split
    assert f"data: point default: the 'validation' split of {url} has" in refused()
    argv[-2:] = []
    argv[-1] = f"vocab=sentencepiece:{gcs.url('vocab/none.model')}"
    assert "vocab: point default: sentencepiece model 'gs://" in refused()
    argv[-1] = f"vocab=sentencepiece:{vocab}"
    argv[argv.index("--root") + 1] = "gs://no-such-bucket-here/runs"
    assert "--root: gs://no-such-bucket-here/runs: cannot write a probe object" in refused()
    argv[argv.index("--root") + 1] = gcs.url("runs")
    assert "has 9 train rows of seq_len 1024, fewer than one global batch of 64" in refused()
    argv += ["--set", "batch_size=8"]
    assert sw.main(argv) == 0, capsys.readouterr().err
    fp = json.loads(gcs.read(f"{url}/manifest.json"))["fingerprint"]
    assert f"point default reads the token store {url} (fingerprint {fp[:12]}, " in capsys.readouterr().out
    assert sorted(gcs.objects()) == objects and not _gcloud_calls(standin) and standin.names() == []
    plan = json.loads((out / "plan.json").read_text())
    assert f"--config.data=tokens:{url}" in plan["points"][0]["argv"]
    staged = plan["points"][0]["argv"][-1].removeprefix("--config.vocab=sentencepiece:")
    assert staged == f"{gcs.url('runs/t/_pods/pod-1/_launch')}/{preflight.staged_vocab_name(str(vocab))}"
    standin.configure(waiting_s=None)  # the request stays queued: nothing boots
    r = _sh(out / "launch_tpu.sh", "up", env={"UP_WAIT_S": "0"})
    assert r.returncode == 1 and "still WAITING_FOR_RESOURCES" in r.stderr
    assert standin.names() == ["pod-1"]  # what the refusals above asserted had not happened
    assert gcs.read(staged) == vocab.read_bytes()
    assert {n.rsplit("/", 1)[-1] for n in gcs.objects("runs/t/_pods/pod-1/_launch/")} == \
        {p.name for p in out.iterdir() if p.name != bundle.MARKER}


def _lifecycle_sweep(tmp_path, gcs, out) -> list[str]:
    f = _write_sweep(tmp_path, "experiments/c4_scaling.py:tiny,diloco_h30", '[{"steps": 60}, {"steps": 8}]',
                     name="life")
    return [str(f), "--root", gcs.url("runs"), *TPU, "--accelerator", "v5p-8", "--slices", "2", "--out", str(out),
            "--set", "seq_len=32", "--set", "batch_size=16", "--set", "H=4", "--set", "log_every=2",
            "--set", "eval_every=4", "--set", "eval_batches=1", "--set", "checkpoint_every=100",
            "--set", "optimizer.warmup_steps=2"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_up_start_status_logs_stop_down_on_the_standin_run_every_line_of_the_launch_script(
        standin, gcs, tmp_path, traced):
    """A two-point sweep on 2 slices of v5p-8 (one host each, 4 CPU devices per host): every launch_tpu.sh
    command, the queued resource held, failed and suspended on the way; stop returns once the running
    point's checkpoint is saved and every agent has exited; start resumes; down deletes. Every executable
    line of launch_tpu.sh and of startup.sh (but its install, run by the install test) is traced."""
    from diloco.tpu import status as S

    trace, env = traced
    out = tmp_path / "bundle"
    standin.configure(cpu_devices=4, waiting_s=None)
    assert sw.main(_lifecycle_sweep(tmp_path, gcs, out)) == 0
    script, base = out / "launch_tpu.sh", gcs.url("runs/life/_pods/pod-1")
    assert _sh(script, env=env).returncode == 2
    r = _sh(script, "logs", "steps=60", env=env)
    assert r.returncode == 1 and "no logs yet" in r.stderr
    # held in WAITING_FOR_RESOURCES: up gives up after its bound and says how to go on
    r = _sh(script, "up", env={**env, "UP_WAIT_S": "1"})
    assert r.returncode == 1 and "pod-1 is still WAITING_FOR_RESOURCES after 1s" in r.stderr
    # FAILED: up deletes it and creates it again
    standin.set_state("pod-1", "FAILED")
    n0 = len(_gcloud_calls(standin))
    r = _sh(script, "up", env={**env, "UP_WAIT_S": "1"})
    assert r.returncode == 1 and "pod-1 is FAILED: deleting it to create it again" in r.stdout
    assert "pod-1 is still WAITING_FOR_RESOURCES after 1s" in r.stderr
    verbs = [c[3] for c in _gcloud_calls(standin)[n0:] if c[:3] == ["compute", "tpus", "queued-resources"]]
    assert verbs.count("delete") == verbs.count("create") == 1 and verbs.index("delete") < verbs.index("create"), verbs
    # SUSPENDED while up waits: up reports it instead of waiting for ever
    p = subprocess.Popen(["bash", str(script), "up"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "POLL_S": "0.2", **env, "UP_WAIT_S": "120"})
    for line in p.stdout:  # up is in its loop, polling the queued request
        if line.startswith("pod-1: WAITING_FOR_RESOURCES"):
            break
    standin.set_state("pod-1", "SUSPENDED")
    so, se = p.communicate(timeout=60)
    assert p.returncode == 1 and "pod-1 is SUSPENDED" in se, (so, se)
    # capacity arrives: up recreates the suspended resource and returns once it is ACTIVE; the first
    # download of the tree fails on one host (retried), and on the other the first fetch of startup.sh
    standin.configure(waiting_s=0.2)
    standin.fail("storage", "cp", "tree-", times=1, host="pod-1/slice0-worker0")
    standin.fail("storage", "cp", "startup.sh", times=1, host="pod-1/slice1-worker0")
    r = _sh(script, "up", env=env)
    assert r.returncode == 0 and "pod-1 is SUSPENDED: deleting it" in r.stdout and "pod-1 is ACTIVE" in r.stdout
    r = _sh(script, "up", env=env)  # up again on the live resource: it says what it does (nothing on the hosts)
    assert r.returncode == 0 and "pod-1 was already ACTIVE" in r.stdout
    standin.wait_for(lambda: [v for v in gcs.objects("runs/life/_pods/pod-1/_pod/boot/").values()
                              if b"agent started" in v][1:], 60, "both hosts' boot logs in the bucket")
    r = _sh(script, "boot", env=env)
    assert r.returncode == 0 and "try 1 of 6 failed: gcloud storage cp" in r.stdout and "agent started" in r.stdout
    r = _sh(script, "start", env=env)  # the agents started at boot stay; start is idempotent
    assert r.returncode == 0 and r.stdout.count("the agent already runs") == 2, r.stdout
    standin.wait_for(lambda: S.collect(base)["points"][0]["state"] == "running" and
                     gcs.objects("runs/life/steps=60/metrics.jsonl"), timeout=600, what="point 1 running")
    r = _sh(script, "status", env=env)
    assert r.returncode == 2 and "queued resource pod-1: ACTIVE" in r.stdout and "running" in r.stdout
    standin.fail("queued-resources", "describe", "value(state.state)", times=3)  # the API fails 3 times running
    r = _sh(script, "status", env=env)
    assert r.returncode == 1 and "describe pod-1 failed 3 times: ERROR: (gcloud) HTTPError 503" in r.stderr
    r = _sh(script, "down", env=env)
    assert r.returncode == 1 and "a point is running on pod-1" in r.stderr
    r = _sh(script, "stop", env=env, timeout=900)
    assert r.returncode == 0, r.stderr
    assert not [p for p in standin.processes("pod-1") if p["slice"] is not None], "an agent or trainer still runs"
    ckpt = {n.split("/ckpt/")[1].split("/")[0] for n in gcs.objects("runs/life/steps=60/ckpt/")}
    assert any(c.isdigit() for c in ckpt) and not [c for c in ckpt if "tmp" in c], ckpt  # saved and finalized
    r = _sh(script, "start", env=env)
    assert r.returncode == 0 and r.stdout.count("agent started") == 2, r.stdout
    standin.wait_for(lambda: S.exit_code(S.collect(base)) != 2, timeout=900, what="both points ended")
    r = _sh(script, "status", env=env)
    assert r.returncode == 0 and r.stdout.count("finished") >= 2, r.stdout
    r = _sh(script, "logs", "steps=60", env=env)
    assert r.returncode == 0 and "slice0-worker0.log <==" in r.stdout and "slice1-worker0.log <==" in r.stdout
    r = _sh(script, "logs", "steps=60", "slice1-worker0", env=env)
    assert r.returncode == 0 and "slice1-worker0.log <==" in r.stdout and "slice0-worker0" not in r.stdout
    r = _sh(script, "down", env=env)
    assert r.returncode == 0 and standin.state("pod-1") is None
    assert standin.leaks() == []
    # every executable line of the scripts ran (startup.sh's install block runs in the install test; giving up
    # after the last try, in tests/test_tpu_cloud.py; the metadata-server lookup only on a VM)
    text = script.read_text().splitlines()  # `watch`: run by tests/test_tpu_e2e.py's Spot test (its own resource)
    w0 = text.index("watch)")
    w1 = next(i for i in range(w0, len(text)) if text[i].strip() == "done ;;")
    launch = executable_lines(script.read_text()) - traced_lines(trace, ("launch_tpu.sh",)) - set(range(w0 + 1, w1 + 2))
    assert not launch, [script.read_text().splitlines()[i - 1] for i in sorted(launch)]
    text = (out / "startup.sh").read_text()
    missed = executable_lines(text) - traced_lines(trace, ("startup.sh", "diloco-startup.sh"))
    assert missed - give_up_lines(text) == install_lines(text), [text.splitlines()[i - 1] for i in sorted(missed)]
    boot = (out / "bootstrap.sh").read_text()
    missed = executable_lines(boot) - traced_lines(trace, ("startup-script",))
    assert missed == give_up_lines(boot), [boot.splitlines()[i - 1] for i in sorted(missed)]


def give_up_lines(script: str) -> set[int]:
    """The lines that run only when the last try failed, or only on a real VM (the metadata server)."""
    lines = script.splitlines()
    out = set()
    for i, line in enumerate(lines, 1):
        if re.search(r'gave up after|boot failed: could not fetch|^meta\(\)', line):
            out.add(i)
            if lines[i].strip() in ("return 1", "exit 1"):
                out.add(i + 1)
    return out


def install_lines(startup: str) -> set[int]:
    lines = startup.splitlines()
    a = next(i for i, l in enumerate(lines, 1) if l.startswith("elif [ ! -f \"$env/.complete\" ]"))
    b = next(i for i, l in enumerate(lines, 1) if i > a and l == "fi")
    return set(range(a, b))  # the elif itself runs only when no interpreter is given


@pytest.mark.slow
def test_a_fresh_host_installs_the_shipped_tree_from_the_lock_and_runs_a_point(standin, gcs, tmp_path):
    """No interpreter given: the host's startup.sh installs uv (pip --target, which works in a virtual
    environment and beside PEP 668), makes a Python 3.11 env with uv and installs the shipped tree's [tpu]
    extra under requirements.lock from the package index (then removes the tree's own package: the env is
    keyed on the lock, the code is the tree's), then its agent runs the point with that env to the end.
    Every installed distribution the lock pins has the lock's version; the install block is traced. The
    wait is bounded, and ends at once when the boot log says the boot failed."""
    from diloco.tpu import status as S

    trace, benv = tmp_path / "trace.txt", tmp_path / "bash_env"
    benv.write_text(TRACE_ENV)
    standin.configure(cpu_devices=4, emulator_env={**standin.config["emulator_env"], "BASH_ENV": str(benv),
                                                   "DILOCO_TRACE": str(trace)})
    f = _write_sweep(tmp_path, "experiments/c4_scaling.py:tiny,dp", '[{"steps": 4}]', name="inst")
    out = tmp_path / "bundle"
    assert sw.main([str(f), "--root", gcs.url("runs"), *TPU, "--accelerator", "v5litepod-4", "--out", str(out),
                    "--set", "seq_len=32", "--set", "batch_size=8", "--set", "log_every=2", "--set", "eval_every=4",
                    "--set", "eval_batches=1", "--set", "optimizer.warmup_steps=1"]) == 0
    assert _sh(out / "launch_tpu.sh", "up", env={}).returncode == 0
    base = gcs.url("runs/inst/_pods/pod-1")
    home = standin.host("pod-1", 0, 0).home
    def ended():
        log = (home / "diloco" / "boot.log").read_text() if (home / "diloco" / "boot.log").exists() else ""
        assert "boot failed" not in log, log[-3000:]
        return S.exit_code(S.collect(base)) != 2

    try:
        standin.wait_for(ended, timeout=1500, what="the point to end")
    finally:
        print((home / "startup.log").read_text()[-4000:] if (home / "startup.log").exists() else "no startup.log")
        for log in sorted(home.glob(".diloco-agent/*/logs/*/*.log")) + [home / "diloco" / "agent.log"]:
            print(f"--- {log}\n" + (log.read_text()[-3000:] if log.exists() else "(none)"))
    assert S.exit_code(S.collect(base)) == 0, S.render(S.collect(base))
    plan = json.loads((out / "plan.json").read_text())
    import hashlib

    assert plan["lock_sha256"] == hashlib.sha256((REPO_ROOT / "requirements.lock").read_bytes()).hexdigest()
    py = home / "diloco" / f"env-{plan['lock_sha256'][:12]}" / "bin" / "python"
    assert (py.parent.parent / ".complete").exists()
    tree = home / "diloco" / plan["tree"]["url"].rsplit("/", 1)[1].removesuffix(".tar.gz")
    r = subprocess.run([str(py), "-c", "import importlib.metadata as m, json, sys, diloco; print(json.dumps("
                        "[list(sys.version_info[:2]), diloco.__file__, {d.metadata['Name'].lower().replace('_', '-'): "
                        "d.version for d in m.distributions()}]))"], capture_output=True, text=True, cwd="/",
                       env={"PYTHONPATH": str(tree)})
    version, where, installed = json.loads(r.stdout)
    assert version == [3, 11] and where == str(tree / "diloco" / "__init__.py"), (version, where)
    r = subprocess.run([str(py), "-c", "import importlib.util as u; print(u.find_spec('diloco'))"], capture_output=True,
                       text=True, cwd="/", env={})
    assert r.stdout.strip() == "None", r  # the env holds the dependencies, the code is the tree's
    lock = dict(line.lower().split("==") for line in (REPO_ROOT / "requirements.lock").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert {k: installed[k] for k in ("jax", "jaxlib", "libtpu")} == {"jax": "0.10.2", "jaxlib": "0.10.2",
                                                                      "libtpu": "0.0.42.1"}
    assert {k: v for k, v in installed.items() if k in lock and lock[k] != v} == {}
    text = (out / "startup.sh").read_text()
    assert install_lines(text) <= traced_lines(trace, ("startup.sh", "diloco-startup.sh"))
    assert standin.leaks() == []


@pytest.mark.tpu
def test_check_fit_compile_compiles_the_point_for_the_slice():
    pytest.importorskip("libtpu", reason="--check-fit compile needs libtpu (the [tpu] extra)")
    from diloco.config import load_config

    cfg = load_config("experiments/c4_scaling.py:tiny,dp", ["--config.seq_len=32", "--config.batch_size=8"],
                      check_data=False)
    verdict, why = preflight.fit_by_compile(cfg, accelerators.parse("v5litepod-4"), 1)
    import re

    m = re.fullmatch(r"compiled for v5e:2x2: peak ([0-9.e-]+) GiB of 16 GiB per chip", why)
    assert verdict == "fits" and m and 0 < float(m.group(1)) < 1, why
