"""Validation as data (diloco/schema.py): every key of experiments/base.py is declared, and random values of
every key, given as a user gives them (--config.key=value), end in a valid config or one ConfigError line."""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from diloco import schema
from diloco.config import flatten, load_config, validate
from diloco.errors import ConfigError
from experiments import base

KEYS = sorted(schema.DECLARED)


def test_every_key_of_base_is_declared_and_every_declaration_is_a_key():
    assert set(flatten(base.get_config())) == set(schema.DECLARED)


def test_the_defaults_satisfy_their_declarations():
    schema.check(flatten(base.get_config()))


def candidates(key: str) -> st.SearchStrategy[str]:
    """Values near and outside the declared range, the enum's members, and junk."""
    d = schema.DECLARED[key]
    junk = st.sampled_from(["nan", "inf", "-inf", "-1", "0", "1", "1e400", "true", "", "x", "2147483648", "0.5"])
    if isinstance(d, schema.Num):
        lo = -1000 if d.lo == -schema.INT_MAX else d.lo
        nums = (st.integers(int(lo) - 3, int(lo) + 64) if d.kind is int
                else st.floats(lo - 1, lo + 2))
        return st.one_of(junk, nums.map(str))
    if isinstance(d, schema.OneOf):
        return st.one_of(junk, st.sampled_from([str(v) for v in d.valid(key)]))
    return st.one_of(junk, st.text(st.characters(codec="ascii", exclude_characters="\n\x00"), max_size=12))


overrides = st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True).flatmap(
    lambda keys: st.tuples(*(candidates(k).map(lambda v, k=k: f"--config.{k}={v}") for k in keys)))


@settings(max_examples=1000, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(spec=st.sampled_from(["experiments/toy.py:dp", "experiments/toy.py:streaming"]), ov=overrides)
def test_random_values_of_every_key_give_a_valid_config_or_one_line(spec, ov):
    try:
        cfg = load_config(spec, list(ov), check_data=False)
    except ConfigError as e:
        assert "\n" not in str(e) and e.field, str(e)
        return
    flat = flatten(cfg)
    schema.check(flat)  # what passed is inside every declaration
    assert all(math.isfinite(v) for v in flat.values() if isinstance(v, float))


@pytest.mark.parametrize("key,value,says", [
    ("optimizer.clip_norm", -1.0, "0 would zero"), ("optimizer.lr", float("nan"), "not finite"),
    ("outer.lr", float("inf"), "not finite"), ("optimizer.b1", 1.5, r"in \[0, 1\)"),
    ("optimizer.min_lr_ratio", -1.0, r"in \[0, 1\]"), ("optimizer.warmup_steps", -10, "≥ 0"),
    ("model.z_loss", float("nan"), "not finite"), ("mesh.replica_axis", -1, "divisor of replicas"),
    ("downstream.every", -1, "≥ 0"), ("codec", "foo", "not one of"), ("seed", 1.5, "not an integer"),
    ("method", "fedavg", "not one of dp, diloco, streaming"),
])
def test_a_value_outside_its_declaration_is_one_line_naming_key_and_value(key, value, says):
    with pytest.raises(ConfigError, match=says) as e:
        schema.DECLARED[key].check(key, value)
    assert str(e.value).startswith(f"{key}: {value!r}") and "\n" not in str(e.value)


def test_cross_field_rules_refuse_or_warn(capsys):
    cfg = load_config("experiments/toy.py:streaming", check_data=False)  # codec e3m0
    with cfg.unlocked():
        cfg.codec_keep_fraction = 0.5
    with pytest.raises(ConfigError, match="codec_keep_fraction: 0.5 applies to topk"):
        validate(cfg, check_data=False)
    load_config("experiments/toy.py:streaming", ["--config.H=1000", "--config.steps=40"], check_data=False)
    load_config("experiments/toy.py:dp", ["--config.codec=e3m0", "--config.downstream.every=5"], check_data=False)
    err = capsys.readouterr().err
    warned = [l for l in err.splitlines() if l.startswith("warning: ")]
    assert len(warned) == 3, err
    assert "H=1000 > steps=40" in warned[0] and "never syncs" in warned[0]
    assert "codec='e3m0' is ignored by method=dp" in warned[1] and "downstream.every=5" in warned[2]
