"""Sparsifying "codecs" for the compression ablation ([SD] §3.3, Fig. 11): Top-K, FedDropout, DARE.

Each sends a static number k of float32 values (static shapes, so jit/vmap work), plus
  topk:    int32 indices (k,)                       -> 8·k bytes
  dare:    one uint32 seed; receiver regenerates the element mask     -> 4·k + 4 bytes
  dropout: one uint32 seed; mask over *units* of `unit` contiguous elements
           (FedDropout drops whole units, not single weights)         -> 4·k_units·unit + 4 bytes
Random masks draw k indices without replacement, so every element (unit) is kept with probability
k/n, and the receiver rescales by n/k (= 1/keep): E[decode(encode(x))] = x. Top-K is not rescaled
(it is deterministic and biased by design). Their registry records (names, byte counts, the kept count
matched to a byte budget) are in diloco/outer/codecs.py `FORMATS`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

def keep_count(keep_fraction: float, m: int) -> int:
    """Static number of kept items out of m: round(keep·m) clipped to [1, m]."""
    return min(m, max(1, int(round(keep_fraction * m))))


def num_units(n: int, unit: int) -> int:
    return -(-n // unit)


def _subset(seed_1: jax.Array, m: int, k: int) -> jax.Array:
    """k distinct indices in [0, m), a pure function of the uint32 seed (sender and receiver agree)."""
    return jax.random.permutation(jax.random.PRNGKey(seed_1[0]), m)[:k]


def _seed(key: jax.Array) -> jax.Array:
    return jax.random.bits(key, (1,), jnp.uint32)


# ---- encode: x_N float32 -> payload ----

def topk_encode(x_N: jax.Array, keep_fraction: float) -> dict[str, jax.Array]:
    k = keep_count(keep_fraction, x_N.shape[0])
    _, idx_K = jax.lax.top_k(jnp.abs(x_N), k)
    idx_K = idx_K.astype(jnp.int32)
    return {"values": x_N[idx_K], "indices": idx_K}


def dare_encode(x_N: jax.Array, keep_fraction: float, key: jax.Array) -> dict[str, jax.Array]:
    n = x_N.shape[0]
    seed = _seed(key)
    idx_K = _subset(seed, n, keep_count(keep_fraction, n))
    return {"values": x_N[idx_K], "seed": seed}


def dropout_encode(x_N: jax.Array, keep_fraction: float, unit: int,
                   key: jax.Array) -> dict[str, jax.Array]:
    n = x_N.shape[0]
    nu = num_units(n, unit)
    seed = _seed(key)
    uid_K = _subset(seed, nu, keep_count(keep_fraction, nu))
    x_UxS = jnp.pad(x_N, (0, nu * unit - n)).reshape(nu, unit)
    return {"values": x_UxS[uid_K].reshape(-1), "seed": seed}


# ---- decode: payload -> float32 (n,) ----

def topk_decode(payload: dict[str, jax.Array], n: int) -> jax.Array:
    return jnp.zeros((n,), jnp.float32).at[payload["indices"]].set(
        payload["values"].astype(jnp.float32))


def dare_decode(payload: dict[str, jax.Array], n: int) -> jax.Array:
    vals_K = payload["values"].astype(jnp.float32)
    k = vals_K.shape[0]
    idx_K = _subset(payload["seed"], n, k)
    return jnp.zeros((n,), jnp.float32).at[idx_K].set(vals_K * (n / k))


def dropout_decode(payload: dict[str, jax.Array], n: int, unit: int) -> jax.Array:
    nu = num_units(n, unit)
    vals_KxS = payload["values"].astype(jnp.float32).reshape(-1, unit)
    ku = vals_KxS.shape[0]
    uid_K = _subset(payload["seed"], nu, ku)
    out_UxS = jnp.zeros((nu, unit), jnp.float32).at[uid_K].set(vals_KxS * (nu / ku))
    return out_UxS.reshape(-1)[:n]


__all__ = ["keep_count", "num_units", "topk_encode", "dare_encode", "dropout_encode", "topk_decode", "dare_decode",
           "dropout_decode"]
