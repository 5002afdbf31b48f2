"""Eager updates ([EU]) as pure math: hand-computed rounds 1–3 on M = 2 and M = 3 scalar parameters.

The inner phase of round r is replaced by a fixed move: replica m ends round r at θᵍ_m − d_m(r), so with
α = 0 its outer gradient is Δ_m(r) = d_m(r) exactly. Outer Nesterov lr = 1, momentum μ = 0.5:
m ← g + μm, θᵍ ← θᵍ − (g + μm). Every number below is worked out by hand in the comments.
"""
import numpy as np
import pytest

from diloco.outer import eager

D2 = [(2.0, 4.0), (6.0, 2.0), (4.0, 8.0)]  # M = 2: Δ̄(1) = 3, Δ̄(2) = 4, Δ̄(3) = 6
D3 = [(3.0, 6.0, 9.0), (9.0, 3.0, 6.0), (6.0, 6.0, 0.0)]  # M = 3: Δ̄ = 6, 6, 4


def run(mode, d, rounds=1):
    ref = eager.EagerRef(mode, np.zeros(1), M=len(d[0]), lr=1.0, momentum=0.5, rounds=rounds)
    outer, mom = [], []
    for d_r in d:
        ref.round(ref.outer - np.asarray(d_r)[:, None])
        outer.append(ref.outer[:, 0].tolist())
        mom.append(ref.mom[:, 0].tolist())
    return [g[:, 0].tolist() for g in ref.applied_log], outer, mom


def test_m2_naive_applies_the_previous_rounds_average():
    # g = Δ̄(r−1): 0 (round 1: nothing arrived), 3, 4, on both replicas.
    # m: 0, 3, 4 + 1.5 = 5.5;  θ: 0, −(3 + 1.5) = −4.5, −4.5 − (4 + 2.75) = −11.25
    g, outer, mom = run("naive", D2)
    assert g == [[0, 0], [3, 3], [4, 4]]
    assert mom == [[0, 0], [3, 3], [5.5, 5.5]]
    assert outer == [[0, 0], [-4.5, -4.5], [-11.25, -11.25]]


def test_m2_swap():
    # g_m = Δ̄(r−1) + (Δ_m(r) − Δ_m(r−1))/2
    # r1: (2/2, 4/2) = (1, 2);  r2: 3 + (6−2)/2 = 5, 3 + (2−4)/2 = 2;  r3: 4 + (4−6)/2 = 3, 4 + (8−2)/2 = 7
    # replica 1: m 1, 5 + .5 = 5.5, 3 + 2.75 = 5.75; θ −1.5, −1.5 − 7.75 = −9.25, −9.25 − 5.875 = −15.125
    # replica 2: m 2, 2 + 1 = 3, 7 + 1.5 = 8.5;      θ −3, −3 − 3.5 = −6.5, −6.5 − 11.25 = −17.75
    g, outer, mom = run("swap", D2)
    assert g == [[1, 2], [5, 2], [3, 7]]
    assert mom == [[1, 2], [5.5, 3], [5.75, 8.5]]
    assert outer == [[-1.5, -3], [-9.25, -6.5], [-15.125, -17.75]]


def test_m2_mix():
    # g_m = Δ_m(r)/2 + Δ̄(r−1)/2:  r1 (1, 2);  r2 (3 + 1.5, 1 + 1.5) = (4.5, 2.5);  r3 (2 + 2, 4 + 2) = (4, 6)
    # replica 1: m 1, 4.5 + .5 = 5, 4 + 2.5 = 6.5;      θ −1.5, −1.5 − 7 = −8.5, −8.5 − 7.25 = −15.75
    # replica 2: m 2, 2.5 + 1 = 3.5, 6 + 1.75 = 7.75;   θ −3, −3 − 4.25 = −7.25, −7.25 − 9.875 = −17.125
    g, outer, mom = run("mix", D2)
    assert g == [[1, 2], [4.5, 2.5], [4, 6]]
    assert mom == [[1, 2], [5, 3.5], [6.5, 7.75]]
    assert outer == [[-1.5, -3], [-8.5, -7.25], [-15.75, -17.125]]


def test_m3_all_readings():
    # swap: r1 (1, 2, 3); r2 6 + (9−3)/3 = 8, 6 + (3−6)/3 = 5, 6 + (6−9)/3 = 5;
    #       r3 6 + (6−9)/3 = 5, 6 + (6−3)/3 = 7, 6 + (0−6)/3 = 4
    g, outer, mom = run("swap", D3)
    assert g == [[1, 2, 3], [8, 5, 5], [5, 7, 4]]
    # m (per replica, rounds): r1 = g; r2 8 + .5 = 8.5, 5 + 1 = 6, 5 + 1.5 = 6.5; r3 5 + 4.25, 7 + 3, 4 + 3.25
    assert mom == [[1, 2, 3], [8.5, 6, 6.5], [9.25, 10, 7.25]]
    # θ: r1 −1.5, −3, −4.5; r2 −1.5 − 12.25, −3 − 8, −4.5 − 8.25; r3 −13.75 − 9.625, −11 − 12, −12.75 − 7.625
    assert outer == [[-1.5, -3, -4.5], [-13.75, -11, -12.75], [-23.375, -23, -20.375]]
    # mix: g_m = Δ_m(r)/3 + (2/3)Δ̄(r−1): r1 (1, 2, 3); r2 (3 + 4, 1 + 4, 2 + 4); r3 (2 + 4, 2 + 4, 0 + 4)
    g, outer_mix, mom = run("mix", D3)
    assert g == [[1, 2, 3], [7, 5, 6], [6, 6, 4]]
    assert mom == [[1, 2, 3], [7.5, 6, 7.5], [9.75, 9, 7.75]]
    assert outer_mix == [[-1.5, -3, -4.5], [-12.25, -11, -14.25], [-23.125, -21.5, -22.125]]
    # naive: g 0, 6, 6; m 0, 6, 9; θ 0, −9, −9 − 10.5 = −19.5 on every replica
    g, outer, mom = run("naive", D3)
    assert g == [[0] * 3, [6] * 3, [6] * 3] and mom == [[0] * 3, [6] * 3, [9] * 3]
    assert outer == [[0] * 3, [-9] * 3, [-19.5] * 3]


def test_swap_and_mix_share_the_consensus():
    """mean_m g_m is Δ̄(r)/M + (M−1)/M·Δ̄(r−D) under both readings, so the evaluated mean θᵍ is the same;
    only the spread between replicas differs (M = 3, round 3: both −66.75/3 = −22.25)."""
    for d in (D2, D3):
        _, swap, _ = run("swap", d)
        _, mix, _ = run("mix", d)
        assert [np.mean(r) for r in swap] == [np.mean(r) for r in mix]
    assert np.mean(run("swap", D3)[1][2]) == -22.25
    assert eager.consensus(np.array([[-23.375], [-23.0], [-20.375]]))[0] == -22.25


def test_two_round_delay():
    # D = 2: g_m = Δ̄(r−2) + (Δ_m(r) − Δ_m(r−2))/2: r1 (1, 2); r2 (3, 1); r3 3 + (4−2)/2 = 4, 3 + (8−4)/2 = 5
    # replica 1: m 1, 3 + .5 = 3.5, 4 + 1.75 = 5.75; θ −1.5, −1.5 − 4.75 = −6.25, −6.25 − 6.875 = −13.125
    # replica 2: m 2, 1 + 1 = 2, 5 + 1 = 6;          θ −3, −3 − 2 = −5, −5 − 8 = −13
    g, outer, mom = run("swap", D2, rounds=2)
    assert g == [[1, 2], [3, 1], [4, 5]]
    assert mom == [[1, 2], [3.5, 2], [5.75, 6]]
    assert outer == [[-1.5, -3], [-6.25, -5], [-13.125, -13]]
    g, _, _ = run("naive", D2, rounds=2)  # Δ̄(r−2): 0, 0, 3
    assert g == [[0, 0], [0, 0], [3, 3]]


def test_nesterov_is_optax_sgd():
    import jax.numpy as jnp
    import optax

    tx = optax.sgd(0.7, momentum=0.9, nesterov=True)
    theta, state = jnp.array([1.0, -2.0]), None
    state = tx.init(theta)
    ref_t, ref_m = np.array([1.0, -2.0]), np.zeros(2)
    for g in ([0.5, 1.0], [-0.25, 2.0], [1.0, 0.0]):
        upd, state = tx.update(jnp.array(g), state, theta)
        theta = theta + upd
        ref_t, ref_m = eager.nesterov(ref_t, ref_m, np.array(g), 0.7, 0.9)
    np.testing.assert_allclose(np.asarray(theta), ref_t, rtol=1e-6)


def test_merge_alpha_and_in_flight():
    """α = 0.5: replicas continue from the midpoint of their local θ and their own θᵍ_m; the last D rounds'
    Δ are in flight."""
    ref = eager.EagerRef("swap", np.zeros(1), M=2, lr=1.0, momentum=0.5, alpha=0.5)
    out = ref.round(np.array([[-2.0], [-4.0]]))  # Δ = (2, 4), g = (1, 2), θᵍ = (−1.5, −3)
    assert out[:, 0].tolist() == [(-2 - 1.5) / 2, (-4 - 3) / 2]
    assert [d[:, 0].tolist() for d in ref.in_flight()] == [[2.0, 4.0]]


# --- the rules on the trainer's outer state (diloco/outer/rules.py, what the send programs run) against EagerRef ---


def _toy_sync(P, alpha=0.0, codec="none", name="nesterov"):
    import jax.numpy as jnp

    from diloco.outer import codecs
    from diloco.outer.fragments import make_fragments
    from diloco.outer.sync import OuterSync, outer_optimizer

    params = {"embed": jnp.array([1.0, 2.0]), **{f"block_{i}": {"w": jnp.array([3.0 + i, -1.0 - i])} for i in range(2)}}
    frags = make_fragments(params, 2, fragments=P, pattern="sequential")
    return params, OuterSync(frags, codecs.make_codec(codec), outer_optimizer(0.7, 0.9, name), alpha)


@pytest.mark.parametrize("mode, rounds, alpha, opt", [("naive", 1, 0.0, "nesterov"), ("swap", 1, 0.0, "nesterov"),
                                                      ("mix", 1, 0.5, "nesterov"), ("swap", 2, 0.5, "nesterov"),
                                                      ("naive", 2, 0.5, "adam")])  # naive: any outer optimizer
def test_eager_round_matches_the_float64_reference(mode, rounds, alpha, opt):
    """M = 2, P = 2, every step a round of both fragments (H = 1 style): replica m subtracts c_m·(1 + t)
    from its parameters each step; 5 rounds of eager_round against EagerRef fragment by fragment."""
    import jax
    import jax.numpy as jnp

    from diloco.outer import rules

    params, sync = _toy_sync(2, alpha, name=opt)
    params_R = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), params)
    rule = rules.Eager(mode, rounds)
    outer = sync.init(params).replace(extra=rules.init(rule, sync, params, 2))
    refs = [eager.EagerRef(mode, np.asarray(sync.frags.flatten(params, p)), 2, lr=0.7, momentum=0.9, alpha=alpha,
                           rounds=rounds, step=getattr(eager, opt)) for p in range(2)]
    c = jnp.array([0.25, -0.5])
    for t in range(5):
        params_R = jax.tree_util.tree_map(lambda x: x - (c * (1 + t)).reshape(2, 1), params_R)
        for p in range(2):
            local = np.asarray(jax.vmap(lambda th: sync.frags.flatten(th, p))(params_R), np.float64)
            want = refs[p].round(local)
            params_R, outer = _send(rule, sync, params_R, outer, p, jax.random.PRNGKey(t))
            got = np.asarray(jax.vmap(lambda th: sync.frags.flatten(th, p))(params_R))
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{mode} t={t} p={p}")
    cons = rule.eval_params(sync, outer)
    for p in range(2):
        np.testing.assert_allclose(np.asarray(sync.frags.flatten(cons, p)), refs[p].outer.mean(0), rtol=1e-5, atol=1e-5)


def _send(rule, sync, params_R, outer, p, key):
    """rules.send on fragment p's view of the whole outer state (what the driver's send program runs)."""
    import jax.numpy as jnp

    from diloco.outer import rules

    params_R, v = rules.send(rule, sync, params_R, rules.view(outer, p), p, key, jnp.ones(2))
    return params_R, rules.put(outer, p, v)


def test_feedback_send_lossless_is_the_plain_send_bit_for_bit():
    import jax
    import jax.numpy as jnp

    from diloco.outer import rules

    params, sync = _toy_sync(2)
    params_R = jax.tree_util.tree_map(lambda x: jnp.stack([x - 0.3, x + 0.1]), params)
    outer = sync.init(params)
    plain = sync.send(params_R, outer, 1, jax.random.PRNGKey(0), jnp.ones(2))
    rule = rules.ErrorFeedback(rules.Plain())
    _, ef = _send(rule, sync, params_R, outer.replace(extra=rules.init(rule, sync, params, 2)), 1, jax.random.PRNGKey(0))
    assert np.array_equal(np.asarray(rules.flat1(plain.pending[1])), np.asarray(rules.flat1(ef.pending[1])))
    assert all(not np.any(np.asarray(r)) for r in ef.extra.residual)


def test_feedback_send_lossy_keeps_what_the_codec_dropped():
    """e3m0: the residual is Δ + 0 − decode(encode(Δ)) per replica, and the next send encodes Δ + residual."""
    import jax
    import jax.numpy as jnp

    from diloco.outer import codecs, rules

    params, sync = _toy_sync(1, codec="e3m0")
    params_R = jax.tree_util.tree_map(lambda x: jnp.stack([x - 0.37, x + 0.11]), params)
    rule = rules.ErrorFeedback(rules.Plain())
    outer = sync.init(params).replace(extra=rules.init(rule, sync, params, 2))
    delta = sync.flat(sync.delta(params_R, outer, 0))
    _, outer = _send(rule, sync, params_R, outer, 0, jax.random.PRNGKey(0))
    dec = jax.vmap(lambda x: codecs.roundtrip(sync.codec, x))(delta)
    np.testing.assert_array_equal(np.asarray(outer.extra.residual[0]), np.asarray(delta - dec))
    assert float(jnp.abs(outer.extra.residual[0]).max()) > 0
    np.testing.assert_array_equal(np.asarray(rules.flat1(outer.pending[0])), np.asarray(dec.mean(0)))
