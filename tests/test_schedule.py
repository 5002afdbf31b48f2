"""The sync schedule against tables written out by hand from the contract in DESIGN.md."""
import pytest

from diloco.errors import ConfigError
from diloco.outer.schedule import Schedule, make_schedule


def events(s: Schedule, steps: int):
    return {t: (sends, applies) for t, sends, applies in s.table(steps) if sends or applies}


# (H, P, τ) → {t: (sends, applies)} over the first `steps`, computed by hand:
# offsets t_p = round(p·H/P); sends at t_p + kH (k ≥ 1); applies τ later.
HAND = [
    # DiLoCo: P=1, τ=0 — send and apply every H steps.
    ((3, 1, 0), 9, {3: ([0], [0]), 6: ([0], [0]), 9: ([0], [0])}),
    # H=4, P=2: offsets 0, 2. τ=1.
    ((4, 2, 1), 12, {4: ([0], []), 5: ([], [0]), 6: ([1], []), 7: ([], [1]), 8: ([0], []),
                     9: ([], [0]), 10: ([1], []), 11: ([], [1]), 12: ([0], [])}),
    # H=5, P=3: offsets round(0)=0, round(5/3)=2, round(10/3)=3. τ=0.
    ((5, 3, 0), 10, {5: ([0], [0]), 7: ([1], [1]), 8: ([2], [2]), 10: ([0], [0])}),
    # H=4, P=2, τ=3 > H/P: two fragments in flight at once (sent 4 and 6, applied 7 and 9).
    ((4, 2, 3), 10, {4: ([0], []), 6: ([1], []), 7: ([], [0]), 8: ([0], []), 9: ([], [1]),
                     10: ([1], [])}),
    # H=6, P=4: offsets 0, round(1.5)=2 (halves round up), 3, round(4.5)=5. τ=2.
    ((6, 4, 2), 12, {6: ([0], []), 8: ([1], [0]), 9: ([2], []), 10: ([], [1]), 11: ([3], [2]),
                     12: ([0], [])}),
    # H=2, P=2, τ=1: a fragment sends every other step, interleaved.
    ((2, 2, 1), 6, {2: ([0], []), 3: ([1], [0]), 4: ([0], [1]), 5: ([1], [0]), 6: ([0], [1])}),
]


@pytest.mark.parametrize("args,steps,expected", HAND, ids=[str(h[0]) for h in HAND])
def test_schedule_matches_hand_table(args, steps, expected):
    H, P, tau = args
    assert events(Schedule(H=H, P=P, taus=(tau, tau)), steps) == expected


@pytest.mark.parametrize("H,P", [(30, 1), (30, 2), (30, 4), (100, 8), (7, 3), (10, 10)])
def test_each_fragment_does_exactly_H_steps_between_its_syncs(H, P):
    s = Schedule(H=H, P=P, taus=(1,))
    sends: dict[int, list[int]] = {}
    for t in range(1, 5 * H + 1):
        for p in s.sends(t):
            sends.setdefault(p, []).append(t)
    assert sorted(sends) == list(range(P))
    for p, ts in sends.items():
        assert all(b - a == H for a, b in zip(ts, ts[1:])), (p, ts)
        assert ts[0] == s.offset(p) + H


def test_heterogeneous_tau_merges_each_replica_at_its_own_step():
    s = Schedule(H=6, P=1, taus=(1, 4))
    assert s.sends(6) == [0]
    assert s.outer_updates(7) == [0] and s.merges(7) == [(0, (True, False))]
    assert s.outer_updates(10) == [] and s.merges(10) == [(0, (False, True))]


@pytest.mark.parametrize("kw,field", [
    (dict(H=5, P=1, tau=5, replicas=2), "tau"),
    (dict(H=5, P=1, tau=-1, replicas=2), "tau"),
    (dict(H=2, P=3, tau=0, replicas=2), "fragments"),
    (dict(H=0, P=1, tau=0, replicas=2), "H"),
    (dict(H=5, P=1, tau=0, replicas=2, replica_tau="1"), "replica_tau"),
    (dict(H=5, P=1, tau=0, replicas=2, replica_tau="1,x"), "replica_tau"),
    (dict(H=5, P=1, tau=0, replicas=2, replica_tau="1,7"), "tau"),
])
def test_bad_schedules_name_the_field(kw, field):
    with pytest.raises(ConfigError) as e:
        make_schedule(**kw)
    assert e.value.field == field


@pytest.mark.parametrize("H,P,taus,t,want", [
    (4, 2, (1, 1), 4, [(0, True, (True, True))]),   # fragment 0 sent after step 4, applied after 5
    (4, 2, (1, 1), 5, []),
    (4, 2, (1, 1), 6, [(1, True, (True, True))]),   # offsets 0 and 2
    (4, 2, (0, 0), 4, []),                          # τ = 0: applied in the send's own step
    (4, 2, (0, 2), 4, [(0, False, (False, True))]),  # outer step done (min τ = 0); replica 1 merges at 6
    (4, 2, (0, 2), 5, [(0, False, (False, True))]),
    (4, 2, (0, 2), 6, [(1, False, (False, True))]),
    (4, 3, (2, 2), 8, [(0, True, (True, True)), (2, True, (True, True))]),  # offsets 0, 1, 3: p2 sent at 7
    (4, 1, (3, 3), 2, []),                          # nothing sent yet
])
def test_in_flight_after_step(H, P, taus, t, want):
    assert Schedule(H=H, P=P, taus=taus).in_flight(t) == want
