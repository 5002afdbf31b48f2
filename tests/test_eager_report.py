"""[EU] Tables 2 and 3 beside ours and the eager / error-feedback claims rows, from hand-made records."""
import numpy as np
import pandas as pd
import pytest

from diloco.report.claims import BY_CLAIM, SweepRows, PaperNumbers, evaluate
from diloco.report.tables import eager_table2, eager_table3


def _agg(sweep: str, rows: dict, base: str = "diloco") -> pd.DataFrame:
    """collapse()-shaped rows: point 'tiny+<row>+<base>', per-seed losses."""
    out = []
    for row, losses in rows.items():
        v = list(losses.values())
        out.append({"sweep": sweep, "point": f"tiny+{row}+{base}", "status": "done", "arg_row": row, "arg_base": base,
                    "scale": "tiny", "H": 10, "replicas": 2, "steps": 200, "fragments": 1 if base == "diloco" else 3,
                    "n": len(v), "final_eval_loss": float(np.mean(v)), "eval_loss_std": float(np.std(v, ddof=1)),
                    "losses": losses})
    return pd.DataFrame(out)


ROWS = {"none": {0: 2.0, 1: 3.0, 2: 4.0}, "naive": {0: 2.4, 1: 3.3, 2: 4.8}, "swap": {0: 2.1, 1: 3.03, 2: 4.2}}


def test_table2_rows_sit_beside_eu_with_paired_gaps():
    t = eager_table2(_agg("eager_table2_tiny", ROWS)).set_index("row")
    assert list(t.index) == ["none", "naive", "swap"]  # experiments/eager.py's order, not the records'
    assert t.loc["naive", "vs_none_pct"] == pytest.approx(np.mean([20.0, 10.0, 20.0]))  # paired per seed
    assert t.loc["naive", "paper_eval_loss"] == 3.01 and t.loc["swap", "paper_eval_loss"] == 2.69
    assert t.loc["naive", "paper_vs_none_pct"] == pytest.approx(100 * (3.01 / 2.67 - 1))
    assert t.loc["swap", "paper_setting"] == "outer_1step_eager"


def test_table3_gaps_are_to_the_same_base():
    agg = pd.concat([_agg("eager_table3_tiny", {"none": {0: 2.0, 1: 3.0}, "swap": {0: 2.02, 1: 3.03}}),
                     _agg("eager_table3_tiny", {"none": {0: 2.0, 1: 2.0}, "swap": {0: 2.1, 1: 2.1}}, "streaming")])
    t = eager_table3(agg).set_index(["base", "row"])
    assert t.loc[("diloco", "swap"), "vs_none_pct"] == pytest.approx(1.0)
    assert t.loc[("streaming", "swap"), "vs_none_pct"] == pytest.approx(5.0)
    assert t.loc[("streaming", "swap"), "paper_vs_none_pct"] == pytest.approx(100 * (2.71 / 2.67 - 1))


def test_recovered_is_the_share_of_naives_gap_that_eager_removes_per_seed():
    """seeds: naive +20/+10/+20 %, swap +5/+1/+5 % over none → recovered 75/90/75 %: mean 80 %, sd √75."""
    s = SweepRows("eager_table2", "eager_table2_tiny", _agg("eager_table2_tiny", ROWS), None)
    row = evaluate(BY_CLAIM["[EU] eager (swap) recovers most of the naive delay's loss"], s, PaperNumbers())
    assert row["ours_gap_pct"] == pytest.approx(80.0) and row["n"] == 3
    assert row["ours_sd_pct"] == pytest.approx(np.std([75.0, 90.0, 75.0], ddof=1))
    assert row["ours_ci_pct"] == pytest.approx(4.3027 * 75 ** 0.5 / 3 ** 0.5, rel=1e-4)  # t(2)·sd/√n = 21.5
    assert row["verdict"] == "agrees"  # 80 − 21.5 = 58.5 > 50 %


def test_error_feedback_claims_read_the_compression_ef_sweep():
    agg = _agg("compression_ef_tiny", {"fp32": {0: 2.0, 1: 3.0, 2: 4.0}, "int2": {0: 2.02, 1: 3.03, 2: 4.04},
                                       "int2_ef": {0: 2.0, 1: 3.0, 2: 4.0}})
    agg["point"] = ["tiny+fp32", "tiny+int2", "tiny+int2_ef"]
    s = SweepRows("compression_ef", "compression_ef_tiny", agg, None)
    helps = evaluate(BY_CLAIM["Error feedback helps 2-bit outer gradients"], s, PaperNumbers())
    assert helps["ours_gap_pct"] == pytest.approx(100 * (1 / 1.01 - 1)) and helps["verdict"] == "agrees"  # sd 0
    same = evaluate(BY_CLAIM["2-bit (int2) outer gradients = FP32"], s, PaperNumbers())
    assert same["ours_gap_pct"] == pytest.approx(1.0) and same["verdict"] == "disagrees"
