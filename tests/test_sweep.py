"""diloco sweep: expansion, dry run, locks, resume, failure isolation (real tiny runs)."""
import json
import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest

from diloco import sweep as sw
from diloco.errors import ConfigError
from diloco.pointlock import LOCK
from diloco.rundir import append_jsonl, atomic_write_json

FAST = [f"--config.{k}={v}" for k, v in {"steps": 4, "seq_len": 32, "batch_size": 4, "log_every": 2, "eval_every": 2,
                                         "eval_batches": 1, "checkpoint_every": 2, "optimizer.warmup_steps": 1}.items()]


def test_product_and_zip_expand_axes():
    pts = sw.product(tau=[0, 1, 5], alpha=[0.0, 0.5])
    assert len(pts) == 6 and {"tau": 5, "alpha": 0.5} in pts
    assert [list(p) for p in pts] == [["tau", "alpha"]] * 6  # axis order kept: stable folder names
    z = sw.zip_(codec=["topk", "dare"], codec_keep_fraction=[0.0625, 0.125])
    assert z == [{"codec": "topk", "codec_keep_fraction": 0.0625}, {"codec": "dare", "codec_keep_fraction": 0.125}]
    crossed = sw.product(z, seed=[0, 1])
    assert len(crossed) == 4 and {"codec": "dare", "codec_keep_fraction": 0.125, "seed": 1} in crossed
    with pytest.raises(ConfigError, match="equal lengths"):
        sw.zip_(a=[1, 2], b=[1])
    with pytest.raises(ConfigError, match="non-empty list"):
        sw.product(tau=[])


def test_point_names_are_stable_and_filesystem_safe():
    assert sw.point_name({"tau": 5, "alpha": 0.5}) == "tau=5,alpha=0.5"
    assert sw.point_name({"arg": "toy,4,local"}) == "toy+4+local"
    assert sw.point_name({"replica_tau": "1,5", "pattern": "a/b c"}) == "replica_tau=1+5,pattern=a-b-c"
    assert sw.point_name({}) == "default"


def _write_sweep(tmp_path, points: str, name="t"):
    p = tmp_path / f"{name}.py"
    p.write_text(textwrap.dedent(f"""
        from diloco.sweep import product
        def get_sweep(arg="tiny"):
            return {{"name": "{name}", "experiment": "experiments/c4_scaling.py:" + arg + ",dp", "points": {points}}}
    """))
    return p


def test_every_repo_sweep_expands():
    for f in sorted((sw.REPO_ROOT / "sweeps").glob("*.py")):
        s = sw.load_sweep(str(f))
        assert s["points"] and len({p["name"] for p in s["points"]}) == len(s["points"])
    s = sw.load_sweep("sweeps/tau_alpha.py:tiny")
    assert len(s["points"]) == 12 and s["name"] == "tau_alpha_tiny"
    assert s["points"][3]["overrides"] == ["--config.tau=1", "--config.alpha=0.5"]


def test_colliding_points_and_bad_files_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="same folder"):
        sw.load_sweep(str(_write_sweep(tmp_path, '[{"pattern": "a b"}, {"pattern": "a/b"}]')))
    with pytest.raises(ConfigError, match="not found"):
        sw.load_sweep(str(tmp_path / "missing.py"))


def test_dry_run_prints_exact_commands(tmp_path, capsys):
    f = _write_sweep(tmp_path, 'product(tau=[1, 2])')
    (tmp_path / "root" / "t" / "tau=2").mkdir(parents=True)
    (tmp_path / "root" / "t" / "tau=2" / "summary.json").write_text("{}")
    assert sw.main([f"{f}:toy", "--root", str(tmp_path / "root"), "--dry-run", "--set", "steps=9"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("diloco train --config experiments/c4_scaling.py:toy,dp ")  # as a user types it
    assert "--config.tau=1" in lines[0]
    assert f"--workdir {tmp_path}/root/t/tau=1" in lines[0] and lines[0].split()[-1] == "--config.steps=9"
    assert lines[1].endswith("# done")


def test_only_matching_nothing_and_ctrl_c_are_one_line(tmp_path, capsys, monkeypatch):
    """`--only` that selects no point is refused (exit 2) before anything runs; Ctrl-C during a sweep exits
    130 saying how to resume, with no traceback."""
    f = _write_sweep(tmp_path, 'product(tau=[1, 2])')
    assert sw.main([f"{f}:toy", "--root", str(tmp_path / "root"), "--only", "tau=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["diloco sweep: bad input: --only: 'tau=3' matches no point of t (tau=1, tau=2); give part of a "
                   "name"], err
    (tmp_path / "afile").write_text("")  # a --root that is a file: one line, before any point is checked
    assert sw.main([f"{f}:toy", "--root", str(tmp_path / "afile" / "r"), "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == f"diloco sweep: bad input: --root: {tmp_path / 'afile'} is a file, not a folder; give a folder"

    # every point is validated before the first runs: a --set typo is one line, once, whatever the point count
    assert sw.main([f"{f}:toy", "--root", str(tmp_path / "root"), "--set", "stpes=5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "point tau=1" in err[0] and "stpes" in err[0] and "1 more point(s)" in err[0], err
    assert not (tmp_path / "root").exists()

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(sw, "run_sweep", interrupted)
    assert sw.main([f"{f}:toy", "--root", str(tmp_path / "root")]) == 130
    assert "rerun the same command to resume" in capsys.readouterr().err


# `--launch tpu` (checks before billing, the bundle, the scripts) is tested in tests/test_tpu_launch.py.


def test_lock_is_exclusive_and_stale_locks_are_taken_over(tmp_path):
    wd = tmp_path / "p"
    assert sw.acquire_lock(wd)
    assert not sw.acquire_lock(wd)  # held by a live process (us)
    sw.release_lock(wd)
    assert not (wd / LOCK).exists()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (wd / LOCK).write_text(f"{socket.gethostname()}:{dead.pid}")
    assert sw.acquire_lock(wd)  # the holder is gone: stale
    assert (wd / LOCK).read_text().endswith(f":{os.getpid()}")
    sw.release_lock(wd)
    (wd / LOCK).write_text("another-host:1")
    assert not sw.acquire_lock(wd)  # cannot tell whether a process on another host lives: leave it


def test_failure_is_recorded_others_finish_and_resume_skips(tmp_path):
    """One good point, one that fails inside `diloco train` (DiLoCo with τ>0 is refused)."""
    f = _write_sweep(tmp_path, '[{"arg": "tiny,dp"}, {"arg": "tiny,diloco_h30", "tau": 3}]')
    s = sw.load_sweep(str(f))
    root = tmp_path / "root"
    res = sw.run_sweep(s, root, workers=2, extra=FAST, quiet=True)
    status = {r["point"]: r["status"] for r in res}
    assert status == {"tiny+dp": "done", "tiny+diloco_h30,tau=3": "failed"}
    good, bad = root / "t" / "tiny+dp", root / "t" / "tiny+diloco_h30,tau=3"
    summary = json.loads((good / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["method"] == "dp"
    failed = json.loads((bad / "failed.json").read_text())
    assert failed["returncode"] == 2 and "tau" in failed["error_tail"] and "diloco" in failed["command"]
    assert not (bad / "summary.json").exists()
    assert json.loads((good / "point.json").read_text())["spec"] == "experiments/c4_scaling.py:tiny,dp"
    assert not (good / LOCK).exists() and not (bad / LOCK).exists()
    mtime = (good / "summary.json").stat().st_mtime_ns
    again = sw.run_sweep(s, root, workers=1, extra=FAST, quiet=True, only="tiny+dp")
    assert [r["status"] for r in again] == ["skipped"]
    assert (good / "summary.json").stat().st_mtime_ns == mtime
    table = sw.format_table(res)
    assert "1 done, 1 failed" in table
    # the experiment changed since (a tuned value, say): the record is kept and called stale, not rerun
    changed = sw.run_sweep(s, root, workers=1, extra=[*FAST, "--config.optimizer.lr=0.01"], quiet=True,
                           only="tiny+dp")
    assert [(r["status"], r["changed"]) for r in changed] == [("stale", ["optimizer.lr"])]
    assert (good / "summary.json").stat().st_mtime_ns == mtime and sw.format_table(changed).endswith(
        "1 stale; 1 stale point(s) hold another config's numbers: not this sweep's results")


def test_a_locked_point_is_not_run(tmp_path):
    f = _write_sweep(tmp_path, '[{}]')
    s = sw.load_sweep(str(f))
    wd = tmp_path / "root" / "t" / "default"
    wd.mkdir(parents=True)
    (wd / LOCK).write_text(f"{socket.gethostname()}:{os.getppid()}")  # a live process holds it
    assert [r["status"] for r in sw.run_sweep(s, tmp_path / "root", quiet=True)] == ["locked"]
    assert not (wd / "config.json").exists()


def test_in_process_pool_records_a_failure_once(tmp_path):
    f = _write_sweep(tmp_path, '[{"arg": "tiny,diloco_h30", "tau": 3}, {"arg": "tiny,dp"}]')
    s = sw.load_sweep(str(f))
    res = sw.run_sweep(s, tmp_path / "root", workers=2, extra=FAST, quiet=True, in_process=True)
    assert {r["point"]: r["status"] for r in res} == {"tiny+diloco_h30,tau=3": "failed", "tiny+dp": "done"}
    log = (tmp_path / "root" / "t" / "tiny+diloco_h30,tau=3" / "train.log").read_text()
    assert log.count("$ ") == 1  # tried by one worker only


def test_status_is_one_line_per_change_with_counts_from_disk(tmp_path, capsys):
    """A finished point is not re-announced; a point that runs gets a start and an end line; the
    'k/n finished' count is what is on disk (the same for every worker of a pool)."""
    f = _write_sweep(tmp_path, '[{"arg": "tiny,dp"}, {"arg": "tiny,diloco_h30", "tau": 3}]')
    s = sw.load_sweep(str(f))
    root = tmp_path / "root"
    (root / "t" / "tiny+dp").mkdir(parents=True)
    (root / "t" / "tiny+dp" / "summary.json").write_text('{"final_eval_loss": 5.0}')
    res = sw.run_sweep(s, root, workers=1, in_process=True)  # the failing point fails in load_config: fast
    assert [r["status"] for r in res] == ["skipped", "failed"]
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == f"[t] 2 point(s) under {root / 't'}, 1 at a time; 1/2 finished"
    assert lines[1] == "[t] start   tiny+diloco_h30,tau=3  (1/2 finished)"
    assert re.fullmatch(r"\[t\] failed  tiny\+diloco_h30,tau=3  \d+ s  \(1/2 finished\)  rc=2: diloco train: bad input: "
                        r"method: diloco is P=1, tau=0; .*  → \S+/failed\.json", lines[2]), lines[2]
    assert len(lines) == 3
    assert sw.eta([60.0, 120.0], 3, 2) == "00:03:00" and sw.eta([10.0], 1, 1) == "00:00:10"  # 2 rounds of 90 s


def test_status_table_reads_every_point_state_and_runs_nothing(tmp_path, capsys):
    """A sweep root written by the real writers: done (100 s), running (step 4 of 10 in 40 s, its lock held by
    this process: ETA 40/4·6 = 60 s), failed, stopped (a dead process's lock left), pending. The sweep's ETA:
    the running point's 60 s + 3 points left × the mean 100 s of the one done = 6 min."""
    f = _write_sweep(tmp_path, "product(tau=[0, 1, 2, 3, 4])")
    root = tmp_path / "root"
    wd = {t: root / "t" / f"tau={t}" for t in range(5)}
    for t in range(4):
        atomic_write_json(wd[t] / "config.json", {"method": "dp", "steps": 10})
    for t, rows in ((0, [(10, 3.5, 100.0)]), (1, [(2, 4.5, 20.0), (4, 4.25, 40.0)]), (3, [(6, 4.0, 70.0)])):
        for step, loss, secs in rows:
            append_jsonl(wd[t] / "metrics.jsonl", {"step": step, "train_loss": loss, "seconds": secs})
    atomic_write_json(wd[0] / "summary.json", {"final_eval_loss": 3.25, "wall_seconds": 100.0})
    atomic_write_json(wd[2] / "failed.json", {"returncode": 1, "error_tail": "boom"})
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (wd[3] / ".lock").write_text(f"{socket.gethostname()}:{dead.stdout.strip()}")
    assert sw.acquire_lock(wd[1])
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    try:
        assert sw.main([str(f), "--root", str(root), "--status"]) == 0
        after = sorted(p.relative_to(root) for p in root.rglob("*"))
    finally:
        sw.release_lock(wd[1])
    lines = capsys.readouterr().out.splitlines()
    assert [l.split() for l in lines[2:7]] == [
        ["done", "10/10", "3.5000", "3.2500", "—", "tau=0"],
        ["running", "4/10", "4.2500", "—", "0:01:00", "tau=1", "(pid", f"{os.getpid()})"],
        ["failed", "0/10", "—", "—", "—", "tau=2"],
        ["stopped", "6/10", "4.0000", "—", "—", "tau=3"],
        ["pending", "0/?", "—", "—", "—", "tau=4"]], lines
    assert lines[7] == (f"5 point(s) under {root / 't'}: 1 done, 1 running, 1 failed, 1 stopped, 1 pending; ETA 0:06:00 "
                        "at -j 1 (3 left at the mean 0:01:40 of 1 done)")
    assert after == before  # nothing written, nothing run


def test_seeds_expand_every_point_seed_major_and_keep_seed_zero_folders(tmp_path):
    f = _write_sweep(tmp_path, 'product(tau=[0, 1])')
    one = sw.load_sweep(str(f))
    three = sw.load_sweep(str(f), seeds=3)
    assert [p["name"] for p in one["points"]] == ["tau=0", "tau=1"]
    assert [p["name"] for p in three["points"]] == ["tau=0", "tau=1", "tau=0,seed=1", "tau=1,seed=1",
                                                    "tau=0,seed=2", "tau=1,seed=2"]
    assert three["points"][0]["overrides"] == one["points"][0]["overrides"]  # seed 0: the same run as K=1
    assert three["points"][5]["overrides"] == ["--config.tau=1", "--config.seed=2"]
    assert [p["seed"] for p in three["points"]] == [0, 0, 1, 1, 2, 2]
    assert sw.base_name("tau=1,seed=2") == ("tau=1", 2) and sw.base_name("tau=1") == ("tau=1", 0)
    f2 = _write_sweep(tmp_path, '[{"tau": 0}]', name="u")
    f2.write_text(f2.read_text().replace('"points"', '"seeds": 2, "points"'))
    assert [p["name"] for p in sw.load_sweep(str(f2))["points"]] == ["tau=0", "tau=0,seed=1"]
    with pytest.raises(ConfigError, match="sweep.seeds"):
        sw.load_sweep(str(f), seeds=0)
    with pytest.raises(ConfigError, match="seeds=K"):
        sw.load_sweep(str(_write_sweep(tmp_path, '[{"seed": 1}]', name="v")))


def test_seeds_run_as_separate_resumable_points(tmp_path):
    f = str(_write_sweep(tmp_path, '[{}]'))
    first = sw.run_sweep(sw.load_sweep(f), tmp_path / "root", extra=FAST, quiet=True, in_process=True)
    res = sw.run_sweep(sw.load_sweep(f, seeds=2), tmp_path / "root", extra=FAST, quiet=True, in_process=True)
    assert [r["status"] for r in first] == ["done"] and [r["status"] for r in res] == ["skipped", "done"]
    cfgs = [json.loads((tmp_path / "root" / "t" / n / "config.json").read_text()) for n in ("default", "default,seed=1")]
    assert [c["seed"] for c in cfgs] == [0, 1]
    pts = [json.loads((tmp_path / "root" / "t" / n / "point.json").read_text()) for n in ("default", "default,seed=1")]
    assert [(p["seed"], p["base_point"]) for p in pts] == [(0, "default"), (1, "default")]
    assert res[0]["final_eval_loss"] != res[1]["final_eval_loss"]  # another initialisation and data order
