"""The Trainer: typed state, the jitted inner step and evaluation, on the plan's mesh.

  TrainState.params, .opt   replica-stacked (leading axis R; R = 1 for DP), on the `replica` mesh axis
  TrainState.outer          DiLoCo family only (OuterState): θᵍ, outer-optimizer state, pending Δ, rule buffers
  TrainState.step           inner steps done

Every inner step is one jitted, vmapped AdamW step per replica (`Trainer.inner_step`); the outer syncs
are the driver's (diloco/outer/driver.py), placed by diloco/outer/placement.py. Evaluation uses θᵍ.
Every `auto` of the config is resolved once, before anything is built (diloco/resolve.py: `plan`);
the mesh and shardings are diloco/sharding.py's, host-memory checks diloco/hostmem.py's.
"""
from __future__ import annotations

import math
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import PartitionSpec as P

from diloco import resolve
from diloco.errors import ConfigError
from diloco.distributed import aligned_jit
from diloco.data import get_vocabulary
from diloco.model import ModelConfig, Transformer, loss_fn, matrix_view
from diloco.outer.codecs import codec_from_config
from diloco.outer import rules
from diloco.outer.driver import OuterDriver
from diloco.outer.fragments import make_fragments
from diloco.outer.sync import OuterState, OuterSync, outer_optimizer
from diloco.sharding import Layout, make_mesh


@struct.dataclass
class TrainState:
    params: Any                      # replica-stacked parameter tree, leading axis R
    opt: Any                         # replica-stacked AdamW state
    step: jax.Array                  # () int32: inner steps done
    outer: OuterState | None = None  # DiLoCo family only


def model_config(cfg, vocab_size: int, plan: "resolve.Plan | None" = None) -> ModelConfig:
    """The model of a run with the plan's concrete choices (attention, remat, scan; no `auto`). Without
    a plan (shapes only: `diloco fragments`), the choices a CPU run would make."""
    platform = plan.platform if plan is not None else "cpu"
    return ModelConfig.from_scale(
        cfg.scale, vocab_size=vocab_size, dtype=cfg.model.dtype,
        scan=plan.scan if plan is not None else resolve.scan(cfg)[0],
        remat_policy=plan.remat if plan is not None else resolve.remat(cfg, platform)[0],
        attention=plan.attention if plan is not None else resolve.attention(cfg, platform)[0], platform=platform)


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
    tx = optax.chain(clip_by_global_norm(o.clip_norm),
                     optax.adamw(sched, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay))
    return tx, sched


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """optax.clip_by_global_norm with the norm summed over each leaf's `matrix_view` (the qkv kernel as D×3D):
    the numbers of the D×3D kernel's runs, bit for bit."""
    def update(updates, state, params=None):
        g_norm = optax.global_norm(jax.tree_util.tree_map_with_path(matrix_view, updates))
        trigger = jnp.squeeze(g_norm < max_norm)
        return jax.tree_util.tree_map(
            lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm), updates), state
    return optax.GradientTransformation(optax.clip_by_global_norm(max_norm).init, update)


class Trainer:
    """Owns the state's layout and the jitted inner step; the loop (diloco/train.py) wires the rest."""

    def __init__(self, cfg, devices=None, comm_devices=None, timeline=None, check=None):
        """`check(state, p, t_send, finite_R)`: the pending check of every send (the loop's
        NumericalFault on a non-finite average), given to the exchange placement once."""
        self.cfg = cfg
        self.is_dp = cfg.method == "dp"
        self.R = 1 if self.is_dp else cfg.replicas
        devices = list(devices if devices is not None else jax.devices())
        self.plan = resolve.resolve(cfg, devices, comm_devices)  # every `auto`, once (summary.json "resolved")
        resolve.apply_matmul_precision(cfg, self.plan)  # before anything is traced
        check_accum(cfg, self.plan.mesh[1] * self.plan.mesh[2])
        self.mesh = make_mesh(devices, self.plan.mesh)
        self.vocab = get_vocabulary(cfg.vocab)
        self.mcfg = model_config(cfg, padded_vocab_size(self.vocab.vocab_size), self.plan)
        self.layout = Layout(cfg, self.mesh, self.mcfg, self.R)
        self.replica_sharding = self.layout.replica_sharding        # P("replica")
        self.replicated_sharding = self.layout.replicated_sharding  # P()
        self.batch_sharding = self.layout.batch_sharding
        self.eval_batch_sharding = self.layout.eval_batch_sharding
        self.model = Transformer(self.mcfg)
        self.tx, self.lr_schedule = inner_optimizer(cfg)
        self.param_shapes = jax.eval_shape(self.init_params)
        self.n_params = sum(int(x.size) for x in jax.tree_util.tree_leaves(self.param_shapes))
        self.driver: OuterDriver | None = None
        if not self.is_dp:
            frags = make_fragments(self.param_shapes, self.mcfg.layers, cfg.layers_per_fragment, cfg.fragments,
                                   cfg.pattern, cfg.embed_fragment)
            specs = tuple(self.layout.logical_spec(self.layout.names_at(path), tuple(x.shape))  # each chip's blocks
                          for path, x in jax.tree_util.tree_flatten_with_path(self.param_shapes)[0])
            sync = OuterSync(frags, codec_from_config(cfg), outer_optimizer(**cfg.outer), cfg.alpha,
                             self.mesh if self.mesh.shape["replica"] > 1 else None, specs)
            # the plan's placement of each send's exchange (diloco/outer/placement.py), the config's rule
            self.driver = OuterDriver(sync, self.plan.schedule,
                                      self.R, cfg.seed, self.plan.exchange,
                                      self._overlap(sync, comm_devices, timeline), self.constrain,
                                      pin=self.pin_pending, inner_step=self.inner_step, check=check,
                                      rule=rules.make_rule(cfg))
        self._jit: dict[Any, Any] = {}

    def _overlap(self, sync, comm_devices, timeline):
        """Multi-process with a comm device per process: exchanges run there, overlapping the inner
        steps, and are waited for only at their apply (diloco/outer/overlap.py)."""
        if self.plan.exchange != "comm_device":
            if comm_devices:  # the plan says why the comm devices cannot serve this mesh
                print(f"diloco train: exchanges will not overlap the inner steps: {self.plan.why['exchange']}",
                      file=sys.stderr)
            return None
        from diloco.outer.overlap import OverlappedExchange

        return OverlappedExchange(sync, self.mesh, comm_devices, timeline)

    @property
    def sync(self) -> OuterSync | None:
        return self.driver.sync if self.driver else None

    @property
    def schedule(self):
        return self.driver.schedule if self.driver else None

    @property
    def overlap(self):
        return self.driver.overlap if self.driver else None

    @property
    def placement(self):
        """Where each send's exchange runs (diloco/outer/placement.py); None for DP."""
        return self.driver.placement if self.driver else None

    # -- state --------------------------------------------------------------------------------------
    def init_params(self):
        return self.model.init(jax.random.PRNGKey(self.cfg.seed), jnp.zeros((1, 8), jnp.int32))["params"]

    def init_state(self) -> TrainState:
        params = self.init_params()
        params_R = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (self.R,) + x.shape), params)
        return TrainState(params=params_R, opt=jax.vmap(self.tx.init)(params_R), step=jnp.zeros((), jnp.int32),
                          outer=self.init_outer(params) if self.sync is not None else None)

    def init_outer(self, params):
        """θᵍ and its optimizer state; the rule's buffers (diloco/outer/rules.py; None for plain sends)."""
        return self.sync.init(params).replace(extra=rules.init(self.driver.rule, self.sync, params, self.R))

    # -- layout (diloco/sharding.py) ---------------------------------------------------------------
    def shardings(self, state: TrainState) -> TrainState:
        return self.layout.state_shardings(state)

    def state_shapes(self) -> TrainState:
        """The state's shapes and dtypes (traced once per trainer: nothing allocated)."""
        if "shapes" not in self._jit:
            self._jit["shapes"] = jax.eval_shape(self.init_state)
        return self._jit["shapes"]

    def constrain(self, state: TrainState) -> TrainState:
        """Inside a jitted program: the state in its own layout (GSPMD would otherwise pick one). Also a
        state holding fewer fragment slots (a shared fragment program's view, OuterDriver.program)."""
        if "shardings" not in self._jit:
            self._jit["shardings"] = self.shardings(self.state_shapes())
        sh = self._jit["shardings"]
        if jax.tree_util.tree_structure(state) != jax.tree_util.tree_structure(sh):
            sh = self.shardings(state)
        return jax.lax.with_sharding_constraint(state, sh)

    def pin_pending(self, avg):
        """Inside a jitted program: a fragment's averaged Δ (its subtree) in θᵍ's layout, as the pending slot."""
        return jax.lax.with_sharding_constraint(avg, self.layout.outer_param_shardings(avg))

    def abstract_state(self) -> TrainState:
        shapes = self.state_shapes()
        return jax.tree_util.tree_map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                      shapes, self.shardings(shapes))

    def fresh_state(self) -> TrainState:
        return jax.jit(self.init_state, out_shardings=self.shardings(self.state_shapes()))()

    def eval_params(self, state: TrainState):
        """θᵍ for the DiLoCo family, the (only) replica for DP."""
        if state.outer is not None:
            return self.driver.rule.eval_params(self.sync, state.outer)  # θᵍ; the replicas' mean if theirs differ
        return jax.tree_util.tree_map(lambda x: x[0], state.params)

    def drained(self, state: TrainState, t: int) -> tuple[TrainState, TrainState, list[int]]:
        """(state with its exchanges landed, a copy with every fragment in flight after step t applied,
        those fragments): θᵍ as at the next sync boundary, what a run reports (OuterDriver.drained)."""
        if self.driver is None:
            return state, state, []
        return self.driver.drained(state, t)

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

    def inner_step(self, active: int | None = None, jitted: bool = True):
        """(state, tokens_RxBxL[, poison_R]) → (state, ce_R, finite_R): one AdamW step per replica, the
        jitted program (built once per trainer), or with `jitted=False` the traced function it compiles
        (to compile into other programs: the in-step exchange, `diloco compile`).

        `poison_R` (fault injection only) multiplies each replica's loss: 1, nan or inf.

        `active=p` trains only fragment p (the FedPart-style frozen-fragment baseline)."""
        if ("inner_py", active) not in self._jit:
            self._jit[("inner_py", active)] = self.build_inner_step(active)
        if not jitted:
            return self._jit[("inner_py", active)]
        if ("inner", active) not in self._jit:
            self._jit[("inner", active)] = aligned_jit(self._jit[("inner_py", active)], f"inner-{active}",
                                                       donate_argnums=(0,))
        return self._jit[("inner", active)]

    def build_inner_step(self, active: int | None = None):
        """The traced inner step `inner_step(active, jitted=False)` returns (built once there)."""
        mask = None
        if active is not None:
            mask = self.sync.frags.mask_tree(self.param_shapes, active)

        def grad1(params, tokens, *poison):
            lossf = self.loss if not poison else (
                lambda p, x: jax.tree_util.tree_map(lambda v: v * poison[0], self.loss(p, x)))
            (loss, aux), grads = jax.value_and_grad(lossf, has_aux=True)(params, tokens)
            return loss, aux, grads

        k = int(self.cfg.get("accum_steps", 1))
        grad = grad1 if k == 1 else accumulated(grad1, k)

        def one(params, opt, tokens, *poison):
            loss, aux, grads = grad(params, tokens, *poison)
            return update(params, opt, loss, aux["ce"], grads)

        def update(params, opt, loss, ce, grads):
            updates, opt2 = self.tx.update(grads, opt, params)
            if mask is not None:
                updates = jax.tree_util.tree_map(lambda u, m: jnp.where(m, u, 0), updates, mask)
            finite = jnp.isfinite(loss) & jnp.isfinite(optax.global_norm(grads))
            return optax.apply_updates(params, updates), opt2, ce, finite

        # With fsdp = tensor = 1 (parameters whole on every chip of a replica) the gradient mean over `data` is
        # one flat all-reduce; with fsdp or tensor > 1 GSPMD places the reduce-scatters/all-gathers itself.
        flat_reduce = self.mesh.shape["data"] > 1 and self.mesh.shape["fsdp"] == self.mesh.shape["tensor"] == 1
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
                vm = jax.vmap(one, spmd_axis_name="replica") if self.layout.activation_rules() else jax.vmap(one)
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

        return self.layout.in_rules(step)

    def eval_fn(self):
        if "eval" not in self._jit:
            spec = self.eval_batch_sharding.spec
            self._jit["eval"] = aligned_jit(self.layout.in_rules(lambda params, toks: self.loss(params, toks)[1]["ce"],
                                                                 batch_axes=spec[0] if len(spec) else None,
                                                                 outside_shard_map=True), "eval")
        return self._jit["eval"]

    def dp_bytes_per_replica(self) -> int:
        return self.n_params * np.dtype(jnp.dtype(self.cfg.dp_grad_dtype)).itemsize


def check_accum(cfg, batch_devices: int) -> None:
    """ConfigError (one line) unless each of the accum_steps microbatches of a replica's batch splits evenly over
    the `batch_devices` devices of its data×fsdp axes."""
    k = int(cfg.get("accum_steps", 1))
    per = cfg.batch_size // (1 if cfg.method == "dp" else cfg.replicas)
    if k > 1 and (per % k or (per // k) % batch_devices):
        raise ConfigError("accum_steps", f"{k} microbatches of the per-replica batch {per} do not split over the "
                          f"{batch_devices} devices of the data×fsdp axes; use a k with {per} / k a multiple of "
                          f"{batch_devices}")


def accumulated(grad1, k: int):
    """`grad1(params, tokens_BxL, *poison) → (loss, aux, grads)` over k microbatches of B/k sequences, one at a
    time (gradient accumulation: activations of B/k sequences live at once): the token-weighted mean of the
    microbatches' losses and gradients, which is the whole batch's (loss_fn is a mean over unmasked tokens), up to
    float32 summation order. Microbatch i is rows i, i+k, i+2k, …: a batch split over devices by rows keeps every
    microbatch on every device, so nothing moves."""
    def run(params, tokens_BxL, *poison):
        B = tokens_BxL.shape[0]
        mb_KxBkxL = jnp.swapaxes(tokens_BxL.reshape(B // k, k, -1), 0, 1)

        def weighted(mb_BkxL):
            loss, aux, grads = grad1(params, mb_BkxL, *poison)
            w = aux["tokens"]
            return loss * w, aux["ce"] * w, aux["z"] * w, w, jax.tree_util.tree_map(lambda g: g * w, grads)

        def body(carry, mb_BkxL):
            return jax.tree_util.tree_map(jnp.add, carry, weighted(mb_BkxL)), None

        # the sum starts from microbatch 0 (laid out like the gradients it adds to), the rest are scanned
        (loss, ce, z, n, grads), _ = jax.lax.scan(body, weighted(mb_KxBkxL[0]), mb_KxBkxL[1:])
        d = jnp.maximum(n, 1.0)
        grads = jax.tree_util.tree_map(lambda g: g / d, grads)
        return loss / d, {"ce": ce / d, "z": z / d, "tokens": n}, grads
    return run


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
