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


def quiet_cuda_plugin() -> None:
    """The `gpu-aot` extra (the CUDA plugin, to compile for GPUs on this machine) loads CUDA libraries when
    JAX is imported and when its plugins are discovered; with no GPU each load logs "Could not find cuda
    drivers" through absl, whatever TF_CPP_MIN_LOG_LEVEL says. On such a machine both are done here, with
    the text captured (shown if they fail). Without the plugin, or with a GPU, nothing is done."""
    import glob
    import importlib.util

    if glob.glob("/dev/nvidia[0-9]*") or not any(
            importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
        return
    with native_stderr_captured():
        import jax._src.xla_bridge as xb  # public `jax` has no call that discovers plugins without a backend

        xb._discover_and_register_pjrt_plugins()


@contextlib.contextmanager
def native_stderr_captured(replay=lambda error: error is not None) -> Iterator[None]:
    """fd 2 → a temporary file for the duration; afterwards the text is shown on stderr when replay(the
    exception the block raised, or None) is true: by default only if the block raised."""
    with _LOCK, tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved, error = os.dup(2), None
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        except BaseException as e:
            error = e
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if replay(error):
                tmp.seek(0)
                sys.stderr.write(tmp.read().decode(errors="replace"))


_SILENCED: list[int] = []  # the saved fd 2 while silence_stderr holds it


def silence_stderr() -> None:
    """fd 2 → /dev/null until restore_stderr(): for the library threads still failing while a failure the
    caller will answer in one line unwinds (a full disk's checkpoint writers)."""
    if not _SILENCED:
        sys.stderr.flush()
        _SILENCED.append(os.dup(2))
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)


def restore_stderr() -> None:
    if _SILENCED:
        sys.stderr.flush()
        saved = _SILENCED.pop()
        os.dup2(saved, 2)
        os.close(saved)
