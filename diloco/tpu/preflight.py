"""Everything `diloco sweep … --launch tpu` checks before anything is created or billed.

One ConfigError (one line naming the field and the fix) for the first thing wrong:
  the accelerator type and slice count; the root on gs://; per point: the spec inside the shipped tree,
  the config, hosts × slices vs replicas (distributed.check_processes, the rule the pod applies),
  the slice axis of a multislice mesh (distributed.slice_axis), the batch split over the chips,
  the data where the workers can read it (a token store on gs://, or files of the tree; no TFDS corpus,
  which the TPU hosts would tokenize), the vocabulary present, the fit in HBM (results/pod/memory.csv, or
  `--check-fit compile`); then, with the bucket: the bucket writable (a probe object written and deleted),
  the store's manifest on gs:// (vocabulary, seq_len, a global batch of rows; more tokens read than it holds is
  a warning), a gs:// vocabulary present. Nothing here calls gcloud or creates a resource.
"""
from __future__ import annotations

import csv
import hashlib
import math
import os
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from diloco.config import REPO_ROOT, load_config
from diloco.resolve import mesh_shape
from diloco.distributed import check_processes, slice_axis
from diloco.errors import ConfigError
from diloco.tpu import accelerators

MEMORY_TABLE = REPO_ROOT / "results" / "pod" / "memory.csv"  # `diloco compile --paper-table`, beside memory.md
METHOD_LABEL = {"dp": "DP", "diloco": "DiLoCo", "streaming": "Streaming"}


@dataclass
class Checked:
    """What preflight found: the slice, each point's resolved config, the local vocabularies to stage
    (local path → file name under _launch/), and warnings (e.g. a fit the table cannot tell)."""
    slice: accelerators.Slice
    slices: int
    configs: dict = field(default_factory=dict)  # point name → ConfigDict
    vocabs: dict = field(default_factory=dict)  # local .model path → staged file name
    warnings: list = field(default_factory=list)
    notes: list = field(default_factory=list)  # what was found, e.g. the token store each point reads


def _point_error(e: ConfigError, name: str) -> ConfigError:
    msg = str(e).split(": ", 1)[-1]
    return ConfigError(e.field, f"point {name}: {msg}")


def staged_vocab_name(local: str) -> str:
    """The staged copy's name under _launch/: by content, so two files never collide."""
    return f"vocab-{hashlib.sha256(Path(local).read_bytes()).hexdigest()[:12]}.model"


def check_names(qr: str, root: str, sweep: str) -> None:
    """A queued-resource name Cloud TPU accepts; a root and sweep name that need no quoting on a command line."""
    if not re.fullmatch(r"[a-z]([-a-z0-9]{0,50}[a-z0-9])?", qr or ""):
        raise ConfigError("--tpu", f"{qr!r}: use lowercase letters, digits and hyphens, starting with a letter "
                          "(≤ 52 characters, so node names like NAME-1 stay valid), e.g. dl-1b")
    if not (root or "").startswith("gs://"):
        raise ConfigError("--root", f"{root!r}: TPU workers cannot read this machine's disk; use a gs://bucket/… root")
    if not re.fullmatch(r"gs://[a-z0-9][-a-z0-9_.]{1,61}[a-z0-9](/[A-Za-z0-9._=+,-]+)*/?", root):
        raise ConfigError("--root", f"{root!r}: use a bucket name of 3-63 lowercase letters, digits, -_. and folder "
                          "names of letters, digits and ._=+,- (the root is written into shell commands)")
    if not re.fullmatch(r"[A-Za-z0-9._=+,-]+", sweep):
        raise ConfigError("sweep", f"sweep name {sweep!r}: use letters, digits and ._=+,- (it names the bucket folder)")


def check_point(point: dict, extra: list[str], sl: accelerators.Slice, slices: int, tree: set[str]):
    """The point's config on `slices` slices of `sl`: spec shipped, config valid, processes, mesh, batch."""
    spec_path = point["spec"].partition(":")[0]
    rel = os.path.relpath(os.path.abspath(spec_path if os.path.exists(spec_path) else REPO_ROOT / spec_path), REPO_ROOT)
    if rel not in tree:
        raise ConfigError("config", f"point {point['name']}: spec {spec_path} is not in the tree shipped to the "
                          f"workers (`git ls-files -co --exclude-standard` under {REPO_ROOT}); put it under experiments/")
    cfg = load_config(point["spec"], [*point["overrides"], *extra], check_data=False)
    n = sl.chips * slices
    R = 1 if cfg.method == "dp" else cfg.replicas
    try:
        check_processes(R, sl.hosts * slices)
        shape = mesh_shape(cfg, n)
        if slices > 1:
            slice_axis(shape, slices)
    except ConfigError as e:
        if e.field == "replicas":
            raise ConfigError("replicas", f"point {point['name']}: {slices}× {sl.name} is {sl.hosts * slices} hosts "
                              f"(one process each): {str(e).split(': ', 1)[-1]}") from None
        if e.field not in ("batch_size", "mesh.replica_axis", "mesh.fsdp", "mesh.data"):
            raise _point_error(e, point["name"]) from None
        r_axis = n if R % n == 0 else math.gcd(R, n)
        per_dev = n // r_axis // max(1, int(cfg.mesh.get("tensor", 1)))  # devices of one replica's data×fsdp axes
        good_b = -(-cfg.batch_size // (R * per_dev)) * R * per_dev
        raise ConfigError(e.field, f"point {point['name']}: {str(e).split(': ', 1)[-1]}; with {slices}×{sl.chips} "
                          f"chips use --set batch_size={good_b}") from None
    return cfg


def check_data(cfg, name: str, tree: set[str]) -> None:
    """Every TPU host must read or make the point's token store without tokenizing a TFDS corpus: a store on
    gs:// (its manifest checked by check_remote), or a corpus each host prepares itself from the shipped tree
    (prepare.self_preparable, the rule `diloco train` applies to a multi-process run: the embedded corpus, JSONL
    or text files). A TFDS corpus (c4, c4:<dir>, dolma) is refused here, on any slice: each new or repaired VM
    starts with an empty cache and would tokenize it on billed TPU time (a multi-host run refuses it there)."""
    from diloco.data import prepare, specs

    corpus = prepare.corpus_of(cfg.data)
    if corpus is None:  # a token store (diloco/data/store.py)
        where = specs.store_path(cfg.data)
        if not where.startswith("gs://"):
            raise ConfigError("data", f"point {name}: the token store {where!r} is on this machine's disk; `diloco "
                              "data tokenize --out gs://BUCKET/STORE` and --set data=tokens:gs://BUCKET/STORE")
        return
    if not prepare.self_preparable(corpus):
        e = prepare.tokenize_first(corpus, cfg.vocab, cfg.data_dir or None, "a pod's TPU hosts do not tokenize a "
                                   "TFDS corpus (each new or repaired VM starts with an empty cache)", "launch with --set data")
        raise _point_error(e, name) from None
    kind, _, arg = corpus.partition(":")
    if kind in ("dolma", "jsonl", "text") and arg:
        import glob

        files = sorted(glob.glob(os.path.join(REPO_ROOT, arg), recursive=True)) if not os.path.isabs(arg) else []
        rel = {os.path.relpath(f, REPO_ROOT) for f in files}
        if not rel or not rel <= tree:
            raise ConfigError("data", f"point {name}: {cfg.data!r} is not a glob of files inside the shipped tree, "
                              "and TPU hosts cannot read this machine's disk; tokenize it into a store on gs:// "
                              f"(`diloco data tokenize --data {corpus} --vocab {cfg.vocab} --out gs://BUCKET/STORE`) and "
                              "--set data=tokens:gs://BUCKET/STORE, or commit the files under the repository")


def check_downstream(cfg, name: str, tree: set[str]) -> None:
    """Downstream scoring during training reads its items from local files (diloco/eval/benchmarks.py),
    on every host, relative to the shipped tree: they must be files of that tree."""
    ds = cfg.get("downstream") or {}
    if not ds.get("tasks"):
        return
    d = str(ds.get("data_dir") or "")
    if not d:
        where = "is unset (each host would look in its own $DILOCO_EVAL_DATA)"
    elif d.startswith("gs://"):
        where = "is on gs://, which the benchmark readers do not read"
    elif os.path.isabs(d) or not any(f.startswith(os.path.normpath(d) + "/") for f in tree):
        where = "is not a folder of the shipped tree, and TPU hosts cannot read this machine's disk"
    else:
        return
    raise ConfigError("downstream.data_dir", f"point {name}: downstream.tasks={ds['tasks']!r} scores items "
                      f"during training, but downstream.data_dir={d!r} {where}; commit the items under the "
                      "repository and --set downstream.data_dir=<that folder>, or leave downstream.tasks empty "
                      "and score the finished run with `diloco eval`")


def check_vocab(cfg, name: str) -> str:
    """'' (byte or gs:// vocabulary) or the local .model path to stage; a missing file is refused."""
    kind, _, arg = (cfg.vocab or "byte").partition(":")
    if kind != "sentencepiece" or arg.startswith("gs://"):
        return ""
    p = os.path.expanduser(arg)
    if not os.path.isfile(p):
        raise ConfigError("vocab", f"point {name}: sentencepiece model {p!r} not found on this machine (it is "
                          "copied to the bucket for the workers); give an existing file with "
                          "--set vocab=sentencepiece:/path/to/spm.model, or one on gs://")
    return os.path.abspath(p)


# -- fit in HBM --------------------------------------------------------------------------------------
def memory_table(path: Path = MEMORY_TABLE) -> list[dict]:
    """Rows of results/pod/memory.csv (written with memory.md by `diloco compile --paper-table`)."""
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("fits") == "True"]


def fit_from_table(cfg, sl: accelerators.Slice, slices: int, rows: list[dict]) -> tuple[str, str]:
    """("fits" | "too big" | "unknown", why). The table holds, per (scale, method, chip), the smallest
    slice that fits with ≥10% headroom at the spec's batch (seq 2048). A point with at least the
    row's chips per replica and at most its tokens per chip fits; one with fewer chips per replica
    and at least its tokens per chip does not; anything else is unknown."""
    chip = accelerators.CHIP[sl.generation]
    label = METHOD_LABEL.get(cfg.method)
    row = next((r for r in rows if r["scale"] == cfg.scale and r["method"] == label and r["chip"] == chip), None)
    topo = f"{sl.topology}" + (f" --slices {slices}" if slices > 1 else "")
    if row is None:
        return "unknown", (f"no row for {cfg.scale} {label} on {chip} in {MEMORY_TABLE.relative_to(REPO_ROOT)}; run "
                           f"`diloco compile --config SPEC --topology {topo}` (or --check-fit compile) to know")
    R = 1 if cfg.method == "dp" else cfg.replicas
    R_t = int(row["mesh"].split("×")[0].removeprefix("replica"))
    chips = sl.chips * slices
    per_rep, per_rep_t = chips / R, int(row["chips"]) / R_t
    tok, tok_t = cfg.batch_size * cfg.seq_len / chips, int(row["global_batch"]) * int(row["seq_len"]) / int(row["chips"])
    where = f"{cfg.scale} {label} on {row['topology']}: {row['peak_gib']} GiB of {row['device_hbm_gib']} per device"
    if per_rep >= per_rep_t and tok <= tok_t:
        return "fits", f"the memory table's {where}"
    if per_rep <= per_rep_t and tok >= tok_t:
        need = max(per_rep_t * R, cfg.batch_size * cfg.seq_len / tok_t)
        best = accelerators.smallest(sl.generation, math.ceil(need / slices))
        fix = f"use --accelerator {best.name}" if best else f"no {sl.generation} slice is large enough"
        return "too big", (f"{chips / R:g} chips per replica on {slices}× {sl.name}, and the smallest {chip} slice "
                           f"that fits with ≥10% HBM headroom gives {per_rep_t:g} ({where}); {fix}"
                           + (f" × {slices} slices" if slices > 1 and best else ""))
    return "unknown", (f"{cfg.scale} {label} at {tok:g} tokens and {per_rep:g} chips per replica differs from the "
                       f"memory table's row ({where}); run `diloco compile --config SPEC --topology {topo}` to know")


def fit_by_compile(cfg, sl: accelerators.Slice, slices: int) -> tuple[str, str]:
    """Compile the point's programs for the slice with libtpu on this machine (minutes at paper scale)."""
    from diloco.compile.aot import report

    rep = report(cfg, sl.topology, slices)
    peak = max(p["peak_bytes_per_chip"] for p in rep["programs"]) / 2 ** 30
    hbm = rep["chip_hbm_bytes"] / 2 ** 30
    if rep["fits"]:
        return "fits", f"compiled for {sl.topology}: peak {peak:.3g} GiB of {hbm:.0f} GiB per chip"
    bigger = [s.name for s in accelerators.of_generation(sl.generation) if s.chips > sl.chips][:1]
    return "too big", (f"compiled for {sl.topology}: peak {peak:.3g} GiB > {hbm:.0f} GiB HBM per chip; try a larger "
                       f"slice{' (' + bigger[0] + ')' if bigger else ''} and `diloco compile --paper-table` for the smallest")


# -- the bucket --------------------------------------------------------------------------------------
def check_bucket(root: str) -> None:
    """Write and delete a probe object under root (the workers and this machine both write there)."""
    from diloco.rundir import require

    probe = require(root, "--root") / f".diloco-probe-{uuid.uuid4().hex[:12]}"
    try:
        probe.write_text("diloco preflight probe\n")
        probe.unlink()
    except Exception as e:  # gcsfs raises many kinds (missing bucket, no credentials, forbidden)
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ConfigError("--root", f"{root}: cannot write a probe object ({type(e).__name__}: {first}); check "
                          "that the bucket exists and `gcloud auth application-default login` can write to it") from None


def check_store_size(cfg, name: str, store: str, tokens: int) -> str:
    """Refuses a store whose train split has fewer rows of seq_len than one global batch; '' or a warning when
    the run reads more tokens than the split holds (it would repeat the data, epoch after epoch)."""
    rows, need = tokens // cfg.seq_len, cfg.steps * cfg.batch_size * cfg.seq_len
    if rows < cfg.batch_size:
        raise ConfigError("data", f"point {name}: the token store {store} has {rows:,} train rows of seq_len "
                          f"{cfg.seq_len}, fewer than one global batch of {cfg.batch_size}; tokenize more into it "
                          f"(`diloco data tokenize`), or --set batch_size={rows} at most")
    if need <= tokens:
        return ""
    return (f"point {name}: the run reads {need:,} tokens ({cfg.steps:,} steps × {cfg.batch_size} × {cfg.seq_len}), "
            f"{need / tokens:,.1f}× the {tokens:,} train tokens of {store}: it repeats the data ≈ {need / tokens:,.0f} "
            "times; tokenize more, or fewer steps")


def check_remote(cfg, name: str, warnings: list | None = None) -> str:
    """A token store's manifest on gs:// (it exists and fits the point's vocabulary and seq_len, holds a global
    batch; a warning into `warnings` when the run reads more tokens than it holds) and a gs:// vocabulary, read
    through the same libraries the workers use; what the point reads ('' when not a store)."""
    from diloco.data import parse_vocab, specs

    where, found = specs.store_path(cfg.data), ""
    if where:
        from diloco.data.store import check_store

        try:
            man = check_store(where, cfg.vocab, cfg.seq_len)
        except ConfigError as e:
            raise _point_error(e, name) from None
        tokens = man["splits"]["train"]["tokens"]
        warning = check_store_size(cfg, name, where, tokens)
        if warning and warnings is not None:
            warnings.append(warning)
        found = f"the token store {where} (fingerprint {man['fingerprint'][:12]}, {tokens:,} train tokens)"
    if (cfg.vocab or "").startswith("sentencepiece:gs://"):
        try:
            parse_vocab(cfg.vocab)
        except ConfigError as e:
            raise _point_error(e, name) from None
    return found


def single_host_multislice(sl: accelerators.Slice, slices: int) -> str:
    """A warning for Multislice over one-host slices ('' otherwise)."""
    if slices < 2 or sl.hosts > 1:
        return ""
    bigger = next((s.name for s in accelerators.of_generation(sl.generation) if s.hosts > 1), "")
    return (f"--slices {slices} of {sl.name} is Multislice over one-host slices: Google documents Multislice (GKE) "
            f"for multi-host slices only and the Cloud TPU API states nothing; if the queued resource is refused "
            f"or the slices do not connect, use one larger slice" + (f" (e.g. {bigger})" if bigger else ""))


def check(sweep: dict, root: str, accelerator: str, slices: int, extra: list[str], tree: set[str],
          check_fit: str = "table", remote: bool = True) -> Checked:
    """Every check, cheapest first; the bucket is touched only once everything local passed."""
    if slices < 1:
        raise ConfigError("--slices", f"{slices} must be ≥ 1")
    sl = accelerators.parse(accelerator)
    if not root.startswith("gs://"):
        raise ConfigError("--root", f"{root!r}: TPU workers cannot read this machine's disk; use a gs://bucket/… root")
    if check_fit not in ("table", "compile", "off"):
        raise ConfigError("--check-fit", f"{check_fit!r} is not one of table, compile, off")
    out = Checked(sl, slices)
    if single_host_multislice(sl, slices):
        out.warnings.append(single_host_multislice(sl, slices))
    rows = memory_table() if check_fit == "table" else []
    for pt in sweep["points"]:
        cfg = check_point(pt, extra, sl, slices, tree)
        check_data(cfg, pt["name"], tree)
        check_downstream(cfg, pt["name"], tree)
        local = check_vocab(cfg, pt["name"])
        if local:
            out.vocabs[local] = staged_vocab_name(local)
        if check_fit != "off":
            verdict, why = (fit_from_table(cfg, sl, slices, rows) if check_fit == "table"
                            else fit_by_compile(cfg, sl, slices))
            if verdict == "too big":
                raise ConfigError("--accelerator", f"point {pt['name']} does not fit: {why}")
            if verdict == "unknown":
                out.warnings.append(f"point {pt['name']}: fit unknown: {why}")
        out.configs[pt["name"]] = cfg
    if remote:
        check_bucket(root)
        for name, cfg in out.configs.items():
            found = check_remote(cfg, name, out.warnings)
            if found:
                out.notes.append(f"point {name} reads {found}")
    return out
