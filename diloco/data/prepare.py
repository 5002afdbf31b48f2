"""Every data spec is read through a token store: the store a spec names, made in the local cache on first use.

    data=tokens:<store>                            that store (local or gs://), made by `diloco data tokenize`
    data=stdlib | jsonl:<glob> | text:<glob> | dolma:<glob>   (also written tokens:<one of these>)
    data=c4 | c4:<dir> | dolma                     a prepared TFDS dataset
        → $DILOCO_CACHE/stores/<kind>-<key>, tokenized there on first use by one process at a time: a lock
          file beside it (flock) makes the other processes of this machine wait and then read it. key: the
          corpus's identity (diloco.data.store.source_identity of both splits, plus the files' mtimes for
          local files, so an edited file makes a new store) and the vocabulary's sha256.

A TFDS corpus is tokenized here only in a single-process run and only when it is small (at most
AUTO_TFDS_MAX_DOCS documents in train + validation, e.g. the C4 sample); a large one, or any TFDS corpus in a multi-process run
whose store is not already in the cache, is refused before anything compiles, naming `diloco data tokenize`
(nothing is tokenized on a TPU host). DILOCO_CACHE=none with a corpus spec is refused the same way.
"""

from __future__ import annotations

import os
from pathlib import Path

from diloco.data import specs, store
from diloco.errors import ConfigError

AUTO_KINDS = ("jsonl", "text", "dolma")  # tokens:<kind>:<glob> (and tokens:stdlib) name a corpus, not a folder
AUTO_TFDS_MAX_DOCS = 100_000  # ≈ 40 M T5 tokens of C4-sized documents, minutes on one core


def corpus_of(data) -> str | None:
    """The corpus spec a run's store is prepared from ('stdlib', 'c4', 'jsonl:…', also 'tokens:stdlib',
    'tokens:jsonl:…'), or None for tokens:<path of a store>. A folder literally named stdlib is tokens:./stdlib."""
    path = specs.store_path(data)
    if path is None:
        return data
    return path if path == "stdlib" or (":" in path and path.split(":", 1)[0] in AUTO_KINDS) else None


def cache_store(corpus: str, vocab: str, data_dir: str | None = None) -> Path:
    """Where the store of `corpus` tokenized with `vocab` is kept in $DILOCO_CACHE (it may not exist yet)."""
    root = specs.cache_dir()
    if root is None:
        raise ConfigError("data", f"data={corpus!r} is read through a token store prepared in $DILOCO_CACHE, which "
                          "DILOCO_CACHE=none turns off; unset DILOCO_CACHE (default ~/.cache/diloco) or set it to a "
                          "local folder, or `diloco data tokenize --out STORE` and --config.data=tokens:STORE")
    spec = specs.parse_data(corpus, data_dir)
    ident = [store.source_identity(spec, s) for s in specs.SPLITS if s in _splits(spec)]
    local = [] if spec.kind == "tfds" else [os.stat(f).st_mtime_ns for f in spec.files]
    key = store.digest([store.FORMAT, store.VERSION, ident, store.vocab_identity(vocab), local])[:16]
    return root / "stores" / f"{spec.kind}-{key}"


def _splits(spec: specs.Spec) -> tuple[str, ...]:
    """The splits a store of spec holds: train and validation, less those that cannot exist (not in the TFDS
    dataset; no file of a stdlib/text corpus hashed into it: a few-file corpus can still be read for training)."""
    if spec.kind == "tfds":
        return tuple(s for s in specs.SPLITS if s in specs.tfds_split_info(spec.root))
    if spec.kind == "jsonl":
        return specs.SPLITS
    return tuple(s for s in specs.SPLITS if any(os.path.getsize(f) for f in specs.file_split(spec, s)))


def self_preparable(corpus: str) -> bool:
    """The rule for a multi-process run (and every pod, whose TPU hosts start with an empty cache): each process may
    tokenize the store of `corpus` itself (the embedded corpus, JSONL/text files: every host makes the same store
    from the same files) unless it is a TFDS corpus (c4, c4:<dir>, dolma), which only a single-process run tokenizes,
    and only when small. From the spec alone (no I/O): the launch preflight applies it before anything is billed."""
    kind, _, arg = corpus.strip().partition(":")
    return not (kind == "c4" or kind == "dolma" and not arg)


def tokenize_first(corpus: str, vocab: str, data_dir: str | None, why: str, then: str = "run with --config.data") -> ConfigError:
    """The one line refusing a corpus whose store must be made first: the `diloco data tokenize` command and the flag."""
    name = corpus.split(":", 1)[0]
    src = corpus + (f" --data_dir {data_dir}" if data_dir and ":" not in corpus else "")
    return ConfigError("data", f"data={corpus!r} has no token store yet and {why}; tokenize it once on a CPU "
                       f"machine (every core): `diloco data tokenize --data {src} --vocab {vocab} --out "
                       f"gs://BUCKET/stores/{name}`, then {then}=tokens:gs://BUCKET/stores/{name} (docs/data.md)")


def check_preparable(corpus: str, vocab: str, data_dir: str | None = None, explicit: bool = False) -> Path:
    """The cache store of `corpus`; a ConfigError when it is not there and may not be made here (a TFDS corpus
    in a multi-process run, or one with more than AUTO_TFDS_MAX_DOCS documents, unless `explicit`)."""
    out = cache_store(corpus, vocab, data_dir)
    spec = specs.parse_data(corpus, data_dir)
    if self_preparable(corpus) or explicit or (out / store.MANIFEST).is_file():
        return out
    from diloco import distributed

    docs = sum(sum(v) for v in specs.tfds_split_info(spec.root).values())
    procs = distributed.num_processes()
    if procs > 1 or docs > AUTO_TFDS_MAX_DOCS:
        why = (f"a {procs}-process run does not tokenize a TFDS corpus on its hosts" if procs > 1 else
               f"it has {docs:,} documents, more than the {AUTO_TFDS_MAX_DOCS:,} a run tokenizes itself")
        raise tokenize_first(corpus, vocab, data_dir, why)
    return out


def store_for(data: str, vocab: str, data_dir: str | None = None, workers: int = 1, explicit: bool = False) -> str:
    """The token store a run of `data` reads: tokens:<path> itself, else the cache store of the corpus,
    tokenized on first use (one process of this machine at a time; the others wait on the lock and read it)."""
    corpus = corpus_of(data)
    if corpus is None:
        return specs.store_path(data)
    out = check_preparable(corpus, vocab, data_dir, explicit)
    if (out / store.MANIFEST).is_file():
        return str(out)
    import fcntl

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or by the kernel if this process dies
        if not (out / store.MANIFEST).is_file():  # not made by the process that held the lock before
            spec = specs.parse_data(corpus, data_dir)
            store.tokenize(corpus, vocab, str(out), data_dir, splits=_splits(spec), workers=workers,
                           progress=spec.kind == "tfds" or explicit)
    return str(out)


def validate_data(data: str, vocab: str, data_dir: str | None, seq_len: int, split: str = "train") -> None:
    """Cheap checks before anything is built: the corpus spec's (specs.validate_data) and whether its store
    can be had here (check_preparable); for tokens:<store>, its manifest against vocab and seq_len."""
    corpus = corpus_of(data)
    if corpus is not None:
        specs.validate_data(corpus, vocab, data_dir, seq_len, split)
        check_preparable(corpus, vocab, data_dir)
        return
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 2:
        raise ConfigError("seq_len", f"seq_len={seq_len!r} must be an int >= 2")
    store.check_store(specs.store_path(data), vocab, seq_len, splits=(split,))


def corpus_info(data: str, data_dir: str | None = None) -> dict:
    """specs.corpus_info of the corpus, or a token store's identity (fingerprint, vocabulary, sources, counts)."""
    corpus = corpus_of(data)
    if corpus is not None:
        return {**specs.corpus_info(corpus, data_dir), "data": data}
    man = store.read_manifest(specs.store_path(data))
    return {"data": data, "kind": "tokens", "store_fingerprint": man["fingerprint"], "vocab": man["vocab"],
            "splits": {k: {"source": v["source"], "tokens": v["tokens"], "docs": v["docs"]} for k, v in man["splits"].items()}}
