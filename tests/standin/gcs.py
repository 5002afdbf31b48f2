"""Cloud Storage on loopback: the `gcp-storage-emulator` package (PyPI) in its own process.

    emu = Emulator.start(state_dir)        # a free port on 127.0.0.1, objects in memory
    emu.env                                # what a process needs to reach it with no credential
    emu.create_bucket("b"); emu.client()   # google-cloud-storage, anonymous
    emu.stop()

The product's gs:// libraries reach it through environment variables only (`emu.env`):
  google-cloud-storage  STORAGE_EMULATOR_HOST (anonymous credentials when it is set)
  gcsfs / etils.epath   STORAGE_EMULATOR_HOST, and EPATH_USE_TF=false (epath would use tf.io.gfile,
                        whose GCS endpoint is fixed: TensorFlow cannot reach an emulator)
  tensorstore (orbax)   TENSORSTORE_GCS_HTTP_URL; it sends no Authorization header when no
                        credential is found
and no library may look for credentials outside loopback: the GCE metadata server (google-auth,
tensorstore, gcsfs) is pointed at a closed port on 127.0.0.1 (GCE_METADATA_HOST / _ROOT / _IP) and
NO_GCE_CHECK=true; CLOUDSDK_CONFIG names an empty folder (no gcloud user credentials).
GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false: gcsfs's default file system first asks the Storage Control
API (gRPC, not on the emulator) for the bucket's layout, fails without a credential and falls back to
the plain GCSFileSystem, with a warning on every call; this picks the plain one from the start.

`python tests/standin/gcs.py --port P --journal DIR` is the server process: the emulator's
single-threaded HTTP server with a longer accept queue (many hosts at once), quiet about clients
that hang up early (gcsfs cancels the loser of two concurrent lookups), and a journal: every object
body ever stored (uploads, overwrites, copies, composes) is also written to DIR, so a secret scan
sees what was overwritten or deleted too.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Emulator:
    endpoint: str  # http://127.0.0.1:PORT
    journal: Path  # every object body ever stored, one file each
    proc: subprocess.Popen
    closed_port: socket.socket  # bound, never listening: connections to it are refused at once
    config_dir: Path  # an empty CLOUDSDK_CONFIG
    buckets: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, state_dir: str | os.PathLike) -> "Emulator":
        state_dir = Path(state_dir)
        (state_dir / "journal").mkdir(parents=True, exist_ok=True)
        (state_dir / "cloudsdk").mkdir(exist_ok=True)
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        for _ in range(5):  # a free port can be taken between the probe and the server's bind
            port = free_port()
            log = open(state_dir / "emulator.log", "ab")
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--port", str(port),
                                     "--journal", str(state_dir / "journal")],
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
            log.close()
            endpoint = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 30
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    urllib.request.urlopen(endpoint + "/", timeout=1).read()
                    return cls(endpoint, state_dir / "journal", proc, closed, state_dir / "cloudsdk")
                except OSError:
                    time.sleep(0.05)
            proc.kill()
            proc.wait()
        closed.close()
        raise RuntimeError(f"the storage emulator did not start; see {state_dir / 'emulator.log'}")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.closed_port.close()

    @property
    def env(self) -> dict[str, str]:
        """Variables that point every gs:// library of the product at the emulator, credential-free."""
        metadata = "127.0.0.1:%d" % self.closed_port.getsockname()[1]
        return {"STORAGE_EMULATOR_HOST": self.endpoint, "TENSORSTORE_GCS_HTTP_URL": self.endpoint,
                "EPATH_USE_TF": "false", "NO_GCE_CHECK": "true", "GCE_METADATA_HOST": metadata,
                "GCE_METADATA_ROOT": metadata, "GCE_METADATA_IP": metadata,
                "CLOUDSDK_CONFIG": str(self.config_dir), "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

    def client(self):
        """google-cloud-storage, anonymous, at the emulator (whatever this process's environment says)."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(project="standin", credentials=AnonymousCredentials(),
                              client_options={"api_endpoint": self.endpoint})

    def create_bucket(self, name: str) -> str:
        body = json.dumps({"name": name}).encode()
        req = urllib.request.Request(f"{self.endpoint}/storage/v1/b?project=standin", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10).read()
        self.buckets.append(name)
        return name

    def objects(self, bucket: str, prefix: str = "") -> dict[str, bytes]:
        """{name: body} of the bucket's live objects under `prefix`."""
        b = self.client().bucket(bucket)
        return {blob.name: blob.download_as_bytes() for blob in b.list_blobs(prefix=prefix or None)}


def serve(port: int, journal: str) -> None:
    import http.server
    import itertools
    import re

    from gcp_storage_emulator import server
    from gcp_storage_emulator.storage import Storage

    import socketserver

    def handle_error(self, request, address):
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            socketserver.BaseServer.handle_error(self, request, address)

    http.server.HTTPServer.request_queue_size = 512
    http.server.HTTPServer.handle_error = handle_error
    counter = itertools.count()
    create_file = Storage.create_file

    def journaled(self, bucket_name, file_name, content, file_obj, file_id=None):
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", f"{bucket_name}/{file_name}")[-150:]
        Path(journal, f"{next(counter):07d}-{safe}").write_bytes(content or b"")
        return create_file(self, bucket_name, file_name, content, file_obj, file_id)

    Storage.create_file = journaled

    def with_generation(handler):
        """Media downloads carry the object's generation in x-goog-generation, as GCS's do: tensorstore
        (orbax's OCDBT) reads it and fails with "Malformed StorageGeneration" without it."""
        def wrapped(request, response, storage, *args, **kwargs):
            handler(request, response, storage, *args, **kwargs)
            try:
                obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
            except Exception:  # no such object: the handler answered 404 already
                return
            if response.status.value < 300:
                response["x-goog-generation"] = str(obj.get("generation", "1"))
                response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))
        return wrapped

    from gcp_storage_emulator.handlers import objects

    for _, handlers in server.HANDLERS:
        for method, handler in list(handlers.items()):
            if handler in (objects.get, objects.download):
                handlers[method] = with_generation(handler)
    import logging

    logging.getLogger().setLevel(logging.CRITICAL)
    server.create_server("127.0.0.1", port, in_memory=True).run()


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--journal", required=True)
    a = p.parse_args()
    serve(a.port, a.journal)
