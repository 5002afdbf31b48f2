"""`diloco <command> …`: one console script, one module per command (imported lazily)."""
from __future__ import annotations

import importlib
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # TensorFlow (under seqio/tfds) is chatty on import

# command -> (module, one-line help). Each module exposes `main(argv: list[str]) -> int | None`.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("diloco.train", "train one run: --config experiments/toy.py:streaming --workdir DIR"),
    "sizes": ("diloco.model.scales", "every model scale with its exact parameter count"),
    "fragments": ("diloco.fragments_cli", "which parameter goes to which fragment (and sizes)"),
    "bytes": ("diloco.outer.bytes_calc", "analytic bytes-exchanged calculator (paper Table 1)"),
    "simulate": ("diloco.simulate.cli", "compute-utilisation simulator (paper Table 4)"),
    "eval": ("diloco.eval.cli", "downstream HellaSwag / PIQA / ARC accuracy of a run"),
    "sweep": ("diloco.sweep", "run every point of a sweep, resumably"),
    "tables": ("diloco.report", "tables and plots from run records, beside the paper's numbers"),
    "reproduce": ("diloco.reproduce", "the main job: toy reproduction of the paper into results/"),
    "launch": ("diloco.distributed", "start one process per replica (jax.distributed) on this machine"),
    "netbench": ("diloco.netbench", "measure achieved throughput between replica processes"),
    "compile": ("diloco.compile", "compile a run for a TPU topology here: per-chip memory, FLOPs, collectives"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: diloco <command> [args…]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`diloco <command> --help` for a command's own flags."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"diloco: unknown command {name!r}; valid: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
