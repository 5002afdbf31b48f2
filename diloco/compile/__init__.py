"""`diloco compile --config SPEC --topology v5e:2x2 [--slices K] [--json]`: prove a run fits a TPU slice
(or NVIDIA GPUs: `--topology h200:1x1x8`, a node of 8 H200s, described by jax's CUDA plugin; `gpu`).

On this CPU machine, libtpu describes a real TPU topology (`jax.experimental.topologies`); the
project's own Trainer is built on those devices and each of its programs is lowered and compiled
ahead of time with abstract arguments (nothing is allocated, no TPU is needed):

  inner           one AdamW step per replica (Trainer.inner_step)
  step+send p     the inner step carrying fragment p's exchange (exchange=in_step, OuterDriver.step_program)
  send/update/merge p   every fragment layout's outer operations (OuterDriver.program), and the
                  undonated update/merge copies the drained evaluation runs when τ > 0
  eval            the evaluation loss on θᵍ (Trainer.eval_fn)

For each: per-chip HBM (arguments, temporaries, outputs, peak) from `memory_analysis()`, FLOPs from
`cost_analysis()`, compile seconds, and every collective parsed from the compiled HLO (kind, operand
bytes, the mesh axes its groups span, whether it crosses slices). Exit 1 when the run does not fit.

The package, by job: `hlo` reads the compiled HLO text (collectives, trip counts, FLOPs, what the
schedule overlaps), `overlap` holds the TPU overlap flags and the compute-utilisation model of the
cross-slice exchange, `gpu` the GPU targets (specs, memory, overlap flags), `aot` compiles the Trainer's
programs and builds the report, `paper_table` the per-device memory table at the paper's scales, `cli`
the command line. The names below are the
package's interface (`from diloco.compile import …`, `diloco.compile.main`).
"""

from diloco.compile.aot import GiB, compile_trainer, per_chip_bytes, report, tpu_devices, trainer_programs
from diloco.compile.cli import main
from diloco.compile.gpu import use_gpu_overlap_flags
from diloco.compile.hlo import (annotate_overlap, custom_calls, hlo_computations, parse_collectives, scheduled_overlap,
                                shape_bytes)
from diloco.compile.overlap import TPU_OVERLAP_FLAGS, parse_bandwidth, predict_cu, use_tpu_overlap_flags
from diloco.compile.paper_table import (COMPILED_BEFORE, PAPER_METHODS, PAPER_SCALES, SLICES, TABLE_HEADROOM,
                                        compiled_kind, compiled_with, paper_config, paper_table, parse_peaks,
                                        read_table, row_id, table_programs, write_table)

__all__ = [
    # aot
    "GiB", "compile_trainer", "per_chip_bytes", "report", "tpu_devices", "trainer_programs",
    # cli
    "main",
    # gpu
    "use_gpu_overlap_flags",
    # hlo
    "annotate_overlap", "custom_calls", "hlo_computations", "parse_collectives", "scheduled_overlap", "shape_bytes",
    # overlap
    "TPU_OVERLAP_FLAGS", "parse_bandwidth", "predict_cu", "use_tpu_overlap_flags",
    # paper_table
    "COMPILED_BEFORE", "PAPER_METHODS", "PAPER_SCALES", "SLICES", "TABLE_HEADROOM", "compiled_kind", "compiled_with",
    "paper_config", "paper_table", "parse_peaks", "read_table", "row_id", "table_programs", "write_table",
]
