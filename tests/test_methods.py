"""The one method vocabulary (diloco/outer/methods.py): names, aliases, paper labels, config
overrides, simulator parameters, and the fragment count."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest

from diloco.errors import ConfigError
from diloco.outer import methods
from experiments import base, common

ROOT = Path(__file__).resolve().parents[1]


def cfg(**kw) -> dict:
    return {**base.get_config().to_dict(), **kw}


@pytest.mark.parametrize("kw, label", [
    (dict(method="dp"), "data_parallel"),
    (dict(method="diloco", H=30), "diloco_h30"),
    (dict(method="streaming", H=10, layers_per_fragment=3), "streaming_h10"),
    (dict(method="streaming", H=30, codec="e3m0"), "streaming_fp4_h30"),
    (dict(method="streaming", H=10, replica_tau="1,2"), "streaming_ovl_h10"),  # heterogeneous τ overlaps too
    (dict(method="streaming", H=100, tau=5, alpha=0.0, codec="e3m0"), "streaming_ovl_fp4_h100"),
    # the format family of the codec registry: each gets its own label (plain `streaming` is FP32)
    (dict(method="streaming", H=30, tau=1, codec="bf16"), "streaming_ovl_bf16_h30"),
    (dict(method="streaming", H=30, tau=1, codec="fp8_e4m3"), "streaming_ovl_fp8_h30"),
    (dict(method="streaming", H=30, codec="fp8_e5m2"), "streaming_fp8_h30"),
    (dict(method="streaming", H=30, tau=1, codec="dare"), "streaming_ovl_sparse_h30"),
    (dict(method="streaming", H=30, tau=1, codec="none"), "streaming_ovl_h30"),
    (dict(method="diloco", H=30, codec="e3m0"), "diloco_fp4_h30"),
])
def test_paper_label_of_hand_written_configs(kw, label):
    assert methods.paper_label(cfg(**kw)) == label


@pytest.mark.parametrize("name", list(methods.VARIANTS))
def test_overrides_and_classifier_agree(name):
    """A config built from a variant's overrides is classified as that variant, and the experiment
    spec of the same name builds exactly those overrides."""
    v = methods.VARIANTS[name]
    assert methods.classify(cfg(H=12, **v.config_overrides())) is v
    spec = name if not v.takes_h else f"{name}_h12"
    c = common.method(common.sized(common.new(), "35M"), spec).to_dict()
    assert {k: c[k] for k in v.config_overrides()} == v.config_overrides()


def test_aliases_are_the_same_variant_in_the_simulator():
    from diloco.simulate.presets import make_method

    assert methods.get("streaming_overlap_fp4") is methods.VARIANTS["streaming_ovl_fp4"]
    assert methods.get("streaming_overlap") is methods.VARIANTS["streaming_ovl"]
    m = make_method("streaming_overlap_fp4", 24, h=100)
    assert m == make_method("streaming_ovl_fp4", 24, h=100)
    assert (m.name, m.fragments, m.tau, m.bits) == ("streaming_ovl_fp4", 8, 1, 4.0)  # 24 blocks / 3
    assert (make_method("streaming", 7).fragments, make_method("streaming", 7).tau) == (3, 0)  # ceil(7/3)
    assert make_method("streaming_fp4", 24).bits == 4.0 and make_method("diloco", 24).bits is None
    with pytest.raises(ConfigError, match=r"'streaming_fp4_overlap'; valid: dp, diloco, streaming"):
        methods.get("streaming_fp4_overlap")


def test_every_label_of_the_papers_csv_and_committed_runs_resolves():
    with open(ROOT / "results/paper/compute_utilization.csv", newline="") as f:
        labels = {r["method"] for r in csv.DictReader(f) if not r["method"].startswith("streaming_eager")}
    assert "data_parallel" in labels and "streaming_ovl_fp4_h100" in labels
    for label in labels:
        v, H = methods.from_paper_label(label)
        assert (v.paper_label if H is None else f"{v.paper_label}_h{H}") == label
    with pytest.raises(ConfigError, match="no method variant for paper label 'streaming_eager_h100'"):
        methods.from_paper_label("streaming_eager_h100")


@pytest.mark.parametrize("bad", ["dp_h3", "diloco", "streaming_ovl_fp4", "streaming_overlap_h3", "foo_h3"])
def test_experiment_names_are_dp_or_variant_h(bad):
    with pytest.raises(ValueError, match=rf"method '{bad}': use dp, diloco_h<H>, streaming_h<H>"):
        common.method(common.new(), bad)


def test_num_fragments_hand_counts():
    assert methods.num_fragments(24, 3) == 8
    assert methods.num_fragments(7, 3) == 3  # ceil: blocks {0,3,6}, {1,4}, {2,5}
    assert methods.num_fragments(6) == 1
    assert methods.num_fragments(6, fragments=4, embed_fragment="own") == 5
    with pytest.raises(ConfigError, match="not both"):
        methods.num_fragments(6, 3, 2)
    with pytest.raises(ConfigError, match=r"P=7 fragments for 6 transformer blocks"):
        methods.num_fragments(6, fragments=7)


def test_fp8_and_bf16_streaming_runs_get_their_own_labels_in_runs_csv_and_every_table(tmp_path):
    """The report labels a run by what it ran: Streaming runs of one spec with fp8 / bf16 outer gradients
    are not passed off as the spec's FP4 (or as FP32 `streaming`) in runs.csv, the bytes table or Table 5."""
    import json

    import pandas as pd

    from diloco import report
    from diloco.config import load_config

    root = tmp_path / "runs"
    for point, spec, codec in (("tiny+dp", "tiny,dp", None), ("tiny+fp4", "tiny,streaming_ovl_fp4_h30", None),
                               ("tiny+fp8", "tiny,streaming_ovl_fp4_h30", "fp8_e4m3"),
                               ("tiny+bf16", "tiny,streaming_ovl_fp4_h30", "bf16")):
        full = f"experiments/c4_scaling.py:{spec}"
        cfg = load_config(full, [f"--config.codec={codec}"] if codec else [], check_data=False).to_dict()
        wd = root / "c4_scaling_tiny" / point
        wd.mkdir(parents=True)
        (wd / "config.json").write_text(json.dumps(cfg))
        (wd / "point.json").write_text(json.dumps({"sweep": "c4_scaling_tiny", "spec": full, "point": {"arg": spec},
                                                   "seed": 0, "base_point": point}))
        (wd / "summary.json").write_text(json.dumps({
            "final_eval_loss": 2.0, "bytes_exchanged_total": 1000, "bytes_peak_per_sync": 10, "syncs": 3,
            "params": 100, "fragments": 1, "tokens": 2000, "wall_seconds": 1.0, "H": cfg["H"], "fragment_sizes": [100]}))
    report.build(root, tmp_path / "out", quiet=True)
    want = {"tiny+dp": "data_parallel", "tiny+fp4": "streaming_ovl_fp4_h30", "tiny+fp8": "streaming_ovl_fp8_h30",
            "tiny+bf16": "streaming_ovl_bf16_h30"}
    runs = pd.read_csv(tmp_path / "out" / "runs.csv")
    assert dict(zip(runs.point, runs.label)) == want
    by_setting = pd.read_csv(tmp_path / "out" / "bytes_exchanged.csv")
    assert dict(zip(by_setting.setting, by_setting.method)) == want
    t5 = pd.read_csv(tmp_path / "out" / "table5_c4_scaling.csv")
    assert set(want.values()) <= set(t5.method)
