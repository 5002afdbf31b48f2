"""docs/claims.md, the claims → tests → CI tier map: every test it names exists and runs in the tier it
says (.ci/run's tiers, from the markers), so the map cannot drift from the suite."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from conftest import REPO

TIERS = ("default", "e2e", "multiprocess", "tpu")

# A pytest plugin for the collecting subprocess: each collected test's tier, as .ci/run selects it.
DUMP = '''
import json, os

def tier(item):
    marks = {m.name for m in item.iter_markers()}
    if "slow" not in marks:
        return "default"
    return "multiprocess" if "multiprocess" in marks else "tpu" if "tpu" in marks else "e2e"

def pytest_collection_finish(session):
    with open(os.environ["CLAIMS_MAP_OUT"], "w") as f:
        json.dump({i.nodeid: tier(i) for i in session.items}, f)
'''


def collected_tiers(tmp_path) -> dict[str, set[str]]:
    """'tests/x.py::name' → the tiers its instances (parameters) run in."""
    (tmp_path / "claims_dump.py").write_text(DUMP)
    out = tmp_path / "tiers.json"
    env = dict(os.environ, CLAIMS_MAP_OUT=str(out), PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "", "-p", "claims_dump",
                        "--continue-on-collection-errors"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=1800)
    assert out.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    tiers: dict[str, set[str]] = {}
    for nodeid, t in json.loads(out.read_text()).items():
        tiers.setdefault(nodeid.split("[")[0], set()).add(t)
    return tiers


def map_rows() -> list[tuple[str, list[str], set[str]]]:
    """(row number, tests named, tiers stated) of every table row of docs/claims.md that names a test; a
    test of the same file as the one before it may be written `::name`."""
    rows = []
    for line in (REPO / "docs" / "claims.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not cells[0].isdigit():
            continue
        tests, path = [], ""
        for file, name in re.findall(r"(tests/[\w/]+\.py)?::(\w+)", cells[3]):  # `::name`: the file before's
            path = file or path
            tests.append(f"{path}::{name}")
        stated = {t.strip() for t in cells[4].split(",") if t.strip() not in ("", "—")}
        rows.append((cells[0], tests, stated))
    return rows


def test_every_test_the_claims_map_names_exists_in_the_tier_it_states(tmp_path):
    rows = map_rows()
    assert len(rows) >= 40 and [int(n) for n, _, _ in rows] == list(range(1, len(rows) + 1))
    tiers = collected_tiers(tmp_path)
    assert len(tiers) > 100  # the collection really ran
    missing = sorted({t for _, tests, _ in rows for t in tests if t not in tiers})
    assert missing == [], f"docs/claims.md names tests that do not exist: {missing}"
    wrong = []
    for n, tests, stated in rows:
        assert stated <= set(TIERS), (n, stated)
        actual = set().union(*(tiers[t] for t in tests)) if tests else set()
        if actual != stated:
            wrong.append(f"row {n}: says {sorted(stated)}, its tests run in {sorted(actual)}")
    assert wrong == []
