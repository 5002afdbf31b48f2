"""Chinchilla-style decoder: pre-norm RMSNorm, no biases, QK-norm, RoPE, plain MLP, tied embeddings.

Shapes are in names: B batch, L length, D d_model, H heads, K head dim, F mlp dim, V vocab.

Every parameter carries logical axis names (flax logical partitioning) and activations carry
logical sharding constraints at block boundaries; both are no-ops until a mesh and rules are in
context (`nn.logical_axis_rules`). `Transformer.init` returns plain arrays; `param_logical_axes`
gives the names, with the same tree structure.

Logical axes: "vocab", "embed" (d_model), "mlp" (F), "heads" (H·K, heads-major: the input dim of
attn_out), "qkv" (H·K of each of q, k and v in the D×3×(H·K) qkv kernel, heads-major), "head_dim" (K, the
QK-norm scales), "layers" (the nn.scan axis). Activations: "batch", "length", "embed", "heads",
"head_dim", "mlp", "vocab".
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from diloco.errors import ConfigError

ATTENTION = ("xla", "dot_product", "cudnn", "splash")  # concrete only: `auto` is diloco/resolve.py's
REMAT_POLICIES = ("none", "full", "save_dots")
_constrain = nn.with_logical_constraint  # (x, logical names): a no-op until rules are in context


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    layers: int
    d_model: int
    heads: int
    mlp_dim: int
    max_seq_len: int = 2048
    dtype: str = "float32"  # compute dtype; params stay float32
    remat: bool = False  # legacy switch: True means remat_policy="full"
    scan: bool = False  # nn.scan over blocks: params stacked on a leading layer axis under "blocks"
    rope_base: float = 10_000.0
    remat_policy: str = "none"  # none | full (recompute every block) | save_dots (keep matmul outputs)
    attention: str = "xla"  # xla (einsum + softmax) | dot_product (jax.nn.dot_product_attention, XLA's) |
    #                        cudnn (the same call, cuDNN's fused kernel: GPU, bf16/fp16) | splash (Pallas, TPU)
    platform: str = ""  # what the model is compiled for ("": JAX's default backend); splash runs its Pallas
    #                     kernel compiled on "tpu", interpreted elsewhere (CPU tests)

    def __post_init__(self):
        if self.remat_policy not in REMAT_POLICIES:
            raise ConfigError("model.remat_policy", f"{self.remat_policy!r} is not one of {', '.join(REMAT_POLICIES)}")
        if self.attention not in ATTENTION:
            raise ConfigError("model.attention", f"{self.attention!r} is not one of {', '.join(ATTENTION)}")
        if self.d_model % self.heads or (self.d_model // self.heads) % 2:
            raise ConfigError("model.heads", f"d_model={self.d_model} must split into {self.heads} heads of an even size (RoPE)")

    @property
    def checkpoint_policy(self) -> str:
        """The remat policy in effect ("none", "full" or "save_dots"); remat=True alone means "full"."""
        if self.remat_policy == "none" and self.remat:
            return "full"
        return self.remat_policy

    @classmethod
    def from_scale(cls, name: str, vocab_size: int, **overrides: Any) -> "ModelConfig":
        from diloco.model.scales import SCALES

        s = SCALES[name]
        kw = dict(vocab_size=vocab_size, layers=s.layers, d_model=s.d_model, heads=s.heads,
                  mlp_dim=s.mlp_dim, max_seq_len=s.max_seq_len)
        kw.update(overrides)
        return cls(**kw)


class RMSNorm(nn.Module):
    eps: float = 1e-6
    axis: str = "embed"  # logical name of the normalised (last) axis

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, (self.axis,)),
                           (x.shape[-1],), jnp.float32)
        x32 = x.astype(jnp.float32)  # no-op in float32
        y = x32 * jax.lax.rsqrt(jnp.mean(x32**2, axis=-1, keepdims=True) + self.eps)
        return (y * scale.reshape((1,) * (x.ndim - 1) + (-1,))).astype(x.dtype)  # explicit broadcast


def rope_tables(L: int, K: int, base: float) -> tuple[jax.Array, jax.Array]:
    """(sin, cos), each L×1×K/2 float32: built once per forward pass, shared by every block."""
    inv_freq = base ** (-jnp.arange(0, K, 2, dtype=jnp.float32) / K)
    ang_LxK2 = jnp.arange(L, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.sin(ang_LxK2)[:, None, :], jnp.cos(ang_LxK2)[:, None, :]


def apply_rope(x_BxLxHxK: jax.Array, sin_Lx1xK2: jax.Array, cos_Lx1xK2: jax.Array) -> jax.Array:
    x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
    sin, cos = sin_Lx1xK2[None], cos_Lx1xK2[None]  # 1×L×1×K/2 against B×L×H×K/2
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxHxK.dtype)


def rope(x_BxLxHxK: jax.Array, base: float) -> jax.Array:
    """RoPE on the last axis (rotate-half layout), positions 0…L−1."""
    _, L, _, K = x_BxLxHxK.shape
    return apply_rope(x_BxLxHxK, *rope_tables(L, K, base))


def _dense(features: int, dtype, name: str, fan_in: int, axes: tuple[str, str]) -> nn.Dense:
    init = nn.with_logical_partitioning(nn.initializers.normal(stddev=fan_in**-0.5), axes)
    return nn.Dense(features, use_bias=False, dtype=dtype, kernel_init=init, name=name)


class QKV(nn.Module):
    """The fused q/k/v projection B×L×D → B×L×3×(H·K); kernel D×3×(H·K), drawn as a Dense(3D)'s D×3D matrix
    and reshaped (the same bytes). When a rule splits "qkv" (tensor) the product keeps the 3 apart, so each chip
    holds whole heads of q, k and v; otherwise it multiplies by the D×3D view, as Dense did (XLA sums that
    kernel's gradient in another order for the D×3×(H·K) product, so numbers would move by an ulp)."""
    dtype: Any

    @nn.compact
    def __call__(self, h_BxLxD):
        D = h_BxLxD.shape[-1]
        normal = nn.initializers.normal(stddev=D**-0.5)
        init = nn.with_logical_partitioning(lambda key, shape, dtype: normal(key, (D, 3 * D), dtype).reshape(shape),
                                            ("embed", None, "qkv"))
        w_Dx3xD = self.param("kernel", init, (D, 3, D), jnp.float32).astype(self.dtype)
        h_BxLxD = h_BxLxD.astype(self.dtype)
        if nn.logical_to_mesh_axes(("qkv",))[0] is not None:
            return jax.lax.dot_general(h_BxLxD, w_Dx3xD, (((2,), (0,)), ((), ())))
        out = jax.lax.dot_general(h_BxLxD, w_Dx3xD.reshape(D, 3 * D), (((2,), (0,)), ((), ())))
        return out.reshape(out.shape[:2] + (3, D))


def target_platform(cfg: ModelConfig) -> str:
    return cfg.platform or jax.default_backend()


SPLASH_BLOCK = 128  # splash tiles (query and key blocks); the sequence length must be a multiple


def splash_attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, interpret: bool) -> jax.Array:
    """Causal multi-head attention with the Pallas splash kernel (jax.experimental.pallas.ops.tpu):
    scores are computed tile by tile in VMEM and never stored whole, forward or backward. The kernel
    takes one sequence (H, L, K); it is vmapped over the batch, and when a mesh is in context
    (`Trainer.in_rules`) wrapped in a shard_map over the mesh axes of the "batch" and "heads" rules (under
    tensor parallelism each chip attends with its own heads), since XLA cannot partition a custom kernel itself. `interpret` runs the kernel's Python body (CPU tests)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    B, L, _, K = q_BxLxHxK.shape
    if L % SPLASH_BLOCK:
        raise ConfigError("model.attention", f"splash needs the sequence length ({L}) to be a multiple of "
                          f"{SPLASH_BLOCK}; use attention=xla")
    blk = SPLASH_BLOCK
    sizes = sk.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk, block_q_dkv=blk, block_kv_dkv=blk,
                          block_kv_dkv_compute=blk, block_q_dq=blk, block_kv_dq=blk)
    dt = q_BxLxHxK.dtype

    def heads_first(x_BxLxHxK):
        return jnp.swapaxes(x_BxLxHxK, 1, 2)

    def attend(q, k, v):  # this chip's rows and heads
        kernel = sk.make_splash_mha(sm.MultiHeadMask([sm.CausalMask((L, L)) for _ in range(q.shape[2])]),
                                    block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)
        out_BxHxLxK = jax.vmap(kernel)(heads_first(q * jnp.asarray(K**-0.5, dt)), heads_first(k), heads_first(v))
        return heads_first(out_BxHxLxK).astype(dt)

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return attend(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK)
    batch_axes, heads_axes = nn.logical_to_mesh_axes(("batch", "heads"))
    spec = (jax.sharding.PartitionSpec(batch_axes, None, heads_axes) if heads_axes
            else jax.sharding.PartitionSpec(batch_axes))
    return jax.shard_map(attend, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)(
        q_BxLxHxK, k_BxLxHxK, v_BxLxHxK)


class Block(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BxLxD, sin_Lx1xK2, cos_Lx1xK2):
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        B, L, D = x_BxLxD.shape
        H, K = cfg.heads, cfg.d_model // cfg.heads
        h = _constrain(RMSNorm(name="attn_norm")(x_BxLxD), ("batch", "length", "embed"))  # sequence=…: gathered
        qkv_BxLx3xHxK = QKV(dt, name="qkv")(h).reshape(B, L, 3, H, K)
        # backward: one concatenate (indexing would pad each and add)
        q, k, v = (t.reshape(B, L, H, K) for t in jnp.split(qkv_BxLx3xHxK, 3, axis=2))
        q, k = RMSNorm(name="q_norm", axis="head_dim")(q), RMSNorm(name="k_norm", axis="head_dim")(k)  # QK-norm
        q, k = apply_rope(q, sin_Lx1xK2, cos_Lx1xK2), apply_rope(k, sin_Lx1xK2, cos_Lx1xK2)
        q, k, v = (_constrain(t, ("batch", "length", "heads", "head_dim")) for t in (q, k, v))
        impl = cfg.attention  # concrete (diloco/resolve.py chose it for the platform)
        if impl in ("dot_product", "cudnn"):
            att_BxLxHxK = jax.nn.dot_product_attention(q, k, v, scale=K**-0.5, is_causal=True,
                                                       implementation="cudnn" if impl == "cudnn" else None)
        elif impl == "splash" and not (self.is_initializing() and L % SPLASH_BLOCK):  # init traces 8 tokens
            att_BxLxHxK = splash_attention(q, k, v, interpret=target_platform(cfg) != "tpu")
        else:
            logits_BxHxLxL = jnp.einsum("blhk,bmhk->bhlm", q, k).astype(jnp.float32) * K**-0.5
            causal_LxL = jnp.tril(jnp.ones((L, L), bool))
            logits_BxHxLxL = jnp.where(causal_LxL[None, None], logits_BxHxLxL, jnp.finfo(jnp.float32).min)
            probs = jax.nn.softmax(logits_BxHxLxL, axis=-1).astype(dt)
            att_BxLxHxK = jnp.einsum("bhlm,bmhk->blhk", probs, v)
        att_BxLxD = att_BxLxHxK.reshape(B, L, D)
        x_BxLxD = x_BxLxD + _dense(D, dt, "attn_out", D, ("heads", "embed"))(att_BxLxD)
        x_BxLxD = _constrain(x_BxLxD, ("batch", "sequence", "embed"))
        h = _constrain(RMSNorm(name="mlp_norm")(x_BxLxD), ("batch", "length", "embed"))
        h_BxLxF = nn.gelu(_dense(cfg.mlp_dim, dt, "mlp_in", D, ("embed", "mlp"))(h))
        h_BxLxF = _constrain(h_BxLxF, ("batch", "length", "mlp"))
        x_BxLxD = x_BxLxD + _dense(D, dt, "mlp_out", cfg.mlp_dim, ("mlp", "embed"))(h_BxLxF)
        return _constrain(x_BxLxD, ("batch", "sequence", "embed")), None


def _remat(block, policy: str, scan: bool):
    if policy == "none":
        return block
    pol = {"full": None, "save_dots": jax.checkpoint_policies.dots_saveable}[policy]
    return nn.remat(block, policy=pol, prevent_cse=not scan)


class Transformer(nn.Module):
    cfg: ModelConfig

    @nn.nowrap
    def init(self, *args, **kwargs):
        """As nn.Module.init, with the parameters unboxed: plain arrays (names: `param_logical_axes`)."""
        return nn.meta.unbox(nn.Module.init(self, *args, **kwargs))

    @nn.compact
    def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=dt, name="embed",
                         embedding_init=nn.with_logical_partitioning(
                             nn.initializers.normal(stddev=cfg.d_model**-0.5), ("vocab", "embed")))
        x_BxLxD = _constrain(embed(tokens_BxL), ("batch", "sequence", "embed"))
        sin, cos = rope_tables(tokens_BxL.shape[1], cfg.d_model // cfg.heads, cfg.rope_base)
        block = _remat(Block, cfg.checkpoint_policy, cfg.scan)
        if cfg.scan:
            stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=cfg.layers,
                            in_axes=(nn.broadcast, nn.broadcast), metadata_params={nn.PARTITION_NAME: "layers"})
            x_BxLxD, _ = stack(cfg, name="blocks")(x_BxLxD, sin, cos)
        else:
            for i in range(cfg.layers):
                x_BxLxD, _ = block(cfg, name=f"block_{i}")(x_BxLxD, sin, cos)
        x_BxLxD = RMSNorm(name="final_norm")(x_BxLxD)
        logits = embed.attend(x_BxLxD).astype(jnp.float32)  # tied output layer, logits in fp32
        return _constrain(logits, ("batch", "length", "vocab"))


def param_logical_axes(cfg: ModelConfig) -> Any:
    """Logical axis names of every parameter: a tree like `init(...)["params"]` with a tuple of names
    (one per dimension) at each leaf. Shape inference only: nothing is allocated."""
    boxed = jax.eval_shape(lambda: nn.Module.init(Transformer(cfg), jax.random.PRNGKey(0),
                                                  jnp.zeros((1, 8), jnp.int32))["params"])
    return jax.tree_util.tree_map(lambda b: tuple(b.names), boxed,
                                  is_leaf=lambda b: isinstance(b, nn.LogicallyPartitioned))


def is_qkv_kernel(path) -> bool:
    """Whether a tree path (of the parameters or a tree shaped like them) ends at the qkv kernel."""
    return [str(getattr(k, "key", k)) for k in path][-2:] == ["qkv", "kernel"]


def matrix_view(path, x):
    """A parameter (or a leaf of a tree shaped like them) as the matrix the math sees: the qkv kernel D×3×(H·K)
    as the D×3D it was (leading axes kept), every other leaf as is. The inner clip's global norm sums each leaf
    in this view: XLA:CPU sums a rank-3 array in another order, which would move the numbers by an ulp."""
    return x.reshape(x.shape[:-2] + (-1,)) if is_qkv_kernel(path) and x.ndim >= 3 else x


def loss_fn(logits_BxLxV: jax.Array, tokens_BxL: jax.Array, z_loss: float = 1e-4):
    """Next-token cross-entropy + z_loss·logsumexp²; token 0 is padding and is masked out.

    Returns (loss, {"ce": …, "z": …, "tokens": …}).

    Written so that forward and backward touch one logits-sized temporary: the last position is masked
    instead of sliced off (its backward would pad a copy of the logits), and the target logit is a
    one-hot dot rather than a gather (whose backward scatters into a zeroed copy); both are exact.
    """
    B, L, V = logits_BxLxV.shape
    targets = jnp.concatenate([tokens_BxL[:, 1:], jnp.zeros((B, 1), tokens_BxL.dtype)], axis=1)
    mask = (targets != 0).astype(jnp.float32)  # the appended 0 masks the last position
    lse = jax.nn.logsumexp(logits_BxLxV, axis=-1)
    target_logit = jnp.sum(logits_BxLxV * jax.nn.one_hot(targets, V, dtype=logits_BxLxV.dtype), axis=-1)
    n = jnp.maximum(mask.sum(), 1.0)
    ce = ((lse - target_logit) * mask).sum() / n
    z = ((lse**2) * mask).sum() / n
    return ce + z_loss * z, {"ce": ce, "z": z, "tokens": mask.sum()}
