"""Data/vocab config strings → resolved sources, cheap validation and corpus info (no TensorFlow here)."""

from __future__ import annotations

import codecs
import dataclasses
import functools
import glob
import gzip
import hashlib
import json
import os
from pathlib import Path

from diloco.errors import ConfigError

SPECS = "stdlib | c4 | c4:<prepared tfds dir> | dolma | dolma:<jsonl glob> | jsonl:<glob> | text:<glob> | tokens:<token store>"
VOCABS = "byte | sentencepiece:<path to .model>"
SPLITS = ("train", "validation")
VAL_PER_MILLE = 20  # file/hash-split corpora: ~2% of documents go to "validation"
SHARD_BYTES = 1 << 20  # stdlib/text corpora: ~1 MiB of source text per shard


@dataclasses.dataclass(frozen=True)
class Spec:
    """A resolved data spec. kind: stdlib | tfds | jsonl | text."""

    data: str
    kind: str
    files: tuple[str, ...] = ()  # stdlib/text/jsonl: sorted absolute paths (all splits)
    root: str = ""  # stdlib: its directory; tfds: the prepared version directory

    @property
    def key(self) -> str:
        """Stable short hash of what was resolved (used in task names and cache keys)."""
        blob = json.dumps([self.kind, self.root, self.files])
        return hashlib.sha256(blob.encode()).hexdigest()[:10]


def file_split(spec: Spec, split: str) -> list[str]:
    """stdlib/text: files of one split; ~2% validation chosen by a hash of the path relative to the root."""
    root = spec.root or os.path.commonpath([os.path.dirname(f) for f in spec.files])
    per_mille = (int(hashlib.md5(os.path.relpath(f, root).encode()).hexdigest()[:8], 16) % 1000 for f in spec.files)
    return [f for f, m in zip(spec.files, per_mille) if (m < VAL_PER_MILLE) == (split == "validation")]


def num_shards(spec: Spec, split: str) -> int:
    """How many shards (units of shuffling, caching and resume) a split has."""
    if spec.kind == "tfds":
        return len(tfds_split_info(spec.root)[split])
    if spec.kind == "jsonl":
        return len(spec.files)
    files = file_split(spec, split)
    size = sum(os.path.getsize(f) for f in files)
    return max(1, min(len(files), -(-size // SHARD_BYTES)))


def stdlib_files() -> tuple[str, tuple[str, ...]]:
    """The `stdlib` corpus: the shipped snapshot (data/snapshot.py), unpacked once into the cache; not this
    interpreter's own standard library, which differs per Python build."""
    from diloco.data import snapshot

    root = snapshot.root(cache_dir())
    return str(root), snapshot.python_files(root)


def _glob(field: str, pattern: str) -> tuple[str, ...]:
    pattern = os.path.expanduser(pattern)
    files = tuple(sorted(f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f)))
    if not files:
        exists = "exists but is not a file" if os.path.exists(pattern) else "matches no file"
        raise ConfigError(field, f"{pattern!r} {exists}; give a file path or glob such as 'jsonl:/data/*.jsonl.gz'")
    return files


def _tfds_root(name: str, path: str) -> str | None:
    """A prepared TFDS version dir (holding dataset_info.json) for `name` at or under `path` (local or gs://…)."""
    from diloco.rundir import require

    p = require(os.path.expanduser(path), "data_dir")
    if (p / "dataset_info.json").is_file():
        return str(p)
    found = sorted(p.glob(f"{name}/*/dataset_info.json")) + sorted(p.glob(f"{name}/*/*/dataset_info.json"))
    if len(found) > 1:  # e.g. c4/en/3.0.1 beside 3.1.0, or c4/realnewslike: never pick one silently
        dirs = ", ".join(os.fspath(f.parent) for f in found)
        raise ConfigError("data", f"{len(found)} prepared {name} copies under {path!r} ({dirs}); choose one with "
                          f"data={name}:<one of them> (C4: c4/en 3.0.1 is the public prepared copy, 3.1.0 the newer build)")
    return str(found[0].parent) if found else None


def tfds_split_info(root: str) -> dict[str, list[int]]:
    """{split: shard lengths} read from dataset_info.json."""
    from diloco.rundir import path as epath_of

    info = json.loads((epath_of(root) / "dataset_info.json").read_text())
    return {s["name"]: [int(n) for n in s.get("shardLengths", [])] for s in info.get("splits", [])}


def default_tfds_dir() -> str:
    return os.environ.get("TFDS_DATA_DIR", os.path.expanduser("~/tensorflow_datasets"))


def parse_data(data: str, data_dir: str | None = None) -> Spec:
    """Resolve a data spec; raises ConfigError naming 'data' or 'data_dir'."""
    if not isinstance(data, str) or not data.strip():
        raise ConfigError("data", f"empty data spec {data!r}; valid: {SPECS}")
    kind, _, arg = data.strip().partition(":")
    if kind == "stdlib" and not arg:
        root, files = stdlib_files()
        if not files:
            raise ConfigError("data", f"no *.py files under the standard library at {root}")
        return Spec(data, "stdlib", files, root)
    if kind in ("c4", "dolma") and not arg:
        d = data_dir or default_tfds_dir()
        root = _tfds_root(kind, d)
        if root is None:
            build = "tfds build c4/en --data_dir=" + d if kind == "c4" else "tfds build <your dolma builder> --data_dir=" + d
            hint = f"prepare it with `{build}`" + (", or use 'dolma:<glob of .jsonl/.jsonl.gz files>'" if kind == "dolma" else "")
            raise ConfigError("data_dir", f"no prepared TFDS '{kind}' dataset under {d!r} (looked for {kind}/<config>/<version>/dataset_info.json); {hint}")
        return Spec(data, "tfds", (), root)
    if kind == "c4":
        root = _tfds_root("c4", arg)
        if root is None:
            raise ConfigError("data", f"{arg!r} is not a prepared TFDS directory (no dataset_info.json at it or in one c4/<config>/<version> under it); build one with `tfds build c4/en --data_dir=<dir>`")
        return Spec(data, "tfds", (), root)
    if kind in ("dolma", "jsonl") and arg:
        return Spec(data, "jsonl", _glob("data", arg))
    if kind == "text" and arg:
        return Spec(data, "text", _glob("data", arg))
    raise ConfigError("data", f"unknown data spec {data!r}; valid: {SPECS}")


def parse_vocab(vocab: str) -> tuple[str, str]:
    """('byte', '') or ('sentencepiece', path); raises ConfigError('vocab', …)."""
    kind, _, arg = (vocab or "byte").partition(":")
    if kind == "byte" and not arg:
        return "byte", ""
    if kind == "sentencepiece" and arg:
        from diloco.rundir import require

        p = require(os.path.expanduser(arg), "vocab")  # local or gs://… (read by seqio through tf.io.gfile)
        if not p.is_file():
            raise ConfigError("vocab", f"sentencepiece model {os.fspath(p)!r} not found; give an existing .model file, e.g. 'sentencepiece:/path/to/sentencepiece.model'")
        if "://" not in os.fspath(p):
            check_sentencepiece(os.fspath(p), os.path.getmtime(p))
        return "sentencepiece", os.fspath(p)
    raise ConfigError("vocab", f"unknown vocab {vocab!r}; valid: {VOCABS}")


@functools.lru_cache(maxsize=8)
def check_sentencepiece(path: str, mtime: float) -> None:
    """ConfigError('vocab') when the file at `path` does not load as a SentencePiece model (once per file version)."""
    import sentencepiece

    try:
        sentencepiece.SentencePieceProcessor(model_file=path)
    except (RuntimeError, OSError) as e:
        raise ConfigError("vocab", f"{path!r} is not a SentencePiece model ({str(e).splitlines()[0][:80]}); give the "
                          ".model file that spm_train wrote") from None


def _first_line(path: str) -> bytes:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        for line in f:
            if line.strip():
                return line
    return b""


def _check_utf8(path: str) -> None:
    dec = codecs.getincrementaldecoder("utf-8")()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                dec.decode(chunk)
        dec.decode(b"", final=True)
    except UnicodeDecodeError as e:
        raise ConfigError("data", f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); convert it with `iconv -t utf-8` or exclude it from the glob") from None


def cache_dir() -> Path | None:
    """$DILOCO_CACHE (default ~/.cache/diloco); 'none' disables the on-disk token cache. A remote URL
    (gs://…) is refused: the cache is this machine's disk (a token store may live on gs://)."""
    d = os.environ.get("DILOCO_CACHE", "~/.cache/diloco")
    if "://" in d:
        raise ConfigError("DILOCO_CACHE", f"{d!r} is a remote URL; the token cache must be a local folder (unset "
                          "DILOCO_CACHE for ~/.cache/diloco). Put a corpus on gs:// as a token store: "
                          "`diloco data tokenize --out gs://…`, then --config.data=tokens:gs://…")
    return None if d.lower() in ("", "none", "off", "0") else Path(os.path.expanduser(d))


def store_path(data) -> str | None:
    """The token store of a 'tokens:<path>' spec (local or gs://…), else None."""
    if isinstance(data, str) and data.strip().startswith("tokens:"):
        path = data.strip()[len("tokens:"):]
        if not path:
            raise ConfigError("data", "'tokens:' needs a store path, e.g. 'tokens:gs://bucket/c4-t5' (made by `diloco data tokenize`)")
        return path
    return None


def validate_data(data: str, vocab: str, data_dir: str | None, seq_len: int, split: str = "train") -> None:
    """Cheap checks before anything is built; raises ConfigError(field, message)."""
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 2:
        raise ConfigError("seq_len", f"seq_len={seq_len!r} must be an int >= 2")
    parse_vocab(vocab)
    if store_path(data) is not None:
        raise ConfigError("data", f"{data!r} is a token store: check it with diloco.data.store.check_store")
    spec = parse_data(data, data_dir)
    if spec.kind == "tfds":
        splits = tfds_split_info(spec.root)
        if split not in splits:
            raise ConfigError("data", f"split {split!r} not in TFDS dataset at {spec.root}; it has {sorted(splits)}")
        if sum(splits[split]) == 0:
            raise ConfigError("data", f"split {split!r} of the TFDS dataset at {spec.root} is empty")
        return
    if split not in SPLITS:
        raise ConfigError("data", f"split {split!r} unknown for {spec.kind} data; valid: {SPLITS}")
    if spec.kind == "jsonl":
        nonempty = 0
        for f in spec.files:
            line = _first_line(f)
            if not line:
                continue
            nonempty += 1
            try:
                doc = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ConfigError("data", f"{f}: first line is not JSON ({e}); jsonl files need one JSON object per line") from None
            if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
                keys = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
                raise ConfigError("data", f"{f}: records need a string 'text' field (first record has {keys}); use text:<glob> for plain text files")
        if not nonempty:
            raise ConfigError("data", f"empty corpus: all {len(spec.files)} file(s) matched by {data!r} are empty")
        return
    if spec.kind == "text":
        for f in spec.files:
            _check_utf8(f)
        if not any(os.path.getsize(f) for f in spec.files):
            raise ConfigError("data", f"empty corpus: all {len(spec.files)} file(s) matched by {data!r} are empty")
    if not any(os.path.getsize(f) for f in file_split(spec, split)):
        raise ConfigError("data", f"the {split!r} split of {data!r} is empty (~{VAL_PER_MILLE / 10:g}% of files, by a hash of their path, go to validation); add more files")


def corpus_info(data: str, data_dir: str | None = None) -> dict:
    """Facts about the corpus for the run summary (no TensorFlow needed)."""
    spec = parse_data(data, data_dir)
    info: dict = {"data": data, "kind": spec.kind}
    if spec.kind == "tfds":
        from diloco.rundir import path as epath_of

        meta = json.loads((epath_of(spec.root) / "dataset_info.json").read_text())
        info |= {"tfds_dir": spec.root, "tfds_name": meta.get("name"), "tfds_config": meta.get("configName"), "tfds_version": meta.get("version"),
                 "examples": {s: sum(v) for s, v in tfds_split_info(spec.root).items()},
                 "shards": {s: len(v) for s, v in tfds_split_info(spec.root).items()}}
        return info
    info |= {"files": len(spec.files), "bytes": sum(os.path.getsize(f) for f in spec.files)}
    if spec.kind == "jsonl":
        info["split_rule"] = f"validation = documents with farmhash(text) % 1000 < {VAL_PER_MILLE}"
    else:
        info |= {"split_rule": f"validation = files with md5(relative path) % 1000 < {VAL_PER_MILLE}",
                 "validation_files": len(file_split(spec, "validation"))}
    if spec.kind == "stdlib":
        from diloco.data import snapshot

        info |= {"snapshot": snapshot.NAME, "snapshot_sha256": snapshot.SHA256, "license": "PSF-2.0",
                 "excluded_dirs": sorted(snapshot.SKIP_DIRS)}
    return info
