"""Outer-gradient codecs: what one replica puts on the wire for a fragment's Δ, and back.

    payload = encode(codec, x_N, key)      # dict of the arrays that cross the network
    x_hat_N = decode(codec, payload, n)    # float32 (n,); the receiver averages these in FP32
    encoded_nbytes(codec, n) == sum(a.size * a.dtype.itemsize for a in payload.values())

Pure functions with static shapes: they work under jax.jit and jax.vmap (leading replica axis).
Formats (docs/codecs.md has the byte layouts):

  none      {"values": float32 (n,)}                                   4 bytes/elem
  bf16      {"values": bfloat16 (n,)}                                  2 bytes/elem, no scale
  fp8_e4m3  {"values": float8_e4m3fn (n,), "scales": float32 (nb,)}   per-block: scale = absmax/448
  fp8_e5m2  {"values": float8_e5m2 (n,),   "scales": float32 (nb,)}   per-block: scale = absmax/57344
  e3m0      {"codes": uint8 (ceil(n/2),),  "scales": float32 (nb,)}   4-bit, two codes per byte

E3M0 (1 sign, 3 exponent, 0 mantissa bits): per block of `block_size` elements the scale s is the
block's absmax (float32). Exponent code e ∈ 0..7 means magnitude 0 (e = 0) or s·2^(e-7) (e = 1..7),
so the largest code maps exactly to the absmax and the smallest non-zero magnitude is s/64. The nibble
is (sign << 3) | e; with m = n rounded up to even, byte i holds element i in its low nibble and element
i + m/2 in its high nibble (the two halves, not neighbours: whole-lane arrays on TPU).
Zero is always encoded with sign 0. Inputs must be finite.

Rounding is in the *linear* domain: "nearest" picks the closest representable magnitude (midpoints
0.75·2^k, and 2^-7·s between 0 and the smallest level; ties go up), which minimises each element's
squared error — what matters when decoded values are summed/averaged. "stochastic" rounds up between
the two neighbouring levels with probability (r - lo)/(hi - lo), so E[decode(encode(x))] = x; zero is
a level and s = absmax, so every input is inside the representable range. For bf16/fp8, "nearest" is
XLA's round-to-nearest-even cast and "stochastic" picks between the two neighbouring values of the
target format the same way.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from diloco.errors import ConfigError
from diloco.outer import sparsify

CODEC_NAMES = ("none", "bf16", "fp8_e4m3", "fp8_e5m2", "e3m0")
SPARSE_NAMES = sparsify.SPARSE_NAMES
ALL_NAMES = CODEC_NAMES + SPARSE_NAMES
ROUNDINGS = ("nearest", "stochastic")

# E3M0 magnitude of exponent code e (times the block scale): 0, 2^-6, ..., 2^0.
E3M0_LEVELS = np.array([0.0] + [2.0 ** (e - 7) for e in range(1, 8)], np.float32)  # (8,)
# Linear-domain midpoints between consecutive levels: r >= _E3M0_MIDS[e-1] rounds to code >= e.
_E3M0_MIDS = (E3M0_LEVELS[:-1] + E3M0_LEVELS[1:]) / 2  # (7,)

# Float formats: (dtype, max finite value, bit pattern of the max finite magnitude, uint type).
_FLOATS = {
    "bf16": (jnp.bfloat16, float(jnp.finfo(jnp.bfloat16).max), 0x7F7F, jnp.uint16),
    "fp8_e4m3": (jnp.float8_e4m3fn, 448.0, 0x7E, jnp.uint8),
    "fp8_e5m2": (jnp.float8_e5m2, 57344.0, 0x7B, jnp.uint8),
}


@dataclasses.dataclass(frozen=True)
class Codec:
    name: str = "none"          # one of ALL_NAMES
    block_size: int = 256       # elements per scale block (fp8, e3m0); unit size for "dropout"
    rounding: str = "nearest"   # "nearest" | "stochastic"
    keep_fraction: float = 1.0  # sparsifiers only: fraction of elements (units) kept


def codec_from_config(cfg, name: str | None = None) -> "Codec":
    """The codec a run's config asks for (`codec`, `codec_block_size`, `codec_rounding`, and
    `codec_keep_fraction` for the pruning baselines); `name` overrides `cfg.codec`."""
    name = name or cfg.codec
    keep = {"keep_fraction": cfg.codec_keep_fraction} if name in ("topk", "dropout", "dare") else {}
    return make_codec(name, cfg.codec_block_size, cfg.codec_rounding, **keep)


def make_codec(name: str, block_size: int = 256, rounding: str = "nearest",
               keep_fraction: float | None = None) -> Codec:
    """Validated Codec; ConfigError names the bad field and the valid values."""
    if name not in ALL_NAMES:
        raise ConfigError("codec", f"unknown codec {name!r}; valid: {', '.join(ALL_NAMES)}")
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ConfigError("codec_block_size", f"block_size={block_size!r} must be an integer >= 1")
    if rounding not in ROUNDINGS:
        raise ConfigError("codec_rounding", f"unknown rounding {rounding!r}; valid: {', '.join(ROUNDINGS)}")
    if name in SPARSE_NAMES:
        if keep_fraction is None:
            raise ConfigError("codec_keep_fraction", f"codec {name!r} needs keep_fraction in (0, 1]")
        if not 0.0 < float(keep_fraction) <= 1.0:
            raise ConfigError("codec_keep_fraction", f"keep_fraction={keep_fraction!r} must be in (0, 1]")
    elif keep_fraction not in (None, 1.0):
        raise ConfigError("codec_keep_fraction",
                          f"keep_fraction={keep_fraction!r} only applies to {', '.join(SPARSE_NAMES)}; "
                          f"codec {name!r} keeps every element")
    kf = 1.0 if keep_fraction is None else float(keep_fraction)
    return Codec(name=name, block_size=int(block_size), rounding=rounding, keep_fraction=kf)


def num_blocks(n: int, block_size: int) -> int:
    return -(-n // block_size)


def encoded_nbytes(codec: Codec, n: int) -> int:
    """Exact bytes of encode(codec, x) for x of length n."""
    nb = num_blocks(n, codec.block_size)
    if codec.name == "none":
        return 4 * n
    if codec.name == "bf16":
        return 2 * n
    if codec.name in ("fp8_e4m3", "fp8_e5m2"):
        return n + 4 * nb
    if codec.name == "e3m0":
        return (n + 1) // 2 + 4 * nb
    if codec.name in SPARSE_NAMES:
        return sparsify.sparse_nbytes(codec.name, n, codec.keep_fraction, codec.block_size)
    raise ConfigError("codec", f"unknown codec {codec.name!r}; valid: {', '.join(ALL_NAMES)}")


def bits_per_element(codec: Codec, n: int) -> float:
    return 8.0 * encoded_nbytes(codec, n) / n


def matched_keep_fraction(name: str, target_bytes: int | Codec, n: int, block_size: int = 256) -> float:
    """Keep fraction whose payload is the largest not exceeding target_bytes (or a target codec's bytes).

    make_codec(name, block_size, keep_fraction=matched_keep_fraction(...)) then keeps exactly that count.
    """
    if name not in SPARSE_NAMES:
        raise ConfigError("codec", f"{name!r} is not a sparsifier; valid: {', '.join(SPARSE_NAMES)}")
    if isinstance(target_bytes, Codec):
        target_bytes = encoded_nbytes(target_bytes, n)
    k, m = sparsify.matched_count(name, int(target_bytes), n, block_size)
    if k < 1:
        raise ConfigError("codec_keep_fraction",
                          f"{target_bytes} bytes cannot carry even one kept item of {name!r} (n={n})")
    return k / m


# ---------------------------------------------------------------------------------------------
# helpers

def _blocks(x_N: jax.Array, block_size: int) -> jax.Array:
    n = x_N.shape[0]
    nb = num_blocks(n, block_size)
    return jnp.pad(x_N, (0, nb * block_size - n)).reshape(nb, block_size)


def _per_element(scale_B: jax.Array, block_size: int, n: int) -> jax.Array:
    """Each block's scale repeated over its elements, (n,): a broadcast and reshape (jnp.repeat lowers to
    a gather that libtpu took minutes to compile at 1M elements)."""
    nb = scale_B.shape[0]
    return jnp.broadcast_to(scale_B[:, None], (nb, block_size)).reshape(nb * block_size)[:n]


def _need_key(codec: Codec, key: jax.Array | None) -> jax.Array:
    if key is None:
        raise ConfigError("key", f"codec {codec.name!r} with rounding={codec.rounding!r} draws random "
                                 "numbers: call encode(codec, x, key) with a jax.random key")
    return key


def _stochastic_cast(a: jax.Array, fmt: str, key: jax.Array) -> jax.Array:
    """Unbiased stochastic rounding of non-negative float32 `a` (<= max finite) to format `fmt`."""
    dtype, _, max_bits, utype = _FLOATS[fmt]
    q = a.astype(dtype)
    qb = jax.lax.bitcast_convert_type(q, utype)
    above = q.astype(jnp.float32) > a
    lo_b = jnp.where(above, qb - 1, qb).astype(utype)          # qb > 0 whenever above (a >= 0)
    hi_b = jnp.where(above, qb, jnp.minimum(qb + 1, max_bits)).astype(utype)
    lo = jax.lax.bitcast_convert_type(lo_b, dtype).astype(jnp.float32)
    hi = jax.lax.bitcast_convert_type(hi_b, dtype).astype(jnp.float32)
    gap = hi - lo
    p_up = jnp.where(gap > 0, (a - lo) / jnp.where(gap > 0, gap, 1.0), 0.0)
    up = jax.random.uniform(key, a.shape) < p_up
    return jax.lax.bitcast_convert_type(jnp.where(up, hi_b, lo_b), dtype)


def _signed_cast(y: jax.Array, fmt: str, rounding: str, key: jax.Array | None) -> jax.Array:
    dtype, fmax, _, _ = _FLOATS[fmt]
    if rounding == "nearest":
        return jnp.clip(y, -fmax, fmax).astype(dtype)
    mag = _stochastic_cast(jnp.minimum(jnp.abs(y), fmax), fmt, key)
    return jnp.where(y < 0, -mag, mag)


def _e3m0_codes(r: jax.Array, rounding: str, key: jax.Array | None) -> jax.Array:
    """Exponent codes 0..7 (uint8) of magnitudes r in [0, 1] (already divided by the block scale)."""
    if rounding == "nearest":
        code = sum((r >= float(t)).astype(jnp.uint8) for t in _E3M0_MIDS)
        return jnp.asarray(code, jnp.uint8)
    lo = sum((r >= float(t)).astype(jnp.uint8) for t in E3M0_LEVELS[1:])  # largest level <= r
    lo = jnp.asarray(lo, jnp.uint8)
    hi = jnp.minimum(lo + 1, 7).astype(jnp.uint8)
    levels = jnp.asarray(E3M0_LEVELS)
    lo_v, hi_v = levels[lo], levels[hi]
    gap = hi_v - lo_v
    p_up = jnp.where(gap > 0, (r - lo_v) / jnp.where(gap > 0, gap, 1.0), 0.0)
    up = jax.random.uniform(key, r.shape) < p_up
    return jnp.where(up, hi, lo).astype(jnp.uint8)


def pack_nibbles(nib_N: jax.Array) -> jax.Array:
    """uint8 (n,) values < 16 -> uint8 (ceil(n/2),): with m = n rounded up to even, byte i holds element
    i in its low nibble and element i + m/2 in its high nibble. (Pairing the two halves, not neighbours,
    keeps every array whole-lane on TPU: interleaving neighbours reshapes to a minor dimension of 2,
    which took libtpu minutes to compile for a 1M-element fragment.)"""
    n = nib_N.shape[0]
    nib = jnp.pad(nib_N, (0, n % 2))
    half = nib.shape[0] // 2
    return (nib[:half] | (nib[half:] << 4)).astype(jnp.uint8)


def unpack_nibbles(packed: jax.Array, n: int) -> jax.Array:
    return jnp.concatenate([packed & 0x0F, packed >> 4])[:n].astype(jnp.uint8)


# ---------------------------------------------------------------------------------------------
# encode / decode

def encode(codec: Codec, x: jax.Array, key: jax.Array | None = None) -> dict[str, jax.Array]:
    """x: 1-D float (n,) -> dict of the arrays that cross the network."""
    if x.ndim != 1:
        raise ConfigError("x", f"encode takes a flat 1-D vector, got shape {x.shape}; ravel the fragment first")
    x_N = x.astype(jnp.float32)
    n = x_N.shape[0]
    name, bs = codec.name, codec.block_size
    stochastic = codec.rounding == "stochastic"
    if name == "none":
        return {"values": x_N}
    if name == "bf16":
        key = _need_key(codec, key) if stochastic else None
        return {"values": _signed_cast(x_N, "bf16", codec.rounding, key)}
    if name in ("fp8_e4m3", "fp8_e5m2"):
        key = _need_key(codec, key) if stochastic else None
        fmax = _FLOATS[name][1]
        x_BxS = _blocks(x_N, bs)
        scale_B = jnp.max(jnp.abs(x_BxS), axis=1) / fmax
        safe_B = jnp.where(scale_B > 0, scale_B, 1.0)
        y_N = x_N / _per_element(safe_B, bs, n)
        return {"values": _signed_cast(y_N, name, codec.rounding, key), "scales": scale_B}
    if name == "e3m0":
        key = _need_key(codec, key) if stochastic else None
        x_BxS = _blocks(x_N, bs)
        scale_B = jnp.max(jnp.abs(x_BxS), axis=1)
        safe_B = jnp.where(scale_B > 0, scale_B, 1.0)
        r_N = jnp.minimum(jnp.abs(x_N) / _per_element(safe_B, bs, n), 1.0)
        code_N = _e3m0_codes(r_N, codec.rounding, key)
        sign_N = ((x_N < 0) & (code_N > 0)).astype(jnp.uint8)
        return {"codes": pack_nibbles(code_N | (sign_N << 3)), "scales": scale_B}
    if name == "topk":
        return sparsify.topk_encode(x_N, codec.keep_fraction)
    if name == "dare":
        return sparsify.dare_encode(x_N, codec.keep_fraction, _need_key(codec, key))
    if name == "dropout":
        return sparsify.dropout_encode(x_N, codec.keep_fraction, bs, _need_key(codec, key))
    raise ConfigError("codec", f"unknown codec {name!r}; valid: {', '.join(ALL_NAMES)}")


def decode(codec: Codec, payload: dict[str, jax.Array], n: int) -> jax.Array:
    """payload from encode(codec, x) with len(x) == n -> float32 (n,)."""
    name, bs = codec.name, codec.block_size
    if name in ("none", "bf16"):
        return payload["values"].astype(jnp.float32)
    if name in ("fp8_e4m3", "fp8_e5m2"):
        return payload["values"].astype(jnp.float32) * _per_element(payload["scales"], bs, n)
    if name == "e3m0":
        nib_N = unpack_nibbles(payload["codes"], n)
        mag_N = jnp.asarray(E3M0_LEVELS)[nib_N & 0x07]
        val_N = jnp.where((nib_N >> 3) == 1, -mag_N, mag_N)
        return val_N * _per_element(payload["scales"].astype(jnp.float32), bs, n)
    if name == "topk":
        return sparsify.topk_decode(payload, n)
    if name == "dare":
        return sparsify.dare_decode(payload, n)
    if name == "dropout":
        return sparsify.dropout_decode(payload, n, bs)
    raise ConfigError("codec", f"unknown codec {name!r}; valid: {', '.join(ALL_NAMES)}")


def roundtrip(codec: Codec, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
    """decode(encode(x)): what the receiver sees, float32 (n,)."""
    return decode(codec, encode(codec, x, key), x.shape[0])
