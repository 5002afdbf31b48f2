"""`diloco fetch ROOT OUT`: a run root's records (local or gs:// on the storage emulator) copied into a local
folder, checkpoints and the rest left behind, atomically and resumably; then `diloco tables` on it."""
import json
import os

import pytest

from diloco import fetch

CFG = {"method": "streaming", "scale": "toy", "H": 10, "tau": 1, "steps": 3, "seed": 0}
# what a sweep root holds: two points' records, and what is not a record or not to be walked into
TREE = {
    "sw/p1/config.json": json.dumps(CFG),
    "sw/p1/summary.json": json.dumps({"final_eval_loss": 2.5, "tokens": 100}),
    "sw/p1/metrics.jsonl": '{"step": 1, "train_loss": 3.0}\n',
    "sw/p1/point.json": json.dumps({"sweep": "sw", "point": {}, "seed": 0, "base_point": "p1"}),
    "sw/p1/ckpt/3/state/d/0000": "shard bytes",
    "sw/p1/ckpt/3/config.json": json.dumps(CFG),  # inside ckpt/: never walked into
    "sw/p1/tb/events.out.tfevents.1": "tb",
    "sw/p1/set_aside/17/metrics.jsonl": "{}\n",
    "sw/p2/config.json": json.dumps({**CFG, "tau": 2}),
    "sw/p2/failed.json": json.dumps({"error": "boom"}),
    "sw/p2/train.log": "not a record",
    "sw/_pods/qr/p1/_state/attempts.json": "{}",
}
COPIED = ["sw/p1/config.json", "sw/p1/metrics.jsonl", "sw/p1/point.json", "sw/p1/summary.json",
          "sw/p2/config.json", "sw/p2/failed.json"]


def _files(folder) -> dict[str, str]:
    return {os.path.relpath(os.path.join(d, f), folder): open(os.path.join(d, f)).read()
            for d, _, fs in os.walk(folder) for f in fs}


@pytest.mark.parametrize("where", ["local", "gs"])
def test_fetch_copies_the_records_only_and_a_rerun_copies_only_what_changed(where, tmp_path, request):
    if where == "gs":
        gcs = request.getfixturevalue("gcs")  # the GCS emulator, reached through gcsfs as training writes
        root, put = gcs.url("runs"), lambda rel, text: gcs.write(gcs.url("runs", rel), text)
    else:
        root = os.fspath(tmp_path / "runs")

        def put(rel, text):
            (tmp_path / "runs" / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / "runs" / rel).write_text(text)
    for rel, text in TREE.items():
        put(rel, text)
    out = tmp_path / "here"
    first = fetch.fetch(root, os.fspath(out))
    assert sorted(first.copied) == COPIED and first.unchanged == 0
    assert _files(out) == {rel: TREE[rel] for rel in COPIED}  # byte for byte; no temporary file left behind
    again = fetch.fetch(root, os.fspath(out))
    assert again.copied == [] and again.unchanged == len(COPIED)
    grown = TREE["sw/p1/metrics.jsonl"] + '{"step": 2, "train_loss": 2.9}\n'  # the run went on meanwhile
    put("sw/p1/metrics.jsonl", grown)
    os.unlink(out / "sw/p2/failed.json")  # an interrupted fetch: a file not there yet
    third = fetch.fetch(root, os.fspath(out))
    assert sorted(third.copied) == ["sw/p1/metrics.jsonl", "sw/p2/failed.json"]
    assert (out / "sw/p1/metrics.jsonl").read_text() == grown


def test_fetch_then_tables_and_bad_roots_are_one_line(tmp_path, capsys):
    root, out = tmp_path / "runs", tmp_path / "here"
    for rel in COPIED:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(TREE[rel])
    assert fetch.main([os.fspath(root), os.fspath(out)]) == 0
    said = capsys.readouterr().out
    assert said.startswith("diloco fetch: 6 file(s) copied (") and "0 unchanged" in said
    assert "diloco tables: 2 run(s)" in said and (out / "runs.csv").exists()  # the tables ran on the copy
    (tmp_path / "empty").mkdir()
    for bad, says in [(tmp_path / "nothing", f"{tmp_path / 'nothing'} is not a folder (or not readable)"),
                      (tmp_path / "empty", f"no run records (config.json) under {tmp_path / 'empty'}"),
                      ("ftp://b/x", "ftp://b/x: unsupported filesystem")]:
        assert fetch.main([os.fspath(bad), os.fspath(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"diloco fetch: bad input: ROOT: {says}") and err.count("\n") == 1, err
    assert fetch.main([os.fspath(root), os.fspath(root)]) == 2
    assert "OUT: " in capsys.readouterr().err and not (tmp_path / "o").exists()
