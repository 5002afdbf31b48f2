"""Start-up noise of the libraries under us, silenced by the project rather than by the user.

TensorFlow's native code logs through absl before anything can configure it ("oneDNN custom
operations are on", "Could not find cuda drivers", "All log messages before absl::InitializeLog()"),
whatever TF_CPP_MIN_LOG_LEVEL says. `native_stderr_captured` points file descriptor 2 at a temporary
file while such a library is imported; the text is shown only if the import fails.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
from typing import Iterator

_LOCK = threading.Lock()


def quiet_environment() -> None:
    """Defaults (a user's own setting wins) read by TensorFlow and gRPC when they load."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


@contextlib.contextmanager
def native_stderr_captured() -> Iterator[None]:
    """fd 2 → a temporary file for the duration; replayed on stderr if the block raises."""
    with _LOCK, tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            tmp.seek(0)
            sys.stderr.write(tmp.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)

