"""`diloco <command> …`: one console script, one module per command (imported lazily)."""
from __future__ import annotations

import atexit
import importlib
import os
import sys

from diloco.noise import quiet_cuda_plugin, quiet_environment

quiet_environment()  # before anything imports TensorFlow (under seqio/tfds)

# command -> (module, one-line help). Each module exposes `main(argv: list[str]) -> int | None`.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("diloco.train", "train one run: --config experiments/toy.py:streaming --workdir DIR"),
    "sizes": ("diloco.model.sizes", "every model scale with its exact parameter count"),
    "fragments": ("diloco.fragments_cli", "which parameter goes to which fragment (and sizes)"),
    "bytes": ("diloco.outer.bytes_calc", "analytic bytes-exchanged calculator (paper Table 1)"),
    "simulate": ("diloco.simulate.cli", "compute-utilisation simulator (paper Table 4)"),
    "eval": ("diloco.eval.cli", "downstream HellaSwag / PIQA / ARC accuracy of a run"),
    "sweep": ("diloco.sweep", "run every point of a sweep, resumably"),
    "tables": ("diloco.report", "tables and plots from run records, beside the paper's numbers"),
    "fetch": ("diloco.fetch", "copy a run root's records (local or gs://, no checkpoints) here, then its tables"),
    "reproduce": ("diloco.reproduce", "the main job: toy reproduction of the paper into results/"),
    "launch": ("diloco.launch", "start one process per replica (jax.distributed) on this machine"),
    "netbench": ("diloco.netbench", "measure achieved throughput between replica processes"),
    "compile": ("diloco.compile", "compile a run for a TPU topology here: per-chip memory, FLOPs, collectives"),
    "data": ("diloco.data.cli", "token stores: tokenize a corpus once (tokenize), its manifest (info), preflight (check)"),
    "syncer": ("diloco.learners.syncer", "synchronizer of independent learners over gRPC: --config … --port …"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: diloco <command> [args…]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`diloco <command> --help` for a command's own flags."]
    return "\n".join(lines)


def compile_cache(command: str = "") -> None:
    """JAX's persistent compilation cache under $DILOCO_CACHE/jax (a user's JAX_COMPILATION_CACHE_DIR
    wins): a second run of the same shapes loads its programs instead of compiling them again.
    `diloco compile` runs with the cache off: what it compiles for a TPU topology without a TPU
    cannot be loaded back (libtpu: "PjRtCompiler must be constructed with a Client"), so every entry
    would be a write followed, on the next compile, by a warning and a compile anyway; and its
    compile seconds must be compiles, not loads. A run on the TPU fills its own cache."""
    if command == "compile":
        os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
        if "jax" in sys.modules:  # called from Python after JAX started: the environment is read no more
            sys.modules["jax"].config.update("jax_enable_compilation_cache", False)
        return
    from diloco.data.specs import cache_dir
    from diloco.errors import ConfigError

    try:
        root = cache_dir()
    except ConfigError as e:  # DILOCO_CACHE=gs://…: one line, before anything makes a local "gs:" folder
        print(f"diloco: bad input: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if root is not None and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = str(root / "jax")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def exit_now(code: list[int]) -> None:
    """Registered first, so it runs after every other atexit handler (orbax, jax.distributed,
    tensorboardX have finished): flush and leave without the interpreter's teardown of TensorFlow
    and XLA objects, which takes seconds after the last line was printed."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code[0])


def main(argv: list[str] | None = None) -> int:
    """`diloco …` (argv None: the program itself) or a call from Python with an argument list."""
    if argv is None:  # the console script / python -m diloco.cli: this process ends with the command
        code = [1]  # an uncaught exception: its traceback is printed before atexit runs
        atexit.register(exit_now, code)
        try:
            code[0] = run(sys.argv[1:], program=True)
        except SystemExit as e:  # argparse: --help, bad flags
            code[0] = e.code if isinstance(e.code, int) else int(e.code is not None)
            raise
        except KeyboardInterrupt:
            code[0] = 130
            raise
        return code[0]
    return run(argv)


def run(argv: list[str], program: bool = False) -> int:
    """`program`: this process is the command, so a signal during its start-up may end it at once."""
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"diloco: unknown command {name!r}; valid: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    with start_up_guard(name, program):
        compile_cache(name)
        quiet_cuda_plugin()
        module = importlib.import_module(COMMANDS[name][0])  # seconds: JAX, flax, orbax…
        if name in GUARDED:
            return int(module.main(rest) or 0)
    return int(module.main(rest) or 0)


# Commands whose main() keeps answering signals itself (train: diloco.interrupt, then its loop); the
# others (sweep, launch, reproduce…) forward or handle KeyboardInterrupt and get it back after import.
GUARDED = ("train",)


def start_up_guard(name: str, program: bool):
    """Ctrl-C while the command is still importing: one line and exit 130, whatever the main thread does."""
    import contextlib

    if not program:
        return contextlib.nullcontext()
    from diloco.interrupt import prompt_exit

    idle = f"diloco {name}: {{}} during start-up; nothing saved"
    return prompt_exit(idle.format, idle.format, idle.format)


if __name__ == "__main__":
    sys.exit(main())
