"""Every config key's type and valid range or values, declared once, keyed like experiments/base.py.

`check(cfg)` runs first in config.validate: no key of base.py goes unchecked (tests/test_schema.py fails
on a key without a declaration). Adding a key: give it a line in DECLARED next to the others of its group.
`cross(cfg)` holds the rules between keys that no single declaration can state."""
from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass

from diloco.errors import ConfigError

INT_MAX = 2**31 - 1  # seeds, steps and sizes go through int32 arrays


@dataclass(frozen=True)
class Num:
    """A finite int or float in [lo, hi]; `open_lo` / `open_hi` exclude the bound; `also`: extra allowed values."""
    kind: type
    lo: float = -INT_MAX
    hi: float = INT_MAX
    open_lo: bool = False
    open_hi: bool = False
    also: tuple = ()
    fix: str = ""

    def check(self, key: str, v) -> None:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (self.kind is int and not isinstance(v, int)):
            raise ConfigError(key, f"{v!r} is not {'an integer' if self.kind is int else 'a number'}; {self.fix or self.range()}")
        if v in self.also:
            return
        if not math.isfinite(v):
            raise ConfigError(key, f"{v!r} is not finite; use a value {self.range()}")
        if v < self.lo or v > self.hi or (self.open_lo and v == self.lo) or (self.open_hi and v == self.hi):
            raise ConfigError(key, f"{v!r} is out of range; use a value {self.range()}" + (f" ({self.fix})" if self.fix else ""))

    def range(self) -> str:
        lo = "" if self.lo == -INT_MAX else f"{'(' if self.open_lo else '['}{self.lo:g}"
        hi = "" if self.hi == INT_MAX else f"{self.hi:g}{')' if self.open_hi else ']'}"
        text = (f"in {lo}, {hi}" if lo and hi else f"{'>' if self.open_lo else '≥'} {self.lo:g}" if lo
                else f"{'<' if self.open_hi else '≤'} {self.hi:g}")
        return text + "".join(f" or {a}" for a in self.also)


@dataclass(frozen=True)
class OneOf:
    """A value from `values`, or (values None) from the names another module defines for the key (_elsewhere)."""
    values: tuple | None = None

    def valid(self, key: str) -> tuple:
        return tuple(_elsewhere()[key] if self.values is None else self.values)

    def check(self, key: str, v) -> None:
        valid = self.valid(key)
        if isinstance(v, bool) or v not in valid:
            raise ConfigError(key, f"{v!r} is not one of {', '.join(map(str, valid))}")


@dataclass(frozen=True)
class Text:
    """A string whose form a later check parses (data specs, paths, lists); `what` says where."""
    what: str

    def check(self, key: str, v) -> None:
        if not isinstance(v, str):
            raise ConfigError(key, f"{v!r} is not a string; {self.what}")


@dataclass(frozen=True)
class Flag:
    def check(self, key: str, v) -> None:
        if not isinstance(v, bool):
            raise ConfigError(key, f"{v!r} is not a boolean; use true or false")


@dataclass(frozen=True)
class Address:
    """'' or grpc://HOST:PORT (HOST a name, an IPv4 address or [an IPv6 one], PORT 1 … 65535)."""

    def check(self, key: str, v) -> None:
        m = re.fullmatch(r"grpc://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})", v) if isinstance(v, str) else None
        if v != "" and not (m and 1 <= int(m.group(2)) <= 65535):
            raise ConfigError(key, f"{v!r} is not grpc://HOST:PORT (the synchronizer's address, e.g. "
                                   "grpc://10.0.0.5:7070) or '' (one SPMD job)")


def _elsewhere() -> dict[str, tuple]:
    """The names that other modules define, by key (imported when a value is checked: some import jax)."""
    from diloco.model.scales import SCALES
    from diloco.outer.codecs import ALL_NAMES
    from diloco.outer.eager import EAGER_MODES
    from diloco.outer.fragments import PATTERNS
    from diloco.outer.methods import METHODS
    from diloco.outer.sync import OUTER_OPTIMIZERS

    return {"method": METHODS, "scale": SCALES, "codec": ALL_NAMES, "eager": EAGER_MODES,
            "outer.name": OUTER_OPTIMIZERS, "pattern": PATTERNS}


DTYPES = ("float32", "bfloat16", "float16")
POS, NONNEG, FRACTION = Num(int, 1), Num(int, 0), Num(float, 0.0, 1.0)
PROB = Num(float, 0.0, 1.0, open_hi=True)  # momenta, Adam's b1 / b2
STEP_OFF = Num(int, 0, fix="a step ≥ 1, or 0 for off")
REPLICA_OFF = Num(int, -1, fix="a replica index, or -1 for off")

DECLARED: dict[str, object] = {
    "method": OneOf(), "scale": OneOf(),
    "data": Text("e.g. stdlib, c4, jsonl:<glob>, tokens:<store> (diloco/data/specs.py)"),
    "data_dir": Text("a TFDS data_dir or ''"), "vocab": Text("byte or sentencepiece:<path>"),
    "seq_len": POS, "batch_size": POS, "accum_steps": POS, "steps": POS, "seed": NONNEG, "log_every": POS,
    "eval_every": POS, "eval_batches": POS, "exchange": OneOf(("auto", "blocking", "in_step")), "eval_drain": OneOf(("final", "every")),
    "checkpoint_every": POS, "keep_checkpoints": POS, "sync": Address(),
    "learner": Num(int, -1, fix="a learner's index 0 … replicas-1 (with sync), or -1"),
    "replicas": POS, "H": POS, "tau": NONNEG, "replica_tau": Text("'' or one τ per replica: '0,1,…'"),
    "alpha": FRACTION, "fragments": NONNEG, "layers_per_fragment": NONNEG, "pattern": OneOf(),
    "embed_fragment": OneOf(("first", "last", "own")), "codec": OneOf(), "codec_block_size": POS,
    "codec_rounding": OneOf(("nearest", "stochastic")), "codec_keep_fraction": Num(float, 0.0, 1.0, open_lo=True),
    "dp_grad_dtype": OneOf(DTYPES), "freeze_non_syncing": Flag(),
    "eager": OneOf(), "eager_rounds": POS, "error_feedback": Flag(),
    "outer.name": OneOf(),
    "outer.lr": Num(float, 0.0, open_lo=True), "outer.momentum": PROB, "outer.b2": PROB,
    "outer.eps": Num(float, 0.0, open_lo=True), "outer.weight_decay": Num(float, 0.0),
    "optimizer.lr": Num(float, 0.0, open_lo=True), "optimizer.warmup_steps": NONNEG,
    "optimizer.min_lr_ratio": FRACTION, "optimizer.weight_decay": Num(float, 0.0), "optimizer.b1": PROB,
    "optimizer.b2": PROB, "optimizer.clip_norm": Num(float, 0.0, open_lo=True, fix="0 would zero every update"),
    "model.dtype": OneOf(DTYPES), "model.remat": Flag(),
    "model.scan": OneOf(("auto", "true", "false", "True", "False", "1", "0")),
    "model.z_loss": Num(float, 0.0), "model.remat_policy": OneOf(("auto", "none", "full", "save_dots")),
    "model.attention": OneOf(("auto", "xla", "dot_product", "cudnn", "splash")),
    "model.matmul_precision": OneOf(("auto", "default", "high", "highest")),
    "mesh.replica_axis": Num(int, 0, fix="0 (auto) or a divisor of replicas"),
    "mesh.data": Num(int, -1, fix="≥ 1, or -1 for the remaining devices"),
    "mesh.fsdp": Num(int, -1, fix="≥ 1, -1 for the remaining devices, or 0 (auto)"),
    "mesh.tensor": Num(int, 0, fix="≥ 1, or 0 (auto: the smallest that fits)"),
    "mesh.rules": Text("name=axis[+axis],… (diloco/axes.py mesh_rules)"),
    "downstream.tasks": Text("'' or task names (diloco eval --help)"), "downstream.every": NONNEG,
    "downstream.limit": NONNEG, "downstream.data_dir": Text("a folder or ''"),
    "faults.miss_sync_replica": REPLICA_OFF, "faults.miss_sync_step": STEP_OFF,
    "faults.restart_replica": REPLICA_OFF, "faults.restart_step": STEP_OFF,
    "faults.nan_policy": OneOf(("stop", "skip")), "faults.nan_step": STEP_OFF, "faults.nan_replica": NONNEG,
    "faults.nan_target": OneOf(("loss", "outer")), "faults.nan_value": OneOf(("nan", "inf")),
}


def check(flat: dict) -> None:
    """ConfigError on the first key of `flat` ({"a.b": value}) outside its declaration."""
    for key, value in flat.items():
        if key not in DECLARED:
            raise ConfigError(key, f"unknown config key {key!r}; valid keys are those of experiments/base.py")
        DECLARED[key].check(key, value)


DP_IGNORES = {"codec": "none", "tau": 0, "replica_tau": "", "fragments": 0, "layers_per_fragment": 0}


def cross(cfg, warn=lambda line: print(f"warning: {line}", file=sys.stderr)) -> None:
    """The rules between keys: refused when the run would be wrong, warned when a setting is ignored."""
    from diloco.outer.codecs import SPARSE_NAMES

    if cfg.codec not in SPARSE_NAMES and cfg.codec_keep_fraction != 1.0:
        raise ConfigError("codec_keep_fraction", f"{cfg.codec_keep_fraction} applies to {', '.join(SPARSE_NAMES)} "
                          f"only; codec={cfg.codec} keeps every element: drop it or use one of those codecs")
    per_replica = cfg.batch_size // (1 if cfg.method == "dp" else cfg.replicas)
    if per_replica % cfg.get("accum_steps", 1):
        raise ConfigError("accum_steps", f"{cfg.get('accum_steps', 1)} does not divide the batch of a replica "
                          f"({per_replica} sequences); use a divisor of it")
    if cfg.method == "dp":
        for key in [k for k, default in DP_IGNORES.items() if cfg[k] != default]:
            warn(f"{key}={cfg[key]!r} is ignored by method=dp (it syncs every step, uncompressed)")
    elif cfg.H > cfg.steps:
        warn(f"H={cfg.H} > steps={cfg.steps}: a fragment whose first sync falls after step {cfg.steps} never syncs, "
             "so θᵍ stays at its initial value for it; lower H or raise steps")
    d = cfg.downstream
    if not d.tasks and (d.every or d.limit):
        warn(f"downstream.every={d.every} / downstream.limit={d.limit} do nothing without downstream.tasks")
