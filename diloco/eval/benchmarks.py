"""The multiple-choice benchmarks, one `Benchmark` record each, and loading their documents.

A record holds everything known about one benchmark: lm-eval's default prompt, which split lm-eval
scores, where the original files may lie and how to read them, the TFDS name and how to map a TFDS
example, the checks a document must pass, and how to obtain the data. The `BENCHMARKS` table at the
end of the per-benchmark sections lists them; nothing else in the package branches on a benchmark's
name.

Words: a *benchmark* is one of these records (HellaSwag, PIQA, ARC). lm-eval calls the same thing a
"task", so the CLI flag (`--tasks`), the config key (`downstream.tasks`), the `task` field of scored
rows and lm-eval's `<name>_local` tasks keep that word; a *seqio task* (diloco/data) is unrelated.

Every reader yields documents in the *Hugging Face schema lm-eval's task YAMLs expect*, so the same
documents can be scored natively (`Item`) or handed to lm-eval as a local task (lm_adapter.py).
Prompts follow lm-eval 0.4 `hellaswag`, `piqa`, `arc_easy`, `arc_challenge` (docs/eval.md):
context = doc_to_text, continuation = " " + choice (target_delimiter " "), gold = doc_to_target.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import re
from pathlib import Path
from typing import Any, Callable

ENV_DATA = "DILOCO_EVAL_DATA"

Prompt = Callable[[dict], tuple[str, list[str], int]]  # doc -> (query, choices, gold index)
Check = Callable[[dict], None]  # raises KeyError / TypeError / ValueError on a doc lm-eval would mis-score
Reader = Callable[[tuple[Path, ...], list[str]], list[tuple[str, dict]]]  # files, errors -> [(where, doc)]
FromTfds = Callable[[dict, int, Any], dict]  # (numpy example, index, builder.info) -> doc


class MalformedItem(ValueError):
    """A data file has items that cannot be scored; the message lists file:line for each."""


class DataNotFound(FileNotFoundError):
    """No copy of a benchmark's data under data_dir; the message says where we looked and how to get it."""


@dataclasses.dataclass(frozen=True)
class Item:
    benchmark: str
    id: str
    query: str  # lm-eval doc_to_text (the context, without few-shot examples)
    choices: tuple[str, ...]  # lm-eval doc_to_choice (continuations without the delimiter)
    label: int  # lm-eval doc_to_target (index into choices)


@dataclasses.dataclass(frozen=True)
class Benchmark:
    name: str
    prompt: Prompt
    check: Check
    read: Reader  # the original files of one split (a group from `originals`)
    from_tfds: FromTfds
    eval_split: str  # the split lm-eval scores (test if the YAML has one, else validation)
    lm_eval_yaml: str  # path of lm-eval's default YAML, relative to lm_eval/tasks
    originals: dict[str, list[tuple[str, ...]]]  # split -> candidate file groups under data_dir
    tfds_name: str
    how_to_get: str  # DATA stands for the data directory


# ---------------------------------------------------------------- shared helpers

def _jsonl(path: Path, errors: list[str]) -> list[tuple[int, Any]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append((lineno, json.loads(line)))
            except json.JSONDecodeError as e:
                errors.append(f"{path}:{lineno}: not valid JSON ({e.msg})")
    return rows


def _need(obj: Any, key: str, typ: type | tuple[type, ...]) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise KeyError(f"missing field {key!r}")
    if not isinstance(obj[key], typ):
        raise TypeError(f"field {key!r} is {type(obj[key]).__name__}, expected "
                        f"{getattr(typ, '__name__', typ)}")
    return obj[key]


def _s(x: Any) -> str:
    return x.decode("utf-8") if isinstance(x, bytes) else str(x)


def _tfds_hint(name: str) -> str:
    return (f"prepare TFDS: python -c \"import tensorflow_datasets as tfds; "
            f"tfds.builder('{name}', data_dir='DATA').download_and_prepare()\"")


# ---------------------------------------------------------------- HellaSwag

def hellaswag_clean(text: str) -> str:
    """lm-eval hellaswag `preprocess`: strip, ' [title]' -> '. ', drop [..] tags, '  ' -> ' '."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _hellaswag_prompt(doc: dict) -> tuple[str, list[str], int]:
    ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    return (hellaswag_clean(doc["activity_label"] + ": " + ctx),
            [hellaswag_clean(e) for e in doc["endings"]], int(doc["label"]))


def _hellaswag_check(doc: dict) -> None:
    for k in ("activity_label", "ctx_a", "ctx_b"):
        _need(doc, k, str)
    endings = _need(doc, "endings", list)
    if len(endings) < 2 or not all(isinstance(e, str) for e in endings):
        raise ValueError("endings must be a list of >= 2 strings")
    label = _need(doc, "label", (int, str))
    if not re.fullmatch(r"\d+", str(label)) or int(label) >= len(endings):
        raise ValueError(f"label {label!r} is not an index into {len(endings)} endings")


def _hellaswag_read(files: tuple[Path, ...], errors: list[str]) -> list[tuple[str, dict]]:
    return [(f"{files[0]}:{lineno}", row) for lineno, row in _jsonl(files[0], errors)]


def _hellaswag_from_tfds(ex: dict, i: int, info: Any) -> dict:
    # TFDS keeps only ctx (= ctx_a + " " + ctx_b); lm-eval capitalises ctx_b, which we cannot
    # redo without the split point (docs/eval.md). ctx_b = "" is the closest faithful choice.
    return {"ind": i, "activity_label": _s(ex["activity_label"]), "ctx_a": _s(ex["context"]),
            "ctx_b": "", "endings": [_s(e) for e in ex["endings"]], "label": int(ex["label"])}


HELLASWAG = Benchmark(
    "hellaswag", _hellaswag_prompt, _hellaswag_check, _hellaswag_read, _hellaswag_from_tfds,
    "validation", "hellaswag/hellaswag.yaml",
    {"validation": [("hellaswag/hellaswag_val.jsonl",), ("hellaswag/hellaswag.jsonl",),
                    ("hellaswag_val.jsonl",)],
     "train": [("hellaswag/hellaswag_train.jsonl",), ("hellaswag_train.jsonl",)]},
    "hellaswag",
    "download hellaswag_val.jsonl (and hellaswag_train.jsonl for few-shot) from "
    "https://github.com/rowanz/hellaswag/tree/master/data to DATA/hellaswag/, or " + _tfds_hint("hellaswag"))


# ---------------------------------------------------------------- PIQA

def _piqa_prompt(doc: dict) -> tuple[str, list[str], int]:
    return f"Question: {doc['goal']}\nAnswer:", [doc["sol1"], doc["sol2"]], int(doc["label"])


def _piqa_check(doc: dict) -> None:
    for k in ("goal", "sol1", "sol2"):
        _need(doc, k, str)
    if doc.get("label") not in (0, 1):
        raise ValueError(f"label {doc.get('label')!r} is not 0 or 1")


def _piqa_read(files: tuple[Path, ...], errors: list[str]) -> list[tuple[str, dict]]:
    """items.jsonl + labels.lst (one label a line) -> docs with the label inlined."""
    rows = _jsonl(files[0], errors)
    labels = [(n, s.strip()) for n, s in enumerate(files[1].read_text().splitlines(), 1) if s.strip()]
    if len(labels) != len(rows):
        errors.append(f"{files[1]}: {len(labels)} labels for {len(rows)} items in {files[0]}")
    out = []
    for (lineno, row), (lab_no, lab) in zip(rows, labels):
        if isinstance(row, dict):
            row = dict(row, label=int(lab) if lab in ("0", "1") else lab)
        out.append((f"{files[0]}:{lineno} (label {files[1].name}:{lab_no})", row))
    return out


def _piqa_from_tfds(ex: dict, i: int, info: Any) -> dict:
    return {"id": _s(ex["id"]), "goal": _s(ex["goal"]), "sol1": _s(ex["sol1"]),
            "sol2": _s(ex["sol2"]), "label": int(ex["label"])}


PIQA = Benchmark(
    "piqa", _piqa_prompt, _piqa_check, _piqa_read, _piqa_from_tfds, "validation", "piqa/piqa.yaml",
    {"validation": [("piqa/valid.jsonl", "piqa/valid-labels.lst"),
                    ("piqa/dev.jsonl", "piqa/dev-labels.lst"),
                    ("physicaliqa-train-dev/dev.jsonl", "physicaliqa-train-dev/dev-labels.lst")],
     "train": [("piqa/train.jsonl", "piqa/train-labels.lst"),
               ("physicaliqa-train-dev/train.jsonl", "physicaliqa-train-dev/train-labels.lst")]},
    "piqa",
    "download valid.jsonl + valid-labels.lst (and train.jsonl + train-labels.lst for few-shot) "
    "from https://yonatanbisk.com/piqa/ (github.com/ybisk/ybisk.github.io/tree/master/piqa/data) "
    "to DATA/piqa/, or " + _tfds_hint("piqa"))


# ---------------------------------------------------------------- ARC (Easy and Challenge)

_ARC_URL = "https://ai2-public-datasets.s3-us-west-2.amazonaws.com/arc/ARC-V1-Feb2018.zip"


def _arc_prompt(doc: dict) -> tuple[str, list[str], int]:
    labels = list(doc["choices"]["label"])
    return (f"Question: {doc['question']}\nAnswer:", list(doc["choices"]["text"]),
            labels.index(doc["answerKey"]))


def _arc_check(doc: dict) -> None:
    _need(doc, "question", str)
    ch = _need(doc, "choices", dict)
    texts, labels = ch.get("text"), ch.get("label")
    if not isinstance(texts, list) or not isinstance(labels, list) or len(texts) != len(labels) \
            or len(texts) < 2:
        raise ValueError("choices must have equal-length text and label lists (>= 2)")
    key = _need(doc, "answerKey", str)
    if key not in labels:
        raise ValueError(f"answerKey {key!r} is not one of the choice labels {labels}")


def _arc_read(files: tuple[Path, ...], errors: list[str]) -> list[tuple[str, dict]]:
    """AI2 schema {id, question: {stem, choices: [{text, label}]}, answerKey} -> HF ai2_arc schema."""
    out = []
    for lineno, row in _jsonl(files[0], errors):
        where = f"{files[0]}:{lineno}"
        try:
            q = _need(row, "question", dict)
            choices = _need(q, "choices", list)
            doc = {"id": str(row.get("id", lineno)), "question": _need(q, "stem", str),
                   "choices": {"text": [c["text"] for c in choices],
                               "label": [str(c["label"]) for c in choices]},
                   "answerKey": str(_need(row, "answerKey", (str, int)))}
        except (KeyError, TypeError) as e:
            errors.append(f"{where}: {e.args[0] if e.args else e}")
            continue
        out.append((where, doc))
    return out


def _arc_from_tfds(ex: dict, i: int, info: Any) -> dict:
    names = info.features["answerKey"].names
    return {"id": _s(ex["id"]), "question": _s(ex["question"]),
            "choices": {"text": [_s(t) for t in ex["choices"]["text"]],
                        "label": [names[int(j)] for j in ex["choices"]["label"]]},
            "answerKey": names[int(ex["answerKey"])]}


def _arc(name: str, cfg: str) -> Benchmark:
    def files(split: str) -> list[tuple[str, ...]]:
        f = f"{cfg}-{split}.jsonl"
        return [(f"arc/{f}",), (f"{cfg}/{f}",), (f"ARC-V1-Feb2018-2/{cfg}/{f}",), (f,)]

    return Benchmark(
        name, _arc_prompt, _arc_check, _arc_read, _arc_from_tfds, "test", f"arc/{name}.yaml",
        {"test": files("Test"), "validation": files("Dev"), "train": files("Train")},
        f"ai2_arc/{cfg}",
        f"unzip {_ARC_URL} and copy {cfg}/{cfg}-Test.jsonl (and -Train.jsonl for few-shot) to "
        f"DATA/arc/, or " + _tfds_hint(f"ai2_arc/{cfg}"))


ARC_EASY = _arc("arc_easy", "ARC-Easy")
ARC_CHALLENGE = _arc("arc_challenge", "ARC-Challenge")

BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (HELLASWAG, PIQA, ARC_EASY, ARC_CHALLENGE)}


def parse_benchmarks(names: str | list[str]) -> list[str]:
    """'piqa,arc_easy' or a list -> names, each a key of BENCHMARKS (ValueError otherwise)."""
    out = [t.strip() for t in (names.split(",") if isinstance(names, str) else names) if t.strip()]
    bad = [t for t in out if t not in BENCHMARKS]
    if bad or not out:
        raise ValueError(f"unknown task(s) {bad or out}; valid: {', '.join(BENCHMARKS)}")
    return out


def check_downstream(d, check_data: bool = True) -> None:
    """A run's `downstream` config (tasks, data_dir), before training (the evaluation runs late): a
    ConfigError naming the field on an unknown task, missing or malformed data."""
    from diloco.errors import ConfigError

    if not d.tasks:
        return
    try:
        names = parse_benchmarks(d.tasks)
    except ValueError as e:
        raise ConfigError("downstream.tasks", str(e)) from None
    for name in names if check_data else ():
        try:
            load_docs(name, d.data_dir or None)
        except (DataNotFound, MalformedItem) as e:
            raise ConfigError("downstream.data_dir", str(e)) from None


# ---------------------------------------------------------------- locating and loading

def _tfds_dir(data_dir: Path, name: str) -> Path | None:
    root = data_dir / name
    if not root.is_dir():
        return None
    versions = sorted((p for p in root.iterdir() if (p / "dataset_info.json").exists()),
                      key=lambda p: tuple(int(x) for x in p.name.split(".") if x.isdigit()))
    return versions[-1] if versions else None


def _read_tfds(bench: Benchmark, path: Path, split: str) -> list[tuple[str, dict]]:
    import tensorflow_datasets as tfds  # lazy: slow import

    builder = tfds.builder_from_directory(str(path))
    if split not in builder.info.splits:
        raise DataNotFound(f"{bench.name}: TFDS dataset {path} has no split {split!r} "
                           f"(has {', '.join(builder.info.splits)})")
    return [(f"{path}[{split}] example {i}", bench.from_tfds(ex, i, builder.info))
            for i, ex in enumerate(tfds.as_numpy(builder.as_dataset(split=split, shuffle_files=False)))]


def resolve_data_dir(data_dir: str | os.PathLike | None) -> Path:
    d = data_dir or os.environ.get(ENV_DATA)
    if not d:
        raise DataNotFound(f"no evaluation data directory: pass --data_dir PATH or set ${ENV_DATA} "
                           f"(layout: docs/eval.md)")
    return Path(d).expanduser()


def locate(name: str, data_dir: Path, split: str) -> tuple[str, Any]:
    """('original', files) or ('tfds', dir); DataNotFound says what was tried and how to get it."""
    bench = BENCHMARKS[name]
    looked = []
    for group in bench.originals.get(split, []):
        paths = tuple(data_dir / p for p in group)
        if all(p.is_file() for p in paths):
            return "original", paths
        looked.append(" + ".join(str(p) for p in paths))
    tdir = _tfds_dir(data_dir, bench.tfds_name)
    if tdir is not None:
        return "tfds", tdir
    looked.append(f"{data_dir / bench.tfds_name}/<version>/ (TFDS)")
    raise DataNotFound(
        f"{name} ({split} split): no data under {data_dir}; looked for " + "; ".join(looked)
        + f". To obtain it: {bench.how_to_get.replace('DATA', str(data_dir))}")


def load_docs(name: str, data_dir: str | os.PathLike | None, split: str | None = None
              ) -> list[tuple[str, dict]]:
    """[(where, HF-schema doc)] of one split (default: the split lm-eval scores), all validated.

    Raises MalformedItem listing every bad item as file:line, DataNotFound if absent.
    """
    bench = BENCHMARKS[name]
    split = split or bench.eval_split
    kind, where = locate(name, resolve_data_dir(data_dir), split)
    errors: list[str] = []
    rows = bench.read(where, errors) if kind == "original" else _read_tfds(bench, where, split)
    docs = []
    for loc, doc in rows:
        try:
            bench.check(doc)
        except (KeyError, TypeError, ValueError) as e:
            errors.append(f"{loc}: {e.args[0] if e.args else e}")
            continue
        docs.append((loc, doc))
    if errors:
        shown = "\n  ".join(errors[:20])
        more = f"\n  … and {len(errors) - 20} more" if len(errors) > 20 else ""
        raise MalformedItem(f"{name}: {len(errors)} malformed item(s):\n  {shown}{more}")
    return docs


def to_item(name: str, doc: dict, index: int) -> Item:
    query, choices, label = BENCHMARKS[name].prompt(doc)
    return Item(name, str(doc.get("id", doc.get("ind", index))), query, tuple(choices), label)


def load_items(name: str, data_dir: str | os.PathLike | None, limit: int | None = None) -> list[Item]:
    return [to_item(name, doc, i) for i, (_, doc) in enumerate(load_docs(name, data_dir)[:limit])]


def fewshot_contexts(name: str, items: list[Item], data_dir: str | os.PathLike | None,
                     num_fewshot: int, seed: int) -> list[str]:
    """The context of every item, with k examples drawn from the train split as lm-eval does.

    One random.Random(seed) draws k training docs per evaluated item, in item order
    (lm-eval's default sampler; its CLI's default --fewshot seed is 1234). Examples are
    "query answer" joined by a blank line, before the item's query.
    """
    if num_fewshot <= 0:
        return [it.query for it in items]
    pool = [to_item(name, d, i) for i, (_, d) in enumerate(load_docs(name, data_dir, "train"))]
    rnd = random.Random(seed)
    out = []
    for it in items:
        shots = rnd.sample(pool, num_fewshot)
        prefix = "".join(f"{s.query} {s.choices[s.label]}\n\n" for s in shots)
        out.append(prefix + it.query)
    return out
