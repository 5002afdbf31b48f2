"""diloco.data: specs → seqio tasks → a token store → int32 batches, on real sample data from ../shared (skipped
when absent). Every spec is read through its store (diloco/data/prepare.py); the reader's order rule, epochs,
host counts and resume are tests/test_store.py's."""

import gc
import json
import os
import subprocess
import sys
import sysconfig
import threading
import venv
from pathlib import Path

import numpy as np
import pytest

from diloco.data import snapshot
from diloco.data import TokenBatches, corpus_info, eval_batches, get_vocabulary, specs, store_for, tasks, validate_data
from diloco.data.store import Store, read_manifest
from diloco.errors import ConfigError
from conftest import SHARED

DATA = SHARED / "data"
TFDS = DATA / "tfds"
C4_JSONL = DATA / "text" / "c4" / "c4_sample.jsonl"
DOLMA = DATA / "text" / "dolma" / "*.jsonl"
SP = DATA / "vocab" / "sentencepiece_cc_all.32000.100extra-sentencepiece.model"
needs_shared = pytest.mark.skipif(not DATA.is_dir(), reason=f"sample data folder {DATA} is absent (it lives beside the repo, not in it)")


@pytest.fixture(autouse=True, scope="module")
def _fresh_cache(tmp_path_factory):
    """Every test module run starts from an empty token cache (exercises tokenization, keeps ~/.cache clean)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DILOCO_CACHE", str(tmp_path_factory.mktemp("diloco_cache")))
        yield


def decode(vocab: str, row: np.ndarray) -> str:
    return get_vocabulary(vocab).decode([int(t) for t in row if t > 1])


def test_import_is_light():
    """Importing the data package loads neither TensorFlow nor seqio (the default corpus needs neither);
    how long start-up takes is benchmarks/bench_startup.py's job, not a test's."""
    code = "import sys; import diloco.data; print(sorted({'tensorflow', 'seqio'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_stdlib_batches_and_info():
    b = next(TokenBatches("stdlib", "byte", seq_len=256, batch_size=8))
    assert b.shape == (8, 256) and b.dtype == np.int32 and b.min() >= 1 and b.max() < 259
    text = "".join(decode("byte", r) for r in b)
    assert any(w in text for w in ("def ", "import ", "return", "class "))
    info = corpus_info("stdlib")
    assert info["snapshot_sha256"] == snapshot.SHA256 and info["files"] == 734 and info["validation_files"] > 0


STDLIB_BYTES = """import hashlib, os, sys
from diloco.data import specs, store
s = specs.parse_data("stdlib")
h = hashlib.sha256()
for f in s.files:
    h.update(os.path.relpath(f, s.root).encode() + b"\\0" + open(f, "rb").read())
print(h.hexdigest(), store.digest([store.source_identity(s, x) for x in specs.SPLITS]), s.root)"""


def test_stdlib_corpus_is_the_same_bytes_from_any_interpreter(tmp_path):
    """data=stdlib reads the shipped snapshot (diloco/data/snapshot.py), not the running interpreter's standard
    library: a second interpreter (a bare venv over the base Python, its own empty cache) reads the same files,
    bytes and source identity (the store fingerprint's input) as this one; the archive is the pinned one."""
    assert snapshot.archive_sha256() == snapshot.SHA256
    venv.create(tmp_path / "venv", system_site_packages=True, with_pip=False, symlinks=True)
    got = [subprocess.run([python, "-c", STDLIB_BYTES], capture_output=True, text=True, check=True, cwd=tmp_path,
                          env=dict(os.environ, DILOCO_CACHE=str(tmp_path / f"cache{i}"),
                                   PYTHONPATH=str(Path(__file__).parents[1]))).stdout.split()
           for i, python in enumerate((sys.executable, str(tmp_path / "venv" / "bin" / "python")))]
    assert got[0][:2] == got[1][:2] and got[0][2] != got[1][2], got  # same bytes, two unpacked copies
    assert not got[0][2].startswith(sysconfig.get_paths()["stdlib"])


def test_stdlib_byte_fast_path_matches_seqio_task(monkeypatch):
    spec = specs.parse_data("stdlib")
    n = specs.num_shards(spec, "validation")
    fast = tasks.tokenize_shard(spec, "byte", "validation", 0, n)
    monkeypatch.setenv("DILOCO_SEQIO_ONLY", "1")
    slow = tasks.tokenize_shard(spec, "byte", "validation", 0, n)
    assert np.array_equal(fast[0], slow[0]) and np.array_equal(fast[1], slow[1])


def test_stdlib_train_validation_disjoint():
    spec = specs.parse_data("stdlib")
    train, val = specs.file_split(spec, "train"), specs.file_split(spec, "validation")
    assert val and not set(train) & set(val) and len(train) + len(val) == len(spec.files)
    assert 0.005 < len(val) / len(spec.files) < 0.06
    xs, ys = eval_batches("stdlib", "byte", 128, 4, 3), eval_batches("stdlib", "byte", 128, 4, 3)
    assert all(np.array_equal(x, y) for x, y in zip(xs, ys))
    first_val = Path(val[0]).read_text()  # shuffle-free eval: the first validation file, from its first byte
    assert decode("byte", xs[0][0]) == first_val[: len(decode("byte", xs[0][0]))]


def test_determinism():
    take = lambda seed: [next(it) for it in [TokenBatches("stdlib", "byte", 128, 4, seed=seed)] for _ in range(3)]
    a, b, c = take(0), take(0), take(1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_every_spec_is_read_through_its_store_tokenized_once(monkeypatch):
    """stdlib and tokens:stdlib are one store in the cache, made on first use; its train split is the
    concatenated shards of the seqio tokenization (tasks.tokenize_shard) in source order, and a batch is
    the store's rows at the reader's global row ids. A second reader, or a resume, tokenizes nothing."""
    path = store_for("stdlib", "byte")
    assert path == store_for("tokens:stdlib", "byte") and path.startswith(os.environ["DILOCO_CACHE"])
    spec = specs.parse_data("stdlib")
    n = specs.num_shards(spec, "train")
    s = Store(path)
    assert len(s.files) == n and read_manifest(path)["splits"]["train"]["docs"] == len(specs.file_split(spec, "train"))
    first = tasks.tokenize_shard(spec, "byte", "train", 0, n)[0][:3 * 64].astype(np.int32)
    assert np.array_equal(s.rows([0, 1, 2], 64).reshape(-1), first)
    monkeypatch.setattr(tasks, "shard_chunks", lambda *a: pytest.fail("tokenized again"))
    it = TokenBatches("stdlib", "byte", 64, 8, seed=3)
    batches = [next(it) for _ in range(4)]
    for t, b in enumerate(batches):
        assert np.array_equal(b, s.rows(it.step_rows(t, local=False), 64))
    it2 = TokenBatches("tokens:stdlib", "byte", 64, 8, seed=3)
    it2.set_state(json.loads(json.dumps({**it.get_state(), "rows_consumed": 2 * 8})))
    assert np.array_equal(next(it2), batches[2]) and it2.get_state()["store"] == read_manifest(path)["fingerprint"]


@needs_shared
def test_resume_across_epochs_dolma():
    """The two Dolma sample files (sorted by file) through their store: 100 steps cross two epochs; a resume at
    the last step of an epoch, at its first, and in the third gives the uninterrupted batches."""
    it = TokenBatches(f"dolma:{DOLMA}", "byte", 256, 16, seed=1)
    per_epoch = it.n_rows // 16
    assert 20 < per_epoch < 50
    ref = [next(it) for _ in range(100)]
    for k in (per_epoch - 1, per_epoch, 2 * per_epoch + 3):
        it2 = TokenBatches(f"dolma:{DOLMA}", "byte", 256, 16, seed=1)
        [next(it2) for _ in range(k)]
        it3 = TokenBatches(f"dolma:{DOLMA}", "byte", 256, 16, seed=1)
        it3.set_state(it2.get_state())
        assert all(np.array_equal(next(it3), ref[k + i]) for i in range(3))
    assert not np.array_equal(ref[0], ref[per_epoch])  # epoch 1 is another permutation


@needs_shared
def test_c4_tfds_byte_and_sentencepiece():
    """The C4 sample (TFDS, 1000 + 200 documents) prepared into its store on first use, single process: row 0 is
    the first document in source order; batches, eval batches and the vocabulary as before."""
    sp = f"sentencepiece:{SP}"
    first = Store(store_for("c4", "byte", str(TFDS))).rows([0], 256)[0]
    assert decode("byte", first).startswith("Posted on April 12, 2018 by admin Posted in VmWare")
    b = next(TokenBatches(f"c4:{TFDS / 'c4/en/3.1.0'}", sp, 128, 8))
    assert b.shape == (8, 128) and b.dtype == np.int32 and 1 <= b.min() and b.max() < 32101 and (b == 1).any()
    assert " the " in " ".join(decode(sp, r) for r in b)
    ev = eval_batches("c4", sp, 64, 2, 2, data_dir=str(TFDS))
    assert all(np.array_equal(x, y) for x, y in zip(ev, eval_batches("c4", sp, 64, 2, 2, data_dir=str(TFDS))))
    assert decode(sp, ev[0][0]).startswith("The woman who died after falling from a bridge")
    info = corpus_info("c4", str(TFDS))
    assert info["examples"] == {"train": 1000, "validation": 200} and info["tfds_version"] == "3.1.0"
    man = read_manifest(store_for("c4", sp, str(TFDS)))
    assert man["splits"]["train"]["docs"] == 1000 and man["splits"]["validation"]["docs"] == 200


@needs_shared
def test_c4_jsonl_and_dolma_jsonl():
    b = Store(store_for(f"jsonl:{C4_JSONL}", "byte")).rows([0, 1], 512)
    assert b.shape == (2, 512) and decode("byte", b[0]).startswith("Beginners BBQ Class Taking Place in Missoula!")
    d = Store(store_for(f"dolma:{DOLMA}", "byte")).rows([0], 256)
    assert decode("byte", d[0]).startswith("We will be starting to hold weekly teleconferences")
    assert corpus_info(f"dolma:{DOLMA}")["files"] == 2
    assert next(TokenBatches(f"jsonl:{C4_JSONL}", "byte", 512, 4)).shape == (4, 512)


@needs_shared
def test_sentencepiece_vocab():
    v = get_vocabulary(f"sentencepiece:{SP}")
    assert v.vocab_size == 32101 and v.pad_id == 0 and v.eos_id == 1  # 32,000 pieces + <s>... incl. 100 extra ids baked in
    assert v.tokenizer.id_to_piece(32100) == "▁<extra_id_0>"
    text = "Beginners BBQ Class Taking Place in Missoula!"
    ids = v.encode(text)
    assert 0 < len(ids) < len(text) and v.decode(ids) == text


def test_byte_vocab_roundtrip():
    v = get_vocabulary("byte")
    text = "déjà vu — naïve 🙂 code\n\tdef f(): pass"
    assert v.vocab_size == 259 and v.decode(v.encode(text)) == text and min(v.encode(text)) >= 3


def test_byte_vocab_size_and_special_ids_need_no_tensorflow():
    code = ("import sys; from diloco.data import get_vocabulary; v = get_vocabulary('byte'); "
            "print(v.vocab_size, v.pad_id, v.eos_id, v.unk_id, 'tensorflow' in sys.modules or 'seqio' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    real = tasks.get_vocabulary("byte")  # seqio.ByteVocabulary itself
    assert out == [str(real.vocab_size), str(real.pad_id), str(real.eos_id), str(real.unk_id), "False"]
    assert get_vocabulary("byte").encode("hé") == real.encode("hé")  # everything else is seqio's


@pytest.mark.parametrize("data, vocab, seq_len, field", [  # {t}: tmp_path, holding e.jsonl, t.jsonl, u/a.txt
    ("jsonl:{t}/nope.jsonl", "byte", 64, "data"), ("text:{t}/*.txt", "byte", 64, "data"),  # missing, empty glob
    ("jsonl:{t}/e.jsonl", "byte", 64, "data"), ("jsonl:{t}/t.jsonl", "byte", 64, "data"),  # empty, no text field
    ("text:{t}/u/a.txt", "byte", 64, "data"), ("wikipedia", "byte", 64, "data"),  # not UTF-8, unknown spec
    ("stdlib", "bpe", 64, "vocab"), ("stdlib", "sentencepiece:{t}/sp.model", 64, "vocab"),
    ("stdlib", "byte", 0, "seq_len"), ("c4", "byte", 64, "data_dir"),  # c4 not prepared under tmp_path
])
def test_bad_inputs_name_their_field(data, vocab, seq_len, field, tmp_path):
    for name, body in {"e.jsonl": b"", "t.jsonl": b'{"content": "hi"}\n', "u/a.txt": b"caf\xe9 latin-1\n"}.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(body)
    data, vocab, data_dir = data.format(t=tmp_path), vocab.format(t=tmp_path), str(tmp_path) if data == "c4" else None
    with pytest.raises(ConfigError) as e:
        validate_data(data, vocab, data_dir, seq_len)
    assert e.value.field == field
    assert data != "c4" or "tfds build c4/en" in str(e.value)
    with pytest.raises(ConfigError):
        TokenBatches(data, vocab, seq_len, 2, data_dir=data_dir)


def test_prefetch_changes_nothing_but_timing():
    """Same batches, hashes and get_state() after every batch for any prefetch depth: the state is the position
    of the batch the caller consumed, however far the background thread has read ahead."""
    runs = {}
    for k in (0, 1, 4):
        it = TokenBatches("stdlib", "byte", 512, 64, seed=5, prefetch=k)
        runs[k] = [(next(it), it.get_state(), it.batch_hash(t, t + 1)) for t in range(12)]
        it.close()
    for k in (1, 4):
        assert all(np.array_equal(a, b) and sa == sb and ha == hb for (a, sa, ha), (b, sb, hb) in zip(runs[0], runs[k]))
    assert [s["rows_consumed"] for _, s, _ in runs[0]] == [64 * (t + 1) for t in range(12)]


def test_prefetch_thread_ends_on_close_and_on_garbage_collection():
    def alive():
        return [t for t in threading.enumerate() if t.name.startswith("store-batches")]

    before = set(alive())  # threads of iterators other tests left open
    it = TokenBatches("stdlib", "byte", 64, 2, prefetch=2)
    next(it)
    assert len(set(alive()) - before) == 1
    it.close()
    assert not set(alive()) - before
    it = TokenBatches("stdlib", "byte", 64, 2, prefetch=2)
    next(it)
    [thread] = set(alive()) - before
    del it
    gc.collect()
    thread.join(timeout=300)  # a hang guard, not a measurement: the thread ends on its own
    assert not thread.is_alive()


def test_prefetch_surfaces_errors_in_the_callers_thread(monkeypatch):
    def broken(self, ids, seq_len):
        raise OSError("disk on fire")

    monkeypatch.setattr(Store, "rows", broken)
    it = TokenBatches("stdlib", "byte", 32, 2, prefetch=2)
    with pytest.raises(OSError, match="disk on fire"):
        next(it)
    assert it.get_state()["rows_consumed"] == 0
    it.close()


def test_bad_prefetch_and_batch_size_name_their_field():
    for kw, field in (({"prefetch": -1}, "prefetch"), ({"batch_size": 0}, "batch_size")):
        with pytest.raises(ConfigError) as e:
            TokenBatches("stdlib", "byte", 64, **{"batch_size": 2, **kw})
        assert e.value.field == field


def test_several_prepared_c4_copies_are_refused_naming_them(tmp_path):
    """data=c4 with a data_dir holding c4/en/3.0.1 beside c4/realnewslike/3.0.1 (a mirror of the public bucket):
    one line naming both and the way out (data=c4:<dir>), never the alphabetically last one silently."""
    for d in ("c4/en/3.0.1", "c4/realnewslike/3.0.1"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "dataset_info.json").write_text("{}")
    with pytest.raises(ConfigError) as e:
        specs.parse_data("c4", data_dir=str(tmp_path))
    msg = str(e.value)
    assert e.value.field == "data" and "c4/en/3.0.1" in msg and "c4/realnewslike/3.0.1" in msg and "data=c4:" in msg
    assert "\n" not in msg
    (tmp_path / "c4/realnewslike/3.0.1/dataset_info.json").unlink()
    assert specs.parse_data("c4", data_dir=str(tmp_path)).root.endswith("c4/en/3.0.1")
