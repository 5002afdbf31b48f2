"""Ctrl-C / SIGTERM at any moment: one line saying what was saved, exit 130, without waiting for the
busy main thread.

The unit tests drive diloco.interrupt in a small subprocess whose main thread is busy (as it is in an
import or an XLA compilation) for 10 minutes: it exiting with 130 and without "finished" shows it did not
wait (no wall-clock threshold: the timeouts below only guard against a hang). The slow test sends
signals to real `diloco train` processes at start-up, while the first programs compile, and during
training."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

BUSY = """
import os, select, signal, sys, time
from diloco.interrupt import prompt_exit
loop_handler = sys.argv[1] == "loop"
with prompt_exit(lambda s: f"idle {s}", lambda s: f"busy {s}", lambda s: f"again {s}", grace_s=1.0):
    if loop_handler:  # what the training loop does: its own handler, which only sets a flag
        signal.signal(signal.SIGINT, lambda *a: None)
        signal.signal(signal.SIGTERM, lambda *a: None)
    print("ready", flush=True)
    t0 = time.time()
    while time.time() - t0 < 600:  # busy: never returns to check anything
        select.select([], [], [], 600 - (time.time() - t0))
print("finished", flush=True)
"""


def busy_process(mode: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", BUSY, mode], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.stdout.readline() == "ready\n"
    return p


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_while_the_main_thread_is_busy_exits_at_once_with_one_line(sig):
    p = busy_process("startup")
    p.send_signal(getattr(signal, sig))
    out, err = p.communicate(timeout=300)  # the main thread would be busy for 600 s
    assert p.returncode == 130 and "finished" not in out
    assert err == f"idle {sig}\n"  # no KeyboardInterrupt traceback, no "Exception ignored"


def test_a_loop_that_took_the_signal_is_left_to_save_and_a_second_signal_quits():
    p = busy_process("loop")
    p.send_signal(signal.SIGINT)
    line = p.stderr.readline()  # after the grace period: says what it waits for
    assert line == "busy SIGINT\n" and p.poll() is None
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 130 and err == "again SIGTERM\n" and "finished" not in out


def test_outside_the_context_the_previous_handlers_are_back():
    code = ("import signal; from diloco.interrupt import prompt_exit\n"
            "before = signal.getsignal(signal.SIGINT)\n"
            "with prompt_exit(str, str, str): pass\n"
            "print(signal.getsignal(signal.SIGINT) is before, signal.set_wakeup_fd(-1))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.stdout.split() == ["True", "-1"]


# -- real runs ----------------------------------------------------------------------------------------
def train_cmd(workdir: Path, steps: int = 400) -> list[str]:
    flat = {"scale": "tiny", "seq_len": 32, "batch_size": 4, "steps": steps, "log_every": 1, "eval_every": 50,
            "eval_batches": 2, "checkpoint_every": 1000}
    return [sys.executable, "-m", "diloco.cli", "train", "--config", "experiments/toy.py:streaming", "--workdir",
            str(workdir), "--no_progress", *[f"--config.{k}={v}" for k, v in flat.items()]]


def wait_until(pred, p: subprocess.Popen, timeout: float = 300) -> None:
    t0 = time.time()
    while not pred():
        assert p.poll() is None, p.communicate()[1][-3000:]
        assert time.time() - t0 < timeout, "timed out"
        time.sleep(0.01)


def complete_checkpoints(workdir: Path) -> list[int]:
    d = workdir / "ckpt"
    return sorted(int(x.name) for x in d.iterdir() if x.name.isdigit()) if d.exists() else []


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["imports", "compiling", "training"])
def test_signal_at_each_phase_of_a_real_run(tmp_path, phase):
    wd = tmp_path / "run"
    p = subprocess.Popen(train_cmd(wd), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if phase == "imports":
        time.sleep(0.5)
    elif phase == "compiling":  # config.json is written just before the trainer builds and compiles its state
        wait_until(lambda: (wd / "config.json").exists(), p)
    else:
        wait_until(lambda: (wd / "metrics.jsonl").exists() and (wd / "metrics.jsonl").stat().st_size > 0, p)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, err[-3000:]
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1, err[-3000:]  # one line, nothing else (no traceback, no library noise)
    assert out == ""
    if phase == "training":
        step = complete_checkpoints(wd)[-1]
        assert lines[0] == f"diloco train: SIGINT: saved a checkpoint at step {step} in {wd / 'ckpt'}; " \
                           "run the same command to resume"
        rows = [json.loads(l) for l in (wd / "metrics.jsonl").read_text().splitlines()]
        assert rows[-1]["step"] == step  # metrics flushed up to the checkpoint
    else:
        assert lines[0] == "diloco train: SIGINT during start-up; nothing saved" and not complete_checkpoints(wd)
