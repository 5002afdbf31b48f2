"""What the real cloud does to a Cloud TPU launch, each behaviour driven on the stand-in or on the pure
function it exercises (issue #29): reboots and repairs run the current bundle, installs and downloads that
fail first, a host that never starts, two pods on one root, the VM's service account, and a launcher that
never deletes or ships what it should not. Default tier: seconds each (the hosts' agents are a stub)."""
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from diloco import sweep as sw
from diloco.config import REPO_ROOT
from diloco.errors import ConfigError
from diloco.tpu import accelerators, agent as A, bundle, host, pods, preflight, status as S

TPU = ["--launch", "tpu", "--tpu", "pod-1", "--zone", "us-east5-a"]


def _sweep(tmp_path, points: str = "[{}]", name: str = "cl") -> Path:
    p = tmp_path / f"{name}.py"
    p.write_text(textwrap.dedent(f"""
        def get_sweep(arg=""):
            return {{"name": "{name}", "experiment": "experiments/toy.py:diloco", "points": {points}}}
    """))
    return p


def _git(repo: Path, *args):
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                   capture_output=True)


# -- #9: --out never deletes a folder it did not make --------------------------------------------------
def test_out_refuses_a_folder_it_did_not_write_and_leaves_every_file(tmp_path, capsys):
    f = _sweep(tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me\n")
    argv = [str(f), "--root", "gs://bkt/r", *TPU, "--accelerator", "v5litepod-4", "--check-fit", "off", "--dry-run"]
    assert sw.main([*argv, "--out", str(mine)]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "nothing there is removed" in err and (mine / "notes.txt").read_text() == "keep me\n"
    out = tmp_path / "b"
    assert sw.main([*argv, "--out", str(out)]) == 0  # a new folder: the bundle, with its marker
    assert (out / bundle.MARKER).read_text() == "pod-1\n"
    stale = next(out.glob("tree-*.tar.gz")).with_name("tree-000000000000.tar.gz")
    stale.write_bytes(b"an older tree")
    assert sw.main([*argv, "--out", str(out)]) == 0  # an earlier bundle of pod-1: its files are replaced
    assert not stale.exists() and len(list(out.glob("tree-*.tar.gz"))) == 1
    (out / "results.csv").write_text("mine\n")  # a stranger inside a bundle: refused, nothing removed
    before = sorted(p.name for p in out.iterdir())
    assert sw.main([*argv, "--out", str(out)]) == 2 and "results.csv" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == before
    (out / "results.csv").unlink()
    other = [a if a != "pod-1" else "pod-2" for a in argv]
    assert sw.main([*other, "--out", str(out)]) == 2  # another queued resource's bundle
    assert "holds the bundle of queued resource 'pod-1'" in capsys.readouterr().err
    assert sw.main([*other, "--out", str(Path.cwd())]) == 2  # `--out .`: the checkout is never touched


def test_the_default_bundle_folder_is_per_queued_resource(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(bundle, "check_out", lambda out, qr: seen.append(out) or (_ for _ in ()).throw(SystemExit(7)))
    with pytest.raises(SystemExit):
        sw.main([str(_sweep(tmp_path)), "--root", "gs://bkt/r", *TPU, "--accelerator", "v5litepod-4", "--dry-run"])
    assert seen == [REPO_ROOT / "build" / "tpu" / "cl" / "pod-1"]


# -- #10: the shipped tree ------------------------------------------------------------------------------
@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "repo"
    (r / "pkg").mkdir(parents=True)
    (r / "pkg" / "a.py").write_text("A = 1\n")
    (r / "tokenizer.json").write_text('{"vocab": ["a"]}\n')  # a name with "token" in it is not a token file
    _git(r, "init", "-q")
    _git(r, "add", ".")
    _git(r, "commit", "-qm", "c")
    return r


@pytest.mark.parametrize("name,body", [
    (".env", "API_KEY=abc\n"), ("deploy/key.json", '{"type": "service_account", "private_key": "x"}'),
    ("conf/prod.json", '{"type": "service_account", "client_email": "a@b"}'), ("id_ed25519", "x"),
    ("notes/server.txt", "-----BEGIN OPENSSH " + "PRIVATE KEY-----\nabc\n"), ("gcp-credentials.json", "{}"),
])
def test_a_credential_is_refused_by_name_tracked_or_shipped(repo, name, body):
    (repo / name).parent.mkdir(parents=True, exist_ok=True)
    (repo / name).write_text(body)
    assert bundle.tree_files(repo) == ["pkg/a.py", "tokenizer.json"]  # untracked: not shipped at all
    assert bundle.untracked(repo) == [name] and bundle.untracked(repo, ship=(name,)) == []  # (a warning names it)
    with pytest.raises(ConfigError, match=re.escape(name) + ".*look.*like a credential"):
        bundle.tree_files(repo, ship=(name,))
    _git(repo, "add", "-f", name)  # tracked (committed by mistake): refused too, by name
    with pytest.raises(ConfigError, match=re.escape(name)):
        bundle.tree_files(repo)


def test_the_tree_has_a_size_cap_naming_the_largest_files(repo):
    (repo / "data.bin").write_bytes(b"x" * 5000)
    _git(repo, "add", "data.bin")
    with pytest.raises(ConfigError, match=r"over the .* cap \(largest: data.bin"):
        bundle.tree_files(repo, max_bytes=4096)
    assert "data.bin" in bundle.tree_files(repo, max_bytes=1 << 20)


def test_this_checkout_ships_no_credential_and_fits_the_cap():
    files = bundle.tree_files()
    assert "diloco/tpu/bundle.py" in files and not [f for f in files if f.startswith((".venv/", "build/"))]


# -- #3: bash 3.2 ------------------------------------------------------------------------------------
def test_arrays_that_may_be_empty_are_expanded_in_the_bash32_guard_form(tmp_path):
    """Before bash 4.4 (macOS ships 3.2), "${A[@]}" of an empty array is an unbound variable under set -u.
    In the default launch (no capacity flag, no internal IPs) TRACK, CREATE_FLAGS and SSH_FLAGS are empty:
    each of their expansions must be ${A[@]+"${A[@]}"}; and that form gives no empty word on this bash."""
    out = tmp_path / "b"
    assert sw.main([str(_sweep(tmp_path)), "--root", "gs://bkt/r", *TPU, "--accelerator", "v5litepod-4",
                    "--check-fit", "off", "--out", str(out), "--dry-run"]) == 0
    text = (out / "launch_tpu.sh").read_text()
    empty = re.findall(r"^([A-Z_]+)=\(\)$", text, re.M)
    assert set(empty) == {"TRACK", "CREATE_FLAGS", "SSH_FLAGS"}
    for name in empty:
        uses = re.findall(r'\$\{' + name + r'\[[@*]\][^}]*\}', text)
        bare = [m.start() for m in re.finditer(r'(?<![+])"\$\{' + name + r'\[@\]\}"', text)]
        assert uses and not bare, (name, uses)
    assert "set -u" in text or "set -euo" in text
    r = subprocess.run(["bash", "-c", 'set -u; A=(); printf "<%s>" x ${A[@]+"${A[@]}"} y'], capture_output=True, text=True)
    assert r.stdout == "<x><y>"


# -- #13: slices (#12's choice among several C4 copies is made by `diloco data tokenize`: specs._tfds_root) ----
@pytest.mark.parametrize("acc,slices,warned", [("v5p-8", 2, True), ("v5litepod-8", 2, True), ("v5litepod-4", 3, True),
                                               ("v5p-16", 2, False), ("v5p-8", 1, False)])
def test_multislice_over_one_host_slices_is_warned_with_the_reason(acc, slices, warned):
    w = preflight.single_host_multislice(accelerators.parse(acc), slices)
    assert bool(w) == warned and (not w or ("multi-host slices" in w and "one larger slice" in w)), w


# -- #7, #8: host hygiene --------------------------------------------------------------------------
def test_the_agent_raises_the_open_file_limit_for_itself_and_its_children():
    code = ("import resource, subprocess; from diloco.tpu.host import raise_nofile; raise_nofile(); "
            "print(subprocess.run(['sh', '-c', 'ulimit -n; ulimit -Hn'], capture_output=True, text=True).stdout)")
    r = subprocess.run(["bash", "-c", f'ulimit -Sn 256 && {sys.executable} -c "{code}"'], capture_output=True,
                       text=True, cwd=REPO_ROOT)
    soft, hard = r.stdout.split()
    assert soft == hard and soft != "256", r.stdout + r.stderr


def test_after_a_reap_what_holds_a_chip_is_killed_and_a_stale_libtpu_lock_removed(tmp_path):
    dev, lock = tmp_path / "accel0", tmp_path / "libtpu_lockfile"
    dev.write_text("")
    lock.write_text("")
    holder = subprocess.Popen([sys.executable, "-c", f"f = open({str(dev)!r}); import time; time.sleep(60)"])
    locker = subprocess.Popen([sys.executable, "-c", f"f = open({str(lock)!r}); import time; time.sleep(60)"])
    try:
        deadline = time.time() + 10
        while not (host.holders([str(dev)]) and host.holders([str(lock)])) and time.time() < deadline:
            time.sleep(0.05)
        said = host.free_chips(str(lock), (str(dev),))
        assert holder.wait(10) == -9 and f"pid {holder.pid} still holds {dev}" in said[0]
        assert lock.exists() and "held by pids" in said[-1]  # a live libtpu's lock is not stale
        locker.kill()
        locker.wait()
        assert host.free_chips(str(lock), (str(dev),)) == [f"removed the stale {lock}"] and not lock.exists()
    finally:
        for p in (holder, locker):
            p.kill()
            p.wait()


def test_every_process_the_launcher_starts_uses_the_gcsfs_backend_of_epath(tmp_path, monkeypatch):
    """EPATH_USE_TF=false in the scripts and in every training process's environment (etils would otherwise
    use tf.io.gfile whenever TensorFlow is importable: a client no launch test runs)."""
    monkeypatch.delenv("EPATH_USE_TF", raising=False)
    plan = {"base": str(tmp_path / "ns"), "sweep": "s", "slices": 1, "hosts_per_slice": 1, "points": [], **A.TIMING,
            "max_attempts": 1, "teardown": False, "env": {}, "boot_wait_s": 1800}
    assert A.Agent(plan, 0, 0, tmp_path / "w").child_env(1)["EPATH_USE_TF"] == "false"
    for name in ("launch_tpu.sh.in", "startup.sh.in", "bootstrap.sh.in"):
        assert "export EPATH_USE_TF=false" in (Path(bundle.__file__).parent / name).read_text(), name


# -- #4: the leader's bounded wait for a host that never starts ------------------------------------
def test_a_host_that_never_starts_fails_the_point_after_the_boot_wait_with_its_boot_log():
    hosts = ("0-0", "0-1")
    beats = {"0-0": {"state": "idle", "time": 1000.0}}
    v = A.PointView(hosts, beats=beats, now=1000.0, since=0.0,
                    boot={"0-1": ["try 6 of 6 failed: uv pip install", "gave up after 6 tries: uv pip install"]})
    a = A.decide(v, 3, 120, boot_wait_s=1800)
    assert a.kind == "wait" and "slice0-worker1 (no heartbeat yet)" in a.reason  # within the bound: it waits
    a = A.decide(A.PointView(**{**v.__dict__, "now": 1900.0}), 3, 120, boot_wait_s=1800)
    assert a.kind == "fail" and a.reason.startswith("slice0-worker1 never started (no heartbeat 1800 s")
    assert "last boot log lines: try 6 of 6 failed: uv pip install | gave up after 6 tries" in a.reason
    st = A.next_status({}, a, A.PointView(**{**v.__dict__, "now": 1900.0}))
    assert st["state"] == "failed" and st["reason"] == a.reason


# -- #1: one pod, one namespace -------------------------------------------------------------------------
def _plan(qr, points, root="gs://b/r/s", acc="v5p-16", slices=1):
    return {"qr": qr, "zone": "z", "project": "", "accelerator": acc, "slices": slices, "root": root,
            "base": f"{root}/_pods/{qr}", "points": [{"name": p, "workdir": f"{root}/{p}"} for p in points]}


def test_two_pods_on_one_root_share_no_coordination_file_and_the_same_run_folders():
    from diloco.tpu.layout import Layout

    (root1, ns1), (root2, ns2) = bundle.namespace("gs://b/r", "s", "pod-1"), bundle.namespace("gs://b/r/", "s", "pod-2")
    assert root1 == root2 == "gs://b/r/s" and (ns1, ns2) == ("gs://b/r/s/_pods/pod-1", "gs://b/r/s/_pods/pod-2")

    def files(L):
        return {str(p) for p in (L.beat("0-0"), L.stop, L.status("p"), L.go("p", 1), L.attempt("p", 1),
                                 L.log("p", 1, "0-0"), L.boot_log("0-0"), L.agent_log("0-0"), L.maintenance("0-0"))}

    assert not files(Layout(ns1)) & files(Layout(ns2))


def test_a_live_launch_of_another_resource_on_the_same_points_is_refused_naming_it():
    mine = _plan("pod-2", ["a", "b"])
    live = lambda qr, plan: {"state": {"state": "ACTIVE"}}  # noqa: E731
    why = pods.check_others(mine, [_plan("pod-1", ["b", "c"])], live)
    assert "queued resource pod-1 (ACTIVE, z) running b" in why and "delete pod-1 --zone=z" in why and "--only" in why
    assert pods.check_others(mine, [_plan("pod-1", ["c"])], live) == ""  # --only split: disjoint points
    assert pods.check_others(mine, [_plan("pod-1", ["a"])], lambda qr, plan: None) == ""  # deleted: not live


def test_up_on_an_existing_resource_of_another_shape_is_refused():
    desc = {"state": {"state": "ACTIVE"}, "tpu": {"nodeSpec": [{"node": {"acceleratorType": "v5p-8"},
                                                                "multisliceParams": {"nodeCount": 2}}]}}
    why = pods.check_shape(_plan("pod-1", ["a"], acc="v5p-16", slices=1), desc)
    assert "exists (ACTIVE) as 2× v5p-8, but this bundle is for 1× v5p-16" in why
    assert pods.check_shape(_plan("pod-1", ["a"], acc="v5p-8", slices=2), desc) == ""
    assert pods.check_shape(_plan("pod-1", ["a"]), {**desc, "state": {"state": "SUSPENDED"}}) == ""  # up recreates it


# -- the stand-in: reboots, repairs, failing downloads, a host that never boots, two pods --------------
FAKE_AGENT = """#!/bin/sh
# stands for the environment's python running `-m diloco.tpu.agent`: says where and how it was started
{ echo "cwd=$(pwd)"; echo "EPATH_USE_TF=${EPATH_USE_TF:-}"; echo "nofile=$(ulimit -n) $(ulimit -Hn)"; } > "$HOME/seen.tmp"
mv "$HOME/seen.tmp" "$HOME/seen.txt"  # whole: the test polls for the file
exec sleep 600
"""


def _seen(standin, s=0, w=0) -> dict:
    p = standin.host("pod-1", s, w).home / "seen.txt"
    if not p.exists():  # the fake agent renames it into place whole
        return {}
    return dict(line.split("=", 1) for line in p.read_text().splitlines() if "=" in line)


def _up(script, **env) -> subprocess.CompletedProcess:
    r = subprocess.run(["bash", str(script), "up"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "POLL_S": "0.1", **env})
    print(r.stdout, r.stderr)
    return r


def _rebundle(out: Path, tmp_path: Path) -> str:
    """What a new `diloco sweep … --launch tpu` after a code change writes: another tree, startup.sh naming it."""
    src = tmp_path / "tree-b"
    src.mkdir()
    (src / "CHANGED").write_text("the new code\n")
    tar, sha = bundle.write_tree(["CHANGED"], out, root=src)
    for old in out.glob("tree-*.tar.gz"):
        if old != tar:
            old.unlink()
    text = (out / "startup.sh").read_text()
    text = re.sub(r"^TREE=.*$", f"TREE={tar.name}", text, flags=re.M)
    (out / "startup.sh").write_text(re.sub(r"^TREE_SHA256=.*$", f"TREE_SHA256={sha}", text, flags=re.M))
    return tar.name.removesuffix(".tar.gz")


def test_reboot_repair_and_failing_downloads_always_converge_on_the_current_bundle(standin, gcs, tmp_path):
    """The metadata holds the fixed bootstrap: after `up` with a new bundle on the live resource, a rebooted
    host runs the new tree (and removes the old one), a repaired one (fresh disk) too; a tree download that
    fails twice is retried and the agent starts; the boot log is in the bucket; the environment the agent
    gets has EPATH_USE_TF=false and the hard open-file limit — the stand-in's hosts no longer set it."""
    fake = tmp_path / "fake-agent"
    fake.write_text(FAKE_AGENT)
    fake.chmod(0o755)
    standin.configure(emulator_env={**standin.config["emulator_env"], "DILOCO_TPU_PYTHON": str(fake),
                                    "DILOCO_BOOT_BACKOFF_S": "0", "DILOCO_BOOT_TRIES": "3"})
    out = tmp_path / "b"
    assert sw.main([str(_sweep(tmp_path)), "--root", gcs.url("r"), *TPU, "--accelerator", "v5litepod-4",
                    "--check-fit", "off", "--out", str(out), "--dry-run"]) == 0
    ns = gcs.url("r/cl/_pods/pod-1")
    r = _up(out / "launch_tpu.sh")
    assert r.returncode == 0 and "pod-1 is ACTIVE" in r.stdout, r.stderr
    assert "EPATH_USE_TF" not in standin.host_env("pod-1", 0, 0)  # a VM sets nothing: the launcher must
    meta = standin.describe("pod-1")["tpu"]["nodeSpec"][0]["node"]["metadata"]["startup-script"]
    assert meta == (out / "bootstrap.sh").read_text()
    tree_a = next(out.glob("tree-*.tar.gz")).name.removesuffix(".tar.gz")
    seen = standin.wait_for(lambda: _seen(standin), 180, "the agent started at boot")
    assert seen["cwd"].endswith(f"/diloco/{tree_a}") and seen["EPATH_USE_TF"] == "false"
    soft, hard = seen["nofile"].split()
    assert soft == hard, seen
    boot_log = lambda: gcs.read(f"{ns}/_pod/boot/slice0-worker0.log").decode() if gcs.exists(  # noqa: E731
        f"{ns}/_pod/boot/slice0-worker0.log") else ""
    standin.wait_for(lambda: "agent started" in boot_log(), 120, "the boot log in the bucket")

    tree_b = _rebundle(out, tmp_path)
    r = _up(out / "launch_tpu.sh")
    assert r.returncode == 0 and "pod-1 was already ACTIVE" in r.stdout and "bash" in r.stdout
    assert not [c for c in standin.invocations() if "create" in c["argv"]][1:], "up created it again"
    assert _seen(standin)["cwd"].endswith(tree_a)  # nothing happens on the hosts by itself
    standin.fail("storage", "cp", "tree-", times=2, host="pod-1/slice0-worker0")
    (standin.host("pod-1", 0, 0).home / "seen.txt").unlink()
    standin.reboot_host("pod-1", 0, 0)
    seen = standin.wait_for(lambda: _seen(standin), 180, "the agent after the reboot")
    home = standin.host("pod-1", 0, 0).home
    assert seen["cwd"].endswith(f"/diloco/{tree_b}") and not (home / "diloco" / tree_a).exists()
    log = standin.wait_for(lambda: boot_log().count("agent started") and boot_log(), 120, "the boot log")
    assert "try 1 of 3 failed: gcloud storage cp" in log and "try 2 of 3 failed" in log and "agent started" in log

    standin.repair_host("pod-1", 0, 0, fresh=True)  # the slice recreated: a new disk, the same metadata
    seen = standin.wait_for(lambda: _seen(standin), 180, "the agent after the repair")
    assert seen["cwd"].endswith(f"/diloco/{tree_b}")

    # a download that never succeeds: the boot fails, says why in the bucket, and status shows it
    standin.fail("storage", "cp", "tree-", times=99, host="pod-1/slice0-worker0")
    standin.repair_host("pod-1", 0, 0, fresh=True)
    standin.wait_for(lambda: "boot failed" in boot_log(), 180, "the failed boot's log in the bucket")
    assert not _seen(standin)
    A.fresh_reads()
    text = S.render(S.collect(ns))
    assert "slice0-worker0 (leader)" in text and "no heartbeat yet; its boot log (_pod/boot/) ends:" in text
    assert re.search(r"\| .*gave up after 3 tries: gcloud storage cp", text), text
    r = subprocess.run(["bash", str(out / "launch_tpu.sh"), "boot"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "slice0-worker0.log <==" in r.stdout and "boot failed" in r.stdout

    # a second pod on the same root and points while pod-1 lives: refused before anything is uploaded
    out2 = tmp_path / "b2"
    assert sw.main([str(_sweep(tmp_path)), "--root", gcs.url("r"), *[a if a != "pod-1" else "pod-2" for a in TPU],
                    "--accelerator", "v5litepod-4", "--check-fit", "off", "--out", str(out2), "--dry-run"]) == 0
    r = _up(out2 / "launch_tpu.sh")
    assert r.returncode == 1 and "already holds the live launch of queued resource pod-1 (ACTIVE" in r.stderr
    assert standin.state("pod-2") is None and not gcs.objects("r/cl/_pods/pod-2/")


# -- #2, #14: checks before billing (`up` runs them before it uploads or creates) -----------------------
class FakeGcloud:
    """`run` for diloco.tpu.pods: answers by the command's leading words; records every call."""

    def __init__(self, **answers):
        self.answers, self.calls = answers, []

    def __call__(self, argv, **kw):
        self.calls.append(argv)
        key = " ".join(w for w in argv[1:6] if not w.startswith("-") and not w.startswith("gs://")
                       and w not in ("proj", "pod-1"))
        out = self.answers.get(key)
        return subprocess.CompletedProcess(argv, 0 if out is not None else 1,
                                           out if isinstance(out, str) else json.dumps(out), "")


def _live(**kw):
    return {**_plan("pod-1", ["a"]), "zone": "us-east5-a", "project": "proj", "base": "gs://bkt/r/s/_pods/pod-1", **kw}


SA = "123-compute@developer.gserviceaccount.com"


@pytest.mark.parametrize("bindings,teardown,refused,warned", [
    ([("roles/editor", SA)], True, "", ""),  # the default compute account's default role
    ([("roles/storage.objectUser", SA)], False, "", ""),
    ([("roles/storage.objectViewer", SA)], False, "holds no role on project proj or gs://bkt granting storage.objects.create", ""),
    ([], False, "(its roles: none)", ""),
    ([("roles/storage.objectAdmin", SA)], True, "--teardown: the VMs' service account", ""),
    ([("projects/proj/roles/custom", SA)], False, "", "cannot read"),
])
def test_the_vms_service_account_needs_roles_for_what_the_hosts_do(bindings, teardown, refused, warned):
    policy = {"bindings": [{"role": r, "members": [f"serviceAccount:{m}"]} for r, m in bindings]}
    run = FakeGcloud(**{"projects describe": {"projectNumber": "123"}, "projects get-iam-policy": policy,
                        "storage buckets get-iam-policy": {"bindings": []}})
    why, warning = pods.check_account(_live(teardown=teardown), run)
    assert (refused in why if refused else why == "") and bool(warning) == bool(warned), (why, warning)
    if why:
        assert f"--member=serviceAccount:{SA}" in why
    run = FakeGcloud()  # policies this user cannot read: a warning, not a refusal
    assert pods.check_account(_live(service_account="sa@proj.iam.gserviceaccount.com"), run)[0] == ""


VIEWER = {"role": "roles/storage.objectViewer", "members": [f"serviceAccount:{SA}"]}


@pytest.mark.parametrize("extra,parent,refused,warned", [
    ([], {}, "granting storage.objects.create, storage.objects.delete", ""),  # the viewer role alone: refused
    ([{"role": "roles/storage.objectUser", "members": [f"serviceAccount:{SA}"],
       "condition": {"title": "runs only", "expression": "resource.name.startsWith('projects/_/buckets/bkt/objects/r')"}}],
     {}, "", "it may through a conditional binding"),
    ([{"role": "roles/storage.objectUser", "members": ["group:ml@example.com"]}], {}, "", "a group or domain binding"),
    ([{"role": "roles/storage.objectUser", "members": ["domain:example.com"]}], {}, "", "a group or domain binding"),
    ([], {"type": "folder", "id": "42"}, "", "the folder above project proj (inherited roles"),
    ([{"role": "roles/storage.objectViewer", "members": ["group:ml@example.com"]}], {}, "granting", ""),  # not enough
])
def test_a_role_held_through_a_condition_a_group_or_a_folder_is_a_warning_not_a_refusal(extra, parent, refused, warned,
                                                                                        monkeypatch):
    run = FakeGcloud(**{"projects describe": {"projectNumber": "123", **({"parent": parent} if parent else {})},
                        "projects get-iam-policy": {"bindings": [VIEWER, *extra]},
                        "storage buckets get-iam-policy": {"bindings": []}})
    why, warning = pods.check_account(_live(), run)
    assert (refused in why if refused else why == "") and (warned in warning if warned else warning == ""), (why, warning)
    if refused:  # DILOCO_IAM_CHECK=warn: the user overrides the refusal; `up` goes on with a warning
        said = []
        monkeypatch.setattr(pods, "check_offered", lambda plan, run: ("", ""))
        monkeypatch.setattr(pods, "check_location", lambda plan, run: ("", ""))
        monkeypatch.setattr(pods, "other_launches", lambda plan, run: [])
        assert pods.check_up(_live(), run, said.append) != ""
        monkeypatch.setenv("DILOCO_IAM_CHECK", "warn")
        assert pods.check_up(_live(), run, said.append) == "" and refused in said[-1] and "warning" in said[-1]


def test_the_buckets_the_points_read_are_checked_too():
    """The store's bucket without a role for the account: a warning naming it and the binding; a public
    vocabulary bucket (allUsers) and the root's own bucket: nothing."""
    plan = _live(points=[{"name": "a", "workdir": "gs://bkt/r/s/a", "argv": [
        "train", "--config.data=tokens:gs://stores/c4", "--config.vocab=sentencepiece:gs://t5-data/v/spm.model",
        "--workdir", "gs://bkt/r/s/a"]}])
    policies = {"gs://stores": {"bindings": [{"role": "roles/storage.objectViewer", "members": ["user:me@x.org"]}]},
                "gs://t5-data": {"bindings": [{"role": "roles/storage.objectViewer", "members": ["allUsers"]}]}}

    def run(argv, **kw):
        out = {"projects describe": {"projectNumber": "123"}, "projects get-iam-policy": {"bindings": []}}.get(
            " ".join(argv[1:3])) or policies.get(argv[4] if argv[1:4] == ["storage", "buckets", "get-iam-policy"] else "")
        return subprocess.CompletedProcess(argv, 0 if out else 1, json.dumps(out), "")

    assert pods.read_buckets(plan) == ["stores", "t5-data"]
    said = pods.check_readers(plan, run)
    assert len(said) == 1 and said[0].startswith(f"{SA} holds no role on project proj or gs://stores (a bucket the "
                                                 "points read) granting storage.objects.get and list"), said
    policies["gs://stores"]["bindings"][0]["members"].append(f"serviceAccount:{SA}")
    assert pods.check_readers(plan, run) == []


def test_the_zone_must_offer_the_type_and_no_stray_node_may_hold_the_name():
    run = FakeGcloud(**{"compute tpus tpu-vm accelerator-types list": [{"type": "v5p-8"}, {"type": "v5p-32"}],
                        "compute tpus tpu-vm list": [{"name": "projects/p/locations/z/nodes/pod-1"}]})
    why, _ = pods.check_offered(_live(accelerator="v5p-16"), run)
    assert "us-east5-a does not offer v5p-16 (it offers v5p-32, v5p-8)" in why
    assert pods.check_offered(_live(accelerator="v5p-8"), run) == ("", "")
    assert "TPU node pod-1 already exists in us-east5-a" in pods.check_nodes(_live(), None, run)
    assert pods.check_nodes(_live(), {"state": {"state": "ACTIVE"}}, run) == ""  # its own node
    assert pods.check_nodes(_live(slices=2), None, run) == ""  # multislice nodes are pod-1-0, pod-1-1


def test_the_buckets_location_is_printed_beside_the_zone_and_a_region_apart_is_warned():
    note, warn = pods.check_location(_live(), FakeGcloud(**{"storage buckets describe": {"location": "US-EAST5"}}))
    assert note == "bucket gs://bkt is in US-EAST5, the pod in us-east5-a" and warn == ""
    note, warn = pods.check_location(_live(), FakeGcloud(**{"storage buckets describe": {"location": "EU"}}))
    assert "is in EU" in note and "not in the pod's region us-east5" in warn and "egress" in warn


def test_a_transient_describe_error_is_retried_not_taken_for_an_absent_resource(standin, gcs, tmp_path):
    """`up` asks the state again after an API error (not NOT_FOUND): one create, no ALREADY_EXISTS."""
    out = tmp_path / "b"
    assert sw.main([str(_sweep(tmp_path)), "--root", gcs.url("r"), *TPU, "--accelerator", "v5litepod-4",
                    "--check-fit", "off", "--out", str(out), "--dry-run"]) == 0
    standin.configure(waiting_s=0.5)
    standin.fail("queued-resources", "describe", "value(state.state)", times=2)
    r = _up(out / "launch_tpu.sh")
    assert r.returncode == 0 and "pod-1 is ACTIVE" in r.stdout, r.stderr
    assert [c["argv"][3] for c in standin.invocations() if c["argv"][:3] == ["compute", "tpus", "queued-resources"]
            ].count("create") == 1


def test_a_vm_account_without_bucket_roles_is_refused_before_create_and_would_never_boot(standin, gcs, tmp_path):
    """The stand-in's bucket refuses the VMs' calls by identity from the project's IAM policy. With the
    default compute account stripped of its roles, `up` refuses before anything is uploaded or created,
    naming the account and the grant; a resource created anyway never boots (the fetch is refused)."""
    from tests.standin import iam

    iam.save(standin.root, enforce=True, project={"bindings": [
        {"role": "roles/owner", "members": ["user:user@example.com"]}]})
    out = tmp_path / "b"
    assert sw.main([str(_sweep(tmp_path)), "--root", gcs.url("r"), *TPU, "--accelerator", "v5litepod-4",
                    "--check-fit", "off", "--out", str(out), "--dry-run"]) == 0
    r = _up(out / "launch_tpu.sh")
    assert r.returncode == 1 and f"the VMs' service account {iam.DEFAULT_SA} holds no role" in r.stderr
    assert "roles/storage.objectUser" in r.stderr and standin.state("pod-1") is None and not gcs.objects("r/")
    # what today's launcher met: created anyway, the host's first download is refused, no agent ever starts
    gcs.write(gcs.url("r/cl/_pods/pod-1/_launch/startup.sh"), (out / "startup.sh").read_text())
    standin.configure(emulator_env={**standin.config["emulator_env"], "DILOCO_BOOT_TRIES": "2",
                                    "DILOCO_BOOT_BACKOFF_S": "0"})
    standin.create("pod-1", zone="us-east5-a", accelerator_type="v5litepod-4", runtime_version="v",
                   node_id="pod-1", metadata_files={"startup-script": str(out / "bootstrap.sh")})
    log = standin.host("pod-1", 0, 0).home / "diloco" / "boot.log"
    standin.wait_for(lambda: log.exists() and "boot failed" in log.read_text(), 180, "the refused boot")
    assert "could not fetch" in log.read_text()
    assert "403" in (standin.host("pod-1", 0, 0).home / "startup.log").read_text()


@pytest.mark.skipif(os.geteuid() != 0 or not __import__("shutil").which("setpriv"), reason="needs root and setpriv")
def test_start_without_passwordless_sudo_never_starts_a_second_agent_beside_roots(tmp_path):
    """startup.sh run by a user without passwordless sudo (`launch_tpu.sh start` over ssh) while the boot's
    agent runs as root: it says so and starts nothing."""
    out = tmp_path / "b"
    assert sw.main([str(_sweep(tmp_path)), "--root", "gs://bkt/r", *TPU, "--accelerator", "v5litepod-4",
                    "--check-fit", "off", "--out", str(out), "--dry-run"]) == 0
    import tempfile

    with tempfile.TemporaryDirectory() as d:  # under /tmp: the user can reach it (pytest's folder is 0700)
        os.chmod(d, 0o755)
        home = Path(d) / "home"
        home.mkdir()
        os.chown(home, 65534, 65534)
        (Path(d) / "startup.sh").write_text((out / "startup.sh").read_text())
        root_agent = subprocess.Popen(["bash", "-c", 'exec -a "python -m diloco.tpu.agent --plan x" sleep 60'])
        try:
            time.sleep(0.2)
            r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash",
                                str(Path(d) / "startup.sh")], capture_output=True, text=True, timeout=60,
                               env={"HOME": str(home), "PATH": "/usr/bin:/bin", "DILOCO_TPU_PYTHON": "/bin/false"})
            assert r.returncode == 0 and f"the agent already runs as root (pid {root_agent.pid})" in r.stdout, r
            assert not (home / "diloco").exists()
        finally:
            root_agent.kill()
            root_agent.wait()
