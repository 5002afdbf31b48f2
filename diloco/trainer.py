"""The Trainer: typed state, mesh and shardings, the jitted inner step and evaluation.

  TrainState.params, .opt   replica-stacked (leading axis R; R = 1 for DP), on the `replica` mesh axis
  TrainState.outer          DiLoCo family only: θᵍ, per-fragment Nesterov state, pending averaged Δ
  TrainState.step           inner steps done

Every inner step is one jitted, vmapped AdamW step per replica; the outer syncs are the driver's
(diloco/outer/driver.py). Evaluation uses θᵍ.
"""
from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from diloco.config import mesh_rules, mesh_shape
from diloco.errors import ConfigError
from diloco.distributed import aligned_jit, device_grid
from diloco.data import get_vocabulary
from diloco.model import ModelConfig, Transformer, loss_fn, param_logical_axes
from diloco.model.scales import TOY_SCALES, formula_params
from diloco.model.transformer import SPLASH_BLOCK
from diloco.outer.codecs import codec_from_config
from diloco.outer import eager_driver, eager_sync
from diloco.outer.driver import OuterDriver
from diloco.outer.fragments import make_fragments
from diloco.outer.schedule import make_schedule
from diloco.outer.sync import OuterState, OuterSync, outer_optimizer


@struct.dataclass
class TrainState:
    params: Any                      # replica-stacked parameter tree, leading axis R
    opt: Any                         # replica-stacked AdamW state
    step: jax.Array                  # () int32: inner steps done
    outer: OuterState | None = None  # DiLoCo family only


def remat_policy(cfg, platform: str = "cpu") -> str:
    """`model.remat_policy`, with "auto" resolved: nothing on CPU or for the toy scales (memory is not
    the limit there); on accelerators, recompute every block from 1B up (activations dominate a chip's
    memory there, docs/distributed.md) and keep the matmul outputs below it."""
    want = cfg.model.remat_policy
    if want != "auto":
        return want
    if cfg.model.remat:
        return "full"
    if platform == "cpu" or cfg.scale in TOY_SCALES:
        return "none"
    return "full" if param_count_estimate(cfg.scale) >= 1e9 else "save_dots"


def param_count_estimate(scale: str) -> float:
    return float(formula_params(scale))


def attention_choice(cfg, platform: str = "cpu") -> str:
    """`model.attention` with "auto" resolved for the platform the run compiles for: the Pallas splash
    kernel on TPU when the sequence length is a multiple of its tile, else what ModelConfig picks."""
    want = cfg.model.attention
    if want == "auto" and platform == "tpu":
        return "splash" if cfg.seq_len % SPLASH_BLOCK == 0 else "xla"
    return want


def scan_layers(cfg) -> bool:
    """`model.scan`, with "auto" resolved: the paper's scales stack their blocks under nn.scan (one
    compiled block: a 4B compile takes a minute, not an hour, and FSDP gathers one layer's weights at a
    time); the toy scales keep one module per block (their committed results and hashes)."""
    want = str(cfg.model.scan).lower()
    if want == "auto":
        return cfg.scale not in TOY_SCALES
    return want in ("true", "1")


def model_config(cfg, vocab_size: int, platform: str = "cpu") -> ModelConfig:
    return ModelConfig.from_scale(cfg.scale, vocab_size=vocab_size, dtype=cfg.model.dtype,
                                  remat=cfg.model.remat, scan=scan_layers(cfg),
                                  remat_policy=remat_policy(cfg, platform),
                                  attention=attention_choice(cfg, platform), platform=platform)


def padded_vocab_size(n: int) -> int:
    return int(math.ceil(n / 128) * 128)


def abstract_params(cfg):
    """Parameter shapes of a config, without allocating (for `diloco fragments`)."""
    mcfg = model_config(cfg, padded_vocab_size(get_vocabulary(cfg.vocab).vocab_size))
    return jax.eval_shape(lambda: Transformer(mcfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))["params"]


def inner_optimizer(cfg):
    o = cfg.optimizer
    sched = optax.warmup_cosine_decay_schedule(0.0, o.lr, max(1, o.warmup_steps), max(cfg.steps, o.warmup_steps + 1),
                                               end_value=o.min_lr_ratio * o.lr)
    tx = optax.chain(optax.clip_by_global_norm(o.clip_norm),
                     optax.adamw(sched, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay))
    return tx, sched


class Trainer:
    """Owns the state's layout and the jitted inner step; the loop (diloco/train.py) wires the rest."""

    def __init__(self, cfg, devices=None, comm_devices=None, timeline=None):
        self.cfg = cfg
        self.is_dp = cfg.method == "dp"
        self.R = 1 if self.is_dp else cfg.replicas
        devices = list(devices if devices is not None else jax.devices())
        self.mesh = Mesh(device_grid(devices, mesh_shape(cfg, len(devices))), ("replica", "data", "fsdp"))
        self.rep_sharding = NamedSharding(self.mesh, P("replica"))
        self.repl_sharding = NamedSharding(self.mesh, P())
        self.batch_sharding = NamedSharding(self.mesh, P("replica", ("data", "fsdp")))
        n_dev = len(devices)  # the eval batch is split over every device when its rows allow
        self.eval_batch_sharding = (NamedSharding(self.mesh, P(("replica", "data", "fsdp")))
                                    if (cfg.batch_size // self.R * self.R) % n_dev == 0 else self.repl_sharding)
        self.vocab = get_vocabulary(cfg.vocab)
        self.mcfg = model_config(cfg, padded_vocab_size(self.vocab.vocab_size), devices[0].platform)
        self.model = Transformer(self.mcfg)
        self.tx, self.lr_schedule = inner_optimizer(cfg)
        self.param_shapes = jax.eval_shape(self.init_params)
        self.n_params = sum(int(x.size) for x in jax.tree_util.tree_leaves(self.param_shapes))
        self.driver: OuterDriver | None = None
        if not self.is_dp:
            frags = make_fragments(self.param_shapes, self.mcfg.layers, cfg.layers_per_fragment, cfg.fragments,
                                   cfg.pattern, cfg.embed_fragment)
            sync = OuterSync(frags, codec_from_config(cfg),
                             outer_optimizer(cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov), cfg.alpha,
                             self.mesh if self.mesh.shape["replica"] > 1 else None)
            if eager_driver.wanted(cfg):  # eager updates / error feedback: their own sends (blocking)
                self.driver = eager_driver.EagerDriver(
                    sync, make_schedule(cfg.H, frags.P, cfg.tau, cfg.replicas, cfg.replica_tau), self.R, cfg.seed,
                    cfg.eager, self.constrain)
            else:
                self.driver = OuterDriver(sync, make_schedule(cfg.H, frags.P, cfg.tau, cfg.replicas, cfg.replica_tau),
                                          self.R, cfg.seed, self._overlap(sync, comm_devices, timeline), self.constrain,
                                          in_step=cfg.exchange == "in_step" or (
                                              cfg.exchange == "auto" and devices[0].platform in ("tpu", "gpu")))
        self._jit: dict[Any, Any] = {}

    def _overlap(self, sync, comm_devices, timeline):
        """Multi-process with a comm device per process: exchanges run there, overlapping the inner
        steps, and are waited for only at their apply (diloco/outer/overlap.py)."""
        if not comm_devices:
            return None
        from diloco.outer.overlap import OverlappedExchange

        try:
            return OverlappedExchange(sync, self.mesh, comm_devices, timeline)
        except ValueError as why:  # this mesh cannot use the comm devices: blocking sends
            print(f"diloco train: exchanges will not overlap the inner steps: {why}", file=sys.stderr)
            return None

    @property
    def sync(self) -> OuterSync | None:
        return self.driver.sync if self.driver else None

    @property
    def schedule(self):
        return self.driver.schedule if self.driver else None

    @property
    def overlap(self):
        return self.driver.overlap if self.driver else None

    # -- state --------------------------------------------------------------------------------------
    def init_params(self):
        return self.model.init(jax.random.PRNGKey(self.cfg.seed), jnp.zeros((1, 8), jnp.int32))["params"]

    def init_state(self) -> TrainState:
        params = self.init_params()
        params_R = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (self.R,) + x.shape), params)
        return TrainState(params=params_R, opt=jax.vmap(self.tx.init)(params_R), step=jnp.zeros((), jnp.int32),
                          outer=self.init_outer(params) if self.sync is not None else None)

    def init_outer(self, params):
        """θᵍ and its optimizer state; the eager / error-feedback buffers when on (else `extra` None)."""
        outer = self.sync.init(params)
        if eager_driver.wanted(self.cfg):
            outer = outer.replace(extra=eager_sync.init(self.sync, params, self.R, self.cfg.eager,
                                                         self.cfg.eager_rounds, self.cfg.error_feedback))
        return outer

    # -- layout by logical axis names (mesh.rules) -------------------------------------------------
    @property
    def rules(self) -> tuple:
        """flax logical axis rules from `mesh.rules` (validated: diloco/config.py mesh_rules)."""
        if getattr(self, "_rules", None) is None:
            self._rules = mesh_rules(self.cfg)
        return self._rules

    def param_names(self) -> dict:
        """{parameter path (dict keys): its logical axis names} (diloco.model.param_logical_axes)."""
        if getattr(self, "_param_names", None) is None:
            axes = param_logical_axes(self.mcfg)
            flat = jax.tree_util.tree_flatten_with_path(axes, is_leaf=lambda t: isinstance(t, tuple))[0]
            self._param_names = {path_keys(p): names for p, names in flat}
        return self._param_names

    def names_at(self, path) -> tuple | None:
        """Logical names of a leaf of the parameter tree or of a tree shaped like it (AdamW's mu/nu)."""
        keys = path_keys(path)
        names = self.param_names()
        for k in range(len(keys)):  # the longest suffix that is a parameter path
            if keys[k:] in names:
                return names[keys[k:]]
        return None

    def logical_spec(self, names, shape) -> tuple:
        """Per-dimension mesh axes of one (unstacked) parameter from the rules; a mesh axis of size 1, or
        one that does not divide its dimension, is dropped (that dimension stays whole)."""
        if names is None or len(names) != len(shape):
            return (None,) * len(shape)
        spec = logical_spec(names, self.rules)
        out = []
        for d, entry in zip(shape, spec):
            axes = tuple(a for a in ((entry,) if isinstance(entry, str) else (entry or ())) if self.mesh.shape[a] > 1)
            k = int(np.prod([self.mesh.shape[a] for a in axes])) if axes else 1
            out.append(None if not axes or d % k else (axes[0] if len(axes) == 1 else axes))
        return tuple(out)

    def param_sharding(self, shape_R, names=None) -> NamedSharding:
        """A replica-stacked leaf (R, …): `replica` on the leading axis, the rest by the logical rules."""
        return NamedSharding(self.mesh, P("replica", *self.logical_spec(names, tuple(shape_R[1:]))))

    def outer_param_sharding(self, shape, names=None) -> NamedSharding:
        """θᵍ: sharded like one replica's parameters, without the replica axis."""
        return NamedSharding(self.mesh, P(*self.logical_spec(names, tuple(shape))))

    def outer_param_shardings(self, tree):
        """θᵍ-shaped tree (no replica axis) → its shardings."""
        return jax.tree_util.tree_map_with_path(
            lambda p, x: self.outer_param_sharding(x.shape, self.names_at(p)), tree)

    def activation_rules(self) -> bool:
        """Trace the model under the mesh and rules (activation constraints on): only when a replica's
        parameters are sharded (fsdp > 1); otherwise the programs are the same as without rules."""
        return self.mesh.shape["fsdp"] > 1

    def in_rules(self, fn, batch_axes: tuple | None | bool = False):
        """`fn` traced with the mesh and logical rules in context, so the model's activation constraints
        apply (flax needs the mesh set, not only `with mesh`); `batch_axes` overrides the batch rule."""
        if not self.activation_rules():
            return fn
        rules = self.rules if batch_axes is False else (("batch", batch_axes),) + tuple(
            r for r in self.rules if r[0] != "batch")
        mesh = self.mesh

        def traced(*args):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(rules):
                return fn(*args)
        return traced

    def flat_sharding(self, shape) -> NamedSharding:
        """Outer per-fragment flat vectors (momentum, pending Δ): over data×fsdp when they divide."""
        k = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        ok = len(shape) == 1 and k > 1 and shape[0] % k == 0
        return NamedSharding(self.mesh, P(("data", "fsdp")) if ok else P())

    def shardings(self, state: TrainState) -> TrainState:
        rep = lambda tree: jax.tree_util.tree_map_with_path(
            lambda p, x: self.param_sharding(x.shape, self.names_at(p)) if x.ndim >= 1 else self.repl_sharding, tree)
        outer = None
        if state.outer is not None:
            flat = lambda tree: jax.tree_util.tree_map(lambda x: self.flat_sharding(x.shape), tree)
            outer = state.outer.replace(
                params=self.outer_param_shardings(state.outer.params),
                opt=flat(state.outer.opt), pending=flat(state.outer.pending),
                extra=eager_sync.shardings(state.outer.extra, self.mesh))
        return TrainState(params=rep(state.params), opt=rep(state.opt), step=self.repl_sharding, outer=outer)

    def constrain(self, state: TrainState) -> TrainState:
        """Inside a jitted program: the state in its own layout (GSPMD would otherwise pick one)."""
        if "shardings" not in self._jit:
            self._jit["shardings"] = self.shardings(jax.eval_shape(self.init_state))
        return jax.lax.with_sharding_constraint(state, self._jit["shardings"])

    def abstract_state(self) -> TrainState:
        shapes = jax.eval_shape(self.init_state)
        return jax.tree_util.tree_map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                      shapes, self.shardings(shapes))

    def fresh_state(self) -> TrainState:
        shapes = jax.eval_shape(self.init_state)
        return jax.jit(self.init_state, out_shardings=self.shardings(shapes))()

    def eval_params(self, state: TrainState):
        """θᵍ for the DiLoCo family, the (only) replica for DP."""
        if state.outer is not None:
            return eager_sync.consensus(self.sync, state.outer)  # θᵍ; the replicas' mean if theirs differ
        return jax.tree_util.tree_map(lambda x: x[0], state.params)

    def drained(self, state: TrainState, t: int, check=None) -> tuple[TrainState, TrainState, list[int]]:
        """(state with its exchanges landed, a copy with every fragment in flight after step t applied,
        those fragments): θᵍ as at the next sync boundary, what a run reports (OuterDriver.drained)."""
        if self.driver is None:
            return state, state, []
        return self.driver.drained(state, t, check)

    def params_of(self, state: TrainState, which: str = "drained") -> tuple[Any, dict]:
        """(parameters, what they are) of a saved state: `drained` (θᵍ with the fragments in flight
        applied: the run's params_sha256 and final_eval_loss), `undrained` (θᵍ as saved) or
        `replica:K` (replica K's inner parameters)."""
        from diloco.outer.sync import params_sha256

        step = int(state.step)
        about: dict[str, Any] = {"params": which, "step": step}
        if which == "drained":
            _, out, about["drained_fragments"] = self.drained(state, step)
            params = self.eval_params(out)
        elif which == "undrained":
            params = self.eval_params(state)
        elif which.startswith("replica:") and which[8:].isdigit() and int(which[8:]) < self.R:
            params = jax.tree_util.tree_map(lambda x, k=int(which[8:]): x[k], state.params)
        else:
            valid = ", ".join(["drained", "undrained"] + [f"replica:{k}" for k in range(self.R)])
            raise ConfigError("--params", f"{which!r} is not one of this run's parameter sets: {valid}")
        about["params_sha256"] = params_sha256(params)
        return params, about

    # -- jitted pieces ------------------------------------------------------------------------------
    def loss(self, params, tokens_BxL):
        logits = self.model.apply({"params": params}, tokens_BxL)
        return loss_fn(logits, tokens_BxL, self.cfg.model.z_loss)

    def apply_fn(self):
        """(params, tokens) → logits; one function per trainer (the scorer's jit cache keys on it)."""
        if "apply" not in self._jit:
            self._jit["apply"] = lambda p, x: self.model.apply({"params": p}, x)
        return self._jit["apply"]

    def inner_step_fn(self, active: int | None = None):
        """(state, tokens_RxBxL[, poison_R]) → (state, ce_R, finite_R): one AdamW step per replica.

        `poison_R` (fault injection only) multiplies each replica's loss: 1, nan or inf.

        `active=p` trains only fragment p (the FedPart-style frozen-fragment baseline)."""
        if ("inner", active) not in self._jit:
            self._jit[("inner", active)] = aligned_jit(self.inner_step_py(active), f"inner-{active}",
                                                       donate_argnums=(0,))
        return self._jit[("inner", active)]

    def inner_step_py(self, active: int | None = None):
        """`inner_step(active)`, built once per trainer (the loop asks for it every step)."""
        if ("inner_py", active) not in self._jit:
            self._jit[("inner_py", active)] = self.inner_step(active)
        return self._jit[("inner_py", active)]

    def step(self, state: TrainState, tokens_RxBxL, active: int | None = None, poison: tuple = (), check=None):
        """One inner step; with exchange=in_step it also carries the exchange of the send after the
        previous step (OuterDriver.inner_step)."""
        fn = self.inner_step_fn(active)
        if self.driver is None:
            return fn(state, tokens_RxBxL, *poison)
        return self.driver.inner_step(state, tokens_RxBxL, fn, self.inner_step_py(active), active, poison, check)

    def inner_step(self, active: int | None = None):
        """The un-jitted inner step (for `inner_step_fn` and for compiling it into other programs)."""
        mask = None
        if active is not None:
            mask = self.sync.frags.mask_tree(self.param_shapes, active)

        def grad(params, tokens, *poison):
            lossf = self.loss if not poison else (
                lambda p, x: jax.tree_util.tree_map(lambda v: v * poison[0], self.loss(p, x)))
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

        # With fsdp = 1 (parameters whole on every chip of a replica) the gradient mean over `data` is
        # one flat all-reduce; with fsdp > 1 GSPMD places the reduce-scatters/all-gathers itself.
        flat_reduce = self.mesh.shape["data"] > 1 and self.mesh.shape["fsdp"] == 1
        if flat_reduce:
            # Gradients averaged over the `data` axis as ONE flat vector (token-weighted, so the
            # masked mean is exact): GSPMD would all-reduce a tuple of every parameter's gradient,
            # and XLA:CPU's gloo collectives pay a fixed cost per operand (54 arrays: 24 ms vs
            # 0.8 ms as one, docs/distributed.md).
            from jax.flatten_util import ravel_pytree

            unravel = unraveler(self.param_shapes)  # from shapes only: nothing of the model's size on the host

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

        def step(state: TrainState, tokens_RxBxL, *poison_R):
            if flat_reduce:
                loss_R, ce_R, g_R = grads_R(state.params, tokens_RxBxL, *poison_R)
                p, o, ce_R, fin_R = jax.vmap(update)(state.params, state.opt, loss_R, ce_R, g_R)
            else:
                vm = jax.vmap(one, spmd_axis_name="replica") if self.activation_rules() else jax.vmap(one)
                p, o, ce_R, fin_R = vm(state.params, state.opt, tokens_RxBxL, *poison_R)
            # Each replica keeps its own update only if its own step was finite: a local decision,
            # so no cross-replica collective sits in the inner step (replicas are independent
            # between syncs; the loop stops or logs the skip from fin_R).
            def keep(new, old):
                def pick(a, b):
                    ok = fin_R.reshape((-1,) + (1,) * (a.ndim - 1))
                    return jnp.where(ok, a, b)
                return jax.tree_util.tree_map(pick, new, old)
            new = state.replace(params=keep(p, state.params), opt=keep(o, state.opt), step=state.step + 1)
            return self.constrain(new), ce_R, fin_R

        return self.in_rules(step)

    def eval_fn(self):
        if "eval" not in self._jit:
            spec = self.eval_batch_sharding.spec
            self._jit["eval"] = aligned_jit(self.in_rules(lambda params, toks: self.loss(params, toks)[1]["ce"],
                                                          batch_axes=spec[0] if len(spec) else None), "eval")
        return self._jit["eval"]

    def dp_bytes_per_replica(self) -> int:
        return self.n_params * np.dtype(jnp.dtype(self.cfg.dp_grad_dtype)).itemsize


def path_keys(path) -> tuple:
    """The dict keys along a tree path (what a parameter path and AdamW's copy of it share)."""
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path
                 if isinstance(k, (jax.tree_util.DictKey, jax.tree_util.GetAttrKey)))


def logical_spec(names: tuple, rules: tuple) -> tuple:
    """Mesh axes per dimension for logical `names` under flax `rules` (earlier rules win a mesh axis)."""
    return tuple(nn.logical_to_mesh_axes(names, rules))


def unraveler(shapes):
    """ravel_pytree's unravel for a tree of ShapeDtypeStructs, built without allocating anything:
    the flat vector is split in tree-leaf order, reshaped and cast back to each leaf's dtype."""
    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    sizes = [int(np.prod(x.shape)) for x in leaves]
    cuts = np.cumsum(sizes)[:-1].tolist()

    def unravel(flat):
        parts = jnp.split(flat, cuts)
        return jax.tree_util.tree_unflatten(
            treedef, [p.reshape(x.shape).astype(x.dtype) for p, x in zip(parts, leaves)])
    return unravel


def state_bytes(trainer: Trainer) -> int:
    """Bytes the training state takes on the trainer's devices, from shapes and shardings alone
    (jax.eval_shape; nothing allocated): parameters and AdamW moments of every replica, the outer θᵍ,
    momentum and pending Δ for the DiLoCo family; a leaf held whole on several devices counts on each."""
    total = 0
    for x in jax.tree_util.tree_leaves(trainer.abstract_state()):
        per_device = int(np.prod(x.sharding.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
        total += per_device * len(x.sharding.device_set)
    return total


def host_memory_available() -> tuple[int, str] | None:
    """(bytes this process can still take, where that figure comes from): /proc/meminfo's MemAvailable,
    or the cgroup's limit less its usage (not counting reclaimable page cache) when that is lower."""
    def read(path: str) -> str | None:
        try:
            with open(path) as f:
                return f.read()
        except OSError:
            return None

    found = []
    meminfo = read("/proc/meminfo") or ""
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            found.append((int(line.split()[1]) * 1024, "MemAvailable"))
    for limit_f, usage_f, stat_f, inactive in (
            ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat", "inactive_file"),
            ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes",
             "/sys/fs/cgroup/memory/memory.stat", "total_inactive_file")):
        limit, usage = (read(limit_f) or "").strip(), (read(usage_f) or "").strip()
        if not limit.isdigit() or not usage.isdigit() or int(limit) >= 1 << 60:  # "max" / no limit
            continue
        stat = dict(l.split()[:2] for l in (read(stat_f) or "").splitlines() if len(l.split()) >= 2)
        cache = int(stat.get(inactive, "0")) if stat.get(inactive, "0").isdigit() else 0
        found.append((int(limit) - int(usage) + cache, f"cgroup limit {int(limit) / 2**30:.1f} GiB less its usage"))
    return min(found) if found else None


def check_fits_host(trainer: Trainer) -> None:
    """On a CPU backend (every device is this host's memory), a run whose state alone exceeds the
    memory available is refused before anything is allocated: ConfigError naming `scale`."""
    if trainer.mesh.devices.flat[0].platform != "cpu":
        return
    avail = host_memory_available()
    need = state_bytes(trainer)
    if avail is None or need <= avail[0]:
        return
    cfg, gib = trainer.cfg, 2 ** 30
    parts = ("parameters and AdamW moments" + (f" of {trainer.R} replicas" if trainer.R > 1 else "")
             + (", outer θᵍ, momentum and pending Δ" if trainer.driver is not None else ""))
    raise ConfigError("scale", f"a {cfg.scale} {cfg.method} run's training state alone is {need / gib:.1f} GiB "
                      f"({parts}; {trainer.n_params:,} parameters) but this host has {avail[0] / gib:.1f} GiB "
                      f"available ({avail[1]}); on CPU use a smaller scale (e.g. --config.scale=toy); for TPU "
                      f"slices, `diloco compile --config … --topology v5p:2x2x2` reports the per-chip memory")


def load_run(workdir: str | os.PathLike) -> tuple[Any, Trainer, TrainState]:
    """(config, trainer, state) of a run's newest readable checkpoint."""
    import ml_collections

    from diloco import rundir
    from diloco.checkpoint import Checkpointer

    run = rundir.RunDir(workdir)
    cfg_path = run / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{cfg_path} not found: is {workdir} a diloco run directory?")
    cfg = ml_collections.ConfigDict(json.loads(cfg_path.read_text()))
    trainer = Trainer(cfg)
    check_fits_host(trainer)
    ck = Checkpointer(run.ckpt, cfg.keep_checkpoints)
    try:
        got = ck.restore(trainer.abstract_state())
    finally:
        ck.close()
    if got is None:
        raise FileNotFoundError(f"no readable checkpoint under {run.ckpt}")
    return cfg, trainer, got[1]


def load_eval_params(workdir: str | os.PathLike, which: str = "drained"):
    """(config, model, params, vocab, what the params are) of the newest checkpoint of a run; by
    default θᵍ drained, the parameters whose sha256 and loss summary.json reports (Trainer.params_of)."""
    cfg, trainer, state = load_run(workdir)
    params, about = trainer.params_of(state, which)
    return cfg, trainer.model, params, trainer.vocab, about

