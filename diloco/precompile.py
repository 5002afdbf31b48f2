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

import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


def run_programs(tr, state, tokens_RxBxL, eval_tokens_BxL=None) -> list[tuple[str, Any, tuple]]:
    """(name, jitted, first-call arguments) of every program a run of `tr` executes from `state`:
    `aot.run_programs` (the list `diloco compile` compiles) with the arguments built as the loop
    builds them (uncommitted keys, weights and masks; the state and batches as placed); nothing runs."""
    from diloco.compile.aot import run_programs as programs

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
    ("compiling 7/12 programs, 41 s"). Returns {"programs", "seconds_wall", "workers"}."""
    from diloco.compile.aot import compile_parallel, compile_workers

    todo = [t for t in todo if hasattr(t[1], "lower")]  # a wrapped, un-jitted callable compiles at its first call
    t0 = time.time()

    def one(name, lowered, _):
        lowered.compile()
        return name

    def progress(done, total, secs):
        msg = f"compiling {done}/{total} programs, {secs:.0f} s"
        if log is not None:
            log(msg)
        else:  # one line on stderr, rewritten in place, ended with the last program
            print(f"\rdiloco train: {msg}", end="\n" if done == total else "", file=sys.stderr, flush=True)

    compile_parallel(todo, one, workers, progress)
    wall = time.time() - t0
    return {"programs": len(todo), "seconds_wall": round(wall, 1), "workers": compile_workers(workers, len(todo))}

