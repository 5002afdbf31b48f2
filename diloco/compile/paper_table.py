"""The per-device memory table at the paper's scales (`diloco compile --paper-table`): each (scale,
method, chip) compiled on the smallest slice that fits with headroom, into results/pod/memory.csv/.md."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from diloco.compile.aot import CHIP_HBM_BYTES, GiB, compile_trainer, model_flops_per_step, tpu_devices
from diloco.errors import ConfigError

PAPER_SCALES = ("35M", "100M", "200M", "300M", "500M", "1B", "4B", "10B")
PAPER_METHODS = {"DP": "dp", "DiLoCo": "diloco_h30", "Streaming": "streaming_ovl_fp4_h100"}
# Slices a user can ask for, smallest first (v4/v5p are 3-D tori; libtpu's names).
SLICES = {"v5e": ("v5e:2x2", "v5e:2x4", "v5e:4x4", "v5e:4x8", "v5e:8x8", "v5e:8x16", "v5e:16x16"),
          "v5p": ("v5p:2x2x1", "v5p:2x2x2", "v5p:2x2x4", "v5p:2x4x4", "v5p:4x4x4", "v5p:4x4x8", "v5p:4x8x8"),
          "v4": ("v4:2x2x1", "v4:2x2x2", "v4:2x2x4", "v4:2x4x4", "v4:4x4x4", "v4:4x4x8", "v4:4x8x8")}
# Peak bf16 FLOP/s per chip (Cloud TPU system architecture pages) and the MFU the step time is stated at.
PEAK_FLOPS = {"v4": 275e12, "v5e": 197e12, "v5p": 459e12, "v6e": 918e12}
TABLE_MFU = 0.4
TABLE_HEADROOM = 0.10
CSV_FIELDS = ("scale", "method", "chip", "topology", "chips", "devices", "mesh", "params", "global_batch",
              "seq_len", "scan", "remat", "attention", "device_hbm_gib", "state_gib", "inner_peak_gib", "eval_peak_gib", "peak_gib",
              "headroom", "fits", "step_tflop", "step_seconds", "compile_seconds", "note")


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


def table_row(scale: str, method: str, chip: str, spm: str, topology: str | None = None, log=None) -> dict:
    """Compile inner + eval on the smallest slice of `chip` that fits with ≥10% headroom (or on
    `topology`), FSDP over every device of a replica; the row of results/pod/memory.csv. The rough
    estimate (`estimate_bytes`) only skips slices that cannot fit by a wide margin (2×); the rest are
    compiled smallest first until one fits."""
    cfg = paper_config(scale, method, spm)
    from diloco.model.scales import formula_params

    n = float(formula_params(scale))
    R = 1 if cfg.method == "dp" else cfg.replicas
    hbm = device_hbm(chip)
    if topology is not None:
        todo = [topology]
    else:
        usable = [t for t in SLICES[chip] if cfg.batch_size % slice_devices(t) == 0 and slice_devices(t) % R == 0]
        if not usable:
            raise ConfigError("batch_size", f"{cfg.batch_size} sequences split over no {chip} slice of "
                              f"{', '.join(SLICES[chip])} with {R} replicas")
        first = next((i for i, t in enumerate(usable)
                      if estimate_bytes(cfg, n, slice_devices(t)) <= 2 * (1 - TABLE_HEADROOM) * hbm), len(usable) - 1)
        todo = usable[first:]
    tried = []
    for topology in todo:
        row = compile_row(cfg, scale, method, chip, topology, R, hbm)
        if row["fits"] or topology == todo[-1]:
            break
        tried.append(f"{topology} {row['peak_gib'] or 'did not compile'}")
        if log:
            log(f"  {topology}: does not fit ({row['peak_gib'] or row['note'][:80]}); next slice")
    if tried:
        row["note"] = ("smaller: " + ", ".join(tried) + ("; " + row["note"] if row["note"] else ""))[:300]
    return row


def compile_row(cfg, scale, method, chip, topology, R, hbm) -> dict:
    from diloco.config import validate

    devices = tpu_devices(topology)
    cfg.mesh.replica_axis, cfg.mesh.data, cfg.mesh.fsdp = R if R > 1 else 0, 1, -1
    validate(cfg, check_data=False, num_devices=len(devices))
    t0 = time.time()
    got = compile_trainer(cfg, devices, {"inner", "eval"})
    tr, progs = got["trainer"], {r["program"]: r for r in got["programs"]}
    peak = lambda p: progs[p].get("peak_bytes_per_chip") if progs[p]["compiled"] else None
    ip, ep = peak("inner"), peak("eval")
    ok = ip is not None and ep is not None
    worst = max(ip, ep) if ok else None
    flops = model_flops_per_step(cfg, tr.n_params)
    chips = len(devices) // devices_per_chip(chip)
    note = "; ".join(f"{p}: {progs[p]['error'][:120]}" for p in progs if not progs[p]["compiled"])
    return {"scale": scale, "method": method, "chip": chip, "topology": topology, "chips": chips,
            "devices": len(devices), "mesh": "×".join(f"{k}{v}" for k, v in tr.mesh.shape.items()),
            "params": tr.n_params, "global_batch": cfg.batch_size, "seq_len": cfg.seq_len,
            "scan": tr.mcfg.scan, "remat": tr.mcfg.checkpoint_policy, "attention": tr.mcfg.attention,
            "device_hbm_gib": round(hbm / GiB, 2), "state_gib": round(got["state_bytes_per_chip"] / GiB, 3),
            "inner_peak_gib": round(ip / GiB, 3) if ip is not None else "",
            "eval_peak_gib": round(ep / GiB, 3) if ep is not None else "",
            "peak_gib": round(worst / GiB, 3) if ok else "", "headroom": round(1 - worst / hbm, 3) if ok else "",
            "fits": bool(ok and worst <= (1 - TABLE_HEADROOM) * hbm),
            "step_tflop": round(flops / 1e12, 1),
            "step_seconds": round(flops / (chips * PEAK_FLOPS[chip] * TABLE_MFU), 3),
            "compile_seconds": round(time.time() - t0, 1), "note": note}


def device_hbm(chip: str) -> int:
    """HBM of one JAX device: libtpu describes v4 with its two TensorCores as two devices (16 GiB each)."""
    return CHIP_HBM_BYTES[chip] // devices_per_chip(chip)


def read_table(path) -> list[dict]:
    import csv

    if not os.path.exists(path):
        return []
    with open(path) as f:
        return list(csv.DictReader(f))


def write_table(rows: list[dict], out_dir: str) -> None:
    """results/pod/memory.csv (every row) and memory.md (the table, sorted by scale, method, chip)."""
    import csv

    order = lambda r: (PAPER_SCALES.index(r["scale"]), list(PAPER_METHODS).index(r["method"]),
                       list(SLICES).index(r["chip"]))
    rows = sorted(rows, key=order)
    with open(os.path.join(out_dir, "memory.csv.tmp"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        w.writerows(rows)
    os.replace(os.path.join(out_dir, "memory.csv.tmp"), os.path.join(out_dir, "memory.csv"))
    lines = ["# Per-device memory at paper scale (`diloco compile --paper-table`)", "",
             f"Seq {rows[0]['seq_len'] if rows else 2048}, T5 32k vocabulary, the spec's global batch "
             "(experiments/common.py BATCH, same tokens per step at seq 2048), bf16 compute, fp32 params + AdamW; "
             "every spec default left on `auto` (blocks under nn.scan, remat full, Pallas splash attention on "
             "TPU); mesh data=1, fsdp = every device of a replica. The slice is the smallest of the chip that "
             "compiles with ≥10% headroom (smaller slices tried and failed are in the note). Compiled for the "
             "TPU topology with libtpu on a CPU host: inner step and eval; peak = the larger of the two per "
             "device (eval adds the rest of the resident state). Headroom = 1 − peak / device HBM. "
             "TFLOP/step = model FLOPs (6·params + 12·layers·d_model·seq per token); "
             f"step time = that / (chips × peak bf16 FLOP/s × {TABLE_MFU:.0%} MFU). "
             "v4: libtpu describes each chip as 2 devices of 16 GiB.", "",
             "| scale | method | slice | chips | mesh | params | peak GiB/dev | HBM GiB | headroom | fits ≥10% | "
             "TFLOP/step | step s | note |", "|" + "---|" * 13]
    for r in rows:
        hr = f"{float(r['headroom']):.0%}" if r["headroom"] not in ("", None) else "–"
        lines.append(f"| {r['scale']} | {r['method']} | {r['topology']} | {r['chips']} | {r['mesh']} | "
                     f"{int(r['params']) / 1e6:,.0f}M | {r['peak_gib'] or '–'} | {r['device_hbm_gib']} | {hr} | "
                     f"{'yes' if str(r['fits']) == 'True' else 'NO'} | {r['step_tflop']} | {r['step_seconds'] or '–'} | "
                     f"{(r['note'] or '')[:80]} |")
    with open(os.path.join(out_dir, "memory.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def paper_table(out_dir: str, spm: str, scales=PAPER_SCALES, methods=tuple(PAPER_METHODS), chips=tuple(SLICES),
                log=print) -> list[dict]:
    """Every (scale, method, chip) row, resumable: rows already in memory.csv are kept and skipped."""
    os.makedirs(out_dir, exist_ok=True)
    rows = read_table(os.path.join(out_dir, "memory.csv"))
    done = {(r["scale"], r["method"], r["chip"]) for r in rows}
    for scale in scales:
        for method in methods:
            for chip in chips:
                if (scale, method, chip) in done:
                    continue
                t0 = time.time()
                log(f"{scale} {method} {chip} ...")
                row = table_row(scale, method, chip, spm, log=log)
                log(json.dumps(row) + f"  ({time.time() - t0:.0f} s)")
                rows.append(row)
                write_table(rows, out_dir)
    return rows


def paper_table_main(argv: list[str]) -> int:
    """`diloco compile --paper-table --out results/pod [--scales 35M,1B] [--chips v5e] [--methods DP]`."""
    ap = argparse.ArgumentParser(prog="diloco compile --paper-table")
    ap.add_argument("--paper-table", action="store_true")
    ap.add_argument("--out", default="results/pod")
    ap.add_argument("--scales", default=",".join(PAPER_SCALES))
    ap.add_argument("--methods", default=",".join(PAPER_METHODS))
    ap.add_argument("--chips", default=",".join(SLICES))
    ap.add_argument("--spm", default=os.environ.get("DILOCO_SPM", "/work/shared/data/vocab/"
                                                    "sentencepiece_cc_all.32000.100extra-sentencepiece.model"),
                    help="the T5 SentencePiece model (only its size is used)")
    args = ap.parse_args(argv)
    split = lambda s, allowed, field: [x for x in s.split(",") if x and (x in allowed or _bad(field, x, allowed))]
    try:
        rows = paper_table(args.out, args.spm, split(args.scales, PAPER_SCALES, "--scales"),
                           split(args.methods, PAPER_METHODS, "--methods"), split(args.chips, SLICES, "--chips"))
    except ConfigError as e:
        print(f"diloco compile: {e}", file=sys.stderr)
        return 2
    return 0 if all(str(r["fits"]) == "True" for r in rows) else 1


def _bad(field: str, x: str, allowed) -> bool:
    raise ConfigError(field, f"{x!r} is not one of {', '.join(allowed)}")
