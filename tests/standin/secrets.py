"""Find secrets of the test's own environment in what a launch wrote: `find_secrets(paths_or_blobs)`.

A secret is (1) the value of an environment variable whose name looks like a credential (TOKEN,
KEY, SECRET, PASSWORD, PASSWD, CREDENTIAL, AUTH; values of 8 characters or more), found verbatim,
or (2) a PEM private key block (`-----BEGIN … PRIVATE KEY-----`; certificates are public and not
reported). Folders are scanned recursively, skipping third-party package trees (site-packages,
dist-packages) and download caches (.cache), which ship test keys of their own.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterable, Mapping

SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.IGNORECASE)
PRIVATE_KEY = re.compile(rb"-----BEGIN [A-Z0-9 ]*PRIVATE KEY( BLOCK)?-----")
SKIP_DIRS = ("site-packages", "dist-packages", ".cache")


def secret_values(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """{name: value} of the environment's variables that look like credentials."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if SECRET_NAME.search(k) and len(v) >= 8}


def _blobs(items: Iterable) -> Iterable[tuple[str, bytes]]:
    for item in items:
        if isinstance(item, (bytes, str)) and not (isinstance(item, str) and os.path.exists(item)):
            yield "<blob>", item.encode() if isinstance(item, str) else item
        elif isinstance(item, Mapping):  # {name: bytes}, e.g. a bucket's objects
            for name, data in item.items():
                yield str(name), data
        else:
            p = Path(item)
            files = [p] if p.is_file() else [
                Path(d, f) for d, dirs, fs in os.walk(p) for f in fs
                if not any(part in SKIP_DIRS for part in Path(d).relative_to(p).parts)]
            for f in files:
                if f.is_file() and not f.is_symlink():
                    yield str(f), f.read_bytes()


def find_secrets(paths_or_blobs: Iterable, environ: Mapping[str, str] | None = None) -> list[str]:
    """Where a secret appears: ['<file or object name>: value of $NAME' | ': a PEM private key'].
    Items: file or folder paths, bytes/str blobs, or {name: bytes} mappings (e.g. Bucket.objects())."""
    values = {name: v.encode() for name, v in secret_values(environ).items()}
    found = []
    for where, data in _blobs(paths_or_blobs):
        found += [f"{where}: value of ${name}" for name, v in values.items() if v in data]
        if PRIVATE_KEY.search(data):
            found.append(f"{where}: a PEM private key")
    return found
