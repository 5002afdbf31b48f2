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
