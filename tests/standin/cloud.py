"""Cloud TPU on this machine: queued resources whose TPU VM hosts are local processes.

State lives in one folder (GCLOUD_STANDIN_DIR):

    config.json                     emulator env, interpreter, CPU devices per host, state delays
    invocations.jsonl               one row per `gcloud` call: argv, time, host (null = the laptop)
    _bin/gcloud                     the stub (execs this interpreter on tests/standin/gcloud.py)
    <qr>/resource.json              the queued resource (what `describe` renders)
    <qr>/metadata/<key>             files given with --metadata-from-file (startup-script)
    <qr>/slice<s>-worker<w>/host.json   {"state": NEW|UP|DOWN, "boots": n}
    <qr>/slice<s>-worker<w>/home/   the host's home; home/startup.log is its startup script's output
    _deleted/<qr>-<time>/           a deleted resource's folder, kept for inspection

A host's processes are every process whose environment holds GCLOUD_STANDIN_HOST=<its folder>
(set on what the stand-in starts there, inherited by whatever those start, daemons included, since
`setsid`/`nohup` keep the environment). Killing a host kills all of them; a process that empties its
environment (`env -i`) would escape. A host's environment is what a TPU VM worker has (see
`Cloud.host_env`), never the test process's.

Lifecycle: `create` → WAITING_FOR_RESOURCES → (waiting_s) PROVISIONING → (provisioning_s) ACTIVE,
then every host boots at once: its startup script (if any) runs detached, like the VM's startup
script service. `waiting_s=None` holds the resource in WAITING_FOR_RESOURCES until
`set_state(name, "ACTIVE")`.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .gcs import free_port

MARKER = "GCLOUD_STANDIN_HOST"
HERE = Path(__file__).resolve().parent
STATES = ("CREATING", "ACCEPTED", "WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE", "SUSPENDING", "SUSPENDED",
          "FAILED", "DELETING")
DOWN_STATES = ("SUSPENDING", "SUSPENDED", "FAILED", "PREEMPTED")  # set_state: every host is killed
NAME = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")


class GcloudError(Exception):
    """A failure the real service would report: `gcloud` prints it and exits 1."""


def accelerator_hosts(accelerator_type: str) -> tuple[int, int]:
    """(chips, hosts) of one slice of a type Cloud TPU accepts: diloco.tpu.accelerators' table (the
    launcher's source of truth; own_accelerator_hosts is the tests' independent check of it)."""
    from diloco.errors import ConfigError
    from diloco.tpu.accelerators import parse

    try:
        s = parse(accelerator_type)
    except ConfigError as e:
        raise GcloudError(f"INVALID_ARGUMENT: accelerator type {accelerator_type!r} does not exist ({e})") from None
    return s.chips, s.hosts


def own_accelerator_hosts(accelerator_type: str) -> tuple[int, int]:
    """v4-N / v5p-N count TensorCores (2 per chip; 3-D slices AxBxC with every side ≤ 4, or every side
    a multiple of 4; at most 4096 / 6144 chips); v5litepod-N / v6e-N count chips (1, 4, 8, …, 256: one
    host up to 8 chips). 4 chips per host otherwise."""
    m = re.fullmatch(r"(v4|v5p|v5litepod|v6e)-(\d+)", accelerator_type)
    if not m:
        raise GcloudError(f"INVALID_ARGUMENT: accelerator type {accelerator_type!r} is not a TPU type")
    gen, n = m.group(1), int(m.group(2))
    if gen in ("v4", "v5p"):
        chips = n // 2
        ok = n % 2 == 0 and chips <= {"v4": 4096, "v5p": 6144}[gen] and (chips in (4, 8, 16, 32, 64) or any(
            chips % (a * b) == 0 and chips // (a * b) % 4 == 0 and chips // (a * b) >= b
            for a in range(4, round(chips ** (1 / 3)) + 1, 4) for b in range(a, chips // a + 1, 4)))
    else:
        chips = n
        ok = n in (1, 4, 8, 16, 32, 64, 128, 256)
    if not ok:
        raise GcloudError(f"INVALID_ARGUMENT: accelerator type {accelerator_type!r} does not exist")
    return chips, 1 if chips <= (8 if gen in ("v5litepod", "v6e") else 4) else chips // 4


def duration_seconds(text: str) -> int:
    """gcloud's duration format: 30m, 6h, 1d2h, 90s (or a bare number of seconds)."""
    if re.fullmatch(r"\d+", text):
        return int(text)
    parts = re.findall(r"(\d+)([dhms])", text.lower())
    if not parts or "".join(a + b for a, b in parts) != text.lower():
        raise ValueError(f"invalid duration {text!r} (use e.g. 30m, 6h, 1d)")
    return sum(int(a) * {"d": 86400, "h": 3600, "m": 60, "s": 1}[u] for a, u in parts)


@dataclass(frozen=True)
class Host:
    slice: int
    worker: int
    node_id: str
    dir: Path

    @property
    def home(self) -> Path:
        return self.dir / "home"

    @property
    def label(self) -> str:
        return f"{self.node_id} worker-{self.worker}"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


class Cloud:
    """One stand-in's state folder, and every operation on it (the stub `gcloud` and the tests' controls)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).resolve()

    # ------------------------------------------------------------------ set-up
    @classmethod
    def init(cls, root: str | os.PathLike, emulator_env: dict[str, str], *, cpu_devices: int = 2,
             waiting_s: float | None = 0.2, provisioning_s: float = 0.2, delete_s: float = 0.2,
             project: str = "standin-project") -> "Cloud":
        cloud = cls(root)
        cloud.root.mkdir(parents=True, exist_ok=True)
        _write_json(cloud.root / "config.json", {
            "python": sys.executable, "emulator_env": emulator_env, "cpu_devices": cpu_devices,
            "waiting_s": waiting_s, "provisioning_s": provisioning_s, "delete_s": delete_s, "project": project})
        (cloud.bin_dir).mkdir(exist_ok=True)
        stub = cloud.bin_dir / "gcloud"
        stub.write_text("#!/bin/sh\n# stand-in gcloud: tests/standin/gcloud.py (the subset the launcher uses)\n"
                        f"export GCLOUD_STANDIN_DIR='{cloud.root}'\n"
                        f"exec '{sys.executable}' '{HERE / 'gcloud.py'}' \"$@\"\n")
        stub.chmod(0o755)
        (cloud.root / "invocations.jsonl").touch()
        return cloud

    @property
    def bin_dir(self) -> Path:
        return self.root / "_bin"

    @property
    def config(self) -> dict:
        return json.loads((self.root / "config.json").read_text())

    def configure(self, **changes) -> None:
        """Change config.json (cpu_devices, waiting_s, provisioning_s, delete_s) for later operations."""
        with self.lock():
            _write_json(self.root / "config.json", {**self.config, **changes})

    @contextlib.contextmanager
    def lock(self):
        with open(self.root / "_lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    # ------------------------------------------------------------------ invocation log
    def log_invocation(self, argv: list[str]) -> None:
        host = os.environ.get(MARKER)
        row = {"argv": argv, "time": time.time(), "host": os.path.relpath(host, self.root) if host else None}
        with open(self.root / "invocations.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    def invocations(self) -> list[dict]:
        """Every `gcloud` call so far: {"argv": [...], "time": t, "host": "qr/slice0-worker1" | None}."""
        return [json.loads(line) for line in (self.root / "invocations.jsonl").read_text().splitlines() if line]

    # ------------------------------------------------------------------ resources
    def _rdir(self, name: str) -> Path:
        return self.root / name

    def resource(self, name: str) -> dict | None:
        p = self._rdir(name) / "resource.json"
        return json.loads(p.read_text()) if NAME.fullmatch(name) and p.exists() else None

    def names(self) -> list[str]:
        return sorted(p.parent.name for p in self.root.glob("*/resource.json"))

    def _get(self, name: str, zone: str | None = None) -> dict:
        r = self.resource(name)
        if r is None or (zone is not None and r["zone"] != zone):
            where = f" in zone {zone}" if zone else ""
            raise GcloudError(f"NOT_FOUND: queued resource {name!r} was not found{where}")
        return r

    def _put(self, r: dict) -> None:
        _write_json(self._rdir(r["name"]) / "resource.json", r)

    def _set_state(self, r: dict, state: str, initiator: str = "SERVICE") -> None:
        r["state"] = state
        r["stateInitiator"] = initiator
        r["history"].append([state, time.time()])
        self._put(r)

    def state(self, name: str) -> str | None:
        r = self.resource(name)
        return r and r["state"]

    def create(self, name: str, *, zone: str, accelerator_type: str, runtime_version: str,
               node_id: str | None = None, node_count: int | None = None, node_prefix: str | None = None,
               project: str | None = None, tier: str | None = None, valid_until_duration: str | None = None,
               service_account: str | None = None, network: str | None = None, subnetwork: str | None = None,
               internal_ips: bool = False, metadata_files: dict[str, str] | None = None) -> dict:
        """A new queued resource in WAITING_FOR_RESOURCES; hosts boot once it turns ACTIVE."""
        if not NAME.fullmatch(name):
            raise GcloudError(f"INVALID_ARGUMENT: {name!r} is not a valid queued resource name (lowercase letters, "
                              "digits and hyphens, starting with a letter)")
        chips, hosts = accelerator_hosts(accelerator_type)
        if (node_id is None) == (node_count is None):
            raise GcloudError("INVALID_ARGUMENT: exactly one of --node-id and --node-count is required")
        if node_count is not None and node_count < 1:
            raise GcloudError("INVALID_ARGUMENT: --node-count must be at least 1")
        node_ids = [node_id] if node_id else [f"{node_prefix or name}-{i}" for i in range(node_count)]
        seconds = duration_seconds(valid_until_duration) if valid_until_duration else None
        metadata = {}
        for key, path in (metadata_files or {}).items():
            if not os.path.isfile(path):
                raise GcloudError(f"INVALID_ARGUMENT: --metadata-from-file {key}={path}: no such file")
            metadata[key] = path
        with self.lock():
            if self.resource(name) is not None:
                raise GcloudError(f"ALREADY_EXISTS: queued resource {name!r} already exists")
            rdir = self._rdir(name)
            if rdir.exists():
                shutil.rmtree(rdir)
            (rdir / "metadata").mkdir(parents=True)
            for key, path in metadata.items():
                shutil.copyfile(path, rdir / "metadata" / key)
            r = {"name": name, "zone": zone, "project": project or self.config["project"],
                 "acceleratorType": accelerator_type, "runtimeVersion": runtime_version, "chips": chips,
                 "hostsPerSlice": hosts, "nodeIds": node_ids, "multislice": node_count is not None,
                 "nodePrefix": node_prefix if node_count is not None else None, "tier": tier,
                 "validUntilSeconds": seconds, "serviceAccount": service_account, "network": network,
                 "subnetwork": subnetwork, "internalIps": internal_ips, "metadataKeys": sorted(metadata),
                 "coordinatorPort": free_port(), "createTime": _now(), "history": []}
            self._set_state(r, "WAITING_FOR_RESOURCES", "USER")
            for h in self._hosts(r):
                self._image_home(h)
                _write_json(h.dir / "host.json", {"state": "NEW", "boots": 0})
        if self.config["waiting_s"] is not None:
            self._detach([self.config["python"], str(HERE / "gcloud.py"), "standin", "_provision", name],
                         marker=self._rdir(name) / "_provisioner")
        return r

    def provision(self, name: str) -> None:
        """The service's side of `create` (a detached process): the states, then every host boots."""
        cfg = self.config
        for before, after, wait in (("WAITING_FOR_RESOURCES", "PROVISIONING", cfg["waiting_s"]),
                                    ("PROVISIONING", "ACTIVE", cfg["provisioning_s"])):
            time.sleep(wait)
            with self.lock():
                r = self.resource(name)
                if r is None or r["state"] != before:
                    return
                self._set_state(r, after)
                if after == "ACTIVE":  # ACTIVE means every VM is up (ssh reaches them)
                    self._boot(r, self._hosts(r))

    def describe(self, name: str, zone: str | None = None) -> dict:
        """The resource as the Cloud TPU API (v2) shows it: name, createTime, tpu.nodeSpec, tier, state."""
        r = self._get(name, zone)
        parent = f"projects/{r['project']}/locations/{r['zone']}"
        node = {"acceleratorType": r["acceleratorType"], "runtimeVersion": r["runtimeVersion"],
                "networkConfig": {"network": r["network"] or "default", "enableExternalIps": not r["internalIps"]}}
        if r["subnetwork"]:
            node["networkConfig"]["subnetwork"] = r["subnetwork"]
        if r["serviceAccount"]:
            node["serviceAccount"] = {"email": r["serviceAccount"]}
        if r["metadataKeys"]:
            node["metadata"] = {k: (self._rdir(name) / "metadata" / k).read_text() for k in r["metadataKeys"]}
        spec = {"parent": parent, "node": node}
        if r["multislice"]:
            spec["multisliceParams"] = {"nodeCount": len(r["nodeIds"]), "nodeIdPrefix": r["nodePrefix"] or name}
        else:
            spec["nodeId"] = r["nodeIds"][0]
        out = {"name": f"{parent}/queuedResources/{name}", "createTime": r["createTime"],
               "tpu": {"nodeSpec": [spec]}, "state": {"state": r["state"], "stateInitiator": r["stateInitiator"]}}
        if r["tier"] == "spot":
            out["spot"] = {}
        elif r["tier"] == "reserved":
            out["guaranteed"] = {"reserved": True}
        elif r["tier"] == "best-effort":
            out["bestEffort"] = {}
        if r["validUntilSeconds"] is not None:
            out["queueingPolicy"] = {"validUntilDuration": f"{r['validUntilSeconds']}s"}
        return out

    def delete(self, name: str, zone: str | None = None, *, force: bool = False, asynchronous: bool = False) -> None:
        """Kill every host's processes and remove the resource (its folder moves to _deleted/)."""
        r = self._get(name, zone)
        if r["state"] in ("PROVISIONING", "ACTIVE") and not force:
            raise GcloudError(f"FAILED_PRECONDITION: queued resource {name!r} is {r['state']} and has TPU nodes; "
                              "delete them first or pass --force")
        with self.lock():
            r = self._get(name, zone)
            self._set_state(r, "DELETING", "USER")
        if asynchronous:
            self._detach([self.config["python"], str(HERE / "gcloud.py"), "standin", "_delete", name],
                         marker=self._rdir(name) / "_deleter")
            return
        self.finish_delete(name)

    def finish_delete(self, name: str, wait: float = 0.0) -> None:
        time.sleep(wait)
        self._kill(self._rdir(name))
        with self.lock():
            if self.resource(name) is not None:
                (self.root / "_deleted").mkdir(exist_ok=True)
                os.replace(self._rdir(name), self.root / "_deleted" / f"{name}-{time.time():.6f}")

    # ------------------------------------------------------------------ hosts
    def _hosts(self, r: dict) -> list[Host]:
        return [Host(s, w, node, self._rdir(r["name"]) / f"slice{s}-worker{w}")
                for s, node in enumerate(r["nodeIds"]) for w in range(r["hostsPerSlice"])]

    def hosts(self, name: str) -> list[Host]:
        return self._hosts(self._get(name))

    def host(self, name: str, slice: int, worker: int) -> Host:
        hosts = [h for h in self.hosts(name) if (h.slice, h.worker) == (slice, worker)]
        if not hosts:
            raise GcloudError(f"NOT_FOUND: {name} has no slice {slice} worker {worker}")
        return hosts[0]

    def host_state(self, name: str, slice: int, worker: int) -> str:
        return json.loads((self.host(name, slice, worker).dir / "host.json").read_text())["state"]

    def host_env(self, name: str, slice: int, worker: int) -> dict[str, str]:
        """A TPU VM worker's environment: the facts a real VM has (worker id and hostnames, multislice
        variables on multislice resources) plus the documented overrides of what a real pod reads from
        the metadata server, plus the storage emulator's endpoint. Nothing from the test process."""
        r, h, cfg = self._get(name), self.host(name, slice, worker), self.config
        hosts, slices = r["hostsPerSlice"], len(r["nodeIds"])
        env = {"HOME": str(h.home), "PATH": f"{self.bin_dir}:{Path(cfg['python']).parent}:/usr/bin:/bin",
               "TPU_WORKER_ID": str(worker),
               "TPU_WORKER_HOSTNAMES": ",".join(f"127.1.{slice}.{w + 1}" for w in range(hosts)),
               "DILOCO_TPU_SLICE": str(slice), "DILOCO_TPU_WORKER": str(worker), "DILOCO_TPU_NAME": name,
               "DILOCO_TPU_ZONE": r["zone"], "DILOCO_COORDINATOR": f"127.0.0.1:{r['coordinatorPort']}",
               "DILOCO_NUM_PROCESSES": str(slices * hosts), "DILOCO_PROCESS_ID": str(slice * hosts + worker),
               "DILOCO_CPU_DEVICES": str(cfg["cpu_devices"]), "JAX_PLATFORMS": "cpu", **cfg["emulator_env"]}
        env.pop("EPATH_USE_TF", None)  # a VM has no such setting: what the launcher starts must set it itself
        env["DILOCO_METADATA_DIR"] = str(h.dir / "metadata-server")  # what the agent reads of the metadata server
        info = h.dir / "host.json"  # this boot of this VM (the hosts share this machine's kernel and its boot_id)
        boots = json.loads(info.read_text())["boots"] if info.exists() else 0
        env["DILOCO_BOOT_ID"] = f"{name}-{r['createTime']}-slice{slice}-worker{worker}-boot{boots}"
        if r["multislice"]:
            env.update(MEGASCALE_NUM_SLICES=str(slices), MEGASCALE_SLICE_ID=str(slice),
                       MEGASCALE_COORDINATOR_ADDRESS="127.1.0.1:8080")
        return env

    def _spawn(self, h: Host, argv: list[str], env: dict, **kw) -> subprocess.Popen:
        return subprocess.Popen(argv, cwd=h.home, env={**env, MARKER: str(h.dir)}, stdin=subprocess.DEVNULL,
                                start_new_session=True, **kw)

    def _detach(self, argv: list[str], marker: Path) -> None:
        env = {"PATH": "/usr/bin:/bin", "GCLOUD_STANDIN_DIR": str(self.root), MARKER: str(marker)}
        subprocess.Popen(argv, env=env, cwd=self.root, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=open(self.root / "standin-errors.log", "ab"), start_new_session=True)

    def boot(self, name: str, slice: int, worker: int) -> None:
        """The host comes up: state UP, and its startup script runs detached, output to ~/startup.log."""
        with self.lock():  # a host marked down by another process is never left running
            self._boot(self._get(name), [self.host(name, slice, worker)])

    def _boot(self, r: dict, hosts: list[Host]) -> None:
        """Under the lock: the hosts are UP when the resource is ACTIVE, and their startup scripts start."""
        if r["state"] != "ACTIVE":
            raise GcloudError(f"FAILED_PRECONDITION: queued resource {r['name']!r} is {r['state']}, not ACTIVE")
        script = self._rdir(r["name"]) / "metadata" / "startup-script"
        for h in hosts:
            info = json.loads((h.dir / "host.json").read_text())
            info.update(state="UP", boots=info["boots"] + 1)
            _write_json(h.dir / "host.json", info)
        for h in hosts if script.exists() else []:
            with open(h.home / "startup.log", "ab") as log:
                log.write(f"--- startup-script, boot {json.loads((h.dir / 'host.json').read_text())['boots']}, "
                          f"{_now()}\n".encode())
                log.flush()
                script.chmod(0o755)
                argv = [str(script)] if script.read_bytes().startswith(b"#!") else ["/bin/bash", str(script)]
                self._spawn(h, argv, self.host_env(r["name"], h.slice, h.worker), stdout=log,
                            stderr=subprocess.STDOUT)

    def kill_host(self, name: str, slice: int, worker: int) -> None:
        """The host is lost (maintenance, hardware): SIGKILL all its processes; ssh to it fails until repaired."""
        h = self.host(name, slice, worker)
        with self.lock():
            _write_json(h.dir / "host.json", {**json.loads((h.dir / "host.json").read_text()), "state": "DOWN"})
        self._kill(h.dir)

    def _image_home(self, h: Host) -> None:
        """A new VM's home, as its image makes it."""
        h.home.mkdir(parents=True)
        # a login shell (ssh's `bash -lc`) resets PATH in /etc/profile; the VM image's ~/.profile sets it
        path = self.host_env(h.dir.parent.name, h.slice, h.worker)["PATH"]
        (h.home / ".profile").write_text(f'PATH="$HOME/.local/bin:{path}"\nexport PATH\n')

    def repair_host(self, name: str, slice: int, worker: int, fresh: bool = False) -> None:
        """The host comes back like a rebooted VM: up again, its metadata startup script runs again. With
        `fresh`, as a VM Cloud TPU recreated (a repaired slice): its disk (home) is new and empty."""
        h = self.host(name, slice, worker)
        self._kill(h.dir)
        if fresh:
            shutil.rmtree(h.home, ignore_errors=True)
            self._image_home(h)
        self.boot(name, slice, worker)

    def reboot_host(self, name: str, slice: int, worker: int) -> None:
        """A maintenance reboot: every process ends, the disk stays, the metadata startup script runs again."""
        self.repair_host(name, slice, worker)

    def repair_slice(self, name: str, slice: int) -> None:
        """Multislice autorepair: every host of the slice is recreated from the metadata, with fresh disks."""
        for h in [h for h in self.hosts(name) if h.slice == slice]:
            self.repair_host(name, h.slice, h.worker, fresh=True)

    def maintenance(self, name: str, slice: int, worker: int, event: str = "TERMINATE_ON_HOST_MAINTENANCE") -> None:
        """A maintenance notice on the host's metadata server (`instance/maintenance-event`; NONE clears it)."""
        d = self.host(name, slice, worker).dir / "metadata-server"
        d.mkdir(exist_ok=True)
        (d / "maintenance-event").write_text(event + "\n")

    def identity(self, host: str | None) -> str:
        """Who a gcloud call runs as: the laptop's user, or the VM's service account (its resource's)."""
        from .faults import DEFAULT_SA, LAPTOP

        if host is None or "/" not in host:
            return LAPTOP
        r = self.resource(host.split("/")[0])
        return (r or {}).get("serviceAccount") or DEFAULT_SA

    def fail(self, *match: str, times: int = 1, host: str | None = None, **kw) -> None:
        """The next `times` gcloud calls whose argv holds every word of `match` fail (faults.fail)."""
        from . import faults

        faults.fail(self.root, *match, times=times, host=host, **kw)

    def deny(self, identity: str, *permissions: str) -> None:
        """Calls made as `identity` that need one of `permissions` are refused with 403 (faults.deny)."""
        from . import faults

        faults.deny(self.root, identity, *permissions)

    def set_state(self, name: str, state: str) -> None:
        """SUSPENDING / SUSPENDED / FAILED / PREEMPTED: every host is killed and down. ACTIVE: hosts not
        up boot (capacity arrived, for a resource held with waiting_s=None). Other states: the label only."""
        if state not in STATES + ("PREEMPTED",):
            raise GcloudError(f"INVALID_ARGUMENT: unknown state {state!r}; one of {', '.join(STATES)}, PREEMPTED")
        with self.lock():
            r = self._get(name)
            self._set_state(r, state)
            if state in DOWN_STATES:
                for h in self._hosts(r):
                    _write_json(h.dir / "host.json", {**json.loads((h.dir / "host.json").read_text()), "state": "DOWN"})
            elif state == "ACTIVE":
                self._boot(r, [h for h in self._hosts(r) if self.host_state(name, h.slice, h.worker) != "UP"])
        if state in DOWN_STATES:
            self._kill(self._rdir(name))

    # ------------------------------------------------------------------ processes
    def _pids(self, under: Path) -> list[tuple[int, str]]:
        """(pid, marker) of the live processes whose marker is `under` or below it."""
        want, out = str(under), []
        for d in os.listdir("/proc"):
            if not d.isdigit() or int(d) == os.getpid():
                continue
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    env = f.read()
            except OSError:
                continue
            for item in env.split(b"\0"):
                if item.startswith(MARKER.encode() + b"="):
                    value = item.split(b"=", 1)[1].decode(errors="replace")
                    if value == want or value.startswith(want + "/"):
                        out.append((int(d), value))
                    break
        return out

    def _kill(self, under: Path) -> None:
        for _ in range(200):  # until none is left: a process may fork between a scan and its kill
            pids = self._pids(under)
            if not pids:
                return
            for pid, _ in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)
        raise RuntimeError(f"processes under {under} survive SIGKILL: {self._pids(under)}")

    def processes(self, name: str) -> list[dict]:
        """What runs on the resource's hosts now: {"host": "slice0-worker1", "slice", "worker", "pid",
        "pgid", "cmdline"} ("host" is "_provisioner"/"_deleter" for the service's own helpers)."""
        out = []
        for pid, marker in self._pids(self._rdir(name)):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                pgid = os.getpgid(pid)
            except (OSError, ProcessLookupError):
                continue
            host = os.path.relpath(marker, self._rdir(name))
            m = re.fullmatch(r"slice(\d+)-worker(\d+)", host)
            out.append({"host": host, "slice": int(m.group(1)) if m else None, "worker": int(m.group(2)) if m else None,
                        "pid": pid, "pgid": pgid, "cmdline": [c.decode(errors="replace") for c in cmd if c]})
        return sorted(out, key=lambda p: (p["host"], p["pid"]))

    def kill_all(self) -> None:
        """Every process any host or helper of this stand-in started (the fixture's finalizer)."""
        self._kill(self.root)

    # ------------------------------------------------------------------ ssh
    def ssh(self, name: str, zone: str | None, nodes: str, workers: str, command: str, out=None) -> int:
        """Run `command` (bash -lc, cwd = home) on the chosen hosts at once; each output line is printed
        as '<node-id> worker-<w>: line'. Exit status: 0 when every host's command exited 0, else the
        first failure's (255 for a host that is down, like ssh's own connection failure)."""
        out = out or sys.stdout
        r = self._get(name, zone)
        if r["state"] != "ACTIVE":
            raise GcloudError(f"FAILED_PRECONDITION: queued resource {name!r} is {r['state']}, not ACTIVE")
        targets = [h for h in self._hosts(r) if h.slice in _pick(nodes, r["nodeIds"], "--node")
                   and h.worker in _pick(workers, [str(w) for w in range(r["hostsPerSlice"])], "--worker")]
        lock, codes, threads = threading.Lock(), {}, []

        def say(h: Host, line: str) -> None:
            with lock:
                out.write(f"{h.label}: {line}" + ("" if line.endswith("\n") else "\n"))
                out.flush()

        def run(h: Host) -> None:
            env = self.host_env(name, h.slice, h.worker)
            with self.lock():  # checked and started together: a host killed meanwhile runs nothing
                up = self.host_state(name, h.slice, h.worker) == "UP"
                if up:
                    p = self._spawn(h, ["/bin/bash", "-lc", command], env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT)
            if not up:
                say(h, f"ssh: connect to host 127.1.{h.slice}.{h.worker + 1} port 22: Connection refused")
                codes[h] = 255
                return
            for raw in p.stdout:
                say(h, raw.decode(errors="replace"))
            code = p.wait()
            codes[h] = 255 if code < 0 else code  # killed with its host: the connection is gone

        for h in targets:
            threads.append(threading.Thread(target=run, args=(h,)))
            threads[-1].start()
        for t in threads:
            t.join()
        failed = [codes[h] for h in targets if codes[h] != 0]
        return failed[0] if failed else 0


def _pick(spec: str, names: list[str], flag: str) -> set[int]:
    """--node / --worker values: all, an index, a name (nodes), comma lists and ranges (0-2)."""
    if spec == "all":
        return set(range(len(names)))
    out = set()
    for part in spec.split(","):
        if part in names:
            out.add(names.index(part))
        elif re.fullmatch(r"\d+-\d+", part):
            a, b = map(int, part.split("-"))
            out |= set(range(a, b + 1))
        elif part.isdigit():
            out.add(int(part))
        else:
            raise GcloudError(f"INVALID_ARGUMENT: {flag}={spec}: {part!r} is not one of {', '.join(names)}")
    bad = sorted(i for i in out if i >= len(names))
    if bad:
        raise GcloudError(f"INVALID_ARGUMENT: {flag}={spec}: index {bad[0]} out of range (0-{len(names) - 1})")
    return out
