"""The mesh and every sharding of a run's state and batches (the Trainer's layout).

Mesh axes ("replica", "data", "fsdp", "tensor"): replicas on `replica`, a replica's chips on data × fsdp ×
tensor (tensor: Megatron-style splits of heads, MLP and vocabulary, diloco/axes.py TENSOR_RULES; the batch rows are
split over data × fsdp only, the chips of a tensor group read the same rows).

  replica_sharding     P("replica"): a replica-stacked array, one replica's row per replica group
  replicated_sharding  P(): the same whole array on every device (steps, keys, masks, eval batches
                       that do not split)
  batch_sharding       P("replica", ("data", "fsdp")): a replica's batch rows over its chips
  parameter leaves     `replica` on the leading axis, the rest by the logical axis rules (`mesh.rules`,
                       diloco/axes.py mesh_rules) through each parameter's names (diloco/model)
  outer state          θᵍ, the outer optimizer's state and the pending Δ (fragment subtrees) like one
                       replica's parameters; the rules' flat buffers (diloco/outer/rules.py shardings)

`state_shardings(layout, state)` gives the shardings of a whole TrainState-shaped tree.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from diloco.axes import TENSOR_RULES, mesh_rules
from diloco.distributed import device_grid
from diloco.model import param_logical_axes

AXES = ("replica", "data", "fsdp", "tensor")


def make_mesh(devices, shape: tuple[int, int, int, int]) -> Mesh:
    """The (replica, data, fsdp, tensor) mesh of `devices` (one slice in order; several: JAX's hybrid mesh)."""
    return Mesh(device_grid(list(devices), tuple(shape)), AXES)


def with_tensor_rules(rules: tuple, tensor: int) -> tuple:
    """`rules` (mesh.rules) with TENSOR_RULES after them for the names they leave out, when tensor > 1; as given
    at tensor 1 (the programs of a run without a tensor axis are unchanged)."""
    named = {name for name, _ in rules}
    return tuple(rules) + (tuple(r for r in TENSOR_RULES if r[0] not in named) if tensor > 1 else ())


def inner_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes of a replica's chips that split a flat outer vector: data, fsdp, and tensor when it is > 1
    (a run without a tensor axis keeps its programs)."""
    return tuple(a for a in ("data", "fsdp", "tensor") if a in mesh.shape and (a != "tensor" or mesh.shape[a] > 1))


def path_keys(path) -> tuple:
    """The dict keys along a tree path (what a parameter path and AdamW's copy of it share)."""
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path
                 if isinstance(k, (jax.tree_util.DictKey, jax.tree_util.GetAttrKey)))


def logical_spec(names: tuple, rules: tuple) -> tuple:
    """Mesh axes per dimension for logical `names` under flax `rules` (earlier rules win a mesh axis)."""
    return tuple(nn.logical_to_mesh_axes(names, rules))


class Layout:
    """Shardings of one run on one mesh: `cfg` (mesh.rules, batch size), the model config (parameter
    names) and R (replicas in the state)."""

    def __init__(self, cfg, mesh: Mesh, mcfg, R: int):
        self.cfg, self.mesh, self.mcfg, self.R = cfg, mesh, mcfg, R
        self.replica_sharding = NamedSharding(mesh, P("replica"))
        self.replicated_sharding = NamedSharding(mesh, P())
        self.batch_sharding = NamedSharding(mesh, P("replica", ("data", "fsdp")))
        n_dev = mesh.devices.size  # the eval batch is split over every device when its rows allow
        self.eval_batch_sharding = (NamedSharding(mesh, P(("replica", "data", "fsdp")))
                                    if (cfg.batch_size // R * R) % n_dev == 0 else self.replicated_sharding)
        self.rules = with_tensor_rules(mesh_rules(cfg), mesh.shape.get("tensor", 1))  # flax logical axis rules
        self._param_names: dict | None = None

    def param_names(self) -> dict:
        """{parameter path (dict keys): its logical axis names} (diloco.model.param_logical_axes)."""
        if self._param_names is None:
            axes = param_logical_axes(self.mcfg)
            flat = jax.tree_util.tree_flatten_with_path(axes, is_leaf=lambda t: isinstance(t, tuple))[0]
            self._param_names = {path_keys(p): names for p, names in flat}
        return self._param_names

    def names_at(self, path) -> tuple | None:
        """Logical names of a leaf of the parameter tree or of a tree shaped like it (AdamW's mu/nu)."""
        keys = path_keys(path)
        names = self.param_names()
        for k in range(len(keys)):  # the longest suffix that is a parameter path
            if keys[k:] in names:
                return names[keys[k:]]
        return None

    def logical_spec(self, names, shape) -> tuple:
        """Per-dimension mesh axes of one (unstacked) parameter from the rules; a mesh axis of size 1, or
        one that does not divide its dimension, is dropped (that dimension stays whole)."""
        if names is None or len(names) != len(shape):
            return (None,) * len(shape)
        out = []
        for d, entry in zip(shape, logical_spec(names, self.rules)):
            axes = tuple(a for a in ((entry,) if isinstance(entry, str) else (entry or ())) if self.mesh.shape[a] > 1)
            k = int(np.prod([self.mesh.shape[a] for a in axes])) if axes else 1
            out.append(None if not axes or d % k else (axes[0] if len(axes) == 1 else axes))
        return tuple(out)

    def param_sharding(self, shape_R, names=None) -> NamedSharding:
        """A replica-stacked leaf (R, …): `replica` on the leading axis, the rest by the logical rules."""
        return NamedSharding(self.mesh, P("replica", *self.logical_spec(names, tuple(shape_R[1:]))))

    def outer_param_sharding(self, shape, names=None) -> NamedSharding:
        """θᵍ (or DP's evaluated parameters): sharded like one replica's parameters, no replica axis."""
        return NamedSharding(self.mesh, P(*self.logical_spec(names, tuple(shape))))

    def outer_param_shardings(self, tree):
        """θᵍ-shaped tree (no replica axis; or the outer optimizer's state over fragment subtrees: a leaf
        named like a parameter, sliced rows of a stacked one included) → its shardings."""
        return jax.tree_util.tree_map_with_path(
            lambda p, x: self.outer_param_sharding(x.shape, self.names_at(p)), tree)

    def outer_opt_sharding(self, path, x) -> NamedSharding:
        """A leaf of the outer optimizer's state (over a fragment's subtree: diloco/outer/sync.py OuterState.opt):
        like the parameter it is named after, else (a step count) a flat vector's."""
        names = self.names_at(path)
        return self.outer_param_sharding(x.shape, names) if names else self.flat_sharding(x.shape)

    def flat_sharding(self, shape) -> NamedSharding:
        """Outer per-fragment flat vectors (pending Δ): over data×fsdp(×tensor) when they divide."""
        axes = inner_axes(self.mesh)
        k = int(np.prod([self.mesh.shape[a] for a in axes]))
        ok = len(shape) == 1 and k > 1 and shape[0] % k == 0
        return NamedSharding(self.mesh, P(axes) if ok else P())

    def activation_rules(self) -> bool:
        """Trace the model under the mesh and rules (activation constraints on): only when a replica's
        parameters are sharded (fsdp > 1 or tensor > 1); otherwise the programs are the same as without rules."""
        return self.mesh.shape["fsdp"] > 1 or self.mesh.shape.get("tensor", 1) > 1

    def in_rules(self, fn, batch_axes: tuple | None | bool = False, outside_shard_map: bool = False):
        """`fn` traced with the mesh and logical rules in context, so the model's activation constraints
        apply (flax needs the mesh set, not only `with mesh`); `batch_axes` overrides the batch rule.
        `outside_shard_map`: `fn` is not traced inside a shard_map (the evaluation), so splash
        attention on more than one device needs the mesh to place its kernel, whatever fsdp is."""
        splash = outside_shard_map and getattr(self.mcfg, "attention", "") == "splash" and self.mesh.devices.size > 1
        if not (self.activation_rules() or splash):
            return fn
        rules = self.rules if batch_axes is False else (("batch", batch_axes),) + tuple(
            r for r in self.rules if r[0] != "batch")
        mesh = self.mesh

        def traced(*args):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(rules):
                return fn(*args)
        return traced

    def state_shardings(self, state: Any) -> Any:
        """The shardings of a TrainState-shaped tree (params/opt replica-stacked; the outer state's)."""
        from diloco.outer import rules

        rep = lambda tree: jax.tree_util.tree_map_with_path(  # noqa: E731
            lambda p, x: self.param_sharding(x.shape, self.names_at(p)) if x.ndim >= 1 else self.replicated_sharding,
            tree)
        outer = None
        if state.outer is not None:
            outer = state.outer.replace(
                params=self.outer_param_shardings(state.outer.params),
                opt=jax.tree_util.tree_map_with_path(self.outer_opt_sharding, state.outer.opt),
                pending=self.outer_param_shardings(state.outer.pending),
                extra=rules.shardings(state.outer.extra, self.mesh))
        return state.replace(params=rep(state.params), opt=rep(state.opt), step=self.replicated_sharding, outer=outer)
