"""The decoder: causality, parameter counts per scale, loss masking and z-loss, scan/remat layouts."""
import hashlib
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO, tiny_config
from diloco import resolve
from diloco.errors import ConfigError
from diloco.model import (SCALES, ModelConfig, Transformer, formula_params, loss_fn, param_count,
                          param_logical_axes)
from diloco.model.scales import Scale, label_params
from diloco.model.transformer import splash_attention

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
    from diloco.model import sizes
    from diloco.trainer import Trainer

    assert sizes.main(["--json"]) == 0
    rows = {r["scale"]: r for r in json.loads(capsys.readouterr().out)}
    run = Trainer(tiny_config("dp"))
    assert rows["tiny"]["params"] == run.n_params == 49_472  # 12·3·32² + 384·32 + 320 norm scales
    assert rows["tiny"]["vocab"] == "byte" and rows["tiny"]["embedding_rows"] == 384
    assert rows["1B"]["vocab"] == "T5 32k" and rows["1B"]["embedding_rows"] == 32_128
    assert rows["1B"]["params"] == param_count("1B", 32_128)


# --- the optimised decoder computes what the previous one did -------------------------------------
# Golden values from the model as of commit d1afa2a (before RoPE tables/mask were hoisted, fused
# attention and logical partitioning), produced by:
#   git show d1afa2a:diloco/model/transformer.py > /tmp/base_transformer.py
#   python -c "import sys; sys.path.insert(0, '/tmp'); import base_transformer as T, ..."
# with T.ModelConfig(vocab_size=384, **kw), params = init(PRNGKey(0), x[:1, :8]), x = _tokens().
GOLDEN = {  # name: (config overrides, sha256[:16] of params, loss, ce)
    "tiny": (dict(layers=3, d_model=32, heads=2, mlp_dim=128), "cf88c9572a9b7672", 6.43834924697876, 6.434195041656494),
    "tiny-scan": (dict(layers=3, d_model=32, heads=2, mlp_dim=128, scan=True), "d96428ea1d383ef8",
                  6.469969749450684, 6.465851306915283),
    "toy": (dict(layers=6, d_model=64, heads=4, mlp_dim=256), "775774489cb18839", 6.502087593078613, 6.49783182144165),
}


def _tokens():
    return jnp.asarray(np.random.default_rng(0).integers(0, 259, size=(4, 64)), jnp.int32)


def _params_hash(p) -> str:
    h = hashlib.sha256()
    for path, x in jax.tree_util.tree_leaves_with_path(p):
        h.update(jax.tree_util.keystr(path).encode())
        h.update(np.asarray(x).tobytes())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("name", list(GOLDEN))
def test_init_is_bit_identical_to_the_previous_model(name):
    kw, digest, _, _ = GOLDEN[name]
    p = Transformer(ModelConfig(vocab_size=384, **kw)).init(jax.random.PRNGKey(0), _tokens()[:1, :8])["params"]
    assert all(type(x) is type(jnp.zeros(1)) for x in jax.tree_util.tree_leaves(p))  # plain arrays, not boxed
    assert _params_hash(p) == digest


@pytest.mark.parametrize("attention", ["xla", "dot_product"])
@pytest.mark.parametrize("remat_policy", ["none", "full", "save_dots"])
@pytest.mark.parametrize("name", list(GOLDEN))
def test_loss_matches_the_previous_model(name, attention, remat_policy):
    kw, _, loss0, ce0 = GOLDEN[name]
    cfg = ModelConfig(vocab_size=384, attention=attention, remat_policy=remat_policy, **kw)
    x = _tokens()
    p = Transformer(cfg).init(jax.random.PRNGKey(0), x[:1, :8])["params"]
    loss, aux = jax.jit(lambda p: loss_fn(Transformer(cfg).apply({"params": p}, x), x))(p)
    np.testing.assert_allclose(float(loss), loss0, rtol=1e-6)
    np.testing.assert_allclose(float(aux["ce"]), ce0, rtol=1e-6)


def test_gradients_agree_across_attention_and_remat():
    x = _tokens()
    grads = {}
    for att, pol in [("xla", "none"), ("dot_product", "none"), ("xla", "save_dots"), ("dot_product", "full")]:
        cfg = ModelConfig(vocab_size=384, **GOLDEN["tiny"][0], attention=att, remat_policy=pol)
        p = Transformer(cfg).init(jax.random.PRNGKey(0), x[:1, :8])["params"]
        grads[att, pol] = jax.grad(lambda p: loss_fn(Transformer(cfg).apply({"params": p}, x), x)[0])(p)
    ref = grads["xla", "none"]
    for g in grads.values():
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7), g, ref)


def test_matches_the_plain_jax_reference_decoder():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import ref_decoder

    cfg = ModelConfig(vocab_size=384, **GOLDEN["toy"][0])
    x = _tokens()
    p = Transformer(cfg).init(jax.random.PRNGKey(0), x[:1, :8])["params"]
    with jax.numpy_rank_promotion("allow"):  # the plain reference broadcasts as NumPy does, on purpose
        loss, ce = ref_decoder.loss(p, x, cfg.heads)
    np.testing.assert_allclose([float(loss), float(ce)], GOLDEN["toy"][2:], rtol=1e-6)


def test_legacy_remat_flag_means_full():
    assert small(remat=True).checkpoint_policy == "full"
    assert small(remat=True, remat_policy="save_dots").checkpoint_policy == "save_dots"
    assert small().checkpoint_policy == "none"


@pytest.mark.parametrize("field,kw", [("model.remat_policy", dict(remat_policy="dots")),
                                      ("model.attention", dict(attention="flash"))])
def test_bad_model_options_name_their_field(field, kw):
    with pytest.raises(ConfigError) as e:
        small(**kw)
    assert e.value.field == field


# --- logical axis names for sharding ----------------------------------------------------------------
@pytest.mark.parametrize("scan", [False, True])
def test_every_parameter_has_one_logical_name_per_dimension(scan):
    cfg = small(scan=scan)
    names = param_logical_axes(cfg)
    shapes = jax.eval_shape(lambda: Transformer(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))["params"]
    is_names = lambda t: isinstance(t, tuple)
    assert jax.tree_util.tree_structure(names, is_leaf=is_names) == jax.tree_util.tree_structure(shapes)
    pairs = zip(jax.tree_util.tree_leaves(names, is_leaf=is_names), jax.tree_util.tree_leaves(shapes))
    assert all(len(n) == s.ndim and all(isinstance(a, str) or a is None for a in n) for n, s in pairs)
    assert names["embed"]["embedding"] == ("vocab", "embed")
    blk = names["blocks"] if scan else names["block_0"]
    lead = ("layers",) if scan else ()
    assert blk["mlp_in"]["kernel"] == lead + ("embed", "mlp") and blk["mlp_out"]["kernel"] == lead + ("mlp", "embed")
    assert blk["q_norm"]["scale"] == lead + ("head_dim",) and blk["attn_out"]["kernel"] == lead + ("heads", "embed")


def test_activation_constraints_follow_logical_rules():
    import flax.linen as nn
    from jax.sharding import Mesh

    cfg = small()
    x = _tokens()[:, :16]
    p = Transformer(cfg).init(jax.random.PRNGKey(0), x[:1, :8])["params"]
    f = jax.jit(lambda p: Transformer(cfg).apply({"params": p}, x))
    assert "sharding_constraint" not in f.lower(p).as_text().lower()  # no rules: no constraints
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "fsdp"))
    with jax.set_mesh(mesh), nn.logical_axis_rules([("batch", "data"), ("embed", "fsdp")]):  # not `with mesh:`
        lowered = f.lower(p)
        out = lowered.compile()(p)
    assert lowered.as_text().count("sharding_constraint") >= 2 * cfg.layers
    np.testing.assert_allclose(np.asarray(out), np.asarray(Transformer(cfg).apply({"params": p}, x)), rtol=1e-6)


# --- the Pallas splash kernel (model.attention=splash; what auto resolves to on TPU) -----------------------------------
def test_splash_attention_matches_xla_in_loss_and_gradients():
    """The splash kernel (run by its interpreter on CPU; compiled for TPU by `diloco compile`) computes
    the same causal attention as the einsum + softmax path: loss to 1e-6, gradients to 1e-4 relative,
    at a sequence of two 128-token tiles (so the causal mask crosses a tile boundary)."""
    x = jnp.asarray(np.random.default_rng(1).integers(0, 259, size=(2, 256)), jnp.int32)
    got = {}
    for att in ("xla", "splash"):
        cfg = ModelConfig(vocab_size=384, layers=2, d_model=32, heads=2, mlp_dim=64, attention=att)
        p = Transformer(cfg).init(jax.random.PRNGKey(0), x[:1, :8])["params"]
        got[att] = jax.value_and_grad(lambda p: loss_fn(Transformer(cfg).apply({"params": p}, x), x)[0])(p)
    np.testing.assert_allclose(float(got["splash"][0]), float(got["xla"][0]), rtol=1e-6)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                           got["splash"][1], got["xla"][1])


def test_splash_attention_is_causal():
    """Changing the last token leaves every earlier position's output unchanged (the kernel's mask)."""
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 128, 2, 16)), jnp.float32) for _ in range(3))
    a = splash_attention(q, k, v, interpret=True)
    b = splash_attention(q, k.at[:, -1].add(1.0), v.at[:, -1].add(1.0), interpret=True)
    np.testing.assert_array_equal(np.asarray(a[:, :-1]), np.asarray(b[:, :-1]))
    assert not np.allclose(np.asarray(a[:, -1]), np.asarray(b[:, -1]))


def test_splash_needs_whole_tiles():
    q = jnp.zeros((1, 192, 2, 16))
    with pytest.raises(ConfigError) as e:
        splash_attention(q, q, q, interpret=True)
    assert e.value.field == "model.attention" and "192" in str(e.value)


def _cfg(scale="4B", **kw):
    import ml_collections

    from experiments import base

    c = base.get_config().to_dict()
    c.update(scale=scale, seq_len=kw.pop("seq_len", 2048))
    c["model"].update(kw)
    return ml_collections.ConfigDict(c)


@pytest.mark.parametrize("scale,platform,over,want,why", [
    ("toy", "cpu", {}, "xla", "einsum"),
    ("toy", "tpu", {}, "splash", "whole 128-token tiles"),
    ("4B", "tpu", {"seq_len": 1000}, "xla", "not a multiple of splash's 128-token tile"),
    ("4B", "gpu", {"dtype": "bfloat16"}, "cudnn", "cuDNN's fused kernel"),         # K = 3072/48 = 64
    ("4B", "gpu", {"dtype": "float16"}, "cudnn", "float16, head dim 64"),
    ("4B", "gpu", {}, "xla", "needs bfloat16 or float16 (model.dtype=float32)"),   # fp32: XLA, and why
    ("tiny", "gpu", {"dtype": "bfloat16"}, "cudnn", "head dim 16"),              # 32/2 = 16
    ("4B", "tpu", {"attention": "xla"}, "xla", "set in the config"),
    ("35M", "cpu", {"attention": "splash"}, "splash", "set in the config"),
])
def test_attention_is_resolved_once_for_the_platform_with_its_reason(scale, platform, over, want, why):
    """diloco/resolve.py: auto → splash on TPU (whole tiles), cuDNN's fused kernel on GPU where dtype and
    head size allow (else XLA, saying why), XLA on CPU; an explicit choice is kept."""
    got, reason = resolve.attention(_cfg(scale, **over), platform)
    assert got == want and why in reason, (got, reason)


def test_cudnn_needs_a_head_dim_it_supports(monkeypatch):
    monkeypatch.setitem(SCALES, "odd", Scale(layers=2, d_model=2 * 36, heads=2, mlp_dim=64))  # K = 36: not /8
    got, why = resolve.attention(_cfg("odd", dtype="bfloat16"), "gpu")
    assert got == "xla" and "multiple of 8" in why and "36" in why


def test_the_model_takes_concrete_attention_only():
    with pytest.raises(ConfigError, match="model.attention"):
        ModelConfig.from_scale("tiny", vocab_size=64, attention="auto")


@pytest.mark.parametrize("scale,platform,over,want", [
    ("tiny", "tpu", {}, "none"), ("35M", "cpu", {}, "full"), ("35M", "tpu", {}, "full"),
    ("1B", "gpu", {}, "full"), ("35M", "tpu", {"remat": True}, "full"), ("4B", "tpu", {"remat_policy": "none"}, "none")])
def test_remat_is_resolved_by_scale_and_platform(scale, platform, over, want):
    assert resolve.remat(_cfg(scale, **over), platform)[0] == want


@pytest.mark.parametrize("scale,scan,want", [("tiny", "auto", False), ("toy-l", "auto", False),
                                             ("35M", "auto", True), ("10B", "auto", True),
                                             ("35M", False, False), ("toy", "True", True), ("4B", "false", False)])
def test_scan_auto_stacks_the_paper_scales_only(scale, scan, want):
    assert resolve.scan(_cfg(scale, scan=scan))[0] is want


def test_the_plan_is_recorded_and_a_changed_plan_is_stale():
    """The trainer's plan (summary.json "resolved") holds every resolved choice; the sweep calls a record
    stale when the config now resolves one of them differently on the run's platform and devices."""
    cfg = tiny_config("streaming", tau=1)
    plan = resolve.resolve(cfg, jax.devices()[:1]).to_json()
    assert {k: plan[k] for k in ("platform", "devices", "attention", "remat", "scan", "exchange")} == {
        "platform": "cpu", "devices": 1, "attention": "xla", "remat": "none", "scan": False, "exchange": "blocking"}
    assert plan["mesh"] == {"replica": 1, "data": 1, "fsdp": 1} and set(plan["why"]) >= {"attention", "exchange"}
    assert resolve.stale_choices(plan, cfg) == []
    assert resolve.stale_choices({**plan, "platform": "tpu"}, cfg) == ["resolved.exchange"]  # auto → in_step there
    assert resolve.stale_choices(plan, tiny_config("streaming", tau=1, **{"model.attention": "dot_product"})) == [
        "resolved.attention"]
    assert resolve.stale_choices(plan, tiny_config("streaming", tau=1, **{"model.attention": "xla"})) == []  # as ran
    assert resolve.stale_choices({"devices": "?"}, cfg) == []


def test_sweep_staleness_compares_the_recorded_plan(tmp_path):
    """A finished run's recorded plan replaces the `auto` text of the fields it resolves: the same plan
    is not stale whatever the config spells; a plan the config now resolves differently is."""
    cfg = tiny_config("streaming", tau=1)
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"resolved": resolve.resolve(cfg, jax.devices()[:1]).to_json()}))
    assert resolve.stale_against_record(["model.attention", "H"], summary, lambda: cfg) == ["H"]
    other = tiny_config("streaming", tau=1, **{"model.attention": "dot_product"})
    assert resolve.stale_against_record(["model.attention"], summary, lambda: other) == ["resolved.attention"]
    (tmp_path / "old.json").write_text("{}")  # a record from before plans: the config fields as they are
    assert resolve.stale_against_record(["model.attention"], tmp_path / "old.json", lambda: other) == ["model.attention"]
