"""A run compiles every program it executes before its first step (#32): after step 1 no fragment
program (step+send, send, update, merge of any layout) compiles — they all were compiled, side by
side, by diloco/precompile.py — and without the precompile the same run compiles them during its
first rounds (so the count can fail)."""
import json
import os
import subprocess
import sys

from conftest import REPO

SCRIPT = r"""
import json, re, sys, time
sys.path.insert(0, "tests")
from jax import monitoring
events = []
monitoring.register_event_duration_secs_listener(
    lambda ev, d, **kw: events.append((time.time(), kw.get("fun_name") or "")) if ev == "/jax/core/compile/backend_compile_duration" else None)
from conftest import tiny_config
from diloco import train as T
marks = {}
orig = T.Run.inner_step
def inner_step(self, t):
    out = orig(self, t)
    marks.setdefault(t, time.time())
    return out
T.Run.inner_step = inner_step
kw = dict(steps=9, H=4, tau=1, layers_per_fragment=1, exchange="in_step", log_every=3, eval_every=4,
          checkpoint_every=4, eval_batches=1, batch_size=4, **{"model.scan": True})
cfg = tiny_config("streaming", **{**kw, **json.loads(sys.argv[2])})
s = T.train(cfg, sys.argv[1], progress=False)
frag = re.compile(sys.argv[3])
print("COUNTS " + json.dumps({"before": sorted(n for t, n in events if t <= marks[1] and frag.match(n)),
                              "after": sorted(n for t, n in events if t > marks[1] and frag.match(n))}))
"""


FRAGMENT_PROGRAMS = r"^jit\((step_send|send|update|merge)_fragments?_"


def fragment_compiles(tmp_path, precompile: bool, overrides: dict | None = None,
                      programs: str = FRAGMENT_PROGRAMS) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", TF_CPP_MIN_LOG_LEVEL="3",
               DILOCO_PRECOMPILE="1" if precompile else "0")
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), json.dumps(overrides or {}), programs],
                       capture_output=True, text=True, cwd=REPO, env=env)
    line = next((l for l in r.stdout.splitlines() if l.startswith("COUNTS ")), None)
    assert r.returncode == 0 and line, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(line[len("COUNTS "):])


def test_nothing_compiles_after_the_first_step(tmp_path):
    # tiny, blocks under nn.scan, 3 fragments: layouts {0} and {1, 2}; in_step: step+send, send (the
    # settle at a checkpoint), update and merge (and their drained copies for evaluation) per layout
    pre = fragment_compiles(tmp_path / "pre", precompile=True)
    assert pre["after"] == []
    assert sorted(set(pre["before"])) == sorted(
        f"jit({k}_{g})" for k in ("step_send", "send", "update", "merge") for g in ("fragment_0", "fragments_1_2"))
    # compiled at first use instead: during the first rounds (step 4's checkpoint settles fragment 0's
    # send with the blocking program, so its step+send first runs only if a later send rides a step)
    lazy = fragment_compiles(tmp_path / "lazy", precompile=False)
    assert lazy["before"] == [] and len(set(lazy["after"])) >= 7 and set(lazy["after"]) <= set(pre["before"])


def test_an_eager_run_compiles_one_program_per_layout_before_the_first_step(tmp_path):
    """Eager updates (swap) under nn.scan, 3 fragments in layouts {0} and {1, 2}: like a plain run, one
    step+send (in_step) and one send (the settle at a checkpoint) per layout, compiled before step 1 and
    none after; no update or merge (the rule does its round in its send). Was one per fragment (6)."""
    got = fragment_compiles(tmp_path, precompile=True, overrides={"eager": "swap", "tau": 0})
    assert got["after"] == []
    assert sorted(set(got["before"])) == sorted(
        f"jit({k}_{g})" for k in ("step_send", "send") for g in ("fragment_0", "fragments_1_2"))
