"""The stand-in `gcloud`: exactly the subset of Google's CLI that the TPU launcher uses, no more.

    gcloud compute tpus queued-resources create NAME --zone=Z [--project=P] --accelerator-type=T
        --runtime-version=V (--node-id=N | --node-count=K [--node-prefix=PFX]) [--spot | --reserved]
        [--valid-until-duration=D] [--service-account=SA] [--network=N] [--subnetwork=S] [--internal-ips]
        [--metadata-from-file=startup-script=FILE] [--async]
        (`gcloud alpha compute tpus queued-resources create` also takes --best-effort: GA gcloud has no
        such flag, so the GA command refuses it here too)
    gcloud compute tpus queued-resources describe NAME --zone=Z [--format=json|yaml|value(state.state)]
    gcloud compute tpus queued-resources delete NAME --zone=Z [--force] [--quiet] [--async]
    gcloud compute tpus queued-resources ssh NAME --zone=Z [--node=all|i|…] [--worker=all|j|…] --command=CMD
        [--batch-size=N|all] [--internal-ip | --tunnel-through-iap]
    gcloud storage cp [-r] [-n] SRC… DST          (local ↔ gs://, gs:// → gs://, `-` = stdin / stdout)
    gcloud storage cat URL…
    gcloud storage ls URL…                        (exit 1, "One or more URLs matched no objects.")
    gcloud storage rm [-r] URL…
    gcloud standin kill-host|repair-host QR SLICE WORKER | set-state QR STATE | processes QR

Anything else (another command, an unknown flag) exits 2 with a message, as gcloud does for bad
usage: a launcher cannot silently rely on what the stand-in does not implement. Every call except
`standin …` is appended to $GCLOUD_STANDIN_DIR/invocations.jsonl. Storage wildcards: * ? [..] within
one level, ** across levels.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `standin`
from standin import faults, iam  # noqa: E402
from standin.cloud import MARKER, Cloud, GcloudError, duration_seconds  # noqa: E402

GLOBAL = ("--project", "--quiet", "-q", "--format")


class Usage(Exception):
    pass


class Parser(argparse.ArgumentParser):
    """argparse that reports bad usage like gcloud: 'ERROR: (gcloud.a.b) …', exit 2; no abbreviations."""

    def __init__(self, command: str, **kw):
        super().__init__(prog=f"gcloud {command}", allow_abbrev=False, add_help=False, **kw)
        self.command = command

    def error(self, message):
        flags = [a.option_strings[0] for a in self._actions if a.option_strings]
        raise Usage(f"{message}\n(the stand-in's `gcloud {self.command}` takes only {', '.join(flags)})")


def _with_globals(p: Parser, fmt: bool = False) -> Parser:
    p.add_argument("--project")
    p.add_argument("--quiet", "-q", action="store_true")
    if fmt:
        p.add_argument("--format")
    return p


# ---------------------------------------------------------------------------------------------- output
def _field(obj, path: str):
    for key in path.split("."):
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


def _check_format(fmt: str | None) -> None:
    if fmt is not None and fmt not in ("json", "yaml") and not re.fullmatch(r"value\((.+)\)", fmt):
        raise Usage(f"--format={fmt}: the stand-in knows json, yaml and value(a.b,…)")


def _render(objs: list[dict], fmt: str | None, default: str) -> str:
    """json, yaml or value(a.b,c) of one resource (describe) or of a list (list: default == "table")."""
    fmt = fmt or default
    if fmt == "json":
        return json.dumps(objs if default == "table" else objs[0], indent=2) + "\n"
    if fmt == "yaml":
        import yaml

        return "---\n".join(yaml.safe_dump(o, sort_keys=True) for o in objs)
    m = re.fullmatch(r"value\((.+)\)", fmt)
    if m:
        keys = [k.strip() for k in m.group(1).split(",")]
        return "".join("\t".join("" if _field(o, k) is None else str(_field(o, k)) for k in keys) + "\n"
                       for o in objs)
    raise Usage(f"--format={fmt}: the stand-in knows json, yaml and value(a.b,…)")


# ---------------------------------------------------------------------------------------------- TPUs
def queued_resources(cloud: Cloud, verb: str, args: list[str], alpha: bool) -> int:
    cmd = f"{'alpha ' if alpha else ''}compute tpus queued-resources {verb}"
    if verb == "create":
        p = _with_globals(Parser(cmd))
        p.add_argument("name")
        p.add_argument("--zone", required=True)
        p.add_argument("--accelerator-type", required=True)
        p.add_argument("--runtime-version", required=True)
        nodes = p.add_mutually_exclusive_group(required=True)
        nodes.add_argument("--node-id")
        nodes.add_argument("--node-count", type=int)
        p.add_argument("--node-prefix")
        tier = p.add_mutually_exclusive_group()
        tier.add_argument("--spot", action="store_const", const="spot", dest="tier")
        tier.add_argument("--reserved", action="store_const", const="reserved", dest="tier")
        if alpha:
            tier.add_argument("--best-effort", action="store_const", const="best-effort", dest="tier")
        p.add_argument("--valid-until-duration")
        p.add_argument("--service-account")
        p.add_argument("--network")
        p.add_argument("--subnetwork")
        p.add_argument("--internal-ips", action="store_true")
        p.add_argument("--metadata-from-file")
        p.add_argument("--async", action="store_true", dest="asynchronous")
        a = p.parse_args(args)
        if a.node_prefix and a.node_count is None:
            raise Usage("--node-prefix goes with --node-count")
        files = {}
        for item in (a.metadata_from_file or "").split(","):
            if item:
                if "=" not in item:
                    raise Usage(f"--metadata-from-file: {item!r} is not KEY=FILE")
                key, path = item.split("=", 1)
                files[key] = path
        try:
            if a.valid_until_duration:
                duration_seconds(a.valid_until_duration)
        except ValueError as e:
            raise Usage(f"--valid-until-duration: {e}")
        cloud.create(a.name, zone=a.zone, project=a.project, accelerator_type=a.accelerator_type,
                     runtime_version=a.runtime_version, node_id=a.node_id, node_count=a.node_count,
                     node_prefix=a.node_prefix, tier=a.tier, valid_until_duration=a.valid_until_duration,
                     service_account=a.service_account, network=a.network, subnetwork=a.subnetwork,
                     internal_ips=a.internal_ips, metadata_files=files)
        sys.stderr.write(f"Create request issued for: [{a.name}]\n")
        if not a.asynchronous:
            sys.stderr.write(f"Created queued resource [{a.name}].\n")
        return 0
    if verb == "describe":
        p = _with_globals(Parser(cmd), fmt=True)
        p.add_argument("name")
        p.add_argument("--zone", required=True)
        a = p.parse_args(args)
        _check_format(a.format)
        sys.stdout.write(_render([cloud.describe(a.name, a.zone)], a.format, "yaml"))
        return 0
    if verb == "delete":
        p = _with_globals(Parser(cmd))
        p.add_argument("name")
        p.add_argument("--zone", required=True)
        p.add_argument("--force", action="store_true")
        p.add_argument("--async", action="store_true", dest="asynchronous")
        a = p.parse_args(args)
        cloud.delete(a.name, a.zone, force=a.force, asynchronous=a.asynchronous)
        sys.stderr.write(f"Delete request issued for: [{a.name}]\n")
        if not a.asynchronous:
            sys.stderr.write(f"Deleted queued resource [{a.name}].\n")
        return 0
    if verb == "ssh":
        p = _with_globals(Parser(cmd))
        p.add_argument("name")
        p.add_argument("--zone", required=True)
        p.add_argument("--node", default="0")
        p.add_argument("--worker", default="0")
        p.add_argument("--command", required=True)
        p.add_argument("--batch-size", default="64", type=lambda v: v if v == "all" or int(v) > 0 else int("x"))
        route = p.add_mutually_exclusive_group()  # how ssh reaches the VMs: recorded, not enforced
        route.add_argument("--internal-ip", action="store_true")
        route.add_argument("--tunnel-through-iap", action="store_true")
        a = p.parse_args(args)  # every chosen host runs at once (--batch-size only limits a real client)
        return cloud.ssh(a.name.split("@")[-1], a.zone, a.node, a.worker, a.command)
    raise Usage(f"unknown command 'queued-resources {verb}'; the stand-in implements create, describe, delete, ssh")


# ---------------------------------------------------------------------------------------------- storage
class NoMatch(GcloudError):
    def __init__(self, urls):
        super().__init__("The following URLs matched no objects or files:\n" + "".join(f"-{u}\n" for u in urls).rstrip())


class Api:
    """The Cloud Storage JSON API at the emulator, anonymous, with the standard library (a stub call
    starts in ~0.1 s; google-cloud-storage's import alone takes most of a second of CPU)."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint.rstrip("/")

    def _call(self, method: str, path: str, query: dict | None = None, data: bytes | None = None,
              upload: bool = False) -> bytes:
        import urllib.error
        import urllib.parse
        import urllib.request

        url = f"{self.endpoint}/{'upload/' if upload else ''}storage/v1/{path}"
        if query:
            url += "?" + urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})
        req = urllib.request.Request(url, data=data, method=method, headers={
            "Content-Type": "application/octet-stream" if upload else "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.read()
        except urllib.error.HTTPError as e:
            if e.code == 404:
                raise GcloudError(f"NOT_FOUND: {method} {path}") from None
            raise GcloudError(f"HTTP {e.code} for {method} {path}: {e.read()[:200]!r}") from None

    @staticmethod
    def _o(bucket: str, name: str = "") -> str:
        import urllib.parse

        return f"b/{bucket}/o" + (f"/{urllib.parse.quote(name, safe='')}" if name else "")

    def list(self, bucket: str, prefix: str = "", delimiter: str | None = None) -> tuple[list[str], list[str]]:
        """(object names, folder prefixes) under `prefix`, every page."""
        names, prefixes, token = [], [], None
        while True:
            page = json.loads(self._call("GET", self._o(bucket), {"prefix": prefix or None, "delimiter": delimiter,
                                                                   "pageToken": token}))
            names += [item["name"] for item in page.get("items") or []]
            prefixes += page.get("prefixes") or []
            token = page.get("nextPageToken")
            if not token:
                return names, sorted(set(prefixes))

    def exists(self, bucket: str, name: str) -> bool:
        try:
            self._call("GET", self._o(bucket, name))
            return True
        except GcloudError as e:
            if str(e).startswith("NOT_FOUND"):
                return False
            raise

    def read(self, bucket: str, name: str) -> bytes:
        return self._call("GET", self._o(bucket, name), {"alt": "media"})

    def write(self, bucket: str, name: str, data: bytes) -> None:
        self._call("POST", self._o(bucket), {"uploadType": "media", "name": name}, data=data, upload=True)

    def delete(self, bucket: str, name: str) -> None:
        self._call("DELETE", self._o(bucket, name))

    def copy(self, src_bucket: str, src: str, dst_bucket: str, dst: str) -> None:
        import urllib.parse

        self._call("POST", f"{self._o(src_bucket, src)}/rewriteTo/b/{dst_bucket}/o/{urllib.parse.quote(dst, safe='')}",
                   data=b"{}")


def _client(cloud: Cloud) -> Api:
    return Api(cloud.config["emulator_env"]["STORAGE_EMULATOR_HOST"])


def _split(url: str) -> tuple[str, str]:
    m = re.fullmatch(r"gs://([^/]+)/?(.*)", url)
    if not m:
        raise Usage(f"{url!r} is not a gs:// URL")
    return m.group(1), m.group(2)


WILD = re.compile(r"[*?\[]")


def _glob_re(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[" and "]" in pattern[i:]:
            j = pattern.index("]", i)
            out, i = out + pattern[i:j + 1], j + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def _names(client: Api, bucket: str, prefix: str) -> list[str]:
    return client.list(bucket, prefix)[0]


def _objects(client: Api, url: str, recursive: bool) -> list[tuple[str, str, str]]:
    """(bucket, object name, name relative to what the URL named) for the objects a URL stands for:
    one object, wildcard matches, or (recursive) everything under a prefix."""
    bucket, path = _split(url)
    if WILD.search(path):
        rx = _glob_re(path.rstrip("/"))
        out = []
        for n in _names(client, bucket, path[:WILD.search(path).start()]):
            if rx.fullmatch(n):
                out.append((bucket, n, n.rsplit("/", 1)[-1]))
            elif recursive:
                parts = n.split("/")
                for k in range(1, len(parts)):
                    if rx.fullmatch("/".join(parts[:k])):
                        out.append((bucket, n, "/".join(parts[k - 1:])))
                        break
        return out
    if path and not path.endswith("/") and client.exists(bucket, path):
        return [(bucket, path, path.rsplit("/", 1)[-1])]
    if recursive:
        prefix = path.rstrip("/") + "/" if path else ""
        base = path.rstrip("/").rsplit("/", 1)[-1]
        return [(bucket, n, f"{base}/{n[len(prefix):]}" if base else n[len(prefix):])
                for n in _names(client, bucket, prefix)]
    return []


def _is_container(client: Api, url: str) -> bool:
    bucket, path = _split(url)
    return not path or path.endswith("/") or bool(_names(client, bucket, path + "/")[:1])


def storage(cloud: Cloud, verb: str, args: list[str]) -> int:
    cmd = f"storage {verb}"
    if verb == "cp":
        p = _with_globals(Parser(cmd))
        p.add_argument("--recursive", "-r", "-R", action="store_true")
        p.add_argument("--no-clobber", "-n", action="store_true")
        p.add_argument("urls", nargs="+")
        a = p.parse_args(args)
        if len(a.urls) < 2:
            raise Usage("cp needs a SOURCE and a DESTINATION")
        return _cp(cloud, a.urls[:-1], a.urls[-1], a.recursive, a.no_clobber)
    if verb == "cat":
        p = _with_globals(Parser(cmd))
        p.add_argument("urls", nargs="+")
        a = p.parse_args(args)
        client = _client(cloud)
        for url in a.urls:
            objs = _objects(client, url, False)
            if not objs:
                raise NoMatch([url])
            for bucket, name, _ in objs:
                sys.stdout.buffer.write(client.read(bucket, name))
        sys.stdout.flush()
        return 0
    if verb == "ls":
        p = _with_globals(Parser(cmd))
        p.add_argument("urls", nargs="+")
        a = p.parse_args(args)
        client = _client(cloud)
        lines = []
        for url in a.urls:
            lines += _ls(client, url)
        if not lines:
            raise GcloudError("One or more URLs matched no objects.")
        print("\n".join(lines))
        return 0
    if verb == "rm":
        p = _with_globals(Parser(cmd))
        p.add_argument("--recursive", "-r", "-R", action="store_true")
        p.add_argument("urls", nargs="+")
        a = p.parse_args(args)
        client = _client(cloud)
        missing = []
        for url in a.urls:
            objs = _objects(client, url, a.recursive)
            if not objs:
                missing.append(url)
            for b, name, _ in objs:
                client.delete(b, name)
                sys.stderr.write(f"Removing gs://{b}/{name}...\n")
        if missing:
            raise NoMatch(missing)
        return 0
    raise Usage(f"unknown command 'storage {verb}'; the stand-in implements cp, cat, ls, rm")


def _ls(client: Api, url: str) -> list[str]:
    """Children of a bucket/prefix ('gs://b/dir/x', 'gs://b/dir/sub/'), the object itself, or wildcard
    matches (a matched folder lists its children)."""
    bucket, path = _split(url)

    def children(prefix: str) -> list[str]:
        names, prefixes = client.list(bucket, prefix, delimiter="/")
        return [f"gs://{bucket}/{n}" for n in names if n != prefix] + [f"gs://{bucket}/{p}" for p in prefixes]

    if WILD.search(path):
        rx, out = _glob_re(path.rstrip("/")), []
        seen_dirs = set()
        for n in _names(client, bucket, path[:WILD.search(path).start()]):
            if rx.fullmatch(n) and not path.endswith("/"):
                out.append(f"gs://{bucket}/{n}")
            parts = n.split("/")
            for k in range(1, len(parts)):
                d = "/".join(parts[:k])
                if rx.fullmatch(d) and d not in seen_dirs:
                    seen_dirs.add(d)
                    out += children(d + "/")
        return out
    out = []
    if path and not path.endswith("/") and client.exists(bucket, path):
        out.append(f"gs://{bucket}/{path}")
    if not path or path.endswith("/"):
        return out + children(path)
    return out + children(path + "/")


def _cp(cloud: Cloud, sources: list[str], dst: str, recursive: bool, no_clobber: bool) -> int:
    client = _client(cloud)
    if sources == ["-"]:
        if not dst.startswith("gs://") or _is_container(client, dst):
            raise Usage("cp from stdin ('-') needs one destination object URL")
        b, name = _split(dst)
        client.write(b, name, sys.stdin.buffer.read())
        return 0
    if "-" in sources:
        raise Usage("'-' (stdin) must be the only source")
    items, missing = [], []  # (kind, source, relative destination name)
    for src in sources:
        found = len(items)
        if src.startswith("gs://"):
            items += [("gs", f"gs://{b}/{n}", rel) for b, n, rel in _objects(client, src, recursive)]
        else:
            paths = glob.glob(src) if WILD.search(src) else ([src] if os.path.exists(src) else [])
            for path in paths:
                if os.path.isdir(path):
                    if not recursive:
                        raise GcloudError(f"{path} is a directory; use -r to copy folders")
                    base = os.path.basename(os.path.normpath(path))
                    for d, _, files in os.walk(path):
                        for f in files:
                            full = os.path.join(d, f)
                            items.append(("file", full, f"{base}/{os.path.relpath(full, path)}"))
                else:
                    items.append(("file", path, os.path.basename(path)))
        if len(items) == found:
            missing.append(src)
    if missing:
        raise NoMatch(missing)
    if dst == "-":
        for kind, src, _ in items:
            if kind != "gs":
                raise Usage("cp to stdout ('-') needs gs:// sources")
            b, n = _split(src)
            sys.stdout.buffer.write(client.read(b, n))
        sys.stdout.flush()
        return 0
    remote = dst.startswith("gs://")
    container = _is_container(client, dst) if remote else (os.path.isdir(dst) or dst.endswith("/"))
    if not container:  # one object/file named dst; or a folder's contents placed under the name dst
        if len(items) > 1 and not (len(sources) == 1 and recursive):
            raise GcloudError(f"destination {dst} must be a folder (end it with /) to copy several sources")
        single = len(items) == 1 and "/" not in items[0][2]
        items = [(k, s, None if single else rel.split("/", 1)[1] if "/" in rel else rel) for k, s, rel in items]
    for kind, src, rel in items:
        target = dst if rel is None else dst.rstrip("/") + "/" + rel
        sys.stderr.write(f"Copying {src if kind == 'gs' else 'file://' + os.path.abspath(src)} to "
                         f"{target if remote else 'file://' + os.path.abspath(target)}\n")
        if remote:
            b, n = _split(target)
            if no_clobber and client.exists(b, n):
                continue
            if kind == "gs":
                client.copy(*_split(src), b, n)
            else:
                client.write(b, n, Path(src).read_bytes())
        else:
            if no_clobber and os.path.exists(target):
                continue
            os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
            if kind == "gs":
                Path(target).write_bytes(client.read(*_split(src)))
            else:
                shutil.copyfile(src, target)
    return 0


# ---------------------------------------------------------------------------------------------- main
def controls(cloud: Cloud, args: list[str]) -> int:
    """Test controls: kill-host / repair-host QR SLICE WORKER, set-state QR STATE, processes QR."""
    p = Parser("standin")
    p.add_argument("action", choices=["kill-host", "repair-host", "set-state", "processes", "_provision", "_delete"])
    p.add_argument("name")
    p.add_argument("rest", nargs="*")
    a = p.parse_args(args)
    if a.action in ("kill-host", "repair-host"):
        s, w = map(int, a.rest)
        (cloud.kill_host if a.action == "kill-host" else cloud.repair_host)(a.name, s, w)
    elif a.action == "set-state":
        cloud.set_state(a.name, *a.rest)
    elif a.action == "processes":
        print(json.dumps(cloud.processes(a.name), indent=1))
    elif a.action == "_provision":
        cloud.provision(a.name)
    else:
        cloud.finish_delete(a.name, wait=cloud.config["delete_s"])
    return 0


def main(argv: list[str]) -> int:
    if "GCLOUD_STANDIN_DIR" not in os.environ:
        sys.stderr.write("ERROR: the stand-in gcloud needs GCLOUD_STANDIN_DIR (its wrapper in <dir>/_bin sets it)\n")
        return 2
    cloud = Cloud(os.environ["GCLOUD_STANDIN_DIR"])
    words = [w for w in argv[:5] if not w.startswith("-")]
    if words[:1] != ["standin"]:
        cloud.log_invocation(argv)
    command = "gcloud"
    try:
        if words[:1] != ["standin"]:
            host = os.environ.get(MARKER)
            host = os.path.relpath(host, cloud.root) if host else None
            why = faults.take(cloud.root, argv, host) or faults.refused(cloud.root, argv, cloud.identity(host))
            if why:
                raise GcloudError(why)
        lead = 0
        while lead < len(argv) and argv[lead].split("=")[0] in GLOBAL:  # gcloud --project=P compute …
            lead += 1 if "=" in argv[lead] or argv[lead] in ("--quiet", "-q") else 2
        rest = argv[lead:] + argv[:lead]
        alpha = rest[:1] == ["alpha"]
        if alpha:
            rest = rest[1:]
        done = iam.command(cloud, [w for w in rest if not w.startswith("-")][:5], rest)
        if done is not None:
            return done
        if rest[:3] == ["compute", "tpus", "queued-resources"] and len(rest) > 3:
            command = f"gcloud.{'alpha.' if alpha else ''}compute.tpus.queued-resources.{rest[3]}"
            return queued_resources(cloud, rest[3], rest[4:], alpha)
        if rest[:1] == ["storage"] and len(rest) > 1 and not alpha:
            command = f"gcloud.storage.{rest[1]}"
            return storage(cloud, rest[1], rest[2:])
        if rest[:1] == ["standin"]:
            return controls(cloud, rest[1:])
        raise Usage(f"unknown command: gcloud {' '.join(argv)}\n(the stand-in implements only "
                    "`compute tpus queued-resources create|describe|list|delete|ssh` and `storage cp|cat|ls|rm`)")
    except Usage as e:
        sys.stderr.write(f"ERROR: ({command}) {e}\n")
        return 2
    except GcloudError as e:
        sys.stderr.write(f"ERROR: ({command}) {e}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
