"""Cloud TPU accelerator types: which names exist, and their chips and hosts per slice.

v4 and v5p names count TensorCores (2 per chip): v5p-16 is 8 chips. Their slices are 3-D tori
AxBxC (A ≤ B ≤ C) with every side ≤ 4 (2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4) or every side a multiple
of 4 (4x4x8, 4x4x12, 8x8x8, …), 4 chips per host (Cloud TPU "TPU v4", "TPU v5p" and "TPU types and
topologies" pages). v5e (`v5litepod-N`) and v6e (`v6e-N`) names count chips, 2-D slices 1x1 … 16x16;
up to 8 chips are one host, larger slices have 4 chips per host.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from diloco.errors import ConfigError

GENERATIONS = ("v4", "v5p", "v5litepod", "v6e")
CORES_PER_CHIP = {"v4": 2, "v5p": 2, "v5litepod": 1, "v6e": 1}
MAX_CHIPS = {"v4": 4096, "v5p": 6144}  # one v4 pod; the largest v5p slice (16x16x24)
SHAPES_2D = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
# libtpu's (and `diloco compile --topology`'s) chip name, and the TPU software version a VM boots.
CHIP = {"v4": "v4", "v5p": "v5p", "v5litepod": "v5e", "v6e": "v6e"}
RUNTIME = {"v4": "tpu-ubuntu2204-base", "v5p": "v2-alpha-tpuv5", "v5litepod": "v2-alpha-tpuv5-lite",
           "v6e": "v2-alpha-tpuv6e"}


@dataclass(frozen=True)
class Slice:
    name: str  # e.g. v5p-16
    generation: str  # v4 | v5p | v5litepod | v6e
    chips: int
    hosts: int
    topology: str  # libtpu's name, e.g. v5p:2x2x2 (what `diloco compile --topology` takes)

    @property
    def chips_per_host(self) -> int:
        return self.chips // self.hosts


def _tori(max_chips: int) -> dict[int, str]:
    """{chips: AxBxC} of the valid 3-D slices, the most cube-like shape for each chip count."""
    small = [(2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4), (4, 4, 4)]
    big = [(a, b, c) for a in range(4, max_chips + 1, 4) for b in range(a, max_chips // a + 1, 4)
           for c in range(b, max_chips // (a * b) + 1, 4)]
    out: dict[int, tuple[int, ...]] = {}
    for s in small + big:
        n = s[0] * s[1] * s[2]
        if n not in out or max(s) - min(s) < max(out[n]) - min(out[n]):
            out[n] = s
    return {n: "x".join(map(str, s)) for n, s in sorted(out.items())}


def table() -> dict[str, Slice]:
    """Every valid accelerator type name → its Slice, smallest first within a generation."""
    out = {}
    for gen in GENERATIONS:
        if gen in MAX_CHIPS:
            for chips, shape in _tori(MAX_CHIPS[gen]).items():
                name = f"{gen}-{chips * CORES_PER_CHIP[gen]}"
                out[name] = Slice(name, gen, chips, max(1, chips // 4), f"{CHIP[gen]}:{shape}")
        else:
            for shape in SHAPES_2D:
                a, b = map(int, shape.split("x"))
                chips = a * b
                name = f"{gen}-{chips}"
                out[name] = Slice(name, gen, chips, 1 if chips <= 8 else chips // 4, f"{CHIP[gen]}:{shape}")
    return out


TABLE = table()


def of_generation(gen: str) -> list[Slice]:
    return [s for s in TABLE.values() if s.generation == gen]


def parse(name: str) -> Slice:
    """The Slice of an accelerator type; a ConfigError naming the valid neighbours otherwise."""
    if name in TABLE:
        return TABLE[name]
    m = re.fullmatch(r"(v4|v5p|v5litepod|v6e)-(\d+)", name or "")
    if not m:
        alias = {"v5e": "v5litepod"}.get((name or "").split("-")[0])
        hint = f" (Cloud TPU calls v5e '{alias}', e.g. {alias}-16)" if alias else ""
        raise ConfigError("--accelerator", f"{name!r} is not a TPU type{hint}; use one of "
                          f"{', '.join(s.name for g in GENERATIONS for s in of_generation(g)[:2])}, …")
    gen, n = m.group(1), int(m.group(2))
    sizes = of_generation(gen)
    unit = "TensorCores" if CORES_PER_CHIP[gen] == 2 else "chips"
    below = [s.name for s in sizes if int(s.name.split("-")[1]) < n][-2:]
    above = [s.name for s in sizes if int(s.name.split("-")[1]) > n][:2]
    raise ConfigError("--accelerator", f"{name!r} is not a {gen} slice ({gen} names count {unit}); the nearest "
                      f"valid ones are {', '.join(below + above)}")


def smallest(gen: str, chips: int) -> Slice | None:
    """The smallest slice of `gen` with at least `chips` chips (None if none is that large)."""
    return next((s for s in of_generation(gen) if s.chips >= chips), None)
