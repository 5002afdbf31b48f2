"""Compile a run's programs before its first step, side by side (`precompile`).

JAX compiles a jitted program at its first call, so without this a Streaming run compiles its inner
step at step 1, then each fragment layout's exchange, outer update and merge at their first use
during the first rounds, one after another, while the chips wait. Here every program the run will
execute (`run_programs`: the inner step, per fragment layout its step+send / send / update / merge and
the drained evaluation's copies, the evaluation) is lowered on this thread, in order, and compiled on
a thread pool (XLA compiles outside the GIL), with the arguments its first call will have: a call
then finds the executable in JAX's in-memory cache (a lowering from abstract arguments would not be
the same cache entry, tests/test_precompile.py). The compilation cache (`jax_compilation_cache_dir`)
keeps working: a second run of the same shapes loads instead of compiling.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from diloco.devmem import program_peak


def programs(tr, state, batch, key, contrib, mask, eval_args=None, inner=None) -> list[tuple]:
    """Every program a run of `tr` executes, as (name, program, arguments of its first call), in the
    order they are compiled: `inner`, the outer driver's fragment programs (`OuterDriver.run_programs`:
    per fragment layout step+send / send / local / land / update / merge and the drained evaluation's
    undonated copies, for every send rule), then `eval`. The one
    enumeration behind `diloco compile` (abstract arguments, `trainer_programs`) and the run's own
    compile before step 1 (its real arguments, `run_programs`). A fragment program has
    `.jitted`, `.args(state, …)` and `.lower(state, …)`."""
    todo = [("inner", tr.inner_step() if inner is None else inner, (state, batch))]
    if tr.driver is not None:
        values = {"state": state, "batch": batch, "key": key, "contrib": contrib, "mask": mask}
        for name, prog, names, p in tr.driver.run_programs(tr.inner_step(jitted=False)):
            # `pending`: an (n_p,) f32 shaped and placed like fragment p's pending slot (an exchanged average)
            todo.append((name, prog, tuple(state.outer.pending[p] if n == "pending" else values[n] for n in names)))
    if eval_args is not None:
        todo.append(("eval", tr.eval_fn(), eval_args))
    return todo


def run_programs(tr, state, tokens_RxBxL, eval_tokens_BxL=None) -> list[tuple[str, Any, tuple]]:
    """(name, jitted, first-call arguments) of every program a run of `tr` executes from `state`:
    `programs` (the list `diloco compile` compiles too) with the arguments built as the loop
    builds them (uncommitted keys, weights and masks; the state and batches as placed); nothing runs."""
    key = tr.driver.key(1, 0) if tr.driver is not None else None
    contrib = jnp.asarray(np.ones(tr.R, np.float32))
    mask = jnp.asarray(np.ones(tr.R, bool))
    evals = (tr.eval_params(state), eval_tokens_BxL) if eval_tokens_BxL is not None else None
    todo = programs(tr, state, tokens_RxBxL, key, contrib, mask, evals)
    return [(name, prog.jitted, prog.args(*args)) if hasattr(prog, "jitted") else (name, prog, args)
            for name, prog, args in todo]


def precompile(todo: list[tuple[str, Any, tuple]], workers: int | None = None,
               log: Callable[[str], None] | None = None) -> dict:
    """Lower every program of `todo` and compile them on a thread pool; one progress line, rewritten
    ("compiling 7/12 programs, 41 s"). Returns {"programs", "seconds_wall", "workers", "peak_bytes": {name: bytes
    a program holds at once on one device}} (diloco/devmem.py: the GPU memory preflight)."""
    todo = [t for t in todo if hasattr(t[1], "lower")]  # a wrapped, un-jitted callable compiles at its first call
    t0 = time.time()

    def one(name, lowered, _):
        return name, program_peak(lowered.compile())

    def progress(done, total, secs):
        msg = f"compiling {done}/{total} programs, {secs:.0f} s"
        if log is not None:
            log(msg)
        else:  # one line on stderr, rewritten in place, ended with the last program
            print(f"\rdiloco train: {msg}", end="\n" if done == total else "", file=sys.stderr, flush=True)

    peaks = dict(compile_parallel(todo, one, workers, progress))
    wall = time.time() - t0
    return {"programs": len(todo), "seconds_wall": round(wall, 1), "workers": compile_workers(workers, len(todo)),
            "peak_bytes": peaks}


def compile_workers(workers: int | None, n: int) -> int:
    """Threads compiling at once: `workers`, else $DILOCO_COMPILE_WORKERS, else this machine's cores."""
    w = workers or int(os.environ.get("DILOCO_COMPILE_WORKERS", "0") or 0) or os.cpu_count() or 1
    return max(1, min(w, n))


def compile_parallel(todo: list[tuple], compile_fn, workers: int | None = None, log=None) -> list:
    """`compile_fn(name, lowered, ())` for every program of `todo` = [(name, jitted, args)], lowered here
    in order, compiled on a thread pool (XLA compiles outside the GIL); results in `todo`'s order;
    `log(done, total, seconds)` after each one finishes."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    if not todo:
        return []
    t0 = time.time()
    # Tracing and lowering are Python (one at a time, in order: flax and JAX trace state stay on this
    # thread); XLA's compiles, the long part, run side by side.
    lowered = [(name, fn.lower(*args), ()) for name, fn, args in todo]
    with ThreadPoolExecutor(compile_workers(workers, len(todo)), thread_name_prefix="diloco-compile") as pool:
        futs = {pool.submit(compile_fn, *t): i for i, t in enumerate(lowered)}
        out: list = [None] * len(todo)
        for done, f in enumerate(as_completed(futs), 1):
            out[futs[f]] = f.result()
            if log:
                log(done, len(todo), time.time() - t0)
    return out
