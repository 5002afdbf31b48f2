"""Inner-step benchmark: the project's decoder vs a lean reference and vs an earlier commit, in ONE run.

    python benchmarks/bench_model.py [--scales toy,toy-l] [--base d1afa2a] [--rounds 7] [--steps 10]

Each variant is one jitted AdamW training step (value_and_grad of CE + z-loss, global-norm clip,
AdamW; what Trainer.inner_step does for DP with one replica) at the same shape and the same
parameters:
  ref      benchmarks/ref_decoder.py: the same math in plain jax.numpy (the lean baseline)
  now      diloco.model from this checkout (default ModelConfig; also every --attention listed)
  base     diloco/model/transformer.py as of --base (`git show`, imported from a temp dir)
The variants run interleaved: every round times --steps steps of each, in a rotating order, and the
reported time is the median over rounds, so machine noise hits all of them alike. Wall time and the
process's CPU time (all threads; steadier on a shared machine) are both reported. Ratios are
variant / ref and variant / base. The losses of the first step are printed too (they must agree).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]


def load_base(commit: str):
    """The transformer module as of `commit`, imported under a private name."""
    src = subprocess.run(["git", "-C", ROOT, "show", f"{commit}:diloco/model/transformer.py"],
                         capture_output=True, text=True, check=True).stdout
    path = os.path.join(tempfile.mkdtemp(prefix="diloco-base-"), "base_transformer.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("base_transformer", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["base_transformer"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def make_step(loss):
    import jax
    import optax

    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, b1=0.9, b2=0.95, weight_decay=0.1))

    def step(state, tokens):
        params, opt = state
        (l, ce), g = jax.value_and_grad(loss, has_aux=True)(params, tokens)
        up, opt = tx.update(g, opt, params)
        return (optax.apply_updates(params, up), opt), l

    return jax.jit(step, donate_argnums=(0,)), tx


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scales", default="toy,toy-l")
    ap.add_argument("--base", default="d1afa2a", help="commit whose model is the 'base' variant ('' to skip)")
    ap.add_argument("--attention", default="xla,dot_product", help="attention settings of 'now' to time")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10, help="steps per variant per round")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq_len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=384, help="259 bytes padded to 128 as the Trainer does")
    a = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    import ref_decoder
    from diloco.model import ModelConfig, Transformer, loss_fn

    base = load_base(a.base) if a.base else None
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; batch {a.batch}x{a.seq_len}, vocab {a.vocab}; "
          f"median of {a.rounds} interleaved rounds x {a.steps} steps")
    print(f"{'':<25} {'---------- wall ----------':>26} {'------- CPU (all threads) -------':>26}")
    print(f"{'scale':<6} {'variant':<18} {'ms/step':>8} {'vs ref':>7} {'vs base':>8} {'ms/step':>8} {'vs ref':>7} "
          f"{'vs base':>8} {'first loss':>11}")
    for scale in a.scales.split(","):
        mcfg = ModelConfig.from_scale(scale, vocab_size=a.vocab)
        x = jnp.asarray(np.random.default_rng(0).integers(1, 259, size=(a.batch, a.seq_len)), jnp.int32)
        params = Transformer(mcfg).init(jax.random.PRNGKey(0), x[:1, :8])["params"]
        variants = {"ref": lambda p, t: ref_decoder.loss(p, t, mcfg.heads, 1e-4)}
        for att in a.attention.split(","):
            model = Transformer(dataclasses.replace(mcfg, attention=att))
            variants[f"now[{att}]"] = (lambda m: lambda p, t: (lambda r: (r[0], r[1]["ce"]))(
                loss_fn(m.apply({"params": p}, t), t, 1e-4)))(model)
        if base is not None:
            fields = {f.name for f in dataclasses.fields(base.ModelConfig)}
            bmodel = base.Transformer(base.ModelConfig(**{k: v for k, v in dataclasses.asdict(mcfg).items() if k in fields}))
            variants[f"base[{a.base}]"] = lambda p, t: (lambda r: (r[0], r[1]["ce"]))(
                base.loss_fn(bmodel.apply({"params": p}, t), t, 1e-4))
        runs = {}
        for name, loss in variants.items():
            step, tx = make_step(loss)
            p = jax.tree_util.tree_map(jnp.array, params)
            state = (p, tx.init(p))
            state, l0 = step(state, x)
            runs[name] = [step, state, float(l0), [], []]
        names = list(runs)
        for r in range(a.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                step, state = runs[name][:2]
                jax.block_until_ready(state)
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(a.steps):
                    state, l = step(state, x)
                jax.block_until_ready(state)
                runs[name][3].append((time.perf_counter() - t0) / a.steps)
                runs[name][4].append((time.process_time() - c0) / a.steps)
                runs[name][1] = state
        med = {n: statistics.median(v[3]) for n, v in runs.items()}
        cpu = {n: statistics.median(v[4]) for n, v in runs.items()}
        bname = f"base[{a.base}]"
        for n in names:
            vs_base = f"{med[n] / med[bname]:>7.2f}x" if bname in med else ""
            cvs_base = f"{cpu[n] / cpu[bname]:>7.2f}x" if bname in cpu else ""
            print(f"{scale:<6} {n:<18} {1e3 * med[n]:>8.1f} {med[n] / med['ref']:>6.2f}x {vs_base:>8} "
                  f"{1e3 * cpu[n]:>8.1f} {cpu[n] / cpu['ref']:>6.2f}x {cvs_base:>8} {runs[n][2]:>11.7f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
