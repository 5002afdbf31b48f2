"""Error feedback and the 2-bit codec (int2): hand tables and the conservation invariant."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco.outer import codecs, lowbit, rules
from diloco.outer.sync import OuterState


def send(codec, d, e, contrib=None):
    """One send through the run's error feedback (rules.ErrorFeedback.compensated): (decoded, new residual)."""
    v = OuterState(params=None, opt=(), pending=(), extra=rules.Extra(residual=(e,)))
    contrib = jnp.ones(d.shape[0]) if contrib is None else contrib
    _, sent, v = rules.ErrorFeedback.compensated(type("Sync", (), {"codec": codec}), v, d, jax.random.PRNGKey(0),
                                                 contrib, True)
    return sent, v.extra.residual[0]


def test_int2_hand_table():
    # block 4: s = absmax = 1; y = 1 → code 3 (≥ 2/3), −0.5 → 1 (≥ −2/3, < 0), 0.2 → 2, −1 → 0; 0 → 2 (ties up)
    # second block (0.3, 0.1, 0, 0): s = 0.3, y = 1, 1/3, 0, 0 → codes 3, 2, 2, 2 → 0.3, 0.1, 0.1, 0.1
    x = jnp.array([1.0, -0.5, 0.2, -1.0, 0.3, 0.1, 0.0, 0.0])
    p = lowbit.encode(x, block_size=4)
    assert p["scales"].tolist() == pytest.approx([1.0, 0.3])
    # n = 8, q = 2: byte 0 = codes of elements 0, 2, 4, 6 = 3 | 2<<2 | 3<<4 | 2<<6 = 3 + 8 + 48 + 128 = 187
    #               byte 1 = elements 1, 3, 5, 7 = 1 | 0<<2 | 2<<4 | 2<<6 = 1 + 32 + 128 = 161
    assert p["codes"].tolist() == [187, 161]
    assert lowbit.unpack(p["codes"], 8).tolist() == [3, 1, 2, 0, 3, 2, 2, 2]
    np.testing.assert_allclose(np.asarray(lowbit.decode(p, 8, block_size=4)),
                               [1, -1 / 3, 1 / 3, -1, 0.3, 0.1, 0.1, 0.1], rtol=1e-6)
    assert sum(a.size * a.dtype.itemsize for a in p.values()) == lowbit.nbytes(8, 4) == 2 + 8
    assert lowbit.nbytes(1000, 256) == 250 + 16  # 2.128 bits per element
    z = lowbit.encode(jnp.zeros(5), block_size=4)
    assert lowbit.decode(z, 5, block_size=4).tolist() == [0.0] * 5


def test_int2_odd_length_and_stochastic_unbiased():
    x = jnp.linspace(-1.0, 1.0, 7)  # n = 7: padded to 8, q = 2
    out = lowbit.decode(lowbit.encode(x, block_size=256), 7, block_size=256)
    assert out.shape == (7,) and np.all(np.isin(np.round(np.asarray(out) * 3), [-3, -1, 1, 3]))
    # stochastic: y = 0.5 between 1/3 and 1: up with p = (0.5 − 1/3)·1.5 = 0.25 → mean 1/3 + 0.25·2/3 = 0.5
    xs = jnp.concatenate([jnp.array([1.0]), jnp.full((4095,), 0.5)])
    dec = jax.vmap(lambda k: lowbit.decode(lowbit.encode(xs, 4096, "stochastic", k), 4096, 4096))(
        jax.random.split(jax.random.PRNGKey(0), 64))
    assert float(dec[:, 1:].mean()) == pytest.approx(0.5, abs=0.005)
    assert set(np.round(np.asarray(dec[:, 1:]) * 3).ravel().tolist()) == {1.0, 3.0}


def test_feedback_hand_table():
    # int2, block 2, one replica, Δ = (1, 0.6) every round (s = 1 throughout):
    # round 1: 0.6 < 2/3 → +1/3; sent (1, 1/3), e = (0, 0.6 − 1/3 = 4/15)
    # round 2: target (1, 0.6 + 4/15 = 13/15) → +1; sent (1, 1), e = (0, −2/15)
    # round 3: target (1, 7/15) → +1/3; sent (1, 1/3), e = (0, 2/15). Σ sent + e = (3, 5/3 + 2/15) = (3, 1.8) = ΣΔ
    # a second replica that does not contribute (contrib 0) keeps its whole target owed: e = 3·Δ after 3 rounds
    int2 = codecs.make_codec("int2", 2)
    e = jnp.zeros((2, 2))
    sents = []
    for _ in range(3):
        s, e = send(int2, jnp.array([[1.0, 0.6], [1.0, 0.6]]), e, jnp.array([1.0, 0.0]))
        sents.append(np.asarray(s[0]))
    np.testing.assert_allclose(np.array(sents), [[1, 1 / 3], [1, 1], [1, 1 / 3]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(e), [[0, 2 / 15], [3, 1.8]], atol=1e-6)


@pytest.mark.parametrize("name", ["e3m0", "fp8_e4m3", "topk", "int2"])
def test_feedback_conserves_the_sum_of_outer_gradients(name):
    """Over K = 8 rounds, Σ sent + residual = Σ Δ per replica (float32 rounding only), while Σ sent alone
    is off by the codec's error (which the residual carries)."""
    R, n, K = 2, 512, 8
    c = codecs.make_codec(name, 64, keep_fraction=0.1 if name == "topk" else None)
    keys = jax.random.split(jax.random.PRNGKey(1), K)
    e = jnp.zeros((R, n))
    total, sent_total = jnp.zeros((R, n)), jnp.zeros((R, n))
    for k in range(K):
        d = jax.random.normal(keys[k], (R, n)) * (1 + k)
        s, e = send(c, d, e)
        total, sent_total = total + d, sent_total + s
    err = float(jnp.abs(sent_total + e - total).max())
    assert err <= 1e-5 * float(jnp.abs(total).max())
    assert float(jnp.abs(e).max()) > 1e-3  # a lossy codec leaves something to carry
