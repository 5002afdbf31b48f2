"""diloco reproduce: the up-front estimate (from the root's own finished runs), the plan of --full, the
headline's merge, and the whole job at a micro budget into a copy of results/ (slow)."""
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from diloco import reproduce, reproduce_results, sweep as sw
from diloco.config import load_config
from diloco.report.tables import ABLATION_RESULT_COLS
from diloco.report.write import KEYS


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


def test_estimate_uses_the_committed_records_of_a_sweep_the_root_lacks(tmp_path):
    """A fresh clone's root is empty: the sweep's committed run records (results/runs.csv) give its seconds
    per step. By hand: 0.1, 0.2, 0.3 s/step → the median 0.2; 12 points × (0.2 × 200 + 10) = 600 s."""
    s = sw.load_sweep("sweeps/tau_alpha.py:tiny")
    rec = tmp_path / "runs.csv"
    rec.write_text("sweep,point,status,steps,wall_seconds\n" + "".join(
        f"{s['name']},p{i},done,200,{w}\n" for i, w in enumerate((20.0, 40.0, 60.0))) +
        f"{s['name']},p9,failed,200,\nother_tiny,q,done,200,2000.0\n")
    secs, left = reproduce.estimate_seconds(tmp_path / "none", [("tau_alpha", "", s)], workers=1, committed=rec)
    assert left == 12 and abs(secs - 12 * (0.2 * 200 + 10.0)) < 1e-9
    done = tmp_path / "root" / s["name"] / s["points"][0]["name"]  # the root's own runs come first
    done.mkdir(parents=True)
    (done / "config.json").write_text(json.dumps({"scale": "tiny", "steps": 200}))
    (done / "summary.json").write_text(json.dumps({"wall_seconds": 100.0}))  # 0.5 s per step
    secs, _ = reproduce.estimate_seconds(tmp_path / "root", [("tau_alpha", "", s)], workers=1, committed=rec)
    assert abs(secs - 11 * (0.5 * 200 + 10.0)) < 1e-9


def test_full_plan_is_the_claims_budget():
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


def test_the_committed_readme_is_what_the_generator_writes_from_the_committed_records(tmp_path, monkeypatch):
    """results/README.md is generated whole: regenerating it from the committed steps.json, runs.csv,
    headline.json and files (no run records, no new steps) gives the committed text, so a hand-written
    section (e.g. #33's provenance) would fail here; it belongs in a step group's description or a
    step's --note (steps.json)."""
    repo = Path(reproduce.__file__).resolve().parents[1]
    shutil.copytree(repo / "results", tmp_path / "results")
    monkeypatch.chdir(tmp_path)  # the README names --out as given: results
    out = Path("results")
    committed = (out / "README.md").read_text()
    h = json.loads((out / "headline.json").read_text())
    reproduce_results.write_readme(out, Path("runs/reproduce"), [], [], h)
    assert (out / "README.md").read_text() == committed
    assert reproduce_results.BEYOND_TITLE in committed and "f2a883d" in committed  # #33's eager runs and their code


def test_beyond_plan_is_the_eager_and_error_feedback_sweeps():
    specs = {sw.load_sweep(sp)["name"]: sw.load_sweep(sp)["seeds"] for _, sp in reproduce_results.BEYOND_PLAN}
    assert specs == {"eager_table2_tiny": 8, "eager_table3_tiny": 8, "compression_ef_tiny": 8, "compression_tiny": 1}
    assert reproduce.main(["--full", "--beyond", "--estimate"]) == 2


def test_headline_merges_with_the_committed_one():
    """A root with some of the headline's runs replaces those rows in place and keeps the others
    (the committed headline.json is never rewritten from the current root alone)."""
    old = {"scaling": [{"scale": "tiny", "method": "s30", "eval_loss": 2.7}, {"scale": "toy", "method": "s30", "eval_loss": 2.4}],
           "tau_alpha": {"alpha=0": {"0": 2.84, "5": 2.91}, "alpha=0.5": {"0": 2.81}}}
    new = {"scaling": [{"scale": "tiny", "method": "s30", "eval_loss": 6.1}, {"scale": "tiny", "method": "s100", "eval_loss": 6.5}],
           "tau_alpha": {"alpha=0": {0: 6.5, 1: 6.4}}}
    assert reproduce_results.merge_headline(new, old) == {
        "scaling": [{"scale": "tiny", "method": "s30", "eval_loss": 6.1}, {"scale": "toy", "method": "s30", "eval_loss": 2.4},
                    {"scale": "tiny", "method": "s100", "eval_loss": 6.5}],
        "tau_alpha": {"alpha=0": {"0": 6.5, "5": 2.91, "1": 6.4}, "alpha=0.5": {"0": 2.81}}}
    assert reproduce_results.merge_headline({"scaling": [], "tau_alpha": {}}, old) == old  # a --full root
    assert reproduce_results.merge_headline(new, {})["scaling"] == new["scaling"]


def _csv_keys(path, key) -> set[tuple]:
    """The key of every row of a CSV; numbers as floats (a column read as int in one file and float in
    the other, because of a blank cell, still matches)."""
    def norm(v):
        try:
            return repr(float(v))
        except (TypeError, ValueError):
            return str(v)

    df = pd.read_csv(path)
    return {tuple(norm(v) for v in r) for r in df[list(key)].itertuples(index=False)}


@pytest.mark.slow
def test_reproduce_end_to_end_at_a_micro_budget_loses_nothing(tmp_path):
    """`diloco reproduce` itself (training, bytes, simulator, tables, headline, README) at 4 steps a run,
    into a copy of the committed results/: every committed file is still there; a file that changed is a
    merged table whose committed rows (by its key) are all still in it, or a plot, or the README."""
    repo = Path(reproduce.__file__).resolve().parents[1]
    out = tmp_path / "results"
    shutil.copytree(repo / "results", out)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    rc = reproduce.main(["--root", str(tmp_path / "runs"), "--out", str(out), "--scale", "tiny", "--taus", "0",
                         "--alphas", "0", "-j", "2", "--set", "steps=4", "--set", "eval_batches=1"])
    assert rc == 0
    assert sorted(str(p) for p in before if not (out / p).is_file()) == []
    changed = {p for p, b in before.items() if (out / p).read_bytes() != b}
    assert Path("table5_c4_scaling.csv") in changed and Path("headline.json") in changed  # the run did write
    for p in sorted(changed):
        old, new = tmp_path / "old" / p, out / p
        old.parent.mkdir(parents=True, exist_ok=True)
        old.write_bytes(before[p])
        if p.suffix == ".csv":
            cols = list(pd.read_csv(old).columns)
            key = KEYS.get(p.stem) or tuple(c for c in cols if c not in ABLATION_RESULT_COLS)
            assert key and _csv_keys(old, key) <= _csv_keys(new, key), p
        elif p.suffix == ".md" and (out / p.with_suffix(".csv")).exists():  # the markdown of a merged table
            rows = lambda f: sum(l.startswith("|") for l in f.read_text().splitlines())
            assert rows(new) >= rows(old), p
        elif p.name in ("provenance.json", "steps.json"):
            assert set(json.loads(old.read_text())) <= set(json.loads(new.read_text())), p
        elif p.name == "headline.json":
            h0, h1 = json.loads(old.read_text()), json.loads(new.read_text())
            assert {(r["scale"], r["method"]) for r in h0["scaling"]} <= {(r["scale"], r["method"]) for r in h1["scaling"]}
            assert [r for r in h1["scaling"] if r["scale"] == "toy"] == [r for r in h0["scaling"] if r["scale"] == "toy"]
            assert {(a, t) for a, d in h0["tau_alpha"].items() for t in d} <= \
                   {(a, t) for a, d in h1["tau_alpha"].items() for t in d}
            assert h1["tau_alpha"]["alpha=0.5"] == h0["tau_alpha"]["alpha=0.5"]  # not rerun: kept as committed
            assert h1["tau_alpha"]["alpha=0"]["0"] != h0["tau_alpha"]["alpha=0"]["0"]  # rerun at 4 steps: replaced
        elif p.name == "README.md" and len(p.parts) == 1:
            names = lambda f: {l.split("`")[1] for l in f.read_text().splitlines() if l.startswith("- `")}
            assert names(old) <= names(new)  # every sweep and file listed (a rerun sweep names its new root)
            heads = lambda f: {l for l in f.read_text().splitlines() if l.startswith("## ")}
            assert heads(old) <= heads(new)  # every section (e.g. #33's, from steps.json) still there
        else:
            assert p.suffix == ".png", f"{p} changed and is not a merged table, a plot or the README"
