"""diloco tables from the records of real tiny runs (DP, DiLoCo, Streaming DiLoCo), made by the sweep."""
import json
import math

import pandas as pd
import pytest

from diloco import report, sweep as sw

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
    files = report.build(runs, tmp_path / "out", quiet=True)
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
    assert set(res) == {"first_replica", "replica_average", "outer_params", "drained_fragments"}
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
    import shutil

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


def md_rows(md: str) -> list[list[str]]:
    """The cells of a pipe table, header first, the alignment row dropped."""
    rows = [[c.strip() for c in l.strip().strip("|").split("|")] for l in md.splitlines() if l.startswith("|")]
    assert set("".join(rows[1])) <= set(":-"), rows[1]
    return [rows[0]] + rows[2:]


def test_markdown_table_cells_are_formatted_once():
    df = pd.DataFrame({"method": ["dp", "streaming_ovl_fp4_h30"], "loss": [3.14159, float("nan")],
                       "bytes": [2e7, 1234.0], "tiny": [0.0001234, 150.25]})
    assert md_rows(report.markdown(df)) == [["method", "loss", "bytes", "tiny"],
                                            ["dp", "3.1416", "20000000", "0.0001234"],
                                            ["streaming_ovl_fp4_h30", "", "1234", "150.2"]]
    assert report.markdown(df.iloc[:0]) == "_(no runs)_\n"


# -- seeds, merging, claims: from hand-written run records (no training) --------------------------------
def _record(root, sweep, point, spec, loss, seed=0, finished=None, sweep_file="sweeps/c4_scaling.py", arg="tiny",
            **cfg_over):
    from diloco.config import load_config

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
    # 3.33 ± 3.33 is not a difference (|gap| must exceed its uncertainty); n < 2 never is
    assert report.is_difference(10 / 3, 2 * math.sqrt(25 / 3) / math.sqrt(3)) is False
    assert report.is_difference(5.0, 1.0) is True and report.is_difference(5.0, float("nan")) is None
    assert report.verdict(0.3, 0.2, -1, 1) == "agrees" and report.verdict(3.0, 0.5, -1, 1) == "disagrees"
    assert report.verdict(0.9, 0.5, -1, 1) == "inconclusive" and report.verdict(0.1, float("nan"), -1, 1).startswith("inconclusive")


def test_regenerating_from_fewer_records_drops_no_table_or_row(tmp_path):
    """A fresh clone's reproduce: the root holds only some of the runs behind the committed tables."""
    from diloco import reproduce

    full, part, out = tmp_path / "full", tmp_path / "part", tmp_path / "out"
    for scale in ("tiny", "toy"):
        _record(full, "c4_scaling_tiny+toy", f"{scale}+dp", f"experiments/c4_scaling.py:{scale},dp", 2.5)
        _record(full, "c4_scaling_tiny+toy", f"{scale}+streaming_ovl_fp4_h30",
                f"experiments/c4_scaling.py:{scale},streaming_ovl_fp4_h30", 2.6)
    _record(full, "tau_alpha_tiny", "tau=0,alpha=0.0", "experiments/ablate_tau.py:tiny", 2.7,
            sweep_file="sweeps/tau_alpha.py")
    report.build(full, out, quiet=True)
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
    assert "2 row(s) kept from the committed table" in (out / "table5_c4_scaling.md").read_text()
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["table5_c4_scaling"]["runs"] == 2 and prov["table5_c4_scaling"]["rows_kept_from_committed"] == 2
    # a number that changes at the printed precision is reported
    part2 = tmp_path / "part2"
    _record(part2, "c4_scaling_tiny+toy", "tiny+dp", "experiments/c4_scaling.py:tiny,dp", 2.50004)
    report.build(part2, out, quiet=True)
    assert report.build.changed == []  # 2.5 vs 2.50004: the same 4 printed decimals
    part3 = tmp_path / "part3"
    _record(part3, "c4_scaling_tiny+toy", "tiny+dp", "experiments/c4_scaling.py:tiny,dp", 2.5123)
    report.build(part3, out, quiet=True)
    assert report.build.changed == ["table5_c4_scaling: tiny, data_parallel, 2: 2.5 → 2.5123"]


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
    for scale in ("tiny", "toy"):  # the quick budget's runs too: their trend is not the row any more
        for m, loss in (("dp", 2.0), ("streaming_ovl_fp4_h30", 2.2)):
            _record(root, "c4_scaling_tiny+toy", f"{scale}+{m}", f"experiments/c4_scaling.py:{scale},{m}", loss,
                    arg="tiny+toy")
    report.build(root, tmp_path / "out", quiet=True)
    c = pd.read_csv(tmp_path / "out" / "claims.csv")
    (row,) = c[c.claim.str.startswith("The gap to DP shrinks")].itertuples()
    assert row.runs == "claims_headline_tiny + claims_headline_toy" and row.n == 2
    assert math.isclose(row.ours_gap_pct, 2.0, rel_tol=1e-9)
    # then `diloco reproduce` (the quick budget only) into the same out/: it regenerates the quick budget's
    # trend as its own row (tiny 10 %, toy 10 %: 0 pp) and keeps the claims budget's row it cannot remake
    quick = tmp_path / "quick"
    for scale in ("tiny", "toy"):
        for m, loss in (("dp", 2.0), ("streaming_ovl_fp4_h30", 2.2)):
            _record(quick, "c4_scaling_tiny+toy", f"{scale}+{m}", f"experiments/c4_scaling.py:{scale},{m}", loss,
                    arg="tiny+toy")
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
    ± 2·sd/√2 = 1.0: [2.5, 4.5] lies in the band [+1 %, ∞) → agrees.
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
    assert math.isclose(row.ours_gap_pct, 3.5, rel_tol=1e-9) and math.isclose(row.ours_unc_pct, 1.0, rel_tol=1e-9)
    assert row.verdict == "agrees" and row.n == 2
    t = pd.read_csv(tmp_path / "out" / "table3_outer_lr.csv").set_index("outer_lr")
    assert sorted(t.index) == [0.4, 1.0] and (t.n == 2).all() and (t.alpha == 0.5).all()
    r = t.loc[0.4]
    assert math.isclose(r.first_vs_avg_pct, 2.0, rel_tol=1e-9) and math.isclose(r.first_vs_avg_pct_unc, 2.0, rel_tol=1e-9)
    assert math.isclose(r.first_vs_outer_pct, (1.0 + 100 * (3.09 / 3.03 - 1)) / 2, rel_tol=1e-9)
    assert math.isclose(r.avg_vs_outer_pct, 100 * (3.00 / 3.03 - 1) / 2, rel_tol=1e-9)
    assert math.isclose(r.outer_params, (2.00 + 3.03) / 2, rel_tol=1e-9)
