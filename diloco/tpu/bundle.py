"""The launch bundle: what `diloco sweep … --launch tpu` writes to a local folder, and what
`launch_tpu.sh up` copies to gs://…/<sweep>/_launch/ (the workers read it from there).

  tree-<sha12>.tar.gz  the exact tree that was validated: `git ls-files -co --exclude-standard`
                       (tracked and untracked-not-ignored files as they are on disk, dirty or not);
                       deterministic (sorted, mtime 0, owner 0), so the same tree gives the same sha256
  plan.json            below; the agent (diloco/tpu/agent.py) reads it
  requirements.lock    the pinned constraints the workers install with (also inside the tree)
  startup.sh           every host: fetch + verify the tree, build the env once, start the agent
  launch_tpu.sh        the laptop: up | start | status | logs | stop | down
  vocab-<sha12>.model  a local sentencepiece vocabulary, staged (the points' argv point at its gs:// copy)
Both scripts are rendered from the templates beside this file (`*.sh.in`, @NAME@ → a shell-quoted value).

plan.json (version 1) — the contract between this launcher and the agent; this docstring is its source
of truth (ask for a key by editing it here and saying so in the commit message):
  version          1
  sweep            the sweep's name;  base: "gs://bucket/root/<sweep>" (every path below is under it)
  qr, zone, project  the queued resource (the leader deletes it when `teardown`); project "" = gcloud's
  accelerator, runtime  e.g. "v5p-16", "v2-alpha-tpuv5"
  slices, hosts_per_slice, chips_per_host   K, H, C: K·H hosts, one agent and one training process each
  tree             {"url": "<base>/_launch/tree-<sha12>.tar.gz", "sha256": "<64 hex>"}
  lock_sha256      sha256 of requirements.lock
  source           {"commit": git HEAD or "", "dirty": bool} — provenance only
  points           [{"name": POINT, "workdir": "<base>/POINT",
                     "argv": ["train", "--config", SPEC, "--workdir", WD, "--no_progress", --config.k=v …]}]
                   in the order they run; `python -m diloco.cli *argv` from the unpacked tree (the cwd)
  max_attempts     attempts per point before it is `failed` (a lost host or non-zero exit starts the next)
  lost_after_s     a host whose heartbeat is older than this is lost
  stop_grace_s     after SIGTERM (abort/stop), SIGKILL the training process after this many seconds
  teardown         true: the leader deletes the queued resource once every point is finished or failed
  env              extra environment of every training process, e.g. JAX_COMPILATION_CACHE_DIR on the bucket
  optional (the agent's defaults): poll_s 10, log_upload_s 30, abort_grace_s 60 (SIGKILL after an abort),
                   program (the command the argv follows; default python -m diloco.cli — a test hook)
Markers the laptop writes: <base>/_launch/control/stop (launch_tpu.sh stop; removed by up and start).
What launch_tpu.sh asks of `python -m diloco.tpu.status BASE`: no flag → the table, exit 0 all finished /
1 any failed / 2 otherwise; `--wait-stopped S` → exit 0 once every host that ever reported has said its
agent exited after the stop marker, 1 after S seconds (naming the hosts still up); `--busy` → exit 0
when some host is running a point now (fresh heartbeat), 1 otherwise.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from diloco.config import REPO_ROOT
from diloco.errors import ConfigError

TEMPLATES = Path(__file__).resolve().parent
LOCK = "requirements.lock"


def sha256_file(p: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tree_files(root: Path = REPO_ROOT, exclude: Path | None = None) -> list[str]:
    """Tracked and untracked-but-not-ignored files present on disk, relative, sorted."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-co", "--exclude-standard", "-z"],
                             capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise ConfigError("--launch", f"{root} is not a git checkout ({type(e).__name__}); the TPU launcher ships "
                          "`git ls-files -co --exclude-standard` of one") from None
    ex = os.path.abspath(exclude) + os.sep if exclude else None
    files = set()
    for rel in out.decode().split("\0"):
        p = root / rel
        if rel and (p.is_file() or p.is_symlink()) and not (ex and os.path.abspath(p).startswith(ex)):
            files.add(rel)
    return sorted(files)


def write_tree(files: list[str], dest: Path, root: Path = REPO_ROOT) -> tuple[Path, str]:
    """tree-<sha12>.tar.gz of `files` in `dest`, byte-identical for identical contents; (path, sha256)."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, filename="") as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for rel in files:
                p = root / rel
                info = tarfile.TarInfo(rel)
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                if p.is_symlink():
                    info.type, info.linkname, info.mode = tarfile.SYMTYPE, os.readlink(p), 0o777
                    tar.addfile(info)
                    continue
                data = p.read_bytes()
                info.size, info.mode = len(data), 0o755 if os.access(p, os.X_OK) else 0o644
                tar.addfile(info, io.BytesIO(data))
    data = buf.getvalue()
    sha = hashlib.sha256(data).hexdigest()
    out = dest / f"tree-{sha[:12]}.tar.gz"
    out.write_bytes(data)
    return out, sha


def render(template: str, comments: dict | None = None, **values) -> str:
    """`template` (a file beside this module) with every @NAME@ replaced by its shell-quoted value (a list
    becomes several words, for `ARRAY=(@NAME@)`); `comments` are inserted as they are, on one line."""
    subs = {k: shlex.join(map(str, v)) if isinstance(v, (list, tuple)) else shlex.quote(str(v)) for k, v in values.items()}
    subs |= {k: " ".join(str(v).split()) for k, v in (comments or {}).items()}
    text = (TEMPLATES / template).read_text()
    missing = sorted(set(re.findall(r"@([A-Z][A-Z0-9_]*)@", text)) - set(subs))
    if missing:
        raise ValueError(f"{template}: no value for {missing}")
    return re.sub(r"@([A-Z][A-Z0-9_]*)@", lambda m: subs[m.group(1)], text)


def git_source(root: Path = REPO_ROOT) -> dict:
    def git(*a):
        r = subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}


def point_argv(point: dict, base: str, extra: list[str], vocab: str = "") -> list[str]:
    wd = f"{base}/{point['name']}"
    return ["train", "--config", point["spec"], "--workdir", wd, "--no_progress", *point["overrides"], *extra,
            *([f"--config.vocab=sentencepiece:{vocab}"] if vocab else [])]


def write(out: Path, sweep: dict, checked, root: str, qr: str, zone: str, project: str = "", extra: list[str] = (),
          capacity: str = "", valid_until: str = "", service_account: str = "", network: str = "",
          subnetwork: str = "", internal_ips: bool = False, max_attempts: int = 3, teardown: bool = False,
          runtime: str = "", lost_after_s: int = 120, stop_grace_s: int = 900, generated_by: str = "") -> dict:
    """Write the bundle for a checked sweep (diloco.tpu.preflight.check) into `out`; returns the plan."""
    from diloco.tpu.accelerators import RUNTIME

    sl, slices = checked.slice, checked.slices
    base = f"{root.rstrip('/')}/{sweep['name']}"
    launch = f"{base}/_launch"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tar, tree_sha = write_tree(tree_files(exclude=out), out)
    shutil.copyfile(REPO_ROOT / LOCK, out / LOCK)
    lock_sha = sha256_file(out / LOCK)
    for local, name in checked.vocabs.items():
        shutil.copyfile(local, out / name)
    points = []
    for pt in sweep["points"]:
        vocab = checked.configs[pt["name"]].vocab
        local = os.path.abspath(os.path.expanduser(vocab.partition(":")[2])) if vocab.startswith("sentencepiece:") else ""
        staged = f"{launch}/{checked.vocabs[local]}" if local in checked.vocabs else ""
        points.append({"name": pt["name"], "workdir": f"{base}/{pt['name']}",
                       "argv": point_argv(pt, base, list(extra), staged)})
    runtime = runtime or RUNTIME[sl.generation]
    plan = {"version": 1, "sweep": sweep["name"], "base": base, "qr": qr, "zone": zone, "project": project,
            "accelerator": sl.name, "runtime": runtime, "slices": slices, "hosts_per_slice": sl.hosts,
            "chips_per_host": sl.chips_per_host, "tree": {"url": f"{launch}/{tar.name}", "sha256": tree_sha},
            "lock_sha256": lock_sha, "source": git_source(), "points": points, "max_attempts": max_attempts,
            "lost_after_s": lost_after_s, "stop_grace_s": stop_grace_s, "teardown": teardown,
            "env": {"JAX_COMPILATION_CACHE_DIR": f"{launch}/jax-cache", "TF_CPP_MIN_LOG_LEVEL": "3"}}
    (out / "plan.json").write_text(json.dumps(plan, indent=1) + "\n")
    env_key = hashlib.sha256(f"{tree_sha} {lock_sha}".encode()).hexdigest()[:12]
    (out / "startup.sh").write_text(render("startup.sh.in", {"SWEEP": sweep["name"]}, LAUNCH=launch, TREE=tar.name,
                                           TREE_SHA256=tree_sha, ENV_KEY=env_key))
    create = ([f"--{capacity}"] if capacity else []) + ([f"--valid-until-duration={valid_until}"] if valid_until else [])
    create += [f"--service-account={service_account}"] if service_account else []
    create += ([f"--network={network}"] if network else []) + ([f"--subnetwork={subnetwork}"] if subnetwork else [])
    create += ["--internal-ips"] if internal_ips else []
    where = f"{slices}× {sl.name}" if slices > 1 else sl.name
    summary = (f"sweep {sweep['name']}: {len(points)} point(s) on {where} ({sl.chips} chips, {sl.hosts} host(s) per "
               f"slice) in {zone}; runs in {base}/<point>")
    script = render("launch_tpu.sh.in", {"SUMMARY": summary, "GENERATED_BY": generated_by or "diloco sweep"}, QR=qr,
                    BASE=base, WHERE=[f"--zone={zone}"] + ([f"--project={project}"] if project else []),
                    ACCELERATOR=sl.name, RUNTIME=runtime,
                    NODES=[f"--node-id={qr}"] if slices == 1 else [f"--node-count={slices}", f"--node-prefix={qr}"],
                    TRACK=["alpha"] if capacity == "best-effort" else [], CREATE_FLAGS=create,
                    SSH_FLAGS=["--tunnel-through-iap"] if internal_ips else [], PYTHON=sys.executable,
                    STOP_WAIT_S=stop_grace_s + 300)
    (out / "launch_tpu.sh").write_text(script)
    (out / "launch_tpu.sh").chmod(0o755)
    return plan
