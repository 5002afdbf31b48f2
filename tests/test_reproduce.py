"""diloco reproduce: the up-front estimate (from the root's own finished runs) and the plan of --full."""
import json

from diloco import reproduce, sweep as sw


def test_estimate_uses_the_roots_measured_seconds_per_step(tmp_path):
    s = sw.load_sweep("sweeps/tau_alpha.py:tiny")  # 12 points of experiments/ablate_tau.py:tiny (200 steps)
    done = tmp_path / s["name"] / s["points"][0]["name"]
    done.mkdir(parents=True)
    (done / "config.json").write_text(json.dumps({"scale": "tiny", "steps": 200}))
    (done / "summary.json").write_text(json.dumps({"wall_seconds": 20.0}))  # 0.1 s per step
    secs, left = reproduce.estimate_seconds(tmp_path, [("tau_alpha", "", s)], workers=2)
    assert left == 11
    assert abs(secs - 11 * (0.1 * 200 + 10.0) / 2) < 1e-9  # by hand: 165 s
    secs, _ = reproduce.estimate_seconds(tmp_path, [("tau_alpha", "", s)], workers=1, extra=["--config.steps=50"])
    assert abs(secs - 11 * (0.1 * 50 + 10.0)) < 1e-9
    fresh, _ = reproduce.estimate_seconds(tmp_path / "none", [("tau_alpha", "", s)], workers=1)
    assert abs(fresh - 12 * (reproduce.SECONDS_PER_STEP["tiny"] * 200 + 10.0)) < 1e-9


def test_estimate_prefers_the_same_sweeps_runs_over_the_same_scales(tmp_path):
    s = sw.load_sweep("sweeps/tau_alpha.py:tiny")
    for sweep, name, wall in ((s["name"], s["points"][0]["name"], 20.0),  # 0.1 s per step
                              ("other_tiny", "a", 200.0), ("other_tiny", "b", 200.0)):  # 1 s per step
        d = tmp_path / sweep / name
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps({"scale": "tiny", "steps": 200}))
        (d / "summary.json").write_text(json.dumps({"wall_seconds": wall}))
    secs, _ = reproduce.estimate_seconds(tmp_path, [("tau_alpha", "", s)], workers=1)
    assert abs(secs - 11 * (0.1 * 200 + 10.0)) < 1e-9  # the scale's median (1 s) would give 2,310 s
    other = {"name": "new_tiny", "points": s["points"][:2]}  # no runs of its own yet: the scale's median
    secs, _ = reproduce.estimate_seconds(tmp_path, [("x", "", other)], workers=1)
    assert abs(secs - 2 * (1.0 * 200 + 10.0)) < 1e-9


def test_full_plan_is_the_claims_budget():
    from diloco.config import load_config

    names = [n for n, _ in reproduce.FULL_PLAN]
    assert names[:2] == ["tune_inner_lr", "tune_outer_lr"]  # tuning first, then the claims sweeps
    for _, spec in reproduce.FULL_PLAN:
        s = sw.load_sweep(spec)
        if s["name"].startswith("claims_headline"):
            c = load_config(s["points"][0]["spec"], s["points"][0]["overrides"])
            # tiny: 49,472 params × 20.5 tokens = 990 steps of 16×64, 8 seeds; toy: 320,512 × 20 = 3,130, 3 seeds
            want = {"claims_headline_tiny": (8, 990), "claims_headline_toy": (3, 3130)}[s["name"]]
            assert (s["seeds"], c.steps, c.eval_batches) == (*want, 64)
    assert {"claims_headline_tiny", "claims_headline_toy"} <= {sw.load_sweep(sp)["name"] for _, sp in reproduce.FULL_PLAN}
