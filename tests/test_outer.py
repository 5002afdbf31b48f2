"""The outer machinery (fragments, send/update/merge) against a plain-Python reading of the contract.

The inner update is replaced by "replica m subtracts c_m from every parameter", so the whole
trajectory is affine and every value can be derived independently with scalar arithmetic.
"""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco.outer import codecs
from diloco.outer.fragments import make_fragments
from diloco.outer.schedule import Schedule
from diloco.outer.sync import OuterSync, outer_optimizer

L = 3  # three "blocks" → P ∈ {1, 2, 3}


def toy_params():
    # Distinct initial values per element so that a mix-up of fragments shows.
    return {"embed": jnp.array([1.0, 2.0]), "final_norm": {"scale": jnp.array([3.0])},
            **{f"block_{i}": {"w": jnp.array([10.0 * (i + 1), 10.0 * (i + 1) + 1])} for i in range(L)}}


def reference(P, tau, alpha, steps, H, cs, lr, mu, x0, frag_of):
    """Contract, element by element, in float64 Python. x0: {name: list}; frag_of: name → p."""
    M = len(cs)
    theta = [{k: list(v) for k, v in x0.items()} for _ in range(M)]
    glob = {k: list(v) for k, v in x0.items()}
    mom = {k: [0.0] * len(v) for k, v in x0.items()}
    pending = {}
    s = Schedule(H=H, P=P, taus=(tau,) * M)
    trace = []
    for t in range(1, steps + 1):
        for m in range(M):
            for k in theta[m]:
                theta[m][k] = [x - cs[m] for x in theta[m][k]]
        for p in s.sends(t):
            pending[p] = {k: [sum(glob[k][i] - theta[m][k][i] for m in range(M)) / M for i in range(len(glob[k]))]
                          for k in glob if frag_of[k] == p}
        for p in s.applies(t):
            for k, d in pending.pop(p).items():
                for i, g in enumerate(d):
                    mom[k][i] = g + mu * mom[k][i]          # Nesterov: m ← g + μm; step −lr(g + μm)
                    glob[k][i] -= lr * (g + mu * mom[k][i])
                    for m in range(M):
                        theta[m][k][i] = alpha * theta[m][k][i] + (1 - alpha) * glob[k][i]
        trace.append(([{k: list(v) for k, v in th.items()} for th in theta], {k: list(v) for k, v in glob.items()}))
    return trace


def names(tree):
    return {"/".join(str(getattr(k, "key", k)) for k in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


GRID = list(itertools.product([1, 2, 3], [0, 1, 2], [0.0, 0.5, 1.0]))


@pytest.mark.parametrize("P,tau,alpha", GRID)
def test_closed_form_trace(P, tau, alpha):
    H, steps, cs, lr, mu = 4, 13, (0.5, 1.5), 0.7, 0.9
    params = toy_params()
    frags = make_fragments(params, L, fragments=P, pattern="sequential")
    sync = OuterSync(frags, codecs.make_codec("none"), outer_optimizer(lr, mu), alpha)
    frag_of = {}
    for p in range(frags.P):
        for n in frags.names[p]:
            frag_of[n] = p
    x0 = {k: [float(x) for x in np.asarray(v)] for k, v in names(params).items()}
    ref = reference(P, tau, alpha, steps, H, cs, lr, mu, x0, frag_of)

    s = Schedule(H=H, P=P, taus=(tau, tau))
    params_R = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), params)
    outer = sync.init(params)
    c_R = jnp.array(cs)
    for t in range(1, steps + 1):
        params_R = jax.tree_util.tree_map(lambda x: x - c_R.reshape((2,) + (1,) * (x.ndim - 1)), params_R)
        for p in s.sends(t):
            outer = sync.send(params_R, outer, p, jax.random.PRNGKey(t), jnp.ones(2))
        for p in s.outer_updates(t):
            outer = sync.update(outer, p)
        for p, mask in s.merges(t):
            params_R = sync.merge(params_R, outer, p, jnp.array(mask))
        want_theta, want_glob = ref[t - 1]
        got = names(params_R)
        for k, v in names(outer.params).items():
            np.testing.assert_allclose(np.asarray(v), want_glob[k], rtol=1e-5, atol=1e-5, err_msg=f"θ^g {k} t={t}")
        for m in range(2):
            for k, v in got.items():
                np.testing.assert_allclose(np.asarray(v[m]), want_theta[m][k], rtol=1e-5, atol=1e-5,
                                           err_msg=f"replica {m} {k} t={t}")


def test_hand_computed_diloco_round():
    """M=2, H=1, P=1, lr=1, μ=0, α=0: one round by hand.
    θ0 = 1; replica 0 → 0.5, replica 1 → −0.5; Δ = mean(1−0.5, 1+0.5) = 1; θ^g = 1 − 1·1 = 0."""
    params = {"block_0": {"w": jnp.array([1.0])}}
    sync = OuterSync(make_fragments(params, 1), codecs.make_codec("none"), outer_optimizer(1.0, 0.0), 0.0)
    outer = sync.init(params)
    params_R = {"block_0": {"w": jnp.array([[0.5], [-0.5]])}}
    outer = sync.update(sync.send(params_R, outer, 0, jax.random.PRNGKey(0), jnp.ones(2)), 0)
    assert float(outer.params["block_0"]["w"][0]) == 0.0
    merged = sync.merge(params_R, outer, 0, jnp.array([True, True]))
    np.testing.assert_array_equal(np.asarray(merged["block_0"]["w"]), [[0.0], [0.0]])


def test_outer_gradient_sign_moves_outer_params_toward_replicas():
    params = {"block_0": {"w": jnp.zeros(4)}}
    sync = OuterSync(make_fragments(params, 1), codecs.make_codec("none"), outer_optimizer(0.4, 0.0), 0.0)
    outer = sync.init(params)
    params_R = {"block_0": {"w": jnp.ones((2, 4))}}
    outer = sync.update(sync.send(params_R, outer, 0, jax.random.PRNGKey(0), jnp.ones(2)), 0)
    np.testing.assert_allclose(np.asarray(outer.params["block_0"]["w"]), 0.4)


def test_non_synced_fragment_momentum_untouched():
    params = toy_params()
    frags = make_fragments(params, L, fragments=3, pattern="sequential")
    sync = OuterSync(frags, codecs.make_codec("none"), outer_optimizer(0.4, 0.9), 0.0)
    outer = sync.init(params)
    params_R = jax.tree_util.tree_map(lambda x: jnp.stack([x - 1, x - 2]), params)
    outer = sync.update(sync.send(params_R, outer, 1, jax.random.PRNGKey(0), jnp.ones(2)), 1)
    for p in (0, 2):
        assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree_util.tree_leaves(outer.opt[p]))
        np.testing.assert_array_equal(np.asarray(frags.flatten(outer.params, p)),
                                      np.asarray(frags.flatten(params, p)))
    assert float(jnp.abs(jax.tree_util.tree_leaves(outer.opt[1])[0]).max()) > 0


def test_missing_replica_contributes_nothing():
    params = {"block_0": {"w": jnp.zeros(3)}}
    sync = OuterSync(make_fragments(params, 1), codecs.make_codec("none"), outer_optimizer(1.0, 0.0), 0.0)
    outer = sync.init(params)
    params_R = {"block_0": {"w": jnp.array([[1.0] * 3, [5.0] * 3])}}
    outer = sync.send(params_R, outer, 0, jax.random.PRNGKey(0), jnp.array([1.0, 0.0]))
    np.testing.assert_allclose(np.asarray(outer.pending[0]["block_0"]["w"]), -1.0)  # only replica 0's Δ = 0 − 1


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_outer_adam_by_name_is_adam_by_hand(name):
    """outer.name=adam/adamw: two sends + updates of one fragment against Adam(W) written out in numpy on
    the same averaged Δ (lr 0.1, b1 0.9, b2 0.99, eps 1e-8, weight decay 0.01 for adamw; subtree-shaped)."""
    params = {"block_0": {"w": jnp.array([1.0, -2.0, 0.5])}}
    sync = OuterSync(make_fragments(params, 1), codecs.make_codec("none"),
                     outer_optimizer(0.1, 0.9, name, b2=0.99, eps=1e-8, weight_decay=0.01), 0.0)
    outer, x, m, v = sync.init(params), np.array([1.0, -2.0, 0.5]), 0.0, 0.0
    for t, c in enumerate(([0.3, -0.1], [-0.2, 0.4]), 1):
        params_R = {"block_0": {"w": jnp.asarray(np.stack([x - c[0], x - c[1] * x]), jnp.float32)}}
        g = x - np.asarray(params_R["block_0"]["w"], np.float64).mean(0)  # the averaged Δ
        outer = sync.update(sync.send(params_R, outer, 0, jax.random.PRNGKey(0), jnp.ones(2)), 0)
        m, v = 0.9 * m + 0.1 * g, 0.99 * v + 0.01 * g * g
        x = x - 0.1 * ((m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.99 ** t)) + 1e-8) + (0.01 * x if name == "adamw" else 0))
        np.testing.assert_allclose(np.asarray(outer.params["block_0"]["w"]), x, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["adam", "muon"])
def test_outer_optimizer_steps_the_fragment_subtree_as_optax_does_by_hand(name):
    """outer.name=adam/muon: the outer state is shaped like the fragment's parameters (OuterState.opt),
    so two sends + updates of a fragment of blocks 0 and 2 (and the embedding) equal optax's optimizer
    applied by hand to the subtree of those parameters with the same averaged Δ; muon orthogonalizes
    the (4, 3) kernels (a flat vector would have given every element to its Adam) and Adams the rest."""
    from jax.flatten_util import ravel_pytree
    from optax.contrib import MuonDimensionNumbers as Dims

    from diloco.outer.sync import muon_matrices

    rng = np.random.default_rng(0)
    params = {"embed": {"embedding": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)},
              **{f"block_{i}": {"kernel": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
                                "scale": jnp.asarray(rng.normal(size=(3,)), jnp.float32)} for i in range(3)}}
    frags = make_fragments(params, 3, fragments=2)  # fragment 0: embed, block_0, block_2
    tx = outer_optimizer(0.1, 0.9, name, b2=0.99)
    sync = OuterSync(frags, codecs.make_codec("none"), tx, 0.0)
    sub = lambda t: {k: t[k] for k in ("embed", "block_0", "block_2")}  # noqa: E731
    outer, x = sync.init(params), sub(params)
    ref = tx.init(x)
    for t in range(2):
        params_R = jax.tree_util.tree_map(lambda v: jnp.stack([v - 0.1 * (t + 1), v * (0.9 - 0.05 * t)]),
                                          outer.params)
        outer = sync.send(params_R, outer, 0, jax.random.PRNGKey(0), jnp.ones(2))
        by_hand = jax.tree_util.tree_map(lambda g, r: g - r.mean(0), x, sub(params_R))
        np.testing.assert_allclose(ravel_pytree(by_hand)[0], ravel_pytree(outer.pending[0])[0], rtol=1e-5, atol=1e-7)
        delta = outer.pending[0]  # the averaged Δ, held as the fragment's subtree
        outer = sync.update(outer, 0)
        upd, ref = tx.update(delta, ref, x)
        x = jax.tree_util.tree_map(jnp.add, x, upd)
        for got, want in zip(jax.tree_util.tree_leaves(sub(outer.params)), jax.tree_util.tree_leaves(x)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=1e-6)
    np.testing.assert_array_equal(outer.params["block_1"]["kernel"], params["block_1"]["kernel"])  # not its fragment
    matrices = jax.tree_util.tree_leaves(muon_matrices(x), is_leaf=lambda d: d is None or isinstance(d, Dims))
    assert [m is not None for m in matrices] == [True, False, True, False, False]  # kernel, scale ×2, embedding


def test_in_step_fails_loudly_when_a_parked_send_was_never_carried():
    """Trainer.inner_step instead of placement.step: the send parked after step 4 never runs, so the next
    send or apply raises instead of applying the previous Δ."""
    from diloco.outer.placement import InStep

    pl = InStep(driver=None)
    pl.send("state", 1, 4, None, None)
    assert pl.land("state", 0, 4) == "state"  # another fragment's apply at the send's own step
    for call, msg in ((lambda: pl.land("state", 0, 5), "placement.step"), (lambda: pl.land("state", 1, 4), "still parked"),
                      (lambda: pl.send("state", 2, 5, None, None), "never exchanged")):
        with pytest.raises(RuntimeError, match=msg):
            call()


@pytest.mark.parametrize("pattern,expected", [
    ("sequential", [["block_0", "block_1", "block_2", "embed", "final_norm"], ["block_3", "block_4", "block_5"]]),
    ("strided", [["block_0", "block_2", "block_4", "embed", "final_norm"], ["block_1", "block_3", "block_5"]]),
])
def test_fragment_assignment(pattern, expected):
    params = {"embed": jnp.zeros(2), "final_norm": jnp.zeros(1), **{f"block_{i}": jnp.zeros(3) for i in range(6)}}
    frags = make_fragments(params, 6, layers_per_fragment=3, pattern=pattern)
    assert [sorted(n) for n in frags.names] == expected
    assert frags.sizes == (3 * 3 + 3, 3 * 3)


def test_scanned_blocks_split_by_rows_and_roundtrip():
    params = {"embed": jnp.arange(2.0), "blocks": {"w": jnp.arange(12.0).reshape(6, 2)}}
    frags = make_fragments(params, 6, layers_per_fragment=2, pattern="strided", embed_fragment="own")
    assert frags.P == 4 and frags.sizes == (4, 4, 4, 2)
    np.testing.assert_array_equal(np.asarray(frags.flatten(params, 1)), [2, 3, 8, 9])  # rows 1 and 4
    back = frags.unflatten(params, 1, jnp.full(4, -1.0))
    np.testing.assert_array_equal(np.asarray(back["blocks"]["w"])[[1, 4]], -1)
    np.testing.assert_array_equal(np.asarray(back["blocks"]["w"])[[0, 2, 3, 5]],
                                  np.asarray(params["blocks"]["w"])[[0, 2, 3, 5]])


def test_a_payload_crosses_as_one_byte_buffer_and_comes_back_exactly():
    """gather_packed: codes (uint8), scales (f32) and bf16 values of 2 local rows, through a stand-in
    gather that stacks two replicas (the local rows, then the same + 1): one gather call, and every array
    comes back bit for bit in its dtype and shape, the second replica's rows after the first's."""
    import jax.numpy as jnp

    from diloco.outer.sync import gather_packed

    rng = np.random.default_rng(0)
    payload = {"codes": jnp.asarray(rng.integers(0, 256, (2, 5, 3), dtype=np.uint8)),
               "scales": jnp.asarray(rng.standard_normal((2, 4)).astype(np.float32)),
               "values": jnp.asarray(rng.standard_normal((2, 6)), dtype=jnp.bfloat16)}
    calls = []

    def gather(x):
        calls.append(x.shape)
        return jnp.concatenate([x, x + 1], axis=0)  # bytes + 1: a different, known second replica

    out = gather_packed(payload, gather)
    assert calls == [(2, 5 * 3 + 4 * 4 + 6 * 2)]  # one buffer: 15 code bytes, 16 scale bytes, 12 bf16 bytes
    for k, v in payload.items():
        assert out[k].dtype == v.dtype and out[k].shape == (4,) + v.shape[1:]
        np.testing.assert_array_equal(np.asarray(out[k][:2]).view(np.uint8), np.asarray(v).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(out["codes"][2:]), np.asarray(payload["codes"]) + 1)
