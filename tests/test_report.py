"""diloco tables from the records of real tiny runs (DP, DiLoCo, Streaming DiLoCo), made by the sweep."""
import itertools
import json
import os
import math
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest

from diloco import report, reproduce_results as reproduce, sweep as sw
from diloco.config import load_config
from diloco.report.claims import (BY_CLAIM, CLAIMS, FAMILIES, HEADLINE, KINDS, PaperNumbers, claims_table,
                                  write_claims)
from diloco.report.judge import judge, mark_changes, planned_seeds
from diloco.report.plots import ablation_axes, point_labels
from diloco.report.records import collapse, paired_gap_pct, paired_stats, seeds_needed, t_quantile

FAST = {"steps": 6, "H": 3, "seq_len": 32, "batch_size": 4, "log_every": 2, "eval_every": 3, "eval_batches": 2,
        "checkpoint_every": 3, "optimizer.warmup_steps": 1}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    s = sw.load_sweep("sweeps/c4_scaling.py:tiny")
    s["points"] = [p for p in s["points"] if not p["name"].endswith("h100")]  # dp, diloco_h30, streaming h30
    res = sw.run_sweep(s, root, workers=2, extra=[f"--config.{k}={v}" for k, v in FAST.items()], quiet=True,
                       in_process=True)  # two worker processes train the three points
    assert [r["status"] for r in res] == ["done"] * 3, res
    return root


def _summaries(root):
    return {p.parent.name: json.loads(p.read_text()) for p in root.rglob("summary.json")}


def test_tables_hold_ours_beside_the_paper(runs, tmp_path):
    files = report.build(runs, tmp_path / "out", quiet=True).files
    names = {f.name for f in files}
    assert {"table5_c4_scaling.md", "table5_c4_scaling.csv", "bytes_exchanged.csv", "runs.csv",
            "loss_curves_c4_scaling_tiny.png"} <= names
    t5 = pd.read_csv(tmp_path / "out" / "table5_c4_scaling.csv")
    for col in ("eval_loss", "paper_eval_loss", "hellaswag", "paper_hellaswag", "paper_piqa", "paper_arc_easy",
                "gap_to_dp_pct", "paper_gap_to_dp_pct", "diff_gap_pp"):
        assert col in t5.columns
    s = _summaries(runs)
    dp, strm = s["tiny+dp"], s["tiny+streaming_ovl_fp4_h30"]
    row = t5.set_index("method").loc["streaming_ovl_fp4_h30"]
    assert math.isclose(row.eval_loss, strm["final_eval_loss"], rel_tol=1e-9)
    assert math.isclose(row.gap_to_dp_pct, 100 * (strm["final_eval_loss"] / dp["final_eval_loss"] - 1), rel_tol=1e-6)
    paper = pd.read_csv(report.PAPER_DIR / "c4_scaling.csv")
    p35 = paper[(paper.scale == "35M") & (paper.source == "streaming_diloco_v1:table5")].set_index("method")
    assert row.paper_eval_loss == p35.eval_loss["streaming_ovl_fp4_h30"]  # toy rows sit beside the 35M row
    assert math.isclose(row.diff_gap_pp, row.gap_to_dp_pct - row.paper_gap_to_dp_pct)
    by = pd.read_csv(tmp_path / "out" / "bytes_exchanged.csv").set_index("method")
    assert math.isclose(by.dp_total_over_ours["streaming_ovl_fp4_h30"],
                        dp["bytes_exchanged_total"] / strm["bytes_exchanged_total"])
    assert by.dp_total_over_ours["streaming_ovl_fp4_h30"] > 1  # fewer bytes than DP, as the paper says
    md = (tmp_path / "out" / "table5_c4_scaling.md").read_text()
    header = next(l for l in md.splitlines() if l.startswith("|"))
    assert [c.strip() for c in header.strip("|").split("|")][:2] == ["scale", "method"]
    assert "streaming_ovl_fp4_h30" in md


def test_which_params_from_the_checkpoint(runs):
    wd = next(runs.rglob("tiny+streaming_ovl_fp4_h30"))
    res = report.which_params_eval(str(wd))
    # θ^g evaluated from the checkpoint is what the trainer reported at the end
    assert math.isclose(res["outer_params"], _summaries(runs)[wd.name]["final_eval_loss"], rel_tol=1e-5)
    assert set(res) == {"first_replica", "replica_average", "outer_params", "drained_fragments", "outer_params_sha256"}
    assert res["outer_params_sha256"] == _summaries(runs)[wd.name]["params_sha256"]  # the run's own θᵍ, drained
    assert json.loads((wd / "which_params.json").read_text()) == res


def test_ablation_tables_and_plots(runs, tmp_path):
    df = report.load_runs(runs)
    df["sweep"] = "tau_alpha_tiny"  # read the same records as an ablation sweep
    t = report.ablation_table(df)
    assert sorted(t.eval_loss) == sorted(df.final_eval_loss) and t.vs_first_pct.iloc[0] == 0
    order = [p["point"]["arg"].split(",")[1] for p in sw.load_sweep("sweeps/c4_scaling.py:tiny")["points"]]
    assert list(t.label) == [m for m in order if m in set(t.label)]  # rows in the sweep file's order
    report.plot_ablation(t, "tau_alpha_tiny", tmp_path / "a.png")
    assert (tmp_path / "a.png").stat().st_size > 1000


def test_failed_and_unfinished_runs_are_listed(runs, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(runs, root)
    bad = root / "c4_scaling_tiny" / "tiny+dp"
    (bad / "summary.json").unlink()
    (bad / "failed.json").write_text(json.dumps({"returncode": 3, "error_tail": "boom: NaN"}))
    report.build(root, tmp_path / "out", quiet=True)
    failed = pd.read_csv(tmp_path / "out" / "failed_runs.csv")
    assert list(failed.point) == ["tiny+dp"] and failed.error[0] == "boom: NaN"


def test_bad_root_is_a_clear_error(tmp_path):
    assert report.main(["--root", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2


def test_markdown_table_cells_are_formatted_once():
    df = pd.DataFrame({"method": ["dp", "streaming_ovl_fp4_h30"], "loss": [3.14159, float("nan")],
                       "bytes": [2e7, 1234.0], "tiny": [0.0001234, 150.25]})
    md = report.markdown(df).splitlines()
    rows = [[c.strip() for c in l.strip().strip("|").split("|")] for l in md if l.startswith("|")]
    assert set("".join(rows.pop(1))) <= set(":-")  # the alignment row
    assert rows == [["method", "loss", "bytes", "tiny"], ["dp", "3.1416", "20000000", "0.0001234"],
                    ["streaming_ovl_fp4_h30", "", "1234", "150.2"]]
    assert report.markdown(df.iloc[:0]) == "_(no runs)_\n"


# -- seeds, merging, claims: from hand-written run records (no training) --------------------------------
def _record(root, sweep, point, spec, loss, seed=0, finished=None, sweep_file="sweeps/c4_scaling.py", arg="tiny",
            **cfg_over):
    cfg = load_config(spec, [f"--config.{k}={v}" for k, v in cfg_over.items()]).to_dict()
    cfg["seed"] = seed
    name = point if seed == 0 else f"{point},seed={seed}"
    wd = root / sweep / name
    wd.mkdir(parents=True)
    (wd / "config.json").write_text(json.dumps(cfg))
    (wd / "point.json").write_text(json.dumps({"sweep": sweep, "spec": spec.removeprefix("experiments/") and spec,
                                               "point": {"arg": spec.split(":")[1]}, "seed": seed,
                                               "base_point": point, "sweep_file": sweep_file, "sweep_arg": arg}))
    (wd / "summary.json").write_text(json.dumps({
        "final_eval_loss": loss, "bytes_exchanged_total": 1000 if cfg["method"] == "dp" else 10,
        "bytes_peak_per_sync": 10, "syncs": 3, "params": 100, "fragments": 1, "tokens": 2000, "wall_seconds": 7.0,
        "H": cfg["H"] if cfg["method"] != "dp" else None, "fragment_sizes": [100]}))
    return wd


def test_seed_rows_are_mean_and_sample_std_and_gaps_are_paired(tmp_path):
    root = tmp_path / "runs"
    for seed, (dp, st) in enumerate([(2.0, 2.1), (2.2, 2.2), (2.4, 2.52)]):
        _record(root, "c4_scaling_tiny", "tiny+dp", "experiments/c4_scaling.py:tiny,dp", dp, seed)
        _record(root, "c4_scaling_tiny", "tiny+streaming_ovl_fp4_h30",
                "experiments/c4_scaling.py:tiny,streaming_ovl_fp4_h30", st, seed)
    report.build(root, tmp_path / "out", quiet=True)
    t5 = pd.read_csv(tmp_path / "out" / "table5_c4_scaling.csv").set_index("method")
    # by hand: DP 2.0, 2.2, 2.4 → mean 2.2, sample std 0.2; gaps 5 %, 0 %, 5 % → mean 3.3333 %,
    # sd 2.88675 %, 2·sd/√3 = 3.33333 %
    assert t5.n["data_parallel"] == 3
    assert math.isclose(t5.eval_loss["data_parallel"], 2.2, rel_tol=1e-12)
    assert math.isclose(t5.eval_loss_std["data_parallel"], 0.2, rel_tol=1e-9)
    assert math.isclose(t5.gap_to_dp_pct["streaming_ovl_fp4_h30"], 10 / 3, rel_tol=1e-9)
    assert math.isclose(t5.gap_to_dp_pct_unc["streaming_ovl_fp4_h30"], 2 * math.sqrt(25 / 3) / math.sqrt(3),
                        rel_tol=1e-9)
    md = (tmp_path / "out" / "table5_c4_scaling.md").read_text()
    assert "| 2.2 ± 0.2 " in md and "3.3333 ± 3.3333" in md
    # the header says what the table is: trained on stdlib, not C4, n = 3 seeds (tokens/params = 2000/100)
    assert md.splitlines()[2] == (
        "What it is: corpus `stdlib` (not C4: the paper's C4 numbers are only beside ours) (store not recorded), "
        "vocab byte, scale tiny, steps 200, H 10, α 0.5, codec e3m0 (DP aside), M 2, tokens per parameter 20; seeds n = 3 per "
        "setting; interval: mean ± sample std over seeds, gaps paired by seed ± 2 SE."), md.splitlines()[2]
    runs_csv = pd.read_csv(tmp_path / "out" / "runs.csv")
    assert set(runs_csv.data) == {"stdlib"} and set(runs_csv.vocab) == {"byte"} and set(runs_csv.tokens_per_param) == {20}


def test_any_sweep_gets_its_table_and_plot_beside_its_runs(tmp_path, capsys):
    """A sweep of a new name (no known prefix) gets its ablation table, plot and loss curves; `diloco tables`
    without --out writes them under --root, not into the repository's results/."""
    root = tmp_path / "runs"
    for tau in (1, 2):
        _record(root, "my_question", f"tau={tau}", "experiments/c4_scaling.py:tiny,streaming_ovl_fp4_h30", 2 + tau,
                sweep_file="sweeps/my_question.py", tau=tau)
    assert report.main(["--root", str(root)]) == 0
    assert {f"ablation_my_question.{e}" for e in ("csv", "md", "png")} <= {f.name for f in root.iterdir()}
    assert (root / "loss_curves_my_question.png").exists()
    assert report.verdict(0.3, 0.2, -1, 1) == "agrees" and report.verdict(3.0, 0.5, -1, 1) == "disagrees"
    assert report.verdict(0.9, 0.5, -1, 1) == "inconclusive" and report.verdict(0.1, float("nan"), -1, 1).startswith("inconclusive")


def test_regenerating_from_fewer_records_drops_no_table_or_row(tmp_path):
    """A fresh clone's reproduce: the root holds only some of the runs behind the committed tables."""
    full, part, out = tmp_path / "full", tmp_path / "part", tmp_path / "out"
    for scale in ("tiny", "toy"):
        _record(full, "c4_scaling_tiny+toy", f"{scale}+dp", f"experiments/c4_scaling.py:{scale},dp", 2.5)
        _record(full, "c4_scaling_tiny+toy", f"{scale}+streaming_ovl_fp4_h30",
                f"experiments/c4_scaling.py:{scale},streaming_ovl_fp4_h30", 2.6)
    _record(full, "tau_alpha_tiny", "tau=0,alpha=0.0", "experiments/ablate_tau.py:tiny", 2.7,
            sweep_file="sweeps/tau_alpha.py")
    report.build(full, out, quiet=True)
    # a step group's section and its steps' note (--note: where the runs came from) are generated, not hand-written
    note = "they ran from a `git archive` of commit f2a883d (one data order)"
    reproduce.write_readme(out, full, ["--beyond", "--note", note],
                           [("eager_table2", f"diloco sweep sweeps/eager.py:table2,tiny --root {full}", 0.0, 0)],
                           {"scaling": [], "tau_alpha": {}}, note=note)
    reproduce.write_readme(out, full, [], [], {"scaling": [], "tau_alpha": {}})
    before = {p.name: p.read_text() for p in out.iterdir() if p.suffix in (".csv", ".md")}
    assert {"table5_c4_scaling.csv", "ablation_tau_alpha_tiny.csv", "runs.csv", "README.md"} <= set(before)
    # rerun: only tiny's c4 runs are present, with the same numbers
    _record(part, "c4_scaling_tiny+toy", "tiny+dp", "experiments/c4_scaling.py:tiny,dp", 2.5)
    _record(part, "c4_scaling_tiny+toy", "tiny+streaming_ovl_fp4_h30",
            "experiments/c4_scaling.py:tiny,streaming_ovl_fp4_h30", 2.6)
    report.build(part, out, quiet=True)
    reproduce.write_readme(out, part, [], [], {"scaling": [], "tau_alpha": {}})
    t5 = pd.read_csv(out / "table5_c4_scaling.csv")
    assert sorted(zip(t5.scale, t5.method)) == [("tiny", "data_parallel"), ("tiny", "streaming_ovl_fp4_h30"),
                                                ("toy", "data_parallel"), ("toy", "streaming_ovl_fp4_h30")]
    assert (out / "ablation_tau_alpha_tiny.md").read_text() == before["ablation_tau_alpha_tiny.md"]
    assert len(pd.read_csv(out / "runs.csv")) == 5
    readme = (out / "README.md").read_text()
    assert "tau_alpha_tiny" in readme and "ablation_tau_alpha_tiny.md" in readme
    # every section and every line outside the per-root lists is kept: the group's description and its note
    section = lambda t: t[t.index(f"## {reproduce.BEYOND_TITLE}"):].split("\n## ")[0]
    assert section(readme) == section(before["README.md"]) and note in section(readme)
    assert reproduce.BEYOND_TEXT in readme and "`diloco reproduce --beyond`" in readme
    heads = lambda t: [l for l in t.splitlines() if l.startswith("## ")]
    assert heads(readme) == heads(before["README.md"])
    assert all(l in readme for l in before["README.md"].splitlines() if not l.startswith(("- `", "Made by")))
    # a rerun of the step that trains new runs drops the note (it may not hold for them); one that trains none keeps it
    reproduce.write_readme(out, full, ["--beyond"], [("eager_table2", "diloco sweep sweeps/eager.py:table2,tiny", 0.0, 0)],
                           {"scaling": [], "tau_alpha": {}})
    assert note in (out / "README.md").read_text()
    reproduce.write_readme(out, full, ["--beyond"], [("eager_table2", "diloco sweep sweeps/eager.py:table2,tiny", 0.0, 0)],
                           {"scaling": [], "tau_alpha": {}}, trained={"eager_table2"})
    assert note not in (out / "README.md").read_text() and reproduce.BEYOND_TITLE in (out / "README.md").read_text()
    assert "2 row(s) kept from the committed table" in (out / "table5_c4_scaling.md").read_text()
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["table5_c4_scaling"]["runs"] == 2 and prov["table5_c4_scaling"]["rows_kept_from_committed"] == 2
    # a number that changes at the printed precision is reported
    part2 = tmp_path / "part2"
    _record(part2, "c4_scaling_tiny+toy", "tiny+dp", "experiments/c4_scaling.py:tiny,dp", 2.50004)
    assert report.build(part2, out, quiet=True).changed == []  # 2.5 vs 2.50004: the same 4 printed decimals
    part3 = tmp_path / "part3"
    _record(part3, "c4_scaling_tiny+toy", "tiny+dp", "experiments/c4_scaling.py:tiny,dp", 2.5123)
    assert report.build(part3, out, quiet=True).changed == ["table5_c4_scaling: tiny, data_parallel, 2: 2.5 → 2.5123"]


def test_the_scale_trend_pairs_the_claims_budgets_two_sweeps(tmp_path):
    """Streaming's gap to DP at tiny and at toy from the claims sweeps (one sweep per scale) makes the
    trend row, in place of the quick budget's. By hand: tiny gaps 5 %, 5 % (seeds 0, 1), toy 2 %, 4 %:
    gap(tiny) − gap(toy) = 5 − 3 = 2 pp."""
    root = tmp_path / "runs"
    losses = {"tiny": [(2.0, 2.1), (2.2, 2.31)], "toy": [(1.0, 1.02), (1.5, 1.56)]}
    for scale, pairs in losses.items():
        for seed, (dp, st) in enumerate(pairs):
            for m, loss in (("dp", dp), ("streaming_ovl_fp4_h30", st)):
                _record(root, f"claims_headline_{scale}", f"{scale}+{m}", f"experiments/claims.py:{scale},{m}", loss,
                        seed, sweep_file="sweeps/claims.py", arg=f"headline,{scale}")
    quick = tmp_path / "quick"  # the quick budget's runs: beside the claims runs (their trend is not the row
    for where, scale in itertools.product((root, quick), ("tiny", "toy")):  # any more) and alone (below)
        for m, loss in (("dp", 2.0), ("streaming_ovl_fp4_h30", 2.2)):
            _record(where, "c4_scaling_tiny+toy", f"{scale}+{m}", f"experiments/c4_scaling.py:{scale},{m}", loss,
                    arg="tiny+toy")
    report.build(root, tmp_path / "out", quiet=True)
    c = pd.read_csv(tmp_path / "out" / "claims.csv")
    (row,) = c[c.claim == "The gap to DP shrinks as scale grows (tiny → toy)"].itertuples()
    assert row.runs == "claims_headline_tiny + claims_headline_toy" and row.n == 2
    assert math.isclose(row.ours_gap_pct, 2.0, rel_tol=1e-9)
    # then `diloco reproduce` (the quick budget only) into the same out/: it regenerates the quick budget's
    # trend as its own row (tiny 10 %, toy 10 %: 0 pp) and keeps the claims budget's row it cannot remake
    report.build(quick, tmp_path / "out", quiet=True)
    c = pd.read_csv(tmp_path / "out" / "claims.csv").set_index("claim")
    kept = c.loc["The gap to DP shrinks as scale grows (tiny → toy)"]
    assert kept.runs == "claims_headline_tiny + claims_headline_toy" and math.isclose(kept.ours_gap_pct, 2.0)
    new = c.loc["The gap to DP shrinks as scale grows (tiny → toy) — quick budget"]
    assert new.runs == "c4_scaling_tiny+toy" and new.n == 1 and abs(new.ours_gap_pct) < 1e-9


def _which_params(wd, first, avg, outer):  # a drained which_params.json, as report.which_params_eval caches it
    (wd / "which_params.json").write_text(json.dumps({"first_replica": first, "replica_average": avg,
                                                      "outer_params": outer, "drained_fragments": [0]}))


def test_table3_rows_pair_the_three_evaluations_by_seed(tmp_path):
    """Claims row 'the replicas drift apart' and results/table3_outer_lr from each seed's which_params.json.
    By hand, headline seeds 0, 1: first/avg = 2.06/2.00 (+3 %), 3.12/3.00 (+4 %) → +3.5 %, sd 0.7071,
    SE 0.5; the 95 % t-interval ± 12.7062·0.5 = 6.3531: [−2.85, 9.85] is not inside the band [+1 %, ∞) →
    inconclusive (±2·SE = [2.5, 4.5] would have said agrees).
    table3 at outer lr 0.4, seeds 0, 1: (first, avg, θᵍ) = (2.02, 2.00, 2.00), (3.09, 3.00, 3.03):
    first vs avg +1 %, +3 % → 2 ± 2; first vs θᵍ +1 %, +1.9802 % → 1.4901 ± 0.9802; avg vs θᵍ 0, −0.9901 %."""
    root = tmp_path / "runs"
    for seed, (first, avg) in enumerate([(2.06, 2.00), (3.12, 3.00)]):
        _record(root, "claims_headline_tiny", "tiny+dp", "experiments/claims.py:tiny,dp", 2.0, seed,
                sweep_file="sweeps/claims.py", arg="headline,tiny")
        wd = _record(root, "claims_headline_tiny", "tiny+streaming_ovl_fp4_h30",
                     "experiments/claims.py:tiny,streaming_ovl_fp4_h30", 2.0, seed, sweep_file="sweeps/claims.py",
                     arg="headline,tiny")
        _which_params(wd, first, avg, avg)
    for seed, (first, avg, outer) in enumerate([(2.02, 2.00, 2.00), (3.09, 3.00, 3.03)]):
        for lr in (0.4, 1.0):
            wd = _record(root, "claims_table3_tiny", f"outer.lr={lr}", "experiments/claims.py:tiny,streaming_ovl_fp4_h30",
                         outer, seed, sweep_file="sweeps/claims.py", arg="table3,tiny", **{"outer.lr": lr})
            _which_params(wd, first, avg, outer)
    report.build(root, tmp_path / "out", quiet=True)
    c = pd.read_csv(tmp_path / "out" / "claims.csv")
    (row,) = c[c.claim.str.startswith("Table 3: the replicas drift apart")].itertuples()
    assert math.isclose(row.ours_gap_pct, 3.5, rel_tol=1e-9) and math.isclose(row.ours_se_pct, 0.5, rel_tol=1e-9)
    assert math.isclose(row.ours_ci_pct, 12.7062 * 0.5, rel_tol=1e-5) and row.ours_df == 1
    assert row.verdict == "inconclusive" and row.n == 2
    t = pd.read_csv(tmp_path / "out" / "table3_outer_lr.csv").set_index("outer_lr")
    assert sorted(t.index) == [0.4, 1.0] and (t.n == 2).all() and (t.alpha == 0.5).all()
    r = t.loc[0.4]
    assert math.isclose(r.first_vs_avg_pct, 2.0, rel_tol=1e-9) and math.isclose(r.first_vs_avg_pct_unc, 2.0, rel_tol=1e-9)
    assert math.isclose(r.first_vs_outer_pct, (1.0 + 100 * (3.09 / 3.03 - 1)) / 2, rel_tol=1e-9)
    assert math.isclose(r.avg_vs_outer_pct, 100 * (3.00 / 3.03 - 1) / 2, rel_tol=1e-9)
    assert math.isclose(r.outer_params, (2.00 + 3.03) / 2, rel_tol=1e-9)


# -- the claims' statistics: Student-t intervals, seeds needed, re-judging committed rows ------------------
def test_t_interval_calls_inconclusive_what_two_se_called_agrees():
    """By hand: per-seed gaps 2 % and 3 % (n = 2): mean 2.5, sd 0.70711, SE 0.5. ±2·SE = [1.5, 3.5] lies in
    the band [0, 5] (agrees); the 95 % t-interval, t(1) = 12.7062 (tables), is ±6.3531 = [−3.85, 8.85]
    (inconclusive). With 8 seeds of sd 0.70711 (SE 0.25, t(7) = 2.3646: ±0.5912) the t-interval agrees."""
    assert math.isclose(t_quantile(1), 12.7062, rel_tol=1e-5) and math.isclose(t_quantile(2), 4.3027, rel_tol=1e-4)
    assert math.isclose(t_quantile(7), 2.3646, rel_tol=1e-4) and math.isclose(t_quantile(1e6), 1.95996, rel_tol=1e-5)
    a, b = {0: 1.02, 1: 1.03}, {0: 1.0, 1: 1.0}  # gaps of a over b: +2 %, +3 %
    m, sd, n = paired_stats(a, b)
    assert n == 2 and math.isclose(m, 2.5, rel_tol=1e-9) and math.isclose(sd, math.sqrt(0.5), rel_tol=1e-9)
    g, two_se, _ = paired_gap_pct(a, b)
    assert math.isclose(two_se, 1.0, rel_tol=1e-9) and report.verdict(g, two_se, 0.0, 5.0) == "agrees"
    ci, v = judge(m, sd / math.sqrt(n), n - 1, 0.0, 5.0)
    assert math.isclose(ci, 6.3531, rel_tol=1e-4) and v == "inconclusive"
    ci8, v8 = judge(2.5, math.sqrt(0.5) / math.sqrt(8), 7, 0.0, 5.0)
    assert math.isclose(ci8, 0.5912, rel_tol=1e-3) and v8 == "agrees"
    assert judge(2.5, float("nan"), float("nan"), 0.0, 5.0)[1] == "inconclusive (n<2)"


def _question(root):
    """The researcher's question as records: τ ∈ {1, 2} × α ∈ {0, 0.5} (Streaming) and DP, 3 seeds each."""
    losses = {(1, 0.0): (2.02, 2.04, 2.06), (2, 0.0): (2.04, 2.05, 2.06), (1, 0.5): (2.0, 2.0, 2.0),
              (2, 0.5): (2.02, 2.02, 2.02), None: (2.0, 2.0, 2.0)}
    for key, ls in losses.items():
        axes = {"method": "dp"} if key is None else {"tau": key[0], "alpha": key[1]}
        spec = "experiments/c4_scaling.py:tiny," + ("dp" if key is None else "streaming_ovl_fp4_h30")
        for seed, loss in enumerate(ls):
            wd = _record(root, "question", sw.point_name(axes), spec, loss, seed, sweep_file="sweeps/question.py",
                         **({} if key is None else axes))
            p = json.loads((wd / "point.json").read_text())
            (wd / "point.json").write_text(json.dumps({**p, "point": axes, "axes": list(axes)}))


def test_ref_and_pairs_compare_with_t_intervals_by_hand(tmp_path, capsys):
    """By hand, against DP (2.0 every seed): τ=1,α=0 gains +1, +2, +3 % (mean 2, sd 1, t(2) = 4.3027, ±2.4841:
    [−0.484, 4.484], not significant); τ=2,α=0 +2, +2.5, +3 % (sd 0.5: ±1.2421, [1.258, 3.742], significant).
    --pairs tau: τ=2 against τ=1 at each α (α held fixed), --pairs alpha: α=0.5 against α=0 at each τ."""
    root = tmp_path / "runs"
    _question(root)
    assert report.main(["--root", str(root), "--ref", "method=dp", "--pairs", "tau,alpha"]) == 0
    assert "| ref method=dp |" in capsys.readouterr().out  # the table is printed, too
    t = pd.read_csv(root / "compare.csv")
    ref = t[t.by == "ref method=dp"].set_index("setting")
    r = ref.loc["tau=1,alpha=0.0"]
    assert r.n == 3 and math.isclose(r.gap_pct, 2.0, rel_tol=1e-9) and r.significant == "no"
    assert math.isclose(r.ci_low_pct, 2 - 4.302653 / math.sqrt(3), abs_tol=1e-5)
    assert math.isclose(r.ci_high_pct, 4.48414, abs_tol=1e-5)
    r = ref.loc["tau=2,alpha=0.0"]
    assert math.isclose(r.gap_pct, 2.5, rel_tol=1e-9) and r.significant == "yes"
    assert math.isclose(r.ci_low_pct, 1.257931, abs_tol=1e-5) and math.isclose(r.ci_high_pct, 3.742069, abs_tol=1e-5)
    assert set(ref.vs) == {"method=dp"} and len(ref) == 4
    pairs = {(x.by, x.setting): (x.vs, x.significant) for x in t[t.by != "ref method=dp"].itertuples()}
    assert pairs == {("tau", "tau=2,alpha=0.0"): ("tau=1,alpha=0.0", "no"),
                     ("tau", "tau=2,alpha=0.5"): ("tau=1,alpha=0.5", "yes"),  # +1 % every seed
                     ("alpha", "tau=1,alpha=0.5"): ("tau=1,alpha=0.0", "no"),  # −0.99, −1.96, −2.91 %: ±2.39
                     ("alpha", "tau=2,alpha=0.5"): ("tau=2,alpha=0.0", "yes")}  # −0.98, −1.46, −1.94 %: ±1.19
    md = (root / "compare.md").read_text()
    assert md.startswith("# Comparisons (--ref method=dp --pairs tau,alpha)") and "What it is: corpus" in md
    assert "seeds n = 3 per setting; interval: gaps paired by seed, mean ± t(n−1)·SE, 95 % Student-t." in md


@pytest.mark.parametrize("argv, says", [
    (["--ref", "method=sgd"], "--ref: method=sgd matches no finished setting under --root (method is dp, streaming)"),
    (["--ref", "tau=1"], "--ref: tau=1 matches 2 settings of sweep 'question'"),
    (["--ref", "nosuch=1"], "--ref: 'nosuch' is not an axis or config field of sweep 'question'"),
    (["--ref", "method"], "--ref: 'method' must look like KEY=VALUE"),
    (["--pairs", "nosuch"], "--pairs: 'nosuch' is not an axis or config field")])
def test_ref_and_pairs_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, argv, says):
    root = tmp_path / "runs"
    _question(root)
    assert report.main(["--root", str(root), *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and says in err, err
    assert not (root / "compare.csv").exists() and not (root / "runs.csv").exists()


def test_seeds_needed_is_the_textbook_power_calculation():
    """80 % power, two-sided 95 %, one-sample t (Cohen 1988; G*Power): effect size d = 0.5 → 34 seeds,
    d = 1 → 10, d = 0.8 → 15 (≈ ((1.960 + 0.842)/d)² + 1.960²/2 = 33.3, 9.8, 14.2, rounded up). d is the
    distance from the mean to the band edge the interval must clear, over the per-seed sd."""
    inf = float("inf")
    assert seeds_needed(0.0, 1.0, -inf, 0.5) == 34  # inside (−∞, 0.5]: agrees once the interval clears 0.5
    assert seeds_needed(0.0, 2.0, -inf, 2.0) == 10 and seeds_needed(0.2, 1.0, -inf, 1.0) == 15
    assert seeds_needed(1.5, 1.0, -inf, 0.5) == 10  # outside: disagrees once the interval clears 0.5 from above
    assert seeds_needed(-1.5, 1.0, -0.5, 0.5) == 10  # below the band: the lower edge
    # inside a two-edged band both edges must be cleared: more seeds than for one edge at that distance
    assert seeds_needed(0.0, 1.0, -0.5, 0.5) > 34
    assert seeds_needed(0.5, 1.0, -inf, 0.5) is None  # the mean on the edge: no number of seeds decides it
    assert seeds_needed(0.0, float("nan"), -inf, 0.5) is None


def _read_claims(path):
    return pd.read_csv(path, dtype={"changed_from": str, "seeds_needed": str}).fillna(
        {"changed_from": "", "seeds_needed": ""})


_LEGACY = ["claim,paper_source,ours,ours_gap_pct,ours_unc_pct,n,paper,band_for_verdict,verdict,runs,note",
           '"Merging α=0.5 vs α=0 (Streaming, τ=0, FP32) — at toy",Fig. 8,-2.74% ± 1.73% (n=2),-2.741120986827733,'
           '1.7324507404486211,2,p,"[−∞, +0.5%]",agrees,"claims_headline_toy (3130 steps)",',
           '"Streaming DiLoCo (ovl. FP4, H=30) ≈ DP at equal tokens",Table 5,+3.00% ± 2.00% (n=4),3.0,2.0,4,p,'
           '"[-1%, +1%]",disagrees,"claims_headline_tiny (990 steps)",',
           '"Streaming DiLoCo (ovl. FP4, H=30) ≈ DP at equal tokens — at toy",Table 5,+1.00% ± 1.41% (n=2),1.0,'
           '1.4142135623730951,2,p,"[-1%, +1%]",inconclusive,"claims_headline_toy (3130 steps)",',
           '"The gap to DP shrinks as scale grows (tiny → toy)",Table 5,+2.00% ± 2.45% (n=2),2.0,2.449,2,p,'
           '"[+0%, +∞]",agrees,claims_headline_tiny + claims_headline_toy,',
           'Total bytes: Streaming FP4 H=100 ≪ DP — at toy,Table 1,DP/ours ×129 at H=33,,,2,p,×132 ± 25 %,agrees,'
           '"claims_headline_toy (3130 steps)",counted']


def test_committed_rows_are_judged_again_without_their_runs(tmp_path):
    """A claims.csv written with ±2·SE (the columns before ours_sd_pct) and no claims runs under the root:
    the rebuild re-judges every row from its n, mean and ±2·SE (sd = unc·√n/2), remakes the trend row from
    the two headline rows, and says which verdicts changed. By hand:
    α at toy: sd = 1.73245·√2/2 = 1.22502, SE 0.86623, ± 12.7062·SE = 11.0064 → [−13.75, 8.27]:
    agrees → inconclusive. Trend: tiny mean 3, sd 2.0·√4/2 = 2, n 4; toy mean 1, sd 1.41421·√2/2 = 1, n 2:
    3 − 1 = 2, SE² = 4/4 + 1/2 = 1.5, Welch df = 1.5² / (1²/3 + 0.5²/1) = 27/7."""
    root, out = tmp_path / "runs", tmp_path / "out"
    out.mkdir()
    (out / "claims.csv").write_text("\n".join(_LEGACY) + "\n")
    _record(root, "tau_alpha_tiny", "tau=0,alpha=0.0", "experiments/ablate_tau.py:tiny", 2.7,
            sweep_file="sweeps/tau_alpha.py")  # a root without claims runs
    report.build(root, out, quiet=True)
    c = _read_claims(out / "claims.csv").set_index("claim")
    a = c.loc["Merging α=0.5 vs α=0 (Streaming, τ=0, FP32) — at toy"]
    assert math.isclose(a.ours_sd_pct, 1.7324507404486211 * math.sqrt(2) / 2, rel_tol=1e-12)
    assert math.isclose(a.ours_ci_pct, 11.0064, rel_tol=1e-4) and a.ours_df == 1
    assert a.verdict == "inconclusive" and a.changed_from == "agrees → inconclusive"
    assert a.ours == "-2.74% ± 11.01% (n=2 < 3 planned)" and a.seeds_planned == 3 and int(a.seeds_needed) > 2
    t = c.loc["The gap to DP shrinks as scale grows (tiny → toy)"]
    assert math.isclose(t.ours_gap_pct, 2.0) and math.isclose(t.ours_se_pct, math.sqrt(1.5), rel_tol=1e-9)
    assert math.isclose(t.ours_df, 27 / 7, rel_tol=1e-9) and t.n == 2
    assert math.isclose(t.ours_ci_pct, t_quantile(27 / 7) * math.sqrt(1.5), rel_tol=1e-9)
    assert t.verdict == "inconclusive" and t.changed_from == "agrees → inconclusive"
    h = c.loc["Streaming DiLoCo (ovl. FP4, H=30) ≈ DP at equal tokens"]  # SE 1, t(3) 3.1824: [−0.18, 6.18]
    assert h.verdict == "inconclusive" and h.changed_from == "disagrees → inconclusive"
    assert h.ours == "+3.00% ± 3.18% (n=4 < 8 planned)"
    b = c.loc["Total bytes: Streaming FP4 H=100 ≪ DP — at toy"]  # counted bytes: no interval, kept as it was
    assert b.verdict == "agrees" and b.ours == "DP/ours ×129 at H=33" and b.changed_from == ""
    md = (out / "claims.md").read_text()
    assert "95% confidence interval" in md and "Student's t" in md and "agrees → inconclusive" in md
    # the same records again: the same files (the changes stay marked until the numbers move)
    before = {f: (out / f).read_text() for f in ("claims.csv", "claims.md")}
    report.build(root, out, quiet=True)
    assert {f: (out / f).read_text() for f in before} == before


def test_changed_from_marks_a_verdict_that_moved_and_only_that():
    old = pd.DataFrame({"claim": list("abcde"), "ours": ["1", "2", "3", "4", "5"],
                        "verdict": ["agrees", "agrees", "inconclusive", "disagrees", "agrees"],
                        "changed_from": [None, "disagrees → agrees", None, "agrees → disagrees", None]})
    new = pd.DataFrame({"claim": list("abcdef"), "ours": ["1", "2", "3", "4b", "5", "6"],
                        "verdict": ["inconclusive", "agrees", "inconclusive (n<2)", "disagrees", "agrees", "agrees"]})
    assert mark_changes(new, old).changed_from.tolist() == [
        "agrees → inconclusive",  # moved
        "disagrees → agrees",  # same verdict, same number: the last change stays marked (a rebuild says the same)
        "",  # 'inconclusive (n<2)' is still inconclusive
        "",  # same verdict, new number (new runs): nothing changed against the table it replaces
        "", ""]  # unchanged; a new row
    assert mark_changes(new, None).changed_from.tolist() == [""] * 6


def test_claims_md_ends_with_the_claims_by_verdict_and_no_readme_is_touched(tmp_path):
    """`diloco tables` closes results/claims.md with the claims grouped by verdict, one line per claim
    with its number at each scale, from the same table; the README beside out/ is not written, even one
    holding the markers an older version rewrote."""
    root, out = tmp_path / "runs", tmp_path / "results"
    out.mkdir()
    (out / "claims.csv").write_text("\n".join(_LEGACY) + "\n")
    _record(root, "tau_alpha_tiny", "tau=0,alpha=0.0", "experiments/ablate_tau.py:tiny", 2.7,
            sweep_file="sweeps/tau_alpha.py")
    readme = "# x\n<!-- claims:begin -->\nstale: agrees\n<!-- claims:end -->\n"
    (tmp_path / "README.md").write_text(readme)
    report.build(root, out, quiet=True)
    assert (tmp_path / "README.md").read_text() == readme
    md = (out / "claims.md").read_text()
    head, _, block = md.partition("\n## By verdict\n\n")
    assert head.startswith("# The paper's claims") and "| claim " in head and "## " not in head
    lines = block.splitlines()
    assert "seeds: tiny 4 of 8 planned, toy 2 of 3 planned" in lines[0]
    i, j = lines.index("  - **agrees** (1 rows):"), lines.index("  - **inconclusive** (4 rows):")
    assert lines[i + 1:j] == ["    - Total bytes: Streaming FP4 H=100 ≪ DP: toy DP/ours ×129 at H=33"]
    need = lambda claim: int(pd.read_csv(out / "claims.csv").set_index("claim").seeds_needed[claim])
    assert lines[j + 1] == ("    - Merging α=0.5 vs α=0 (Streaming, τ=0, FP32): toy -2.74 ± 11.01% "
                            f"({need('Merging α=0.5 vs α=0 (Streaming, τ=0, FP32) — at toy')} seeds would decide it)")
    assert len(lines) == j + 4 and "**disagrees**" not in block  # 3 claims (the headline at both scales)


def _claims_rows_by_scale(scale: str):
    c = _read_claims(report.PAPER_DIR.parent / "claims.csv")
    c = c[c.ours_gap_pct.notna()]  # rows with an interval (not the counted bytes)
    rows = [(r.claim, int(r.n), planned_seeds(r.runs), r.ours) for r in c.itertuples()
            if planned_seeds(r.runs) and (scale in r.runs if scale == "toy" else "toy" not in r.runs)]
    assert rows, f"no claims rows at {scale} in results/claims.csv"
    return rows


def test_committed_claims_say_when_they_have_fewer_seeds_than_planned():
    """Honesty of the committed results/claims.csv: a row with fewer seeds than sweeps/claims.py plans for
    its sweep says so in its number ('n=2 < 3 planned'); one with enough does not."""
    for scale in ("tiny", "toy"):
        for claim, n, planned, ours in _claims_rows_by_scale(scale):
            assert (f"(n={n} < {planned} planned)" in ours) == (n < planned), (claim, ours)


@pytest.mark.parametrize("scale", ["tiny", pytest.param("toy", marks=pytest.mark.xfail(
    strict=True, reason="toy 3rd seed not run: 8 runs × ~20 min (results/claims.md says n=2 < 3 planned)"))])
def test_committed_claims_have_the_planned_seeds(scale):
    """results/claims.csv's rows have the seeds sweeps/claims.py plans (tiny 8, toy 3), and so do the run
    records they were built from (results/runs.csv: finished seeds per point of the claims sweeps)."""
    for claim, n, planned, _ in _claims_rows_by_scale(scale):
        assert n >= planned, f"{claim}: n={n} < {planned} planned"
    runs = pd.read_csv(report.PAPER_DIR.parent / "runs.csv")
    runs = runs[runs.sweep.str.startswith(("claims_headline_", "claims_tau_alpha_")) & (runs.status == "done")
                & runs.sweep.str.endswith(f"_{scale}")]
    seeds = runs.groupby(["sweep", "base_point"]).seed.nunique()
    assert len(seeds) and all(k >= planned_seeds(sw) for (sw, _), k in seeds.items()), seeds.to_dict()


# -- claims golden: the claims evaluator's output for fixed inputs, byte for byte ---------------------------
# tests/fixtures/claims/: the claims and c4_scaling rows of results/runs.csv (the committed run records),
# the committed claims.csv and table5_c4_scaling.csv they were judged against, and what claims.py made of
# them (golden_*), written by the code before the claims became a table of definitions; claims.md is
# compared up to its closing section by verdict (added after, moved from the README). Two builds:
# `all`: every claims and c4_scaling sweep, no committed table, a which_params.json per headline seed
#   (first replica, replica average, θᵍ made from the run's loss and its seed) so the Table 3 rows exist;
# `committed`: the root behind the committed results/claims.md (claims_headline_tiny, claims_tau_alpha_tiny
#   under runs/full) over the committed claims.csv and Table 5: committed rows re-judged, the quick
#   budget's trend from the committed Table 5. Regenerate (only for an intended change, named in the
#   commit): DILOCO_WRITE_CLAIMS_GOLDEN=1 python -m pytest tests/test_report.py -k golden
GOLDEN = report.PAPER_DIR.parents[1] / "tests" / "fixtures" / "claims"
GOLDEN_SWEEPS = {"all": None, "committed": ("claims_headline_tiny", "claims_tau_alpha_tiny")}


def _golden_build(build: str, tmp_path) -> dict[str, str]:
    df = pd.read_csv(GOLDEN / "runs.csv")
    out = tmp_path / build
    out.mkdir()
    old5 = None
    if GOLDEN_SWEEPS[build]:
        df = df[df.sweep.isin(GOLDEN_SWEEPS[build])]
        shutil.copy(GOLDEN / "committed_claims.csv", out / "claims.csv")
        old5 = pd.read_csv(GOLDEN / "committed_table5_c4_scaling.csv")
    else:
        df = df.copy()
        for i, r in df[df.sweep.str.startswith("claims_headline_") & df.base_point.str.endswith("+streaming_ovl_fp4_h30")
                       & (df.status == "done")].iterrows():
            wd = tmp_path / "wd" / f"{r.sweep}-{r.point}"
            wd.mkdir(parents=True)
            outer, s = float(r.final_eval_loss), int(r.seed)
            avg = outer * (1 + 0.001 * (s % 3))
            _which_params(wd, avg * (1.02 + 0.004 * s), avg, outer)
            df.loc[i, "workdir"] = str(wd)
    c = claims_table(collapse(df), old5, run_records=df)
    write_claims(c, out, df[df.sweep.str.startswith(("claims_", "c4_scaling"))], Path("runs/full"), {})
    return {f: (out / f).read_text() for f in ("claims.csv", "claims.md")}


@pytest.mark.parametrize("build", sorted(GOLDEN_SWEEPS))
def test_claims_golden_same_inputs_same_claims_files(build, tmp_path):
    got = _golden_build(build, tmp_path)
    for f, text in got.items():
        gold = GOLDEN / f"golden_{build}_{f}"
        if f == "claims.md":  # the old code's text, then (since) the claims by verdict
            text, sep, _ = text.partition("\n## By verdict\n\n- **At the claims budget**")
            assert sep, "claims.md has no closing section of the claims by verdict"
        if os.environ.get("DILOCO_WRITE_CLAIMS_GOLDEN"):
            gold.write_text(text)
        assert text == gold.read_text(), f"{f} of the {build!r} build differs from {gold}"


def test_readme_result_quotes_the_committed_claims():
    """The README's three-line result is written by hand (no table rebuild rewrites the README): every
    gap ± interval it quotes is a row of results/claims.csv at tiny, with the verdict it states for the
    headline row."""
    readme = (report.PAPER_DIR.parents[1] / "README.md").read_text()
    result = readme[readme.index("**Result**"):readme.index("(results/claims.md)")]
    quoted = [(float(m.replace("−", "-")), float(u)) for m, u in re.findall(r"([+−-]\d+\.\d\d) ± (\d+\.\d\d) %", result)]
    assert len(quoted) == 3, result
    c = _read_claims(report.PAPER_DIR.parent / "claims.csv")
    tiny = c[c.runs.str.startswith("claims_headline_tiny ") & c.ours_ci_pct.notna()]
    rows = {(round(r.ours_gap_pct, 2), round(r.ours_ci_pct, 2)): r for r in tiny.itertuples()}
    for q in quoted:
        assert q in rows, f"README quotes {q}, not a tiny row of results/claims.csv"
    head = tiny.set_index("claim").loc[HEADLINE]
    assert (round(head.ours_gap_pct, 2), round(head.ours_ci_pct, 2)) in quoted
    assert f"is {head.verdict}" in result.replace("\n", " ")


def test_every_claim_definition_is_well_formed():
    """CLAIMS, the claims as data: unique claim texts, a known kind and sweep family, rows compared in the
    kind's shape, a band lo < hi, and a paper number each (texts made from the paper's CSVs resolve)."""
    assert len(BY_CLAIM) == len(CLAIMS) >= 17
    p = PaperNumbers()
    for d in CLAIMS:
        assert d.kind in KINDS and d.band[0] < d.band[1], d
        assert d.sweep in FAMILIES or (d.kind == "trend" and d.sweep in ("c4_scaling", "claims_headline")), d
        shape = {"gap": 2, "bytes_total": 2, "bytes_peak": 2, "gap_change": 2, "recovered": 2, "trend": 0}[d.kind]
        assert len(d.compare) == shape, d
        if d.kind in ("gap_change", "recovered"):
            assert all(len(pair) == 2 for pair in d.compare), d
        assert (d.paper(p) if callable(d.paper) else d.paper), d


def test_ablation_plot_labels_keep_the_swept_fragments_and_print_ints_as_ints():
    """A sweep over fragments (the axis and the result column are one column) keeps it in its labels; a
    swept int read back as a float prints as an int."""
    t = pd.DataFrame({"scale": ["tiny"] * 2, "method": ["streaming"] * 2, "tau": [1.0, 1.0], "status": ["done"] * 2,
                      "eval_loss": [2.0, 2.1], "fragments": [1, 2], "bytes_total": [10, 10]})
    axes = ablation_axes(t)
    assert axes == ["method", "tau", "fragments"]
    assert point_labels(t, axes) == ["streaming, tau=1, fragments=1", "streaming, tau=1, fragments=2"]
    assert "fragments" not in ablation_axes(t.assign(fragments=[3, 3]))

