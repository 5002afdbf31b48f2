"""Outer-gradient codecs: what one replica puts on the wire for a fragment's Δ, and back.

    payload = encode(codec, x_N, key)      # dict of the arrays that cross the network
    x_hat_N = decode(codec, payload, n)    # float32 (n,); the receiver averages these in FP32
    encoded_nbytes(codec, n) == sum(a.size * a.dtype.itemsize for a in payload.values())

Pure functions with static shapes: they work under jax.jit and jax.vmap (leading replica axis).
`FORMATS` is the registry: one `Format` record per name (encode, decode, bytes, the unit a replica's
chips may split a fragment by, the family reports label runs by, whether it draws random numbers);
everything else (OuterSync, methods.classify, `diloco bytes`, the tests) asks it. A new format is one
entry (docs/extending.md); docs/codecs.md has every format's payload and byte layout.

E3M0 (1 sign, 3 exponent, 0 mantissa bits): per block of `block_size` elements the scale s is the
block's absmax (float32). Exponent code e ∈ 0..7 means magnitude 0 (e = 0) or s·2^(e-7) (e = 1..7),
so the largest code maps exactly to the absmax and the smallest non-zero magnitude is s/64. The nibble
is (sign << 3) | e; with m = n rounded up to even, byte i holds element i in its low nibble and element
i + m/2 in its high nibble (the two halves, not neighbours: whole-lane arrays on TPU).
Zero is always encoded with sign 0. Inputs must be finite. Edge cases (bf16 aside, every scaled codec):
a NaN or ±Inf in a block makes its scale non-finite and the whole block decodes to NaN (Inf's sign is lost);
a block whose absmax is below float32's smallest normal (1.18e-38) decodes to zeros; an
element exactly on an E3M0 or int2 rounding threshold lands there through x/s in float32,
so which side of a tie it takes depends on that division's rounding (implementations differ at ties).

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

from typing import Callable

from diloco.errors import ConfigError
from diloco.outer import lowbit, sparsify

ROUNDINGS = ("nearest", "stochastic")
FAMILIES = ("fp32", "bf16", "fp8", "fp4", "int2", "sparse")  # what a report's label says a run sent (methods.classify)

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
    name: str = "none"          # a key of FORMATS
    block_size: int = 256       # elements per scale block (fp8, e3m0); unit size for "dropout"
    rounding: str = "nearest"   # "nearest" | "stochastic"
    keep_fraction: float = 1.0  # sparsifiers only: fraction of elements (units) kept


def codec_from_config(cfg, name: str | None = None) -> "Codec":
    """The codec a run's config asks for (`codec`, `codec_block_size`, `codec_rounding`, and
    `codec_keep_fraction` for the pruning baselines); `name` overrides `cfg.codec`."""
    name = name or cfg.codec
    keep = {"keep_fraction": cfg.codec_keep_fraction} if name in SPARSE_NAMES else {}
    return make_codec(name, cfg.codec_block_size, cfg.codec_rounding, **keep)


def make_codec(name: str, block_size: int = 256, rounding: str = "nearest",
               keep_fraction: float | None = None) -> Codec:
    """Validated Codec; ConfigError names the bad field and the valid values."""
    if name not in FORMATS:
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


def fmt(codec: Codec) -> "Format":
    """The registry record of a codec's format."""
    return FORMATS[codec.name]


def encoded_nbytes(codec: Codec, n: int) -> int:
    """Exact bytes of encode(codec, x) for x of length n."""
    return int(fmt(codec).nbytes(codec, n))


def bits_per_element(codec: Codec, n: int) -> float:
    return 8.0 * encoded_nbytes(codec, n) / n


def stochastic(codec: Codec) -> bool:
    """Whether encode draws random numbers (then it needs a key, and its chips cannot split it)."""
    draws = fmt(codec).draws
    return draws == "always" or (draws == "rounding" and codec.rounding == "stochastic")


def split_unit(codec: Codec) -> int:
    """Elements of one chip's slice must be a multiple of this for its encoding to be the unsplit
    one's byte for byte; 0: it cannot be split (random draws depend on the whole vector)."""
    return 0 if stochastic(codec) else int(fmt(codec).unit(codec))


def family(name: str) -> str:
    """The family (one of FAMILIES) of a codec name; a name not in the registry (a record written by other
    code) is its own family."""
    return FORMATS[name].family if name in FORMATS else str(name)


def matched_keep_fraction(name: str, target_bytes: int | Codec, n: int, block_size: int = 256) -> float:
    """Keep fraction whose payload is the largest not exceeding target_bytes (or a target codec's bytes).

    make_codec(name, block_size, keep_fraction=matched_keep_fraction(...)) then keeps exactly that count
    (the registry's byte count, searched over the kept count k of m items: elements, or units)."""
    if name not in SPARSE_NAMES:
        raise ConfigError("codec", f"{name!r} is not a sparsifier; valid: {', '.join(SPARSE_NAMES)}")
    if isinstance(target_bytes, Codec):
        target_bytes = encoded_nbytes(target_bytes, n)
    m = sparsify.num_units(n, block_size) if name == "dropout" else n
    size = lambda k: encoded_nbytes(Codec(name, block_size, "nearest", k / m), n)
    lo, hi = 0, m  # the largest k in 1..m with size(k) <= target (size grows with k)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if size(mid) <= int(target_bytes) else (lo, mid - 1)
    if lo < 1:
        raise ConfigError("codec_keep_fraction",
                          f"{target_bytes} bytes cannot carry even one kept item of {name!r} (n={n})")
    return lo / m


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
# the formats' encode / decode: (codec, x_N float32, key or None) -> payload; (codec, payload, n) -> x_N

def _values_encode(codec, x_N, key):
    return {"values": x_N}


def _values_decode(codec, payload, n):
    return payload["values"].astype(jnp.float32)


def _bf16_encode(codec, x_N, key):
    return {"values": _signed_cast(x_N, "bf16", codec.rounding, key)}


def _fp8_encode(codec, x_N, key):
    bs, fmax = codec.block_size, _FLOATS[codec.name][1]
    scale_B = jnp.max(jnp.abs(_blocks(x_N, bs)), axis=1) / fmax
    safe_B = jnp.where(scale_B > 0, scale_B, 1.0)
    y_N = x_N / _per_element(safe_B, bs, x_N.shape[0])
    return {"values": _signed_cast(y_N, codec.name, codec.rounding, key), "scales": scale_B}


def _fp8_decode(codec, payload, n):
    return payload["values"].astype(jnp.float32) * _per_element(payload["scales"], codec.block_size, n)


def _e3m0_encode(codec, x_N, key):
    bs = codec.block_size
    scale_B = jnp.max(jnp.abs(_blocks(x_N, bs)), axis=1)
    safe_B = jnp.where(scale_B > 0, scale_B, 1.0)
    r_N = jnp.minimum(jnp.abs(x_N) / _per_element(safe_B, bs, x_N.shape[0]), 1.0)
    code_N = _e3m0_codes(r_N, codec.rounding, key)
    sign_N = ((x_N < 0) & (code_N > 0)).astype(jnp.uint8)
    return {"codes": pack_nibbles(code_N | (sign_N << 3)), "scales": scale_B}


def _e3m0_decode(codec, payload, n):
    nib_N = unpack_nibbles(payload["codes"], n)
    mag_N = jnp.asarray(E3M0_LEVELS)[nib_N & 0x07]
    val_N = jnp.where((nib_N >> 3) == 1, -mag_N, mag_N)
    return val_N * _per_element(payload["scales"].astype(jnp.float32), codec.block_size, n)


# -- values each format reproduces exactly (the registry's `exact`, for the invariants test) ----------

def _grid_blocks(levels, codec: Codec, n: int, scale: float = 2.0 ** -5) -> np.ndarray:
    """n values laid out in blocks, each block holding the largest level first (so the block's scale is
    `scale`), then signed levels cycling: decode(encode(x)) == x for a format with these levels."""
    rng = np.random.default_rng(n)
    levels = np.asarray(levels, np.float64)
    x = rng.choice(levels, n) * rng.choice([-1.0, 1.0], n)
    x[::codec.block_size] = levels.max()
    return (x * scale).astype(np.float32)


def _float_grid(dtype) -> np.ndarray:
    """Every finite non-negative value of a float8 format (from its bit patterns)."""
    v = np.arange(256, dtype=np.uint8).view(jnp.dtype(dtype)).astype(np.float32)
    return np.unique(v[np.isfinite(v) & (v >= 0)])


def _any_values(codec: Codec, n: int) -> np.ndarray:
    return np.random.default_rng(n).standard_normal(n).astype(np.float32)


def _bf16_values(codec: Codec, n: int) -> np.ndarray:
    return _any_values(codec, n).astype(jnp.bfloat16).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Format:
    """One outer-gradient format: everything the code asks about it (the registry's record)."""
    name: str
    family: str                                  # one of FAMILIES: the label a report gives its runs
    encode: Callable                             # (codec, x_N f32, key | None) -> payload (dict of arrays)
    decode: Callable                             # (codec, payload, n) -> f32 (n,)
    nbytes: Callable[[Codec, int], int]          # (codec, n) -> exact payload bytes
    unit: Callable[[Codec], int]                 # elements per chip-split unit (0: never split)
    draws: str                                   # random numbers: "never" | "rounding" (stochastic) | "always"
    exact: Callable[[Codec, int], np.ndarray]    # (codec, n) -> values decode(encode(x)) returns as they are
    sum_reduce: bool = False                     # the payload is the values: exchanged as one psum
    keeps: bool = False                          # takes codec_keep_fraction (sparsifiers)


_blocks_of = lambda c: c.block_size  # noqa: E731  (a scale block is the unit)
_e3m0_exact = lambda c, n: _grid_blocks(E3M0_LEVELS, c, n)  # noqa: E731
FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("none", "fp32", _values_encode, _values_decode, lambda c, n: 4 * n, lambda c: 1, "never",
           _any_values, sum_reduce=True),
    Format("bf16", "bf16", _bf16_encode, _values_decode, lambda c, n: 2 * n, lambda c: 1, "rounding",
           _bf16_values),
    Format("fp8_e4m3", "fp8", _fp8_encode, _fp8_decode, lambda c, n: n + 4 * num_blocks(n, c.block_size),
           _blocks_of, "rounding", lambda c, n: _grid_blocks(_float_grid(jnp.float8_e4m3fn), c, n)),
    Format("fp8_e5m2", "fp8", _fp8_encode, _fp8_decode, lambda c, n: n + 4 * num_blocks(n, c.block_size),
           _blocks_of, "rounding", lambda c, n: _grid_blocks(_float_grid(jnp.float8_e5m2), c, n)),
    Format("e3m0", "fp4", _e3m0_encode, _e3m0_decode, lambda c, n: (n + 1) // 2 + 4 * num_blocks(n, c.block_size),
           lambda c: int(np.lcm(c.block_size, 2)), "rounding", _e3m0_exact),  # two nibbles per byte
    Format("int2", "int2", lambda c, x, k: lowbit.encode(x, c.block_size, c.rounding, k),  # 2-bit, lowbit.py
           lambda c, p, n: lowbit.decode(p, n, c.block_size), lambda c, n: lowbit.nbytes(n, c.block_size),
           lambda c: int(np.lcm(c.block_size, 4)), "rounding",  # four codes per byte
           lambda c, n: _grid_blocks(np.abs(lowbit.LEVELS[2:]), c, n)),
    Format("topk", "sparse", lambda c, x, k: sparsify.topk_encode(x, c.keep_fraction),
           lambda c, p, n: sparsify.topk_decode(p, n), lambda c, n: 8 * sparsify.keep_count(c.keep_fraction, n),
           lambda c: 0, "never", _any_values, keeps=True),
    Format("dropout", "sparse", lambda c, x, k: sparsify.dropout_encode(x, c.keep_fraction, c.block_size, k),
           lambda c, p, n: sparsify.dropout_decode(p, n, c.block_size),
           lambda c, n: 4 * sparsify.keep_count(c.keep_fraction, sparsify.num_units(n, c.block_size)) * c.block_size + 4,
           lambda c: 0, "always", _any_values, keeps=True),
    Format("dare", "sparse", lambda c, x, k: sparsify.dare_encode(x, c.keep_fraction, k),
           lambda c, p, n: sparsify.dare_decode(p, n), lambda c, n: 4 * sparsify.keep_count(c.keep_fraction, n) + 4,
           lambda c: 0, "always", _any_values, keeps=True),
)}
ALL_NAMES = tuple(FORMATS)
SPARSE_NAMES = tuple(n for n, f in FORMATS.items() if f.keeps)
CODEC_NAMES = tuple(n for n in FORMATS if n not in SPARSE_NAMES)  # the dense formats


def encode(codec: Codec, x: jax.Array, key: jax.Array | None = None) -> dict[str, jax.Array]:
    """x: 1-D float (n,) -> dict of the arrays that cross the network."""
    if x.ndim != 1:
        raise ConfigError("x", f"encode takes a flat 1-D vector, got shape {x.shape}; ravel the fragment first")
    return fmt(codec).encode(codec, x.astype(jnp.float32), _need_key(codec, key) if stochastic(codec) else None)


def decode(codec: Codec, payload: dict[str, jax.Array], n: int) -> jax.Array:
    """payload from encode(codec, x) with len(x) == n -> float32 (n,)."""
    return fmt(codec).decode(codec, payload, n)


def roundtrip(codec: Codec, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
    """decode(encode(x)): what the receiver sees, float32 (n,)."""
    return decode(codec, encode(codec, x, key), x.shape[0])
