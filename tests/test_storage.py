"""The run folder through one path type (etils.epath): a local path and a non-local filesystem.

The non-local one is `gs://` served offline: fsspec's in-memory filesystem registered under the
gs protocol, and epath told to use fsspec instead of TensorFlow (EPATH_USE_TF=false)."""
import json
import os
import signal
import socket
import struct
import subprocess
import sys

import pytest

from diloco import rundir
from diloco.data import specs
from diloco.errors import ConfigError


@pytest.fixture
def fake_gcs(monkeypatch):
    import fsspec
    from etils.epath import gpath
    from fsspec.implementations.memory import MemoryFileSystem

    class FakeGCS(MemoryFileSystem):
        protocol = ("gs", "gcs")
        root_marker = ""
        store: dict = {}
        pseudo_dirs = [""]

    for name in ("gs", "gcs"):
        fsspec.register_implementation(name, FakeGCS, clobber=True)
    monkeypatch.setenv("EPATH_USE_TF", "false")
    gpath._is_tf_installed.cache_clear()
    yield "gs://bucket/runs/x"
    FakeGCS.store.clear()
    gpath._is_tf_installed.cache_clear()
    for name in ("gs", "gcs"):
        fsspec.register_implementation(name, "gcsfs.GCSFileSystem", clobber=True, errtxt="Please install gcsfs")


@pytest.fixture(params=["local", "gs"])
def root(request, tmp_path):
    return os.fspath(tmp_path / "run") if request.param == "local" else request.getfixturevalue("fake_gcs")


def tb_events(folder) -> list:
    """The Event records of a TensorBoard folder's event files (TFRecord framing: length, crc, data, crc)."""
    from tensorboardX.proto import event_pb2

    out = []
    for f in sorted(f for f in folder.iterdir() if f.name.startswith("events")):  # glob: not on the fake gs
        b, i = f.read_bytes(), 0
        while i < len(b):
            n = struct.unpack("<Q", b[i:i + 8])[0]
            out.append(event_pb2.Event.FromString(b[i + 12:i + 12 + n]))
            i += 12 + n + 4
    return out


def test_run_folder_records_round_trip(root):
    run = rundir.RunDir(root)
    assert os.fspath(run.root) == (root if "://" in root else os.path.abspath(root))
    cfg = json.dumps({"a": 1, "outer": {"lr": 0.4, "nesterov": True}, "steps": 3})
    run.make()
    run.claim(cfg)
    run.claim(cfg)  # the same config again: a resume
    with pytest.raises(ConfigError, match="workdir"):
        run.claim(json.dumps({"a": 2}))
    for step in (1, 2, 3):
        run.log({"step": step, "loss": 1.0 / step})
        if step == 2:  # a checkpoint: a remote folder's TensorBoard as far as here is in its tb/
            run.sync_tb()
            if "://" in root:
                assert {(v.tag, e.step) for e in tb_events(run.root / "tb") for v in e.summary.value} == {
                    ("loss", 1), ("loss", 2)}
    staged = run.tb_local  # a remote folder's staging folder (None for a local one)
    assert (staged is None) == ("://" not in root)
    run.resume_records(2)  # rows after the checkpoint's step go
    assert [r["step"] for r in rundir.read_jsonl(run / "metrics.jsonl")] == [1, 2]
    run.close()  # as the trainer does: the folder (lock, TensorBoard writer) closed, then the summary written
    assert staged is None or not os.path.exists(staged)
    run.write_summary({"final": 0.5, "method": "dp"})
    assert run.summary() == {"final": 0.5, "method": "dp"}
    names = sorted(p.name for p in run.root.iterdir() if p.name != "tb")
    lock = [".run.lock"] if "://" not in root else []  # the run-folder lock: local folders only
    assert names == [*lock, "config.json", "metrics.jsonl", "summary.json"]  # no temporary files left behind
    assert (run / "config.json").read_text() == cfg
    # TensorBoard, remote folders too: the metrics (all it was sent), the config as hparams with the summary's
    # numbers as their metrics (tb/hparams)
    from tensorboardX.proto import plugin_hparams_pb2

    files = [f for f in (run.root / "tb").iterdir() if f.name.startswith("events")]
    assert len(files) == (2 if "://" in root else 1)  # remote: one per checkpoint interval; local: not reopened
    assert {(v.tag, e.step) for e in tb_events(run.root / "tb") for v in e.summary.value} == {
        ("loss", 1), ("loss", 2), ("loss", 3)}
    ev = {v.tag: v for e in tb_events(run.root / "tb" / "hparams") for v in e.summary.value}
    start = plugin_hparams_pb2.HParamsPluginData.FromString(
        ev["_hparams_/session_start_info"].metadata.plugin_data.content).session_start_info
    assert {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()} == {
        "a": 1.0, "outer.lr": 0.4, "outer.nesterov": True, "steps": 3.0}
    assert ev["hparam/final"].simple_value == 0.5 and "hparam/method" not in ev


def test_a_non_primary_process_writes_nothing(root):
    run = rundir.RunDir(root, primary=False)
    run.make()
    run.claim(json.dumps({"a": 1}))
    run.log({"step": 1, "loss": 1.0})
    run.write_summary({"final": 0.5})
    assert not (run / "config.json").exists() and not (run / "metrics.jsonl").exists() and run.summary() == {}


def test_gs_paths_stay_remote_and_local_ones_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert os.fspath(rundir.path("gs://b/runs/x")) == "gs://b/runs/x"
    assert os.fspath(rundir.path("runs/x")) == os.fspath(tmp_path / "runs" / "x")
    assert not (tmp_path / "gs:").exists()


def test_gs_without_filesystem_support_names_the_field(monkeypatch):
    monkeypatch.setattr(rundir, "filesystem_support", lambda scheme: None)
    with pytest.raises(ConfigError) as e:
        rundir.require("gs://b/runs/x", "workdir")
    assert e.value.field == "workdir"
    assert "gcsfs" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="unsupported filesystem"):
        rundir.require("ftp://b/x", "workdir")
    with pytest.raises(ConfigError, match="gcsfs") as e:
        specs.parse_vocab("sentencepiece:gs://b/vocab.model")
    assert e.value.field == "vocab"
    with pytest.raises(ConfigError, match="gcsfs") as e:
        specs.parse_data("c4", "gs://b/tfds")
    assert e.value.field == "data_dir"


def test_train_cli_gs_workdir_without_support_is_one_line(monkeypatch, capsys, tmp_path):
    from diloco import train

    monkeypatch.setattr(rundir, "filesystem_support", lambda scheme: None)
    monkeypatch.chdir(tmp_path)
    rc = train.main(["--config", os.fspath(rundir.path(__file__).parent.parent / "experiments" / "toy.py") + ":streaming",
                     "--workdir", "gs://b/runs/x", "--no_progress", "--config.steps=2"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "workdir" in err and "gcsfs" in err, err
    assert not (tmp_path / "gs:").exists()


def test_a_busy_run_folder_is_refused_in_one_line_and_a_killed_holders_lock_is_free(tmp_path):
    """A real second `diloco train` on a folder another process holds exits 2 naming the holder; after a
    SIGKILL of the holder (no clean-up ran) the folder is free again: the kernel dropped the flock."""
    wd, repo = tmp_path / "run", rundir.path(__file__).parent.parent
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from diloco.rundir import RunDir; "
                               "RunDir(sys.argv[1]).make(); print('held', flush=True); time.sleep(600)", wd],
                              stdout=subprocess.PIPE, text=True, cwd=repo)
    try:
        assert holder.stdout.readline().strip() == "held"
        r = subprocess.run([sys.executable, "-m", "diloco.cli", "train", "--config", "experiments/toy.py:dp",
                            "--workdir", wd, "--no_progress", "--config.steps=2"], capture_output=True, text=True,
                           timeout=300, cwd=repo)
        lines = [l for l in r.stderr.splitlines() if l.startswith("diloco")]
        assert r.returncode == 2 and lines == [f"diloco train: bad input: workdir: {wd} is in use by pid {holder.pid} "
                                               f"on {socket.gethostname()}; wait for that run to end (or stop it), "
                                               "or use another --workdir"], r.stderr[-2000:]
        assert not (wd / "metrics.jsonl").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    run = rundir.RunDir(wd)
    run.make()  # the stale lock is taken over
    assert (wd / ".run.lock").read_text() == f"pid {os.getpid()} on {socket.gethostname()}"
    run.close()


def test_a_workdir_that_is_empty_or_a_file_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="^workdir: '' is empty"):
        rundir.require("", "workdir")
    (tmp_path / "f").write_text("x")
    for wd in (tmp_path / "f", tmp_path / "f" / "run"):
        with pytest.raises(ConfigError, match=r"^workdir: .* is a file, not a folder; use another --workdir$"):
            rundir.RunDir(wd).make()
