"""`diloco fetch ROOT [OUT]`: bring a run root's records (local or gs://) to a local folder, then its tables.

Copies every run record `diloco tables` reads (RECORDS: config.json, summary.json, metrics.jsonl, …) found
under ROOT, keeping the layout, into OUT (default `runs/<ROOT's last name>`); checkpoints, TensorBoard,
timelines, set-aside records and a Cloud TPU launch's `_pods/` state are not walked into (SKIP). A file is
written to a temporary sibling and renamed, then given the source's mtime, so an interrupted fetch keeps what it
finished and the same command copies only what is missing or changed (size or mtime differ; a metrics.jsonl
that grew). Every read goes through the run folder's path type (diloco.rundir.path: etils epath), as training
writes them. Then `diloco tables --root OUT` (unless --no-tables).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

from diloco.errors import ConfigError
from diloco.rundir import atomic_write_text, is_remote, require, require_folder

RECORDS = ("config.json", "summary.json", "metrics.jsonl", "point.json", "failed.json", "downstream.jsonl",
           "which_params.json")
SKIP = ("ckpt", "tb", "timeline", "set_aside", "_pods", "slurm")


@dataclass
class Fetched:
    copied: list[str]  # paths relative to ROOT, in the order copied
    unchanged: int
    bytes: int


def records(root) -> list[tuple[str, int, int]]:
    """(path relative to root, size, mtime in s) of every record under root, folders in SKIP not entered."""
    if is_remote(root):  # listings an earlier call in this process cached (gcsfs) would hide new writes
        from etils.epath import backend

        try:
            backend.fsspec_backend.fs(os.fspath(root)).invalidate_cache()
        except (ImportError, ValueError):  # epath reads it through TensorFlow: nothing cached
            pass
    out, base = [], os.fspath(root).split("://", 1)[-1].rstrip("/")
    for folder, dirs, files in root.walk():  # an object store's folders come back without their gs://
        dirs[:] = sorted(d for d in dirs if d not in SKIP)
        under = os.fspath(folder).split("://", 1)[-1][len(base):].strip("/")
        for rel in sorted(f"{under}/{name}".lstrip("/") for name in files if name in RECORDS):
            st = (root / rel).stat()  # mtime on gs://: from the object's generation, new at every write
            out.append((rel, int(st.length or 0), int(st.mtime or 0)))
    return out


def fresh(dest: str, size: int, mtime: int) -> bool:
    """dest is a copy of a source of this size and mtime (an unknown mtime, 0, is never fresh)."""
    try:
        st = os.stat(dest)
    except FileNotFoundError:
        return False
    return mtime != 0 and st.st_size == size and int(st.st_mtime) == mtime


def fetch(root: str, out: str) -> Fetched:
    """Copy root's records into the local folder out (see the module docstring)."""
    src = require(root, "ROOT")
    if is_remote(out):
        raise ConfigError("OUT", f"{out} is not local; name a folder on this machine, e.g. runs/x")
    require_folder(out, "OUT")
    dst = os.path.abspath(out)
    if not is_remote(src) and os.path.realpath(dst) == os.path.realpath(os.fspath(src)):
        raise ConfigError("OUT", f"{out} is ROOT itself; name another folder")
    try:
        found = records(src) if src.is_dir() else None
    except ConfigError:
        raise
    except (OSError, ValueError) as e:  # no credential, no permission, no such bucket …
        why = (str(e).splitlines() or [""])[0][:160]
        raise ConfigError("ROOT", f"{root}: cannot list it ({type(e).__name__}: {why}); check the path and "
                          "that `gcloud auth application-default login` can read it") from None
    if found is None:
        raise ConfigError("ROOT", f"{root} is not a folder (or not readable); name a sweep root (diloco sweep "
                          "--root) or a run folder")
    if not any(os.path.basename(rel) == "config.json" for rel, _, _ in found):
        raise ConfigError("ROOT", f"no run records (config.json) under {root}; name a sweep root (diloco sweep "
                          "--root) or a run folder")
    done = Fetched([], 0, 0)
    for rel, size, mtime in found:
        dest = os.path.join(dst, rel)
        if fresh(dest, size, mtime):
            done.unchanged += 1
            continue
        text = (src / rel).read_text()
        atomic_write_text(dest, text)
        if mtime:
            os.utime(dest, (time.time(), mtime))
        done.copied.append(rel)
        done.bytes += len(text.encode())
    return done


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="diloco fetch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", metavar="ROOT", help="a sweep root or run folder: a local path or gs://BUCKET/…")
    ap.add_argument("out", metavar="OUT", nargs="?", help="local folder (default: runs/<ROOT's last name>)")
    ap.add_argument("--no-tables", action="store_true", help="copy only; do not run `diloco tables` on OUT")
    args = ap.parse_args(argv)
    out = args.out or os.path.join("runs", os.fspath(args.root).rstrip("/").rsplit("/", 1)[-1])
    t0 = time.time()
    try:
        done = fetch(args.root, out)
    except ConfigError as e:
        print(f"diloco fetch: bad input: {e}", file=sys.stderr)
        return 2
    print(f"diloco fetch: {len(done.copied)} file(s) copied ({done.bytes / 1e6:.2f} MB), {done.unchanged} unchanged, "
          f"{args.root} → {out} ({time.time() - t0:.1f} s)")
    if args.no_tables:
        return 0
    from diloco import report

    return report.main(["--root", out])
