"""seqio vocabularies, Tasks and per-shard tokenization (TensorFlow/seqio are imported lazily, here only)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
from collections.abc import Iterator

import numpy as np

from diloco.data import specs


@functools.cache
def _tf():
    from diloco.noise import native_stderr_captured, quiet_environment

    quiet_environment()
    with native_stderr_captured():  # TensorFlow's native start-up lines ignore TF_CPP_MIN_LOG_LEVEL
        import seqio  # noqa: F401  (imports TensorFlow, TFDS)
        import tensorflow as tf

    tf.config.set_visible_devices([], "GPU")  # the data pipeline must never take accelerator memory from JAX
    return tf


@functools.cache
def get_vocabulary(spec: str = "byte"):
    """'byte' → seqio.ByteVocabulary (259 ids); 'sentencepiece:<path>' → seqio.SentencePieceVocabulary."""
    kind, path = specs.parse_vocab(spec)
    _tf()
    import seqio

    return seqio.ByteVocabulary() if kind == "byte" else seqio.SentencePieceVocabulary(path)


def vocab_fingerprint(spec: str) -> str:
    kind, path = specs.parse_vocab(spec)
    if kind == "byte":
        return "byte"
    from diloco.rundir import path as epath_of

    return "sp-" + hashlib.sha256(epath_of(path).read_bytes()).hexdigest()[:10]


def _read_whole_file(path):
    tf = _tf()
    return tf.data.Dataset.from_tensors({"text": tf.io.read_file(path)})


def _read_jsonl(path):
    tf = _tf()

    def parse(line):
        try:
            text = json.loads(line.numpy()).get("text")
        except (ValueError, AttributeError):
            text = None
        return text if isinstance(text, str) else ""

    gz = tf.where(tf.strings.regex_full_match(path, r".*\.gz"), "GZIP", "")
    lines = tf.data.TextLineDataset(path, compression_type=gz)
    lines = lines.filter(lambda s: tf.strings.length(tf.strings.strip(s)) > 0)
    texts = lines.map(lambda s: tf.ensure_shape(tf.py_function(parse, [s], tf.string), []))
    return texts.filter(lambda t: tf.strings.length(t) > 0).map(lambda t: {"text": t})


def _hash_split_source(files: list[str]):
    """A seqio.FileDataSource over JSONL files whose 'validation' split is ~2% of documents by farmhash(text)."""
    tf = _tf()
    import seqio

    class HashSplitSource(seqio.FileDataSource):
        def get_dataset(self, split="train", shuffle=True, seed=None, shard_info=None, **kw):
            ds = super().get_dataset(split=split, shuffle=shuffle, seed=seed, shard_info=shard_info, **kw)
            want_val = split == "validation"
            return ds.filter(lambda x: (tf.strings.to_hash_bucket_fast(x["text"], 1000) < specs.VAL_PER_MILLE) == want_val)

    return HashSplitSource(_read_jsonl, {s: files for s in specs.SPLITS}, cycle_length=1)


_REGISTRY_LOCK = threading.Lock()  # prefetch threads and the main thread may register concurrently


def task_name(spec: specs.Spec, vocab: str) -> str:
    v = vocab_fingerprint(vocab).replace("-", "_")
    return f"diloco_stdlib_{v}" if spec.kind == "stdlib" else f"diloco_{spec.kind}_{spec.key}_{v}"


def get_task(spec: specs.Spec, vocab: str):
    """Register (once per process) and return the seqio Task for (data spec, vocab)."""
    tf = _tf()
    import seqio

    name = task_name(spec, vocab)
    with _REGISTRY_LOCK:
        if name in seqio.TaskRegistry.names():
            return seqio.TaskRegistry.get(name)
        if spec.kind == "tfds":  # prepared dirs only: never downloads
            source = seqio.TfdsDataSource(tfds_data_dir=spec.root, read_only=True)
        elif spec.kind == "jsonl":
            source = _hash_split_source(list(spec.files))
        else:  # stdlib / text: one document per file
            source = seqio.FileDataSource(_read_whole_file, {s: specs.file_split(spec, s) for s in specs.SPLITS},
                                          cycle_length=1)
        features = {"targets": seqio.Feature(get_vocabulary(vocab), add_eos=True, dtype=tf.int32)}
        prep = [functools.partial(seqio.preprocessors.rekey, key_map={"targets": "text"}),
                seqio.preprocessors.tokenize, seqio.preprocessors.append_eos]
        return seqio.TaskRegistry.add(name, source=source, output_features=features, preprocessors=prep,
                                      shuffle_buffer_size=None)


_NO_ENDS = np.zeros(0, np.int64)
CHUNK_BYTES = 1 << 20  # byte-vocab files are read in blocks of this many bytes (= tokens)
BATCH_DOCS = 256  # seqio path: documents per chunk (a C4 document is ~480 T5 tokens, the longest few ×10⁵)


def _byte_chunks(files: list[str]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """seqio.ByteVocabulary + append_eos on whole files, without TensorFlow: UTF-8 bytes + 3, then EOS (1);
    read CHUNK_BYTES at a time, so a file of any size is never held whole."""
    for f in files:
        with open(f, "rb") as fh:
            while block := fh.read(CHUNK_BYTES):
                yield np.frombuffer(block, np.uint8).astype(np.uint16) + 3, _NO_ENDS
        yield np.ones(1, np.uint16), np.ones(1, np.int64)


def shard_chunks(spec: specs.Spec, vocab: str, split: str, index: int, num: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Documents of one shard, in source order, as a stream of (tokens, ends): the shard's tokens are the
    concatenation of the chunks, each document followed by EOS; `ends` are the positions in this chunk just
    after a document's EOS. At most one chunk (≤ CHUNK_BYTES or BATCH_DOCS documents) is held at a time.

    Byte-vocab file corpora (stdlib, text:) skip TensorFlow (a cold TF import costs ~7-12 s on 2 cores);
    set DILOCO_SEQIO_ONLY=1 to force the seqio Task; tests check both give identical tokens.
    """
    if spec.kind in ("stdlib", "text") and vocab == "byte" and os.environ.get("DILOCO_SEQIO_ONLY") != "1":
        yield from _byte_chunks(specs.file_split(spec, split)[index::num])  # same files, order, ids as the seqio Task
        return
    import seqio

    task = get_task(spec, vocab)
    ds = task.get_dataset(sequence_length=None, split=split, shuffle=False, shard_info=seqio.ShardInfo(index, num),
                          num_epochs=1, trim_output_features=False, try_in_mem_cache=False)
    ds = ds.map(lambda x: x["targets"]).ragged_batch(BATCH_DOCS)
    from tqdm import tqdm

    desc = f"tokenizing {spec.data} {split} shard {index + 1}/{num}"
    for rb in tqdm(ds, desc=desc, unit=f" x{BATCH_DOCS} docs", delay=5, leave=False):
        yield rb.flat_values.numpy(), np.cumsum(rb.row_lengths().numpy()).astype(np.int64)


def tokenize_shard(spec: specs.Spec, vocab: str, split: str, index: int, num: int) -> tuple[np.ndarray, np.ndarray]:
    """One shard whole, as (tokens, offsets): doc i = tokens[offsets[i]:offsets[i+1]] (for tests and small shards;
    the store writes shard_chunks as they come)."""
    chunks, offsets, n = [], [np.zeros(1, np.int64)], 0
    for tokens, ends in shard_chunks(spec, vocab, split, index, num):
        chunks.append(tokens)
        offsets.append(n + ends)
        n += len(tokens)
    dtype = chunks[0].dtype if chunks else np.uint16
    return (np.concatenate(chunks) if chunks else np.zeros(0, dtype)), np.concatenate(offsets)
