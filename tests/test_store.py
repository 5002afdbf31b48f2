"""The token store (diloco/data/store.py) and its global-index reader (diloco/data/reader.py): default tier."""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from diloco.data import prepare, reader, specs, store, tasks
from diloco.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def _val(rel: str) -> bool:  # the text/stdlib split rule of diloco/data/specs.py, restated
    return int(hashlib.md5(rel.encode()).hexdigest()[:8], 16) % 1000 < 20


def make_text_corpus(root: Path, n_train: int = 36, n_val: int = 2, size: int = 120_000) -> str:
    """n_train + n_val deterministic text files (~size bytes each), named so that n_val of them fall
    into the validation split; returns the data spec."""
    rng = np.random.default_rng(0)
    words = np.array(["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa", "\n"])
    root.mkdir(parents=True, exist_ok=True)
    train = val = i = 0
    while train < n_train or val < n_val:
        name, i = f"doc{i:04d}.txt", i + 1
        is_val = _val(name)
        if (is_val and val >= n_val) or (not is_val and train >= n_train):
            continue
        (root / name).write_text(" ".join(rng.choice(words, size // 5)))
        val, train = val + is_val, train + (not is_val)
    return f"text:{root}/*.txt"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_text_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def st(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("store") / "s"
    store.tokenize(corpus, "byte", str(out), workers=1, progress=False)
    return str(out)


# -- the keyed permutation and the order rule ----------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 100, 1000, 4097])
def test_permute_is_a_bijection_of_every_size(n):
    for seed, epoch in [(0, 0), (1, 0), (0, 1)]:
        y = reader.permute(np.arange(n), n, seed, epoch)
        assert sorted(y.tolist()) == list(range(n))
    if n >= 16:  # keyed: another seed or epoch is another order
        a = reader.permute(np.arange(n), n, 0, 0)
        assert not np.array_equal(a, reader.permute(np.arange(n), n, 1, 0))
        assert not np.array_equal(a, reader.permute(np.arange(n), n, 0, 1))


def test_order_rule_by_hand():
    """N=10 rows, B=4: an epoch is 2 steps (8 positions); positions 8..15 are epoch 1; the 2 rows an epoch
    leaves out are perm_e(8), perm_e(9)."""
    n, b, seed = 10, 4, 7
    got = reader.global_rows(np.arange(24), n, b, seed)
    p0, p1, p2 = (reader.permute(np.arange(10), 10, seed, e) for e in range(3))
    assert got[:8].tolist() == p0[:8].tolist()
    assert got[8:16].tolist() == p1[:8].tolist()
    assert got[16:24].tolist() == p2[:8].tolist()
    assert len(set(got[:8].tolist())) == 8


def test_a_store_smaller_than_a_batch_is_refused():
    with pytest.raises(ConfigError, match="fewer than the global batch 8"):
        reader.global_rows(np.arange(3), 5, 8, 0)


# -- the store's rows are the corpus's tokens ----------------------------------------------------------
def test_rows_are_the_concatenated_parts_and_tokens_equal_the_seqio_tokens(corpus, st):
    man = store.read_manifest(st)
    s = store.Store(st, "train")
    assert len(s.files) > 1 and man["splits"]["train"]["tokens"] == s.tokens
    spec = specs.parse_data(corpus)
    n = specs.num_shards(spec, "train")  # the seqio tokenization of each source shard, in source order
    stream = np.concatenate([tasks.tokenize_shard(spec, "byte", "train", i, n)[0] for i in range(n)]).astype(np.int32)
    assert len(stream) == s.tokens and man["splits"]["train"]["docs"] == len(specs.file_split(spec, "train"))
    L = 1000
    boundary = int(s.starts[1]) // L  # a row that continues into the second part
    for r in [0, 1, boundary, s.num_rows(L) - 1]:
        assert np.array_equal(s.rows([r], L)[0], stream[r * L:(r + 1) * L])
    assert (stream == 1).sum() == man["splits"]["train"]["docs"]  # one EOS per document


# -- the same global batch on any process count and device layout -------------------------------------
def _sharding(devices, R, data, fsdp):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.asarray(devices).reshape(R, data, fsdp), ("replica", "data", "fsdp"))
    return NamedSharding(mesh, P("replica", ("data", "fsdp")))


def _global_batches(st, sharding, shape, processes: int, steps: int, seed=3, start_state=None):
    """The (steps, R·b, L) global batches assembled from `processes` simulated hosts, each holding a
    consecutive group of the devices and reading only its own rows; also every host's rows."""
    R, b, L = shape
    devs = list(sharding.mesh.devices.reshape(-1))  # process-major, as diloco.distributed.device_grid orders them
    per = len(devs) // processes
    out = np.full((steps, R * b, L), -1, np.int32)
    owned = []
    for p in range(processes):
        rows = reader.local_row_ids(sharding, shape, devs[p * per:(p + 1) * per])
        owned.append(rows)
        it = reader.StoreBatches(st, L, R * b, seed, rows, prefetch=2)
        if start_state:
            it.set_state(start_state)
        for t in range(steps):
            out[t, rows] = next(it)
        it.close()
    return out, owned


def check_layouts(st: str) -> None:
    """Run with 8 CPU devices (test below): every layout and host count gives the 1-host global batches."""
    import jax

    devs = jax.devices()
    assert len(devs) == 8, devs
    shape = (2, 4, 64)
    ref, _ = _global_batches(st, _sharding(devs, 2, 2, 2), shape, 1, 6)
    assert (ref >= 0).all()
    for layout, procs in [((2, 2, 2), 2), ((2, 2, 2), 4), ((2, 4, 1), 4), ((2, 1, 4), 8), ((2, 4, 1), 1)]:
        got, owned = _global_batches(st, _sharding(devs, *layout), shape, procs, 6)
        assert np.array_equal(got, ref), (layout, procs)
        assert sorted(r for rows in owned for r in rows) == list(range(8))  # each row read by one host
    print("layouts ok")


def test_global_batches_are_identical_on_1_2_4_processes_and_8x1_vs_4x2(st):
    """1 host × 8 devices vs 2 × 4, 4 × 2 and 8 × 1 over three mesh layouts: the same tokens in every
    global batch (hosts simulated as groups of one process's 8 CPU devices, each reading only its rows)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", PYTHONPATH=f"{REPO / 'tests'}:{REPO}")
    r = subprocess.run([sys.executable, "-c", f"import test_store; test_store.check_layouts({st!r})"], env=env,
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0 and "layouts ok" in r.stdout, r.stderr[-3000:]
    it = reader.StoreBatches(st, 64, 8, 3)
    hashes = [it.batch_hash(t, t + 1) for t in range(6)]
    assert len(set(hashes)) == 6
    assert reader.StoreBatches(st, 64, 8, 4).batch_hash(0, 1) != hashes[0]  # another seed, another batch


def test_an_epoch_reads_every_row_once_across_a_resume_on_another_process_count(st):
    """B divides N (an exact epoch): 1 host reads part of the epoch, its state resumes on 4 hosts of another
    layout; every row of the store is read exactly once in the epoch and the tokens are the uninterrupted ones."""
    s = store.Store(st)
    L, B = next((L, B) for L in range(4096, 4400) for B in (8,) if s.num_rows(L) % B == 0)
    n = s.num_rows(L)
    E = n // B
    it = reader.StoreBatches(st, L, B, 11)
    ref = np.stack([next(it) for _ in range(E)])
    first = reader.StoreBatches(st, L, B, 11)
    got = [next(first) for _ in range(E // 2)]
    state = json.loads(json.dumps(first.get_state()))  # as the checkpoint's sidecar stores it
    assert state["rows_consumed"] == E // 2 * B
    rest = np.full((E - E // 2, B, L), -1, np.int32)
    for rows in ([1, 5], [0, 2], [3, 7], [4, 6]):  # 4 hosts, rows interleaved
        host = reader.StoreBatches(st, L, B, 11, rows)
        host.set_state(state)
        for t in range(E - E // 2):
            rest[t, rows] = next(host)
        host.close()
    assert np.array_equal(np.concatenate([np.stack(got), rest]), ref)
    rows = np.concatenate([it.step_rows(t, local=False) for t in range(E)])
    assert sorted(rows.tolist()) == list(range(n))


@pytest.mark.parametrize("n,B", [(10, 4), (37, 6), (64, 8)])
def test_replicas_never_share_a_row_in_a_step(n, B):
    """Every step of 5 epochs (also the steps at an epoch's end) holds B distinct rows; an epoch reads no row
    twice and leaves out exactly N mod B rows."""
    E = n // B
    for t in range(5 * E):
        rows = reader.global_rows(t * B + np.arange(B), n, B, 5)
        assert len(set(rows.tolist())) == B
    for e in range(5):
        rows = reader.global_rows(np.arange(e * E * B, (e + 1) * E * B), n, B, 5)
        assert len(set(rows.tolist())) == E * B == n - n % B


# -- identity: fingerprints, refusals ------------------------------------------------------------------
def test_a_store_with_another_fingerprint_is_refused_on_resume_naming_both(st, corpus, tmp_path):
    other = tmp_path / "other"  # the same file names, other text
    store.tokenize(make_text_corpus(tmp_path / "c2", size=100_000), "byte", str(other), workers=1, progress=False)
    a = reader.StoreBatches(st, 64, 4, 0)
    b = reader.StoreBatches(str(other), 64, 4, 0)
    assert a.store.fingerprint != b.store.fingerprint
    with pytest.raises(ConfigError, match=f"{a.store.fingerprint}.*{b.store.fingerprint}"):
        b.set_state(a.get_state())
    with pytest.raises(ConfigError, match="seq_len: saved 64 vs now 32"):
        reader.StoreBatches(st, 32, 4, 0).set_state(a.get_state())
    with pytest.raises(ConfigError, match="vocab"):
        store.check_store(st, "sentencepiece:" + str(_spm_or_skip()), 64)
    with pytest.raises(ConfigError, match="diloco data tokenize"):
        store.read_manifest(str(tmp_path / "nothing"))


@pytest.mark.parametrize("damage", ["flip_bit", "zero", "truncate", "delete"])
def test_a_damaged_part_is_refused_in_one_line_naming_it_and_a_garbage_manifest_too(st, tmp_path, damage):
    """Each part's size and sha256 (in the manifest, under the fingerprint) are checked when the split is opened,
    before any row is read: an undamaged split of the same store still opens."""
    copy = tmp_path / "s"
    shutil.copytree(st, copy)
    part = sorted((copy / "validation").glob("part-*.bin"))[0]
    raw = bytearray(part.read_bytes())
    if damage == "flip_bit":
        raw[len(raw) // 2] ^= 1
    part.write_bytes(bytes(len(raw)) if damage == "zero" else bytes(raw[:-2] if damage == "truncate" else raw))
    if damage == "delete":
        part.unlink()
    assert store.Store(str(copy), "train").rows([0], 64).shape == (1, 64)
    with pytest.raises(ConfigError) as e:
        store.Store(str(copy), "validation")
    assert str(e.value).startswith(f"data: token store part {part}") and "diloco data tokenize" in str(e.value)
    assert "\n" not in str(e.value)
    (copy / "manifest.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"manifest.json is not valid JSON .*diloco data tokenize"):
        store.Store(str(copy), "validation")


def _spm_or_skip():
    p = REPO.parent / "shared" / "data" / "vocab"
    found = sorted(p.glob("*.model")) if p.is_dir() else []
    if not found:
        pytest.skip(f"no SentencePiece model under {p}")
    return found[0]


def test_a_remote_token_cache_is_refused_and_makes_no_local_folder(tmp_path):
    env = dict(os.environ, DILOCO_CACHE="gs://bucket/cache")
    r = subprocess.run([sys.executable, "-m", "diloco.cli", "sizes"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "DILOCO_CACHE" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "gs:").exists()


# -- tokenize: interrupted and rerun --------------------------------------------------------------------
def _tokenize_cmd(corpus, out):
    return [sys.executable, "-m", "diloco.cli", "data", "tokenize", "--data", corpus, "--out", str(out), "--workers", "1"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_tokenize_interrupted_and_rerun_gives_the_uninterrupted_fingerprint(st, corpus, tmp_path, sig):
    out = tmp_path / "s"
    env = dict(os.environ, DILOCO_TOKENIZE_PAUSE_S="0.5")  # a window between parts to interrupt in
    p = subprocess.Popen(_tokenize_cmd(corpus, out), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while p.poll() is None and time.time() < deadline and not list((out / "train").glob("part-00001-*.json")):
        time.sleep(0.02)
    assert p.poll() is None, "tokenize finished before it could be interrupted"
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == (130 if sig == signal.SIGINT else -signal.SIGKILL), err[-2000:]
    if sig == signal.SIGINT:  # one line, no traceback
        assert "run the same command to finish" in err.decode() and b"Traceback" not in err
    assert not (out / "manifest.json").exists()  # written last
    with pytest.raises(ConfigError, match="did not finish"):
        store.read_manifest(str(out))
    kept = {f.name: f.stat().st_mtime_ns for f in (out / "train").glob("*.bin")}
    assert kept
    r = subprocess.run(_tokenize_cmd(corpus, out), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["fingerprint"] == store.read_manifest(st)["fingerprint"]
    assert {f: (out / "train" / f).stat().st_mtime_ns for f in kept} == kept  # finished parts were not redone
    assert "tokens/s" in r.stderr and "ETA" in r.stderr


def test_tokenize_on_two_processes_gives_the_same_store(st, corpus, tmp_path):
    man = store.tokenize(corpus, "byte", str(tmp_path / "s2"), workers=2, progress=False)
    assert man["fingerprint"] == store.read_manifest(st)["fingerprint"]


@pytest.mark.parametrize("seqio_only", [False, True])
def test_a_worker_holds_one_chunk_not_its_shard_and_the_store_is_unchanged(st, corpus, tmp_path, monkeypatch, seqio_only):
    """Streaming: each part is written chunk by chunk (a byte block of CHUNK_BYTES, or BATCH_DOCS documents of
    the seqio Task), so the most tokens a worker holds is one chunk, a small share of its ~1 MiB part, and the
    bytes (the fingerprint) are those of the store made with the default chunks."""
    monkeypatch.setattr(tasks, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(tasks, "BATCH_DOCS", 1)
    if seqio_only:
        monkeypatch.setenv("DILOCO_SEQIO_ONLY", "1")
    man = store.tokenize(corpus, "byte", str(tmp_path / "s"), workers=1, progress=False)
    assert man["fingerprint"] == store.read_manifest(st)["fingerprint"]
    metas = [json.loads(p.read_text()) for p in sorted((tmp_path / "s" / "train").glob("*.json"))]
    longest = max(os.path.getsize(f) for f in specs.parse_data(corpus).files)
    bound = longest + 1 if seqio_only else 4096  # one document (its bytes + EOS), or one block
    assert len(metas) > 1 and all(m["most_tokens_held"] <= bound < m["tokens"] / 2 for m in metas), metas


@pytest.mark.parametrize("ram_gib, cpus, asked, want", [(96, 96, None, 64), (40.5, 96, None, 27), (40.5, 96, 96, 27),
                                                         (40.5, 96, 8, 8), (0.5, 4, None, 1), (8, 2, None, 2), (8, 2, 6, 5)])
def test_workers_default_to_every_core_and_are_capped_by_memory(ram_gib, cpus, asked, want):
    """At most one worker per 1.5 GiB (store.WORKER_RAM) of available memory: an n2-highcpu-96 runs 64, not 96."""
    n, note = store.size_workers(asked, int(ram_gib * 2**30), cpus)
    assert n == want and (note is not None) == bool(asked and asked > want)
    assert store.available_ram() > 0


def test_an_unwritable_out_fails_in_one_line_before_tokenizing(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(tasks, "shard_chunks", lambda *a: pytest.fail("tokenized before the probe"))
    (tmp_path / "f").write_text("a file")
    with pytest.raises(ConfigError, match=r"cannot write the token store at .*f/s.*--scopes=cloud-platform") as e:
        store.tokenize(corpus, "byte", str(tmp_path / "f" / "s"), workers=1, progress=False)
    assert "\n" not in str(e.value) and e.value.field == "out"


# -- gs:// (the storage emulator) ------------------------------------------------------------------------
def test_a_store_on_gcs_is_written_and_read(gcs, st, corpus):
    url = gcs.url("stores", "t")
    man = store.tokenize(corpus, "byte", url, workers=1, progress=False)
    assert man["fingerprint"] == store.read_manifest(st)["fingerprint"]
    assert "stores/t/manifest.json" in gcs.objects("stores/t")
    local, remote = reader.StoreBatches(st, 128, 8, 2), reader.StoreBatches(url, 128, 8, 2)
    for _ in range(3):
        assert np.array_equal(next(local), next(remote))
    remote.close()
    store.check_store(url, "byte", 128)
    with pytest.raises(ConfigError, match="cannot write the token store at 'gs://no-such-bucket-x/s'"):
        store.tokenize(corpus, "byte", "gs://no-such-bucket-x/s", workers=1, progress=False)


# -- mixing: a source-sorted JSONL corpus ----------------------------------------------------------------
def _source_share(batch: np.ndarray) -> float:
    """Share of source A's tokens (bytes of 'a'..'m', +3 in the byte vocabulary) among a batch's text tokens."""
    text = batch[batch > 2]
    return float(((text >= ord("a") + 3) & (text <= ord("m") + 3)).mean())


def test_a_source_sorted_jsonl_corpus_gives_every_batch_the_corpus_source_share(tmp_path):
    """Two sources, one JSONL file each (source A's text uses the letters a-m, B's n-z; B has twice A's
    documents): every global batch's share of A is within 4·sqrt(p(1-p)/B) of the corpus's share p
    (rows are drawn by the keyed permutation over the whole store). The store's rows in source order (what
    a reader streaming one file at a time, like the per-host shard reader before #30, gives) do not meet it."""
    rng = np.random.default_rng(1)
    for name, letters, n in (("a", "abcdefghijklm", 150), ("b", "nopqrstuvwxyz", 300)):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for _ in range(n):
                f.write(json.dumps({"text": "".join(rng.choice(list(letters + " "), int(rng.integers(100, 400))))}) + "\n")
    data = f"jsonl:{tmp_path}/*.jsonl"
    out = str(tmp_path / "s")
    store.tokenize(data, "byte", out, workers=1, progress=False)
    L, B = 64, 64
    s = store.Store(out)
    p = _source_share(s.rows(np.arange(s.num_rows(L)), L))
    assert 0.25 < p < 0.42  # about a third
    tol = 4 * np.sqrt(p * (1 - p) / B)
    it = reader.StoreBatches(out, L, B, 0, prefetch=0)
    worst = max(abs(_source_share(next(it)) - p) for _ in range(s.num_rows(L) // B))
    print(f"source share p={p:.3f}: worst batch |share-p|={worst:.3f}, tolerance {tol:.3f}")
    assert worst <= tol
    in_order = s.rows(np.arange(s.num_rows(L) // B * B), L).reshape(-1, B, L)
    assert max(abs(_source_share(b) - p) for b in in_order) > tol


def test_preflight_checks_a_points_store_before_billing(gcs, corpus):
    """diloco/tpu/preflight.py: a store on this machine's disk is refused; on gs:// its manifest must exist and fit
    the point's vocabulary and seq_len, with `diloco data tokenize` as the fix."""
    import ml_collections

    from diloco.tpu import preflight

    url = gcs.url("stores", "p")

    def cfg(data, vocab="byte", seq_len=64):
        return ml_collections.ConfigDict({"data": data, "vocab": vocab, "seq_len": seq_len, "data_dir": "",
                                          "steps": 1, "batch_size": 1})

    with pytest.raises(ConfigError, match="on this machine's disk.*diloco data tokenize"):
        preflight.check_data(cfg("tokens:/tmp/store"), "pt", set())
    preflight.check_data(cfg(f"tokens:{url}"), "pt", set())
    with pytest.raises(ConfigError, match="point pt: no token store .*diloco data tokenize"):
        preflight.check_remote(cfg(f"tokens:{url}"), "pt")
    store.tokenize(corpus, "byte", url, workers=1, progress=False)
    preflight.check_remote(cfg(f"tokens:{url}"), "pt")
    with pytest.raises(ConfigError, match="point pt: .*less than one row of seq_len=999999999"):
        preflight.check_remote(cfg(f"tokens:{url}", seq_len=999_999_999), "pt")


def test_tokens_of_a_corpus_spec_is_prepared_into_the_local_cache_once(corpus, st, tmp_path, monkeypatch):
    """tokens:text:<glob> (and tokens:stdlib, tokens:jsonl:…): the store is made in $DILOCO_CACHE/stores on first
    use, with the fingerprint `diloco data tokenize` gives, and reused after that."""
    from diloco.data import eval_batches, store_for, validate_data

    monkeypatch.setenv("DILOCO_CACHE", str(tmp_path / "cache"))
    data = f"tokens:{corpus}"
    validate_data(data, "byte", None, 64)  # the corpus's own checks; nothing tokenized yet
    assert not (tmp_path / "cache").exists()
    path = store_for(data, "byte")
    assert path.startswith(str(tmp_path / "cache" / "stores"))
    assert store.read_manifest(path)["fingerprint"] == store.read_manifest(st)["fingerprint"]
    mtime = os.stat(os.path.join(path, "manifest.json")).st_mtime_ns
    assert store_for(data, "byte") == path and os.stat(os.path.join(path, "manifest.json")).st_mtime_ns == mtime
    ev = eval_batches(data, "byte", 64, 4, 2)
    assert np.array_equal(np.stack(ev), np.stack(reader.store_eval_batches(st, 64, 4, 2)))
    monkeypatch.setenv("DILOCO_CACHE", "none")
    for spec in (data, corpus, "stdlib"):  # also a corpus spec read without tokens: (one path for every spec)
        with pytest.raises(ConfigError, match="DILOCO_CACHE=none") as e:
            store_for(spec, "byte")
        assert e.value.field == "data" and "\n" not in str(e.value)
        with pytest.raises(ConfigError, match="DILOCO_CACHE=none"):
            validate_data(spec, "byte", None, 64)  # before anything compiles


def test_retokenizing_another_corpus_into_a_store_unpublishes_it_until_done(corpus, tmp_path, monkeypatch):
    """Another corpus tokenized into an existing store's path: the old manifest goes before the first part
    changes, so a reader never sees the old manifest over new parts; a finished store is left as it is."""
    out = str(tmp_path / "s")
    first = store.tokenize(corpus, "byte", out, workers=1, progress=False)
    assert store.tokenize(corpus, "byte", out, workers=1, progress=False)["fingerprint"] == first["fingerprint"]
    real, calls = store.tokenize_part, []

    def fail_second(job):
        calls.append(job["index"])
        if len(calls) == 2:
            raise RuntimeError("preempted")
        return real(job)

    monkeypatch.setattr(store, "tokenize_part", fail_second)
    with pytest.raises(RuntimeError, match="preempted"):
        store.tokenize(make_text_corpus(tmp_path / "c2", size=100_000), "byte", out, workers=1, progress=False)
    with pytest.raises(ConfigError, match="did not finish"):
        store.read_manifest(out)


# -- every spec through its store: first use, locks, what is prepared where ------------------------------
def test_concurrent_first_use_tokenizes_once_and_every_caller_reads_the_store(corpus, st, tmp_path, monkeypatch):
    """Three callers (threads here; processes of one machine lock the same file the same way: flock) ask for the
    store of a corpus spec at once: one tokenizes it while the others wait on the lock file, then all read it."""
    monkeypatch.setenv("DILOCO_CACHE", str(tmp_path / "cache"))
    real, calls = store.tokenize, []

    def slow_tokenize(*a, **k):
        calls.append(a[0])
        time.sleep(0.5)  # a window in which the other callers arrive
        return real(*a, **k)

    monkeypatch.setattr(store, "tokenize", slow_tokenize)
    got, errors = [], []

    def ask():
        try:
            got.append(prepare.store_for(corpus, "byte"))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and len(got) == 3 and len(set(got)) == 1
    assert calls == [corpus]  # tokenized once
    assert store.read_manifest(got[0])["fingerprint"] == store.read_manifest(st)["fingerprint"]


def _fake_tfds(root: Path, train_docs: int) -> str:
    d = root / "c4" / "en" / "3.1.0"
    d.mkdir(parents=True)
    (d / "dataset_info.json").write_text(json.dumps({"name": "c4", "configName": "en", "version": "3.1.0", "splits": [
        {"name": "train", "shardLengths": [train_docs // 2, train_docs - train_docs // 2]},
        {"name": "validation", "shardLengths": [10]}]}))
    return str(root)


def test_a_tfds_corpus_is_prepared_by_a_single_small_run_only(tmp_path, monkeypatch):
    """data=c4 without a store in the cache: a single-process run prepares a small one (≤ AUTO_TFDS_MAX_DOCS, the
    C4 sample); a large one, or any in a multi-process run, is refused in one line before anything is tokenized,
    naming `diloco data tokenize … --out gs://…` and --config.data=tokens:…; once the store is in the cache a
    multi-process run reads it."""
    monkeypatch.setenv("DILOCO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(store, "tokenize", lambda *a, **k: pytest.fail("tokenized"))
    small, large = _fake_tfds(tmp_path / "small", 1000), _fake_tfds(tmp_path / "large", prepare.AUTO_TFDS_MAX_DOCS + 1)
    out = prepare.check_preparable("c4", "byte", small)  # allowed: a run would tokenize it into `out`
    assert str(out).startswith(str(tmp_path / "cache" / "stores" / "tfds-"))
    cases = [(large, {}, "100,011 documents"), (small, {"DILOCO_NUM_PROCESSES": "4"}, "4-process run")]
    for data_dir, env, why in cases:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        for call in (lambda: prepare.check_preparable("c4", "byte", data_dir),
                     lambda: prepare.store_for("c4", "byte", data_dir)):
            with pytest.raises(ConfigError) as e:
                call()
            msg = str(e.value)
            assert e.value.field == "data" and "\n" not in msg and why in msg, msg
            assert f"diloco data tokenize --data c4 --data_dir {data_dir}" in msg and "--out gs://" in msg
            assert "--config.data=tokens:gs://" in msg
    out.mkdir(parents=True)
    (out / "manifest.json").write_text("{}")  # prepared before (e.g. by a single-process run on this machine)
    assert prepare.check_preparable("c4", "byte", small) == out  # 4 processes: read, not refused
    assert prepare.check_preparable("c4:" + small + "/c4/en/3.1.0", "byte") == out  # the same corpus, the same store


def test_an_edited_local_corpus_gets_a_new_store(tmp_path, monkeypatch):
    """The cache key of a local corpus holds its files' mtimes (the store's fingerprint does not): a file edited
    in place, even to the same size, is tokenized again instead of being read stale from the cache."""
    monkeypatch.setenv("DILOCO_CACHE", str(tmp_path / "cache"))
    data = make_text_corpus(tmp_path / "c", n_train=3, n_val=1, size=5_000)
    a = prepare.store_for(data, "byte")
    f = sorted((tmp_path / "c").glob("*.txt"))[0]
    f.write_text(f.read_text()[::-1])  # same size, other text
    os.utime(f, ns=(time.time_ns(), time.time_ns() + 10**9))
    b = prepare.store_for(data, "byte")
    assert a != b and store.read_manifest(a)["fingerprint"] != store.read_manifest(b)["fingerprint"]


def test_two_processes_preparing_one_store_tokenize_it_once(tmp_path):
    """The same with two real processes started together (as `diloco launch --processes 2` on one machine):
    exactly one of them tokenizes (each reports it), both get the store, which has the uninterrupted fingerprint."""
    data = make_text_corpus(tmp_path / "c", n_train=3, n_val=1, size=5_000)
    code = ("import sys; from diloco.data import prepare, store; real = store.tokenize\n"
            "def wrapped(*a, **k):\n    print('TOKENIZED', flush=True); return real(*a, **k)\n"
            f"store.tokenize = wrapped; print('STORE', prepare.store_for({data!r}, 'byte'))")
    env = dict(os.environ, DILOCO_CACHE=str(tmp_path / "cache"), DILOCO_TOKENIZE_PAUSE_S="1.5")  # 2 parts: 3 s
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    assert sum(o.count("TOKENIZED") for o, _ in outs) == 1
    paths = {line.split(" ", 1)[1] for o, _ in outs for line in o.splitlines() if line.startswith("STORE ")}
    assert len(paths) == 1
    ref = store.tokenize(data, "byte", str(tmp_path / "ref"), workers=1, progress=False)
    assert store.read_manifest(paths.pop())["fingerprint"] == ref["fingerprint"]
