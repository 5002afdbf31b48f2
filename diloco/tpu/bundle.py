"""The launch bundle: what `diloco sweep … --launch tpu` writes to a local folder (default
build/tpu/<sweep>/<queued resource>), and what `launch_tpu.sh up` copies to NS/_launch/, where
NS = ROOT/<sweep>/_pods/<queued resource> is the launch's own folder: one pod, one namespace (its plan,
heartbeats, go/stop/exit files and logs), so two pods on one root never share a coordination file.
The points' run folders stay ROOT/<sweep>/<point>.

  tree-<sha12>.tar.gz  the exact tree that was validated: the tracked files (`git ls-files -c`) as they
                       are on disk (modifications included), plus untracked files only when listed
                       (`--ship PATH`); at most MAX_TREE_BYTES, and nothing that looks like a credential
                       (refused by name); deterministic (sorted, mtime 0, owner 0): same tree, same sha256
  plan.json            below; the agent (diloco/tpu/agent.py) reads it
  requirements.lock    the pinned constraints the workers install with (also inside the tree)
  bootstrap.sh         the VM metadata's startup script, fixed per queued resource: at every boot it
                       fetches the current startup.sh from NS/_launch/ and runs it (a reboot or a
                       repaired slice always runs the bundle `up` uploaded last)
  startup.sh           every host: fetch + verify the tree, build the env once per lock, start the agent
  launch_tpu.sh        the laptop: up | start | status | logs | stop | down
  vocab-<sha12>.model  a local sentencepiece vocabulary, staged (the points' argv point at its gs:// copy)
  .diloco-bundle       marks the folder as a bundle (the queued resource's name): only such a folder is
                       rewritten by the next `--out` to it, and only the files named here are removed
The scripts are rendered from the templates beside this file (`*.sh.in`, @NAME@ → a shell-quoted value).

plan.json (version 1) — the contract between this launcher and the agent; this docstring is its source
of truth (ask for a key by editing it here and saying so in the commit message):
  version          1
  sweep            the sweep's name;  base: NS, "gs://bucket/root/<sweep>/_pods/<qr>" (every coordination
                   path is under it);  root: "gs://bucket/root/<sweep>" (the points' run folders)
  qr, zone, project  the queued resource (the leader deletes it when `teardown`); project "" = gcloud's
  accelerator, runtime  e.g. "v5p-16", "v2-alpha-tpuv5"
  slices, hosts_per_slice, chips_per_host   K, H, C: K·H hosts, one agent and one training process each
  tree             {"url": "<base>/_launch/tree-<sha12>.tar.gz", "sha256": "<64 hex>"}
  lock_sha256      sha256 of requirements.lock
  source           {"commit": git HEAD or "", "dirty": bool} — provenance only
  points           [{"name": POINT, "workdir": "<base>/POINT",
                     "argv": ["train", "--config", SPEC, "--workdir", WD, "--no_progress", --config.k=v …]}]
                   in the order they run; `python -m diloco.cli *argv` from the unpacked tree (the cwd)
  max_attempts     failed attempts per point before it is `failed` (a non-zero exit, a lost host that did not
                   come back on a new boot, a stalled run); a stopped or preempted attempt does not count
  max_preemptions  attempts ended by a replaced or rebooted VM (Spot, repair, reboot: the host's agent finds a
                   new boot id) per point before it is `failed`
  lost_after_s     a host whose heartbeat is older than this is lost
  stop_grace_s     after SIGTERM (abort/stop), SIGKILL the training process after this many seconds
  teardown         true: the leader deletes the queued resource once every point is finished or failed
  service_account  the VMs' account (--service-account; "": the project's default compute account)
  capacity         "" (on-demand) | spot | reserved | best-effort: how the pod is bought (status prices it)
  env              extra environment of every training process, e.g. JAX_COMPILATION_CACHE_DIR on the bucket
  boot_wait_s      the leader fails a point (naming the host and its last boot-log lines) when a host has
                   sent no heartbeat this long after the leader's agent started
  optional (the agent's defaults): poll_s 10, log_upload_s 30, abort_grace_s 60 (SIGKILL after an abort),
                   lost_give_up 10 (a host lost this many × lost_after_s fails the point), stall_rows 5 and
                   stall_min_s 1800 (no new metrics row for max(stall_rows × the longest gap so far,
                   stall_min_s) while the hosts heartbeat: the attempt is aborted as stalled),
                   maintenance_wait_s 1800 (after a maintenance stop, the next attempt waits this long at
                   most for the noticed host's reboot) (decide.Limits),
                   program (the command the argv follows; default python -m diloco.cli — a test hook)
Markers the laptop writes: <base>/_launch/control/stop (launch_tpu.sh stop; removed by up and start).
Every host's boot log: <base>/_pod/boot/slice<s>-worker<w>.log (startup.sh uploads it after each step).
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


MAX_TREE_BYTES = 64 << 20  # the repository is ≈ 3 MB; more means data or an environment was committed
# names that hold credentials: private keys, service-account or OAuth JSON, .env files, token files
SECRET_NAME = re.compile(r"\.env(\..*)?|\.netrc|\.pypirc|\.git-credentials|id_(rsa|dsa|ecdsa|ed25519)|.*\.(pem|key|p12|pfx"
                         r"|jks|keystore)|(.*[-_.])?(credentials?|secrets?|tokens?|service[-_]?account|client_secrets?"
                         r"|keyfile|key|sa)([-_.].*)?\.json", re.IGNORECASE)  # matched against the file's name
SECRET_HEAD = re.compile(rb"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----|\"type\"\s*:\s*\"(service_account|"
                         rb"authorized_user|external_account)\"|\"private_key\"\s*:")


def looks_like_credential(rel: str, head: bytes) -> bool:
    """By name (SECRET_NAME), or a file that starts as a key file or credential JSON does: its first
    4 KiB hold a PEM private key, or it is .json with a service-account / OAuth user / private_key field."""
    if SECRET_NAME.fullmatch(rel.rsplit("/", 1)[-1]):
        return True
    if rel.endswith(".json") or head.lstrip().startswith(b"-----BEGIN"):
        return bool(SECRET_HEAD.search(head))
    return False


def tree_files(root: Path = REPO_ROOT, exclude: Path | None = None, ship: tuple[str, ...] = (),
               max_bytes: int = MAX_TREE_BYTES) -> list[str]:
    """The tracked files present on disk (`git ls-files -c`, as they are now: modifications included)
    plus the untracked ones listed in `ship` (paths relative to root, or files under it), relative,
    sorted. Refused (ConfigError, naming the files): anything that looks like a credential, and a
    tree over `max_bytes`."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-c", "-z"], capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise ConfigError("--launch", f"{root} is not a git checkout ({type(e).__name__}); the TPU launcher ships "
                          "the tracked files (`git ls-files -c`) of one") from None
    ex = os.path.abspath(exclude) + os.sep if exclude else None
    files = set()
    for rel in out.decode().split("\0") + [os.path.relpath(os.path.abspath(root / f), os.path.abspath(root))
                                             for f in ship]:
        p = root / rel
        if rel.startswith(".."):
            raise ConfigError("--ship", f"{rel!r} is outside {root}; ship files of the checkout only")
        if rel and (p.is_file() or p.is_symlink()) and not (ex and os.path.abspath(p).startswith(ex)):
            files.add(rel)
        elif rel in ship:
            raise ConfigError("--ship", f"{rel!r} is not a file under {root}")
    secret = []
    for rel in sorted(files):
        p = root / rel
        head = b"" if p.is_symlink() else p.open("rb").read(4096)
        if looks_like_credential(rel, head):
            secret.append(rel)
    if secret:
        raise ConfigError("--launch", f"{', '.join(secret)} look(s) like a credential and would be copied to the bucket "
                          "and every VM; remove it from the checkout (git rm --cached, then .gitignore) or rename "
                          "it — the VMs use their service account, nothing in the bundle may hold a key")
    sizes = sorted(((root / f).lstat().st_size, f) for f in files)
    total = sum(n for n, _ in sizes)
    if total > max_bytes:
        big = ", ".join(f"{f} ({n / 2**20:.1f} MiB)" for n, f in sizes[::-1][:3])
        raise ConfigError("--launch", f"the shipped tree is {total / 2**20:.0f} MiB, over the {max_bytes / 2**20:.0f} "
                          f"MiB cap (largest: {big}); keep data and environments out of git (data goes on gs://)")
    return sorted(files)


def untracked(root: Path = REPO_ROOT, exclude: Path | None = None, ship: tuple[str, ...] = ()) -> list[str]:
    """Untracked, not ignored files that are not shipped (a module not yet `git add`ed would be missing on
    the pod): for a warning."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-o", "--exclude-standard", "-z"],
                             capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        return []
    ex = os.path.abspath(exclude) + os.sep if exclude else None
    shipped = {os.path.normpath(f) for f in ship}
    return sorted(f for f in out if f and os.path.normpath(f) not in shipped
                  and not (ex and os.path.abspath(root / f).startswith(ex)))


BUNDLE_FILES = re.compile(r"(tree-[0-9a-f]{12}\.tar\.gz|vocab-[0-9a-f]{12}\.model|plan\.json|requirements\.lock|"
                          r"bootstrap\.sh|startup\.sh|launch_tpu\.sh|\.diloco-bundle)")
MARKER = ".diloco-bundle"


def check_out(out: Path, qr: str) -> list[str]:
    """`--out` may be absent, empty, or an earlier bundle of the same queued resource (its marker, and
    nothing but bundle files); the names to remove. Anything else is refused (ConfigError) and left as it is."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError("--out", f"{out} is a file; give a folder for the bundle")
    if not out.exists() or not any(out.iterdir()):
        return []
    names = sorted(p.name for p in out.iterdir())
    if MARKER not in names:
        raise ConfigError("--out", f"{out} is not empty and holds no bundle ({', '.join(names[:3])}"
                          f"{', …' if len(names) > 3 else ''}): nothing there is removed; give a new or empty folder")
    other = (out / MARKER).read_text().strip()
    if other != qr:
        raise ConfigError("--out", f"{out} holds the bundle of queued resource {other!r}, not {qr!r}: give another "
                          f"--out (the default is build/tpu/<sweep>/<queued resource>)")
    stray = [n for n in names if not BUNDLE_FILES.fullmatch(n) or not (out / n).is_file()]
    if stray:
        raise ConfigError("--out", f"{out} holds files that are not part of a bundle ({', '.join(stray[:3])}): "
                          "nothing was removed; move them or give another --out")
    return names


def prepare_out(out: Path, qr: str) -> None:
    """check_out, then remove the earlier bundle's files (only those)."""
    for n in check_out(out, qr):
        (Path(out) / n).unlink()


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


def namespace(root: str, sweep: str, qr: str) -> tuple[str, str]:
    """(ROOT/<sweep>: the points' run folders, ROOT/<sweep>/_pods/<qr>: this launch's coordination)."""
    base = f"{root.rstrip('/')}/{sweep}"
    return base, f"{base}/_pods/{qr}"


def write(out: Path, sweep: dict, checked, root: str, qr: str, zone: str, project: str = "", extra: list[str] = (),
          capacity: str = "", valid_until: str = "", service_account: str = "", network: str = "",
          subnetwork: str = "", internal_ips: bool = False, max_attempts: int = 3, teardown: bool = False,
          runtime: str = "", lost_after_s: int = 120, stop_grace_s: int = 900, generated_by: str = "",
          ship: tuple[str, ...] = (), boot_wait_s: int = 1800, max_preemptions: int = 20) -> dict:
    """Write the bundle for a checked sweep (diloco.tpu.preflight.check) into `out`; returns the plan."""
    from diloco.tpu.accelerators import RUNTIME

    sl, slices = checked.slice, checked.slices
    base, ns = namespace(root, sweep["name"], qr)
    launch = f"{ns}/_launch"
    files = tree_files(exclude=out, ship=ship)
    prepare_out(out, qr)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text(qr + "\n")
    tar, tree_sha = write_tree(files, out)
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
    plan = {"version": 1, "sweep": sweep["name"], "base": ns, "root": base, "qr": qr, "zone": zone,
            "project": project, "accelerator": sl.name, "runtime": runtime, "slices": slices,
            "hosts_per_slice": sl.hosts, "chips_per_host": sl.chips_per_host,
            "tree": {"url": f"{launch}/{tar.name}", "sha256": tree_sha}, "lock_sha256": lock_sha,
            "source": git_source(), "points": points, "max_attempts": max_attempts, "max_preemptions": max_preemptions,
            "lost_after_s": lost_after_s,
            "stop_grace_s": stop_grace_s, "boot_wait_s": boot_wait_s, "teardown": teardown,
            "service_account": service_account, "capacity": capacity,
            "env": {"JAX_COMPILATION_CACHE_DIR": f"{launch}/jax-cache", "TF_CPP_MIN_LOG_LEVEL": "3",
                    "EPATH_USE_TF": "false"}}
    (out / "plan.json").write_text(json.dumps(plan, indent=1) + "\n")
    (out / "bootstrap.sh").write_text(render("bootstrap.sh.in", {"QR": qr}, LAUNCH=launch))
    (out / "startup.sh").write_text(render("startup.sh.in", {"SWEEP": sweep["name"]}, BASE=ns, LAUNCH=launch,
                                           TREE=tar.name, TREE_SHA256=tree_sha, ENV_KEY=lock_sha[:12]))
    create = ([f"--{capacity}"] if capacity else []) + ([f"--valid-until-duration={valid_until}"] if valid_until else [])
    create += [f"--service-account={service_account}"] if service_account else []
    create += ([f"--network={network}"] if network else []) + ([f"--subnetwork={subnetwork}"] if subnetwork else [])
    create += ["--internal-ips"] if internal_ips else []
    where = f"{slices}× {sl.name}" if slices > 1 else sl.name
    summary = (f"sweep {sweep['name']}: {len(points)} point(s) on {where} ({sl.chips} chips, {sl.hosts} host(s) per "
               f"slice) in {zone}; runs in {base}/<point>, this launch's state in {ns}")
    script = render("launch_tpu.sh.in", {"SUMMARY": summary, "GENERATED_BY": generated_by or "diloco sweep"}, QR=qr,
                    BASE=ns, WHERE=[f"--zone={zone}"] + ([f"--project={project}"] if project else []),
                    ACCELERATOR=sl.name, RUNTIME=runtime,
                    NODES=[f"--node-id={qr}"] if slices == 1 else [f"--node-count={slices}", f"--node-prefix={qr}"],
                    TRACK=["alpha"] if capacity == "best-effort" else [], CREATE_FLAGS=create,
                    SSH_FLAGS=["--tunnel-through-iap"] if internal_ips else [], PYTHON=sys.executable,
                    STOP_WAIT_S=stop_grace_s + 300)
    (out / "launch_tpu.sh").write_text(script)
    (out / "launch_tpu.sh").chmod(0o755)
    return plan
