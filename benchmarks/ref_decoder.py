"""A minimal decoder of the project's math in plain jax.numpy: the lean baseline for bench_model.py.

Same function as diloco.model.Transformer + loss_fn (pre-norm RMSNorm, no biases, QK-norm, RoPE,
GELU MLP, tied embeddings, fp32 logits, CE + z-loss, token 0 masked), written as directly as JAX
allows: RoPE tables and the causal mask built once per call, the blocks a Python loop over the same
parameter tree the Flax model makes (unrolled layout: params["block_i"]). No Flax, no options.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _norm(x, scale, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def forward(params, tokens, heads: int, rope_base: float = 10_000.0):
    emb = params["embed"]["embedding"]
    B, L = tokens.shape
    D = emb.shape[1]
    K = D // heads
    inv = rope_base ** (-jnp.arange(0, K, 2, dtype=jnp.float32) / K)
    ang = jnp.arange(L, dtype=jnp.float32)[:, None] * inv[None, :]
    sin, cos = jnp.sin(ang)[:, None, :], jnp.cos(ang)[:, None, :]

    def rope(t):
        a, b = jnp.split(t, 2, axis=-1)
        return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    causal = jnp.tril(jnp.ones((L, L), bool))
    x = emb[tokens]
    for i in range(sum(k.startswith("block_") for k in params)):
        p = params[f"block_{i}"]
        h = _norm(x, p["attn_norm"]["scale"])
        q, k, v = jnp.split((h @ p["qkv"]["kernel"].reshape(D, 3 * D)).reshape(B, L, 3 * heads, K), 3, axis=2)
        q, k = rope(_norm(q, p["q_norm"]["scale"])), rope(_norm(k, p["k_norm"]["scale"]))
        s = jnp.einsum("blhk,bmhk->bhlm", q, k) * K**-0.5
        a = jax.nn.softmax(jnp.where(causal, s, jnp.finfo(jnp.float32).min), axis=-1)
        x = x + jnp.einsum("bhlm,bmhk->blhk", a, v).reshape(B, L, D) @ p["attn_out"]["kernel"]
        h = jax.nn.gelu(_norm(x, p["mlp_norm"]["scale"]) @ p["mlp_in"]["kernel"])
        x = x + h @ p["mlp_out"]["kernel"]
    return _norm(x, params["final_norm"]["scale"]) @ emb.T


def loss(params, tokens, heads: int, z_loss: float = 1e-4):
    logits = forward(params, tokens, heads)[:, :-1]
    targets = tokens[:, 1:]
    mask = (targets != 0).astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    tl = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    n = jnp.maximum(mask.sum(), 1.0)
    ce = ((lse - tl) * mask).sum() / n
    return ce + z_loss * ((lse * lse) * mask).sum() / n, ce
