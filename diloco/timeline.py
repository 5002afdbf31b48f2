"""Per-process wall-clock events of a run (`Timeline`: inner steps, exchange start/end, apply
waits; `diloco train` writes one JSONL file per rank under the run's timeline/ folder) and what
they show (`overlap_report`: compute utilisation, exchanges that ran beside compute), which
`diloco netbench` reads."""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np


class Timeline:
    """Times are seconds on this process's perf_counter clock since `t0`. With a `path` the events go
    to a JSONL file whose first line holds `t0_monotonic` (to put the ranks of one machine on one
    axis); without one they are kept in `rows`."""

    def __init__(self, path: os.PathLike | None = None, rank: int = 0, resume: bool = False):
        self.t0 = time.perf_counter()
        self.lock = threading.Lock()
        self.rows: list[dict] = []
        self.f = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.f = open(path, "a" if resume else "w")
            self._write({"kind": "start", "rank": rank, "t0_monotonic": time.monotonic(), "t": 0.0})

    def _write(self, row: dict) -> None:
        with self.lock:
            if self.f is None:
                self.rows.append(row)
            elif not self.f.closed:  # a watcher thread may finish after the run closed the file
                self.f.write(json.dumps(row) + "\n")

    def add(self, kind: str, **kw) -> float:
        now = time.perf_counter()
        self._write({"kind": kind, "t": round(now - self.t0, 6), **kw})
        return now

    def watch(self, x, kind: str, **kw) -> None:
        """Record when `x` becomes ready, from a daemon thread (never blocks the loop)."""
        def wait():
            x.block_until_ready()
            self.add(kind, **kw)
        threading.Thread(target=wait, daemon=True).start()

    def close(self) -> None:
        with self.lock:
            if self.f is not None:
                self.f.close()


def read_timeline(path: os.PathLike) -> list[dict]:
    return [json.loads(l) for l in Path(path).read_text().splitlines() if l.strip()]


def overlap_report(rows: list[dict], warmup_steps: int = 0) -> dict:
    """Compute utilisation and overlap evidence from one rank's timeline.

    cu = Σ inner-step time / wall time over the steps after `warmup_steps` (wall: from the end of
    step `warmup_steps`, or of the first send when 0, to the end of the last step); `overlapped`
    counts exchanges that completed after the next inner step had started (they ran beside
    compute), out of the `checkable` ones (completed, with a next step in the timeline). A resumed
    run's timeline holds one segment per start; only the last is reported."""
    last = max((i for i, r in enumerate(rows) if r["kind"] == "start"), default=0)
    rows = rows[last:]  # a resumed run appends a segment with its own clock: report the last one
    steps = {r["step"]: r for r in rows if r["kind"] == "step"}
    starts = [r for r in rows if r["kind"] == "exchange_start"]
    ends = {(r["step"], r["fragment"]): r["t"] for r in rows if r["kind"] == "exchange_end"}
    waits = [r["waited_s"] for r in rows if r["kind"] == "apply_wait"]
    checkable = [r for r in starts if (r["step"], r["fragment"]) in ends and r["step"] + 1 in steps]
    overlapped = sum(1 for r in checkable if ends[(r["step"], r["fragment"])] > steps[r["step"] + 1]["start"])
    out = {"exchanges": len(starts), "completed": len(ends), "checkable": len(checkable), "overlapped": overlapped,
           "apply_wait_s": float(np.sum(waits)) if waits else 0.0,
           "max_apply_wait_s": float(np.max(waits)) if waits else 0.0}
    first = warmup_steps or min((r["step"] for r in starts), default=None)
    if first is None or first not in steps:
        return out
    window = [s for k, s in steps.items() if k > first]
    if not window:
        return out
    wall = max(s["end"] for s in window) - steps[first]["end"]
    durs = [s["end"] - s["start"] for s in window]
    out.update(cu=sum(durs) / wall if wall > 0 else None, wall_s=wall, compute_s=sum(durs),
               steps_measured=len(window), median_step_s=float(np.median(durs)))
    return out
