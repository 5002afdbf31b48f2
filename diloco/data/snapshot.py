"""The `stdlib` corpus: a pinned snapshot of a Python standard library's source, shipped in the package, so every
machine reads the same bytes (the running interpreter's own stdlib differs per build: _sysconfigdata*.py names
the build folder).

stdlib-3.11.7.tar.xz holds the *.py files of CPython 3.11.7's Lib/ as installed by pyenv on the machine the
committed results and tests/test_same_numbers.py's second table were recorded on (built 2026-05-09), without
site-packages and the test suites (SKIP_DIRS): 734 files, 12.1 MB. License: the Python Software
Foundation License (PSF-2.0, redistributable; LICENSE inside the archive's root). The archive's sha256 is
pinned below, checked before first use, and named in every store's source identity (the run summary's
data_store fingerprint).

Made by `python -m diloco.data.snapshot OUT.tar.xz` on that machine (sorted members, mtime 0, uid/gid 0,
mode 644, xz preset 9: the same interpreter gives the same archive)."""

from __future__ import annotations

import hashlib
import os
import sys
import tarfile
import tempfile
from pathlib import Path

# tarfile's "data" filter (no absolute paths, links out of the folder, devices) where this Python has it
# (3.11.4+); Debian 12's python3.11 (3.11.2) has none, and the archives extracted here are the repo's own.
SAFE_EXTRACT = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}

NAME = "stdlib-3.11.7"
ARCHIVE = Path(__file__).with_name(f"{NAME}.tar.xz")
# skip third-party code and the (huge, machine-generated-heavy) test suites
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
SHA256 = "69737fb869b31df9291a243d107f456c8b5ed107894200c785cd2fe54a690ff7"


def python_files(root: str | Path) -> tuple[str, ...]:
    """The *.py files of a standard library folder, less SKIP_DIRS, sorted."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        files += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    return tuple(sorted(files))


def archive_sha256(path: Path = ARCHIVE) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def root(cache: Path | None) -> Path:
    """The snapshot unpacked under `cache` (or the temp folder): <cache>/corpora/<NAME>-<sha[:12]>, made once,
    atomically (unpacked beside it, then renamed into place); the archive's sha256 checked first."""
    from diloco.errors import ConfigError

    base = (cache or Path(tempfile.gettempdir()) / "diloco") / "corpora"
    out = base / f"{NAME}-{SHA256[:12]}"
    if out.is_dir():
        return out
    if not ARCHIVE.is_file() or (got := archive_sha256()) != SHA256:
        why = "is missing" if not ARCHIVE.is_file() else f"has sha256 {got[:12]}, not the pinned {SHA256[:12]}"
        raise ConfigError("data", f"the stdlib corpus snapshot {ARCHIVE} {why}; reinstall diloco "
                          "(pip install -e .) or use another corpus (data=text:<glob> | jsonl:<glob>)")
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=base, prefix=".unpack-"))
    with tarfile.open(ARCHIVE) as t:
        t.extractall(tmp, **SAFE_EXTRACT)
    try:
        os.rename(tmp / NAME, out)
    except OSError:  # another process renamed its copy first: the same bytes
        if not out.is_dir():
            raise
    finally:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def make(out: str, lib: str, files: list[str]) -> None:
    """Write the archive of `files` (paths under `lib`) plus `lib`'s LICENSE.txt, deterministically."""
    def member(path: str, arc: str) -> tuple[tarfile.TarInfo, bytes]:
        data = Path(path).read_bytes()
        info = tarfile.TarInfo(f"{NAME}/{arc}")
        info.size, info.mtime, info.mode, info.uid, info.gid = len(data), 0, 0o644, 0, 0
        return info, data

    import io
    import lzma

    entries = [member(f, os.path.relpath(f, lib)) for f in sorted(files)]
    entries.append(member(os.path.join(lib, "LICENSE.txt"), "LICENSE"))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as t:
        for info, data in entries:
            t.addfile(info, io.BytesIO(data))
    Path(out).write_bytes(lzma.compress(buf.getvalue(), preset=9))


if __name__ == "__main__":
    import sysconfig

    lib = sysconfig.get_paths()["stdlib"]
    make(sys.argv[1], lib, list(python_files(lib)))
