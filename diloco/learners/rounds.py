"""When the synchronizer merges a fragment's round, and with what weights: pure logic on a clock the caller
passes in (tests drive it with a fake one; diloco/learners/syncer.py with time.monotonic).

Round k of fragment p is the k-th send of p by every learner. It is merged exactly once, when

  quorum     `quorum` learners have sent it (default: all of them), or
  grace      `grace` seconds have passed since its first contribution arrived (None: no grace window,
             wait for the quorum however long it takes)

whichever comes first. A contribution to a round already merged is late: it is dropped (counted) and its
learner gets that round's θᵍ_p like the others. A learner cannot be more than one round ahead of the
merged one (it waits for round k's answer before its next send of p), so a round past merged + 1 is
refused; so is the same (learner, fragment, round) twice (a replay).

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
        self.dropped: collections.Counter = collections.Counter()  # learner → late contributions dropped

    def add(self, m: int, p: int, k: int, tokens: int, payload: Any, now: float) -> bool:
        """Record learner m's contribution to round k of fragment p: True when it will be merged, False when
        the round was already merged (late: dropped). Rejected for a replay or a round too far ahead."""
        if (m, p, k) in self.seen:
            raise Rejected(f"replayed: learner {m} already sent round {k} of fragment {p}")
        if k > self.merged[p] + 1:
            raise Rejected(f"round {k} of fragment {p} is ahead: round {self.merged[p] + 1} is not merged yet")
        self.seen.add((m, p, k))
        if k <= self.merged[p]:
            self.dropped[m] += 1
            return False
        self.open.setdefault((p, k), Round(first=now)).got[m] = (tokens, payload)
        return True

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
        return [(m, *r.got[m]) for m in sorted(r.got)]
