"""`diloco launch --processes M -- train …`: one process per replica on this machine, one JAX job.

The spawner: it starts M copies of `python -m diloco.cli ARGV`, each with its place in the job in
the environment (the variables and how a child joins: diloco/distributed.py), waits for them, and
stops them all when one fails. `--netns` runs process i inside namespace `dlrep$i` made by
scripts/netns.sh (throttled links).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from diloco.distributed import (ENV_AUTO, ENV_COMM, ENV_COORD, ENV_CPU_DEVICES, ENV_ID, ENV_IFACE, ENV_LOCAL_DEVICES,
                                ENV_N)

NETNS_PREFIX, NETNS_SUBNET = "dlrep", "10.77.0."


def child_env(i: int, m: int, coordinator: str, iface: str | None, comm_device: bool,
              devices_per_process: int = 1, gpus: int = 0) -> dict[str, str]:
    env = dict(os.environ, **{ENV_COORD: coordinator, ENV_N: str(m), ENV_ID: str(i),
                              ENV_COMM: "1" if comm_device else "0"})
    if gpus:  # process i drives its own G/M of the machine's GPUs
        k = gpus // m
        env[ENV_LOCAL_DEVICES] = ",".join(str(g) for g in range(i * k, (i + 1) * k))
    env.pop(ENV_AUTO, None)
    if "xla_force_host_platform_device_count" in env.get("XLA_FLAGS", ""):
        env.pop("XLA_FLAGS")  # devices per process come from DILOCO_CPU_DEVICES, not the fake-device mesh
    if devices_per_process > 1:
        env[ENV_CPU_DEVICES] = str(devices_per_process)
    else:
        env.pop(ENV_CPU_DEVICES, None)
    if iface:
        env[ENV_IFACE] = iface
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    return env


def spawn(m: int, argv: list[str], port: int, logdir: Path, netns: bool = False, comm_device: bool = False,
          devices_per_process: int = 1, gpus: int = 0) -> list[subprocess.Popen]:
    """Start M copies of `python -m diloco.cli ARGV`; rank 0 inherits stdout/stderr, ranks ≥ 1 write logdir."""
    host = f"{NETNS_SUBNET}1" if netns else "127.0.0.1"
    logdir.mkdir(parents=True, exist_ok=True)
    procs = []
    for i in range(m):
        cmd = [sys.executable, "-m", "diloco.cli", *argv]
        if netns:
            cmd = ["ip", "netns", "exec", f"{NETNS_PREFIX}{i}", *cmd]
        env = child_env(i, m, f"{host}:{port}", "eth0" if netns else None, comm_device, devices_per_process, gpus)
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


def gpu_count() -> int:
    """GPUs on this machine (`nvidia-smi -L`, within CUDA_VISIBLE_DEVICES when set); 0 without any."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


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
    ap.add_argument("--devices_per_process", type=int, default=1, help="CPU devices per process (a host's chips)")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to split among the processes (default: "
                    "this machine's, nvidia-smi -L); each process drives G/M of them")
    ap.add_argument("--logdir", default=None, help="where ranks ≥ 1 write their output (default: a temp dir)")
    args = ap.parse_args(argv[:cut])
    if args.processes < 1:
        print(f"diloco launch: --processes {args.processes} must be ≥ 1", file=sys.stderr)
        return 2
    if args.devices_per_process < 1 or (args.comm_device and args.devices_per_process != 1):
        print(f"diloco launch: --devices_per_process {args.devices_per_process} must be ≥ 1 (and 1 with "
              "--comm_device)", file=sys.stderr)
        return 2
    gpus = gpu_count() if args.gpus is None else args.gpus
    if gpus < 0 or (gpus and gpus % args.processes):
        print(f"diloco launch: --gpus {gpus} cannot be split among {args.processes} processes; give a multiple of "
              f"--processes (or --gpus 0 for CPU devices)", file=sys.stderr)
        return 2
    if args.comm_device and gpus:
        print(f"diloco launch: --comm_device gives each process a CPU device of its own for the exchange; with "
              f"{gpus} GPUs it would take a GPU from training instead (the same GPU at one per process). On GPUs the "
              "exchange rides on the next step's program (exchange=auto → in_step): drop --comm_device, or give "
              "--gpus 0 for CPU devices", file=sys.stderr)
        return 2
    port = args.port or (free_port() if not args.netns else 29500 + os.getpid() % 1000)
    logdir = Path(args.logdir or tempfile.mkdtemp(prefix="diloco-launch-"))
    procs = spawn(args.processes, argv[cut + 1:], port, logdir, args.netns, args.comm_device,
                  args.devices_per_process, gpus)

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
