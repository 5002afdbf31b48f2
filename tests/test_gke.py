"""`diloco sweep --launch gke` (diloco/gke.py): the JobSets and xpk lines it writes.

The JobSet checks are the fields the JobSet controller and Kubernetes act on (names, failure policy,
placement, resources); the xpk lines are parsed by xpk's own argument parser (slow: it is fetched)."""
import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from conftest import REPO
from diloco import distributed as dist, gke

TRAIN = ["python", "-m", "diloco.cli", "train", "--workdir", "gs://b/r/p"]


def _env(spec) -> dict:
    c = spec["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


@pytest.mark.parametrize("acc,slices,nodes,groups,pods,limits,selector", [
    ("v5p-16", 2, 1, 2, 2, {"google.com/tpu": 4}, {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                                  "cloud.google.com/gke-tpu-topology": "2x2x2"}),
    ("v6e-8", 1, 1, 1, 1, {"google.com/tpu": 8}, {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
                                                 "cloud.google.com/gke-tpu-topology": "2x4"}),
    ("h200-141gb-8", 1, 4, 1, 4, {"nvidia.com/gpu": 8}, {"cloud.google.com/gke-accelerator": "nvidia-h200-141gb"}),
])
def test_each_accelerator_places_its_pods(acc, slices, nodes, groups, pods, limits, selector):
    t = gke.target(acc, slices, nodes)
    spec = gke.jobset("d-x-123456", TRAIN, t, "img:1", 3, 120)
    rj = spec["spec"]["replicatedJobs"][0]
    job, pod = rj["template"]["spec"], rj["template"]["spec"]["template"]["spec"]
    assert (rj["replicas"], job["parallelism"], job["completions"]) == (groups, pods, pods)
    assert pod["nodeSelector"] == selector and pod["containers"][0]["resources"]["limits"] == limits
    assert pod["containers"][0]["command"] == TRAIN and pod["restartPolicy"] == "Never"
    env = _env(spec)
    if t.tpu:  # JAX finds its TPU peers itself; several slices are one multislice job
        assert env["DILOCO_DISTRIBUTED"] == "auto" and ("MEGASCALE_NUM_SLICES" in env) == (slices > 1)
    else:  # the variables distributed.py reads, pod 0 by its JobSet DNS name
        assert env[dist.ENV_COORD] == f"d-x-123456-workers-0-0.d-x-123456:{gke.COORDINATOR_PORT}"
        assert env[dist.ENV_N] == "4" and "job-completion-index" in str(env[dist.ENV_ID])


def test_a_disruption_restarts_without_counting_and_other_failures_count():
    spec = gke.jobset("d-x-1", TRAIN, gke.target("v5p-16"), "img", 5, 120)
    fp = spec["spec"]["failurePolicy"]
    assert fp["maxRestarts"] == 5
    assert fp["rules"] == [{"name": "disruptions-are-free", "action": "RestartJobSetAndIgnoreMaxRestarts",
                            "onJobFailureReasons": ["PodFailurePolicy"]}]
    job = spec["spec"]["replicatedJobs"][0]["template"]["spec"]
    # only a DisruptionTarget pod fails its job with reason PodFailurePolicy; anything else is BackoffLimitExceeded
    assert job["podFailurePolicy"]["rules"] == [{"action": "FailJob",
                                                 "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]
    assert job["backoffLimit"] == 0
    assert yaml.safe_load(yaml.safe_dump(spec)) == spec


def test_names_are_dns_labels_unique_per_point():
    names = {gke.k8s_name("c4_scaling_1B", f"1B+streaming,tau={t},H=100,lr=0.{t}" * 3) for t in range(20)}
    assert len(names) == 20
    assert all(re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", n) and len(n) <= 40 for n in names)


@pytest.mark.parametrize("argv,field", [
    (["--root", "runs"], "--root"), (["--accelerator", "v5p-48"], "--accelerator"),
    (["--accelerator", "a100-8"], "--accelerator"), (["--image", ""], "--launch"), (["--max-restarts", "-1"], "--max-restarts"),
])
def test_bad_gke_input_is_one_line_before_anything_is_written(tmp_path, argv, field):
    base = {"--root": "gs://b/runs", "--accelerator": "v5p-16", "--image": "img", "--cluster": "c", "--max-restarts": "3"}
    base.update(dict(zip(argv[::2], argv[1::2])))
    args = [a for kv in base.items() for a in kv]
    r = subprocess.run([sys.executable, "-m", "diloco.cli", "sweep", "sweeps/replicas.py:toy", "--launch", "gke",
                        "--only", "toy+2+global", "--out", str(tmp_path / "out"), *args], capture_output=True,
                       text=True, cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(f"diloco sweep: bad input: {field}:"), r.stderr
    assert not (tmp_path / "out").exists()


XPK = ["xpk==1.16.0", "ruamel.yaml==0.19.1", "google-cloud-resource-manager==1.19.0", "kubernetes==37.0.2",
       "durationpy==0.11", "websocket-client==1.9.2", "setuptools-scm==10.3.4", "vcs-versioning==2.6.0",
       "argcomplete==3.7.2", "pydantic==2.13.4", "pydantic-core==2.46.4", "annotated-types==0.7.0",
       "typing-inspection==0.4.2", "docker==7.1.0"]  # what `xpk.parser.workload` imports, beside packages of our lock
SCHEMAS = ["kubernetes-validate==1.37.0", "importlib-resources==7.1.0",  # Kubernetes' own schemas, per version,
           "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1", "referencing==0.37.0",  # and the
           "rpds-py==0.30.0"]  # validator under them (absent from a fresh venv; --no-deps, as xpk)
# Each replicated job of a JobSet is a batch/v1 Job template: checked against Kubernetes 1.33's schema, unknown
# fields refused (strict). The JobSet fields around them have no schema on PyPI (the CRD lives in jobset's repo).
VALIDATE = """
import sys, yaml, kubernetes_validate as kv
def job(rj):
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": rj["name"]}, "spec": rj["template"]["spec"]}
for f in sys.argv[1:]:
    js = yaml.safe_load(open(f))
    assert (js["apiVersion"], js["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet"), f
    for rj in js["spec"]["replicatedJobs"]:
        kv.validate(job(rj), "1.33.0", strict=True)
        misspelt = {**job(rj), "spec": {**rj["template"]["spec"], "backofLimit": 1}}
        try:
            kv.validate(misspelt, "1.33.0", strict=True)
        except Exception as e:
            assert "backofLimit" in str(e), e
        else:
            raise SystemExit("a misspelt field passed")
    print(f, len(js["spec"]["replicatedJobs"]))
"""
PARSE = """
import argparse, shlex, sys
from xpk.parser.workload import set_workload_create_parser
p = argparse.ArgumentParser(exit_on_error=False)
set_workload_create_parser(p)
for line in open(sys.argv[1]).read().splitlines()[3:]:
    argv = shlex.split(line)
    assert argv[:3] == ["xpk", "workload", "create"], argv
    a = p.parse_args(argv[3:])
    print(a.workload, a.tpu_type or a.device_type, a.num_slices, a.num_nodes, a.max_restarts)
"""


@pytest.mark.slow
def test_xpk_s_own_parser_accepts_every_generated_line(tmp_path):
    """xpk 1.16.0's `workload create` parser (installed beside the lock with --no-deps: xpk pins versions
    our lock does not) takes each line of xpk.sh, for a TPU and a GPU sweep."""
    site = tmp_path / "xpk"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), *XPK, *SCHEMAS],
                         capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stderr[-2000:]
    got = []
    for acc in (["--accelerator", "v5p-16", "--slices", "2"], ["--accelerator", "h100-80gb-8", "--nodes", "2"]):
        out = tmp_path / acc[1]
        r = subprocess.run([sys.executable, "-m", "diloco.cli", "sweep", "sweeps/replicas.py:toy", "--only", "+global",
                            "--root", "gs://b/runs", "--launch", "gke", "--image", "img:1", "--cluster", "c",
                            "--out", str(out), *acc], capture_output=True, text=True, cwd=REPO, timeout=300,
                           env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert r.returncode == 0, r.stderr
        p = subprocess.run([sys.executable, "-c", PARSE, str(out / "xpk.sh")], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(site)}, timeout=120)
        assert p.returncode == 0, p.stderr[-3000:]
        got += p.stdout.split("\n")[:-1]
        assert {f.name for f in out.glob("*.yaml")} == {"toy+2+global.yaml", "toy+4+global.yaml", "toy+8+global.yaml"}
        v = subprocess.run([sys.executable, "-c", VALIDATE, *map(str, sorted(out.glob("*.yaml")))], capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": str(site)}, timeout=300)
        assert v.returncode == 0 and len(v.stdout.splitlines()) == 3, v.stdout + v.stderr[-3000:]
    assert len(got) == 6
    assert all(l.endswith("v5p-16 2 1 3") for l in got[:3]) and all(l.endswith("h100-80gb-8 1 2 3") for l in got[3:])
    assert all(shlex.split(l)[0].startswith("d-replicas-toy-toy-") for l in got)
