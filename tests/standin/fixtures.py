"""pytest fixtures of the Cloud TPU / Cloud Storage stand-in (tests/conftest.py imports them).

    gcs_emulator  (session)   the storage emulator process: standin.gcs.Emulator
    gcs           (function)  a fresh bucket on it, and this test process pointed at it (env vars,
                              no credential): gs:// through epath, orbax/tensorstore and
                              google-cloud-storage reaches the emulator. → Bucket
    standin       (function)  Cloud TPU: a state folder, the stub `gcloud` first on PATH for this
                              test and its subprocesses, the bucket above. → Standin (a cloud.Cloud)
Nothing outlives a test: the `standin` finalizer SIGKILLs every process any host started.
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from .cloud import Cloud
from .gcs import Emulator
from .secrets import find_secrets

_BUCKETS = itertools.count()
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Bucket:
    """One bucket on the emulator: gs:// URLs and direct reads/writes (google-cloud-storage, anonymous)."""
    name: str
    emulator: Emulator

    def url(self, *parts: str) -> str:
        return "/".join([f"gs://{self.name}", *[p.strip("/") for p in parts]])

    @property
    def env(self) -> dict[str, str]:
        return self.emulator.env

    def _blob(self, path: str):
        return self.emulator.client().bucket(self.name).blob(path.removeprefix(f"gs://{self.name}/"))

    def read(self, path: str) -> bytes:
        return self._blob(path).download_as_bytes()

    def write(self, path: str, data: bytes | str) -> None:
        self._blob(path).upload_from_string(data)

    def exists(self, path: str) -> bool:
        return self._blob(path).exists()

    def objects(self, prefix: str = "") -> dict[str, bytes]:
        """{object name: body} of the live objects under `prefix` (a name or gs:// URL)."""
        return self.emulator.objects(self.name, prefix.removeprefix(f"gs://{self.name}/"))


class Standin(Cloud):
    """The stand-in's state (cloud.Cloud: create/describe/ssh/kill_host/repair_host/set_state/processes,
    invocations) plus the test's view: the bucket, the environment for subprocesses, `gcloud(...)`."""

    def __init__(self, root: Path, bucket: Bucket):
        super().__init__(root)
        self.bucket = bucket

    @property
    def env(self) -> dict[str, str]:
        """The test process's environment as the fixture set it (stub gcloud first on PATH, emulator)."""
        return dict(os.environ)

    def gcloud(self, *args: str, input: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run the stub `gcloud ARGS…` as the laptop would; text output, never raises on failure."""
        return subprocess.run([str(self.bin_dir / "gcloud"), *args], input=input, capture_output=True, text=True,
                              timeout=timeout, env=self.env)

    def wait_state(self, name: str, state: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.state(name) != state:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} is {self.state(name)}, not {state}, after {timeout} s")
            time.sleep(0.05)

    def wait_for(self, predicate, timeout: float = 30, what: str = "condition"):
        """Poll `predicate()` until it returns something truthy; that value, or TimeoutError."""
        deadline = time.monotonic() + timeout
        while not (value := predicate()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not met after {timeout} s")
            time.sleep(0.05)
        return value

    def secrets(self) -> list[str]:
        """find_secrets over everything the stand-in holds: its state folder (host homes, logs,
        invocation log), every object body the emulator ever stored, and the bucket's live objects."""
        return find_secrets([self.root, self.bucket.emulator.journal, self.bucket.objects()])

    def leaks(self) -> list[str]:
        """secrets(), less a host's unpacked copies of the repository's own files (tests/test_standin.py
        holds a fake PEM key to test the scanner): shipped as they are, not leaked from the environment."""
        out = []
        for finding in self.secrets():
            path = finding.rsplit(": ", 1)[0]
            m = re.search(r"/tree-[0-9a-f]{12}/(.+)$", path)
            if m and (REPO / m.group(1)).is_file() and Path(path).read_bytes() == (REPO / m.group(1)).read_bytes():
                continue
            out.append(finding)
        return out


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory):
    state = tmp_path_factory.mktemp("gcs-emulator")
    emu = Emulator.start(state)
    yield emu
    emu.stop()
    shutil.rmtree(state, ignore_errors=True)  # the journal holds every object body of the session


@pytest.fixture
def gcs(gcs_emulator, request, monkeypatch) -> Bucket:
    """A fresh bucket; this process's gs:// libraries go to the emulator, with no credential."""
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    bucket = Bucket(gcs_emulator.create_bucket(f"b{next(_BUCKETS)}-{slug}"), gcs_emulator)
    for k, v in gcs_emulator.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    # Settings that libraries read once, at import, if they were imported before this test.
    meta = sys.modules.get("google.auth.compute_engine._metadata")
    if meta is not None:
        monkeypatch.setattr(meta, "_GCE_METADATA_HOST", gcs_emulator.env["GCE_METADATA_HOST"])
        monkeypatch.setattr(meta, "_NO_GCE_CHECK", True)
    _forget_filesystems()
    yield bucket
    _forget_filesystems()


def _forget_filesystems() -> None:
    """File systems made before this test (another endpoint, or a test's fake gs://) are not reused:
    gs:// is gcsfs again, and gcsfs's instances and epath's cached file system and EPATH_USE_TF go."""
    import fsspec
    import gcsfs

    for name in ("gs", "gcs"):  # the class itself: a class path would not replace a registered class
        fsspec.register_implementation(name, gcsfs.GCSFileSystem, clobber=True)
    gcsfs.GCSFileSystem.clear_instance_cache()
    if "etils.epath.gpath" in sys.modules:
        sys.modules["etils.epath.gpath"]._is_tf_installed.cache_clear()
        sys.modules["etils.epath.backend"].fsspec_backend._get_filesystem.cache_clear()


@pytest.fixture
def standin(gcs, tmp_path, monkeypatch) -> Standin:
    """Cloud TPU on this machine; `gcloud` on PATH is the stub for this test and its subprocesses."""
    root = tmp_path / "standin"
    Cloud.init(root, gcs.env)
    cloud = Standin(root, gcs)
    monkeypatch.setenv("PATH", f"{cloud.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("GCLOUD_STANDIN_DIR", str(cloud.root))
    yield cloud
    cloud.kill_all()
