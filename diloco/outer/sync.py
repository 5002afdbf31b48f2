"""Outer state and the three sync operations of (Streaming) DiLoCo, as pure functions.
The algorithm contract these implement is stated once, in docs/architecture.md.

  send(p):    Δ_m,p = θ^g_p − θ_m,p on every replica → encode → exchanged over the `replica`
              mesh axis as the encoded arrays (all-gather of the payload) → decoded and averaged in
              FP32 on arrival → held in `pending[p]` (fragment p's subtree, sharded like θᵍ) until applied.
  update(p):  one outer-optimizer step (config `outer.name`, Nesterov by default) of fragment p's outer
              params with pending[p] (per-fragment optax state: a non-synced fragment's is never touched).
  merge(p):   θ_m,p ← α·θ_m,p + (1−α)·θ^g_p on the replicas in `mask`.

Replica-stacked trees carry a leading axis R. The outer state has no replica axis: it is identical
on every replica by construction, and sharded over the chips of a replica (the Trainer's layout).
With a mesh whose replica rows have several chips (data × fsdp × tensor), each chip encodes and exchanges the
blocks of Δ it holds when every chip's share of every piece is whole codec blocks (`OuterSync.chip_wire`: the
average is then the canonical wire's bit for bit, and nothing is regathered); otherwise the fragment is one
canonical flat vector (its pieces end to end) split into whole-block slices over the chips (`exchange`).

Plain sends compute Δ with `OuterSync.delta`; what a send encodes and where its average lands is its
rule's (diloco/outer/rules.py: eager swap/mix make Δ from each replica's own θᵍ_m). Every placement
exchanges with `OuterSync.average`. diloco/outer/driver.py turns the schedule into calls.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh, PartitionSpec as P

from diloco.outer import codecs
from diloco.outer.fragments import Fragments
from diloco.sharding import inner_axes


@struct.dataclass
class OuterState:
    params: Any                  # θᵍ: the model's parameter tree, no replica axis
    opt: tuple                   # one outer-optimizer (optax) state per fragment, over its parameter subtree
                                 # (fp32, sharded like θᵍ: diloco/sharding.py outer_param_shardings)
    pending: tuple               # per fragment: the averaged Δ of its last send, until applied: the fragment's
                                 # subtree in f32, sharded like θᵍ (Fragments.subtree)
    extra: Any = None            # the send rule's buffers (diloco/outer/rules.py Extra); None for plain sends


# The outer optimizer by name (config `outer.name`): the optax constructor, given outer.lr, outer.momentum
# (Adam's b1) and the rest of `outer` (b2, eps, weight_decay). LINEAR: the step is linear in Δ at a fixed
# state, which eager swap/mix's consensus (the mean of the replicas' θᵍ_m) rests on (diloco/outer/eager.py).
OUTER_OPTIMIZERS = {
    "nesterov": lambda lr, mu, **_: optax.sgd(lr, momentum=mu or None, nesterov=mu > 0),  # the paper's
    "sgd": lambda lr, mu, **_: optax.sgd(lr, momentum=mu or None),
    "adam": lambda lr, mu, b2=0.999, eps=1e-8, **_: optax.adam(lr, b1=mu, b2=b2, eps=eps),
    "adamw": lambda lr, mu, b2=0.999, eps=1e-8, weight_decay=1e-4, **_: optax.adamw(
        lr, b1=mu, b2=b2, eps=eps, weight_decay=weight_decay),
    "muon": lambda lr, mu, b2=0.999, eps=1e-8, weight_decay=0.0, **_: optax.contrib.muon(
        lr, beta=mu, eps=eps, weight_decay=weight_decay, adam_b1=mu, adam_b2=b2,
        muon_weight_dimension_numbers=muon_matrices),
}
LINEAR = ("nesterov", "sgd")


def muon_matrices(tree):
    """Muon's view of an outer subtree: a leaf of rank ≥ 2 is a matrix over its last two axes (leading
    axes, nn.scan's layers, are a batch), except the token embedding; the rest (norms: rank 1) None, so
    optax.contrib.muon gives them to its Adam."""
    from optax.contrib import MuonDimensionNumbers

    from diloco.model import is_qkv_kernel

    def one(path, x):
        embed = any(getattr(k, "key", None) == "embed" for k in path)
        if is_qkv_kernel(path) and x.ndim >= 3:  # the qkv kernel D×3×(H·K): one D×3D matrix
            return MuonDimensionNumbers(x.ndim - 3, (x.ndim - 2, x.ndim - 1))
        return MuonDimensionNumbers(x.ndim - 2, x.ndim - 1) if x.ndim >= 2 and not embed else None
    return jax.tree_util.tree_map_with_path(one, tree)


def outer_optimizer(lr: float, momentum: float = 0.0, name: str = "nesterov", **kw) -> optax.GradientTransformation:
    """OUTER_OPTIMIZERS[name] (config `outer`: `outer_optimizer(**cfg.outer)`)."""
    return OUTER_OPTIMIZERS[name](lr, momentum, **kw)


@dataclasses.dataclass(frozen=True)
class OuterSync:
    frags: Fragments
    codec: codecs.Codec
    tx: optax.GradientTransformation
    alpha: float
    mesh: Mesh | None = None  # None: no collectives (single device, replicas on one array axis)
    specs: tuple | None = None  # per parameter leaf: its mesh axes per dimension (no replica), for chip_wire

    def init(self, params) -> OuterState:
        P = range(self.frags.P)
        return OuterState(params=params, opt=tuple(self.tx.init(self.subtree(params, p)) for p in P),
                          pending=tuple(jax.tree_util.tree_map(jnp.zeros_like, self.subtree(params, p)) for p in P))

    def subtree(self, params, p: int, starts=None) -> dict:
        """Fragment p of θᵍ in fp32, keyed like the parameters: what the outer optimizer steps."""
        return self.frags.subtree(self.pieces32(params, p, starts), p)

    def pieces32(self, params, p: int, starts=None) -> list[jax.Array]:
        """Fragment p's pieces of one parameter tree in float32, each in the parameters' own sharding."""
        return [x.astype(jnp.float32) for x in self.frags.pieces(params, p, starts)]

    def bytes_per_replica(self, p: int) -> int:
        """Bytes one replica sends for fragment p, as counted in `bytes_exchanged`: the encoding of its
        n_p elements, the same on every chip layout."""
        return codecs.encoded_nbytes(self.codec, self.frags.sizes[p])

    def wire_bytes_per_replica(self, p: int) -> int:
        """Bytes that really cross `replica` per replica for fragment p: the counted bytes on the chips'
        own blocks (`chip_wire`), else the encoding at the padded length when the chips of a replica split
        the flat vector (`padded`: at most chips × (block/2 + 4) bytes more for e3m0, zeros)."""
        n = self.frags.sizes[p]
        return codecs.encoded_nbytes(self.codec, n if self.chip_wire(p) else self.padded(n))

    # -- send ------------------------------------------------------------------------------------
    def delta(self, params_R, outer: OuterState, p: int, starts=None) -> dict:
        """Δ_m,p = θᵍ_p − θ_m,p: the outer gradient of every replica (the only place), fragment p's subtree
        with a leading replica axis, f32, piece by piece in the parameters' own sharding (nothing is
        flattened). `starts`: fragment p's rows read at these (traced) starts, for a program shared by the
        fragments of p's layout (`Fragments.layout`); the same in update and merge."""
        g = self.pieces32(outer.params, p, starts)
        return self.frags.subtree(jax.vmap(lambda theta: [gx - x for gx, x in zip(g, self.pieces32(theta, p, starts))])(
            params_R), p)

    @staticmethod
    def flat(tree_R) -> jax.Array:
        """A fragment subtree with a leading axis (R, …) as the canonical (R, n_p) vector: its pieces end to end
        (a payload that is already that vector, a rule's, is returned as it is)."""
        if hasattr(tree_R, "shape"):
            return tree_R
        return jnp.concatenate([x.reshape(x.shape[0], -1) for x in jax.tree_util.tree_leaves(tree_R)], axis=1)

    def unflat(self, vec, p: int) -> dict:
        """The inverse of `flat` for one vector (n_p,) (or rows (R, n_p)): fragment p's subtree."""
        if vec.ndim == 2:
            return jax.vmap(lambda v: self.unflat(v, p))(vec)
        return self.frags.subtree(self.frags.split(vec, p), p)

    @staticmethod
    def with_pending(outer: OuterState, p: int, avg) -> OuterState:
        """The averaged Δ of fragment p (its subtree), held until its apply (the only write of the pending buffer)."""
        return outer.replace(pending=outer.pending[:p] + (avg,) + outer.pending[p + 1:])

    def send(self, params_R, outer: OuterState, p: int, key: jax.Array, contrib_R: jax.Array) -> OuterState:
        """Average the encoded outer gradients of fragment p over the replicas with contrib > 0 (Plain's
        send on the whole outer state, for tests and netbench; runs go through diloco/outer/rules.py)."""
        return self.with_pending(outer, p, self.average(self.delta(params_R, outer, p), key, contrib_R, p))

    def average(self, payload_R, key: jax.Array, contrib_R: jax.Array, p: int) -> dict:
        """The exchanged FP32 average of the replicas' Δ of fragment p (or of any payload: its subtree with a
        leading replica axis, or the canonical (R, n_p) vector), as fragment p's subtree."""
        return self.as_subtree(self.exchanged(payload_R, key, contrib_R, p), p)

    def exchanged(self, payload_R, key: jax.Array, contrib_R: jax.Array, p: int):
        """The average as the exchange delivers it: fragment p's subtree (`chip_wire`) or the canonical (n_p,)
        vector split over the chips, which `as_subtree` cuts into θᵍ's pieces (a regather when they split 2-D)."""
        wire = self.wire(payload_R, p)
        keys_R = jax.random.split(key, self.rows(wire))
        w_R = contrib_R.astype(jnp.float32)
        if hasattr(wire, "shape"):
            return self.exchange(wire, keys_R, w_R, self.frags.sizes[p])
        return self.exchange_chips(wire, keys_R, w_R, p)

    def wire(self, payload_R, p: int):
        """The payload (Δ's subtree or a rule's canonical (R, n_p) vector) as the exchange reads it: the subtree on
        the chip wire, else the canonical vector padded to whole blocks per chip and laid out as the
        exchange splits it. Idempotent; the driver builds it before the inner step, so the gathers within a
        replica that lay a 2-D-split fragment end to end are not left for after the step (seen on TPU)."""
        if not hasattr(payload_R, "shape") and self.chip_wire(p):
            return payload_R
        if self.one_replica():
            return self.flat(payload_R)
        # each piece first as a vector split over the chips: XLA reshards it chip to chip; concatenated as
        # they are, it gathered every piece whole on every chip (10B step+send 0: 15.9 → 11.0 GiB, v5e tensor 2)
        line = jax.sharding.NamedSharding(self.mesh, P("replica", inner_axes(self.mesh)))
        payload_R = self.flat(jax.tree_util.tree_map(
            lambda x: jax.lax.with_sharding_constraint(x.reshape(x.shape[0], -1), line), payload_R))
        n = payload_R.shape[1]
        return jax.lax.with_sharding_constraint(self.pad(payload_R, n), jax.sharding.NamedSharding(self.mesh, self.wire_spec(n)))

    def pad(self, x_Rxn, n: int):
        """Zeros to `padded(n)`, whole blocks per chip (their zero blocks decode to 0)."""
        return jnp.pad(x_Rxn, ((0, 0), (0, self.padded(n) - x_Rxn.shape[1]))) if x_Rxn.shape[1] < self.padded(n) else x_Rxn

    def wire_spec(self, n: int) -> P:
        return P("replica", inner_axes(self.mesh) if self.shards(n) > 1 else None)

    def as_subtree(self, avg, p: int) -> dict:
        """The exchange's average as fragment p's subtree. The flat vector is cut into θᵍ's pieces inside each
        replica (`replica` manual): every replica holds the same average, and left to itself XLA's partitioner
        regathered it through the other replicas' chips, across the slow network."""
        if not hasattr(avg, "shape"):
            return avg
        specs = self.piece_specs(p)
        if self.one_replica() or specs is None:
            return self.unflat(avg, p)

        def cut(v):
            line = jax.sharding.NamedSharding(self.mesh, P(inner_axes(self.mesh)))  # as in `wire`, the other way
            pieces = [jax.lax.with_sharding_constraint(
                jax.lax.with_sharding_constraint(x.reshape(-1), line).reshape(x.shape),
                jax.sharding.NamedSharding(self.mesh, P(*s))) for x, s in zip(self.frags.split(v, p), specs)]
            return self.frags.subtree(pieces, p)
        return jax.shard_map(cut, mesh=self.mesh, in_specs=P(), out_specs=P(), axis_names={"replica"},
                             check_vma=False)(avg)

    @staticmethod
    def rows(tree_R) -> int:
        return jax.tree_util.tree_leaves(tree_R)[0].shape[0]

    def one_replica(self) -> bool:
        """No mesh, or one replica on it: the exchange is a local average, nothing crosses `replica`."""
        return self.mesh is None or self.mesh.shape["replica"] == 1

    def split_unit(self) -> int:
        """Elements of one chip's slice must be a multiple of this for its encoding to be the unsharded
        one's byte for byte (whole codec blocks; two nibbles per byte); 0: the codec cannot be split
        (sparsifiers, stochastic rounding: their draws depend on the whole vector) or nothing to split."""
        if self.one_replica() or self.chips() == 1:
            return 0
        return codecs.split_unit(self.codec)  # the codec registry's unit (diloco/outer/codecs.py FORMATS)

    def padded(self, n: int) -> int:
        """Length at which a fragment of n elements is exchanged: n, or (when the chips of a replica split
        it) n rounded up to chips × split_unit, zeros appended, so every chip's slice is whole blocks."""
        unit = self.split_unit()
        if not unit:
            return n
        k = self.chips() * unit
        return -(-n // k) * k

    def chips(self) -> int:
        """Chips of one replica (data × fsdp × tensor)."""
        return self.mesh.shape.get("data", 1) * self.mesh.shape.get("fsdp", 1) * self.mesh.shape.get("tensor", 1)

    def shards(self, n: int) -> int:
        """Chips of one replica that split a fragment of length n for the exchange: each encodes and
        gathers over `replica` only its own slice of the (padded) fragment, so the bytes crossing
        `replica` are `wire_bytes_per_replica`. 1 (every chip moves the whole payload) for codecs that
        cannot be split (`split_unit`)."""
        return self.chips() if self.split_unit() else 1

    def exchange(self, delta_Rxn, keys_R, w_R, n: int | None = None):
        """encode → all-gather over `replica` → decode → FP32 weighted average: (R, n) → (n,), the canonical
        vector split into whole-block slices over a replica's chips (`shards`). n: the fragment's length when
        `delta_Rxn` is already `wire`'s padded vector."""
        n = delta_Rxn.shape[1] if n is None else n
        if self.one_replica():
            return reduce_replicas(self.codec, delta_Rxn, keys_R, w_R, _identity)[:n]
        split = self.shards(n) > 1
        fn = jax.shard_map(functools.partial(reduce_replicas, self.codec, gather=_over_replica), mesh=self.mesh,
                           in_specs=(self.wire_spec(n), P("replica"), P("replica")),
                           out_specs=P(inner_axes(self.mesh)) if split else P(), check_vma=False)
        return fn(self.pad(delta_Rxn, n), keys_R, w_R)[:n]

    # -- each chip exchanges the blocks it holds ---------------------------------------------------
    def piece_specs(self, p: int) -> list[tuple] | None:
        """Mesh axes per dimension of each piece of fragment p (None: unknown, or a stacked leaf split on its
        layer axis)."""
        if self.specs is None:
            return None
        out = []
        for i, rows in self.frags.parts[p]:
            spec = tuple(self.specs[i]) + (None,) * (len(self.frags.shapes[i]) - len(self.specs[i]))
            if rows is not None and spec[0] is not None:
                return None
            out.append(spec)
        return out

    def chip_wire(self, p: int) -> bool:
        """Whether each chip encodes and exchanges its own blocks of fragment p (`exchange_chips`): a codec that
        splits, several chips a replica, and every chip's share of every piece whole codec blocks of the
        canonical vector (each piece whole blocks; the chip's rows of it, in order, whole blocks; a piece held
        whole by several chips cut between them into whole blocks). Then the average is the canonical
        wire's bit for bit, in another order. fp32 and bf16 (unit 1) qualify on any layout; E3M0's 256-element
        blocks do not at the paper's shapes (a fragment's q/k-norm pieces, 3 × 64 elements, shift every later
        block), which take the flat wire."""
        unit, specs = self.split_unit(), self.piece_specs(p)
        if not unit or specs is None:
            return False
        size = lambda axes: int(np.prod([self.mesh.shape[a] for a in axes]))  # noqa: E731
        for (i, rows), spec in zip(self.frags.parts[p], specs):
            shape = (len(rows),) + self.frags.shapes[i][1:] if rows is not None else self.frags.shapes[i]
            ks = [size(_axes(e)) for e in spec]
            if any(d % k for d, k in zip(shape, ks)) or int(np.prod(shape)) % unit:
                return False
            local = [d // k for d, k in zip(shape, ks)]
            split = [j for j, k in enumerate(ks) if k > 1]
            run = local[split[-1]] * int(np.prod(shape[split[-1] + 1:])) if split else int(np.prod(shape))
            held = self.held_by(spec)
            if run % unit or int(np.prod(local)) % (size(held) * unit):
                return False
        return True

    def held_by(self, spec) -> tuple[str, ...]:
        """A replica's chip axes a piece with `spec` is not split over (its chips along them hold the same block)."""
        used = {a for e in spec for a in _axes(e)}
        return tuple(a for a in inner_axes(self.mesh) if a not in used and self.mesh.shape[a] > 1)

    def exchange_chips(self, tree_R, keys_R, w_R, p: int) -> dict:
        """The exchange of fragment p on the chips' own blocks: each chip lays the blocks it holds end to end
        (of a piece held by several chips, its share), encodes, gathers over `replica`, decodes and averages
        them, and puts them back in its blocks; no collective inside a replica but the small gather of pieces
        held by several chips. `chip_wire(p)` must hold."""
        leaves, treedef = jax.tree_util.tree_flatten(tree_R)
        specs = self.piece_specs(p)
        helds = [self.held_by(s) for s in specs]
        codec = self.codec

        def local(xs, keys_r, w_r):
            parts = []
            for x, held in zip(xs, helds):
                v = x.reshape(x.shape[0], -1)
                if held:
                    m = v.shape[1] // int(np.prod([self.mesh.shape[a] for a in held]))
                    v = jax.lax.dynamic_slice_in_dim(v, jax.lax.axis_index(held) * m, m, axis=1)
                parts.append(v)
            avg, out, at = reduce_replicas(codec, jnp.concatenate(parts, 1), keys_r, w_r, _over_replica), [], 0
            for x, held, v in zip(xs, helds, parts):
                seg = avg[at:at + v.shape[1]]
                at += v.shape[1]
                out.append((jax.lax.all_gather(seg, held, tiled=True) if held else seg).reshape(x.shape[1:]))
            return out

        fn = jax.shard_map(local, mesh=self.mesh, in_specs=([P("replica", *s) for s in specs], P("replica"), P("replica")),
                           out_specs=[P(*s) for s in specs], check_vma=False)
        return jax.tree_util.tree_unflatten(treedef, fn(leaves, keys_R, w_R))

    # -- update and merge --------------------------------------------------------------------------
    def update(self, outer: OuterState, p: int) -> OuterState:
        params, opt_p = self.outer_step(outer.params, outer.opt[p], outer.pending[p], p)
        return outer.replace(params=params, opt=outer.opt[:p] + (opt_p,) + outer.opt[p + 1:])

    def outer_step(self, g_params, opt_p, pending, p: int, starts=None):
        """One outer-optimizer step of fragment p of θᵍ with its averaged Δ (`pending`, fragment p's subtree):
        (θᵍ, fragment p's optax state), both as fragment p's subtree, so a matrix-aware optimizer (muon) sees
        matrices and no chip holds more of θᵍ or the optimizer's state than its share."""
        g = self.subtree(g_params, p, starts)
        upd, opt_p = self.tx.update(pending, opt_p, g)
        new = jax.tree_util.tree_map(jnp.add, g, upd)
        return self.frags.unpieces(g_params, p, jax.tree_util.tree_leaves(new), starts), opt_p

    def merge(self, params_R, outer: OuterState, p: int, mask_R: jax.Array, starts=None):
        g = self.pieces32(outer.params, p, starts)
        return jax.vmap(lambda theta, m: self.merge_one(theta, g, m, p, starts))(params_R, mask_R)

    def merge_one(self, theta, g_pieces, m, p: int, starts=None):
        """θ_m,p ← α·θ_m,p + (1−α)·θᵍ_p (where m) for one replica's tree, piece by piece in the parameters'
        own sharding (elementwise: nothing is flattened, so no chip holds more than its share)."""
        new = [jnp.where(m, self.alpha * x + (1.0 - self.alpha) * gx, x)
               for gx, x in zip(g_pieces, self.pieces32(theta, p, starts))]
        return self.frags.unpieces(theta, p, new, starts)


def _identity(x):
    return x


def _over_replica(x):
    return jax.lax.all_gather(x, "replica", tiled=True)


def _axes(entry) -> tuple[str, ...]:
    """A PartitionSpec entry as a tuple of mesh axes."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def reduce_replicas(codec, delta_rxn, keys_r, w_r, gather: Callable):
    """One chip's part of an exchange: its rows' (R, n) payload encoded, `gather`ed over `replica` (one
    collective: gather_packed), decoded and averaged in FP32 with weights w → (n,). Plain fp32 sums instead
    (a sum-reduction is the cheapest honest exchange)."""
    n = delta_rxn.shape[1]
    if codecs.fmt(codec).sum_reduce:
        if gather is _identity:
            return (delta_rxn * w_r[:, None]).sum(0) / jnp.maximum(w_r.sum(), 1.0)
        return (jax.lax.psum((delta_rxn * w_r[:, None]).sum(0), "replica")
                / jnp.maximum(jax.lax.psum(w_r.sum(), "replica"), 1.0))
    payload = jax.vmap(lambda x, k: codecs.encode(codec, x, k))(delta_rxn, keys_r)
    payload = gather_packed(payload, gather)
    dec_Rxn = jax.vmap(lambda pl: codecs.decode(codec, pl, n))(payload)
    w_R = gather(w_r)
    return (dec_Rxn * w_R[:, None]).sum(0) / jnp.maximum(w_R.sum(), 1.0)


def gather_packed(payload: dict[str, jax.Array], gather: Callable) -> dict[str, jax.Array]:
    """`gather` every array of an encoded payload (rows = this chip's replicas) as ONE byte buffer: each
    array bitcast to bytes and laid side by side per row, gathered, cut apart and bitcast back (exact).
    One collective instead of one per array: on TPU the block scales' own all-reduce was waited for
    before the step's compute, outside the codes' window (results/pod/overlap.md, 4B)."""
    if gather is _identity or len(payload) == 1:
        return {k: gather(v) for k, v in payload.items()}
    keys = sorted(payload)
    rows = payload[keys[0]].shape[0]
    parts, layout = [], []
    for k in keys:
        v = payload[k]
        b = v.reshape(rows, -1)
        if b.dtype != jnp.uint8:
            b = jax.lax.bitcast_convert_type(b, jnp.uint8)  # itemsize > 1: (rows, m, itemsize)
        b = b.reshape(rows, -1)
        parts.append(b)
        layout.append((k, v.shape[1:], v.dtype, b.shape[1]))
    all_ = gather(jnp.concatenate(parts, axis=1))  # (R, Σ bytes)
    out, at = {}, 0
    for k, shape, dtype, nb in layout:
        b = all_[:, at:at + nb]
        at += nb
        size = jnp.dtype(dtype).itemsize
        if jnp.dtype(dtype) != jnp.uint8:
            b = jax.lax.bitcast_convert_type(b.reshape(b.shape[0], -1, size) if size > 1 else b, dtype)
        out[k] = b.reshape((b.shape[0],) + tuple(shape))
    return out


def params_sha256(tree) -> str:
    import hashlib

    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(tree):
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return h.hexdigest()
