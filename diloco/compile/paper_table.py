"""The per-device memory table at the paper's scales (`diloco compile --paper-table`): each (scale,
method, chip) compiled on the smallest slice that fits with headroom, into results/pod/memory.csv/.md.
A row compiles every program a run of its method executes (`aot.trainer_programs`), with the TPU
overlap flags `diloco train` sets (`overlap.use_tpu_overlap_flags`), and fits on the largest peak."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np

from diloco.compile.aot import (CHIP_HBM_BYTES, GiB, compile_trainer, model_flops_per_step, tpu_devices,
                                trainer_programs)
from diloco.config import REPO_ROOT
from diloco.compile.gpu import (GPU_OVERLAP_FLAGS, GPU_PEAK_TFLOPS, GPU_SPECS, gpu_devices, gpu_usable_bytes,
                                use_gpu_overlap_flags)
from diloco.compile.overlap import TPU_OVERLAP_FLAGS, use_tpu_overlap_flags
from diloco.errors import ConfigError
from diloco.rundir import atomic_write_json, atomic_write_text, read_json

PAPER_SCALES = ("35M", "100M", "200M", "300M", "500M", "1B", "4B", "10B")
PAPER_METHODS = {"DP": "dp", "DiLoCo": "diloco_h30", "Streaming": "streaming_ovl_fp4_h100"}
# Slices a user can ask for, smallest first (v4/v5p are 3-D tori; libtpu's names).
SLICES = {"v5e": ("v5e:2x2", "v5e:2x4", "v5e:4x4", "v5e:4x8", "v5e:8x8", "v5e:8x16", "v5e:16x16"),
          "v5p": ("v5p:2x2x1", "v5p:2x2x2", "v5p:2x2x4", "v5p:2x4x4", "v5p:4x4x4", "v5p:4x4x8", "v5p:4x8x8"),
          "v4": ("v4:2x2x1", "v4:2x2x2", "v4:2x2x4", "v4:2x4x4", "v4:4x4x4", "v4:4x4x8", "v4:4x8x8")}
# NVIDIA GPUs (`--chips h200`, rows in their own table: `--out results/gpu`): one node of 8, then 2 and 4 nodes.
GPU_NODES = {c: (f"{c}:1x1x8", f"{c}:1x2x8", f"{c}:1x4x8") for c in GPU_SPECS}
# Peak bf16 FLOP/s per chip (Cloud TPU system architecture pages; NVIDIA's datasheets, dense) and the MFU
# the step time is stated at.
PEAK_FLOPS = {"v4": 275e12, "v5e": 197e12, "v5p": 459e12, "v6e": 918e12,
              **{c: t * 1e12 for c, t in GPU_PEAK_TFLOPS.items()}}
TABLE_MFU = 0.4
TABLE_HEADROOM = 0.10
CSV_FIELDS = ("scale", "method", "chip", "topology", "chips", "devices", "mesh", "params", "global_batch",
              "seq_len", "scan", "remat", "attention", "device_hbm_gib", "state_gib", "inner_peak_gib", "eval_peak_gib", "peak_gib",
              "headroom", "fits", "step_tflop", "step_seconds", "compile_seconds", "note",
              "programs", "program_peaks_gib", "peak_program", "compiled_with", "distinct_programs",
              "compile_wall_seconds", "compiled_on")
# What the rows written before issue #25 compiled: the inner step and eval only, without the overlap flags.
COMPILED_BEFORE = "inner+eval, no overlap flags (before #25)"


def compiled_kind(row: dict) -> str:
    """What a row compiled: `distinct` (every distinct program of the run, this code), `largest fragment`
    (every kind of program, for the largest fragment only: rows written before fragments shared
    programs, #32) or `inner+eval` (before #25). Only `distinct` rows claim a run's fit."""
    how = str(row.get("compiled_with") or "")
    if how.startswith("run programs") and row.get("method") != "Streaming":
        return "distinct"  # DP and DiLoCo (P = 1) have no fragments to share: the same programs either way
    return "distinct" if how.startswith("distinct run programs") else (
        "largest fragment" if how.startswith("run programs") else "inner+eval")


def compiled_with(flags: list[str] | None = None, chip: str | None = None) -> str:
    """How this process compiles a row: every program a run executes, the LIBTPU_INIT_ARGS in effect
    (`overlap flags` when every TPU_OVERLAP_FLAGS is there, as `diloco train` sets them) and the
    jax/libtpu versions; for a GPU chip the XLA_FLAGS of XLA's GPU compiler (GPU_OVERLAP_FLAGS) and
    jax's CUDA plugin. Rows compiled otherwise are compiled again by `paper_table`."""
    import importlib.metadata

    import jax

    if chip in GPU_SPECS:
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith("--xla_gpu_")]
        how = "gpu overlap flags" if set(GPU_OVERLAP_FLAGS) <= set(flags) else "XLA_FLAGS=" + " ".join(flags)
        return (f"distinct run programs, {how}; jax {jax.__version__}, "
                f"jax-cuda12-plugin {importlib.metadata.version('jax-cuda12-plugin')}")
    flags = os.environ.get("LIBTPU_INIT_ARGS", "").split() if flags is None else flags
    extra = [f for f in flags if f not in TPU_OVERLAP_FLAGS]
    how = ("overlap flags" if set(TPU_OVERLAP_FLAGS) <= set(flags) else "no overlap flags" if not flags else
           "LIBTPU_INIT_ARGS=" + " ".join(flags))
    if extra and how == "overlap flags":
        how += " + " + " ".join(extra)
    try:
        libtpu = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        libtpu = "none"
    return f"distinct run programs, {how}; jax {jax.__version__}, libtpu {libtpu}"


def table_programs(tr) -> list[str]:
    """The programs a row compiles: every distinct program a run of `tr` executes (`diloco.precompile.programs`:
    one per fragment layout, so the embeddings' fragment and the fragments of blocks only)."""
    return [name for name, _, _ in trainer_programs(tr)]


def paper_config(scale: str, method: str, spm: str, seq_len: int = 2048):
    """The paper-scale spec (experiments/c4_scaling.py) at seq 2048, T5 32k vocabulary."""
    from diloco.config import load_config

    cfg = load_config(f"experiments/c4_scaling.py:{scale},{PAPER_METHODS[method]}",
                      [f"--config.vocab=sentencepiece:{spm}"], check_data=False)
    cfg.batch_size = max(1, cfg.batch_size * cfg.seq_len // seq_len)  # the spec's tokens per step
    cfg.seq_len = seq_len
    return cfg


def estimate_bytes(cfg, n_params: int, devices: int) -> float:
    """A first guess of the per-device peak (to pick the slice to compile): fp32 params + AdamW moments
    per replica over its devices (+ θᵍ, outer momentum, pending for DiLoCo), bf16 activations under
    full remat (one residual per layer, one block's working set, fp32 logits ×3); no attention scores
    (the splash kernel on TPU keeps them in VMEM)."""
    from diloco.model.scales import SCALES

    s = SCALES[cfg.scale]
    R = 1 if cfg.method == "dp" else cfg.replicas
    per_rep = devices // R
    state = 12 * n_params / per_rep + (12 * n_params / per_rep if R > 1 else 0)
    T = cfg.batch_size * cfg.seq_len / devices  # tokens per device
    act = 2 * T * (s.layers * s.d_model + 6 * s.d_model + 3 * s.mlp_dim) + 12 * T * 32_128
    return state + act


def devices_per_chip(chip: str) -> int:
    """JAX devices libtpu describes per chip: v4's two TensorCores are two devices."""
    return 2 if chip == "v4" else 1


def slice_devices(topology: str) -> int:
    chip, shape = topology.split(":")
    return int(np.prod([int(x) for x in shape.split("x")])) * devices_per_chip(chip)


def table_row(scale: str, method: str, chip: str, spm: str, topology: str | None = None, log=None,
              cache: str | None = None, tensor: int = 1, batch: int | None = None) -> dict:
    """Compile the run's programs (`table_programs`) on the smallest slice of `chip` that fits with ≥10%
    headroom (or on `topology`), FSDP over every device of a replica (÷ `tensor`, the rest on the tensor
    axis); the row of results/pod/memory.csv. `batch`: global batch rows instead of the spec's.
    The rough estimate (`estimate_bytes`) only skips slices that cannot fit by a wide margin (2×); the
    rest are compiled smallest first until one fits (each slice's result kept under `cache`)."""
    cfg = paper_config(scale, method, spm)
    cfg.batch_size, cfg.mesh.tensor = batch or cfg.batch_size, tensor
    from diloco.model.scales import formula_params

    n = float(formula_params(scale))
    R = 1 if cfg.method == "dp" else cfg.replicas
    hbm = device_hbm(chip)
    if topology is not None:
        todo = [topology]
    else:
        slices = SLICES.get(chip) or GPU_NODES[chip]
        usable = [t for t in slices if cfg.batch_size * tensor % slice_devices(t) == 0
                  and slice_devices(t) % (R * tensor) == 0]
        if not usable:
            raise ConfigError("batch_size", f"{cfg.batch_size} sequences split over no {chip} slice of "
                              f"{', '.join(slices)} with {R} replicas")
        first = next((i for i, t in enumerate(usable)
                      if estimate_bytes(cfg, n, slice_devices(t)) <= 2 * (1 - TABLE_HEADROOM) * hbm), len(usable) - 1)
        todo = usable[first:]
    tried = []
    for topology in todo:
        row = compile_row(cfg, scale, method, chip, topology, R, hbm, cache)
        if row["fits"] or topology == todo[-1]:
            break
        tried.append(f"{topology} {row['peak_gib'] or 'did not compile'}")
        if log:
            log(f"  {topology}: does not fit ({row['peak_gib'] or row['note'][:80]}); next slice")
    if tried:
        row["note"] = ("smaller: " + ", ".join(tried) + ("; " + row["note"] if row["note"] else ""))[:300]
    if batch:
        row["note"] = f"batch {batch} ({batch // R} rows per replica), not the spec's" + (
            "; " + row["note"] if row["note"] else "")
    return row


def compile_row(cfg, scale, method, chip, topology, R, hbm, cache: str | None = None) -> dict:
    """One slice: inner and eval first; when they fit, the rest of the run's programs. The row's peak
    is the largest of the programs compiled, and `fits` is decided on it. A result under `cache`
    (keyed by the config, the slice and `compiled_with()`) is returned without compiling."""
    from diloco.config import to_json
    from diloco.resolve import mesh_dict, mesh_shape
    from diloco.trainer import Trainer

    devices = gpu_devices(topology) if chip in GPU_SPECS else tpu_devices(topology)
    cfg.mesh.replica_axis, cfg.mesh.data, cfg.mesh.fsdp = R if R > 1 else 0, 1, -1  # mesh.tensor: table_row's
    mesh_shape(cfg, len(devices))  # the mesh and batch fit the devices
    how = compiled_with(chip=chip)
    key = hashlib.sha256(f"{to_json(cfg)}|{topology}|{how}".encode()).hexdigest()[:16]
    where = os.path.join(cache, f"{scale}_{method}_{topology.replace(':', '-')}_{key}.json") if cache else None
    if where and read_json(where) is not None:
        return read_json(where)
    t0 = time.time()
    tr = Trainer(cfg, devices=devices)
    names = table_programs(tr)
    limit = (1 - TABLE_HEADROOM) * hbm
    load = os.getloadavg()[0]
    got = compile_trainer(cfg, devices, {"inner", "eval"}, tr=tr)
    progs = {r["program"]: r for r in got["programs"]}
    wall = got["compile"]["seconds_wall"]
    first = [progs[p].get("peak_bytes_per_chip") for p in ("inner", "eval")]
    if all(b is not None and b <= limit for b in first):  # else the rest cannot make it fit
        rest = compile_trainer(cfg, devices, set(names) - set(progs), tr=tr)
        progs.update((r["program"], r) for r in rest["programs"])
        wall += rest["compile"]["seconds_wall"]
    peaks = {p: progs[p]["peak_bytes_per_chip"] for p in names if p in progs and progs[p]["compiled"]}
    ok = len(peaks) == len(progs)
    top = max(peaks, key=peaks.get) if peaks else ""
    worst = peaks[top] if ok and peaks else None
    gib = lambda b: round(b / GiB, 3) if b is not None else ""
    flops = model_flops_per_step(cfg, tr.n_params)
    chips = len(devices) // devices_per_chip(chip)
    note = "; ".join(f"{p}: {progs[p]['error'][:120]}" for p in progs if not progs[p]["compiled"])
    if ok and len(progs) < len(names):
        note = (note + "; " if note else "") + "inner/eval do not fit: the rest not compiled"
    row = {"scale": scale, "method": method, "chip": chip, "topology": topology, "chips": chips,
           "devices": len(devices), "mesh": "×".join(f"{k}{v}" for k, v in mesh_dict(tr.mesh.shape).items()),
           "params": tr.n_params, "global_batch": cfg.batch_size, "seq_len": cfg.seq_len,
           "scan": tr.mcfg.scan, "remat": tr.mcfg.checkpoint_policy, "attention": tr.mcfg.attention,
           "device_hbm_gib": round(hbm / GiB, 2), "state_gib": round(got["state_bytes_per_chip"] / GiB, 3),
           "inner_peak_gib": gib(peaks.get("inner")), "eval_peak_gib": gib(peaks.get("eval")),
           "peak_gib": gib(worst), "headroom": round(1 - worst / hbm, 3) if worst is not None else "",
           "fits": bool(worst is not None and len(progs) == len(names) and worst <= limit),
           "step_tflop": round(flops / 1e12, 1),
           "step_seconds": round(flops / (chips * PEAK_FLOPS[chip] * TABLE_MFU), 3),
           "compile_seconds": round(time.time() - t0, 1), "note": note,
           "programs": ", ".join(p for p in names if p in progs),
           "program_peaks_gib": "; ".join(f"{p}={gib(b)}" for p, b in peaks.items()),
           "peak_program": top if worst is not None else "", "compiled_with": how,
           "distinct_programs": len(names), "compile_wall_seconds": round(wall, 1),
           "compiled_on": f"{os.cpu_count()} cores, load {max(load, os.getloadavg()[0]):.1f}"}
    if where:
        atomic_write_json(where, row)
    return row


def row_id(r: dict) -> tuple:
    """What a row of the table is: (scale, method, chip, tensor size, global batch); rows of one id replace
    each other."""
    tensor = next((int(x[6:]) for x in str(r["mesh"]).split("×") if x.startswith("tensor")), 1)
    return r["scale"], r["method"], r["chip"], tensor, int(r["global_batch"])


def parse_peaks(text: str) -> dict[str, float]:
    """A row's `program_peaks_gib` ('inner=1.7; eval=1.4; …') as {program: GiB}."""
    return {k: float(v) for k, v in (x.rsplit("=", 1) for x in str(text or "").split("; ") if x)}


def device_hbm(chip: str) -> int:
    """HBM of one JAX device: libtpu describes v4 with its two TensorCores as two devices (16 GiB each); a
    GPU's is the share JAX's pool holds (XLA_PYTHON_CLIENT_MEM_FRACTION, 90% as `diloco train` sets it)."""
    return gpu_usable_bytes(chip) if chip in GPU_SPECS else CHIP_HBM_BYTES[chip] // devices_per_chip(chip)


def read_table(path) -> list[dict]:
    import csv

    if not os.path.exists(path):
        return []
    with open(path) as f:
        return list(csv.DictReader(f))


def before(r: dict) -> dict:
    """What a row written before #25 compiled (inner and eval, no flags), in the columns added since."""
    if r.get("compiled_with") not in (None, "", COMPILED_BEFORE):
        return {}
    peaks = {p: float(r[f"{p}_peak_gib"]) for p in ("inner", "eval") if r.get(f"{p}_peak_gib") not in (None, "")}
    return {"programs": "inner, eval", "program_peaks_gib": "; ".join(f"{p}={v:g}" for p, v in peaks.items()),
            "peak_program": max(peaks, key=peaks.get) if peaks else "", "compiled_with": COMPILED_BEFORE}


def write_table(rows: list[dict], out_dir: str) -> None:
    """results/pod/memory.csv (every row) and memory.md (the table, sorted by scale, method, chip)."""
    import csv
    import io

    order = lambda r: (PAPER_SCALES.index(r["scale"]), list(PAPER_METHODS).index(r["method"]),
                       (list(SLICES) + list(GPU_NODES)).index(r["chip"]), -row_id(r)[4], row_id(r)[3])
    rows = sorted(({**r, **{k: v for k, v in before(r).items() if r.get(k) in (None, "")}} for r in rows), key=order)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\r\n")
    w.writeheader()
    w.writerows({k: r.get(k, "") for k in CSV_FIELDS} for r in rows)
    atomic_write_text(os.path.join(out_dir, "memory.csv"), buf.getvalue())
    new = sorted({r["compiled_with"] for r in rows if compiled_kind(r) == "distinct"})
    n_new = sum(compiled_kind(r) == "distinct" for r in rows)
    lines = ["# Per-device memory at paper scale (`diloco compile --paper-table`)", "",
             f"Seq {rows[0]['seq_len'] if rows else 2048}, T5 32k vocabulary, the spec's global batch "
             "(experiments/common.py BATCH, same tokens per step at seq 2048), bf16 compute, fp32 params + AdamW; "
             "every spec default left on `auto` (blocks under nn.scan, remat full, Pallas splash attention on "
             "TPU); mesh data=1, fsdp = every device of a replica (÷ tensor in rows with a tensor axis: "
             "`--tensor N`, heads, MLP and vocabulary split N ways). The slice is the smallest of the chip that "
             "compiles with ≥10% headroom (smaller slices tried and failed are in the note). Compiled for the "
             "TPU topology with libtpu on a CPU host.", "",
             "**What is compiled** (column *compiled* = `run`): every program a run of the method executes "
             "(`diloco.precompile.programs`, the list `diloco compile` compiles): DP `inner` and `eval`; "
             "DiLoCo `inner`, the whole-model `send 0`, `update 0`, `merge 0` and `eval`; Streaming (exchange "
             "in_step on TPU) `inner`, `step+send` (the step that carries the exchange), `send` (the deferred "
             "send a checkpoint settles), `update`, `merge` once per fragment layout (`0`: the fragment holding the "
             "embeddings; `1-7`: the fragments of blocks only, one program shared with the fragment's row start "
             "as an argument), the undonated `update`/`merge` copies an evaluation runs while a fragment is in "
             "flight (τ > 0: `update 0 (drained copy)`), and `eval`: *distinct programs* of them, compiled in "
             "parallel in *compile wall s* "
             "on the machine in *compiled on*. Peak = the largest per-device peak of those programs (eval adds the rest of the resident "
             "state), named in *peak program*; fits = peak ≤ 90% of device HBM. **With the flags a run sets**: "
             "`LIBTPU_INIT_ARGS` = `" + " ".join(TPU_OVERLAP_FLAGS) + "` (`diloco.compile.use_tpu_overlap_flags`, "
             "the call `diloco train` makes before libtpu starts). " + (f"Rows marked `distinct`: {n_new} of {len(rows)}, "
             "compiled with " + " | ".join(f"`{h}`" for h in new) + "." if new else "")]
    if n_new < len(rows):
        lines += ["", f"Rows not marked `distinct` ({len(rows) - n_new}) are from earlier tables: `inner+eval` "
                  "(the inner step and eval only, without the overlap flags) or `largest fragment` (every kind of "
                  "program, for the largest fragment only); their fit is not a claim about a run (fits column "
                  "`inner+eval: …` / `largest fragment: …`). Compile them with `diloco compile --paper-table --out "
                  "results/pod` (rows already compiled as above are skipped)."]
    if any(r["chip"] in GPU_SPECS for r in rows):
        lines += ["", "**NVIDIA GPUs** (chips " + "/".join(GPU_SPECS) + ", slice `NAME:1xNODESx8`): compiled on a CPU host "
                  "by jax's CUDA plugin for XLA's target spec of the GPU (diloco/compile/gpu_specs/), attention "
                  "as the plan resolves it on GPU (cuDNN's fused kernel in bf16), with `XLA_FLAGS` = `"
                  + " ".join(GPU_OVERLAP_FLAGS).replace(str(REPO_ROOT) + "/", "")
                  + "` (`diloco.compile.use_gpu_overlap_flags`). *HBM GiB* of a GPU "
                  "is what JAX's pool may hold (XLA_PYTHON_CLIENT_MEM_FRACTION: 90% of its memory, as `diloco train` sets it)."]
    lines += ["", "Headroom = 1 − peak / device HBM. TFLOP/step = model FLOPs (6·params + 12·layers·d_model·seq per "
              f"token); step time = that / (chips × peak bf16 FLOP/s × {TABLE_MFU:.0%} MFU). "
              "v4: libtpu describes each chip as 2 devices of 16 GiB.", "",
              "| scale | method | slice | chips | mesh | params | peak GiB/dev | peak program | HBM GiB | headroom | "
              "fits ≥10% | compiled | TFLOP/step | step s | note |", "|" + "---|" * 15]
    for r in rows:
        kind = compiled_kind(r)
        run = kind == "distinct"
        hr = f"{float(r['headroom']):.0%}" if r["headroom"] not in ("", None) else "–"
        fits = "yes" if str(r["fits"]) == "True" else "NO"
        lines.append(f"| {r['scale']} | {r['method']} | {r['topology']} | {r['chips']} | {r['mesh']} | "
                     f"{int(r['params']) / 1e6:,.0f}M | {r['peak_gib'] or '–'} | {r.get('peak_program') or '–'} | "
                     f"{r['device_hbm_gib']} | {hr} | {fits if run else kind + ': ' + fits} | "
                     f"{kind} | {r['step_tflop']} | {r['step_seconds'] or '–'} | "
                     f"{(r['note'] or '')[:80]} |")
    atomic_write_text(os.path.join(out_dir, "memory.md"), "\n".join(lines) + "\n")


def paper_table(out_dir: str, spm: str, scales=PAPER_SCALES, methods=tuple(PAPER_METHODS), chips=tuple(SLICES),
                log=print, cache: str | None = None, tensor: int = 1, batch: int | None = None,
                topology: str | None = None) -> list[dict]:
    """Every (scale, method, chip) row (at `tensor`, `batch`: `row_id`), resumable: rows in memory.csv compiled
    as this process compiles (`compiled_with()`) are kept and skipped; the others are compiled again and
    replaced, each row written as soon as it is done (memory.csv read again first: processes compiling other
    rows may share it). Set the flags (`use_tpu_overlap_flags`) before libtpu starts: `paper_table_main` does."""
    os.makedirs(out_dir, exist_ok=True)
    rows = read_table(os.path.join(out_dir, "memory.csv"))
    hows = {chip: compiled_with(chip=chip) for chip in chips}
    done = {row_id(r) for r in rows if r["chip"] in hows and (r.get("compiled_with") == hows[r["chip"]] or (
            compiled_kind(r) == "distinct" and "distinct " + r["compiled_with"] == hows[r["chip"]]))}
    for scale in scales:
        for method in methods:
            rows_of = batch or paper_config(scale, method, spm).batch_size
            for chip in chips:
                if (key := (scale, method, chip, tensor, rows_of)) in done:
                    continue
                t0 = time.time()
                log(f"{scale} {method} {chip} tensor {tensor} batch {rows_of} ...")
                row = table_row(scale, method, chip, spm, topology, log, cache, tensor, batch)
                log(json.dumps(row) + f"  ({time.time() - t0:.0f} s)")
                # read again: another --paper-table process may have written rows since
                rows = [r for r in read_table(os.path.join(out_dir, "memory.csv")) if row_id(r) != key] + [row]
                write_table(rows, out_dir)
    return rows


def paper_table_main(argv: list[str]) -> int:
    """`diloco compile --paper-table --out results/pod [--scales 35M,1B] [--chips v5e] [--methods DP]`."""
    ap = argparse.ArgumentParser(prog="diloco compile --paper-table")
    ap.add_argument("--paper-table", action="store_true")
    ap.add_argument("--out", default="results/pod")
    ap.add_argument("--scales", default=",".join(PAPER_SCALES))
    ap.add_argument("--methods", default=",".join(PAPER_METHODS))
    ap.add_argument("--chips", default=",".join(SLICES), help=f"TPU chips, or NVIDIA GPUs: {','.join(GPU_NODES)} "
                    "(one node of 8, then 2 and 4 nodes; needs the gpu-aot extra; write them apart: --out results/gpu)")
    ap.add_argument("--spm", default=os.environ.get("DILOCO_SPM"),
                    help="the T5 SentencePiece model sentencepiece_cc_all.32000.100extra-sentencepiece.model "
                    "(only its size is used; default $DILOCO_SPM)")
    ap.add_argument("--cache", default=None, help="keep each compiled slice's result here, so a rerun skips it "
                    "(default $DILOCO_CACHE/paper_table; 'none': off)")
    ap.add_argument("--no-overlap-flags", action="store_true",
                    help="do not add the project's overlap flags to LIBTPU_INIT_ARGS (rows then say so)")
    ap.add_argument("--tensor", type=int, default=1, help="mesh.tensor of the rows (fsdp = the rest of a replica)")
    ap.add_argument("--batch", type=int, default=None, help="global batch rows (default: the spec's)")
    ap.add_argument("--topology", default=None, help="the slice (default: the smallest of the chip that fits)")
    args = ap.parse_args(argv)
    if not args.spm:
        print("diloco compile: --spm: no SentencePiece model given; pass --spm PATH to the T5 32k model "
              "(sentencepiece_cc_all.32000.100extra-sentencepiece.model) or set DILOCO_SPM", file=sys.stderr)
        return 2
    if not args.no_overlap_flags:
        use_tpu_overlap_flags()  # as `diloco train` does, before libtpu starts
        use_gpu_overlap_flags()  # XLA_FLAGS before XLA's GPU compiler reads them
    cache = args.cache
    if cache is None:
        from diloco.data.specs import cache_dir

        cache = os.fspath(cache_dir() / "paper_table") if cache_dir() is not None else None
    elif cache.lower() in ("", "none", "off", "0"):
        cache = None
    split = lambda s, allowed, field: [x for x in s.split(",") if x and (x in allowed or _bad(field, x, allowed))]
    try:
        rows = paper_table(args.out, args.spm, split(args.scales, PAPER_SCALES, "--scales"),
                           split(args.methods, PAPER_METHODS, "--methods"), split(args.chips, {**SLICES, **GPU_NODES}, "--chips"),
                           cache=cache, tensor=args.tensor, batch=args.batch, topology=args.topology)
    except ConfigError as e:
        print(f"diloco compile: {e}", file=sys.stderr)
        return 2
    return 0 if all(str(r["fits"]) == "True" for r in rows) else 1


def _bad(field: str, x: str, allowed) -> bool:
    raise ConfigError(field, f"{x!r} is not one of {', '.join(allowed)}")
