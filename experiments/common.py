"""Sizing shared by the paper-setting specs (not a spec itself).

`sized(c, scale)` turns the base config into either the paper's setting at a named scale (C4,
seq 1024, Chinchilla token budget, [SL]-fitted batch/lr where [SD] is silent) or its CPU toy
twin (`tiny`/`toy`/`toy-l`: embedded corpus, byte vocab, a few hundred steps). Every spec then
states only its differences (method, H, τ, α, codec, …)."""
from __future__ import annotations

import os

from diloco.outer import methods
from experiments import base

TOY_SCALES = ("tiny", "toy", "toy-l")
# [SD] Table 2 token budgets (Chinchilla-optimal, C4).
TOKENS = {"35M": 700e6, "100M": 1.5e9, "200M": 3.5e9, "300M": 6e9, "500M": 11e9, "1B": 25e9, "4B": 83e9,
          "10B": 200e9}
# Parameter counts behind the [SL] fits (its labels for the same shapes).
PARAMS = {"35M": 35e6, "100M": 90e6, "200M": 180e6, "300M": 335e6, "500M": 550e6, "1B": 1.3e9, "4B": 4e9,
          "10B": 10e9}
# Global batch in sequences. UNKNOWN in [SD]; powers of two near [SL]'s fitted batch (Table 9), in
# 1024-token sequences.
BATCH = {"35M": 64, "100M": 128, "200M": 128, "300M": 256, "500M": 256, "1B": 512, "4B": 1024, "10B": 2048}
# Toy twins: (seq_len, global batch, steps at "1× budget", inner lr).
TOY = {"tiny": (64, 16, 200, 3e-3), "toy": (128, 16, 240, 3e-3), "toy-l": (128, 16, 300, 2e-3)}
# Where the paper's data and vocabulary live on a real machine (override with --config.*).
C4 = "c4"  # TFDS c4/en/3.1.0 under --config.data_dir (or ~/tensorflow_datasets)
SPM = os.environ.get("DILOCO_SPM", os.path.expanduser("~/tensorflow_datasets/vocab/t5_32k.model"))


def inner_lr(scale: str, replicas: int | None) -> float:
    """[SL] Table 8 power law γ = A·N^α (DP, or DiLoCo at M replicas); not stated in [SD]."""
    fits = {None: (16319.2, -0.819), 1: (74620.6, -0.945), 2: (3978.82, -0.780), 4: (4512.99, -0.789),
            8: (618986.0, -1.102)}
    a, e = fits.get(replicas, fits[2])
    return float(f"{a * PARAMS[scale] ** e:.3g}")


def sized(c, scale: str, replicas: int | None = 2, budget: float = 1.0, data: str = C4, seq_len: int = 1024):
    """Paper or toy sizing. `budget` multiplies the token budget (Dolma over-training: 1, 4, 10)."""
    c.scale = scale
    if scale in TOY_SCALES:
        c.seq_len, c.batch_size, steps, c.optimizer.lr = TOY[scale]
        c.steps = max(1, int(round(steps * budget)))
        c.optimizer.warmup_steps = max(1, min(30, c.steps // 10))
        c.eval_every = max(c.log_every, c.steps // 4)
        c.checkpoint_every = max(50, c.steps // 2)
        c.eval_batches = 8
        return c
    c.data, c.vocab, c.seq_len = data, f"sentencepiece:{SPM}", seq_len
    c.batch_size = max(1, BATCH[scale] * 1024 // seq_len)  # same tokens per step at seq 2048
    c.steps = int(TOKENS[scale] * budget // (c.batch_size * c.seq_len))
    c.optimizer.lr = inner_lr(scale, replicas)
    c.optimizer.warmup_steps = 1000                     # [SL] §2b
    c.optimizer.min_lr_ratio = 0.05                     # cosine to 5% of peak ([SL])
    c.optimizer.weight_decay = round(1.0 / c.steps, 8)  # [SL]: λ = 1/T
    c.model.dtype = "bfloat16"  # remat_policy auto: full on TPU, chosen by memory on a GPU (diloco/resolve.py)
    c.log_every, c.eval_every, c.checkpoint_every, c.eval_batches = 100, 1000, 1000, 64
    return c


def method(c, name: str):
    """The four columns of [SD] Table 5 (and the variants used by the ablations): `dp` or
    `<variant>_h<H>` with a variant of diloco/outer/methods.py, e.g. diloco_h30, streaming_h30
    (no overlap, FP32), streaming_ovl_h30 (τ=1), streaming_ovl_fp4_h30 (τ=1, E3M0: the paper's final
    method). Toy scales shrink H (toy_H); `tiny` syncs one block per fragment."""
    variant, H = methods.parse(name)
    if H is not None:
        c.H = toy_H(c.scale, H)
    for k, v in variant.config_overrides().items():
        c[k] = v
    if variant.layers_per_fragment and c.scale in ("tiny",):
        c.layers_per_fragment = 1  # tiny has 3 blocks: keep P = 3 fragments as at 35M–100M
    return c


def parse(arg: str, spec: str, names: tuple[str, ...], defaults: dict | None = None) -> dict:
    """'1B,dp' → {'scale': '1B', 'method': 'dp', …defaults}; a clear error naming the spec's fields."""
    defaults = defaults or {}
    parts = arg.split(",") if arg else []
    out = {**defaults, **dict(zip(names, parts))}
    if len(parts) > len(names) or any(n not in out for n in names):
        opt = f" ({', '.join(defaults)} optional)" if defaults else ""
        raise ValueError(f"experiments/{spec}.py:{arg!r}: expected {','.join(names)}{opt}, "
                         f"e.g. experiments/{spec}.py:toy")
    return out


def toy_H(scale: str, H: int) -> int:
    """Toy twins run a few hundred steps, not thousands: H shrinks 3× so a run still has many rounds."""
    return max(2, round(H / 3)) if scale in TOY_SCALES else H


def new():
    return base.get_config()
