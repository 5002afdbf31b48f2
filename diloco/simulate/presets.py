"""Named models and assumption sets of the papers' simulator runs; methods come from diloco/outer/methods.py."""
from __future__ import annotations

import dataclasses
import re

from diloco.errors import ConfigError
from diloco.outer import methods
from diloco.simulate.dag import Assumptions, Method, Model

CALIBRATIONS = ("paper", "physical")

# [SD] Table 4 (1B/10B/100B) and [SL] Table 6 models; params are the nominal sizes.
MODELS: dict[str, Model] = {
    "1B": Model("1B", layers=24, params=1e9, step_time_s=0.1),
    "10B": Model("10B", layers=48, params=1e10, step_time_s=0.8),
    "100B": Model("100B", layers=108, params=1e11, step_time_s=4.9),
    "Chinchilla-10B": Model("Chinchilla-10B", layers=48, params=1e10, step_time_s=0.8),
    "Llama3-405B": Model("Llama3-405B", layers=126, params=405e9, step_time_s=26.0),
    "DeepSeek-V3-671B": Model("DeepSeek-V3-671B", layers=61, params=671e9, step_time_s=20.0),
}

# The paper's unknowns, calibrated on [SD] Table 4 (docs/simulator.md, "Assumptions"):
# bf16 payload, 4-bit FP4, link traffic = 0.84 × payload, no latency, fwd:bwd_act:bwd_param 1:1:1.
PAPER = Assumptions(bits=16.0, allreduce_factor=0.84)
# What a ring all-reduce over M=2 datacenters in bf16 actually moves: 2(M−1)/M × payload.
PHYSICAL = Assumptions(bits=16.0, allreduce_factor=1.0)


def assumptions_for(calibration: str, **overrides) -> Assumptions:
    """PAPER or PHYSICAL, with any field replaced (None values are ignored)."""
    if calibration not in CALIBRATIONS:
        raise ConfigError("calibration", f"{calibration!r}; valid: {', '.join(CALIBRATIONS)}")
    base = PAPER if calibration == "paper" else PHYSICAL
    return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})


def allreduce_factor(replicas: int) -> float:
    """Bytes each datacenter sends per payload byte in a ring all-reduce: 2(M − 1)/M."""
    if replicas < 2:
        raise ConfigError("replicas", f"M={replicas} must be >= 2 to need a reduction")
    return 2 * (replicas - 1) / replicas


# [EU]'s "1-outer-step overlap" (eager updates): Streaming + FP4 with τ = H, i.e. fragment p's exchange
# issued after step t_p + kH is needed only by the step after its next send, t_p + (k+1)H + 1. A
# simulator-only name: training selects eager with config.eager, not with a method variant.
EAGER = "streaming_eager"
EAGER_BASE = "streaming_ovl_fp4"


def make_method(
    kind: str,
    layers: int,
    h: int = 100,
    fragments: int | None = None,
    layers_per_fragment: int | None = None,
    tau: int | None = None,
    bits: float | None = None,
    pattern: str = "strided",
) -> Method:
    """Method of a variant of diloco/outer/methods.py (or an alias, or EAGER); None arguments take the
    variant's values: Streaming ceil(layers / 3) fragments, τ=1 when overlapped (τ=H for EAGER), 4 bits
    for FP4."""
    if kind == EAGER:
        m = make_method(EAGER_BASE, layers, h, fragments, layers_per_fragment, h if tau is None else tau, bits, pattern)
        return dataclasses.replace(m, name=EAGER)
    v = methods.get(kind)
    if v.method == "dp":
        return Method(v.name, h=1, fragments=1, tau=0, bits=bits)
    if v.method == "diloco":
        return Method(v.name, h=h, fragments=1, tau=0 if tau is None else tau, bits=bits)
    if fragments is None:
        lpf = v.layers_per_fragment if layers_per_fragment is None else layers_per_fragment
        if lpf < 1:
            raise ConfigError("layers_per_fragment", f"{lpf} must be >= 1")
        fragments = methods.num_fragments(layers, lpf)
    return Method(
        v.name,
        h=h,
        fragments=fragments,
        tau=v.tau if tau is None else tau,
        bits=v.bits if bits is None else bits,
        pattern=pattern,
    )


def parse_count(text: str, field: str = "params") -> float:
    """'7e9', '7B', '350M', '1.3T' -> a number."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKMBGT]?)\s*", str(text))
    if not m:
        raise ConfigError(field, f"{text!r} is not a count like 7e9, 7B or 350M")
    mult = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}[m.group(2)]
    return float(m.group(1)) * mult


def kaplan_step_time(params: float, tokens_per_step: float, chips: int, chip_tflops: float, mfu: float = 0.6) -> float:
    """Step time of 6·N·tokens FLOPs (Kaplan et al. 2020) on `chips` at `mfu` of peak."""
    return 6 * params * tokens_per_step / (chips * chip_tflops * 1e12 * mfu)


def scale_model(name: str, step_time_s: float, vocab_size: int = 32000) -> Model:
    """A model from diloco.model.scales (imported lazily): its layers and parameter count."""
    from diloco.model import scales

    if name not in scales.SCALES:
        raise ConfigError("model", f"unknown model {name!r}; valid: {', '.join(known_model_names())}")
    return Model(name, layers=scales.SCALES[name].layers, params=float(scales.formula_params(name, vocab_size)),
                 step_time_s=step_time_s)


def known_model_names() -> list[str]:
    """Preset names plus the scales of diloco.model.scales."""
    from diloco.model import scales

    return [*MODELS, *(s for s in scales.SCALES if s not in MODELS), "custom"]
