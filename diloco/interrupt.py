"""Ctrl-C and SIGTERM at any moment of a command, answered within a second or two.

Python runs signal handlers in the main thread between bytecodes, so while the main thread sits in
a long C call (importing TensorFlow, an XLA compilation) a plain handler waits, and the default
SIGINT handler raises KeyboardInterrupt wherever the main thread happens to be (inside a gc
callback it is printed as "Exception ignored" and lost). Instead, `prompt_exit` installs a handler
that does nothing in the main thread and asks the C-level handler to write the signal number to a
pipe (`signal.set_wakeup_fd`); a watcher thread reads the pipe and:

- when this module's handler is still the one installed (start-up, or after a loop restored it):
  prints one line saying what is saved and exits at once with 130;
- when someone else installed a handler meanwhile (the training loop, which saves a checkpoint at
  the end of its current step): lets it work; if the process is still running 5 s later it says
  what it is waiting for; a second signal exits at once (checkpoints are written atomically, so an
  unfinished one is simply not there).
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
from typing import Callable, Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)
EXIT_CODE = 130


def _ignore(signum, frame) -> None:
    """The main thread's part: nothing. The watcher thread acts on the byte in the wakeup pipe."""


@contextlib.contextmanager
def prompt_exit(on_idle: Callable[[str], str], on_busy: Callable[[str], str], on_again: Callable[[str], str],
                grace_s: float = 5.0) -> Iterator[None]:
    """While inside: a signal exits at once (printing `on_idle(name)`) unless another handler took
    over, in which case `on_busy(name)` is printed if it has not finished after `grace_s` and a
    second signal exits printing `on_again(name)`. Outside the main thread this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    err = os.dup(2)  # the terminal's stderr, even while a library import has fd 2 captured (diloco.noise)
    r, w = os.pipe()
    os.set_blocking(w, False)
    old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    old = {s: signal.signal(s, _ignore) for s in SIGNALS}
    done = threading.Event()

    def say_and_exit(line: str) -> None:
        try:
            sys.stdout.flush()
        finally:
            os.write(err, (line.rstrip("\n") + "\n").encode(errors="replace"))
            os._exit(EXIT_CODE)

    def watch() -> None:
        pending: str | None = None  # a signal the training loop is handling
        while not done.is_set():
            ready, _, _ = select.select([r], [], [], grace_s if pending else 0.5)
            if done.is_set():
                return
            if not ready:
                if pending:
                    os.write(err, (on_busy(pending).rstrip("\n") + "\n").encode(errors="replace"))
                    pending = ""  # said once; keep waiting for the loop or a second signal
                continue
            try:
                data = os.read(r, 64)
            except OSError:
                return
            for num in data:
                if num not in [int(s) for s in SIGNALS]:
                    continue
                name = signal.Signals(num).name
                if signal.getsignal(num) is _ignore:
                    say_and_exit(on_idle(name))
                elif pending is not None:
                    say_and_exit(on_again(name))
                else:
                    pending = name

    watcher = threading.Thread(target=watch, name="diloco-interrupt", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        os.write(w, b"\0")  # wake the watcher so it sees `done`
        for s, h in old.items():
            signal.signal(s, h)
        signal.set_wakeup_fd(old_fd)
        watcher.join(timeout=1.0)
        for fd in (w, r, err):
            os.close(fd)


def train_lines(workdir):
    """What to say when a signal arrives outside the loop's own handling (diloco/interrupt.py):
    (at start-up or after training, mid-step, on a second signal), from the checkpoints on disk."""
    from diloco.rundir import path

    ckpt = path(workdir) / "ckpt"

    def saved() -> set[int]:  # complete checkpoints: orbax renames a step's folder into place
        try:
            return {int(p.name) for p in ckpt.iterdir() if p.name.isdigit()}
        except Exception:  # no folder yet: OSError locally, the filesystem's own NotFound error on gs://
            return set()

    before = saved()

    def idle(sig: str) -> str:
        now = saved()
        if not now:
            return f"diloco train: {sig} during start-up; nothing saved"
        if now == before:
            return (f"diloco train: {sig} during start-up; nothing new saved; the checkpoint at step {max(now)} in "
                    f"{ckpt} is kept: run the same command to resume")
        return (f"diloco train: {sig} after training; the checkpoint at step {max(now)} is in {ckpt}: "
                "run the same command to write the summary")

    def busy(sig: str) -> str:
        return (f"diloco train: {sig}: finishing the current step (it may be compiling or evaluating), then "
                f"saving a checkpoint; send {sig} again to quit without it")

    def again(sig: str) -> str:
        now = saved()
        kept = f"the checkpoint at step {max(now)} in {ckpt} is kept" if now else "nothing saved"
        return f"diloco train: {sig} again; quit without saving: {kept}" + (": run the same command to resume" if now else "")

    return idle, busy, again
