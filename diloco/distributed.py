"""The runtime side of a job of several processes: joining it, which devices and rows are this
process's, and the helpers the loop uses to move arrays between processes (`diloco launch`, which
starts the processes, is diloco/launch.py).

Each child gets its place in the job from the environment and calls `jax.distributed.initialize`
before any other JAX use (train() calls `initialize_from_env()` first). Cross-process collectives
are JAX's CPU collectives over TCP (gloo), so the `replica` mesh axis really spans processes;
on a multi-host TPU pod the same code path runs with the pod's own coordinator. Inside an srun step
of several tasks (diloco/slurm.py) srun's variables place the process instead of these:

  DILOCO_COORDINATOR   host:port of process 0's coordination service
  DILOCO_NUM_PROCESSES M
  DILOCO_PROCESS_ID    0 … M−1
  DILOCO_GLOO_IFACE    network interface gloo binds to (`eth0` inside scripts/netns.sh namespaces)
  DILOCO_COMM_DEVICE   1: every process gets a second CPU device that only runs the outer
                       exchange, so it overlaps with the inner steps (docs/distributed.md says why)
  DILOCO_CPU_DEVICES   K: CPU devices per process (`--devices_per_process K`, jax_num_cpu_devices)
  DILOCO_LOCAL_DEVICE_IDS  0,1,…: the GPUs this process drives; `task`: GPU SLURM_LOCALID (one per process)
  DILOCO_SLURM_PORT    the coordinator's port inside an srun step (default: from the job id, as JAX does)
  DILOCO_DISTRIBUTED   auto: a TPU pod (set by `diloco sweep --launch tpu`); also detected from the
                       multislice variables (MEGASCALE_COORDINATOR_ADDRESS) or TPU_WORKER_HOSTNAMES
                       with more than one host: `jax.distributed.initialize()` with no arguments

Once the job is joined, every answer (how many processes, which one is this) comes from JAX.
"""
from __future__ import annotations

import functools
import os
import re
from typing import Any

ENV_COORD, ENV_N, ENV_ID = "DILOCO_COORDINATOR", "DILOCO_NUM_PROCESSES", "DILOCO_PROCESS_ID"
ENV_IFACE, ENV_COMM = "DILOCO_GLOO_IFACE", "DILOCO_COMM_DEVICE"
ENV_CPU_DEVICES, ENV_AUTO = "DILOCO_CPU_DEVICES", "DILOCO_DISTRIBUTED"
ENV_LOCAL_DEVICES = "DILOCO_LOCAL_DEVICE_IDS"
_joined = False  # set once jax.distributed.initialize() has run in this process


def num_processes() -> int:
    """jax.process_count() once the job is joined; before that what the environment announces."""
    if _joined:
        import jax

        return jax.process_count()
    return int(os.environ.get(ENV_N, "1"))


def process_index() -> int:
    if _joined:
        import jax

        return jax.process_index()
    return int(os.environ.get(ENV_ID, "0"))


def comm_device_enabled() -> bool:
    return int(os.environ.get(ENV_N, "1")) > 1 and os.environ.get(ENV_COMM, "0") == "1"


def tpu_pod_env(env=None) -> bool:
    """A multi-host TPU job whose coordinator JAX finds by itself (no DILOCO_* placement)."""
    env = os.environ if env is None else env
    if env.get(ENV_AUTO, "").lower() in ("auto", "1", "tpu"):
        return True
    if env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return True
    hosts = (env.get("TPU_WORKER_HOSTNAMES") or env.get("TPU_PROCESS_ADDRESSES") or "").split(",")
    # several hosts; libtpu writes a "WARNING: could not determine …" sentence there off a TPU VM
    return len(hosts) > 1 and all(h.strip() and " " not in h.strip() for h in hosts)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: "gpu[07-09,12],cpu1" -> "gpu07"."""
    head = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?", nodelist.strip())
    prefix, ranges = head.group(1), head.group(2)
    return prefix + (ranges.split(",")[0].split("-")[0] if ranges else "")


def slurm_placement(env) -> dict[str, str]:
    """srun's placement of this process as DILOCO_* variables; {} outside an srun step of several
    tasks, or when DILOCO_* variables already place it (`diloco launch`)."""
    need = ("SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_STEP_NODELIST", "SLURM_JOB_ID")
    if ENV_N in env or not all(k in env for k in need) or int(env["SLURM_STEP_NUM_TASKS"]) <= 1:
        return {}
    port = env.get("DILOCO_SLURM_PORT") or str(int(env["SLURM_JOB_ID"]) % 4096 + 61440)
    return {ENV_COORD: f"{first_host(env['SLURM_STEP_NODELIST'])}:{port}", ENV_N: env["SLURM_STEP_NUM_TASKS"],
            ENV_ID: env["SLURM_PROCID"]}


def local_device_ids(env) -> list[int] | None:
    """DILOCO_LOCAL_DEVICE_IDS as JAX's `local_device_ids` (None: JAX's default)."""
    v = env.get(ENV_LOCAL_DEVICES, "").strip()
    if not v:
        return None
    return [int(env["SLURM_LOCALID"])] if v == "task" else [int(x) for x in v.split(",")]


def initialize_from_env() -> bool:
    """Join the job described by the environment (idempotent). False when single-process.

    `diloco launch` (DILOCO_* variables, CPU collectives over gloo) and a TPU pod (JAX's own cluster
    detection) both end in `jax.distributed.initialize`; afterwards num_processes()/is_primary()
    answer from JAX."""
    global _joined
    os.environ.update(slurm_placement(os.environ))
    n = int(os.environ.get(ENV_N, "1"))
    if _joined:
        return True
    import jax

    if n <= 1:
        if os.environ.get(ENV_CPU_DEVICES):
            jax.config.update("jax_num_cpu_devices", int(os.environ[ENV_CPU_DEVICES]))
        if tpu_pod_env():
            jax.distributed.initialize()
            _joined = True
        return _joined
    from jax._src import distributed as jdist
    from jax._src import xla_bridge

    if jdist.global_state.client is not None:
        _joined = True
        return True
    iface = os.environ.get(ENV_IFACE)
    if iface:  # gloo otherwise binds to the hostname's address, unreachable from a namespace
        orig = xla_bridge._jax.make_gloo_tcp_collectives
        xla_bridge._jax.make_gloo_tcp_collectives = functools.partial(orig, interface=iface)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if comm_device_enabled():
        jax.config.update("jax_num_cpu_devices", 2)
    else:
        # One program at a time per process (not with a comm device: its exchange must run beside the
        # step): with async dispatch XLA:CPU may start a program while the previous one still waits
        # in a collective, and the two can meet other processes' collectives in a different order
        # (seen: a hang with data/fsdp axes spanning processes).
        jax.config.update("jax_cpu_enable_async_dispatch", False)
        if os.environ.get(ENV_CPU_DEVICES):
            jax.config.update("jax_num_cpu_devices", int(os.environ[ENV_CPU_DEVICES]))
    jax.distributed.initialize(os.environ[ENV_COORD], n, int(os.environ[ENV_ID]),
                               local_device_ids=local_device_ids(os.environ))
    _joined = True
    return True


ENV_FIRST_CALL_TIMEOUT = "DILOCO_FIRST_CALL_TIMEOUT_S"
_first_calls = 0  # programs first called so far in this process: the same order in every process (SPMD)


class AlignedFirstCall:
    """A jitted program whose first call in a multi-process CPU job compiles it, then waits for every
    process at a barrier of JAX's coordination service, then runs it; every later call is the program's.

    Why: XLA:CPU's gloo collectives set up a communicator at the first collective of each group of
    devices, and give up when the processes arrive there more than 30 s apart (`Gloo context
    initialization failed: … GetKeyValue() timed out … 29.99s`; not configurable from JAX). On a loaded
    machine one process can compile a program 30 s later than another: seen here as `diloco launch
    --processes 4` failing at its first step. The barrier waits DILOCO_FIRST_CALL_TIMEOUT_S (default
    1800 s), so only the compile's skew moves into it. On one process or a TPU pod: the program as is.
    `jit(f).lower(…).compile()` fills the same in-memory cache the call then uses (nothing compiles twice)."""

    def __init__(self, fn, name: str):
        self.fn, self.name, self.aligned = fn, name, False

    def __getattr__(self, attr):  # .lower, .eval_shape, … of the jitted program
        return getattr(self.fn, attr)

    def __call__(self, *args, **kwargs):
        if not self.aligned:
            self.aligned = True
            import jax

            if jax.process_count() > 1 and jax.default_backend() == "cpu":
                from jax._src import distributed as jdist

                global _first_calls
                _first_calls += 1
                self.fn.lower(*args, **kwargs).compile()
                timeout_s = float(os.environ.get(ENV_FIRST_CALL_TIMEOUT, "1800"))
                jdist.global_state.client.wait_at_barrier(f"diloco-first-call-{_first_calls}-{self.name}",
                                                          int(timeout_s * 1000))
        return self.fn(*args, **kwargs)


def aligned_jit(fun, name: str, **jit_kwargs) -> AlignedFirstCall:
    """`jax.jit(fun, **jit_kwargs)` in an AlignedFirstCall (name: in the barrier's id, says which program waited)."""
    import jax

    return AlignedFirstCall(jax.jit(fun, **jit_kwargs), name)


def _by_process() -> list[list[Any]]:
    import jax

    devs = jax.devices()
    return [sorted((d for d in devs if d.process_index == i), key=lambda d: d.id)
            for i in range(jax.process_count())]


def compute_devices() -> list | None:
    """Devices the trainer's mesh uses: None (all of them) unless a comm device is reserved."""
    if not comm_device_enabled():
        return None
    return [ds[0] for ds in _by_process()]


def comm_devices() -> list | None:
    """One device per process that runs only the outer exchange (None: no separate device)."""
    if not comm_device_enabled():
        return None
    return [ds[-1] for ds in _by_process()]


def is_primary() -> bool:
    """Process 0 writes the run records; the others only compute."""
    return process_index() == 0


def device_grid(devices: list, shape: tuple[int, ...]):
    """The (replica, data, fsdp, tensor) array of devices for the trainer's mesh. One slice: the devices in
    order (process-major, so a process's devices are neighbours, and a tensor group is consecutive devices). Several slices (device.slice_index):
    JAX's hybrid mesh, the slices along `replica` (ICI inside a slice, DCN only between replicas);
    when the replicas are fewer than the slices (DP) along `data`, then `fsdp`."""
    import numpy as np

    slices = sorted({getattr(d, "slice_index", 0) or 0 for d in devices})
    if len(slices) <= 1:
        return np.array(devices).reshape(shape)
    from jax.experimental import mesh_utils

    S = len(slices)
    axis = slice_axis(shape, S)
    dcn = tuple(S if i == axis else 1 for i in range(len(shape)))
    ici = tuple(n // S if i == axis else n for i, n in enumerate(shape))
    return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices, allow_split_physical_axes=True)


def slice_axis(shape: tuple[int, ...], slices: int) -> int:
    """The mesh axis that spans the slices: the first of (replica, data, fsdp) divisible by their count
    (never `tensor`: its collectives run inside every sublayer)."""
    from diloco.errors import ConfigError

    axis = next((i for i in range(min(3, len(shape))) if shape[i] % slices == 0), None)
    if axis is None:
        raise ConfigError("replicas", f"the mesh (replica, data, fsdp)={shape} has no axis divisible by the {slices} "
                          "slices; use a number of replicas divisible by the slice count")
    return axis


def check_processes(replicas: int, n: int | None = None) -> None:
    """Each of the n processes (default: this job's) holds whole replicas, or a part of exactly one
    (a ConfigError otherwise)."""
    from diloco.errors import ConfigError

    n = num_processes() if n is None else n
    if n > 1 and replicas % n and n % replicas:
        good = sorted({d for d in range(1, replicas + 1) if replicas % d == 0} | {replicas * 2, replicas * 4})
        raise ConfigError("replicas", f"{n} processes do not divide replicas={replicas} (nor the other way round): "
                          f"a process must hold whole replicas or part of one; use {good} processes or change replicas")


def allgather(x) -> "Any":
    """Every process's numpy value `x` (same shape everywhere), stacked on a new leading axis."""
    import numpy as np

    if num_processes() <= 1:
        return np.asarray(x)[None]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray(x), tiled=False))


def global_batch(local, rows, sharding, shape: tuple[int, int, int]):
    """The (R, B, L) global batch from this process's rows only: `local[i]` is flattened row `rows[i]`."""
    import jax
    import numpy as np

    R, b, L = shape
    pos = {int(g): i for i, g in enumerate(rows)}

    def piece(idx):
        sel = [pos[r * b + j] for r in range(R)[idx[0]] for j in range(b)[idx[1]]]
        return np.asarray(local)[sel].reshape(len(range(R)[idx[0]]), len(range(b)[idx[1]]), L)[..., idx[2]]

    return jax.make_array_from_callback(shape, sharding, piece)


def to_host(x) -> "Any":
    """numpy value of a (possibly cross-process) array; a collective when not fully addressable."""
    import numpy as np

    if getattr(x, "is_fully_addressable", True) or getattr(x, "is_fully_replicated", False):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def local_rows(x) -> dict[int, Any]:
    """{row: value} of a 1-D array's rows held by this process (blocks on local work only)."""
    import numpy as np

    out: dict[int, Any] = {}
    for s in x.addressable_shards:
        start = (s.index[0].start or 0) if s.index else 0
        for i, v in enumerate(np.asarray(s.data).reshape(-1)):
            out.setdefault(start + i, v)
    return out


def global_array(x_np, sharding):
    """Global array from a host value that every process holds whole (same seed, same data)."""
    import jax

    return jax.make_array_from_callback(x_np.shape, sharding, lambda idx: x_np[idx])


def gather_window(window: list, mesh, stop_local: bool | None = None):
    """([(t, ce_R, finite_R)] as host values, whether any process is stopping).

    Across processes: one all-gather for the whole window, and with `stop_local` not None one
    more for every process's stop flag."""
    import numpy as np

    if num_processes() <= 1:
        return [(t, np.asarray(ce), np.asarray(fin)) for t, ce, fin in window], bool(stop_local)
    rows = []
    if window:
        ce_W, fin_W = stack_window()([w[1] for w in window], [w[2] for w in window])
        ce_W, fin_W = to_host(ce_W), to_host(fin_W)
        rows = [(t, ce_W[i], fin_W[i]) for i, (t, _, _) in enumerate(window)]
    if stop_local is None:
        return rows, False
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    n = mesh.devices.size  # one slot per device; each process fills its own devices' slots
    flags = jax.make_array_from_callback((n,), NamedSharding(mesh, P(mesh.axis_names)),
                                         lambda idx: np.full(np.empty(n)[idx].shape, stop_local, bool))
    return rows, bool(to_host(flags).any())


@functools.cache
def stack_window():
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda c, f: (jnp.stack(c), jnp.stack(f)))
