""".ci/run gates: a failing test in any tier (the slow ones included) makes CI fail, a tier that hangs is
killed at its limit and fails, and under CI=true a test that would skip for a missing libtpu fails.

The first three run the real .ci/run on a scratch project of four one-line tests (one per tier, selected
by the same markers as ours) with `pip` replaced by a stub on PATH, so the script's own logic — tier
selection, exit codes, the summary lines — is what is tested, in seconds. The last runs one of our real
libtpu tests with libtpu hidden (tests/conftest.py: DILOCO_TEST_HIDE_LIBTPU)."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import textwrap
import tomllib
import venv

import pytest

from conftest import REPO

TIERS = ("default", "e2e", "multiprocess", "tpu", "slurm", "learners", "gpu")
MARKS = {"default": "", "e2e": "@pytest.mark.slow", "multiprocess": "@pytest.mark.slow\n@pytest.mark.multiprocess",
         "tpu": "@pytest.mark.slow\n@pytest.mark.tpu", "slurm": "@pytest.mark.slow\n@pytest.mark.slurm",
         "learners": "@pytest.mark.slow\n@pytest.mark.learners",
         "gpu": "@pytest.mark.slow\n@pytest.mark.gpu"}


def scratch_project(tmp_path, body: dict[str, str], python: str = sys.executable):
    """A copy of .ci/run beside a pytest project with one test per tier; `body[tier]` is that test's body.
    Its bin/python runs `python` by its own path (a script, not a symlink: a venv's interpreter reached through
    a link outside the venv has no pyvenv.cfg beside it and loses the venv's packages)."""
    (tmp_path / ".ci").mkdir(parents=True)
    shutil.copy(REPO / ".ci" / "run", tmp_path / ".ci" / "run")
    addopts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    (tmp_path / "pyproject.toml").write_text(textwrap.dedent(f"""
        [tool.pytest.ini_options]
        addopts = "{addopts}"
        testpaths = ["tests"]
        markers = ["slow: slow", "multiprocess: several processes", "tpu: libtpu", "slurm: slurm", "learners: learners", "gpu: gpu"]
    """))  # our addopts: the default tier runs on pytest-xdist workers, as ours does
    (tmp_path / "tests").mkdir()
    tests = ["import os\nimport time\nimport pytest\n"]
    for t in TIERS:
        tests.append(f"{MARKS[t]}\ndef test_{t}():\n    {body.get(t, 'pass')}\n")
    (tmp_path / "tests" / "test_tiers.py").write_text("\n".join(tests))
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "pip").write_text("#!/bin/sh\necho \"stub pip $*\" >> \"$(dirname \"$0\")/pip.log\"\n")
    (bin_ / "pip").chmod(0o755)
    for stub in ("apt-get", "slurmctld"):  # the slurm tier's install step finds SLURM there already
        (bin_ / stub).write_text("#!/bin/sh\nexit 0\n")
        (bin_ / stub).chmod(0o755)
    (bin_ / "python").write_text(f"#!/bin/sh\nexec {shlex.quote(python)} \"$@\"\n")
    (bin_ / "python").chmod(0o755)
    return tmp_path


def venv_python(tmp_path) -> str:
    """An interpreter inside a venv that has our packages: the running one when it is a venv, else a bare venv
    over the running interpreter's packages (--system-site-packages, no pip: ~0.1 s)."""
    if sys.prefix != sys.base_prefix:
        return sys.executable
    venv.create(tmp_path / "venv", system_site_packages=True, with_pip=False, symlinks=True)
    return str(tmp_path / "venv" / "bin" / "python")


def ci_run(project, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "CI"))}
    e.update(PATH=f"{project / 'bin'}{os.pathsep}{os.environ['PATH']}", **env)
    return subprocess.run(["bash", str(project / ".ci" / "run")], cwd=project, env=e, capture_output=True,
                          text=True, timeout=300)


def summary(r) -> dict[str, str]:
    return {line.split()[2].rstrip(":"): line for line in r.stdout.splitlines()
            if line.startswith("ci: tier ") and ": python -m pytest" not in line}  # not the tier's header line


def test_every_tier_passing_passes_and_installs_from_the_lock(tmp_path):
    """Through a venv's interpreter, as a fresh clone's user runs it: every tier's test runs in that venv."""
    python = venv_python(tmp_path)
    prefix = subprocess.run([python, "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True,
                            check=True).stdout.strip()
    p = scratch_project(tmp_path / "project", {t: f"assert __import__('sys').prefix == {prefix!r}" for t in TIERS},
                        python)
    r = ci_run(p)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1] == "ci: passed"
    s = summary(r)
    assert list(s) == list(TIERS)
    assert all("1 passed, 0 failed, 0 skipped" in s[t] and s[t].endswith("— ok") for t in TIERS), s
    assert (p / "bin" / "pip.log").read_text() == ("stub pip install -c requirements.lock -e .[test,tpu]\n"
                                                   "stub pip install -q -c requirements.lock -e .[test,tpu,gpu-aot]\n")


@pytest.mark.parametrize("failing", [TIERS[0::2], TIERS[1::2]], ids=lambda t: "+".join(t))
def test_a_failing_test_in_any_tier_fails_ci(tmp_path, failing):
    """Every tier fails in one of the two runs, beside tiers that pass: a failing tier does not stop the
    others from running and reporting, and is reported as failed whichever it is."""
    r = ci_run(scratch_project(tmp_path, {t: "assert False, 'broken on purpose'" for t in failing}))
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1] == "ci: FAILED"
    s = summary(r)
    assert list(s) == list(TIERS)
    for t in TIERS:
        want = "FAILED (pytest exit 1)" if t in failing else "— ok"
        assert s[t].endswith(want) and ("0 passed, 1 failed" in s[t]) == (t in failing), s


def test_a_tier_that_hangs_is_killed_at_its_limit_and_fails(tmp_path):
    """A hung test in the pytest process (multiprocess) and on an xdist worker (e2e): both killed, the
    run goes on to the next tier."""
    hung = {t: tmp_path / f"hung-{t}.pid" for t in ("multiprocess", "e2e")}
    body = {t: f"open({str(f)!r}, 'w').write(str(os.getpid())); time.sleep(120)" for t, f in hung.items()}
    p = scratch_project(tmp_path / "project", body)
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "CI"))}
    e.update(PATH=f"{p / 'bin'}{os.pathsep}{os.environ['PATH']}", CI_TIER_LIMIT_S="25")  # xdist starts in < 25 s
    r = subprocess.run(["bash", str(p / ".ci" / "run"), "e2e", "multiprocess", "default"], cwd=p, env=e,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    s = summary(r)
    assert list(s) == ["e2e", "multiprocess", "default"], s
    assert all(s[t].endswith("FAILED: killed at its 25 s limit") for t in hung) and s["default"].endswith("— ok"), s
    for f in hung.values():  # the process running the hung test is gone, worker or not
        pid = int(f.read_text())
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(") ")[1][0] == "Z", pid


def test_under_ci_a_test_skipped_for_missing_libtpu_fails(tmp_path):
    """The rule of tests/conftest.py on one of our real TPU tests: with libtpu hidden (as an install without
    the `tpu` extra would be) it skips outside CI and fails under CI=true, naming what did not run."""
    test = "tests/test_compile.py::test_compile_streaming_step_for_v5e_2x2"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env["DILOCO_TEST_HIDE_LIBTPU"] = "1"
    outside = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", test], cwd=REPO, capture_output=True,
                             text=True, timeout=600, env={**env, "CI": "false"})
    assert outside.returncode == 0 and "1 skipped" in outside.stdout, outside.stdout[-2000:]
    under = subprocess.run([sys.executable, "-m", "pytest", "-q", test], cwd=REPO, capture_output=True, text=True,
                           timeout=600, env={**env, "CI": "true"})
    assert under.returncode == 1 and "1 error in" in under.stdout, under.stdout[-2000:]  # failed at its setup
    assert f"ci: did not run: {test} (" in under.stdout and "libtpu" in under.stdout
