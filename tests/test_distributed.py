"""Multi-process replicas (diloco launch), throttled links (scripts/netns.sh), overlap measurement."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import REPO
from diloco import distributed as dist

TINY = ["--config.scale=tiny", "--config.seq_len=32", "--config.batch_size=4", "--config.steps=8",
        "--config.H=4", "--config.layers_per_fragment=1", "--config.tau=1", "--config.log_every=2",
        "--config.eval_every=4", "--config.eval_batches=2", "--config.checkpoint_every=100",
        "--config.optimizer.warmup_steps=2", "--no_progress"]


def test_child_env_places_each_process():
    env = dist.child_env(1, 2, "127.0.0.1:1234", "eth0", comm_device=True)
    assert env[dist.ENV_COORD] == "127.0.0.1:1234" and env[dist.ENV_N] == "2" and env[dist.ENV_ID] == "1"
    assert env[dist.ENV_IFACE] == "eth0" and env[dist.ENV_COMM] == "1"


def test_single_process_needs_no_initialize(monkeypatch):
    monkeypatch.delenv(dist.ENV_N, raising=False)
    assert dist.initialize_from_env() is False
    assert dist.compute_devices() is None and dist.comm_devices() is None and dist.is_primary()


def test_one_failing_process_stops_the_others():
    ok = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    bad = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    t0 = time.time()
    assert dist.wait_all([ok, bad]) == 3
    assert time.time() - t0 < 30 and ok.poll() is not None


def test_launch_without_separator_is_a_usage_error(capsys):
    assert dist.main(["--processes", "2"]) == 2
    assert "usage" in capsys.readouterr().err


def _run(cmd: list[str], cwd=REPO) -> subprocess.CompletedProcess:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, "-m", "diloco.cli", *cmd], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=600)


def _rows(workdir) -> list[dict]:
    return [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["streaming", "dp"])
def test_two_processes_match_one_process(tmp_path, method):
    """Same config and seed: the 2-process job logs the numbers of the 1-process run."""
    one, two = tmp_path / "one", tmp_path / "two"
    extra = [] if method == "streaming" else ["--config.replicas=2"]
    r1 = _run(["train", "--config", f"experiments/toy.py:{method}", "--workdir", str(one), *TINY, *extra])
    assert r1.returncode == 0, r1.stderr[-3000:]
    r2 = _run(["launch", "--processes", "2", "--logdir", str(tmp_path / "logs"), "--", "train", "--config",
               f"experiments/toy.py:{method}", "--workdir", str(two), *TINY, *extra])
    assert r2.returncode == 0, r2.stderr[-3000:]
    a, b = _rows(one), _rows(two)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert x["bytes_exchanged"] == y["bytes_exchanged"]
        for k in ("train_loss", "eval_loss"):
            if k in x:
                assert y[k] == pytest.approx(x[k], rel=1e-5, abs=1e-6), (k, x["step"])
    s1, s2 = (json.loads((d / "summary.json").read_text()) for d in (one, two))
    assert s2["final_eval_loss"] == pytest.approx(s1["final_eval_loss"], rel=1e-5)
    assert s2["versions"]["devices"] == 2  # the job really spans two processes


def _netns_usable() -> str | None:
    if os.geteuid() != 0:
        return "needs root for ip netns / tc"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs iproute2 (ip, tc)"
    r = subprocess.run(["ip", "netns", "add", "dltestprobe"], capture_output=True, text=True)
    if r.returncode:
        return f"ip netns add failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", "dltestprobe"], capture_output=True)
    return None


def test_netns_script_shapes_links():
    why = _netns_usable()
    if why:
        pytest.skip(why)
    script = str(REPO / "scripts" / "netns.sh")
    env = dict(os.environ, DILOCO_NETNS_PREFIX="dltest", DILOCO_NETNS_BRIDGE="dltbr0", DILOCO_NETNS_SUBNET="10.78.0")
    try:  # own names and subnet: never touches the dlrep* namespaces of a running measurement
        r = subprocess.run([script, "up", "2", "50mbit"], capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr
        st = subprocess.run([script, "status", "2"], capture_output=True, text=True, env=env).stdout
        assert "10.78.0.1/24" in st and "10.78.0.2/24" in st and "rate 50Mbit" in st
        ping = subprocess.run(["ip", "netns", "exec", "dltest0", sys.executable, "-c",
                               "import socket; s = socket.create_connection(('10.78.0.2', 9), 2)"],
                              capture_output=True, text=True, env=env)
        assert "refused" in ping.stderr.lower(), ping.stderr  # reachable: the peer answers with RST
    finally:
        subprocess.run([script, "down", "2"], capture_output=True, env=env)


def test_cross90_interpolates_in_log_rate():
    from diloco.netbench import cross90

    assert cross90([1, 10, 100], [0.5, 0.8, 1.0]) == pytest.approx(10 ** 1.5)
    assert cross90([1, 10], [0.95, 1.0]) == 1
    assert cross90([1, 10], [0.1, 0.2]) is None


def test_simulated_cu_rises_with_bandwidth_and_fp4_needs_less():
    from diloco.netbench import simulated_cu

    base = dict(layers=6, params=320512, step_time_s=0.06, H=20, fragments=2, tau=1)
    fp4 = {**base, "method": "streaming_overlap_fp4", "payload_bytes": [88988, 76280]}
    dp = {**base, "method": "dp", "fragments": 1, "tau": 0, "payload_bytes": [641024]}
    cus = [simulated_cu(fp4, g) for g in (1e-3, 1e-2, 1e-1)]
    assert cus == sorted(cus) and cus[-1] > 0.99
    assert simulated_cu(dp, 1e-2) < simulated_cu(fp4, 1e-2)


@pytest.mark.slow
def test_netbench_throughput_on_loopback(tmp_path):
    out = tmp_path / "tp.json"
    r = _run(["launch", "--processes", "2", "--", "netbench", "throughput", "--mb", "1", "--repeats", "2",
              "--out", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["processes"] == 2 and res["mbit_per_s"] > 0
