"""`diloco compile`'s command line: the flags, the compile report (text or JSON), and the hand-off
to `--paper-table`."""
from __future__ import annotations

import argparse
import json
import sys

from diloco.compile.aot import report, text_report
from diloco.compile.gpu import use_gpu_overlap_flags
from diloco.compile.overlap import parse_bandwidth, predict_cu, use_tpu_overlap_flags
from diloco.compile.paper_table import paper_table_main
from diloco.errors import ConfigError


def main(argv: list[str]) -> int:
    """`diloco compile …` (or `--paper-table …`); 0 when the run fits, 1 when not, 2 on a bad flag or config."""
    if "--paper-table" in argv:
        return paper_table_main(argv)
    ap = argparse.ArgumentParser(prog="diloco compile",
                                 description="Compile a run's programs for a TPU topology or NVIDIA GPUs on this "
                                             "machine; report per-chip memory, FLOPs and collectives.")
    ap.add_argument("--config", required=True, help="experiments/<file>.py[:arg], e.g. experiments/toy.py:streaming")
    ap.add_argument("--topology", required=True, help="TPU topology, e.g. v5e:2x2, v5p:2x2x2, v4:2x2x2; or GPUs as "
                    "NAME:SLICESxHOSTSxGPUS, e.g. h200:1x1x8 (a node of 8), h100:1x2x8, b200:1x1x8")
    ap.add_argument("--slices", type=int, default=1, help="number of slices (multislice over DCN)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--programs", default="", help="comma-separated subset, e.g. 'inner,send 0,eval' (default: all)")
    ap.add_argument("--bandwidth", default="", help="DCN Gbit/s between slices, e.g. 1Gbit,10,100: predict compute "
                    "utilisation from the compute scheduled under each cross-slice collective")
    ap.add_argument("--mfu", type=float, default=0.6, help="model FLOPs utilisation for compute time (default 0.6)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="peak TFLOP/s per chip (default: the chip's bf16 peak)")
    ap.add_argument("--no-overlap-flags", action="store_true",
                    help="do not add the project's overlap flags to LIBTPU_INIT_ARGS (TPU_OVERLAP_FLAGS) or "
                    "XLA_FLAGS (GPU_OVERLAP_FLAGS)")
    ap.add_argument("--hlo-dir", default=None, help="write each compiled (scheduled) program's HLO text here")
    args, overrides = ap.parse_known_args(argv)
    if not args.no_overlap_flags:
        use_tpu_overlap_flags()
        use_gpu_overlap_flags()
    from diloco.config import load_config

    try:
        if args.slices < 1:
            raise ConfigError("--slices", f"{args.slices} must be ≥ 1")
        cfg = load_config(args.config, overrides, check_data=False)
        bws = parse_bandwidth(args.bandwidth) if args.bandwidth else []
        rep = report(cfg, args.topology, args.slices,
                     {p.strip() for p in args.programs.split(",")} if args.programs else None, args.hlo_dir)
        rep["predictions"] = [predict_cu(rep, bw, args.mfu, args.peak_tflops) for bw in bws]
    except ConfigError as e:
        print(f"diloco compile: {e}", file=sys.stderr)
        return 2
    print(json.dumps(rep, default=str) if args.json else text_report(rep))
    return 0 if rep["fits"] else 1
