"""When the synchronizer merges a fragment's round, and with what weights: pure logic on a clock the caller
passes in (tests drive it with a fake one; diloco/learners/syncer.py with time.monotonic).

Round k of fragment p is the k-th send of p by every learner. It is merged exactly once, when

  quorum     `quorum` learners have sent it (default: all of them), or
  grace      `grace` seconds have passed since its first contribution arrived (None: no grace window,
             wait for the quorum however long it takes)

whichever comes first. A contribution to a round already merged is late: it is dropped (counted) and its
learner gets that round's θᵍ_p like the others. A learner cannot be more than one round ahead of the
merged one (it waits for round k's answer before its next send of p), so a round past merged + 1 is
refused; so is the same (learner, fragment, round) twice (a replay) — unless the message says it is a
retry (its learner lost the answer: a dropped connection, a restarted synchronizer), which adds nothing and
gets the round's answer.

`meta()` / `Rounds.restore` are what the synchronizer's checkpoint keeps of this (JSON): the last merged
round per fragment, which learners each merged round took, the contributions seen of merged rounds and the
counters. A contribution to a round still open is not kept: after a restart its learner's retry is fresh.

Contributions are weighted by the tokens each learner processed since its previous send of the fragment:
w_m = tokens_m / max tokens, so equal learners weigh exactly 1.0 each and the average is the SPMD path's
FP32 mean of the decoded Δ (`OuterSync.exchange`: Σ w·Δ / Σ w) bit for bit, summed in learner order.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any

from diloco.learners.proto import Rejected


@dataclasses.dataclass
class Round:
    first: float                                   # clock time of its first contribution
    got: dict = dataclasses.field(default_factory=dict)  # learner → (tokens, payload)


def weights(tokens: list[int]) -> list[float]:
    """Each contribution's weight: its tokens over the largest (1.0 each when every learner did the same work)."""
    top = max(tokens)
    return [t / top for t in tokens]


class Rounds:
    def __init__(self, learners: int, fragments: int, quorum: int | None = None, grace: float | None = None):
        quorum = learners if quorum is None else quorum
        if not 1 <= quorum <= learners:
            raise ValueError(f"quorum={quorum} must be in 1 … learners={learners}")
        if grace is not None and grace < 0:
            raise ValueError(f"grace={grace} must be ≥ 0 seconds (or None: no grace window)")
        self.learners, self.quorum, self.grace = learners, quorum, grace
        self.merged = [0] * fragments                   # last merged round per fragment
        self.open: dict[tuple[int, int], Round] = {}
        self.seen: set[tuple[int, int, int]] = set()    # (learner, fragment, round) accepted or dropped
        self.merges: collections.Counter = collections.Counter()   # (p, k) → times merged (must stay 1)
        self.took: dict[tuple[int, int], list[int]] = {}           # (p, k) → the learners it merged
        self.dropped: collections.Counter = collections.Counter()  # learner → late contributions dropped
        self.tokens = 0                                            # tokens of every contribution merged

    def add(self, m: int, p: int, k: int, tokens: int, payload: Any, now: float, retry: bool = False) -> str:
        """Record learner m's contribution to round k of fragment p: "fresh" (it will be merged), "late" (the
        round was merged without it: dropped) or "again" (a retry of a contribution already recorded: nothing
        added). Rejected for a replay (the same contribution twice, not marked retry) or a round too far ahead."""
        if (m, p, k) in self.seen:
            if not retry:
                raise Rejected(f"replayed: learner {m} already sent round {k} of fragment {p}")
            return "again"
        if k > self.merged[p] + 1:
            raise Rejected(f"round {k} of fragment {p} is ahead: round {self.merged[p] + 1} is not merged yet")
        self.seen.add((m, p, k))
        if k <= self.merged[p]:
            self.dropped[m] += 1
            return "late"
        self.open.setdefault((p, k), Round(first=now)).got[m] = (tokens, payload)
        return "fresh"

    def last_sent(self, m: int) -> list[int]:
        """Per fragment, the last round of learner m recorded (0: none): where a restarted learner goes on."""
        out = [0] * len(self.merged)
        for mm, p, k in self.seen:
            if mm == m:
                out[p] = max(out[p], k)
        return out

    def due(self, p: int, k: int, now: float) -> bool:
        """Whether round k of fragment p should merge now (quorum reached or its grace window over)."""
        r = self.open.get((p, k))
        if r is None:
            return False
        return len(r.got) >= self.quorum or (self.grace is not None and now >= r.first + self.grace)

    def deadline(self, p: int, k: int) -> float | None:
        """When the grace window of an open round ends (None: no window, or no such round)."""
        r = self.open.get((p, k))
        return None if r is None or self.grace is None else r.first + self.grace

    def take(self, p: int, k: int) -> list[tuple[int, int, Any]]:
        """Close round k of fragment p: its contributions [(learner, tokens, payload)] in learner order."""
        r = self.open.pop((p, k))
        self.merged[p] = k
        self.merges[(p, k)] += 1
        self.took[(p, k)] = sorted(r.got)
        self.tokens += sum(tok for tok, _ in r.got.values())
        return [(m, *r.got[m]) for m in sorted(r.got)]

    def meta(self) -> dict:
        """What a checkpoint keeps (JSON): merged rounds and what they took; contributions to open rounds are not."""
        return {"merged": list(self.merged), "merges": {f"{p}/{k}": n for (p, k), n in sorted(self.merges.items())},
                "took": {f"{p}/{k}": ms for (p, k), ms in sorted(self.took.items())},
                "seen": sorted([m, p, k] for m, p, k in self.seen if k <= self.merged[p]),
                "dropped": {str(m): n for m, n in sorted(self.dropped.items())}, "tokens": self.tokens}

    @classmethod
    def restore(cls, meta: dict, learners: int, quorum: int | None = None, grace: float | None = None) -> "Rounds":
        def key(pk: str) -> tuple[int, int]:
            p, k = pk.split("/")
            return int(p), int(k)

        r = cls(learners, len(meta["merged"]), quorum, grace)
        r.merged = list(meta["merged"])
        r.merges = collections.Counter({key(pk): n for pk, n in meta["merges"].items()})
        r.took = {key(pk): list(ms) for pk, ms in meta["took"].items()}
        r.seen = {(m, p, k) for m, p, k in meta["seen"]}
        r.dropped = collections.Counter({int(m): n for m, n in meta["dropped"].items()})
        r.tokens = meta["tokens"]
        return r
