"""Independent learners' pure logic (no JAX, no server): the frame and its checks, quorum / grace window on a
fake clock, token weights by hand. The real service on loopback: tests/test_learners_grpc.py (tier learners)."""
import dataclasses
import struct

import pytest

from diloco.learners import proto
from diloco.learners.rounds import Rounds, weights


@dataclasses.dataclass(frozen=True)
class FakeExpect:  # two fragments: e3m0 of 6 and of 300 elements (block 256: 1 and 2 scales)
    fingerprint: str = "f" * 64
    codec: str = "e3m0"
    layouts: tuple = ((("codes", "uint8", (3,), 3), ("scales", "float32", (1,), 4)),
                      (("codes", "uint8", (150,), 150), ("scales", "float32", (2,), 8)))


def push(**over):
    head = {"v": 1, "learner": 1, "fragment": 0, "round": 1, "tokens": 64, "fingerprint": "f" * 64, "codec": "e3m0",
            "arrays": [["codes", "uint8", [3]], ["scales", "float32", [1]]]}
    payload = over.pop("payload", b"\1\2\3" + struct.pack("<f", 0.5))
    head.update(over)
    return head, payload


def test_a_good_push_passes_and_splits_into_its_arrays():
    head, payload = push()
    h, pl = proto.unframe(proto.frame(head, payload))
    assert proto.check_push(h, pl, FakeExpect(), learners=2, fragments=2) == [("codes", "uint8", (3,)),
                                                                               ("scales", "float32", (1,))]
    parts = proto.split_payload(pl, FakeExpect().layouts[0])
    assert parts["codes"] == ("uint8", (3,), b"\1\2\3") and parts["scales"][2] == struct.pack("<f", 0.5)


@pytest.mark.parametrize("body, reason", [
    (b"", "malformed"), (b"\0\0", "malformed"), (struct.pack(">I", 99) + b"{}", "malformed: header length 99"),
    (struct.pack(">I", 5000) + b"x" * 5000, "oversized header: 5000"), (struct.pack(">I", 3) + b"{x}", "malformed header"),
    (struct.pack(">I", 2) + b"[]", "not a JSON object"),
])
def test_a_frame_that_does_not_parse_is_refused(body, reason):
    with pytest.raises(proto.Rejected, match=reason):
        proto.unframe(body)


@pytest.mark.parametrize("over, reason", [
    ({"learner": True}, "field 'learner' must be int"), ({"round": "1"}, "field 'round' must be int"),
    ({"v": 2}, "protocol version 2"), ({"fingerprint": "e" * 64}, "wrong config: fingerprint"),
    ({"codec": "fp8_e4m3"}, "wrong config: codec"), ({"learner": 2}, "unknown learner 2"),
    ({"fragment": 2}, "unknown fragment 2"), ({"round": 0}, "round 0 must be ≥ 1"), ({"tokens": 0}, "tokens 0"),
    ({"arrays": [["codes", "uint8", [4]], ["scales", "float32", [1]]]}, "wrong shape"),
    ({"arrays": [["scales", "float32", [1]], ["codes", "uint8", [3]]]}, "wrong shape"),
    ({"arrays": [["codes", "int8", [3]], ["scales", "float32", [1]]]}, "wrong shape"),
    ({"payload": b"\1\2\3"}, "payload is 7 bytes, got 3"), ({"fragment": 1}, "wrong shape"),
    ({"retry": 1}, "field 'retry' must be bool"),
])
def test_a_wrong_push_names_what_is_wrong(over, reason):
    head, payload = push(**over)
    with pytest.raises(proto.Rejected, match=reason):
        proto.check_push(head, payload, FakeExpect(), learners=2, fragments=2)


def test_a_token_is_compared_whole_and_a_learners_own_names_it_and_only_it():
    secret = "s3cret-token-0123456789"
    bearer = lambda tok: [("authorization", f"Bearer {tok}")]
    assert proto.caller(bearer(secret), secret, learners=3) == proto.ANY
    for bad in ([], [("authorization", secret)], bearer(secret[:-1]), bearer(secret + "x"),
                bearer(proto.learner_token(secret, 3)), bearer(proto.learner_token("another-secret-0123", 0))):
        assert proto.caller(bad, secret, 3) is None  # no learner 3; another secret's learner 0
    assert [proto.caller(bearer(proto.learner_token(secret, m)), secret, 3) for m in range(3)] == [0, 1, 2]
    assert len({proto.learner_token(secret, m) for m in range(3)}) == 3


def test_quorum_or_grace_window_merges_each_round_once_weighted_by_tokens():
    assert weights([256, 256]) == [1.0, 1.0]  # equal learners: exactly the SPMD path's weights
    w = weights([100, 300])  # Σ w·x / Σ w with x = (1, 3): (1/3 + 3) / (4/3) = 2.5 = (100·1 + 300·3) / 400
    assert w == [1 / 3, 1.0] and (w[0] * 1 + w[1] * 3) / sum(w) == pytest.approx(2.5, abs=1e-15)
    r = Rounds(learners=3, fragments=2, quorum=2, grace=5.0)
    assert r.add(0, 1, 1, 64, "a", now=0.0) == "fresh" and not r.due(1, 1, now=4.9)
    assert r.add(2, 1, 1, 32, "c", now=1.0) == "fresh" and r.due(1, 1, now=1.0)
    assert r.take(1, 1) == [(0, 64, "a"), (2, 32, "c")]  # learner order, whatever the arrival order
    assert r.add(1, 1, 1, 64, "b", now=2.0) == "late"  # dropped, counted
    assert r.dropped[1] == 1 and r.merges == {(1, 1): 1} and r.merged == [0, 1] and r.took == {(1, 1): [0, 2]}
    r = Rounds(learners=2, fragments=1, grace=3.0)  # quorum = all, a grace window: it merges what arrived
    r.add(1, 0, 1, 64, "b", now=10.0)
    assert r.deadline(0, 1) == 13.0 and not r.due(0, 1, now=12.99) and r.due(0, 1, now=13.0)
    assert r.take(0, 1) == [(1, 64, "b")]
    never = Rounds(learners=2, fragments=1, grace=None)  # no window: the quorum, however long
    never.add(0, 0, 1, 64, "a", now=0.0)
    assert not never.due(0, 1, now=1e9) and never.deadline(0, 1) is None


def test_a_replay_or_a_round_ahead_is_refused():
    r = Rounds(learners=2, fragments=1)
    r.add(0, 0, 1, 64, "a", now=0.0)
    with pytest.raises(proto.Rejected, match="replayed: learner 0 already sent round 1 of fragment 0"):
        r.add(0, 0, 1, 64, "a", now=0.1)
    with pytest.raises(proto.Rejected, match="round 2 of fragment 0 is ahead"):
        r.add(1, 0, 2, 64, "b", now=0.1)
    r.add(1, 0, 1, 64, "b", now=0.2)
    r.take(0, 1)
    with pytest.raises(proto.Rejected, match="replayed"):  # also once merged
        r.add(1, 0, 1, 64, "b", now=0.3)
    assert r.add(1, 0, 1, 64, "b", now=0.3, retry=True) == "again" and r.merges == {(0, 1): 1}  # adds nothing
    with pytest.raises(ValueError, match="quorum=3"):
        Rounds(learners=2, fragments=1, quorum=3)


def test_a_restored_round_book_merges_nothing_twice_and_forgets_open_rounds():
    """What the synchronizer's checkpoint keeps (JSON round trip): after a restart a retry of a merged
    contribution adds nothing, one of a round that was open (lost with the process) is taken afresh."""
    import json

    r = Rounds(learners=3, fragments=2, quorum=2)
    r.add(0, 0, 1, 64, "a", now=0.0), r.add(1, 0, 1, 64, "b", now=0.0)
    r.take(0, 1)
    r.add(2, 0, 1, 64, "c", now=1.0)  # late
    r.add(0, 1, 1, 64, "d", now=1.0)  # round 1 of fragment 1 open: not in the checkpoint
    assert r.last_sent(0) == [1, 1] and r.last_sent(2) == [1, 0]
    meta = json.loads(json.dumps(r.meta()))
    assert meta == {"merged": [1, 0], "merges": {"0/1": 1}, "took": {"0/1": [0, 1]},
                    "seen": [[0, 0, 1], [1, 0, 1], [2, 0, 1]], "dropped": {"2": 1}, "tokens": 128}
    back = Rounds.restore(meta, learners=3, quorum=2)
    assert (back.merged, back.merges, back.took, back.dropped, back.tokens) == (r.merged, r.merges, r.took, r.dropped, 128)
    assert back.open == {} and back.last_sent(0) == [1, 0]
    assert back.add(1, 0, 1, 64, "b", now=5.0, retry=True) == "again"
    assert back.add(0, 1, 1, 64, "d", now=5.0, retry=True) == "fresh"  # its first copy died with the process
    back.add(1, 1, 1, 64, "e", now=5.0)
    back.take(1, 1)
    assert back.merges == {(0, 1): 1, (1, 1): 1} and back.meta()["took"] == {"0/1": [0, 1], "1/1": [0, 1]}


def test_plain_grpc_only_on_loopback_unless_told_and_a_bad_sync_address_is_one_line(tmp_path):
    from diloco.errors import ConfigError
    from diloco.learners.common import read_tls
    from diloco.schema import Address

    for good in ("", "grpc://10.0.0.5:7070", "grpc://sync-host.example:1", "grpc://[::1]:65535"):
        Address().check("sync", good)
    for bad in ("10.0.0.5:7070", "grpc://h", "grpc://h:0", "grpc://h:70000", "http://h:80", "grpc://a b:1"):
        with pytest.raises(ConfigError, match=f"sync: '{bad}' is not grpc://HOST:PORT .* or '' .one SPMD job.$"):
            Address().check("sync", bad)

    assert read_tls(None, None, "127.0.0.1", insecure=False) is None
    assert read_tls(None, None, "0.0.0.0", insecure=True) is None
    with pytest.raises(ConfigError, match="0.0.0.0: off loopback the synchronizer needs TLS"):
        read_tls(None, None, "0.0.0.0", insecure=False)
    with pytest.raises(ConfigError, match="both --tls_cert and --tls_key"):
        read_tls("c.pem", None, "127.0.0.1", insecure=False)
    (tmp_path / "c.pem").write_bytes(b"CERT")
    with pytest.raises(ConfigError, match="tls_key: .*k.pem: No such file"):
        read_tls(str(tmp_path / "c.pem"), str(tmp_path / "k.pem"), "0.0.0.0", insecure=False)
    (tmp_path / "k.pem").write_bytes(b"KEY")
    assert read_tls(str(tmp_path / "c.pem"), str(tmp_path / "k.pem"), "0.0.0.0", insecure=False) == (b"KEY", b"CERT")
