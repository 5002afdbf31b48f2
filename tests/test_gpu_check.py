"""scripts/gpu_check.sh, the device check of one NVIDIA GPU (#41): its comparison logic, and its CPU-only dry mode
end to end (every phase, the same code path the GPU run takes, with the CPU standing in for the GPU)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402


def write_run(d: Path, losses: dict[int, float], evals: dict[int, float], sha: str = "a") -> Path:
    d.mkdir(parents=True)
    rows = [{"step": s, "train_loss": v, **({"eval_loss": evals[s]} if s in evals else {})} for s, v in losses.items()]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "summary.json").write_text(json.dumps({"final_eval_loss": evals[max(evals)], "params_sha256": sha}))
    return d


def test_compare_pair_takes_the_worst_row_of_train_and_eval(tmp_path):
    """Hand-computed: |Δ train| at steps 10, 20 = 0.004, 0.003 → 0.004; |Δ eval| at 20 = 0.02 → out of the 0.01 bound;
    steps only one side logged (30) are not compared."""
    g = write_run(tmp_path / "g", {10: 3.000, 20: 2.500, 30: 2.0}, {20: 2.60})
    c = write_run(tmp_path / "c", {10: 3.004, 20: 2.497}, {20: 2.58}, sha="b")
    r = gpu_check.compare_pair(g, c)
    assert r["steps_compared"] == 2
    assert r["max_abs_train_loss_diff"] == pytest.approx(0.004)
    assert r["max_abs_eval_loss_diff"] == pytest.approx(0.02)
    assert r["within_bound"] is False and r["params_sha256_equal"] is False
    near = write_run(tmp_path / "n", {10: 3.001, 20: 2.5}, {20: 2.595})
    assert gpu_check.compare_pair(g, near)["within_bound"] is True


@pytest.mark.slow
def test_dry_mode_runs_every_phase_and_cpu_matches_itself_exactly(tmp_path):
    """`gpu_check.sh --dry`: the five files, both toy sides on the CPU give identical losses (a GPU-vs-CPU gap on the
    device is then the platform's, not the check's), and the bench measured DP (1 replica) and Streaming (2)."""
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    p = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sorted(f.name for f in out.iterdir()) == ["bench.jsonl", "env.txt", "log.txt", "toy_compare.json",
                                                     "verdict.txt"]
    log = (out / "log.txt").read_text()
    for phase in ("setup", "env", "toy", "compare", "bench-dp", "bench-streaming", "verdict"):
        assert f"== phase {phase}: ok" in log, log[-3000:]
    cmp = json.loads((out / "toy_compare.json").read_text())
    for m in ("dp", "diloco", "streaming"):
        r = cmp["methods"][m]
        assert r["steps_compared"] >= 4 and r["eval_rows"] >= 1, r
        assert r["max_abs_train_loss_diff"] == 0 and r["max_abs_eval_loss_diff"] == 0 and r["params_sha256_equal"], r
    rows = [json.loads(x) for x in (out / "bench.jsonl").read_text().splitlines()]
    assert [r["replicas"] for r in rows] == [1, 2]
    for r in rows:
        assert r["ms_per_step"] > 0 and r["compiled_memory"]["predicted_peak"] > 0 and r["model_flops_per_step"] > 0
    verdict = (out / "verdict.txt").read_text()
    assert verdict.count("PASS toy") == 3 and "FAIL" not in verdict and "NOT RUN" not in verdict, verdict
    assert "pkg jax " in (out / "env.txt").read_text()
