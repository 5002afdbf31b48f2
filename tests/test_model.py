"""The decoder: causality, parameter counts per scale, loss masking and z-loss, scan/remat layouts."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco.model import SCALES, ModelConfig, Transformer, formula_params, loss_fn, param_count
from diloco.model.scales import label_params

PAPER = ["35M", "100M", "200M", "300M", "500M", "1B", "4B", "10B"]


def small(**kw):
    return ModelConfig.from_scale("tiny", vocab_size=64, **kw)


@pytest.mark.parametrize("scan", [False, True])
def test_changing_a_future_token_leaves_earlier_logits_unchanged(scan):
    cfg = small(scan=scan)
    model = Transformer(cfg)
    x = jnp.array(np.random.default_rng(0).integers(1, 64, size=(2, 16)), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), x)
    y = x.at[:, 10].set((x[:, 10] + 7) % 64)
    a, b = model.apply(params, x), model.apply(params, y)
    np.testing.assert_array_equal(np.asarray(a[:, :10]), np.asarray(b[:, :10]))
    assert float(jnp.abs(a[:, 10:] - b[:, 10:]).max()) > 1e-4  # and the change does propagate forward


@pytest.mark.parametrize("name", PAPER)
def test_param_counts_match_formula_and_labels(name):
    n = param_count(name)
    s = SCALES[name]
    norms = s.layers * (2 * s.d_model + 2 * (s.d_model // s.heads)) + s.d_model  # RMSNorm + QK-norm scales
    assert n == formula_params(name) + norms
    assert abs(n / label_params(s.label) - 1) < 0.05, (name, n)


def test_formula_by_hand_for_35M():
    # 12·6·512² + 32000·512 = 18,874,368 + 16,384,000
    assert formula_params("35M") == 35_258_368


def test_scan_and_unrolled_blocks_compute_the_same_function():
    x = jnp.array(np.random.default_rng(1).integers(1, 64, size=(2, 12)), jnp.int32)
    unrolled = Transformer(small())
    p = unrolled.init(jax.random.PRNGKey(0), x)["params"]
    stacked = {k: v for k, v in p.items() if not k.startswith("block_")}
    stacked["blocks"] = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *[p[f"block_{i}"] for i in range(3)])
    a = unrolled.apply({"params": p}, x)
    b = Transformer(small(scan=True, remat=True)).apply({"params": stacked}, x)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_loss_masks_padding_and_adds_z_loss():
    # Uniform logits over V=4: CE = log 4, logsumexp = log 4 → z-term = (log 4)².
    logits = jnp.zeros((1, 4, 4))
    tokens = jnp.array([[2, 3, 1, 0]])  # the last target is padding
    loss, aux = loss_fn(logits, tokens, z_loss=1e-4)
    assert float(aux["tokens"]) == 2.0
    np.testing.assert_allclose(float(aux["ce"]), np.log(4), rtol=1e-6)
    np.testing.assert_allclose(float(loss), np.log(4) + 1e-4 * np.log(4) ** 2, rtol=1e-6)


def test_bfloat16_compute_keeps_float32_params():
    x = jnp.ones((1, 8), jnp.int32)
    m = Transformer(small(dtype="bfloat16"))
    p = m.init(jax.random.PRNGKey(0), x)
    assert {l.dtype for l in jax.tree_util.tree_leaves(p)} == {jnp.dtype("float32")}
    assert m.apply(p, x).dtype == jnp.float32  # logits are upcast for the loss


def test_sizes_counts_each_scale_as_a_run_builds_it(capsys):
    """`diloco sizes` shows tiny at the byte vocabulary a tiny run uses: the trainer's own count."""
    import json

    from conftest import tiny_config
    from diloco.model import sizes
    from diloco.trainer import Trainer

    assert sizes.main(["--json"]) == 0
    rows = {r["scale"]: r for r in json.loads(capsys.readouterr().out)}
    run = Trainer(tiny_config("dp"))
    assert rows["tiny"]["params"] == run.n_params == 49_472  # 12·3·32² + 384·32 + 320 norm scales
    assert rows["tiny"]["vocab"] == "byte" and rows["tiny"]["embedding_rows"] == 384
    assert rows["1B"]["vocab"] == "T5 32k" and rows["1B"]["embedding_rows"] == 32_128
    assert rows["1B"]["params"] == param_count("1B", 32_128)
