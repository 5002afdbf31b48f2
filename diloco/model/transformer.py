"""Chinchilla-style decoder: pre-norm RMSNorm, no biases, QK-norm, RoPE, plain MLP, tied embeddings.

Shapes are in names: B batch, L length, D d_model, H heads, K head dim, F mlp dim, V vocab.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    layers: int
    d_model: int
    heads: int
    mlp_dim: int
    max_seq_len: int = 2048
    dtype: str = "float32"  # compute dtype; params stay float32
    remat: bool = False
    scan: bool = False  # nn.scan over blocks: params stacked on a leading layer axis under "blocks"
    rope_base: float = 10_000.0

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

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32**2, axis=-1, keepdims=True) + self.eps)
        return (y * scale).astype(x.dtype)


def rope(x_BxLxHxK: jax.Array, base: float) -> jax.Array:
    B, L, H, K = x_BxLxHxK.shape
    inv_freq = base ** (-jnp.arange(0, K, 2, dtype=jnp.float32) / K)
    ang_LxK2 = jnp.arange(L, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    sin, cos = jnp.sin(ang_LxK2)[None, :, None, :], jnp.cos(ang_LxK2)[None, :, None, :]
    x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxHxK.dtype)


def _dense(features: int, dtype, name: str, fan_in: int) -> nn.Dense:
    init = nn.initializers.normal(stddev=fan_in**-0.5)
    return nn.Dense(features, use_bias=False, dtype=dtype, kernel_init=init, name=name)


class Block(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BxLxD, _=None):
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        B, L, D = x_BxLxD.shape
        H, K = cfg.heads, cfg.d_model // cfg.heads
        h = RMSNorm(name="attn_norm")(x_BxLxD)
        qkv = _dense(3 * D, dt, "qkv", D)(h).reshape(B, L, 3, H, K)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        q, k = RMSNorm(name="q_norm")(q), RMSNorm(name="k_norm")(k)  # QK-norm over the head dim
        q, k = rope(q, cfg.rope_base), rope(k, cfg.rope_base)
        logits_BxHxLxL = jnp.einsum("blhk,bmhk->bhlm", q, k).astype(jnp.float32) * K**-0.5
        causal_LxL = jnp.tril(jnp.ones((L, L), bool))
        logits_BxHxLxL = jnp.where(causal_LxL, logits_BxHxLxL, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(logits_BxHxLxL, axis=-1).astype(dt)
        att_BxLxD = jnp.einsum("bhlm,bmhk->blhk", probs, v).reshape(B, L, D)
        x_BxLxD = x_BxLxD + _dense(D, dt, "attn_out", D)(att_BxLxD)
        h = RMSNorm(name="mlp_norm")(x_BxLxD)
        h_BxLxF = nn.gelu(_dense(cfg.mlp_dim, dt, "mlp_in", D)(h))
        x_BxLxD = x_BxLxD + _dense(D, dt, "mlp_out", cfg.mlp_dim)(h_BxLxF)
        return x_BxLxD, None


class Transformer(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=dt, name="embed",
                         embedding_init=nn.initializers.normal(stddev=cfg.d_model**-0.5))
        x_BxLxD = embed(tokens_BxL)
        block = nn.remat(Block) if cfg.remat else Block
        if cfg.scan:
            stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                            length=cfg.layers)
            x_BxLxD, _ = stack(cfg, name="blocks")(x_BxLxD, None)
        else:
            for i in range(cfg.layers):
                x_BxLxD, _ = block(cfg, name=f"block_{i}")(x_BxLxD)
        x_BxLxD = RMSNorm(name="final_norm")(x_BxLxD)
        return embed.attend(x_BxLxD).astype(jnp.float32)  # tied output layer, logits in fp32


def loss_fn(logits_BxLxV: jax.Array, tokens_BxL: jax.Array, z_loss: float = 1e-4):
    """Next-token cross-entropy + z_loss·logsumexp²; token 0 is padding and is masked out.

    Returns (loss, {"ce": …, "z": …, "tokens": …}).
    """
    logits, targets = logits_BxLxV[:, :-1], tokens_BxL[:, 1:]
    mask = (targets != 0).astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    n = jnp.maximum(mask.sum(), 1.0)
    ce = ((lse - target_logit) * mask).sum() / n
    z = ((lse**2) * mask).sum() / n
    return ce + z_loss * z, {"ce": ce, "z": z, "tokens": mask.sum()}
