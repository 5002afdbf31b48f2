"""The Cloud TPU / Cloud Storage stand-in itself (tests/standin/): each stub `gcloud` command, hosts
as local processes (concurrency, environment, kill / repair, states), the storage emulator reached by
the product's own gs:// libraries (epath/gcsfs, RunDir, orbax/tensorstore), and the secret scan."""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from diloco.tpu import accelerators
from standin.cloud import GcloudError, accelerator_hosts, own_accelerator_hosts
from standin.secrets import find_secrets

QR = ("compute", "tpus", "queued-resources")
ZONE = "us-east5-a"


def script(tmp_path, body: str) -> str:
    p = tmp_path / "startup.sh"
    p.write_text(body)
    return str(p)


def barrier(path, n: int) -> str:
    """Shell: announce this host in `path`, then wait (≤ 20 s) until `n` hosts have; exit 3 if they never do."""
    return (f"mkdir -p {path}; touch {path}/$DILOCO_PROCESS_ID; date +%s.%N > {path}/t$DILOCO_PROCESS_ID; "
            f"for i in $(seq 400); do [ $(ls {path} | grep -vc '^t') -ge {n} ] && break; sleep 0.05; done; "
            f"[ $(ls {path} | grep -vc '^t') -ge {n} ] || exit 3")


def two_slices(standin, tmp_path, startup: str | None = None, name: str = "qr", **kw):
    """v5p-16 (8 chips, 2 hosts) × 2 slices, ACTIVE: four hosts."""
    files = {"startup-script": script(tmp_path, startup)} if startup else {}
    standin.create(name, zone=ZONE, accelerator_type="v5p-16", runtime_version="v2-alpha-tpuv5", node_count=2,
                   node_prefix=name, metadata_files=files, **kw)
    standin.wait_state(name, "ACTIVE")
    return name


def test_accelerator_names_give_the_hosts_of_one_slice():
    for hosts in (accelerator_hosts, own_accelerator_hosts):
        assert hosts("v5p-8") == (4, 1)  # TensorCores: 2 per chip, 4 chips per host
        assert hosts("v5p-16") == (8, 2)
        assert hosts("v4-32") == (16, 4)
        assert hosts("v5p-384") == (192, 48)  # 4x4x12
        assert hosts("v5litepod-8") == (8, 1)  # chips; up to 8 on one host
        assert hosts("v6e-16") == (16, 4)
        for bad in ("v5p-48", "v5litepod-24", "v5e-8", "v5p-7", "v4-8320"):
            with pytest.raises(GcloudError):
                hosts(bad)


def test_the_stand_ins_own_accelerator_rule_agrees_with_the_launchers_table():
    for gen, sizes in (("v4", range(2, 8400, 2)), ("v5p", range(2, 12400, 2)), ("v5litepod", range(300)),
                       ("v6e", range(300))):
        for n in [*sizes, 7, 9, 15]:
            name = f"{gen}-{n}"
            try:
                mine = own_accelerator_hosts(name)
            except GcloudError:
                mine = None
            s = accelerators.TABLE.get(name)
            assert mine == (s and (s.chips, s.hosts)), name


def test_create_describe_list_delete_through_the_stub(standin, tmp_path, monkeypatch):
    monkeypatch.setenv("STANDIN_TEST_ONLY_VARIABLE", "the-laptop-has-it")
    boot = tmp_path / "boot"
    body = f"env > $HOME/env.txt\n{barrier(boot, 4)}\necho together\nexec sleep 600\n"
    r = standin.gcloud(*QR, "create", "sweep-a", f"--zone={ZONE}", "--accelerator-type=v5p-16",
                       "--runtime-version=v2-alpha-tpuv5", "--node-count=2", "--node-prefix=sweep-a", "--spot",
                       "--valid-until-duration=6h", "--internal-ips", "--service-account=sa@p.iam.gserviceaccount.com",
                       f"--metadata-from-file=startup-script={script(tmp_path, body)}")
    assert r.returncode == 0, r.stderr
    standin.wait_state("sweep-a", "ACTIVE")
    assert [s for s, _ in standin.resource("sweep-a")["history"]] == ["WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE"]
    r = standin.gcloud(*QR, "describe", "sweep-a", f"--zone={ZONE}", "--format=value(state.state)")
    assert (r.returncode, r.stdout) == (0, "ACTIVE\n")
    d = json.loads(standin.gcloud(*QR, "describe", "sweep-a", f"--zone={ZONE}", "--format=json").stdout)
    spec = d["tpu"]["nodeSpec"][0]
    assert d["name"] == f"projects/standin-project/locations/{ZONE}/queuedResources/sweep-a"
    assert spec["multisliceParams"] == {"nodeCount": 2, "nodeIdPrefix": "sweep-a"}
    assert spec["node"]["networkConfig"]["enableExternalIps"] is False and "spot" in d
    assert d["queueingPolicy"] == {"validUntilDuration": "21600s"}
    # every host booted and ran its startup script at the same time (the barrier needs all four)
    homes = {(h.slice, h.worker): h.home for h in standin.hosts("sweep-a")}
    assert sorted(homes) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    standin.wait_for(lambda: all("together" in (h / "startup.log").read_text() for h in homes.values()
                                 if (h / "startup.log").exists()) and len(list(boot.glob("t*"))) == 4, what="boot")
    for (s, w), home in homes.items():
        env = dict(line.split("=", 1) for line in (home / "env.txt").read_text().splitlines() if "=" in line)
        assert env["DILOCO_PROCESS_ID"] == str(2 * s + w) and env["DILOCO_NUM_PROCESSES"] == "4"
        assert (env["TPU_WORKER_ID"], env["MEGASCALE_SLICE_ID"], env["MEGASCALE_NUM_SLICES"]) == (str(w), str(s), "2")
        assert env["TPU_WORKER_HOSTNAMES"] == f"127.1.{s}.1,127.1.{s}.2"
        assert (env["DILOCO_TPU_SLICE"], env["DILOCO_TPU_WORKER"], env["DILOCO_TPU_NAME"]) == (str(s), str(w), "sweep-a")
        assert env["HOME"] == str(home) and env["PATH"].split(":")[0] == str(standin.bin_dir)
        assert env["STORAGE_EMULATOR_HOST"] == standin.bucket.emulator.endpoint and env["JAX_PLATFORMS"] == "cpu"
        assert "STANDIN_TEST_ONLY_VARIABLE" not in env and "GCLOUD_STANDIN_DIR" not in env
    assert len({open(h / "env.txt").read().split("DILOCO_COORDINATOR=")[1].split()[0] for h in homes.values()}) == 1
    r = standin.gcloud(*QR, "delete", "sweep-a", f"--zone={ZONE}", "--quiet")
    assert r.returncode == 1 and "--force" in r.stderr  # an ACTIVE resource has nodes
    assert [p["cmdline"] for p in standin.processes("sweep-a")] == [["sleep", "600"]] * 4  # the scripts exec sleep
    r = standin.gcloud(*QR, "delete", "sweep-a", f"--zone={ZONE}", "--force", "--quiet")
    assert r.returncode == 0, r.stderr
    assert standin.resource("sweep-a") is None and standin._pids(standin.root) == []
    r = standin.gcloud(*QR, "describe", "sweep-a", f"--zone={ZONE}")
    assert r.returncode == 1 and "NOT_FOUND" in r.stderr
    assert [i["argv"][3] for i in standin.invocations()] == ["create", "describe", "describe", "delete", "delete",
                                                             "describe"]
    assert all(i["host"] is None for i in standin.invocations())


def test_ssh_runs_on_every_host_at_once_and_fails_when_one_fails(standin, tmp_path):
    two_slices(standin, tmp_path)
    r = standin.gcloud(*QR, "ssh", "qr", f"--zone={ZONE}", "--node=all", "--worker=all",
                       f"--command={barrier(tmp_path / 'b', 4)}; echo at $DILOCO_PROCESS_ID in $PWD")
    assert r.returncode == 0, r.stdout + r.stderr  # a host run after another would wait at the barrier and exit 3
    lines = sorted(r.stdout.splitlines())
    assert lines == sorted(f"qr-{s} worker-{w}: at {2 * s + w} in {standin.host('qr', s, w).home}"
                           for s in (0, 1) for w in (0, 1))
    starts = [float((tmp_path / "b" / f"t{i}").read_text()) for i in range(4)]
    assert max(starts) - min(starts) < 5
    r = standin.gcloud(*QR, "ssh", "qr", f"--zone={ZONE}", "--node=1", "--worker=0", "--command=echo $DILOCO_PROCESS_ID")
    assert (r.returncode, r.stdout) == (0, "qr-1 worker-0: 2\n")
    r = standin.gcloud(*QR, "ssh", "qr", f"--zone={ZONE}", "--node=all", "--worker=all",
                       "--command=[ $DILOCO_PROCESS_ID != 3 ] || exit 7")
    assert r.returncode == 7 and r.stdout == ""


def test_a_killed_host_loses_every_process_and_a_repaired_one_boots_again(standin, tmp_path):
    # the startup script leaves a daemon in its own session, as startup.sh does with the agent
    body = "setsid nohup sleep 601 > /dev/null 2>&1 < /dev/null &\nexec sleep 600\n"
    two_slices(standin, tmp_path, body)
    settled = sorted([["sleep", "600"], ["sleep", "601"]] * 4)  # not while bash or nohup is still about to exec
    standin.wait_for(lambda: sorted(p["cmdline"] for p in standin.processes("qr")) == settled,
                     what="the script and its daemon on each of 4 hosts")
    on_host = {p["cmdline"][1]: p for p in standin.processes("qr") if p["host"] == "slice0-worker1"}
    daemon = [on_host["601"]]
    assert daemon[0]["pgid"] != on_host["600"]["pgid"]  # setsid: out of reach of the script's process group
    standin.kill_host("qr", 0, 1)
    assert {p["host"] for p in standin.processes("qr")} == {"slice0-worker0", "slice1-worker0", "slice1-worker1"}
    assert not os.path.exists(f"/proc/{daemon[0]['pid']}/cmdline") or open(f"/proc/{daemon[0]['pid']}/stat").read(
        ).split(")")[1].split()[0] == "Z"
    assert standin.host_state("qr", 0, 1) == "DOWN"
    r = standin.gcloud(*QR, "ssh", "qr", f"--zone={ZONE}", "--node=0", "--worker=all", "--command=echo up")
    assert r.returncode == 255
    assert sorted(r.stdout.splitlines()) == ["qr-0 worker-0: up",
                                             "qr-0 worker-1: ssh: connect to host 127.1.0.2 port 22: Connection refused"]
    standin.repair_host("qr", 0, 1)
    standin.wait_for(lambda: sorted(p["cmdline"] for p in standin.processes("qr")) == settled,
                     what="the repaired host's processes")
    log = (standin.host("qr", 0, 1).home / "startup.log").read_text()
    assert "boot 1," in log and "boot 2," in log
    r = standin.gcloud(*QR, "ssh", "qr", f"--zone={ZONE}", "--node=all", "--worker=all", "--command=true")
    assert r.returncode == 0
    standin.kill_all()
    assert standin._pids(standin.root) == []


@pytest.mark.parametrize("state", ["SUSPENDED", pytest.param("FAILED", marks=pytest.mark.slow),
                                   pytest.param("PREEMPTED", marks=pytest.mark.slow)])
def test_a_state_that_loses_the_slices_kills_every_host(standin, tmp_path, state):
    two_slices(standin, tmp_path, "exec sleep 600\n")
    standin.wait_for(lambda: len(standin.processes("qr")) == 4, what="every host's startup script")
    r = subprocess.run(["gcloud", "standin", "set-state", "qr", state], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert standin.processes("qr") == [] and standin.state("qr") == state
    r = standin.gcloud(*QR, "describe", "qr", f"--zone={ZONE}", "--format=value(state.state)")
    assert r.stdout == f"{state}\n"
    r = standin.gcloud(*QR, "ssh", "qr", f"--zone={ZONE}", "--node=all", "--worker=all", "--command=true")
    assert r.returncode == 1 and "not ACTIVE" in r.stderr
    with pytest.raises(GcloudError):
        standin.repair_host("qr", 0, 0)
    assert [i for i in standin.invocations() if i["argv"][0] == "standin"] == []  # controls are not logged


def test_a_resource_waits_for_capacity_until_it_arrives(standin, tmp_path):
    standin.configure(waiting_s=None)
    standin.create("held", zone=ZONE, accelerator_type="v5litepod-8", runtime_version="v2-alpha-tpuv5-lite",
                   node_id="held", metadata_files={"startup-script": script(tmp_path, "exec sleep 600\n")})
    time.sleep(0.5)
    assert standin.state("held") == "WAITING_FOR_RESOURCES" and standin.processes("held") == []
    assert [(h.slice, h.worker, h.node_id) for h in standin.hosts("held")] == [(0, 0, "held")]  # one host
    assert "MEGASCALE_NUM_SLICES" not in standin.host_env("held", 0, 0)  # single slice: no multislice variables
    standin.set_state("held", "ACTIVE")  # the startup script starts (a moment later, as on a VM: poll)
    standin.wait_for(lambda: [p["host"] for p in standin.processes("held")] == ["slice0-worker0"],
                     timeout=10, what="the startup script running on slice0-worker0")
    standin.delete("held", force=True, asynchronous=True)
    assert standin.state("held") == "DELETING"
    standin.wait_for(lambda: standin.resource("held") is None and standin._pids(standin.root) == [],
                     what="the asynchronous delete")


def test_what_the_stand_in_does_not_implement_is_refused_with_exit_2(standin, tmp_path):
    common = ("qr", f"--zone={ZONE}", "--accelerator-type=v5p-8", "--runtime-version=v", "--node-id=qr")
    for argv in [("compute", "tpus", "tpu-vm", "ssh", "qr"), (*QR, "create", *common, "--best-effort"),
                 (*QR, "create", "qr", f"--zone={ZONE}", "--topology=2x2x1", "--runtime-version=v", "--node-id=qr"),
                 (*QR, "ssh", "qr", f"--zone={ZONE}", "--command=true", "--dry-run"), ("storage", "mv", "a", "b"),
                 (*QR, "create", *common, "--zon=x"), (*QR, "describe", "qr", f"--zone={ZONE}", "--format=csv")]:
        r = standin.gcloud(*argv)
        assert r.returncode == 2 and r.stderr.startswith("ERROR: (gcloud"), (argv, r.stderr)
    r = standin.gcloud("alpha", *QR, "create", *common, "--best-effort", "--async")  # alpha has it
    assert r.returncode == 0, r.stderr
    assert json.loads(standin.gcloud(*QR, "describe", "qr", f"--zone={ZONE}", "--format=json").stdout)["bestEffort"] == {}


def test_storage_commands_round_trip_with_the_products_gs_library(standin, tmp_path):
    from etils import epath

    b = standin.bucket
    src = tmp_path / "tree"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("alpha")
    (src / "sub" / "b.bin").write_bytes(bytes(range(256)))
    assert standin.gcloud("storage", "cp", "-r", str(src), b.url("up") + "/").returncode == 0
    assert b.objects("up/") == {"up/tree/a.txt": b"alpha", "up/tree/sub/b.bin": bytes(range(256))}
    assert epath.Path(b.url("up/tree/sub/b.bin")).read_bytes() == bytes(range(256))  # gcsfs sees what gcloud wrote
    epath.Path(b.url("made/by/epath.json")).write_text('{"x": 1}')
    assert standin.gcloud("storage", "cat", b.url("made/by/epath.json")).stdout == '{"x": 1}'
    r = standin.gcloud("storage", "ls", b.url("up/tree"))
    assert r.stdout.splitlines() == [b.url("up/tree/a.txt"), b.url("up/tree/sub") + "/"]
    assert standin.gcloud("storage", "ls", b.url("up/tree/a*")).stdout == b.url("up/tree/a.txt") + "\n"
    r = standin.gcloud("storage", "ls", b.url("nothing/here"))
    assert r.returncode == 1 and "One or more URLs matched no objects." in r.stderr
    assert standin.gcloud("storage", "cp", "-", b.url("piped.txt"), input="from stdin").returncode == 0
    assert standin.gcloud("storage", "cp", b.url("piped.txt"), "-").stdout == "from stdin"
    assert standin.gcloud("storage", "cp", b.url("piped.txt"), b.url("copy.txt")).returncode == 0
    assert standin.gcloud("storage", "cp", "-r", b.url("up/tree"), str(tmp_path / "down")).returncode == 0
    assert (tmp_path / "down" / "sub" / "b.bin").read_bytes() == bytes(range(256))
    assert standin.gcloud("storage", "cp", b.url("copy.txt"), str(tmp_path / "down") + "/").returncode == 0
    assert (tmp_path / "down" / "copy.txt").read_text() == "from stdin"
    r = standin.gcloud("storage", "cat", b.url("missing.txt"))
    assert r.returncode == 1 and f"-{b.url('missing.txt')}" in r.stderr
    assert standin.gcloud("storage", "rm", b.url("copy.txt")).returncode == 0
    assert standin.gcloud("storage", "rm", "-r", b.url("up")).returncode == 0
    assert sorted(b.objects()) == ["made/by/epath.json", "piped.txt"]
    assert standin.gcloud("storage", "rm", b.url("up/tree/a.txt")).returncode == 1


def test_rundir_on_gs_reaches_the_emulator(gcs):
    from diloco import rundir

    run = rundir.RunDir(gcs.url("runs/x"))
    run.make()
    run.claim(json.dumps({"a": 1}))
    for step in (1, 2, 3):
        run.log({"step": step, "loss": 1.0 / step})
    run.resume_records(2)
    run.close()  # the TensorBoard files staged locally go to tb/
    run.write_summary({"final": 0.5})
    objects = gcs.objects("runs/x/")  # read back with google-cloud-storage, not through epath
    tb = sorted(n for n in objects if "/tb/" in n)
    assert sorted(set(objects) - set(tb)) == ["runs/x/config.json", "runs/x/metrics.jsonl", "runs/x/summary.json"]
    assert [n.rsplit("/", 1)[0] for n in tb] == ["runs/x/tb", "runs/x/tb/hparams"], tb
    from tensorboardX.proto import event_pb2

    b, i, steps = objects[tb[0]], 0, []  # TFRecord framing: length, crc, event, crc
    while i < len(b):
        n = int.from_bytes(b[i:i + 8], "little")
        steps += [e.step for e in [event_pb2.Event.FromString(b[i + 12:i + 12 + n])] if e.summary.value]
        i += 16 + n
    assert steps == [1, 2, 3]
    assert [json.loads(line)["step"] for line in objects["runs/x/metrics.jsonl"].splitlines()] == [1, 2]
    assert run.summary() == {"final": 0.5} and os.fspath(run.root) == gcs.url("runs/x")


def test_orbax_checkpoint_on_the_emulator(gcs):
    import jax.numpy as jnp
    import jax

    from diloco.checkpoint import Checkpointer

    state = {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.array([7, -1, 3], jnp.int32)}
    ck = Checkpointer(gcs.url("run/ckpt"))
    ck.save(3, state, {"step": 3})
    ck.close()
    names = gcs.objects("run/ckpt/")
    assert any(n.startswith("run/ckpt/3/state/") and "ocdbt" in n for n in names)  # tensorstore wrote these
    ck = Checkpointer(gcs.url("run/ckpt"))
    step, restored, meta = ck.restore(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state))
    ck.close()
    assert step == 3 and meta["step"] == 3
    np.testing.assert_array_equal(restored["w"], np.arange(12.0).reshape(3, 4))
    np.testing.assert_array_equal(restored["b"], [7, -1, 3])


@pytest.mark.slow
def test_jax_compilation_cache_on_gs_from_a_host_environment(standin, tmp_path):
    standin.create("one", zone=ZONE, accelerator_type="v5litepod-1", runtime_version="v", node_id="one")
    standin.wait_state("one", "ACTIVE")
    code = ("import jax, jax.numpy as jnp; jax.config.update('jax_compilation_cache_dir', %r); "
            "jax.config.update('jax_persistent_cache_min_compile_time_secs', 0); "
            "print(jax.jit(lambda x: x * 2 + 1)(jnp.arange(3.0)))" % standin.bucket.url("jax-cache"))
    r = standin.gcloud(*QR, "ssh", "one", f"--zone={ZONE}", f"--command=EPATH_USE_TF=false {sys.executable} -c \"{code}\"", timeout=300)
    assert r.returncode == 0 and "[1. 3. 5.]" in r.stdout, r.stdout + r.stderr
    assert any(n.startswith("jax-cache/") for n in standin.bucket.objects())


@pytest.mark.slow
def test_every_host_reads_and_writes_the_bucket_at_once(standin, tmp_path):
    """Four hosts, each 40 writes and reads through epath (gcsfs) at the same time: the emulator serves them all."""
    two_slices(standin, tmp_path)
    code = ("from etils import epath; import os; i = os.environ['DILOCO_PROCESS_ID']; "
            "[epath.Path(f'gs://%s/c/{i}/{k}').write_text(f'{i}-{k}') for k in range(40)]; "
            "print(sum(epath.Path(f'gs://%s/c/{i}/{k}').read_text() == f'{i}-{k}' for k in range(40)))"
            % (standin.bucket.name, standin.bucket.name))
    r = standin.gcloud(*QR, "ssh", "qr", f"--zone={ZONE}", "--node=all", "--worker=all",
                       f"--command={barrier(tmp_path / 'b', 4)}; EPATH_USE_TF=false {sys.executable} -c \"{code}\"", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(line.split(": ")[1] for line in r.stdout.splitlines()) == ["40"] * 4
    assert len(standin.bucket.objects("c/")) == 160


def test_find_secrets_reports_environment_secrets_and_private_keys(tmp_path):
    env = {"MY_API_TOKEN": "tok-1234567890", "DB_PASSWORD": "hunter2hunter2", "SHORT_KEY": "abc", "HOME": "/root/x"}
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "run.log").write_text("connecting with tok-1234567890\n")
    (tmp_path / "clean.txt").write_text("HOME=/root/x abc\n-----BEGIN CERTIFICATE-----\n")
    (tmp_path / "venv" / "site-packages").mkdir(parents=True)
    (tmp_path / "venv" / "site-packages" / "test.key").write_text("-----BEGIN RSA PRIVATE KEY-----\n")
    found = find_secrets([tmp_path, b"pw=hunter2hunter2", {"bucket/obj": b"-----BEGIN PRIVATE KEY-----\nMII"}], env)
    assert found == [f"{tmp_path}/logs/run.log: value of $MY_API_TOKEN", "<blob>: value of $DB_PASSWORD",
                     "bucket/obj: a PEM private key"]
    assert find_secrets([tmp_path / "clean.txt"], env) == []


def test_nothing_from_the_test_environment_reaches_hosts_logs_or_the_bucket(standin, tmp_path, monkeypatch):
    canary = "canary-" + os.urandom(8).hex()
    monkeypatch.setenv("STANDIN_CANARY_TOKEN", canary)
    body = ("env > $HOME/env.txt\ngcloud storage cp $HOME/env.txt gs://%s/hosts/$DILOCO_PROCESS_ID.env\n"
            "echo uploaded\n" % standin.bucket.name)
    two_slices(standin, tmp_path, body)
    standin.wait_for(lambda: len(standin.bucket.objects("hosts/")) == 4, what="every host's upload")
    assert standin.gcloud("storage", "cp", str(tmp_path / "startup.sh"), standin.bucket.url("laptop/")).returncode == 0
    r = standin.gcloud(*QR, "ssh", "qr", f"--zone={ZONE}", "--node=all", "--worker=all", "--command=env")
    assert r.returncode == 0 and canary not in r.stdout
    assert standin.secrets() == []
    assert [i["host"] for i in standin.invocations() if i["argv"][:2] == ["storage", "cp"]].count(None) == 1
    # the scan does look where a leak would land: the state folder, and object bodies even once deleted
    (standin.host("qr", 1, 1).home / "leak.log").write_text(f"token={canary}\n")
    standin.bucket.write("tmp/leak", canary)
    standin.bucket.emulator.client().bucket(standin.bucket.name).blob("tmp/leak").delete()
    found = standin.secrets()
    assert f"{standin.host('qr', 1, 1).home}/leak.log: value of $STANDIN_CANARY_TOKEN" in found
    assert any("tmp_leak: value of $STANDIN_CANARY_TOKEN" in f for f in found) and len(found) == 2
