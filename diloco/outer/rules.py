"""What a send does, as rules (optax-style: a rule is an object with `init`, `local`, `land`; a wrapper
takes a rule and returns one). A send of fragment p after inner step t is

  local(…)   everything without traffic: Δ (or what the rule sends), residuals, the rule's bookkeeping;
             returns the payload each replica encodes: fragment p's subtree with a replica axis (Plain:
             each chip encodes the blocks it holds), or the canonical (R, n_p) vector (a rule with flat buffers)
  exchange   encode → all-gather over `replica` → decode → FP32 average (`OuterSync.average`): the
             placement's business (diloco/outer/placement.py: now, on the next step's program, or on the
             comm devices)
  land(…)    where the average (fragment p's subtree) is written: its pending slot (and the rule's buffers)

then the outer update and merge follow the schedule (diloco/outer/driver.py), unless the rule did its
round itself (`round_in_send`). The rules:

  Plain                 local = Δ, land = into pending (Streaming DiLoCo; DiLoCo is P = 1, τ = 0)
  Eager(mode, D)        [EU] naive / swap / mix (diloco/outer/eager.py): local steps θᵍ with the average of
                        D rounds ago and merges; land appends the fresh average to the D-round buffer
  ErrorFeedback(rule)   wraps any rule: it encodes payload + residual and keeps what the codec dropped
                        (diloco/outer/feedback.py)

A rule sees ONE fragment: the outer state's per-fragment tuples (opt, pending, Extra's) cut to fragment
p's slots (`view`; `put` writes them back), and the fragment's rows at `starts` (a program shared by
the fragments of a layout, `Fragments.layout`), so every rule's programs are per layout, not per
fragment. `Extra` (OuterState.extra, checkpointed; None for Plain) keeps canonical flat vectors (pieces
end to end), so a rule with buffers flattens Δ (a regather when the chips of a replica split it 2-D):

  residual[p]   (R, n_p) f32   error feedback: what each replica meant to send and the codec did not
  avg[p]        (D, n_p) f32   eager: the averaged Δ of fragment p's last D rounds, oldest first
  own[p]        (D, R, n_p)    eager: each replica's decoded contribution to them (swap removes it)
  outer[p]      (R, n_p) f32   eager swap/mix: θᵍ_m,p per replica (naive keeps the shared θᵍ)
  opt[p]        optax state over (R, n_p): each replica's outer-optimizer state of fragment p (swap/mix)
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from diloco.outer import codecs, eager, feedback

SLOTS = ("residual", "avg", "own", "outer", "opt")  # Extra's per-fragment tuples


@struct.dataclass
class Extra:
    residual: tuple | None = None
    avg: tuple | None = None
    own: tuple | None = None
    outer: tuple | None = None
    opt: tuple | None = None
    mode: str = struct.field(pytree_node=False, default="off")


def _cut(t, p):
    return None if t is None else (t[p],)


def _put(t, p, v):
    return None if t is None else t[:p] + v + t[p + 1:]


def view(outer, p: int):
    """Fragment p's slots of the outer state (every per-fragment tuple cut to its one element)."""
    ex = outer.extra
    return outer.replace(opt=_cut(outer.opt, p), pending=_cut(outer.pending, p),
                         extra=None if ex is None else ex.replace(**{f: _cut(getattr(ex, f), p) for f in SLOTS}))


def put(outer, p: int, v):
    """`outer` with fragment p's slots (and θᵍ) taken from its view `v`."""
    ex = outer.extra
    return outer.replace(params=v.params, opt=_put(outer.opt, p, v.opt), pending=_put(outer.pending, p, v.pending),
                         extra=None if ex is None else ex.replace(
                             **{f: _put(getattr(ex, f), p, getattr(v.extra, f)) for f in SLOTS}))


def flat1(tree) -> jax.Array:
    """A fragment subtree (no replica axis) as its canonical vector (n_p,)."""
    return jnp.concatenate([x.reshape(-1) for x in jax.tree_util.tree_leaves(tree)])


def decoded(codec, target_Rxn, key):
    """What the receivers decode of each replica's payload (the same keys as OuterSync.average)."""
    if codec.name == "none":
        return target_Rxn
    keys_R = jax.random.split(key, target_Rxn.shape[0])
    return jax.vmap(lambda x, k: codecs.roundtrip(codec, x, k))(target_Rxn, keys_R)


def as_is(sync, v, fresh_Rxn, key, contrib_R, need_sent: bool):
    """The payload hook of a bare rule: (payload = what it made, its decoded form when the rule needs it, v)."""
    return fresh_Rxn, (decoded(sync.codec, fresh_Rxn, key) if need_sent else None), v


class Plain:
    """Streaming DiLoCo's send: local = Δ, land = into pending."""
    round_in_send = False  # the schedule's outer update and merge apply the average τ steps later
    stateless = True       # no buffers: a send program returns only the average

    def init(self, sync, params, R: int, vecs) -> Extra | None:
        return None

    def local(self, sync, params_R, v, p: int, key, contrib_R, starts=None, encode=as_is):
        target, _, v = encode(sync, v, sync.delta(params_R, v, p, starts), key, contrib_R, False)
        return params_R, v, target

    def land(self, v, avg):
        return v.replace(pending=(avg,))

    def eval_params(self, sync, outer):
        return outer.params

    @property
    def eval_label(self) -> str:
        """What a run evaluates (summary.json `eval_params`)."""
        return eager.eval_params_label("off")


class Eager(Plain):
    """[EU] eager updates: fragment p's round at its send (step θᵍ with the average of D rounds ago, merge);
    the fresh average lands in the D-round buffer (read by round r + D, so in time the exchange overlaps D
    whole rounds) and in pending (what the finiteness check reads)."""
    round_in_send = True
    stateless = False

    def __init__(self, mode: str, rounds: int = 1):
        eager.check(mode, rounds)
        self.mode, self.rounds = mode, rounds

    def init(self, sync, params, R: int, vecs) -> Extra:
        ex = Extra(mode=self.mode, avg=tuple(jnp.zeros((self.rounds,) + v.shape, jnp.float32) for v in vecs),
                   own=tuple(jnp.zeros((self.rounds, R) + v.shape, jnp.float32) for v in vecs))
        if eager.per_replica(self.mode):
            outer_R = tuple(jnp.broadcast_to(v, (R,) + v.shape).astype(jnp.float32) for v in vecs)
            ex = ex.replace(outer=outer_R, opt=tuple(sync.tx.init(o) for o in outer_R))
        return ex

    def local(self, sync, params_R, v, p: int, key, contrib_R, starts=None, encode=as_is):
        mode, flat = self.mode, lambda t: sync.frags.flatten(t, p, starts)
        flat_R = jax.vmap(flat)(params_R)
        fresh = v.extra.outer[0] - flat_R if eager.per_replica(mode) else sync.flat(sync.delta(params_R, v, p, starts))
        target, sent, v = encode(sync, v, fresh, key, contrib_R, mode == "swap")
        ex = v.extra
        old_avg, old_own = ex.avg[0][0], ex.own[0][0]
        if mode == "swap":  # a replica that did not contribute (fault injection) has no share to replace later
            sent = jnp.where((contrib_R > 0)[:, None], sent, 0.0)
            ex = ex.replace(own=(jnp.concatenate([ex.own[0][1:], sent[None]]),))
        mask_R = jnp.ones(flat_R.shape[0], bool)
        if not eager.per_replica(mode):  # naive: the shared θᵍ steps with the delayed average
            delayed = sync.as_subtree(old_avg, p)
            params, opt_p = sync.outer_step(v.params, v.opt[0], delayed, p, starts)
            v = v.replace(params=params, opt=(opt_p,), pending=(delayed,), extra=ex)
            return sync.merge(params_R, v, p, mask_R, starts), v, target
        g_R = eager.applied(mode, fresh, old_avg, old_own)
        upd, opt_p = sync.tx.update(g_R, ex.opt[0], ex.outer[0])
        outer_p = ex.outer[0] + upd
        v = v.replace(extra=ex.replace(outer=(outer_p,), opt=(opt_p,)))

        one = lambda theta, g_n, m: sync.merge_one(theta, sync.frags.split(g_n, p), m, p, starts)  # noqa: E731
        return jax.vmap(one)(params_R, outer_p, mask_R), v, target

    def land(self, v, avg):
        ex, avg_n = v.extra, flat1(avg)
        return v.replace(pending=(avg,), extra=ex.replace(avg=(jnp.concatenate([ex.avg[0][1:], avg_n[None]]),)))

    def eval_params(self, sync, outer):
        """Under swap/mix the mean of the replicas' θᵍ_m per fragment (eager.consensus), else θᵍ."""
        if not eager.per_replica(self.mode):
            return outer.params
        params = outer.params
        for p in range(sync.frags.P):
            params = sync.frags.unflatten(params, p, eager.consensus(outer.extra.outer[p]))
        return params

    @property
    def eval_label(self) -> str:
        return eager.eval_params_label(self.mode)


class ErrorFeedback:
    """Wraps a rule: each replica encodes the rule's payload plus its residual, and keeps as its new residual
    what the receivers do not decode (a replica that does not contribute keeps all of it owed)."""

    def __init__(self, rule):
        self.rule = rule
        self.round_in_send, self.stateless = rule.round_in_send, False

    def init(self, sync, params, R: int, vecs) -> Extra:
        ex = self.rule.init(sync, params, R, vecs) or Extra()
        return ex.replace(residual=tuple(jnp.zeros((R,) + v.shape, jnp.float32) for v in vecs))

    def local(self, sync, params_R, v, p: int, key, contrib_R, starts=None, encode=as_is):
        return self.rule.local(sync, params_R, v, p, key, contrib_R, starts, encode=self.compensated)

    @staticmethod
    def compensated(sync, v, fresh, key, contrib_R, need_sent: bool):
        fresh_Rxn = fresh if hasattr(fresh, "shape") else sync.flat(fresh)  # Plain's Δ subtree: canonical
        target = feedback.compensate(fresh_Rxn, v.extra.residual[0])
        sent = decoded(sync.codec, target, key)
        res = jnp.where((contrib_R > 0)[:, None], feedback.residual(target, sent), target)
        return target, sent, v.replace(extra=v.extra.replace(residual=(res,)))

    def land(self, v, avg):
        return self.rule.land(v, avg)

    def eval_params(self, sync, outer):
        return self.rule.eval_params(sync, outer)

    @property
    def eval_label(self) -> str:
        return self.rule.eval_label


def make_rule(cfg):
    """The rule of a run's config (`eager`, `eager_rounds`, `error_feedback`)."""
    mode = cfg.get("eager", "off")
    rule = Plain() if mode == "off" else Eager(mode, cfg.get("eager_rounds", 1))
    return ErrorFeedback(rule) if cfg.get("error_feedback", False) else rule


def init(rule, sync, params, R: int) -> Extra | None:
    """The rule's zero buffers for a fresh run (OuterState.extra)."""
    return rule.init(sync, params, R, [sync.frags.flatten(params, p) for p in range(sync.frags.P)])


def send(rule, sync, params_R, v, p: int, key, contrib_R, starts=None, pin=lambda x: x):
    """A whole send on fragment p's view, blocking: local, the exchange, land → (params_R, v)."""
    params_R, v, target = rule.local(sync, params_R, v, p, key, contrib_R, starts)
    return params_R, rule.land(v, pin(sync.average(target, key, contrib_R, p)))


def shardings(ex: Extra | None, mesh) -> Any:
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
