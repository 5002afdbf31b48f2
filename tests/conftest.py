import atexit
import os
import sys
from pathlib import Path

# Implicit rank promotion (adding a (D,) array to a (B, L, D) one) is an error in the tests, here and in
# the subprocesses they start (nanodo's guard for vmapped code: a missing replica axis would broadcast
# silently). Set before anything imports jax; the code broadcasts explicitly.
os.environ.setdefault("JAX_NUMPY_RANK_PROMOTION", "raise")

import pytest  # noqa: E402

from standin.fixtures import gcs, gcs_emulator, standin  # noqa: F401  (the Cloud TPU / GCS stand-in)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# Many tests compile the same tiny-model functions in fresh Trainers: share compilations through
# JAX's persistent cache (also inherited by the subprocesses tests start).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.environ.get("TMPDIR", "/tmp"), "diloco-test-jax-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

# Under CI (CI=true, as .ci/run sets it) a test that would skip because libtpu or ../shared is missing
# FAILS instead: those skips would leave claims unchecked while the suite stays green. A skip counts as
# one of them when its reason names libtpu or the shared folder. DILOCO_TEST_HIDE_LIBTPU=1 makes
# `import libtpu` fail in this process, as an install without the `tpu` extra would (to check the rule).
CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
MUST_RUN_IN_CI = ("libtpu", str(SHARED), "../shared", "slurm-wlm", "jax-cuda12-plugin")
if os.environ.get("DILOCO_TEST_HIDE_LIBTPU") == "1":
    sys.modules["libtpu"] = None  # import fails; importlib.util.find_spec("libtpu") is None
_CI_SKIPS: list[tuple[str, str]] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    rep = (yield).get_result()
    if CI and rep.skipped and not hasattr(rep, "wasxfail"):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        if any(m in reason for m in MUST_RUN_IN_CI):
            rep.outcome = "failed"
            rep.longrepr = f"{item.nodeid} would skip ({reason}): under CI=true that is a failure"
            rep.user_properties.append(("ci_skip", reason))  # travels with the report to xdist's controller


def pytest_runtest_logreport(report):
    """Collects the CI-skip failures where the summary is written: in this process, or in the xdist
    controller, which sees every worker's reports (the makereport above runs in the worker)."""
    _CI_SKIPS.extend((report.nodeid, v) for k, v in report.user_properties if k == "ci_skip")


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: the `tpu` tier follows from the need itself
def pytest_collection_modifyitems(config, items):
    for item in items:
        if any("libtpu" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.tpu)
        if any("jax-cuda12-plugin" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.gpu)  # CI's gpu tier installs the plugin (the gpu-aot extra)


def pytest_terminal_summary(terminalreporter):
    if _CI_SKIPS:
        terminalreporter.section("tests that would have skipped under CI")
        for nodeid, reason in _CI_SKIPS:
            terminalreporter.write_line(f"ci: did not run: {nodeid} ({reason})")
        terminalreporter.write_line(f"ci: {len(_CI_SKIPS)} test(s) skipped for a missing libtpu or ../shared; "
                                    "CI=true counts them as failures")

# After the summary, the interpreter's teardown of everything the session built (thousands of XLA
# executables, TensorFlow's runtime) took a minute. When pytest is the program, leave right after
# the last atexit handler registered after this one (JAX, orbax, tensorboardX) with pytest's status.
_STATUS: dict[str, int] = {}


def pytest_sessionfinish(session, exitstatus):
    if Path(sys.argv[0]).name in ("pytest", "py.test") or sys.argv[0].endswith(os.path.join("pytest", "__main__.py")):
        _STATUS["exit"] = int(exitstatus)


def _leave_now() -> None:
    if "exit" in _STATUS and os.environ.get("DILOCO_TEST_SLOW_EXIT") != "1":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_STATUS["exit"])


atexit.register(_leave_now)


@pytest.fixture
def shared_dir() -> Path:
    if not (SHARED / "data").is_dir():
        pytest.skip(f"needs the sample data in {SHARED}/data (present beside the repo in CI and dev)")
    return SHARED


def tiny_config(method: str = "diloco", **overrides):
    """The toy spec shrunk for unit tests: tiny scale, short sequences."""
    from diloco.config import load_config

    flat = {"scale": "tiny", "seq_len": 32, "batch_size": 4, "steps": 6, "log_every": 2, "eval_every": 3,
            "eval_batches": 2, "checkpoint_every": 3, "optimizer.warmup_steps": 2}
    flat.update(overrides)
    return load_config(f"experiments/toy.py:{method}", [f"--config.{k}={v}" for k, v in flat.items()])
