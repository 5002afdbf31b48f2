"""One loop for Data-Parallel, DiLoCo and Streaming DiLoCo.

State (one pytree, checkpointed whole):
  params, opt   replica-stacked (leading axis R; R = 1 for DP), on the `replica` mesh axis
  outer         DiLoCo family only: outer params θ^g, per-fragment Nesterov state, in-flight Δ
  step          inner steps done
Every inner step is one jitted, vmapped AdamW step per replica; syncs are separate jitted
functions per fragment, called as the pure schedule says. Evaluation uses θ^g.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from diloco.errors import ConfigError


class NumericalFault(RuntimeError):
    pass


def model_config(cfg, vocab_size: int):
    from diloco.model import ModelConfig

    return ModelConfig.from_scale(cfg.scale, vocab_size=vocab_size, dtype=cfg.model.dtype,
                                  remat=cfg.model.remat, scan=cfg.model.scan)


def padded_vocab_size(n: int) -> int:
    return int(math.ceil(n / 128) * 128)


def abstract_params(cfg):
    """Parameter shapes of a config, without allocating (for `diloco fragments`)."""
    import jax
    import jax.numpy as jnp

    from diloco.data import get_vocabulary
    from diloco.model import Transformer

    mcfg = model_config(cfg, padded_vocab_size(get_vocabulary(cfg.vocab).vocab_size))
    return jax.eval_shape(lambda: Transformer(mcfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))["params"]


def inner_optimizer(cfg):
    import optax

    o = cfg.optimizer
    sched = optax.warmup_cosine_decay_schedule(0.0, o.lr, max(1, o.warmup_steps), max(cfg.steps, o.warmup_steps + 1),
                                               end_value=o.min_lr_ratio * o.lr)
    tx = optax.chain(optax.clip_by_global_norm(o.clip_norm),
                     optax.adamw(sched, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay))
    return tx, sched


class Trainer:
    """Owns the state; the loop only wires model, data, schedule and syncs together."""

    def __init__(self, cfg, workdir: str | os.PathLike, need_data: bool = True, devices=None, comm_devices=None,
                 timeline=None):
        import jax
        import jax.numpy as jnp
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

        from diloco.config import replica_axis_size
        from diloco.data import get_vocabulary
        from diloco.model import Transformer, loss_fn

        self.cfg, self.workdir = cfg, Path(workdir)
        self.jax, self.jnp = jax, jnp
        self.is_dp = cfg.method == "dp"
        self.R = 1 if self.is_dp else cfg.replicas
        devices = list(devices if devices is not None else jax.devices())
        r_axis = replica_axis_size(cfg, len(devices))
        self.mesh = Mesh(np.array(devices).reshape(r_axis, len(devices) // r_axis), ("replica", "data"))
        self.rep_sharding = NamedSharding(self.mesh, P("replica"))
        self.repl_sharding = NamedSharding(self.mesh, P())
        self.batch_sharding = NamedSharding(self.mesh, P("replica", "data"))
        self.vocab = get_vocabulary(cfg.vocab)
        self.mcfg = model_config(cfg, padded_vocab_size(self.vocab.vocab_size))
        self.model = Transformer(self.mcfg)
        self.tx, self.lr_schedule = inner_optimizer(cfg)
        self._loss_fn = loss_fn
        self.need_data = need_data
        init_params = jax.eval_shape(self._init_params)
        self.n_params = sum(int(x.size) for x in jax.tree_util.tree_leaves(init_params))
        self.sync = None
        self.schedule = None
        if not self.is_dp:
            from diloco.config import _keep
            from diloco.outer.codecs import make_codec
            from diloco.outer.fragments import make_fragments
            from diloco.outer.schedule import make_schedule
            from diloco.outer.sync import OuterSync, outer_optimizer

            frags = make_fragments(init_params, self.mcfg.layers, cfg.layers_per_fragment, cfg.fragments,
                                   cfg.pattern, cfg.embed_fragment)
            codec = make_codec(cfg.codec, cfg.codec_block_size, cfg.codec_rounding, **_keep(cfg))
            mesh = self.mesh if self.mesh.shape["replica"] > 1 else None
            self.sync = OuterSync(frags, codec, outer_optimizer(cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov),
                                  cfg.alpha, mesh)
            self.schedule = make_schedule(cfg.H, frags.P, cfg.tau, cfg.replicas, cfg.replica_tau)
        # Multi-process with a comm device per process: exchanges run there, overlapping the inner
        # steps, and are waited for only at their apply (diloco/outer/overlap.py).
        self.overlap = None
        if self.sync is not None and comm_devices:
            from diloco.outer.overlap import OverlappedExchange

            try:
                self.overlap = OverlappedExchange(self.sync, self.mesh, comm_devices, timeline)
            except ValueError as why:  # this mesh cannot use the comm devices: blocking sends
                print(f"diloco train: exchanges will not overlap the inner steps: {why}", file=sys.stderr)
        self._jit_cache: dict[Any, Any] = {}

    # -- state --------------------------------------------------------------------------------------
    def _init_params(self):
        jax, jnp = self.jax, self.jnp
        return self.model.init(jax.random.PRNGKey(self.cfg.seed), jnp.zeros((1, 8), jnp.int32))["params"]

    def init_state(self):
        jax, jnp = self.jax, self.jnp
        params = self._init_params()
        params_R = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (self.R,) + x.shape), params)
        state = {"params": params_R, "opt": jax.vmap(self.tx.init)(params_R), "step": jnp.zeros((), jnp.int32)}
        if self.sync is not None:
            state["outer"] = self.sync.init(params)
        return state

    def shardings(self, state):
        jax = self.jax
        out = {k: jax.tree_util.tree_map(lambda _: self.rep_sharding, state[k]) for k in ("params", "opt")}
        out["step"] = self.repl_sharding
        if "outer" in state:
            out["outer"] = jax.tree_util.tree_map(lambda _: self.repl_sharding, state["outer"])
        return out

    def abstract_state(self):
        jax = self.jax
        shapes = jax.eval_shape(self.init_state)
        return jax.tree_util.tree_map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                      shapes, self.shardings(shapes))

    def fresh_state(self):
        jax = self.jax
        shapes = jax.eval_shape(self.init_state)
        return jax.jit(self.init_state, out_shardings=self.shardings(shapes))()

    def eval_params(self, state):
        """θ^g for the DiLoCo family, the (only) replica for DP."""
        if "outer" in state:
            return state["outer"]["params"]
        return self.jax.tree_util.tree_map(lambda x: x[0], state["params"])

    def restore_or_init(self, restore_only: bool = False):
        from diloco.checkpoint import Checkpointer

        ck = Checkpointer(self.workdir, self.cfg.keep_checkpoints)
        got = ck.restore(self.abstract_state())
        ck.close()
        if got is None:
            if restore_only:
                raise FileNotFoundError(f"no readable checkpoint under {self.workdir / 'ckpt'}")
            return 0, self.fresh_state()
        step, state, meta = got
        self.restored_meta = meta
        return step, state

    # -- jitted pieces ------------------------------------------------------------------------------
    def _loss(self, params, tokens_BxL):
        logits = self.model.apply({"params": params}, tokens_BxL)
        return self._loss_fn(logits, tokens_BxL, self.cfg.model.z_loss)

    def inner_step_fn(self, active: int | None = None):
        """(state, tokens_RxBxL[, poison_R]) → (state, ce_R, finite_R): one AdamW step per replica.

        `poison_R` (fault injection only) multiplies each replica's loss: 1, nan or inf.

        `active=p` trains only fragment p (the FedPart-style frozen-fragment baseline)."""
        if ("inner", active) in self._jit_cache:
            return self._jit_cache[("inner", active)]
        jax, jnp = self.jax, self.jnp
        import optax

        mask = None
        if active is not None:
            mask = self.sync.frags.mask_tree(jax.eval_shape(self._init_params), active)

        def grad(params, tokens, *poison):
            lossf = self._loss if not poison else (
                lambda p, x: jax.tree_util.tree_map(lambda v: v * poison[0], self._loss(p, x)))
            (loss, aux), grads = jax.value_and_grad(lossf, has_aux=True)(params, tokens)
            return loss, aux, grads

        def one(params, opt, tokens, *poison):
            loss, aux, grads = grad(params, tokens, *poison)
            return update(params, opt, loss, aux["ce"], grads)

        def update(params, opt, loss, ce, grads):
            updates, opt2 = self.tx.update(grads, opt, params)
            if mask is not None:
                updates = jax.tree_util.tree_map(lambda u, m: jnp.where(m, u, 0), updates, mask)
            finite = jnp.isfinite(loss) & jnp.isfinite(optax.global_norm(grads))
            return optax.apply_updates(params, updates), opt2, ce, finite

        flat_reduce = self.mesh.shape["data"] > 1
        if flat_reduce:
            # Gradients averaged over the `data` axis as ONE flat vector (token-weighted, so the
            # masked mean is exact): GSPMD would all-reduce a tuple of every parameter's gradient,
            # and XLA:CPU's gloo collectives pay a fixed cost per operand (54 arrays: 24 ms vs
            # 0.8 ms as one, docs/distributed.md).
            from jax.flatten_util import ravel_pytree
            from jax.sharding import PartitionSpec as P

            _, unravel = ravel_pytree(jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype),
                                                             jax.eval_shape(self._init_params)))

            def local(params_r, tokens_r, *poison_r):
                def g1(params, tokens, *pz):
                    loss, aux, grads = grad(params, tokens, *pz)
                    w = aux["tokens"]
                    return jnp.concatenate([ravel_pytree(grads)[0] * w, jnp.stack([loss * w, aux["ce"] * w, w])])
                tot = jax.lax.psum(jax.vmap(g1)(params_r, tokens_r, *poison_r), "data")
                return tot[:, :-3] / jnp.maximum(tot[:, -1:], 1.0), tot[:, -3:-1] / jnp.maximum(tot[:, -1:], 1.0)

            def grads_R(params_R, tokens_RxBxL, *poison_R):
                specs = (P("replica"), P("replica", "data")) + (P("replica"),) * len(poison_R)
                flat, lc = jax.shard_map(local, mesh=self.mesh, in_specs=specs, out_specs=(P("replica"), P("replica")),
                                         check_vma=False)(params_R, tokens_RxBxL, *poison_R)
                return lc[:, 0], lc[:, 1], jax.vmap(unravel)(flat)

        def step(state, tokens_RxBxL, *poison_R):
            if flat_reduce:
                loss_R, ce_R, g_R = grads_R(state["params"], tokens_RxBxL, *poison_R)
                p, o, ce_R, fin_R = jax.vmap(update)(state["params"], state["opt"], loss_R, ce_R, g_R)
            else:
                p, o, ce_R, fin_R = jax.vmap(one)(state["params"], state["opt"], tokens_RxBxL, *poison_R)
            # Each replica keeps its own update only if its own step was finite: a local decision,
            # so no cross-replica collective sits in the inner step (replicas are independent
            # between syncs; the loop stops or logs the skip from fin_R).
            def keep(new, old):
                def pick(a, b):
                    ok = fin_R.reshape((-1,) + (1,) * (a.ndim - 1))
                    return jnp.where(ok, a, b)
                return jax.tree_util.tree_map(pick, new, old)
            new = {**state, "params": keep(p, state["params"]), "opt": keep(o, state["opt"]),
                   "step": state["step"] + 1}
            return new, ce_R, fin_R

        fn = jax.jit(step, donate_argnums=(0,))
        self._jit_cache[("inner", active)] = fn
        return fn

    def eval_fn(self):
        if "eval" not in self._jit_cache:
            self._jit_cache["eval"] = self.jax.jit(lambda params, toks: self._loss(params, toks)[1]["ce"])
        return self._jit_cache["eval"]

    def _sync_fn(self, kind: str, p: int):
        key = (kind, p)
        if key in self._jit_cache:
            return self._jit_cache[key]
        jax, sync = self.jax, self.sync
        if kind == "send":
            def f(state, key, contrib_R):
                return {**state, "outer": sync.send(state["params"], state["outer"], p, key, contrib_R)}
        elif kind == "update":
            def f(state):
                return {**state, "outer": sync.update(state["outer"], p)}
        else:
            def f(state, mask_R):
                return {**state, "params": sync.merge(state["params"], state["outer"], p, mask_R)}
        fn = jax.jit(f, donate_argnums=(0,))
        self._jit_cache[key] = fn
        return fn

    def run_syncs(self, state, t: int, key=None, contrib=None, check=None) -> tuple[Any, list[tuple[int, int]]]:
        """Everything the schedule says happens after inner step t. Returns (state, [(p, bytes)]).

        `check(state, p, t_send, finite_R)` is called once fragment p's averaged outer gradient is in
        `outer["pending"][p]`: right after the send, or at its apply when the exchange overlaps
        (`finite_R`: which replicas held only finite values at the send, for the error message)."""
        jax, jnp = self.jax, self.jnp
        sent = []
        if self.schedule is None:
            return state, sent
        base = key if key is not None else jax.random.PRNGKey(self.cfg.seed + 1)
        sends = self.schedule.sends(t)
        finite_R = _replica_finite(state["params"]) if sends and check else None  # culprit, pre-merge
        for p in sends:
            c = np.ones(self.R, np.float32) if contrib is None else np.asarray(contrib(t, p), np.float32)
            k = jax.random.fold_in(jax.random.fold_in(base, t), p)
            if self.overlap is not None:
                self.overlap.send(state, p, k, jnp.asarray(c), t, finite_R)
            else:
                state = self._sync_fn("send", p)(state, k, jnp.asarray(c))
                if check:
                    check(state, p, t, finite_R)
            sent.append((p, int(self.sync.bytes_per_replica(p) * (c > 0).sum())))
        for p in self.schedule.outer_updates(t):
            if self.overlap is not None:
                state, rec = self.overlap.land(state, p, t)
                if rec is not None and check:
                    check(state, p, rec.step, rec.finite_R)
            state = self._sync_fn("update", p)(state)
        for p, mask in self.schedule.merges(t):
            state = self._sync_fn("merge", p)(state, jnp.asarray(mask))
        return state, sent

    def settle(self, state, check=None):
        """Land every exchange still in flight (before a checkpoint or the end of the run)."""
        if self.overlap is None:
            return state
        state, landed = self.overlap.land_all(state)
        for p, rec in landed:
            if check:
                check(state, p, rec.step, rec.finite_R)
        return state

    def dp_bytes_per_replica(self) -> int:
        return self.n_params * np.dtype(self.jnp.dtype(self.cfg.dp_grad_dtype)).itemsize


# ---------------------------------------------------------------------------------------------------
def train(cfg, workdir: str | os.PathLike, progress: bool = True, stop_after: int | None = None) -> dict:
    """Run (or resume) one training run; returns the summary.

    `stop_after=k` behaves as if SIGTERM arrived during step k (tests of the preemption path)."""
    import jax

    from diloco.checkpoint import Checkpointer, atomic_write_json, atomic_write_text
    from diloco.config import to_json, validate
    from diloco.data import TokenBatches, corpus_info, eval_batches
    from diloco.outer.sync import params_sha256
    from diloco import distributed as dist

    dist.initialize_from_env()  # multi-process (diloco launch): before any other JAX use
    primary = dist.is_primary()
    validate(cfg, check_data=True, num_devices=len(dist.compute_devices() or jax.devices()))
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    cfg_json = to_json(cfg)
    old = workdir / "config.json"
    if old.exists() and json.loads(old.read_text()) != json.loads(cfg_json):
        raise ConfigError("workdir", f"{workdir} holds a run with a different config; use a new --workdir "
                          "or delete it (diff the two config.json files to see what changed)")
    if primary:
        atomic_write_text(old, cfg_json)

    timeline = None
    if dist.num_processes() > 1 or os.environ.get("DILOCO_TIMELINE") == "1":  # steps, exchanges, waits
        from diloco.outer.overlap import Timeline

        timeline = Timeline(workdir / "timeline" / f"rank{jax.process_index()}.jsonl", jax.process_index(),
                            resume=True)
    tr = Trainer(cfg, workdir, devices=dist.compute_devices(), comm_devices=dist.comm_devices(), timeline=timeline)
    ck = Checkpointer(workdir, cfg.keep_checkpoints)
    got = ck.restore(tr.abstract_state(), quarantine=True)
    data = TokenBatches(cfg.data, cfg.vocab, cfg.seq_len, cfg.batch_size, split="train", seed=cfg.seed,
                        data_dir=cfg.data_dir or None)
    counters = {"bytes_exchanged": 0, "bytes_peak_per_sync": 0, "bytes_per_fragment": {}, "syncs": 0,
                "wall_seconds": 0.0, "skipped_batches": 0}
    if got is None:
        start, state = 0, tr.fresh_state()
    else:
        start, state, meta = got
        data.set_state(meta["data"])
        counters.update(meta["counters"])
        print(f"resumed {workdir} at step {start}", file=sys.stderr)
    metrics_path = workdir / "metrics.jsonl"
    if primary:
        _truncate_metrics(metrics_path, start)
        _truncate_metrics(workdir / "downstream.jsonl", start)
    evals = [dist.global_array(np.asarray(b), tr.repl_sharding) for b in eval_batches(cfg.data, cfg.vocab, cfg.seq_len, cfg.batch_size // tr.R * tr.R,
                                                   cfg.eval_batches, data_dir=cfg.data_dir or None)]
    tb = _tb_writer(workdir) if primary else None
    inner = tr.inner_step_fn()
    ev = tr.eval_fn()
    stop = {"signal": None}

    def on_signal(signum, _):
        stop["signal"] = signal.Signals(signum).name

    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

    def eval_loss(st) -> float:
        params = tr.eval_params(st)
        return float(np.mean([float(ev(params, b)) for b in evals]))

    def check(st, p, t_send, finite_R):
        _check_pending_finite(st, p, t_send, max(ck.steps(), default=0), finite_R)

    window: list[tuple[int, Any, Any]] = []  # (t, ce_R, finite_R) on device, since the last flush

    multi = dist.num_processes() > 1

    def flush(agree: bool = False) -> bool:
        """Fold the window's per-replica losses into `losses` (one gather across processes).

        With `agree` (log rows, which every process reaches at the same step) the processes also
        share whether any of them got a stop signal; returns True if one did."""
        rows, any_stop = _gather_window(window, tr, bool(stop["signal"]) if agree else None)
        for t_, ce, fin in rows:
            if fin.all():
                losses.append(float(ce.mean()))
                continue
            bad = [m for m, f in enumerate(fin) if not f]
            if faults.nan_policy != "skip":
                raise NumericalFault(f"step {t_}: non-finite loss or gradient on replica(s) {bad} "
                                     f"(loss {ce.tolist()}); the run stopped and the last good checkpoint "
                                     f"(step {max(ck.steps(), default=0)}) is kept. Lower optimizer.lr or set "
                                     "--config.faults.nan_policy=skip to skip bad batches.")
            counters["skipped_batches"] += 1
            print(f"step {t_}: non-finite loss/gradient on replica(s) {bad}; batch skipped "
                  "(faults.nan_policy=skip)", file=sys.stderr)
        window.clear()
        return any_stop

    def save(step, st):
        flush()
        st = tr.settle(st, check)
        ck.save(step, st, {"data": data.get_state(), "counters": counters, "step": step,
                           "pending_losses": losses})
        return st

    tokens_per_step = cfg.batch_size * cfg.seq_len
    t0 = time.time() - counters["wall_seconds"]
    losses: list[float] = list(got[2].get("pending_losses", [])) if got else []  # since the last metrics row
    last_log_time, last_log_step = time.time(), start
    bar = _progress(start, cfg.steps, progress)
    shown_eval = None  # the bar shows an eval loss once there is one
    faults = cfg.faults
    contrib = _fault_contrib(cfg) if tr.sync is not None else None
    try:
        for t in range(start + 1, cfg.steps + 1):
            tokens = next(data)
            tokens_RxBxL = dist.global_array(tokens.reshape(tr.R, -1, tokens.shape[-1]), tr.batch_sharding)
            if cfg.freeze_non_syncing and tr.schedule is not None:
                inner = tr.inner_step_fn(active=tr.schedule.next_sender(t))
            t_start = time.perf_counter()
            state, ce_R, fin_R = inner(state, tokens_RxBxL, *_fault_poison(cfg, tr.R, t, "loss"))
            # This process's replicas only (no collective per step: it would queue behind an exchange
            # in flight); the whole window is gathered at the next log row or checkpoint.
            fin_local = dist.local_rows(fin_R)
            if timeline is not None:
                timeline.add("step", step=t, start=round(t_start - timeline.t0, 6),
                             end=round(time.perf_counter() - timeline.t0, 6))
            window.append((t, ce_R, fin_R))
            if faults.nan_policy != "skip" and not all(fin_local.values()):
                flush()  # raises with every replica's loss
            log_due = t % cfg.log_every == 0 or t % cfg.eval_every == 0 or t == cfg.steps
            peer_stop = False
            if log_due:  # gather the losses before this step's sends: behind a fragment in flight it would wait
                peer_stop = flush(agree=multi)
            if tr.sync is not None:
                if faults.restart_replica >= 0 and t == faults.restart_step:
                    state = _restart_replica(tr, state, faults.restart_replica)
                for v in _fault_poison(cfg, tr.R, t, "outer"):  # replica's params go bad before the send
                    state = {**state, "params": jax.tree_util.tree_map(
                        lambda x: x * v.reshape((-1,) + (1,) * (x.ndim - 1)).astype(x.dtype), state["params"])}
                t_sync = time.perf_counter()
                state, sent = tr.run_syncs(state, t, contrib=contrib, check=check)
                if timeline is not None and (sent or tr.schedule.outer_updates(t)):
                    timeline.add("syncs", step=t, start=round(t_sync - timeline.t0, 6), sent=[p for p, _ in sent])
                for p, nb in sent:
                    counters["bytes_exchanged"] += nb
                    counters["syncs"] += 1
                    key = str(p)
                    counters["bytes_per_fragment"][key] = counters["bytes_per_fragment"].get(key, 0) + nb
                    counters["bytes_peak_per_sync"] = max(counters["bytes_peak_per_sync"],
                                                          tr.sync.bytes_per_replica(p))
            else:
                nb = tr.dp_bytes_per_replica()
                counters["bytes_exchanged"] += nb * cfg.replicas
                counters["bytes_peak_per_sync"] = nb
                counters["syncs"] += 1
            counters["wall_seconds"] = time.time() - t0
            bar.update(1)
            row = None
            if log_due:
                now = time.time()
                tok_s = (t - last_log_step) * tokens_per_step / max(now - last_log_time, 1e-9)
                last_log_time, last_log_step = now, t
                row = {"step": t, "tokens": t * tokens_per_step,
                       "train_loss": float(np.mean(losses)) if losses else None,
                       "lr": float(tr.lr_schedule(t)), "bytes_exchanged": counters["bytes_exchanged"],
                       "seconds": round(counters["wall_seconds"], 3), "tokens_per_s": round(tok_s, 1)}
                losses = []
                if t % cfg.eval_every == 0 or t == cfg.steps:
                    row["eval_loss"] = eval_loss(state)
                if primary:
                    _append_metrics(metrics_path, row)
                _tb_log(tb, row)
                shown_eval = f"{row['eval_loss']:.3f}" if "eval_loss" in row else shown_eval  # none until the first
                bar.set_postfix(loss=f"{row['train_loss'] or float('nan'):.3f}", tok_s=f"{tok_s:,.0f}",
                                **({"eval": shown_eval} if shown_eval else {}))
            if _downstream_due(cfg, t):
                _run_downstream(tr, state, workdir, cfg, write=primary)
            if t % cfg.checkpoint_every == 0 and t != cfg.steps:
                state = save(t, state)
            if stop_after is not None and t == stop_after:
                stop["signal"] = "SIGTERM"
            # One process alone cannot stop: the others would wait in the next collective (and orbax
            # saves together). Processes agree at the next log row, which all of them reach.
            stopping = (stop["signal"] or "a stop signal to another process") if peer_stop else None
            if stopping if multi else stop["signal"]:
                stop["signal"] = stop["signal"] or stopping
                if t not in ck.steps():  # a checkpoint step already saved this state
                    state = save(t, state)
                bar.close()
                raise KeyboardInterrupt(f"{stop['signal']}: saved a checkpoint at step {t} in {workdir / 'ckpt'}; "
                                        "run the same command to resume")
        bar.close()
        if not ck.steps() or max(ck.steps()) != cfg.steps:
            state = save(cfg.steps, state)
    finally:
        for s, h in old_handlers.items():
            signal.signal(s, h)
        ck.close()
        if tb is not None:
            tb.close()
        if timeline is not None:
            timeline.close()

    params = tr.eval_params(state)
    summary = _summary_base(workdir)
    final_eval = eval_loss(state)
    summary.update({
        "method": cfg.method, "scale": cfg.scale, "steps": cfg.steps, "tokens": cfg.steps * tokens_per_step,
        "final_eval_loss": final_eval, "bytes_exchanged_total": counters["bytes_exchanged"],
        "bytes_peak_per_sync": counters["bytes_peak_per_sync"], "bytes_per_fragment": counters["bytes_per_fragment"],
        "syncs": counters["syncs"], "params": tr.n_params, "params_sha256": params_sha256(params),
        "wall_seconds": round(counters["wall_seconds"], 3), "skipped_batches": counters["skipped_batches"],
        "replicas": cfg.replicas, "H": cfg.H if tr.sync else None,
        "fragments": tr.sync.frags.P if tr.sync else None, "pattern": cfg.pattern if tr.sync else None,
        "tau": cfg.replica_tau or cfg.tau if tr.sync else None, "alpha": cfg.alpha if tr.sync else None,
        "codec": cfg.codec if tr.sync else None,
        "fragment_sizes": list(tr.sync.frags.sizes) if tr.sync else None,
        "corpus": corpus_info(cfg.data, cfg.data_dir or None),
        "versions": _versions(),
    })
    if cfg.downstream.tasks:
        summary["downstream"] = _run_downstream(tr, state, workdir, cfg, write=False)
    if primary:
        atomic_write_json(workdir / "summary.json", summary)
    return summary


def _summary_base(workdir: Path) -> dict:
    p = workdir / "summary.json"
    return json.loads(p.read_text()) if p.exists() else {}


def _versions() -> dict:
    import flax
    import jax
    import optax

    from diloco import __version__

    return {"python": platform.python_version(), "jax": jax.__version__, "flax": flax.__version__,
            "optax": optax.__version__, "diloco": __version__, "backend": jax.default_backend(),
            "devices": jax.device_count()}


def _truncate_metrics(path: Path, step: int) -> None:
    """On resume, drop rows logged after the checkpoint (they will be logged again)."""
    if not path.exists():
        return
    from diloco.checkpoint import atomic_write_text

    rows = [l for l in path.read_text().splitlines() if l.strip()]
    keep = []
    for l in rows:
        try:
            if json.loads(l)["step"] <= step:
                keep.append(l)
        except (json.JSONDecodeError, KeyError):
            break  # a torn last line from a crash
    atomic_write_text(path, "".join(k + "\n" for k in keep))


def _append_metrics(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _tb_writer(workdir: Path):
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(workdir / "tb"))


def _tb_log(tb, row: dict) -> None:
    if tb is None:
        return
    for k, v in row.items():
        if k != "step" and isinstance(v, (int, float)):
            tb.add_scalar(k, v, row["step"])


def _progress(start: int, total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, disable=not enabled, unit="step", dynamic_ncols=True,
                mininterval=1.0)


def _fault_contrib(cfg):
    f = cfg.faults
    if f.miss_sync_replica < 0:
        return None

    def contrib(t: int, p: int):
        c = np.ones(cfg.replicas, np.float32)
        if f.miss_sync_step and f.miss_sync_step <= t < f.miss_sync_step + cfg.H:
            c[f.miss_sync_replica] = 0.0
        return c

    return contrib


def _fault_poison(cfg, R: int, t: int, target: str) -> tuple:
    """faults.nan_step: () on other steps, else a per-replica multiplier (1, or nan/inf for nan_replica)."""
    f = cfg.faults
    if f.nan_step != t or f.nan_target != target:
        return ()
    s = np.ones(R, np.float32)
    s[f.nan_replica] = np.nan if f.nan_value == "nan" else np.inf
    print(f"step {t}: injecting {f.nan_value} into replica {f.nan_replica}'s {target} (faults.nan_step)",
          file=sys.stderr)
    import jax.numpy as jnp

    return (jnp.asarray(s),)


def _restart_replica(tr: Trainer, state, m: int):
    """Replica m loses its state and restarts from the outer params: fresh AdamW moments (and bias
    correction), but the learning-rate schedule continues at the global step (no second warm-up)."""
    import optax

    jax = tr.jax
    g = state["outer"]["params"]
    params = jax.tree_util.tree_map(lambda x, gx: x.at[m].set(gx), state["params"], g)
    is_sched = lambda x: isinstance(x, optax.ScaleByScheduleState)
    fresh = jax.tree_util.tree_map(lambda f, o: o if is_sched(f) else f, jax.vmap(tr.tx.init)(params), state["opt"],
                                   is_leaf=is_sched)
    opt = jax.tree_util.tree_map(lambda o, f: o.at[m].set(f[m]), state["opt"], fresh)
    return {**state, "params": params, "opt": opt}


def _gather_window(window: list, tr=None, stop_local: bool | None = None):
    """([(t, ce_R, finite_R)] as host values, whether any process is stopping).

    Across processes: one all-gather for the whole window, and with `stop_local` not None one
    more for every process's stop flag."""
    from diloco import distributed as dist

    if dist.num_processes() <= 1:
        return [(t, np.asarray(ce), np.asarray(fin)) for t, ce, fin in window], bool(stop_local)
    rows = []
    if window:
        ce_W, fin_W = _stack_window()([w[1] for w in window], [w[2] for w in window])
        ce_W, fin_W = dist.to_host(ce_W), dist.to_host(fin_W)
        rows = [(t, ce_W[i], fin_W[i]) for i, (t, _, _) in enumerate(window)]
    if stop_local is None:
        return rows, False
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    n = tr.mesh.devices.size  # one slot per device; each process fills its own devices' slots
    flags = jax.make_array_from_callback((n,), NamedSharding(tr.mesh, P(("replica", "data"))),
                                         lambda idx: np.full(np.empty(n)[idx].shape, stop_local, bool))
    return rows, bool(dist.to_host(flags).any())


@functools.cache
def _stack_window():
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda c, f: (jnp.stack(c), jnp.stack(f)))


def _replica_finite(params_R):
    """(R,) bool on device, not fetched unless a fault is found: which replicas hold only finite values."""
    import jax
    import jax.numpy as jnp

    leaves = jax.tree_util.tree_leaves(params_R)
    return jnp.stack([jnp.isfinite(x).reshape(x.shape[0], -1).all(1) for x in leaves]).all(0)


def _check_pending_finite(state, p: int, t: int, last_ckpt: int = 0, finite_R=None) -> None:
    import jax.numpy as jnp

    pending = state["outer"]["pending"][p]
    if not bool(jnp.isfinite(pending).all()):  # one scalar to the host per sync, the vector only on failure
        v = np.asarray(pending)
        try:
            bad = [m for m, ok in enumerate(np.asarray(finite_R)) if not ok]
        except Exception:  # None, or not addressable from this process
            bad = "unknown"
        raise NumericalFault(f"step {t}: the averaged outer gradient of fragment {p} is not finite "
                             f"({int((~np.isfinite(v)).sum())} bad values; non-finite parameters on replica(s) "
                             f"{bad}); the run stopped and the last good checkpoint (step {last_ckpt}) is kept")


def _downstream_due(cfg, t: int) -> bool:
    return bool(cfg.downstream.tasks) and cfg.downstream.every > 0 and t % cfg.downstream.every == 0 and t != cfg.steps


def _run_downstream(tr: Trainer, state, workdir: Path, cfg, write: bool = True) -> dict:
    from diloco.eval import evaluate

    if "apply" not in tr._jit_cache:  # one apply_fn per trainer: the scorer's jit cache keys on it
        tr._jit_cache["apply"] = lambda p, x: tr.model.apply({"params": p}, x)
    res = evaluate(tr._jit_cache["apply"], tr.eval_params(state), tr.vocab,
                   [t for t in cfg.downstream.tasks.split(",") if t], cfg.downstream.data_dir or None,
                   cfg.downstream.limit or None, cfg.seq_len)
    if write:
        _append_metrics(workdir / "downstream.jsonl", {"step": int(state["step"]), **res})
    return res


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="diloco train", description="Train one run (resumes if DIR has a checkpoint).")
    ap.add_argument("--config", required=True, help="experiments/<file>.py[:arg], e.g. experiments/toy.py:streaming")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--no_progress", action="store_true")
    args, overrides = ap.parse_known_args(argv)
    from diloco.config import load_config
    from diloco.interrupt import prompt_exit

    ckpt = Path(args.workdir) / "ckpt"

    def saved_steps(ckpt: Path) -> set[int]:  # complete checkpoints: orbax renames a step's folder into place
        try:
            return {int(p.name) for p in ckpt.iterdir() if p.name.isdigit()}
        except OSError:
            return set()

    before = saved_steps(ckpt)

    def on_idle(sig: str) -> str:  # outside the training steps: start-up, or the final evaluation
        now = saved_steps(ckpt)
        if not now:
            return f"diloco train: {sig} during start-up; nothing saved"
        if now == before:
            return (f"diloco train: {sig} during start-up; nothing new saved; the checkpoint at step {max(now)} in "
                    f"{ckpt} is kept: run the same command to resume")
        return (f"diloco train: {sig} after training; the checkpoint at step {max(now)} is in {ckpt}: "
                "run the same command to write the summary")

    def on_busy(sig: str) -> str:
        return (f"diloco train: {sig}: finishing the current step (it may be compiling or evaluating), then "
                f"saving a checkpoint; send {sig} again to quit without it")

    def on_again(sig: str) -> str:
        now = saved_steps(ckpt)
        kept = f"the checkpoint at step {max(now)} in {ckpt} is kept" if now else "nothing saved"
        return f"diloco train: {sig} again; quit without saving: {kept}" + (": run the same command to resume" if now else "")

    try:
        with prompt_exit(on_idle, on_busy, on_again):
            cfg = load_config(args.config, overrides)
            summary = train(cfg, args.workdir, progress=not args.no_progress)
    except ConfigError as e:
        print(f"diloco train: bad input: {e}", file=sys.stderr)
        return 2
    except NumericalFault as e:
        print(f"diloco train: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt as e:  # the loop saved a checkpoint and says where
        print(f"diloco train: {e}" if str(e) else "diloco train: interrupted", file=sys.stderr)
        return 130
    keys = ("method", "steps", "final_eval_loss", "bytes_exchanged_total", "bytes_peak_per_sync", "wall_seconds")
    print(json.dumps({k: summary[k] for k in keys}), flush=True)
    return 0
