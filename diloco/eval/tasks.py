"""Multiple-choice tasks: readers (original files or TFDS) and lm-eval's default prompts.

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


class MalformedItem(ValueError):
    """A data file has items that cannot be scored; the message lists file:line for each."""


class DataNotFound(FileNotFoundError):
    """No copy of a task's data under data_dir; the message says where we looked and how to get it."""


@dataclasses.dataclass(frozen=True)
class Item:
    task: str
    id: str
    query: str  # lm-eval doc_to_text (the context, without few-shot examples)
    choices: tuple[str, ...]  # lm-eval doc_to_choice (continuations without the delimiter)
    label: int  # lm-eval doc_to_target (index into choices)


# ---------------------------------------------------------------- lm-eval's default prompts

def hellaswag_clean(text: str) -> str:
    """lm-eval hellaswag `preprocess`: strip, ' [title]' -> '. ', drop [..] tags, '  ' -> ' '."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _hellaswag(doc: dict) -> tuple[str, list[str], int]:
    ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    return (hellaswag_clean(doc["activity_label"] + ": " + ctx),
            [hellaswag_clean(e) for e in doc["endings"]], int(doc["label"]))


def _piqa(doc: dict) -> tuple[str, list[str], int]:
    return f"Question: {doc['goal']}\nAnswer:", [doc["sol1"], doc["sol2"]], int(doc["label"])


def _arc(doc: dict) -> tuple[str, list[str], int]:
    labels = list(doc["choices"]["label"])
    return (f"Question: {doc['question']}\nAnswer:", list(doc["choices"]["text"]),
            labels.index(doc["answerKey"]))


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    name: str
    prompt: Callable[[dict], tuple[str, list[str], int]]
    eval_split: str  # the split lm-eval scores (test if the YAML has one, else validation)
    lm_eval_yaml: str  # path of lm-eval's default YAML, relative to lm_eval/tasks
    originals: dict[str, list[tuple[str, ...]]]  # split -> candidate file groups under data_dir
    tfds_name: str
    how_to_get: str


_ARC_URL = "https://ai2-public-datasets.s3-us-west-2.amazonaws.com/arc/ARC-V1-Feb2018.zip"


def _arc_files(cfg: str, split: str) -> list[tuple[str, ...]]:
    f = f"{cfg}-{split}.jsonl"
    return [(f"arc/{f}",), (f"{cfg}/{f}",), (f"ARC-V1-Feb2018-2/{cfg}/{f}",), (f,)]


def _arc_spec(name: str, cfg: str) -> TaskSpec:
    return TaskSpec(
        name, _arc, "test", f"arc/{name}.yaml",
        {"test": _arc_files(cfg, "Test"), "validation": _arc_files(cfg, "Dev"),
         "train": _arc_files(cfg, "Train")},
        f"ai2_arc/{cfg}",
        f"unzip {_ARC_URL} and copy {cfg}/{cfg}-Test.jsonl (and -Train.jsonl for few-shot) to "
        f"DATA/arc/, or prepare TFDS: python -c \"import tensorflow_datasets as tfds; "
        f"tfds.builder('ai2_arc/{cfg}', data_dir='DATA').download_and_prepare()\"")


TASKS: dict[str, TaskSpec] = {
    "hellaswag": TaskSpec(
        "hellaswag", _hellaswag, "validation", "hellaswag/hellaswag.yaml",
        {"validation": [("hellaswag/hellaswag_val.jsonl",), ("hellaswag/hellaswag.jsonl",),
                        ("hellaswag_val.jsonl",)],
         "train": [("hellaswag/hellaswag_train.jsonl",), ("hellaswag_train.jsonl",)]},
        "hellaswag",
        "download hellaswag_val.jsonl (and hellaswag_train.jsonl for few-shot) from "
        "https://github.com/rowanz/hellaswag/tree/master/data to DATA/hellaswag/, or prepare TFDS: "
        "python -c \"import tensorflow_datasets as tfds; "
        "tfds.builder('hellaswag', data_dir='DATA').download_and_prepare()\""),
    "piqa": TaskSpec(
        "piqa", _piqa, "validation", "piqa/piqa.yaml",
        {"validation": [("piqa/valid.jsonl", "piqa/valid-labels.lst"),
                        ("piqa/dev.jsonl", "piqa/dev-labels.lst"),
                        ("physicaliqa-train-dev/dev.jsonl", "physicaliqa-train-dev/dev-labels.lst")],
         "train": [("piqa/train.jsonl", "piqa/train-labels.lst"),
                   ("physicaliqa-train-dev/train.jsonl", "physicaliqa-train-dev/train-labels.lst")]},
        "piqa",
        "download valid.jsonl + valid-labels.lst (and train.jsonl + train-labels.lst for few-shot) "
        "from https://yonatanbisk.com/piqa/ (github.com/ybisk/ybisk.github.io/tree/master/piqa/data) "
        "to DATA/piqa/, or prepare TFDS: python -c \"import tensorflow_datasets as tfds; "
        "tfds.builder('piqa', data_dir='DATA').download_and_prepare()\""),
    "arc_easy": _arc_spec("arc_easy", "ARC-Easy"),
    "arc_challenge": _arc_spec("arc_challenge", "ARC-Challenge"),
}


def parse_tasks(tasks: str | list[str]) -> list[str]:
    names = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks) if t.strip()]
    bad = [t for t in names if t not in TASKS]
    if bad or not names:
        raise ValueError(f"unknown task(s) {bad or names}; valid: {', '.join(TASKS)}")
    return names


# ---------------------------------------------------------------- readers (original schemas)

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


def _need(obj: Any, key: str, typ: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise KeyError(f"missing field {key!r}")
    if not isinstance(obj[key], typ):
        raise TypeError(f"field {key!r} is {type(obj[key]).__name__}, expected "
                        f"{getattr(typ, '__name__', typ)}")
    return obj[key]


def _check(task: str, doc: dict) -> None:
    """Raise (KeyError/TypeError/ValueError) if lm-eval's prompt for this doc would fail or mis-score."""
    if task == "hellaswag":
        for k in ("activity_label", "ctx_a", "ctx_b"):
            _need(doc, k, str, task)
        endings = _need(doc, "endings", list, task)
        if len(endings) < 2 or not all(isinstance(e, str) for e in endings):
            raise ValueError("endings must be a list of >= 2 strings")
        label = _need(doc, "label", (int, str), task)
        if not re.fullmatch(r"\d+", str(label)) or int(label) >= len(endings):
            raise ValueError(f"label {label!r} is not an index into {len(endings)} endings")
    elif task == "piqa":
        for k in ("goal", "sol1", "sol2"):
            _need(doc, k, str, task)
        if doc.get("label") not in (0, 1):
            raise ValueError(f"label {doc.get('label')!r} is not 0 or 1")
    else:
        _need(doc, "question", str, task)
        ch = _need(doc, "choices", dict, task)
        texts, labels = ch.get("text"), ch.get("label")
        if not isinstance(texts, list) or not isinstance(labels, list) or len(texts) != len(labels) \
                or len(texts) < 2:
            raise ValueError("choices must have equal-length text and label lists (>= 2)")
        key = _need(doc, "answerKey", str, task)
        if key not in labels:
            raise ValueError(f"answerKey {key!r} is not one of the choice labels {labels}")


def _read_hellaswag(files: tuple[Path, ...], errors: list[str]) -> list[tuple[str, dict]]:
    out = []
    for lineno, row in _jsonl(files[0], errors):
        out.append((f"{files[0]}:{lineno}", row))
    return out


def _read_piqa(files: tuple[Path, ...], errors: list[str]) -> list[tuple[str, dict]]:
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


def _read_arc(files: tuple[Path, ...], errors: list[str]) -> list[tuple[str, dict]]:
    """AI2 schema {id, question: {stem, choices: [{text, label}]}, answerKey} -> HF ai2_arc schema."""
    out = []
    for lineno, row in _jsonl(files[0], errors):
        where = f"{files[0]}:{lineno}"
        try:
            q = _need(row, "question", dict, "arc")
            choices = _need(q, "choices", list, "arc")
            doc = {"id": str(row.get("id", lineno)), "question": _need(q, "stem", str, "arc"),
                   "choices": {"text": [c["text"] for c in choices],
                               "label": [str(c["label"]) for c in choices]},
                   "answerKey": str(_need(row, "answerKey", (str, int), "arc"))}
        except (KeyError, TypeError) as e:
            errors.append(f"{where}: {e.args[0] if e.args else e}")
            continue
        out.append((where, doc))
    return out


_READERS = {"hellaswag": _read_hellaswag, "piqa": _read_piqa, "arc_easy": _read_arc,
            "arc_challenge": _read_arc}


# ---------------------------------------------------------------- TFDS

def _tfds_dir(data_dir: Path, name: str) -> Path | None:
    root = data_dir / name
    if not root.is_dir():
        return None
    versions = sorted((p for p in root.iterdir() if (p / "dataset_info.json").exists()),
                      key=lambda p: tuple(int(x) for x in p.name.split(".") if x.isdigit()))
    return versions[-1] if versions else None


def _s(x: Any) -> str:
    return x.decode("utf-8") if isinstance(x, bytes) else str(x)


def _read_tfds(task: str, path: Path, split: str) -> list[tuple[str, dict]]:
    import tensorflow_datasets as tfds  # lazy: slow import

    builder = tfds.builder_from_directory(str(path))
    if split not in builder.info.splits:
        raise DataNotFound(f"{task}: TFDS dataset {path} has no split {split!r} "
                           f"(has {', '.join(builder.info.splits)})")
    out = []
    for i, ex in enumerate(tfds.as_numpy(builder.as_dataset(split=split, shuffle_files=False))):
        if task == "hellaswag":
            # TFDS keeps only ctx (= ctx_a + " " + ctx_b); lm-eval capitalises ctx_b, which we cannot
            # redo without the split point (docs/eval.md). ctx_b = "" is the closest faithful choice.
            doc = {"ind": i, "activity_label": _s(ex["activity_label"]), "ctx_a": _s(ex["context"]),
                   "ctx_b": "", "endings": [_s(e) for e in ex["endings"]], "label": int(ex["label"])}
        elif task == "piqa":
            doc = {"id": _s(ex["id"]), "goal": _s(ex["goal"]), "sol1": _s(ex["sol1"]),
                   "sol2": _s(ex["sol2"]), "label": int(ex["label"])}
        else:
            names = builder.info.features["answerKey"].names
            doc = {"id": _s(ex["id"]), "question": _s(ex["question"]),
                   "choices": {"text": [_s(t) for t in ex["choices"]["text"]],
                               "label": [names[int(j)] for j in ex["choices"]["label"]]},
                   "answerKey": names[int(ex["answerKey"])]}
        out.append((f"{path}[{split}] example {i}", doc))
    return out


# ---------------------------------------------------------------- loading

def resolve_data_dir(data_dir: str | os.PathLike | None) -> Path:
    d = data_dir or os.environ.get(ENV_DATA)
    if not d:
        raise DataNotFound(f"no evaluation data directory: pass --data_dir PATH or set ${ENV_DATA} "
                           f"(layout: docs/eval.md)")
    return Path(d).expanduser()


def locate(task: str, data_dir: Path, split: str) -> tuple[str, Any]:
    """('original', files) or ('tfds', dir); DataNotFound says what was tried and how to get it."""
    spec = TASKS[task]
    looked = []
    for group in spec.originals.get(split, []):
        paths = tuple(data_dir / p for p in group)
        if all(p.is_file() for p in paths):
            return "original", paths
        looked.append(" + ".join(str(p) for p in paths))
    tdir = _tfds_dir(data_dir, spec.tfds_name)
    if tdir is not None:
        return "tfds", tdir
    looked.append(f"{data_dir / spec.tfds_name}/<version>/ (TFDS)")
    raise DataNotFound(
        f"{task} ({split} split): no data under {data_dir}; looked for " + "; ".join(looked)
        + f". To obtain it: {spec.how_to_get.replace('DATA', str(data_dir))}")


def load_docs(task: str, data_dir: str | os.PathLike | None, split: str | None = None
              ) -> list[tuple[str, dict]]:
    """[(where, HF-schema doc)] of one split (default: the split lm-eval scores), all validated.

    Raises MalformedItem listing every bad item as file:line, DataNotFound if absent.
    """
    spec = TASKS[task]
    split = split or spec.eval_split
    kind, where = locate(task, resolve_data_dir(data_dir), split)
    errors: list[str] = []
    rows = _READERS[task](where, errors) if kind == "original" else _read_tfds(task, where, split)
    docs = []
    for loc, doc in rows:
        try:
            _check(task, doc)
        except (KeyError, TypeError, ValueError) as e:
            errors.append(f"{loc}: {e.args[0] if e.args else e}")
            continue
        docs.append((loc, doc))
    if errors:
        shown = "\n  ".join(errors[:20])
        more = f"\n  … and {len(errors) - 20} more" if len(errors) > 20 else ""
        raise MalformedItem(f"{task}: {len(errors)} malformed item(s):\n  {shown}{more}")
    return docs


def to_item(task: str, doc: dict, index: int) -> Item:
    query, choices, label = TASKS[task].prompt(doc)
    return Item(task, str(doc.get("id", doc.get("ind", index))), query, tuple(choices), label)


def load_items(task: str, data_dir: str | os.PathLike | None, limit: int | None = None) -> list[Item]:
    docs = load_docs(task, data_dir)
    docs = docs[:limit] if limit is not None else docs
    return [to_item(task, doc, i) for i, (_, doc) in enumerate(docs)]


def fewshot_contexts(task: str, items: list[Item], data_dir: str | os.PathLike | None,
                     num_fewshot: int, seed: int) -> list[str]:
    """The context of every item, with k examples drawn from the train split as lm-eval does.

    One random.Random(seed) draws k training docs per evaluated item, in item order
    (lm-eval's default sampler; its CLI's default --fewshot seed is 1234). Examples are
    "query answer" joined by a blank line, before the item's query.
    """
    if num_fewshot <= 0:
        return [it.query for it in items]
    pool = [to_item(task, d, i) for i, (_, d) in enumerate(load_docs(task, data_dir, "train"))]
    rnd = random.Random(seed)
    out = []
    for it in items:
        shots = rnd.sample(pool, num_fewshot)
        prefix = "".join(f"{s.query} {s.choices[s.label]}\n\n" for s in shots)
        out.append(prefix + it.query)
    return out
