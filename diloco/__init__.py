"""diloco: Data-Parallel, DiLoCo and Streaming DiLoCo (arXiv 2501.18512) in one JAX/Flax loop."""
import glob as _glob
import os as _os
import sys as _sys

__version__ = "0.1.0"

# With libtpu installed (the `tpu` extra, for `diloco compile`), JAX probes for a TPU at start-up and
# libtpu prints several lines when there is none. On a machine with no accelerator device at all
# (no /dev/accel* or /dev/vfio of a TPU VM, no /dev/nvidia* of a GPU) the CPU is all there is: say so
# to JAX before it starts, unless the user chose platforms. `diloco compile` still reaches libtpu's
# topologies (they do not need the TPU backend).
# A notebook or script that imported JAX first has read the variable already: its config is set
# instead (it takes effect if no JAX backend has started yet, as is usual right after `import jax`).
if "JAX_PLATFORMS" not in _os.environ and not any(
        _glob.glob(p) for p in ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*")):
    _os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in _sys.modules and not _sys.modules["jax"].config.jax_platforms:
        _sys.modules["jax"].config.update("jax_platforms", "cpu")
