"""`diloco launch --processes M -- train …`: one process per replica on this machine, one JAX job.

Each child gets its place in the job from the environment and calls `jax.distributed.initialize`
before any other JAX use (train() calls `initialize_from_env()` first). Cross-process collectives
are JAX's CPU collectives over TCP (gloo), so the `replica` mesh axis really spans processes;
on a multi-host TPU pod the same code path runs with the pod's own coordinator.

  DILOCO_COORDINATOR   host:port of process 0's coordination service
  DILOCO_NUM_PROCESSES M
  DILOCO_PROCESS_ID    0 … M−1
  DILOCO_GLOO_IFACE    network interface gloo binds to (`eth0` inside scripts/netns.sh namespaces)
  DILOCO_COMM_DEVICE   1: every process gets a second CPU device that only runs the outer
                       exchange, so it overlaps with the inner steps (docs/distributed.md says why)

`--netns` runs process i inside namespace `dlrep$i` made by scripts/netns.sh (throttled links).
"""
from __future__ import annotations

import argparse
import functools
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ENV_COORD, ENV_N, ENV_ID = "DILOCO_COORDINATOR", "DILOCO_NUM_PROCESSES", "DILOCO_PROCESS_ID"
ENV_IFACE, ENV_COMM = "DILOCO_GLOO_IFACE", "DILOCO_COMM_DEVICE"
NETNS_PREFIX, NETNS_SUBNET = "dlrep", "10.77.0."


def num_processes() -> int:
    return int(os.environ.get(ENV_N, "1"))


def comm_device_enabled() -> bool:
    return num_processes() > 1 and os.environ.get(ENV_COMM, "0") == "1"


def initialize_from_env() -> bool:
    """Join the job described by the environment (idempotent). False when single-process."""
    n = num_processes()
    if n <= 1:
        return False
    import jax
    from jax._src import distributed as jdist
    from jax._src import xla_bridge

    if jdist.global_state.client is not None:
        return True
    iface = os.environ.get(ENV_IFACE)
    if iface:  # gloo otherwise binds to the hostname's address, unreachable from a namespace
        orig = xla_bridge._jax.make_gloo_tcp_collectives
        xla_bridge._jax.make_gloo_tcp_collectives = functools.partial(orig, interface=iface)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if comm_device_enabled():
        jax.config.update("jax_num_cpu_devices", 2)
    jax.distributed.initialize(os.environ[ENV_COORD], n, int(os.environ[ENV_ID]))
    return True


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
    if num_processes() <= 1:
        return True
    import jax

    return jax.process_index() == 0


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


# -- the launcher ------------------------------------------------------------------------------------
def child_env(i: int, m: int, coordinator: str, iface: str | None, comm_device: bool) -> dict[str, str]:
    env = dict(os.environ, **{ENV_COORD: coordinator, ENV_N: str(m), ENV_ID: str(i),
                              ENV_COMM: "1" if comm_device else "0"})
    if "xla_force_host_platform_device_count" in env.get("XLA_FLAGS", ""):
        env.pop("XLA_FLAGS")  # one device per process (two with comm_device), not the fake-device mesh
    if iface:
        env[ENV_IFACE] = iface
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    return env


def spawn(m: int, argv: list[str], port: int, netns: bool = False, comm_device: bool = False,
          logdir: Path | None = None) -> list[subprocess.Popen]:
    """Start M copies of `python -m diloco.cli ARGV`; rank 0 inherits stdout/stderr."""
    host = f"{NETNS_SUBNET}1" if netns else "127.0.0.1"
    logdir = Path(logdir or tempfile.mkdtemp(prefix="diloco-launch-"))
    logdir.mkdir(parents=True, exist_ok=True)
    procs = []
    for i in range(m):
        cmd = [sys.executable, "-m", "diloco.cli", *argv]
        if netns:
            cmd = ["ip", "netns", "exec", f"{NETNS_PREFIX}{i}", *cmd]
        env = child_env(i, m, f"{host}:{port}", "eth0" if netns else None, comm_device)
        out = None if i == 0 else open(logdir / f"rank{i}.log", "w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None))
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float | None = None, grace: float = 10.0,
             stopping=lambda: False, grace_stopping: float = 300.0) -> int:
    """Wait for every child; if one fails, stop the others (a collective would hang forever).

    After SIGTERM the others get `grace` seconds before they are killed, or `grace_stopping` when
    `stopping()` (a requested stop: they are saving a checkpoint together)."""
    deadline = None if timeout is None else time.time() + timeout
    rcs: dict[int, int] = {}
    while len(rcs) < len(procs):
        for i, p in enumerate(procs):
            if i not in rcs and p.poll() is not None:
                rcs[i] = p.returncode
        if any(rc != 0 for rc in rcs.values()) or (deadline and time.time() > deadline):
            for i, p in enumerate(procs):
                if i not in rcs:
                    p.send_signal(signal.SIGTERM)
            for i, p in enumerate(procs):
                if i not in rcs:
                    try:
                        rcs[i] = p.wait(grace_stopping if stopping() else grace)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        rcs[i] = p.wait()
            break
        time.sleep(0.05)
    return next((rc for rc in rcs.values() if rc != 0), 0)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: diloco launch --processes M [--netns] [--comm_device] -- train --config … --workdir …",
              file=sys.stderr)
        return 2
    cut = argv.index("--")
    ap = argparse.ArgumentParser(prog="diloco launch", description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, required=True, help="M: one process per replica")
    ap.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
    ap.add_argument("--netns", action="store_true", help="process i in namespace dlrep$i (scripts/netns.sh up M …)")
    ap.add_argument("--comm_device", action="store_true", help="a second CPU device per process for the exchange")
    ap.add_argument("--logdir", default=None, help="where ranks ≥ 1 write their output (default: a temp dir)")
    args = ap.parse_args(argv[:cut])
    if args.processes < 1:
        print(f"diloco launch: --processes {args.processes} must be ≥ 1", file=sys.stderr)
        return 2
    port = args.port or (free_port() if not args.netns else 29500 + os.getpid() % 1000)
    logdir = Path(args.logdir or tempfile.mkdtemp(prefix="diloco-launch-"))
    procs = spawn(args.processes, argv[cut + 1:], port, args.netns, args.comm_device, logdir)

    requested = []

    def forward(signum, _):  # preemption / Ctrl-C: every rank saves a checkpoint at the same step and exits
        requested.append(signum)
        print(f"diloco launch: {signal.Signals(signum).name}: asking every process to checkpoint and stop",
              file=sys.stderr)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    rc = wait_all(procs, stopping=lambda: bool(requested))
    if rc and args.processes > 1:
        print(f"diloco launch: a process failed (rc={rc}); logs of ranks ≥ 1 are in {logdir}", file=sys.stderr)
    return rc
