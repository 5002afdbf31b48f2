"""Eager updates and error feedback on the trainer's outer state (jax; the math is eager.py / feedback.py).

`Extra` is what the two add to `OuterState` (field `extra`; None when both are off, so such a run's
state, programs and numbers are today's):

  residual[p]   (R, n_p) f32   error feedback: what each replica meant to send and the codec did not
  avg[p]        (D, n_p) f32   eager: the averaged Δ of fragment p's last D rounds, oldest first
  own[p]        (D, R, n_p)    eager: each replica's decoded contribution to them (swap removes it)
  outer[p]      (R, n_p) f32   eager swap/mix: θᵍ_m,p per replica (naive keeps the shared θᵍ)
  opt[p]        optax state over (R, n_p): each replica's Nesterov momentum of fragment p (swap/mix)

Both buffers start at zero: in rounds r ≤ D nothing has arrived (eager.py). Under eager a fragment is
sent, stepped and merged at its send step (`eager_round`): the exchange of round r is what round r + D
applies, so in time it overlaps D whole rounds — the same numbers as an exchange that takes that
long. The replicas' θᵍ_m,p differ under swap/mix; the evaluated θᵍ is their mean (`consensus`),
computed when asked (no traffic per round).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from diloco.outer import codecs, eager, feedback
from diloco.outer.sync import OuterSync


@struct.dataclass
class Extra:
    residual: tuple | None = None
    avg: tuple | None = None
    own: tuple | None = None
    outer: tuple | None = None
    opt: tuple | None = None
    mode: str = struct.field(pytree_node=False, default="off")


def init(sync, params, R: int, mode: str = "off", rounds: int = 1, error_feedback: bool = False) -> Extra | None:
    """The zero buffers of a fresh run (None when eager is off and error feedback is false)."""
    eager.check(mode, rounds)
    if mode == "off" and not error_feedback:
        return None
    vecs = [sync.frags.flatten(params, p) for p in range(sync.frags.P)]
    ex = Extra(mode=mode)
    if error_feedback:
        ex = ex.replace(residual=tuple(jnp.zeros((R,) + v.shape, jnp.float32) for v in vecs))
    if mode != "off":
        ex = ex.replace(avg=tuple(jnp.zeros((rounds,) + v.shape, jnp.float32) for v in vecs),
                        own=tuple(jnp.zeros((rounds, R) + v.shape, jnp.float32) for v in vecs))
    if eager.per_replica(mode):
        outer_R = tuple(jnp.broadcast_to(v, (R,) + v.shape).astype(jnp.float32) for v in vecs)
        ex = ex.replace(outer=outer_R, opt=tuple(sync.tx.init(o) for o in outer_R))
    return ex


def _set(t: tuple, p: int, v) -> tuple:
    return t[:p] + (v,) + t[p + 1:]


def decoded(codec, target_Rxn, key):
    """What the receivers decode of each replica's payload (the same keys as OuterSync.average)."""
    if codec.name == "none":
        return target_Rxn
    keys_R = jax.random.split(key, target_Rxn.shape[0])
    return jax.vmap(lambda x, k: codecs.roundtrip(codec, x, k))(target_Rxn, keys_R)


def prepare(sync, ex: Extra, p: int, delta_Rxn, key, contrib_R):
    """The local half of a send (no traffic): (what each replica encodes, (R, n_p); its decoded contribution
    (swap, or error feedback) else None; Extra with the new residual). With error feedback the target is
    Δ + residual; a replica that does not contribute keeps all of it owed."""
    if ex is None or ex.residual is None:
        return delta_Rxn, (decoded(sync.codec, delta_Rxn, key) if ex is not None and ex.mode == "swap" else None), ex
    target = feedback.compensate(delta_Rxn, ex.residual[p])
    sent = decoded(sync.codec, target, key)
    res = jnp.where((contrib_R > 0)[:, None], feedback.residual(target, sent), target)
    return target, sent, ex.replace(residual=_set(ex.residual, p, res))


def exchange(sync, ex: Extra, p: int, delta_Rxn, key, contrib_R):
    """(average, each replica's decoded contribution, Extra with the new residual): one send of Δ, with
    error feedback when ex.residual is kept (`prepare`, then the exchange of what it says to encode)."""
    target, sent, ex = prepare(sync, ex, p, delta_Rxn, key, contrib_R)
    return sync.average(target, key, contrib_R), sent, ex


def local(sync, params_R, outer, p: int, key, contrib_R, mask_R=None):
    """Everything of fragment p's send that needs no traffic: (params_R, outer, target (R, n_p), what goes
    on the wire). Error feedback only: the residual kept (params unchanged). Eager: the round stepped and
    merged with the buffers' delayed average (eager_round), its own fresh average not yet in them. `land`
    with the exchanged average of `target` completes it; the placements run the exchange between the two
    (diloco/outer/eager_driver.py)."""
    ex: Extra = outer.extra
    if ex.mode == "off":
        target, _, ex = prepare(sync, ex, p, sync.delta(params_R, outer, p), key, contrib_R)
        return params_R, outer.replace(extra=ex), target
    mode = ex.mode
    flat_R = jax.vmap(lambda t: sync.frags.flatten(t, p))(params_R)
    if eager.per_replica(mode):
        fresh = ex.outer[p] - flat_R
    else:
        fresh = sync.delta(params_R, outer, p)
    target, sent, ex = prepare(sync, ex, p, fresh, key, contrib_R)
    old_avg, old_own = ex.avg[p][0], ex.own[p][0]
    if mode == "swap":  # a replica that did not contribute (fault injection) has no share to replace later
        sent = jnp.where((contrib_R > 0)[:, None], sent, 0.0)
        ex = ex.replace(own=_set(ex.own, p, jnp.concatenate([ex.own[p][1:], sent[None]])))
    g_R = eager.applied(mode, fresh, old_avg, old_own)
    if mask_R is None:
        mask_R = jnp.ones(flat_R.shape[0], bool)
    if not eager.per_replica(mode):  # naive: the shared θᵍ steps with the delayed average
        outer = sync.update(sync.with_pending(outer, p, old_avg).replace(extra=ex), p)
        return sync.merge(params_R, outer, p, mask_R), outer, target
    upd, opt_p = sync.tx.update(g_R, ex.opt[p], ex.outer[p])
    outer_p = ex.outer[p] + upd
    ex = ex.replace(outer=_set(ex.outer, p, outer_p), opt=_set(ex.opt, p, opt_p))

    def one(theta, g_n, m):
        local_n = sync.frags.flatten(theta, p)
        merged = sync.alpha * local_n + (1.0 - sync.alpha) * g_n
        return sync.frags.unflatten(theta, p, jnp.where(m, merged, local_n))

    return jax.vmap(one)(params_R, outer_p, mask_R), outer.replace(extra=ex), target


def land(outer, p: int, avg_n):
    """Fragment p's exchanged average in the outer state: pending[p] (what the finiteness check reads,
    and under error feedback alone what the apply τ steps later uses); under eager also the newest slot
    of the D-round buffer (what round r + D applies)."""
    ex: Extra = outer.extra
    if ex.mode != "off":
        outer = outer.replace(extra=ex.replace(avg=_set(ex.avg, p, jnp.concatenate([ex.avg[p][1:], avg_n[None]]))))
    return OuterSync.with_pending(outer, p, avg_n)


def send(sync, params_R, outer, p: int, key, contrib_R):
    """OuterSync.send with error feedback (eager off): the average into pending[p], the residual kept."""
    _, outer, target = local(sync, params_R, outer, p, key, contrib_R)
    return land(outer, p, sync.average(target, key, contrib_R))


def eager_round(sync, params_R, outer, p: int, key, contrib_R, mask_R=None):
    """Fragment p's round under eager: send Δ_m(r), step θᵍ with g_m(r) (eager.applied), merge.
    Returns (params_R, outer); outer.pending[p] holds the round's fresh average (in flight for D rounds:
    what the driver's finiteness check reads), the buffers hold what is applied."""
    params_R, outer, target = local(sync, params_R, outer, p, key, contrib_R, mask_R)
    return params_R, land(outer, p, sync.average(target, key, contrib_R))


def consensus(sync, outer) -> Any:
    """The evaluated θᵍ: under swap/mix the mean of the replicas' θᵍ_m per fragment, else outer.params."""
    ex = outer.extra
    if ex is None or not eager.per_replica(ex.mode):
        return outer.params
    params = outer.params
    for p in range(sync.frags.P):
        params = sync.frags.unflatten(params, p, eager.consensus(ex.outer[p]))
    return params


def shardings(ex: Extra | None, mesh):
    """Layouts of the buffers: arrays with a replica axis (residual, outer, opt: axis 0; own: axis 1) on
    the `replica` mesh axis, so a replica's buffers stay on its devices (nothing crosses `replica`);
    the averages (the same on every replica) whole everywhere."""
    if ex is None:
        return None
    from jax.sharding import NamedSharding, PartitionSpec as P

    rep, whole = NamedSharding(mesh, P("replica")), NamedSharding(mesh, P())
    own = NamedSharding(mesh, P(None, "replica"))
    per = lambda tree: None if tree is None else jax.tree_util.tree_map(lambda x: rep if x.ndim else whole, tree)
    return ex.replace(residual=per(ex.residual), outer=per(ex.outer), opt=per(ex.opt),
                      avg=None if ex.avg is None else tuple(whole for _ in ex.avg),
                      own=None if ex.own is None else tuple(own for _ in ex.own))
