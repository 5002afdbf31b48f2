"""Outer exchanges that really overlap the inner steps (multi-process runs with a comm device).

A fragment's exchange is dispatched at its send step on a second device per process (the comm
device, `diloco launch --comm_device`) and only waited for at its apply, τ inner steps later.
XLA:CPU runs the executions of one device in order and its collectives are synchronous, so an
exchange on the compute device would stall the inner steps behind it; on a device of its own it
runs beside them (measurements: results/overlap/README.md).

The numbers are those of `OuterSync.send`: the same `OuterSync.delta` and keys (computed on the
compute devices), the same `OuterSync.exchange` (encode → all-gather over `replica` → decode →
FP32 average), only placed on other devices. The driver (diloco/outer/driver.py) writes a landed
average into the checkpointed pending slot with `OuterSync.with_pending`, as the blocking path
does, so checkpoints and resume are unchanged (everything in flight lands before a save).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import numpy as np


@dataclasses.dataclass
class InFlight:
    out: Any          # (n_p,) f32 average, replicated over the comm mesh
    step: int         # the inner step after which it was sent
    finite_R: Any     # (R,) bool: which replicas held only finite values at the send (for errors)


def overlap_unsupported(mesh, comm_devices) -> str | None:
    """Why the overlapped path cannot serve this mesh (None: it can).

    comm_devices[i] serves replica row i of the mesh and must be on the same process."""
    if not comm_devices:
        return "no comm device (diloco launch --comm_device)"
    inner = mesh.devices.size // mesh.shape["replica"]
    if inner != 1:
        return f"the mesh has {inner} devices per replica (data × fsdp); the overlapped exchange needs 1"
    rows = list(replica_rows(mesh))
    if len(comm_devices) != len(rows):
        return f"{len(comm_devices)} comm devices for {len(rows)} replica rows; one each is needed"
    if set(comm_devices) & set(mesh.devices.flat):
        return "the comm devices must not be compute devices of the mesh"
    for i, (r, c) in enumerate(zip(rows, comm_devices)):
        if r.process_index != c.process_index:
            return f"comm device {i} is on process {c.process_index}, replica row {i} on {r.process_index}"
    return None


def replica_rows(mesh) -> np.ndarray:
    """The first device of each replica row (every mesh axis after `replica` at index 0)."""
    return mesh.devices.reshape(mesh.shape["replica"], -1)[:, 0]


class OverlappedExchange:
    """Fragment exchanges in flight on the comm devices; `land` waits for one at its apply."""

    def __init__(self, sync, mesh, comm_devices, timeline=None):  # a diloco.timeline.Timeline
        import jax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

        why = overlap_unsupported(mesh, comm_devices)
        if why:
            raise ValueError(why)
        self.jax, self.mesh, self.sync, self.timeline = jax, mesh, sync, timeline
        self.comm_of = dict(zip(replica_rows(mesh), comm_devices))  # compute device of a row → its comm device
        self.comm_mesh = Mesh(np.array(list(comm_devices)), ("replica",))
        self.xsync = dataclasses.replace(sync, mesh=self.comm_mesh)
        self.replica_sharding = NamedSharding(mesh, P("replica"))
        self.replicated_sharding = NamedSharding(mesh, P())
        self.comm_rep = NamedSharding(self.comm_mesh, P("replica"))
        self.inflight: dict[int, InFlight] = {}
        self._prep: dict[int, Any] = {}
        self._x: dict[int, Any] = {}

    # -- send --------------------------------------------------------------------------------------
    def _prep_fn(self, p: int, given: bool = False):
        """(Δ, keys, weights) on the replica rows; `given`: Δ is passed in (what the rule's local
        program says to encode, diloco/outer/rules.py) instead of OuterSync.delta of the state."""
        if (p, given) not in self._prep:
            jax, sync = self.jax, self.sync

            def prep(params_R, outer, key, contrib_R):
                return prep_given(sync.delta(params_R, outer, p), key, contrib_R)

            def prep_given(delta, key, contrib_R):  # one device a replica: the canonical vector is free
                delta = sync.flat(delta)
                return delta, jax.random.split(key, delta.shape[0]), contrib_R.astype("float32")

            self._prep[(p, given)] = jax.jit(prep_given if given else prep,
                                             out_shardings=(self.replica_sharding,) * 3)
        return self._prep[(p, given)]

    def _to_comm(self, x):
        """A replica-sharded array on the compute mesh → the same rows on the comm mesh."""
        jax = self.jax
        bufs = [jax.device_put(s.data, self.comm_of[s.device]) for s in x.addressable_shards]
        return jax.make_array_from_single_device_arrays(x.shape, self.comm_rep, bufs)

    def send(self, state, p: int, key, contrib_R, t: int, finite_R=None, delta=None) -> None:
        """Dispatch fragment p's exchange; returns at once (the comm device works in the background).
        `delta` (R, n_p): exchange this instead of OuterSync.delta of `state`."""
        if p in self.inflight:
            raise RuntimeError(f"fragment {p} sent at step {t} while its exchange from step "
                               f"{self.inflight[p].step} is still in flight (τ ≥ H?)")
        if delta is None:
            delta, keys, w = self._prep_fn(p)(state.params, state.outer, key, contrib_R)
        else:
            delta, keys, w = self._prep_fn(p, given=True)(delta, key, contrib_R)
        args = [self._to_comm(a) for a in (delta, keys, w)]
        if p not in self._x:
            self._x[p] = self.jax.jit(self.xsync.exchange)
        out = self._x[p](*args)
        self.inflight[p] = InFlight(out, t, finite_R)
        if self.timeline is not None:
            self.timeline.add("exchange_start", step=t, fragment=p)
            self.timeline.watch(out, "exchange_end", step=t, fragment=p)

    # -- land --------------------------------------------------------------------------------------
    def land(self, p: int, t: int | None = None):
        """Wait for fragment p (if in flight): (average on the compute mesh, replicated, as fragment p's
        subtree; its InFlight),
        or (None, None) when nothing was in flight (e.g. a resumed run whose checkpoint holds it)."""
        jax = self.jax
        rec = self.inflight.pop(p, None)
        if rec is None:
            return None, None
        t0 = time.perf_counter()
        local = rec.out.addressable_shards[0].data
        local.block_until_ready()
        waited = time.perf_counter() - t0
        if self.timeline is not None:
            self.timeline.add("apply_wait", step=t if t is not None else rec.step, fragment=p, waited_s=waited)
        bufs = [jax.device_put(local, d) for d in self.replicated_sharding.addressable_devices]
        avg = jax.make_array_from_single_device_arrays(local.shape, self.replicated_sharding, bufs)
        if ("unflat", p) not in self._x:  # fragment p's subtree (the pending slot), one program
            self._x[("unflat", p)] = jax.jit(functools.partial(self.sync.as_subtree, p=p))
        return self._x[("unflat", p)](avg), rec
