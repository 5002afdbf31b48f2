"""diloco.data: specs → seqio tasks → int32 batches, on real sample data from ../shared (skipped when absent)."""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from diloco.data import TokenBatches, corpus_info, eval_batches, get_vocabulary, specs, tasks, validate_data
from diloco.errors import ConfigError


def shared_dir() -> Path:
    """../shared next to the repository root (also right for a fresh clone with a sibling shared/)."""
    return Path(__file__).resolve().parents[1].parent / "shared"


DATA = shared_dir() / "data"
TFDS = DATA / "tfds"
C4_JSONL = DATA / "text" / "c4" / "c4_sample.jsonl"
DOLMA = DATA / "text" / "dolma" / "*.jsonl"
SP = DATA / "vocab" / "sentencepiece_cc_all.32000.100extra-sentencepiece.model"
needs_shared = pytest.mark.skipif(not DATA.is_dir(), reason=f"sample data folder {DATA} is absent (it lives beside the repo, not in it)")


@pytest.fixture(autouse=True, scope="module")
def _fresh_cache(tmp_path_factory):
    """Every test module run starts from an empty token cache (exercises tokenization, keeps ~/.cache clean)."""
    old = os.environ.get("DILOCO_CACHE")
    os.environ["DILOCO_CACHE"] = str(tmp_path_factory.mktemp("diloco_cache"))
    yield
    if old is None:
        del os.environ["DILOCO_CACHE"]
    else:
        os.environ["DILOCO_CACHE"] = old


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
    assert info["python_version"] == platform.python_version() and info["files"] > 100 and info["validation_files"] > 0


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


@pytest.mark.parametrize("pack", [True, False])
def test_resume_exact_without_reading_everything(pack, monkeypatch):
    it = TokenBatches("stdlib", "byte", 512, 64, seed=3, pack=pack)
    for _ in range(45):  # crosses shard boundaries (~30 packed batches per shard)
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(5)]
    loaded = []
    real = tasks.tokenize_shard
    monkeypatch.setenv("DILOCO_CACHE", "none")  # no cache: a resume must only tokenize the shard it is in (+1 prefetched)
    monkeypatch.setattr(tasks, "tokenize_shard", lambda *a: loaded.append(a[3]) or real(*a))
    it2 = TokenBatches("stdlib", "byte", 512, 64, seed=3, pack=pack)
    it2.set_state(state)
    got = [next(it2) for _ in range(5)]
    assert all(np.array_equal(x, y) for x, y in zip(expected, got))
    assert len(set(loaded)) <= 3 < specs.num_shards(specs.parse_data("stdlib"), "train")


@needs_shared
def test_resume_across_epochs_dolma():
    it = TokenBatches(f"dolma:{DOLMA}", "byte", 256, 16, seed=1)
    ref = [next(it) for _ in range(100)]  # ~38 batches per epoch
    for k in (37, 38, 80):
        it2 = TokenBatches(f"dolma:{DOLMA}", "byte", 256, 16, seed=1)
        [next(it2) for _ in range(k)]
        it3 = TokenBatches(f"dolma:{DOLMA}", "byte", 256, 16, seed=1)
        it3.set_state(it2.get_state())
        assert all(np.array_equal(next(it3), ref[k + i]) for i in range(3))
    assert it.get_state()["epoch"] >= 2


@needs_shared
def test_c4_tfds_byte_and_sentencepiece():
    sp = f"sentencepiece:{SP}"
    first = next(TokenBatches("c4", "byte", 256, 4, data_dir=str(TFDS), shuffle=False))
    assert decode("byte", first[0]).startswith("Posted on April 12, 2018 by admin Posted in VmWare")
    b = next(TokenBatches(f"c4:{TFDS / 'c4/en/3.1.0'}", sp, 128, 8))
    assert b.shape == (8, 128) and b.dtype == np.int32 and 1 <= b.min() and b.max() < 32101 and (b == 1).any()
    assert " the " in " ".join(decode(sp, r) for r in b)
    ev = eval_batches("c4", sp, 64, 2, 2, data_dir=str(TFDS))
    assert all(np.array_equal(x, y) for x, y in zip(ev, eval_batches("c4", sp, 64, 2, 2, data_dir=str(TFDS))))
    assert decode(sp, ev[0][0]).startswith("The woman who died after falling from a bridge")
    info = corpus_info("c4", str(TFDS))
    assert info["examples"] == {"train": 1000, "validation": 200} and info["tfds_version"] == "3.1.0"


@needs_shared
def test_c4_jsonl_and_dolma_jsonl():
    b = next(TokenBatches(f"jsonl:{C4_JSONL}", "byte", 512, 4, shuffle=False))
    assert b.shape == (4, 512) and decode("byte", b[0]).startswith("Beginners BBQ Class Taking Place in Missoula!")
    d = next(TokenBatches(f"dolma:{DOLMA}", "byte", 256, 4, shuffle=False))
    assert decode("byte", d[0]).startswith("We will be starting to hold weekly teleconferences")
    assert corpus_info(f"dolma:{DOLMA}")["files"] == 2


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


def test_pack_false_pads_short_documents(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "c.txt").write_text("x" * 70)  # longer than seq_len: cut into 32 + 32 + 7 (incl. EOS)
    b = next(TokenBatches(f"text:{tmp_path}/*.txt", "byte", 32, 8, pack=False, shuffle=False))
    assert b.shape == (8, 32) and b.dtype == np.int32
    assert decode("byte", b[0]) == "hello" and list(b[0, 5:7]) == [1, 0] and not b[0, 6:].any()
    assert (b[1] > 0).all() and (b[2] > 0).all() and b[3, 6] == 1 and not b[3, 7:].any()
    assert decode("byte", b[4]) == "hello"  # repeats over epochs


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize("case", ["missing path", "empty glob", "empty file", "no text field", "not utf-8", "unknown spec",
                                  "unknown vocab", "missing sp model", "bad seq_len", "c4 not prepared"])
def test_bad_inputs_name_their_field(case, tmp_path):
    data, vocab, data_dir, seq_len, field = "stdlib", "byte", None, 64, "data"
    if case == "missing path":
        data = f"jsonl:{tmp_path}/nope.jsonl"
    elif case == "empty glob":
        data = f"text:{tmp_path}/*.txt"
    elif case == "empty file":
        data = "jsonl:" + _write(tmp_path / "e.jsonl", b"")
    elif case == "no text field":
        data = "jsonl:" + _write(tmp_path / "t.jsonl", b'{"content": "hi"}\n')
    elif case == "not utf-8":
        data = "text:" + _write(tmp_path / "a.txt", b"caf\xe9 latin-1\n")
    elif case == "unknown spec":
        data = "wikipedia"
    elif case == "unknown vocab":
        vocab, field = "bpe", "vocab"
    elif case == "missing sp model":
        vocab, field = f"sentencepiece:{tmp_path}/sp.model", "vocab"
    elif case == "bad seq_len":
        seq_len, field = 0, "seq_len"
    elif case == "c4 not prepared":
        data, data_dir, field = "c4", str(tmp_path), "data_dir"
    with pytest.raises(ConfigError) as e:
        validate_data(data, vocab, data_dir, seq_len)
    assert e.value.field == field
    if case == "c4 not prepared":
        assert "tfds build c4/en" in str(e.value)
    with pytest.raises(ConfigError):
        TokenBatches(data, vocab, seq_len, 2, data_dir=data_dir)


@pytest.mark.parametrize("pack", [True, False])
def test_prefetch_changes_nothing_but_timing(pack):
    """Same batches and the same get_state() after every batch for any prefetch depth: the state is the
    position of the batch the caller consumed, however far the background thread has run ahead."""
    runs = {}
    for k in (0, 1, 4):
        it = TokenBatches("stdlib", "byte", 512, 64, seed=5, pack=pack, prefetch=k)
        runs[k] = [(next(it), it.get_state()) for _ in range(45)]  # crosses a shard boundary (~30 per shard)
        it.close()
    for k in (1, 4):
        assert all(np.array_equal(a, b) and sa == sb for (a, sa), (b, sb) in zip(runs[0], runs[k]))
    assert len({(s["epoch"], s["shard"]) for _, s in runs[0]}) > 1


def test_prefetch_thread_ends_on_close_and_on_garbage_collection():
    import gc
    import threading

    def alive():
        return [t for t in threading.enumerate() if t.name.startswith("TokenBatches-stdlib")]

    it = TokenBatches("stdlib", "byte", 64, 2, prefetch=2)
    next(it)
    assert len(alive()) == 1
    it.close()
    assert not alive()
    it = TokenBatches("stdlib", "byte", 64, 2, prefetch=2)
    next(it)
    [thread] = alive()
    del it
    gc.collect()
    thread.join(timeout=300)  # a hang guard, not a measurement: the thread ends on its own
    assert not alive()


def test_prefetch_surfaces_errors_in_the_callers_thread(monkeypatch):
    def broken(*a):
        raise OSError("disk on fire")

    monkeypatch.setenv("DILOCO_CACHE", "none")
    monkeypatch.setattr(tasks, "tokenize_shard", broken)
    it = TokenBatches("stdlib", "byte", 32, 2, prefetch=2)
    with pytest.raises(OSError, match="disk on fire"):
        next(it)
    assert it.get_state()["batches"] == 0


def test_bad_prefetch_names_its_field():
    with pytest.raises(ConfigError) as e:
        TokenBatches("stdlib", "byte", 64, 2, prefetch=-1)
    assert e.value.field == "prefetch"


def test_one_reader_is_the_whole_batch():
    """HostBatches with one reader hands out TokenBatches' own batches (a 1-process run is unchanged)."""
    from diloco.data import HostBatches

    a, b = TokenBatches("stdlib", "byte", 64, 8, seed=5), HostBatches("stdlib", "byte", 64, 8, 1, [0], seed=5)
    assert b.rows() == list(range(8))
    for _ in range(3):
        assert np.array_equal(next(a), next(b))
    a.close(), b.close()


def test_readers_split_shards_and_rows_and_resume(monkeypatch):
    """4 readers: each process's blocks come from its own shards (k::4) only; the blocks of two
    'processes' put together are the readers' batches; a resume from the gathered state continues each."""
    from diloco.data import HostBatches

    n = specs.num_shards(specs.parse_data("stdlib"), "train")
    assert n >= 4
    loaded: dict[int, list[int]] = {}
    p0 = HostBatches("stdlib", "byte", 512, 256, 4, [0, 1], seed=2, prefetch=0)
    p1 = HostBatches("stdlib", "byte", 512, 256, 4, [2, 3], seed=2, prefetch=0)
    assert p0.rows() == list(range(128)) and p1.rows() == list(range(128, 256))
    assert p0.shards_read() == sorted(list(range(0, n, 4)) + list(range(1, n, 4)))
    assert set(p0.shards_read()).isdisjoint(p1.shards_read())
    for p in (p0, p1):  # the loader of each reader only ever asks for its own shards
        for k, part in zip(p.blocks, p.parts):
            monkeypatch.setattr(part.store, "get", (lambda get, k: lambda i, prefetch=None: (
                loaded.setdefault(k, []).append(i), get(i, prefetch))[1])(part.store.get, k))
    for _ in range(40):  # crosses shard boundaries
        x0, x1 = next(p0), next(p1)
    assert x0.shape == (128, 512) and not np.array_equal(x0[:64], x0[64:])
    assert all(i % 4 == k for k, ids in loaded.items() for i in ids) and sorted(loaded) == [0, 1, 2, 3]
    assert len({i for ids in loaded.values() for i in ids}) > 4  # more than one shard per reader was read
    assert p0.tokens_read() == p1.tokens_read() == 40 * 128 * 512
    state = json.loads(json.dumps(p0.state(np.concatenate([p0.local_positions(), p1.local_positions()]))))
    assert [r["reader"] for r in state["readers"]] == [[k, 4] for k in range(4)]
    want = [np.concatenate([next(p0), next(p1)]) for _ in range(3)]
    q0 = HostBatches("stdlib", "byte", 512, 256, 4, [0, 1], seed=2, prefetch=0)
    q1 = HostBatches("stdlib", "byte", 512, 256, 4, [2, 3], seed=2, prefetch=0)
    q0.set_state(state), q1.set_state(state)
    assert all(np.array_equal(w, np.concatenate([next(q0), next(q1)])) for w in want)
    with pytest.raises(ConfigError, match="data_readers=4"):  # a checkpoint of 4 readers, resumed with 2
        HostBatches("stdlib", "byte", 512, 256, 2, [0], seed=2, prefetch=0).set_state(state)


def test_readers_bad_counts_name_their_field():
    from diloco.data import HostBatches

    with pytest.raises(ConfigError, match="data_readers"):
        HostBatches("stdlib", "byte", 64, 6, 4, [0])  # 4 readers cannot split a batch of 6
    n = specs.num_shards(specs.parse_data("stdlib"), "validation")
    with pytest.raises(ConfigError, match="data_readers"):
        TokenBatches("stdlib", "byte", 64, 1, split="validation", reader=(n, n + 1))


def test_the_shard_permutation_gathered_in_passes_is_the_documents_in_permuted_order(monkeypatch):
    """batches.permute_documents gathers PERMUTE_DOCS documents per pass (bounded scratch at a shard boundary); the
    stream is still document perm[0], then perm[1], … whatever the pass size."""
    from diloco.data import batches

    rng = np.random.default_rng(0)
    lens = rng.integers(1, 9, 50)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    tokens = rng.integers(3, 259, offsets[-1]).astype(np.uint16)
    perm = rng.permutation(50)
    want = np.concatenate([tokens[offsets[d]:offsets[d + 1]] for d in perm])
    for per_pass in (1, 3, 7, 50, 4096):
        monkeypatch.setattr(batches, "PERMUTE_DOCS", per_pass)
        got, off = batches.permute_documents(tokens, offsets, perm)
        assert np.array_equal(got, want) and off.tolist() == np.concatenate([[0], np.cumsum(lens[perm])]).tolist()


def test_several_prepared_c4_copies_are_refused_naming_them(tmp_path):
    """data=c4 with a data_dir holding c4/en/3.0.1 beside c4/realnewslike/3.0.1 (a mirror of the public bucket):
    one line naming both and the way out (data=c4:<dir>), never the alphabetically last one silently."""
    from diloco.data.specs import parse_data
    from diloco.errors import ConfigError

    for d in ("c4/en/3.0.1", "c4/realnewslike/3.0.1"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "dataset_info.json").write_text("{}")
    with pytest.raises(ConfigError) as e:
        parse_data("c4", data_dir=str(tmp_path))
    msg = str(e.value)
    assert e.value.field == "data" and "c4/en/3.0.1" in msg and "c4/realnewslike/3.0.1" in msg and "data=c4:" in msg
    assert "\n" not in msg
    (tmp_path / "c4/realnewslike/3.0.1/dataset_info.json").unlink()
    assert parse_data("c4", data_dir=str(tmp_path)).root.endswith("c4/en/3.0.1")
