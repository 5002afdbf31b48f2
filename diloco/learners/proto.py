"""The wire format between independent learners and the synchronizer (diloco/learners/syncer.py), and
the checks every message passes before anything reads its payload. Pure Python: no JAX here.

A message is one gRPC bytes body (grpcio's generic handlers, no generated stubs: three methods with a
hand-written frame are less code than a .proto plus a pinned grpcio-tools, and the payload is the
codec's own bytes either way):

    frame   = u32 big-endian header length | header (UTF-8 JSON object) | payload bytes
    Push    learner → syncer  header {v, learner, fragment, round, tokens, fingerprint, codec,
                                       arrays: [[name, dtype, shape], ...], retry: bool, have: int (both
                                       optional; have: the round the learner's θᵍ_p is at)}
                              payload: the codec's arrays (codecs.encode of Δ_m,p), in `arrays` order,
                              each C-ordered, little-endian
            syncer → learner  header {v, fragment, round, merged: [learner ids], dropped: reason|null,
                                       arrays: [[name, dtype, shape], ...]}
                              payload: θᵍ_p after that round's outer step, fp32 ["theta"]; `round` is the
                              round θᵍ_p is at (a late contribution gets the newest). With `diloco syncer
                              --answer codec` and `have` = round − 1: the codec's arrays of θᵍ_p's update
                              since round `base` = have instead (common.apply_update adds it)
    Join    learner → syncer  header {v, learner, fingerprint}; answer: every fragment's θᵍ_p, fp32, the
                              last merged round per fragment (merged) and this learner's last recorded
                              round per fragment (mine)
    Stats   → {merges: {"p/k": count}, rejected: {reason: count}, ...}

Authentication: gRPC metadata `authorization: Bearer <token>`, compared in constant time
(`hmac.compare_digest`): the shared secret, or learner m's own token (`learner_token`, an HMAC of the secret),
which may push only learner m's contributions. What is refused (each a `Rejected` with a one-line reason the syncer logs):
a frame that does not parse, a header over MAX_HEADER bytes, a payload whose arrays are not exactly the
expected names / dtypes / shapes for that fragment and codec, a config fingerprint or codec other than
the syncer's, an unknown learner or fragment, a round that is not positive, and a replay (the same
learner, fragment and round twice without `retry`; a retry adds nothing and gets the round's answer).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import struct

VERSION = 1
MAX_HEADER = 4096          # bytes of JSON header; anything longer is refused before it is parsed
SERVICE = "diloco.Sync"   # gRPC service name: /diloco.Sync/Push, /diloco.Sync/Join, /diloco.Sync/Stats

# field → type of a Push header (bool is refused where int is asked: JSON true is not a learner id)
PUSH_FIELDS = {"v": int, "learner": int, "fragment": int, "round": int, "tokens": int, "fingerprint": str,
               "codec": str, "arrays": list}


class Rejected(ValueError):
    """A message the synchronizer refuses; str() is the one-line reason it logs and answers."""


def frame(header: dict, payload: bytes = b"") -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack(">I", len(head)) + head + payload


def unframe(body: bytes, max_header: int = MAX_HEADER) -> tuple[dict, bytes]:
    """(header, payload) of a frame; Rejected when it is not one."""
    if not isinstance(body, (bytes, bytearray)) or len(body) < 4:
        raise Rejected(f"malformed: {len(body) if body else 0} bytes is not a frame (u32 length + JSON header)")
    (n,) = struct.unpack(">I", body[:4])
    if n > max_header:
        raise Rejected(f"oversized header: {n} bytes > {max_header}")
    if n > len(body) - 4:
        raise Rejected(f"malformed: header length {n} past the end of a {len(body)}-byte message")
    try:
        header = json.loads(bytes(body[4:4 + n]).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Rejected(f"malformed header: {e.__class__.__name__}") from None
    if not isinstance(header, dict):
        raise Rejected("malformed header: not a JSON object")
    return header, bytes(body[4 + n:])


def check_fields(header: dict, fields: dict) -> None:
    for k, t in fields.items():
        v = header.get(k)
        if not isinstance(v, t) or (t is int and isinstance(v, bool)):
            raise Rejected(f"malformed header: field {k!r} must be {t.__name__}, got {v!r:.60}")
    if header["v"] != VERSION:
        raise Rejected(f"protocol version {header['v']} (this synchronizer speaks {VERSION})")


def check_push(header: dict, payload: bytes, expect, learners: int, fragments: int) -> list[tuple[str, str, tuple]]:
    """A Push header and payload checked against what this synchronizer expects; returns its arrays'
    layout [(name, dtype, shape)]. `expect` holds fingerprint, codec and layouts[p] = [(name, dtype,
    shape, nbytes)], the codec's arrays for fragment p."""
    check_fields(header, PUSH_FIELDS)
    if not isinstance(header.get("retry", False), bool):
        raise Rejected(f"malformed header: field 'retry' must be bool, got {header['retry']!r:.60}")
    have = header.get("have", 0)
    if not isinstance(have, int) or isinstance(have, bool) or have < 0:
        raise Rejected(f"malformed header: field 'have' must be an int ≥ 0, got {have!r:.60}")
    if not hmac.compare_digest(header["fingerprint"], expect.fingerprint):
        raise Rejected(f"wrong config: fingerprint {header['fingerprint'][:12]}… is not this synchronizer's "
                       f"{expect.fingerprint[:12]}… (start every learner with the syncer's --config)")
    if header["codec"] != expect.codec:
        raise Rejected(f"wrong config: codec {header['codec']!r}, the synchronizer decodes {expect.codec!r}")
    m, p, k, tok = header["learner"], header["fragment"], header["round"], header["tokens"]
    if not 0 <= m < learners:
        raise Rejected(f"unknown learner {m} (0 … {learners - 1})")
    if not 0 <= p < fragments:
        raise Rejected(f"unknown fragment {p} (0 … {fragments - 1})")
    if k < 1:
        raise Rejected(f"round {k} must be ≥ 1")
    if tok < 1:
        raise Rejected(f"tokens {tok} must be ≥ 1 (the merge weights contributions by tokens)")
    want = expect.layouts[p]
    got = [(a[0], a[1], tuple(a[2])) if isinstance(a, list) and len(a) == 3 and isinstance(a[2], list) else a
           for a in header["arrays"]]
    if got != [(n, d, s) for n, d, s, _ in want]:
        raise Rejected(f"wrong shape: fragment {p} with codec {expect.codec!r} is "
                       f"{[(n, d, list(s)) for n, d, s, _ in want]}, got {str(header['arrays'])[:120]}")
    nbytes = sum(b for *_, b in want)
    if len(payload) != nbytes:
        raise Rejected(f"wrong shape: fragment {p}'s payload is {nbytes} bytes, got {len(payload)}")
    return got


def split_payload(payload: bytes, layout) -> dict[str, tuple[str, tuple, bytes]]:
    """name → (dtype, shape, bytes) of a checked payload (layout: [(name, dtype, shape, nbytes)])."""
    out, at = {}, 0
    for name, dtype, shape, nb in layout:
        out[name] = (dtype, tuple(shape), payload[at:at + nb])
        at += nb
    return out


ANY = -1  # the shared token's holder: may push for any learner (tests, an operator)


def learner_token(secret: str, m: int) -> str:
    """Learner m's own credential, derived from the shared secret: it can push only learner m's contributions."""
    return hmac.new(secret.encode(), f"diloco-learner-{m}".encode(), hashlib.sha256).hexdigest()


def caller(metadata, secret: str, learners: int) -> int | None:
    """Who the call's `authorization: Bearer <token>` is: ANY (the shared secret), a learner id (its derived
    token), or None. Constant-time compares."""
    who, got = None, dict(metadata or ()).get("authorization", "").encode()
    for m, tok in [(ANY, secret)] + [(m, learner_token(secret, m)) for m in range(learners)]:
        if hmac.compare_digest(got, f"Bearer {tok}".encode()):  # every one compared: the time does not say which
            who = m
    return who
