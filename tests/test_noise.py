"""No start-up noise: native libraries' lines are captured by the project, not left to the user."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "GRPC_VERBOSITY")}
ENV["PYTHONPATH"] = str(REPO)


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=ENV, check=True)


def test_native_stderr_is_captured_and_replayed_only_when_the_import_fails():
    r = run("import os\n"
            "from diloco.noise import native_stderr_captured\n"
            "with native_stderr_captured():\n"
            "    os.write(2, b'chatty native library\\n')\n"
            "try:\n"
            "    with native_stderr_captured():\n"
            "        os.write(2, b'why it failed\\n')\n"
            "        raise ImportError('boom')\n"
            "except ImportError:\n"
            "    pass\n"
            "os.write(2, b'after\\n')\n")
    assert r.stderr == "why it failed\nafter\n"


@pytest.mark.slow  # a cold TensorFlow import: 10-40 s on 2 shared cores
def test_loading_tensorflow_and_seqio_prints_nothing():
    """TensorFlow's oneDNN / CUDA / absl::InitializeLog lines, which ignore TF_CPP_MIN_LOG_LEVEL."""
    r = run("import sys\n"
            "from diloco.data import tasks\n"
            "v = tasks.get_vocabulary('byte')\n"
            "print(type(v).__name__, 'tensorflow' in sys.modules)\n")
    assert r.stdout == "ByteVocabulary True\n" and r.stderr == ""
