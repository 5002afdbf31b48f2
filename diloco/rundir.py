"""The run folder: every record a run writes, and the one way to write it.

  config.json       the config as given (`auto`)  summary.json     final numbers, resolved plan
  metrics.jsonl     one row per logged step       downstream.jsonl downstream accuracy rows
  point.json        a sweep point's identity      failed.json      why a sweep point failed
  tb/               TensorBoard scalars           timeline/        per-process event timelines (local)
  ckpt/             orbax checkpoints (diloco/checkpoint.py)

All paths go through `path()`, an `etils.epath.Path` (what orbax uses), so a run folder may live on
a non-local filesystem such as `gs://bucket/runs/x`. Writes are atomic: a local file is written
to a temporary sibling, fsynced and renamed; an object store's write of a whole object is atomic
by itself. Readers never see half a file. TensorBoard of a remote folder is written to a local staging
folder, one events file per checkpoint interval, each copied into tb/ once (sync_tb; at close the last).
"""
from __future__ import annotations

import functools
import json
import os
import platform
import shutil
import tempfile
import time
from typing import Any, Iterable

from etils import epath

from diloco.errors import ConfigError

# config keys an older config.json may hold that no longer exist: ignored when a run folder is claimed
# (diloco sweep's staleness counts only keys both sides have). data_readers: the per-host data reader (#30)
RETIRED_KEYS = ("data_readers",)

PathLike = str | os.PathLike | epath.Path
HELD: dict[str, int] = {}  # run-folder locks this process holds: realpath of .run.lock -> descriptor


def path(p: PathLike) -> epath.Path:
    """The run-folder path type: local paths stay local (made absolute); `gs://…` stays remote."""
    s = os.fspath(p)
    return epath.Path(s) if is_remote(s) else epath.Path(os.path.abspath(s))


def is_remote(p: PathLike) -> bool:
    return "://" in os.fspath(p)


# scheme → Python modules of which one gives epath (and orbax, TFDS, seqio) that filesystem
SUPPORT = {"gs": ("gcsfs", "tensorflow"), "s3": ("s3fs", "tensorflow"), "az": ("adlfs",), "hf": ("huggingface_hub",)}
INSTALL = {"gs": "pip install gcsfs google-cloud-storage (both in the project's [tpu] extra)",
           "s3": "pip install s3fs", "az": "pip install adlfs", "hf": "pip install huggingface_hub"}


def filesystem_support(scheme: str) -> str | None:
    """The installed module that serves `scheme://` paths, or None."""
    import importlib.util

    return next((m for m in SUPPORT.get(scheme, ()) if importlib.util.find_spec(m) is not None), None)


def require(p: PathLike, field: str) -> epath.Path:
    """path(p), or a ConfigError naming `field` when p is on a filesystem this install cannot reach."""
    s = os.fspath(p)
    if not s.strip():
        raise ConfigError(field, "'' is empty (it would write into the current folder); name a folder, e.g. runs/toy")
    if is_remote(s):
        scheme = s.split("://", 1)[0]
        if scheme not in SUPPORT:
            raise ConfigError(field, f"{s}: unsupported filesystem {scheme}://; use a local path or one of "
                              f"{', '.join(k + '://' for k in SUPPORT)}")
        if filesystem_support(scheme) is None:
            raise ConfigError(field, f"{s} is on {scheme}:// but no support for it is installed: {INSTALL[scheme]}")
    return path(s)


def require_folder(p: PathLike, field: str) -> None:
    """ConfigError naming `field` when the local path p, or a folder above it, exists as a file."""
    if is_remote(os.fspath(p)):
        return
    q = os.path.abspath(os.fspath(p))
    while not os.path.exists(q) and os.path.dirname(q) != q:
        q = os.path.dirname(q)
    if not os.path.isdir(q):
        raise ConfigError(field, f"{q} is a file, not a folder; give a folder")


def atomic_write_text(p: PathLike, text: str) -> None:
    p = path(p)
    if is_remote(p):  # an object store replaces a whole object at once
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        return
    local = os.fspath(p)
    os.makedirs(os.path.dirname(local), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(local), prefix=f".{os.path.basename(local)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, local)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(p: PathLike, obj: Any) -> None:
    atomic_write_text(p, json.dumps(obj, indent=1, sort_keys=True, default=json_default) + "\n")


def write_jsonl(p: PathLike, rows: Iterable[dict]) -> None:
    atomic_write_text(p, "".join(json.dumps(r, default=json_default) + "\n" for r in rows))


def json_default(x):
    import numpy as np

    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x)}")


def upload_tree(local: str, dest: epath.Path, sent: dict[str, int]) -> None:
    """Copy every file under the local folder whose size is not `sent[its relative path]` to dest/<relative
    path>, whole; `sent` records what went."""
    for folder, _, files in os.walk(local):
        for name in sorted(files):
            f = os.path.join(folder, name)
            rel, size = os.path.relpath(f, local), os.path.getsize(f)
            if sent.get(rel) != size:
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                with open(f, "rb") as src:
                    (dest / rel).write_bytes(src.read())
                sent[rel] = size


def read_json(p: PathLike, default: Any = None) -> Any:
    p = path(p)
    return json.loads(p.read_text()) if p.exists() else default


def read_jsonl(p: PathLike) -> list[dict]:
    """Rows of a JSONL file; a torn last line (a crash mid-append) ends the list."""
    p = path(p)
    rows = []
    for line in p.read_text().splitlines() if p.exists() else []:
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def append_jsonl(p: PathLike, row: dict) -> None:
    """One row, durably: fsynced locally; rewritten whole on an object store (no appends there)."""
    p = path(p)
    if is_remote(p):
        atomic_write_text(p, (p.read_text() if p.exists() else "") + json.dumps(row, default=json_default) + "\n")
        return
    with open(os.fspath(p), "a", encoding="utf-8") as f:
        f.write(json.dumps(row, default=json_default) + "\n")
        f.flush()
        os.fsync(f.fileno())


def truncate_jsonl(p: PathLike, step: int) -> None:
    """On resume, drop rows logged after the checkpoint's step (they will be logged again)."""
    p = path(p)
    if p.exists():
        write_jsonl(p, [r for r in read_jsonl(p) if r.get("step", 0) <= step])


def versions() -> dict:
    import flax
    import jax
    import optax

    from diloco import __version__

    return {"python": platform.python_version(), "jax": jax.__version__, "flax": flax.__version__,
            "optax": optax.__version__, "diloco": __version__, "backend": jax.default_backend(),
            "devices": jax.device_count()}


@functools.cache
def code_version() -> dict:
    """{diloco: version, commit: git HEAD of the checkout the package runs from (+"-dirty" when tracked
    files differ from it), or None outside a git checkout} — recorded beside every checkpoint."""
    import subprocess

    from diloco import __version__

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*a) -> str | None:
        try:
            r = subprocess.run(["git", "-C", root, *a], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    if sha and git("status", "--porcelain", "--untracked-files=no"):
        sha += "-dirty"
    return {"diloco": __version__, "commit": sha}


def flatten(d, prefix: str = "") -> dict:
    """{"a.b": value} of a nested dict or ConfigDict (a config, or its JSON form: a run's config.json)."""
    out = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}{k}.") if hasattr(v, "items") else {f"{prefix}{k}": v})
    return out


def config_changes(old: dict, new: dict, defaults: dict) -> list[str]:
    """'key: old → new' for every dotted key whose value differs between a run's record and a config,
    retired keys left out; a key the record lacks is no change when the new value is its default."""
    o, n, d = flatten(old), flatten(new), flatten(defaults)
    missing = object()
    out = []
    for k in sorted(o.keys() | n.keys()):
        if k.split(".")[0] in RETIRED_KEYS or (k not in o and k in d and n.get(k) == d[k]):
            continue
        a, b = o.get(k, missing), n.get(k, missing)
        if a != b:
            out.append(f"{k}: {'(none)' if a is missing else json.dumps(a)} → {'(none)' if b is missing else json.dumps(b)}")
    return out


class RunDir:
    """One run's folder. `primary=False` (every process but 0 of a multi-process run) writes nothing."""

    def __init__(self, root: PathLike, primary: bool = True):
        self.root, self.primary = path(root), primary
        self.tb, self.tb_local, self.tb_sent = None, None, {}

    def __truediv__(self, name: str) -> epath.Path:
        return self.root / name

    @property
    def ckpt(self) -> epath.Path:
        return self.root / "ckpt"

    def make(self) -> None:
        """Create the folder and, in the primary process of a local run, hold its lock (`.run.lock`, an
        fcntl.flock the kernel releases when the process ends, SIGKILL included) for the run's life: a
        second run on a busy folder is refused in one line naming the holder. Unusable folder: one line."""
        try:
            if self.primary or not is_remote(self.root):
                self.root.mkdir(parents=True, exist_ok=True)
            if self.primary and not is_remote(self.root):
                self._lock()
        except (FileExistsError, NotADirectoryError):
            raise ConfigError("workdir", f"{self.root} (or a folder above it) is a file, not a folder; "
                              "use another --workdir") from None
        except PermissionError as e:
            raise ConfigError("workdir", f"{self.root} is not writable ({e.strerror}); use a folder you can "
                              "write to") from None
        except OSError as e:  # EROFS, ENOSPC, …
            raise ConfigError("workdir", f"{self.root}: {e.strerror}; use a writable folder with space") from None

    def _lock(self) -> None:
        import fcntl
        import socket

        key = os.path.realpath(self / ".run.lock")
        if key in HELD:  # this process holds it already (a run of it that stopped before close())
            self.lock_fd = HELD[key]
            return
        fd = os.open(key, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ConfigError("workdir", f"{self.root} is in use by {holder}; wait for that run to end (or stop "
                              "it), or use another --workdir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
        self.lock_fd = HELD[key] = fd  # held until close() or the end of the process

    def claim(self, cfg_json: str, defaults_json: str = "{}") -> None:
        """Write config.json, or check that the folder holds a run of this same config. A key the record
        lacks (added to the code since) counts as the same when the new value is its default."""
        old = read_json(self / "config.json")
        changed = [] if old is None else config_changes(old, json.loads(cfg_json), json.loads(defaults_json))
        if changed:
            shown = "; ".join(changed[:3]) + (f"; +{len(changed) - 3} more" if len(changed) > 3 else "")
            raise ConfigError("workdir", f"{self.root} holds a run with a different config ({shown}); use a new "
                              "--workdir or delete it")
        if self.primary and old is None:  # an older record (retired keys included) is kept as it was written
            atomic_write_text(self / "config.json", cfg_json)

    def set_aside(self) -> epath.Path | None:
        """Move ckpt/ and the run's records (metrics.jsonl, downstream.jsonl, summary.json, tb/, timeline/)
        into set_aside/<unix time>/ (a fresh start keeps what was there); the folder, or None if nothing was."""
        names = [n for n in ("ckpt", "metrics.jsonl", "downstream.jsonl", "summary.json", "tb", "timeline")
                 if (self / n).exists()]
        if not names or names == ["ckpt"] and not any((self / "ckpt").iterdir()):
            return None
        aside = self / "set_aside" / str(int(time.time()))
        if self.primary:
            aside.mkdir(parents=True, exist_ok=True)
            for n in names:
                (self / n).rename(aside / n)
        return aside

    def resume_records(self, step: int) -> None:
        if self.primary:
            truncate_jsonl(self / "metrics.jsonl", step)
            truncate_jsonl(self / "downstream.jsonl", step)

    def log(self, row: dict, name: str = "metrics.jsonl") -> None:
        if not self.primary:
            return
        append_jsonl(self / name, row)
        if name == "metrics.jsonl":
            self._tb_log(row)

    def summary(self) -> dict:
        return read_json(self / "summary.json", {})

    def write_summary(self, summary: dict) -> None:
        if self.primary:
            atomic_write_json(self / "summary.json", summary)
            self._tb_hparams(summary)

    def _writer(self):
        """The run's TensorBoard writer: into tb/, or for a remote folder (an object store has no appends)
        into a local staging folder that sync_tb copies into tb/."""
        if self.tb is None:
            from tensorboardX import SummaryWriter

            if is_remote(self.root) and self.tb_local is None:
                self.tb_local = tempfile.mkdtemp(prefix="diloco-tb-")
            part = f".{len(os.listdir(self.tb_local))}" if self.tb_local else ""  # two files of one second differ
            self.tb = SummaryWriter(self.tb_local or os.fspath(self / "tb"), filename_suffix=part)
        return self.tb

    def sync_tb(self) -> None:
        """TensorBoard into tb/ as far as now (at a checkpoint). A remote folder's writer is closed (its
        queue drained) and its staged file written whole, one object; the next row opens the next file."""
        if self.tb is not None and self.tb_local is None:
            self.tb.flush()
        elif self.tb is not None:
            self.tb.close()
            self.tb = None
            upload_tree(self.tb_local, self / "tb", self.tb_sent)

    def _tb_hparams(self, summary: dict) -> None:
        """The run's config (config.json, flattened: outer.lr, …) as TensorBoard hparams with the summary's
        numbers as their metrics (hparam/final_eval_loss, …), in tb/hparams: the HParams tab compares runs."""
        cfg = read_json(self / "config.json", {})
        if not cfg:
            return
        from tensorboardX import SummaryWriter
        from tensorboardX.summary import hparams

        flat = {k: v if isinstance(v, (bool, int, float, str)) else json.dumps(v) for k, v in flatten(cfg).items()}
        metrics = {f"hparam/{k}": float(v) for k, v in summary.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        staged = tempfile.mkdtemp(prefix="diloco-tb-") if is_remote(self.root) else None
        with SummaryWriter(staged or os.fspath(self / "tb" / "hparams")) as tb:  # its own writer: the run's is closed
            for part in hparams(flat, metrics):
                tb.file_writer.add_summary(part)
            for k, v in metrics.items():
                tb.add_scalar(k, v, cfg.get("steps"))
        if staged:
            upload_tree(staged, self / "tb" / "hparams", {})
            shutil.rmtree(staged, ignore_errors=True)

    def _tb_log(self, row: dict) -> None:
        if self._writer() is None:
            return
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)):
                self.tb.add_scalar(k, v, row["step"])
            elif k.endswith("_replicas") and isinstance(v, list):  # one scalar per replica: train_loss/replica_0 …
                for m, x in enumerate(v):
                    self.tb.add_scalar(f"{k[:-len('_replicas')]}/replica_{m}", x, row["step"])

    def close(self) -> None:
        if getattr(self, "lock_fd", None) is not None:
            HELD.pop(os.path.realpath(self / ".run.lock"), None)
            os.close(self.lock_fd)  # closing the descriptor releases the flock
            self.lock_fd = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.tb_local is not None:  # what the writer's close flushed goes too; then the staging folder
            upload_tree(self.tb_local, self / "tb", self.tb_sent)
            shutil.rmtree(self.tb_local, ignore_errors=True)
            self.tb_local = None
