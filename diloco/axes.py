"""The logical axis names the model uses, the mesh axes, and `mesh.rules` parsed into flax's logical axis rules
(one parser: diloco/config.py validates with it, diloco/resolve.py and diloco/sharding.py read it)."""
from __future__ import annotations

from diloco.errors import ConfigError

# Logical axis names the model uses (diloco/model/transformer.py: parameters and activations) and the mesh axes.
LOGICAL_NAMES = ("batch", "length", "sequence", "vocab", "embed", "qkv", "heads", "head_dim", "mlp", "layers")
# `sequence`: the length axis of the residual stream between sublayers (`length`: inside attention and the MLP);
# sequence=tensor is sequence parallelism (the all-reduce of each sublayer becomes a reduce-scatter + all-gather).
MESH_AXES = ("replica", "data", "fsdp", "tensor")
DEFAULT_RULES = "batch=data+fsdp,embed=fsdp"
# Megatron-style splits on `tensor` (mesh.tensor > 1), after `mesh.rules` for the names it leaves out:
# qkv and mlp_in column-split, attn_out and mlp_out row-split, the tied embedding split over its rows.
TENSOR_RULES = (("heads", ("tensor",)), ("qkv", ("tensor",)), ("mlp", ("tensor",)), ("vocab", ("tensor",)))


def mesh_rules(cfg) -> tuple[tuple[str, tuple[str, ...] | None], ...]:
    """`mesh.rules` → flax logical axis rules: "name=axis[+axis…],name=,…" maps each logical name to
    mesh axes (empty: replicated); earlier rules win a mesh axis (flax), names not listed are replicated.
    `batch` is the per-replica batch (the replica axis is always in front)."""
    text = str(cfg.mesh.get("rules", DEFAULT_RULES)).strip()
    rules, seen = [], set()
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, eq, axes = item.partition("=")
        name = name.strip()
        if not eq:
            raise ConfigError("mesh.rules", f"{item!r} is not name=axis (e.g. {DEFAULT_RULES!r})")
        if name not in LOGICAL_NAMES:
            raise ConfigError("mesh.rules", f"{name!r} is not a logical axis name; use one of {', '.join(LOGICAL_NAMES)}")
        if name in seen:
            raise ConfigError("mesh.rules", f"{name!r} is given twice")
        seen.add(name)
        got = tuple(a.strip() for a in axes.split("+") if a.strip())
        bad = [a for a in got if a not in MESH_AXES[1:]]
        if bad:
            raise ConfigError("mesh.rules", f"{name}={axes}: {bad[0]!r} is not a mesh axis inside a replica; "
                              "use data, fsdp, tensor or nothing (replicated)")
        if len(set(got)) != len(got):
            raise ConfigError("mesh.rules", f"{name}={axes} names a mesh axis twice")
        rules.append((name, got or None))
    return tuple(rules)
