"""Independent learners over a real gRPC service on loopback (tier `learners`, .ci/run): the SPMD run's numbers, bad
messages refused while serving goes on, the synchronizer's checkpoint and a failed merge, mutual TLS, and a chaos run of
5 real processes (diloco/learners/chaos.py: SIGKILLed learner and synchronizer, a straggler). Toy scale, 8–24 steps."""
import json
import os
import threading

import grpc
import numpy as np
import pytest

from conftest import tiny_config
from diloco.rundir import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.learners]
TOKEN = "learners-test-token-0123456789"
OVER = dict(steps=8, H=4, log_every=1, eval_every=100, checkpoint_every=100, eval_batches=1, batch_size=4,
            layers_per_fragment=1, codec="e3m0", codec_block_size=64, tau=1)
BASE = {"scale": "tiny", "seq_len": 32, "optimizer.warmup_steps": 2}  # tiny_config's, for a subprocess's flags


def start(cfg, **kw):
    from diloco.learners.syncer import Synchronizer, serve

    syncer = Synchronizer(cfg, **kw)
    server, port = serve(syncer, TOKEN)
    return syncer, server, port


def two_learners(cfg, port: int, tmp_path) -> dict:
    """Learners 0 and 1 in threads against the synchronizer on `port`: {m: what Learner.train returned}."""
    from diloco.learners import common
    from diloco.learners.client import Learner, SyncClient

    out = {}

    def learner(m):
        client = SyncClient(f"grpc://127.0.0.1:{port}", TOKEN, m, common.fingerprint(cfg))
        out[m] = Learner(cfg, m, client, os.fspath(tmp_path / f"learner{m}")).train()

    threads = [threading.Thread(target=learner, args=(m,)) for m in range(2)]
    [t.start() for t in threads]
    [t.join(timeout=300) for t in threads]
    return out


def test_two_learners_give_the_spmd_runs_numbers(tmp_path):
    """Quorum = all, no grace window: each learner's loss, step by step, is the SPMD replica's within 1e-6 relative. Not
    bit for bit: one replica's inner step (the learner's) and two stacked replicas' (SPMD) are different XLA:CPU programs,
    at most 2 ulp (1.8e-7 relative) apart over 8 steps, 4 syncs; a wrong merge moves the rows after step 5 by > 1e-3."""
    from diloco.train import train

    cfg = tiny_config("streaming", **OVER)
    spmd = train(cfg, tmp_path / "spmd", progress=False)
    syncer, server, port = start(cfg)
    out = two_learners(cfg, port, tmp_path)
    server.stop(0)
    assert sorted(out) == [0, 1]
    want = np.array([r["train_loss_replicas"] for r in read_jsonl(tmp_path / "spmd" / "metrics.jsonl")])
    got = np.array([[r["train_loss"] for r in read_jsonl(tmp_path / f"learner{m}" / "metrics.jsonl")]
                    for m in (0, 1)]).T
    assert want.shape == got.shape == (8, 2)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    assert out[0]["params_sha256"] == out[1]["params_sha256"]  # one θᵍ, from the same answers
    stats = syncer.stats()
    assert set(stats["merges"].values()) == {1} and len(stats["merges"]) == spmd["syncs"]  # one merge per SPMD sync
    assert out[0]["bytes_payload"] + out[1]["bytes_payload"] == spmd["bytes_exchanged_total"]  # same bytes counted
    assert stats["rejected"] == {} and stats["dropped_late"] == {}


def test_quantized_answers_keep_every_learner_on_the_synchronizers_theta(tmp_path):
    """`--answer codec`: a learner holding round k−1 gets θᵍ_p's update in the run's codec (E3M0) and adds it with the
    synchronizer's program: both end on its θᵍ bit for bit, having received the codec's bytes; without `have`, fp32."""
    from diloco.learners import common
    from diloco.learners.client import SyncClient
    from diloco.outer import codecs
    from diloco.outer.sync import params_sha256

    cfg = tiny_config("streaming", **OVER)
    syncer, server, port = start(cfg, answer="codec")
    out = two_learners(cfg, port, tmp_path)
    assert sorted(out) == [0, 1]
    assert out[0]["params_sha256"] == out[1]["params_sha256"] == params_sha256(syncer.outer.params)
    sizes, codec = syncer.sync.frags.sizes, syncer.sync.codec
    join = 4 * sum(sizes) + 200  # the Join at the start: fp32 θᵍ, header
    quantized = sum(r * codecs.encoded_nbytes(codec, n) for r, n in zip(out[0]["rounds"], sizes))
    assert quantized < out[0]["bytes_received"] - join < quantized + 400 * sum(out[0]["rounds"])  # headers ≤ 400 B
    client, one = (SyncClient(f"127.0.0.1:{port}", TOKEN, m, common.fingerprint(cfg), timeout=60, retry_for=0) for m in (0, 1))
    zeros, k = {n: np.zeros(s, d) for n, d, s, _ in syncer.expect.layouts[0]}, syncer.rounds.merged[0] + 1
    pending = one.push(0, k, 64, "e3m0", zeros, have=k - 1)
    h, theta = client.answer(client.push(0, k, 64, "e3m0", zeros))  # no `have`: fp32
    assert "base" not in h and np.array_equal(theta, np.asarray(syncer.sync.frags.flatten(syncer.outer.params, 0)))
    h, update = one.answer(pending)
    assert h["base"] == k - 1 and sorted(update) == ["codes", "scales"]
    server.stop(0)


def test_bad_messages_are_refused_and_the_service_keeps_serving(tmp_path):
    from diloco.learners import common, proto
    from diloco.learners.client import SyncClient

    cfg = tiny_config("streaming", **OVER)
    syncer, server, port = start(cfg, quorum=1)
    good = SyncClient(f"127.0.0.1:{port}", TOKEN, 0, common.fingerprint(cfg), timeout=60)
    zeros, push = {n: np.zeros(s, d) for n, d, s, _ in syncer.expect.layouts[0]}, good.calls["Push"]

    def refused(body, code=grpc.StatusCode.INVALID_ARGUMENT, meta=good.meta):
        with pytest.raises(grpc.RpcError) as e:
            push(body, timeout=30, metadata=meta)
        assert e.value.code() == code, e.value.details()
        return e.value.details()

    head = {"v": 1, "learner": 1, "fragment": 0, "round": 1, "tokens": 64, "fingerprint": common.fingerprint(cfg),
            "codec": "e3m0", "arrays": [[n, d, list(s)] for n, d, s, _ in syncer.expect.layouts[0]]}
    body = proto.frame(head, b"".join(z.tobytes() for z in zeros.values()))
    rest = body[len(proto.frame(head)):]
    assert "token" in refused(body, grpc.StatusCode.UNAUTHENTICATED, meta=(("authorization", "Bearer nope"),))
    assert "malformed header" in refused(b"\0\0\0\x03{x}") and "oversized header" in refused(b"\xff" * 10)
    refused(b"\0" * (4 << 20), grpc.StatusCode.RESOURCE_EXHAUSTED)  # over the largest fragment: grpc refuses it
    assert "wrong shape" in refused(body[:-1])
    assert "wrong config" in refused(proto.frame({**head, "fingerprint": "0" * 64}, rest))
    h, theta = good.answer(good.push(0, 1, 64, "e3m0", zeros))  # quorum 1: merged at once
    assert (h["fragment"], h["round"], h["merged"], h["dropped"]) == (0, 1, [0], None)
    assert theta.shape == (syncer.sync.frags.sizes[0],)
    assert "replayed" in refused(proto.frame({**head, "learner": 0}, rest))
    own = (("authorization", f"Bearer {proto.learner_token(TOKEN, 1)}"),)  # learner 1's own token
    assert "forbidden" in refused(proto.frame({**head, "learner": 0}, rest), meta=own)  # cannot push learner 0's
    one = SyncClient(f"127.0.0.1:{port}", proto.learner_token(TOKEN, 1), 1, common.fingerprint(cfg))
    h, _ = one.answer(one.push(0, 1, 64, "e3m0", zeros))
    assert h["dropped"] == "late" and h["merged"] == [0]  # learner 1 was late for round 1: dropped, answered
    assert good.answer(good.push(0, 2, 64, "e3m0", zeros))[0]["round"] == 2
    stats = good.stats()
    server.stop(0)
    assert stats["merges"] == {"0/1": 1, "0/2": 1} and stats["dropped_late"] == {"1": 1}
    assert stats["rejected"] == {"unauthenticated": 1, "malformed header": 1, "oversized header": 1, "wrong shape": 1, "wrong config": 1,
                                 "replayed": 1, "forbidden": 1}


def test_the_synchronizer_resumes_from_its_checkpoint_and_a_failed_merge_is_answered(tmp_path):
    """Every merge is checkpointed before it is answered: restarted on its workdir (whose lock it holds) the synchronizer
    has the same θᵍ and counters, answers a retry of a merged round without merging it again, refuses a replay; a merge
    that raises answers INTERNAL with the reason, refuses every later call, and is in no checkpoint."""
    from diloco.learners import common
    from diloco.learners.client import SyncClient
    from diloco.outer.sync import params_sha256

    cfg = tiny_config("streaming", **OVER)
    a, server, port = start(cfg, quorum=1, workdir=tmp_path / "s")
    client = SyncClient(f"127.0.0.1:{port}", TOKEN, 0, common.fingerprint(cfg), timeout=60, retry_for=0)
    zeros = {n: np.full(s, 1, d) for n, d, s, _ in a.expect.layouts[0]}
    h1, theta1 = client.answer(client.push(0, 1, 64, "e3m0", zeros))
    server.stop(0)
    a.ck.close()
    b, server, port = start(cfg, quorum=1, workdir=tmp_path / "s")
    with open(tmp_path / "s" / ".run.lock") as f, pytest.raises(BlockingIOError):  # the folder's lock is held
        __import__("fcntl").flock(f, 6)  # LOCK_EX | LOCK_NB: what a second synchronizer on this folder tries
    client = SyncClient(f"127.0.0.1:{port}", TOKEN, 0, common.fingerprint(cfg), timeout=60, retry_for=0)
    assert params_sha256(b.outer.params) == params_sha256(a.outer.params) != params_sha256(b.tr.fresh_state().outer.params)
    assert b.rounds.merged == a.rounds.merged == [1] + [0] * (b.sync.frags.P - 1) and b.stats()["resumed"] == 1
    h, theta = client.answer(client.push(0, 1, 64, "e3m0", zeros, retry=True))  # its answer was lost: asked again
    assert (h["round"], h["merged"], h["dropped"]) == (1, [0], None) and np.array_equal(theta, theta1)
    with pytest.raises(grpc.RpcError, match="replayed"):
        client.answer(client.push(0, 1, 64, "e3m0", zeros))
    assert b.stats()["merges"] == {"0/1": 1}

    def broken(kind, p):
        raise FloatingPointError("a stand-in for any failure of a merge")

    b.program = broken
    with pytest.raises(grpc.RpcError) as e:
        client.answer(client.push(0, 2, 64, "e3m0", zeros))
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert "the merge of fragment 0 round 2 failed: FloatingPointError" in e.value.details()
    with pytest.raises(grpc.RpcError, match="round 2 failed") as e:
        client.join()
    assert e.value.code() == grpc.StatusCode.INTERNAL
    server.stop(0)
    b.ck.close()
    c, server, _ = start(cfg, quorum=1, workdir=tmp_path / "s")
    server.stop(0)
    assert c.rounds.merged == [1] + [0] * (c.sync.frags.P - 1)  # the failed round 2 is in no checkpoint
    assert c.stats()["merges"] == {"0/1": 1} and c.failed is None


CHAOS = {**BASE, **OVER, "steps": 24, "checkpoint_every": 4, "batch_size": 8, "eval_batches": 4}


@pytest.fixture(scope="module")
def no_fault_band(tmp_path_factory):
    """Final eval loss of the chaos config's no-fault run, seeds 0 … 3 (the SPMD run: the no-fault gRPC run's numbers)."""
    from diloco.train import train

    return [train(tiny_config("streaming", replicas=4, seed=s, **CHAOS), tmp_path_factory.mktemp(f"spmd{s}"),
                  progress=False)["final_eval_loss"] for s in range(4)]


@pytest.mark.parametrize("faults", ["kill+straggle+syncer", "throttle"])
def test_chaos_four_learners(tmp_path, no_fault_band, faults):
    """`diloco syncer` + 4 `diloco train --config.sync=grpc://…` processes (learner 2 on 2 devices); each round merged
    once. kill+straggle+syncer (quorum 3, grace 2 s): learner 1 SIGKILLed a third in, restarted (resumes from its
    checkpoint), learner 3 3× slower, the synchronizer SIGKILLed two thirds in, restarted; learner 0 never waits > grace
    + 2 s, trains on while it is down; late rounds dropped; the eval loss (seed 0) moves by ≤ the no-fault seeds 0 … 3
    spread. throttle (quorum all, no window; scripts/netns.sh namespaces, 10 mbit egress): the no-fault numbers, the
    transfers beside the steps."""
    from diloco.learners import chaos

    if faults == "throttle" and chaos.netns_unusable():
        pytest.skip(chaos.netns_unusable())
    grace, steps, throttled = 2.0, CHAOS["steps"], faults == "throttle"
    r = chaos.run(tmp_path, set(faults.split("+")), 4, steps, CHAOS, quorum=None if throttled else 3,
                  grace=None if throttled else grace, devices={2: 2})
    stats, (s0, s1, *_), ev = r["stats"], r["summaries"], r["events"]
    print(json.dumps({**{k: v for k, v in r.items() if k not in ("summaries", "stats")}, "band": no_fault_band}))
    want = {f"{p}/{k}" for p, last in enumerate(stats["merged_rounds"]) for k in range(1, last + 1)}
    assert set(stats["merges"]) == want and set(stats["merges"].values()) == {1}  # each round once, none lost
    assert [s["mesh"]["data"] for s in r["summaries"]] == [1, 1, 2, 1]  # learner 2: its own mesh of 2 devices
    if throttled:
        assert stats["dropped_late"] == {} and abs(r["eval_loss"] - no_fault_band[0]) < 1e-4 < r["compute_utilisation"] - 0.7
        return
    assert stats["resumed"] >= 1 and stats["failed"] is None and min(stats["merged_rounds"]) >= s0["rounds"][0] - 1 > 0
    assert 0 < s1["resumed_at"] <= ev["learner1_killed_after_step"] and s1["resumed_at"] % 4 == 0
    assert int(stats["dropped_late"].get("3", 0)) >= 1 and s0["retries"] >= 1 and s0["steps_with_an_answer_owed"] >= 1
    unix = np.array([row["unix"] for row in read_jsonl(tmp_path / "learner0" / "metrics.jsonl")])  # one row a step
    between = np.diff(unix)[(unix[1:] > ev["learner1_killed_at"]) & (unix[1:] < ev["syncer_killed_at"])]
    assert len(unix) == steps and len(between) >= 2 and between.max() <= grace + 2.0, between
    assert abs(r["eval_loss"] - no_fault_band[0]) <= max(no_fault_band) - min(no_fault_band), no_fault_band


def test_mutual_tls_refuses_a_learner_without_a_client_certificate(tmp_path):
    """Synchronizer with --tls_cert/--tls_key and --tls_ca: a learner presenting a client certificate the CA signed
    talks to it; one without a client certificate, one with another, and a plain-gRPC one cannot (openssl's)."""
    import subprocess

    from diloco.learners.client import SyncClient
    from diloco.learners.syncer import Synchronizer, serve

    def cert(name, *ext):  # a self-signed EC certificate: (key, cert) PEM bytes
        key, pem = tmp_path / f"{name}.key", tmp_path / f"{name}.pem"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                        "-keyout", key, "-out", pem, "-days", "1", "-subj", f"/CN={name}", *ext], check=True,
                       capture_output=True)
        return key.read_bytes(), pem.read_bytes()

    server_pair, client_pair, other = cert("localhost", "-addext", "subjectAltName=IP:127.0.0.1"), cert("l0"), cert("x")
    server, port = serve(Synchronizer(tiny_config("streaming", **OVER)), TOKEN, tls=server_pair, client_ca=client_pair[1])
    try:
        ok = SyncClient(f"127.0.0.1:{port}", TOKEN, 0, "", timeout=30, retry_for=0, tls_ca=server_pair[1],
                        tls_pair=client_pair)
        assert "merges" in ok.stats()
        for kw in ({"tls_ca": server_pair[1]}, {"tls_ca": server_pair[1], "tls_pair": other}, {}):
            with pytest.raises(grpc.RpcError) as e:
                SyncClient(f"127.0.0.1:{port}", TOKEN, 0, "", timeout=10, retry_for=0, **kw).stats()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, kw
    finally:
        server.stop(0)
