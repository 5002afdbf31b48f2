"""The method vocabulary: every named variant of DP / DiLoCo / Streaming DiLoCo, defined once.

Words:
  * a *method* is what `config.method` selects: the algorithm family `dp`, `diloco` or `streaming`;
  * a *variant* is a named setting of a method, one row of `VARIANTS`: its config overrides, the
    label results/paper/*.csv and the report give it, its figure title, and what the simulator needs
    (fragments, overlap τ, bits per element).

Experiment specs take `<variant>_h<H>` (`streaming_ovl_fp4_h30`; DP takes no H), the simulator and
netbench take variant names, and the report labels a run by the variant its config matches. Older
spellings (`streaming_overlap`, `streaming_overlap_fp4`, the simulator's and netbench's) are
accepted as aliases. Pure data and small functions: no jax, importable by the simulator.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping

from diloco.errors import ConfigError

METHODS = ("dp", "diloco", "streaming")  # config.method
EMBED_RULES = ("first", "last", "own")  # config.embed_fragment: where embeddings + final norm sync


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    method: str  # config.method
    paper_label: str  # label stem in results/paper/*.csv (+ "_h<H>" except DP)
    title: str  # legend of the paper's figures
    layers_per_fragment: int = 0  # 0: one fragment ([SD]: 3 blocks per fragment, strided)
    tau: int = 0  # overlap in inner steps
    codec: str = "none"  # outer-gradient codec; e3m0 is the paper's FP4
    alpha: float = 0.0  # merge α (the main runs' α is UNKNOWN in [SD]; 0.5 as in §3.3.2)
    bits: float | None = None  # simulator: bits per reduced element (None: the assumptions' payload bits)
    aliases: tuple[str, ...] = ()

    @property
    def takes_h(self) -> bool:
        return self.method != "dp"

    def config_overrides(self) -> dict[str, Any]:
        """The config fields this variant sets on experiments/base.py (defaults left untouched)."""
        out: dict[str, Any] = {"method": self.method}
        if self.layers_per_fragment:
            out.update(layers_per_fragment=self.layers_per_fragment, pattern="strided")
        if self.alpha:
            out["alpha"] = self.alpha
        if self.tau:
            out["tau"] = self.tau
        if self.codec != "none":
            out["codec"] = self.codec
        return out


_STREAM = dict(method="streaming", layers_per_fragment=3, alpha=0.5)
VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("dp", "dp", "data_parallel", "Data-Parallel"),
    Variant("diloco", "diloco", "diloco", "DiLoCo"),
    Variant("streaming", paper_label="streaming", title="Streaming DiLoCo", **_STREAM),
    Variant("streaming_fp4", paper_label="streaming_fp4", title="Streaming + FP4 com.", codec="e3m0",
            bits=4.0, **_STREAM),
    Variant("streaming_ovl", paper_label="streaming_ovl", title="Streaming + overlapped com.", tau=1,
            aliases=("streaming_overlap",), **_STREAM),
    Variant("streaming_ovl_fp4", paper_label="streaming_ovl_fp4", title="Streaming + overlapped FP4 com.",
            tau=1, codec="e3m0", bits=4.0, aliases=("streaming_overlap_fp4",), **_STREAM),
)}
# The columns of [SD] Table 5 / the curves of its Fig. 4, in the paper's order.
PAPER_VARIANTS = ("dp", "diloco", "streaming", "streaming_ovl", "streaming_ovl_fp4")
# What a bare method name stands for in experiments/toy.py: the paper's final Streaming DiLoCo.
DEFAULT_VARIANT = {"dp": "dp", "diloco": "diloco", "streaming": "streaming_ovl_fp4"}
_BY_ALIAS = {a: v for v in VARIANTS.values() for a in v.aliases}
_BY_LABEL = {v.paper_label: v for v in VARIANTS.values()}


def get(name: str, field: str = "method") -> Variant:
    """The variant called `name` (or an alias of it); ConfigError naming `field` otherwise."""
    v = VARIANTS.get(name) or _BY_ALIAS.get(name)
    if v is None:
        raise ConfigError(field, f"{name!r}; valid: {', '.join(VARIANTS)}")
    return v


def split_h(name: str) -> tuple[str, int | None]:
    """'streaming_ovl_fp4_h30' -> ('streaming_ovl_fp4', 30); 'dp' -> ('dp', None)."""
    m = re.fullmatch(r"(.+)_h(\d+)", name)
    return (m.group(1), int(m.group(2))) if m else (name, None)


def parse(name: str) -> tuple[Variant, int | None]:
    """An experiment's method argument: 'dp' or '<variant>_h<H>' -> (variant, H)."""
    stem, H = split_h(name)
    v = VARIANTS.get(stem)
    if v is None or (H is None) == v.takes_h:
        forms = ", ".join(f"{n}_h<H>" if VARIANTS[n].takes_h else n for n in VARIANTS)
        raise ValueError(f"method {name!r}: use {forms} (e.g. streaming_ovl_fp4_h30)")
    return v, H


def from_paper_label(label: str) -> tuple[Variant, int | None]:
    """'streaming_ovl_fp4_h100' / 'data_parallel' (results/paper) -> (variant, H)."""
    stem, H = split_h(label)
    if stem not in _BY_LABEL:
        raise ConfigError("method", f"no method variant for paper label {label!r}")
    return _BY_LABEL[stem], H


def classify(cfg: Mapping[str, Any]) -> Variant:
    """The variant a run config belongs to: its method, whether it overlaps (τ or per-replica τ) and
    the family of its outer-gradient format (the codec registry, diloco/outer/codecs.py `FORMATS`);
    other fields (H, P, α, …) do not change the variant. A format family no named variant sends (bf16,
    fp8, sparse; FP4 for DiLoCo) gives the method's variant with the family in its name and label:
    `streaming_ovl` + fp8 → `streaming_ovl_fp8` (labels `streaming_ovl_fp8_h30`)."""
    from diloco.outer.codecs import family  # lazily: the registry imports jax, this module does not

    fam = family(cfg.get("codec") or "none") if cfg["method"] != "dp" else "fp32"
    if cfg["method"] != "streaming":
        base = VARIANTS[cfg["method"]]
    else:
        overlapped = bool(cfg.get("tau") or cfg.get("replica_tau"))
        named = [v for v in VARIANTS.values() if v.method == "streaming" and bool(v.tau) == overlapped]
        hit = [v for v in named if family(v.codec) == fam]
        if hit:
            return hit[0]
        base = next(v for v in named if v.codec == "none")
    if fam == family(base.codec):
        return base
    return dataclasses.replace(base, name=f"{base.name}_{fam}", paper_label=f"{base.paper_label}_{fam}",
                               title=f"{base.title} ({fam} com.)", codec=str(cfg.get("codec")), bits=None,
                               aliases=())


def paper_label(cfg: Mapping[str, Any], H: int | None = None) -> str:
    """The results/paper label of a run config: 'data_parallel', 'diloco_h30', 'streaming_ovl_fp8_h30', …
    at its actual H, or at `H` (a toy twin's setting named by the paper's H)."""
    v = classify(cfg)
    return f"{v.paper_label}_h{cfg['H'] if H is None else H}" if v.takes_h else v.paper_label


def num_fragments(layers: int, layers_per_fragment: int = 0, fragments: int = 0, embed_fragment: str = "first") -> int:
    """Total fragment count P: `fragments`, else ceil(layers / layers_per_fragment), else 1; plus one
    when the embeddings sync as their `own` fragment."""
    if fragments and layers_per_fragment:
        raise ConfigError("fragments", "set either fragments or layers_per_fragment, not both (the other = 0)")
    if fragments:
        P = fragments
    elif layers_per_fragment:
        if layers_per_fragment < 1:
            raise ConfigError("layers_per_fragment", f"{layers_per_fragment} must be ≥ 1")
        P = math.ceil(layers / layers_per_fragment)
    else:
        P = 1
    if not 1 <= P <= layers:
        raise ConfigError("fragments", f"P={P} fragments for {layers} transformer blocks: must be 1…{layers}")
    if embed_fragment not in EMBED_RULES:
        raise ConfigError("embed_fragment", f"{embed_fragment!r} is not one of {EMBED_RULES}")
    return P + (embed_fragment == "own")
