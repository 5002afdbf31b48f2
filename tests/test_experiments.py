"""Every paper-setting spec validates at the paper's scales and at its CPU toy twin."""
import importlib

import pytest

from diloco.config import load_config, validate
from diloco.errors import ConfigError
from diloco.model.scales import BYTE_VOCAB, SCALES, padded_vocab
from diloco.model.sizes import param_count
from diloco.outer.fragments import block_fragment
from diloco.sweep import load_sweep
from experiments import claims

PAPER = ["35M", "100M", "200M", "300M", "500M", "1B", "4B"]
SPECS = {  # spec → arguments at paper scale and at toy scale
    "c4_scaling": [f"{s},{m},{M}" for s in PAPER + ["tiny", "toy"] for M in (2, 4)
                   for m in ("dp", "diloco_h30", "streaming_ovl_fp4_h30", "streaming_ovl_fp4_h100")],
    "dolma_overtraining": [f"{s},{t},{m},{M}" for s in ("1B", "tiny") for t in ("25B", "100B", "250B")
                           for m in ("dp", "streaming_ovl_fp4_h100") for M in (2, 4)],
    "which_params": ["500M", "toy"], "ablation": ["500M", "tiny", "toy"], "ablate_tau": ["500M", "tiny", "toy"],
    "ablate_compression": [f"{s},{k}" for s in ("500M", "toy") for k in
                           ("fp32", "bf16", "fp8", "fp4", "topk", "dare", "dropout")],
    "ablate_replicas": [f"{s},{m},{f}" for s in ("500M", "toy") for m in (2, 4, 8) for f in ("global", "local")],
    "ablate_H": [f"{s},{m}" for s in ("500M", "toy") for m in ("diloco", "streaming")],
    "fedpart": [f"{s},{f}" for s in ("500M", "toy") for f in ("true", "false")],
    "claims": [f"{s},{m}" for s in ("tiny", "toy") for m in ("dp", "diloco_h30", "streaming_h30",
                                                             "streaming_ovl_fp4_h30", "streaming_ovl_fp4_h100")]
              + ["tiny,streaming_ovl_fp4_h30,4"],
}


def _get(spec, arg):
    return importlib.import_module(f"experiments.{spec}").get_config(arg)


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_every_setting_validates(spec):
    for arg in SPECS[spec]:
        validate(_get(spec, arg), check_data=False)


def test_paper_settings_follow_the_paper():
    c = _get("c4_scaling", "1B,streaming_ovl_fp4_h100")
    assert (c.method, c.H, c.tau, c.codec, c.layers_per_fragment, c.pattern, c.replicas) == \
        ("streaming", 100, 1, "e3m0", 3, "strided", 2)
    assert c.data == "c4" and c.seq_len == 1024
    assert abs(c.steps * c.batch_size * c.seq_len - 25e9) / 25e9 < 0.01  # Chinchilla budget of Table 2
    d = _get("c4_scaling", "1B,diloco_h30")
    assert (d.method, d.H, d.tau, d.codec) == ("diloco", 30, 0, "none")
    dolma2, dolma4 = _get("dolma_overtraining", "1B,250B,streaming_ovl_fp4_h100,2"), \
        _get("dolma_overtraining", "1B,250B,streaming_ovl_fp4_h100,4")
    assert dolma2.seq_len == 2048 and dolma2.H == 100
    assert abs(dolma2.steps * dolma2.batch_size * 2048 - 250e9) / 250e9 < 0.01
    assert dolma4.batch_size == 2 * dolma2.batch_size and dolma4.steps == dolma2.steps // 2  # Table 7
    fp = _get("fedpart", "500M,true")
    assert fp.freeze_non_syncing and fp.layers_per_fragment == 3  # 18 blocks → 6 fragments, 5/6 frozen


def test_toy_twins_keep_the_structure_and_stay_small():
    for arg in SPECS["c4_scaling"]:
        if arg.startswith(("tiny", "toy")):
            toy, paper = _get("c4_scaling", arg), _get("c4_scaling", "35M" + arg[arg.index(","):])
            assert (toy.method, toy.tau, toy.codec, toy.alpha, toy.pattern, toy.replicas) == \
                (paper.method, paper.tau, paper.codec, paper.alpha, paper.pattern, paper.replicas)
            assert toy.data == "stdlib" and toy.vocab == "byte"
            assert toy.steps * toy.batch_size * toy.seq_len <= 300 * 16 * 128  # ≲ 2 min on 2 cores
    r = _get("ablate_replicas", "toy,8,local")
    assert r.batch_size == 4 * _get("ablate_replicas", "toy,2,local").batch_size


def test_toy_twin_loads_through_the_cli_path():
    c = load_config("experiments/c4_scaling.py:tiny,streaming_ovl_fp4_h30", ["--config.steps=7"])
    assert c.steps == 7 and c.scale == "tiny" and c.codec == "e3m0"


def test_paper_spec_loads_with_real_data(shared_dir):
    tfds = shared_dir / "data" / "tfds"
    spm = next((shared_dir / "data" / "vocab").glob("*.model"))
    c = load_config("experiments/c4_scaling.py:35M,streaming_ovl_fp4_h30",
                    [f"--config.data_dir={tfds}", f"--config.vocab=sentencepiece:{spm}"])
    assert c.scale == "35M" and c.steps > 1000


def test_bad_arguments_name_the_fields():
    with pytest.raises(ValueError, match="scale,method"):
        _get("c4_scaling", "toy")
    with pytest.raises(ValueError, match="diloco_h<H>"):
        _get("c4_scaling", "toy,fedavg")
    with pytest.raises(ValueError, match="global or local"):
        _get("ablate_replicas", "toy,4,both")
    with pytest.raises(ConfigError):
        load_config("experiments/c4_scaling.py:toy,nope", [])


@pytest.mark.parametrize("name", ["c4_scaling", "replicas_h", "dolma_overtraining", "which_params", "tau_alpha",
                                  "hetero_tau", "fragments", "compression", "replicas", "H", "fedpart"])
def test_every_sweep_point_validates(name):
    s = load_sweep(f"sweeps/{name}.py")
    assert s["points"]
    for p in s["points"]:  # the defaults are toy twins: the full CLI path, data checks included
        c = load_config(p["spec"], p["overrides"])
        assert c.scale in ("tiny", "toy")


def test_claims_budget_is_the_papers_shape():
    """≈20 tokens per parameter, ≥30 outer rounds per fragment at H=30 and H=100 (toy H 10, 33), warm-up
    short against the rounds, the tuned lrs from their sweeps."""
    for m in ("streaming_ovl_fp4_h30", "streaming_ovl_fp4_h100", "diloco_h30"):
        c = _get("claims", f"tiny,{m}")
        tokens = c.steps * c.batch_size * c.seq_len
        assert 19 <= tokens / param_count(c.scale, padded_vocab(BYTE_VOCAB)) <= 22
        assert c.steps // c.H >= 30
        assert c.optimizer.warmup_steps <= 0.1 * c.steps and c.optimizer.warmup_steps <= 5 * c.H
        assert (c.optimizer.lr, c.outer.lr) == (claims.TUNED["tiny"]["inner_lr"], claims.TUNED["tiny"]["outer_lr"])
    for f in claims.TUNED["tiny"]["chosen_by"].split(", "):
        load_sweep(f)
    dp = _get("claims", "tiny,dp")
    assert dp.eval_batches == claims.EVAL_BATCHES and dp.steps == claims.STEPS["tiny"]


def test_claims_sweeps_differ_in_one_factor():
    s = load_sweep("sweeps/claims.py:headline,tiny")
    cfgs = {p["name"]: load_config(p["spec"], p["overrides"]).to_dict() for p in s["points"] if p["seed"] == 0}

    def diff(a, b):
        keys = ("method", "layers_per_fragment", "alpha", "tau", "codec", "H", "replicas")
        return {k for k in keys if cfgs[a][k] != cfgs[b][k]}
    chain = ["tiny+diloco_h30", "tiny+streaming_h30,alpha=0.0", "tiny+streaming_h30", "tiny+streaming_ovl_h30",
             "tiny+streaming_ovl_fp4_h30", "tiny+streaming_ovl_fp4_h100"]
    steps = [diff(a, b) for a, b in zip(chain, chain[1:])]
    assert steps == [{"method", "layers_per_fragment"}, {"alpha"}, {"tau"}, {"codec"}, {"H"}]
    assert diff("tiny+streaming_ovl_fp4_h30", "tiny+streaming_ovl_fp4_h30+4") == {"replicas"}
    p = load_sweep("sweeps/claims.py:pattern,toy")
    pc = [load_config(q["spec"], q["overrides"]) for q in p["points"] if q["seed"] == 0]
    assert [c.pattern for c in pc] == ["strided", "sequential"]
    layers = SCALES[pc[0].scale].layers
    P = layers // pc[0].layers_per_fragment
    assert P >= 2 and pc[0].layers_per_fragment >= 2  # ≥ 2 blocks per fragment and P ≥ 2 …
    assigned = [[block_fragment(i, layers, P, c.pattern) for i in range(layers)] for c in pc]
    assert assigned[0] != assigned[1]  # … so the two patterns really assign blocks differently
