"""What a learner and the synchronizer agree on, derived from the one run config both are started with:
the learner's own config (one replica, its share of the batch), the config fingerprint every message
carries, the codec's array layout per fragment, and the shared token.

The run config's `replicas` is the number of learners M; learner m trains what replica m of the SPMD run
would (rows m·b … m·b+b−1 of each global batch of `batch_size` = M·b rows, the same init and keys)."""
from __future__ import annotations

import dataclasses
import hashlib
import os

from diloco.errors import ConfigError

TOKEN_ENV = "DILOCO_SYNC_TOKEN"


def check_supported(cfg) -> None:
    """One line for a config the learner path does not run yet (before anything compiles)."""
    if cfg.method not in ("diloco", "streaming"):
        raise ConfigError("method", f"{cfg.method!r}: independent learners run diloco or streaming (DP syncs "
                                    "every step: use one SPMD job)")
    for key, off in (("eager", "off"), ("error_feedback", False), ("replica_tau", "")):
        if cfg.get(key, off) != off:
            raise ConfigError(key, f"{cfg[key]!r}: not supported by the gRPC synchronizer yet (plain sends, one τ); "
                                   f"use --config.{key}={off!s} or the SPMD path")
    if cfg.batch_size % cfg.replicas:
        raise ConfigError("batch_size", f"{cfg.batch_size} must be a multiple of replicas={cfg.replicas} "
                                        "(the learners' count): each learner trains batch_size/replicas rows")


def learner_config(cfg):
    """The config of one learner's own Trainer: one replica, batch_size / M rows, blocking placement (the
    learner loop exchanges over gRPC itself)."""
    check_supported(cfg)
    lcfg = cfg.copy_and_resolve_references()
    with lcfg.unlocked():
        lcfg.batch_size = cfg.batch_size // cfg.replicas
        lcfg.replicas = 1
        lcfg.exchange = "blocking"
    return lcfg


def fingerprint(cfg) -> str:
    """sha256 of the run config (every key but `sync` and `learner`: the address a learner reaches the synchronizer
    by, and who it is): learners and the synchronizer must hold the same one."""
    from diloco.config import to_json

    cfg = cfg.copy_and_resolve_references()
    with cfg.unlocked():
        cfg.sync, cfg.learner = "", -1
    return hashlib.sha256(to_json(cfg).encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class Expect:
    """What a Push must match (proto.check_push): the fingerprint, the codec, and per fragment its arrays."""
    fingerprint: str
    codec: str
    layouts: tuple  # per fragment: ((name, dtype, shape, nbytes), …) in name order


def payload_layouts(sync) -> tuple:
    """Per fragment, the codec's arrays for its n_p elements: ((name, dtype, shape, nbytes), …), sorted by
    name (the order a learner packs them in). Traced abstractly: nothing is computed."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from diloco.outer import codecs

    out = []
    for n in sync.frags.sizes:
        shapes = jax.eval_shape(lambda x, k: codecs.encode(sync.codec, x, k),
                                jax.ShapeDtypeStruct((n,), jnp.float32), jax.random.PRNGKey(0))
        out.append(tuple((k, np.dtype(s.dtype).name, tuple(s.shape), int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize)
                         for k, s in sorted(shapes.items())))
    return tuple(out)


def apply_update(codec, n: int):
    """θᵍ_p ← θᵍ_p + decode(update): how a quantized answer is applied, one jitted function that the
    synchronizer and every learner run alike (the same program: the same bits on both sides)."""
    import jax

    from diloco.outer import codecs

    return jax.jit(lambda theta_n, payload: theta_n + codecs.decode(codec, payload, n))


LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def read_tls(cert: str | None, key: str | None, host: str, insecure: bool) -> tuple[bytes, bytes] | None:
    """The (key, certificate) PEM bytes of --tls_cert/--tls_key, or None for plain gRPC: which the synchronizer
    serves only on loopback unless --insecure says so (the token would cross the network in the clear)."""
    if (cert is None) != (key is None):
        raise ConfigError("tls_cert", "give both --tls_cert and --tls_key (PEM files), or neither")
    if cert is None:
        if host not in LOOPBACK and not insecure:
            raise ConfigError("host", f"{host}: off loopback the synchronizer needs TLS (--tls_cert FILE --tls_key "
                                      "FILE), or --insecure on a network you trust")
        return None
    return read_file(key, "tls_key"), read_file(cert, "tls_cert")


def read_file(name: str, field: str) -> bytes:
    try:
        return open(name, "rb").read()
    except OSError as e:
        raise ConfigError(field, f"{name}: {e.strerror}") from None


def read_token(token_file: str | None) -> str:
    """The shared token: the file's first line, else $DILOCO_SYNC_TOKEN; neither is one line of bad input."""
    if token_file:
        try:
            tok = open(token_file, encoding="utf-8").read().strip()
        except OSError as e:
            raise ConfigError("token_file", f"{token_file}: {e.strerror}") from None
    else:
        tok = os.environ.get(TOKEN_ENV, "").strip()
    if len(tok) < 16:
        raise ConfigError("token_file", f"the shared token must be ≥ 16 characters: pass --token_file FILE or set "
                                        f"{TOKEN_ENV} (e.g. `python -c 'import secrets; print(secrets.token_hex(16))'`)")
    return tok
