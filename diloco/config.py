"""Load an experiment spec (`experiments/<file>.py[:arg]` + `--config.key=value` overrides) and
validate it before anything is compiled: every error names the field and what would be valid."""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import ml_collections

from diloco.axes import DEFAULT_RULES, LOGICAL_NAMES, MESH_AXES, TENSOR_RULES, mesh_rules  # noqa: F401
from diloco.errors import ConfigError
from diloco.rundir import flatten

REPO_ROOT = Path(__file__).resolve().parents[1]


def repo_path(path: str) -> Path:
    """`path` relative to the cwd, else to the repo root (editable installs); it may not exist."""
    p = Path(path)
    return REPO_ROOT / path if not p.exists() and (REPO_ROOT / path).exists() else p


def make_importable(root: str | Path) -> None:
    """Put `root` on sys.path (once), so spec files can `from experiments import base`."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))


def resolve_spec_path(spec: str) -> str:
    """`experiments/toy.py:dp` relative to the cwd, else to the repo root (editable installs)."""
    path, _, arg = spec.partition(":")
    p = repo_path(path)
    if not p.exists():
        raise ConfigError("config", f"spec file {path!r} not found (looked in {os.getcwd()} and {REPO_ROOT}); "
                          "e.g. --config experiments/toy.py:streaming")
    make_importable(p.resolve().parent.parent)
    return f"{p}:{arg}" if arg else str(p)


AUTO_ZERO = {f"--config.{k}=auto": f"--config.{k}=0" for k in ("mesh.fsdp", "mesh.tensor")}


def load_config(spec: str, overrides: list[str] = (), check_data: bool = True) -> ml_collections.ConfigDict:
    """Same semantics as ml_collections.config_flags: `path:arg`, then `--config.a.b=value`.

    Every failure is a one-line ConfigError naming the dotted field (`optimizer.lrr`, `H`, or `config`
    for the spec itself) with the valid values or a suggestion."""
    from absl import flags
    from ml_collections import config_flags

    keys = []
    overrides = [AUTO_ZERO.get(o, o) for o in overrides]  # `auto` of an int field whose auto is 0
    for o in overrides:
        if not o.startswith("--config.") or "=" not in o:
            raise ConfigError(o.split("=")[0], "unknown flag; overrides look like --config.key=value")
        keys.append(o.split("=", 1)[0][len("--config."):])
    cfg = load_spec(spec)
    for key in keys:
        check_key(cfg, key)
    argv = ["diloco", *overrides]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_dict("config", cfg, "experiment spec", flag_values=fv, lock_config=True,
                                    sys_argv=argv)
    try:
        fv(argv)
    except flags.Error as e:  # a value that does not parse as the field's type
        msg = one_line(str(e))
        m = re.match(r"flag --config\.([\w.-]+)=(.*?): (.*)$", msg)
        if not m:
            raise ConfigError("config", msg) from None
        field, value, why = m.groups()
        raise ConfigError(field, bad_value_message(field, get_field(cfg, field), value, why)) from None
    validate(cfg, check_data=check_data)
    return cfg


def one_line(text: str) -> str:
    """A message on one line: the first non-empty line, surrounding quotes kept."""
    return next((l.strip() for l in str(text).splitlines() if l.strip()), "")


def load_spec(spec: str) -> ml_collections.ConfigDict:
    """`experiments/<file>.py[:arg]` -> its get_config(arg); the spec's own error message is kept."""
    import importlib.util

    path, _, arg = resolve_spec_path(spec).partition(":")
    try:
        mod_spec = importlib.util.spec_from_file_location(f"diloco_spec_{Path(path).stem}", path)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    except Exception as e:  # a syntax error or failing import in the spec file
        raise ConfigError("config", f"{path} could not be loaded: {type(e).__name__}: {one_line(e)}") from None
    if not callable(getattr(module, "get_config", None)):
        raise ConfigError("config", f"{path} has no get_config(); a spec defines get_config(arg)")
    try:
        cfg = module.get_config(arg) if arg else module.get_config()
    except Exception as e:  # the spec rejected its argument: its message says what is valid
        msg = one_line(e) or type(e).__name__
        raise ConfigError("config", msg if Path(path).name in msg else f"{spec}: {msg}") from None
    if not isinstance(cfg, ml_collections.ConfigDict):
        raise ConfigError("config", f"{path}: get_config() returned {type(cfg).__name__}, not a ConfigDict")
    return cfg


def get_field(cfg, dotted: str):
    v = cfg
    for part in dotted.split("."):
        v = v[part]
    return v


def check_key(cfg: ml_collections.ConfigDict, dotted: str) -> None:
    """ConfigError naming `dotted` if it is not a leaf of cfg, with the closest existing keys."""
    import difflib

    v = cfg
    for part in dotted.split("."):
        if not isinstance(v, ml_collections.ConfigDict) or part not in v:
            break
        v = v[part]
    else:
        if not isinstance(v, ml_collections.ConfigDict):
            return
        raise ConfigError(dotted, f"is a group of keys, not a value; set one of {dotted}.{{{','.join(sorted(v))}}}")
    leaves = list(flatten(cfg))
    close = difflib.get_close_matches(dotted, leaves, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else "valid keys are those of experiments/base.py"
    raise ConfigError(dotted, f"unknown config key {dotted!r}; {hint}")


def bad_value_message(field: str, current, value: str, why: str) -> str:
    if isinstance(current, bool):
        return f"{value!r} is not a boolean; use true or false"
    kind = {int: "an integer", float: "a number"}.get(type(current))
    if kind:
        return f"{value!r} is not {kind}; e.g. --config.{field}={current}"
    return f"{value!r}: {why}"


def validate(cfg: ml_collections.ConfigDict, check_data: bool = True) -> None:
    """Raise ConfigError on the first bad field: keys, types, ranges and the rules between keys; the data
    it names exists (`check_data`). Once per run (load_config); what needs the devices is resolve.py's."""
    from diloco import schema
    from diloco.model.scales import SCALES

    schema.check(flatten(cfg))  # every key known, its type and range (diloco/schema.py); NaN and inf refused
    if cfg.seq_len > SCALES[cfg.scale].max_seq_len:
        raise ConfigError("seq_len", f"{cfg.seq_len} exceeds scale {cfg.scale!r}'s max_seq_len="
                          f"{SCALES[cfg.scale].max_seq_len}; use seq_len ≤ {SCALES[cfg.scale].max_seq_len}")
    if cfg.batch_size % cfg.replicas:
        raise ConfigError("batch_size", f"global batch {cfg.batch_size} is not divisible by replicas={cfg.replicas}")
    _validate_outer_name(cfg)
    from diloco.model.transformer import SPLASH_BLOCK

    if cfg.model.attention == "splash" and cfg.seq_len % SPLASH_BLOCK:
        raise ConfigError("model.attention", f"splash tiles the sequence by {SPLASH_BLOCK}; seq_len={cfg.seq_len} "
                          "is not a multiple (use a multiple, or attention=xla)")
    _validate_faults(cfg)
    if cfg.method != "dp":
        from diloco.outer.codecs import codec_from_config
        from diloco.outer.rules import make_rule
        from diloco.resolve import outer_schedule

        if cfg.method == "diloco" and (cfg.fragments > 1 or cfg.layers_per_fragment or cfg.tau or cfg.replica_tau):
            raise ConfigError("method", "diloco is P=1, tau=0; for fragments or overlap use method=streaming")
        sched = outer_schedule(cfg)  # its own checks: H, τ < H, P ≤ H, replica_tau

        if cfg.exchange == "in_step" and sched.tau_min < 1 and not make_rule(cfg).round_in_send:  # eager: D rounds later
            raise ConfigError("exchange", "in_step runs a send's exchange inside the next inner step, so it needs "
                              f"tau ≥ 1 (got tau={sched.tau_min}); use exchange=blocking or exchange=auto")
        codec_from_config(cfg)
    _validate_eager(cfg)
    mesh_rules(cfg)  # the mesh's sizes need the devices: diloco/resolve.py mesh_shape
    schema.cross(cfg)
    if check_data:
        from diloco.data import validate_data

        validate_data(cfg.data, cfg.vocab, cfg.data_dir or None, cfg.seq_len)
        validate_data(cfg.data, cfg.vocab, cfg.data_dir or None, cfg.seq_len, split="validation")  # eval loss


def _validate_outer_name(cfg) -> None:
    """outer.name (one of OUTER_OPTIMIZERS: schema.DECLARED) with the rule it serves."""
    from diloco.outer.sync import LINEAR

    name = cfg.outer.name
    if name not in LINEAR and cfg.eager in ("swap", "mix"):
        raise ConfigError("outer.name", f"{name} with eager={cfg.eager}: the evaluated θᵍ (the replicas' mean) is "
                          "what one optimizer would hold only for a step linear in Δ (nesterov, sgd); use eager=naive")


def _validate_eager(cfg) -> None:
    """eager / eager_rounds / error_feedback ([EU] eager updates, error feedback: docs/architecture.md)."""
    if cfg.eager == "off" and cfg.eager_rounds != 1:  # eager's and the others' values: schema.DECLARED
        raise ConfigError("eager_rounds", f"eager_rounds={cfg.eager_rounds} needs eager=naive, swap or mix")
    on = [f for f in ("eager", "error_feedback") if cfg[f] not in ("off", False)]
    if not on:
        return
    if cfg.method == "dp":
        raise ConfigError(on[0], "applies to the outer exchange of method=diloco or streaming, not dp")
    if cfg.eager != "off" and (cfg.tau or cfg.replica_tau):
        raise ConfigError("tau", f"eager={cfg.eager} applies a round's average eager_rounds·H steps later by "
                          "construction; set --config.tau=0 (and no replica_tau)")


def _validate_faults(cfg) -> None:
    f, R = cfg.faults, 1 if cfg.method == "dp" else cfg.replicas
    for k in ("miss_sync_step", "restart_step", "nan_step"):
        if not 0 <= f[k] <= cfg.steps:
            raise ConfigError(f"faults.{k}", f"{f[k]} must be a step in 1..steps={cfg.steps} (0: off)")
    if not 0 <= f.nan_replica < R:
        raise ConfigError("faults.nan_replica", f"{f.nan_replica} is not a replica index in 0..{R - 1}")
    if f.nan_target == "outer" and cfg.method == "dp":
        raise ConfigError("faults.nan_target", "'outer' needs method diloco or streaming (dp has no outer step)")
    for k, step in (("miss_sync_replica", "miss_sync_step"), ("restart_replica", "restart_step")):
        if f[k] == -1:
            continue
        if cfg.method == "dp":
            raise ConfigError(f"faults.{k}", "replica faults need method diloco or streaming; dp has one replica")
        if not 0 <= f[k] < R:
            raise ConfigError(f"faults.{k}", f"{f[k]} must be -1 (off) or a replica index in 0..{R - 1}")
        if f[step] < 1:
            raise ConfigError(f"faults.{step}", f"set faults.{step} ≥ 1: the step at which replica {f[k]} faults")


def to_json(cfg: ml_collections.ConfigDict) -> str:
    return json.dumps(cfg.to_dict(), indent=1, sort_keys=True)


def check_points(pts: list[dict], extra: list[str]) -> None:
    """Every sweep point's config (with --set's `extra`) loads and validates before the first runs (no
    compile, no data): a bad point or a --set typo is refused once, in one line naming the point."""
    bad = []
    for pt in pts:
        try:
            load_config(pt["spec"], [*pt["overrides"], *extra], check_data=False)
        except ConfigError as e:
            bad.append((pt, e))
    if bad:
        (pt, e), more = bad[0], f" ({len(bad) - 1} more point(s) refused too)" if len(bad) > 1 else ""
        raise ConfigError(e.field, f"point {pt['name']} (--config {pt['spec']} {' '.join(pt['overrides'])}): "
                          f"{str(e).split(': ', 1)[-1]}{more}")
