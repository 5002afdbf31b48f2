"""`diloco sweep … --launch tpu`: a bash script that runs a sweep's points on Cloud TPU.

One slice: a TPU VM (`gcloud compute tpus tpu-vm create`). Several slices: a queued resource with
`--node-count K` (multislice: the runtime gives every host the MEGASCALE_* environment JAX needs;
the `replica` mesh axis then spans the slices). The script's steps, each a subcommand:

  up       create the slice(s)                      down    delete them
  setup    on every worker: clone the repo at the commit this was generated from, a venv,
           `pip install -e .[tpu]`; copy the worker script (and a local vocabulary) to the root
  start P  start point P on every host of every slice, detached (setsid nohup), logs copied to
           ROOT/…/P/logs/<host>.log every 30 s;  stop P: SIGTERM → every host checkpoints and exits
  status   each point: done / last metrics row;      run: start every unfinished point in turn
Resume = `start P` again (the run continues from its checkpoint in ROOT). The root must be gs://.
"""
from __future__ import annotations

import math
import re
import shlex
import subprocess

from diloco.errors import ConfigError

RUNTIME = {"v4": "tpu-ubuntu2204-base", "v5p": "v2-alpha-tpuv5", "v5litepod": "v2-alpha-tpuv5-lite",
           "v6e": "v2-alpha-tpuv6e"}


def slice_chips(accelerator: str) -> tuple[int, int]:
    """(chips, hosts) of one slice of an accelerator type such as v5p-64 (64 TensorCores = 32 chips),
    v5litepod-16 or v6e-8 (chips)."""
    m = re.fullmatch(r"(v4|v5p|v5litepod|v6e)-(\d+)", accelerator or "")
    if not m:
        raise ConfigError("--accelerator", f"{accelerator!r} is not a TPU type like v5p-8, v5p-64, v4-32, "
                          "v5litepod-16 or v6e-8")
    family, n = m.group(1), int(m.group(2))
    chips = n // 2 if family in ("v4", "v5p") else n  # v4/v5p types count TensorCores, 2 per chip
    hosts = max(1, chips // 4) if family in ("v4", "v5p") or chips > 8 else 1
    return chips, hosts


def check_point(point: dict, extra: list[str], chips: int, slices: int):
    """Refuse, before anything starts, a point whose batch cannot be split over the slice(s)."""
    from diloco.config import load_config, mesh_shape, validate

    cfg = load_config(point["spec"], [*point["overrides"], *extra], check_data=False)
    n = chips * slices
    R = 1 if cfg.method == "dp" else cfg.replicas
    if slices > 1 and R % slices and R != 1:
        raise ConfigError("replicas", f"point {point['name']}: replicas={R} cannot be spread over {slices} slices "
                          f"(one replica axis across slices); use replicas a multiple of {slices}")
    try:
        validate(cfg, check_data=False, num_devices=n)
    except ConfigError as e:
        if e.field not in ("batch_size", "mesh.replica_axis", "mesh.fsdp", "mesh.data"):
            raise
        r_axis = n if R % n == 0 else math.gcd(R, n)
        per = cfg.batch_size // R
        per_dev = n // r_axis  # devices of one replica's data×fsdp axes
        fit = max(d for d in range(1, per_dev + 1) if per_dev % d == 0 and per % d == 0)
        good_b = -(-cfg.batch_size // (R * per_dev)) * R * per_dev
        raise ConfigError(e.field, f"point {point['name']}: {str(e).split(': ', 1)[-1]}; with {slices}×{chips} chips "
                          f"use --set batch_size={good_b}, or slices of {fit * r_axis // slices} chips for "
                          f"batch_size={cfg.batch_size}") from None
    mesh_shape(cfg, n)
    return cfg


def git_source(repo_url: str = "", commit: str = "") -> tuple[str, str]:
    from diloco.config import REPO_ROOT

    def git(*a):
        r = subprocess.run(["git", "-C", str(REPO_ROOT), *a], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    url = repo_url or git("remote", "get-url", "origin")
    sha = commit or git("rev-parse", "HEAD")
    if not url or not sha:
        raise ConfigError("--repo-url", "cannot tell which repository/commit the workers should install; pass "
                          "--repo-url URL --commit SHA (a clone the workers can reach)")
    return url, sha


def _worker_script(sweep: dict, root: str, extra: list[str], vocab_override: list[str]) -> str:
    """Runs on every TPU host: start/stop one point, detached, logs copied to the run folder."""
    lines = ["#!/usr/bin/env bash", "# diloco worker script (written by `diloco sweep --launch tpu`)",
             "set -euo pipefail", 'cmd=$1; point=$2; logs=$HOME/diloco-logs; mkdir -p "$logs"',
             'log=$logs/$point.log; pidf=$logs/$point.pid', 'case $point in']
    for pt in sweep["points"]:
        wd = f"{root}/{sweep['name']}/{pt['name']}"
        args = ["train", "--config", pt["spec"], "--workdir", wd, "--no_progress", *pt["overrides"], *extra,
                *vocab_override]
        lines.append(f"  {shlex.quote(pt['name'])}) wd={shlex.quote(wd)}; args=({shlex.join(args)});;")
    lines += ['  *) echo "unknown point $point" >&2; exit 2;;', "esac",
              'if [ "$cmd" = stop ]; then kill -TERM "$(cat "$pidf")" && echo "$(hostname): SIGTERM sent"; exit 0; fi',
              'if [ -f "$pidf" ] && kill -0 "$(cat "$pidf")" 2>/dev/null; then echo "$(hostname): already running"; exit 0; fi',
              'cd "$HOME/diloco"',
              'DILOCO_DISTRIBUTED=auto setsid nohup "$HOME/diloco-venv/bin/python" -m diloco.cli "${args[@]}" '
              '>"$log" 2>&1 </dev/null & echo $! >"$pidf"',
              'setsid nohup bash -c "while kill -0 $(cat "$pidf") 2>/dev/null; do gcloud storage cp -q \\"$log\\" '
              '\\"$wd/logs/$(hostname).log\\"; sleep 30; done; gcloud storage cp -q \\"$log\\" \\"$wd/logs/$(hostname).log\\"" '
              '>/dev/null 2>&1 </dev/null &',
              'echo "$(hostname): started $point (pid $(cat "$pidf"))"']
    return "\n".join(lines) + "\n"


def tpu_script(sweep: dict, root: str, tpu: str, zone: str, accelerator: str, slices: int = 1, project: str = "",
               extra: list[str] = (), repo_url: str = "", commit: str = "", runtime: str = "",
               generated_by: str = "") -> tuple[str, str]:
    """(the launch script, the worker script). Every point is checked against the slice first."""
    if not root.startswith("gs://"):
        raise ConfigError("--root", f"{root!r}: TPU workers cannot read this machine's disk; use a gs://bucket/… root")
    if slices < 1:
        raise ConfigError("--slices", f"{slices} must be ≥ 1")
    chips, hosts = slice_chips(accelerator)
    vocabs = {check_point(pt, extra, chips, slices).vocab for pt in sweep["points"]}
    local_sp = sorted(v for v in vocabs if v.startswith("sentencepiece:") and "://" not in v)
    if len(local_sp) > 1:
        raise ConfigError("vocab", f"points use {len(local_sp)} local vocabularies {local_sp}; put them on gs:// "
                          "and give --set vocab=sentencepiece:gs://…")
    vocab = local_sp[0] if local_sp else ""
    url, sha = git_source(repo_url, commit)
    root = root.rstrip("/")
    base = f"{root}/{sweep['name']}"
    stage = f"{base}/_launch"
    vocab_override, stage_vocab = [], []
    if vocab:
        local = vocab.split(":", 1)[1]
        remote = f"{stage}/{local.rstrip('/').rsplit('/', 1)[-1]}"
        stage_vocab = [f"gcloud storage cp {shlex.quote(local)} {shlex.quote(remote)}"]
        vocab_override = [f"--config.vocab=sentencepiece:{remote}"]
    worker = _worker_script(sweep, root, list(extra), vocab_override)
    proj = f" --project={shlex.quote(project)}" if project else ""
    z = f" --zone={shlex.quote(zone)}{proj}"
    runtime = runtime or RUNTIME[accelerator.split("-")[0]]
    nodes = [tpu] if slices == 1 else [f"{tpu}-{i}" for i in range(slices)]
    setup_remote = (f"set -e; test -d ~/diloco/.git || git clone -q {shlex.quote(url)} ~/diloco; cd ~/diloco; "
                    f"git fetch -q origin; git checkout -q {sha}; test -d ~/diloco-venv || python3 -m venv ~/diloco-venv; "
                    "~/diloco-venv/bin/pip install -q -e '.[tpu]'; "
                    f"gcloud storage cp {shlex.quote(stage + '/worker.sh')} ~/diloco-worker.sh")

    def on_all(remote: str) -> list[str]:
        return [f"gcloud compute tpus tpu-vm ssh {shlex.quote(n)}{z} --worker=all --command={shlex.quote(remote)}"
                for n in nodes]

    if slices == 1:
        up = [f"gcloud compute tpus tpu-vm create {shlex.quote(tpu)}{z} --accelerator-type={accelerator} "
              f"--version={runtime}"]
        down = [f"gcloud compute tpus tpu-vm delete {shlex.quote(tpu)}{z} --quiet"]
    else:
        up = [f"gcloud compute tpus queued-resources create {shlex.quote(tpu)}{z} --accelerator-type={accelerator} "
              f"--runtime-version={runtime} --node-count={slices} --node-prefix={shlex.quote(tpu)}",
              f"until gcloud compute tpus queued-resources describe {shlex.quote(tpu)}{z} "
              "--format='value(state.state)' | grep -q ACTIVE; do sleep 30; done"]
        down = [f"gcloud compute tpus queued-resources delete {shlex.quote(tpu)}{z} --force --quiet"]
    names = [pt["name"] for pt in sweep["points"]]
    where = f"{slices}× {accelerator}" if slices > 1 else accelerator
    L = ["#!/usr/bin/env bash",
         f"# {sweep['name']}: {len(names)} point(s) on {where} ({chips} chips, {hosts} host(s) per slice) in {zone}",
         f"# repo {url} at {sha}; runs in {base}/<point>",
         *([f"# generated by: {generated_by}"] if generated_by else []),
         "# usage: bash launch_tpu.sh up | setup | start POINT | stop POINT | status | run | down",
         "set -euo pipefail",
         f"POINTS=({shlex.join(names)})",
         "point() {  # start|stop POINT on every host of every slice (detached: the ssh returns at once)",
         *[f"  gcloud compute tpus tpu-vm ssh {shlex.quote(n)}{z} --worker=all "
           '--command="bash ~/diloco-worker.sh $1 $2"' for n in nodes],
         "}",
         'case "${1:-help}" in',
         "up)", *[f"  {c}" for c in up], "  ;;",
         "setup)", *[f"  {c}" for c in stage_vocab], *[f"  {c}" for c in on_all(setup_remote)], "  ;;",
         "start|stop)", '  p=${2:?point name: one of ${POINTS[*]}}; point "$1" "$p"', "  ;;",
         "status)",
         f"  for p in \"${{POINTS[@]}}\"; do if gcloud storage ls {shlex.quote(base)}/\"$p\"/summary.json >/dev/null 2>&1; "
         "then echo \"done     $p\"; else echo \"not done $p: $(gcloud storage cat "
         f"{shlex.quote(base)}/\"$p\"/metrics.jsonl 2>/dev/null | tail -n 1)\"; fi; done",
         "  ;;",
         "run)",
         f"  for p in \"${{POINTS[@]}}\"; do gcloud storage ls {shlex.quote(base)}/\"$p\"/summary.json >/dev/null 2>&1 && continue",
         '    point start "$p"',
         f"    until gcloud storage ls {shlex.quote(base)}/\"$p\"/summary.json >/dev/null 2>&1; do sleep 60; "
         f"gcloud storage cat {shlex.quote(base)}/\"$p\"/metrics.jsonl 2>/dev/null | tail -n 1; done",
         "  done", "  ;;",
         "down)", *[f"  {c}" for c in down], "  ;;",
         '*) echo "usage: launch_tpu.sh up | setup | start POINT | stop POINT | status | run | down" >&2; exit 2;;',
         "esac"]
    return "\n".join(L) + "\n", worker
