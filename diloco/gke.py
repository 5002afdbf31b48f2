"""`diloco sweep … --launch gke`: one JobSet per point on a GKE cluster (TPU slices or GPU nodes).

For each point it writes `<out>/<point>.yaml`, a JobSet (jobset.x-k8s.io/v1alpha2) to `kubectl apply -f`, and
`<out>/xpk.sh` with the equivalent `xpk workload create` line per point for users of xpk. Nothing is applied:
the cluster, its JobSet controller and the container image (the repo installed from the lock) are yours.

What the JobSet does:
- **TPU** (`--accelerator v5p-16 --slices S`): one replicated job of S jobs, one pod per TPU host with the
  slice's node selectors and `google.com/tpu` chips; several slices get the multislice variables
  (MEGASCALE_*); each process joins the JAX job by JAX's own detection (`DILOCO_DISTRIBUTED=auto`).
- **GPU** (`--accelerator h100-80gb-8 --nodes N`): N pods, one process per node driving its 8 GPUs, placed
  with the DILOCO_* variables of diloco/distributed.py (coordinator: pod 0 by the JobSet's DNS name, process
  id: the job completion index).
- **Failures**: a pod evicted for a disruption (Spot preemption, maintenance, node repair: the
  DisruptionTarget condition) fails its job with reason PodFailurePolicy, and the JobSet restarts
  without counting it (`RestartJobSetAndIgnoreMaxRestarts`); any other failure restarts it at most
  `--max-restarts` times. Every restart resumes from the newest checkpoint in the gs:// run folder;
  the grace period (`--grace`, SIGTERM first) gives the processes time to save one.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from diloco.errors import ConfigError

API = "jobset.x-k8s.io/v1alpha2"
COORDINATOR_PORT = 8476
# GKE's node label values (cloud.google.com/gke-tpu-accelerator, cloud.google.com/gke-accelerator)
TPU_NODE = {"v4": "tpu-v4-podslice", "v5p": "tpu-v5p-slice", "v5litepod": "tpu-v5-lite-podslice",
            "v6e": "tpu-v6e-slice"}
GPU_NODE = {"h100-80gb-8": "nvidia-h100-80gb", "h100-mega-80gb-8": "nvidia-h100-mega-80gb",
            "h200-141gb-8": "nvidia-h200-141gb", "b200-8": "nvidia-b200"}


@dataclass(frozen=True)
class Target:
    accelerator: str  # a TPU type (v5p-16) or xpk's GPU device type (h100-80gb-8)
    groups: int  # TPU slices, or 1 for GPUs
    pods: int  # pods per group: TPU hosts per slice, or GPU nodes
    selector: dict
    limits: dict

    @property
    def tpu(self) -> bool:
        return "google.com/tpu" in self.limits


def target(accelerator: str, slices: int = 1, nodes: int = 1) -> Target:
    if accelerator in GPU_NODE:
        if nodes < 1:
            raise ConfigError("--nodes", f"{nodes} must be ≥ 1")
        gpus = int(accelerator.rsplit("-", 1)[1])
        return Target(accelerator, 1, nodes, {"cloud.google.com/gke-accelerator": GPU_NODE[accelerator]},
                      {"nvidia.com/gpu": gpus})
    from diloco.tpu import accelerators

    try:
        s = accelerators.parse(accelerator)
    except ConfigError as e:
        raise ConfigError("--accelerator", f"{e.args[0].split(': ', 1)[1]}; GPUs: {', '.join(GPU_NODE)}") from None
    if slices < 1:
        raise ConfigError("--slices", f"{slices} must be ≥ 1")
    return Target(accelerator, slices, s.hosts, {"cloud.google.com/gke-tpu-accelerator": TPU_NODE[s.generation],
                                                 "cloud.google.com/gke-tpu-topology": s.topology.split(":")[1]},
                  {"google.com/tpu": s.chips_per_host})


def k8s_name(sweep: str, point: str) -> str:
    """A DNS-1035 label ≤ 40 characters (JobSet prefixes pod names with it), unique per point."""
    import hashlib

    base = re.sub(r"[^a-z0-9-]+", "-", f"{sweep}-{point}".lower()).strip("-")
    digest = hashlib.sha256(f"{sweep}/{point}".encode()).hexdigest()[:6]
    return f"d-{base[:31].strip('-')}-{digest}"


def env_of(name: str, t: Target) -> list[dict]:
    index = {"valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}}
    head = f"{name}-workers-0-0.{name}"
    env = [{"name": "EPATH_USE_TF", "value": "false"}, {"name": "TF_CPP_MIN_LOG_LEVEL", "value": "3"}]
    if t.tpu:
        env.append({"name": "DILOCO_DISTRIBUTED", "value": "auto"})
        if t.groups > 1:
            slice_id = {"valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['jobset.sigs.k8s.io/job-index']"}}}
            env += [{"name": "MEGASCALE_COORDINATOR_ADDRESS", "value": head},
                    {"name": "MEGASCALE_NUM_SLICES", "value": str(t.groups)}, {"name": "MEGASCALE_SLICE_ID", **slice_id}]
    elif t.pods > 1:
        env += [{"name": "DILOCO_COORDINATOR", "value": f"{head}:{COORDINATOR_PORT}"},
                {"name": "DILOCO_NUM_PROCESSES", "value": str(t.pods)}, {"name": "DILOCO_PROCESS_ID", **index}]
    return env


def jobset(name: str, train: list[str], t: Target, image: str, max_restarts: int, grace_s: int) -> dict:
    pod = {"restartPolicy": "Never", "terminationGracePeriodSeconds": grace_s, "nodeSelector": t.selector,
           "containers": [{"name": "diloco", "image": image, "command": train, "env": env_of(name, t),
                           "ports": [{"containerPort": COORDINATOR_PORT}],
                           "resources": {"limits": {k: v for k, v in t.limits.items()}}}]}
    job = {"parallelism": t.pods, "completions": t.pods, "completionMode": "Indexed", "backoffLimit": 0,
           "podFailurePolicy": {"rules": [{"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]},
           "template": {"metadata": {"labels": {"app.kubernetes.io/name": "diloco"}}, "spec": pod}}
    return {"apiVersion": API, "kind": "JobSet",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "diloco"}},
            "spec": {"failurePolicy": {"maxRestarts": max_restarts, "rules": [
                         {"name": "disruptions-are-free", "action": "RestartJobSetAndIgnoreMaxRestarts",
                          "onJobFailureReasons": ["PodFailurePolicy"]}]},
                     "network": {"enableDNSHostnames": True},
                     "replicatedJobs": [{"name": "workers", "replicas": t.groups, "template": {"spec": job}}]}}


def xpk_line(name: str, train: list[str], t: Target, image: str, cluster: str, max_restarts: int,
             project: str = "", zone: str = "") -> list[str]:
    line = ["xpk", "workload", "create", "--cluster", cluster, "--workload", name, "--docker-image", image,
            "--command", shlex.join(train), "--max-restarts", str(max_restarts)]
    line += ["--tpu-type", t.accelerator, "--num-slices", str(t.groups)] if t.tpu else \
        ["--device-type", t.accelerator, "--num-nodes", str(t.pods)]
    return line + ["--project", project] * bool(project) + ["--zone", zone] * bool(zone)


def launch(points: list[dict], sweep_name: str, root: str, args, extra: list[str], train_command) -> int:
    import sys

    import yaml

    if not str(root).startswith("gs://"):
        raise ConfigError("--root", f"{root} is local; pods share no disk: give --root gs://BUCKET/runs")
    if not (args.accelerator and args.image and args.cluster):
        raise ConfigError("--launch", "gke needs --accelerator (a TPU type or a GPU type), --image and --cluster")
    if args.max_restarts < 0:
        raise ConfigError("--max-restarts", f"{args.max_restarts} must be ≥ 0")
    t = target(args.accelerator, args.slices, args.nodes)
    out = Path(args.out or Path("build") / "gke" / sweep_name)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["#!/bin/sh", "# written by `diloco sweep --launch gke`: the same points through xpk", "set -e"]
    for pt in points:
        name = k8s_name(sweep_name, pt["name"])
        train = ["python", "-m", "diloco.cli", *train_command(pt, f"{root}/{sweep_name}/{pt['name']}", extra)[3:]]
        spec = jobset(name, train, t, args.image, args.max_restarts, args.grace)
        (out / f"{pt['name']}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
        lines.append(shlex.join(xpk_line(name, train, t, args.image, args.cluster, args.max_restarts,
                                         args.project, args.zone)))
    (out / "xpk.sh").write_text("\n".join(lines) + "\n")
    print(f"{len(points)} JobSet(s) for {t.groups}× {t.pods} pod(s) of {t.accelerator} in {out}\n"
          f"  kubectl apply -f {out}        # needs the JobSet controller on the cluster\n"
          f"  sh {out / 'xpk.sh'}            # or the same through xpk", file=sys.stderr)
    return 0


def add_arguments(ap) -> None:
    g = ap.add_argument_group("--launch gke (one JobSet per point; diloco/gke.py; also --accelerator, --slices, "
                              "--nodes, --project, --zone, --out)")
    g.add_argument("--cluster", default="", help="GKE cluster name (for the xpk lines)")
    g.add_argument("--image", default="", help="container image with this repo installed from the lock")
    g.add_argument("--max-restarts", type=int, default=3, help="restarts for failures other than disruptions")
