"""Split the parameter pytree into P fragments of transformer blocks, and flatten a fragment.

Blocks go to fragments by `pattern`:
  sequential: block i → fragment ⌊i·P/L⌋      (fragment 0 = blocks 0,1,2 at 3 per fragment)
  strided:    block i → fragment i mod P      (fragment 0 = blocks 0, P, 2P, …; the paper's default)
Parameters outside the blocks (tied embedding, final norm) follow `embed_fragment`:
  first: with block 0's fragment · last: with block L−1's fragment · own: an extra fragment P.
A fragment is a static list of (leaf, rows): whole leaves, or rows of the leading layer axis when
blocks are stacked by nn.scan. `flatten` gathers them into one fp32 vector; `unflatten` scatters back.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diloco.errors import ConfigError
from diloco.outer.methods import num_fragments

PATTERNS = ("sequential", "strided")
_BLOCK_RE = re.compile(r"^block_(\d+)$")


def block_fragment(i: int, layers: int, P: int, pattern: str) -> int:
    if pattern == "sequential":
        return (i * P) // layers
    if pattern == "strided":
        return i % P
    raise ConfigError("pattern", f"{pattern!r} is not one of {PATTERNS}")


@dataclasses.dataclass(frozen=True)
class Fragments:
    """parts[p] = ((leaf index, rows or None), …); names[p] = readable parameter names."""
    parts: tuple[tuple[tuple[int, tuple[int, ...] | None], ...], ...]
    names: tuple[tuple[str, ...], ...]
    sizes: tuple[int, ...]
    treedef: Any
    shapes: tuple[tuple[int, ...], ...]

    @property
    def P(self) -> int:
        return len(self.parts)

    def flatten(self, tree, p: int) -> jax.Array:
        """Fragment p of one (un-replicated) parameter tree as a float32 vector (n_p,)."""
        leaves = jax.tree_util.tree_leaves(tree)
        chunks = [(leaves[i] if rows is None else leaves[i][np.asarray(rows)]).reshape(-1)
                  for i, rows in self.parts[p]]
        return jnp.concatenate([c.astype(jnp.float32) for c in chunks])

    def unflatten(self, tree, p: int, vec: jax.Array):
        """`tree` with fragment p replaced by `vec` (n_p,)."""
        leaves = list(jax.tree_util.tree_leaves(tree))
        off = 0
        for i, rows in self.parts[p]:
            leaf = leaves[i]
            if rows is None:
                n = leaf.size
                leaves[i] = vec[off:off + n].reshape(leaf.shape).astype(leaf.dtype)
            else:
                shape = (len(rows),) + leaf.shape[1:]
                n = int(np.prod(shape))
                leaves[i] = leaf.at[np.asarray(rows)].set(vec[off:off + n].reshape(shape).astype(leaf.dtype))
            off += n
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def mask_tree(self, tree, p: int):
        """A tree of bools, True where a parameter element belongs to fragment p."""
        leaves = jax.tree_util.tree_leaves(tree)
        masks = [np.zeros(l.shape, bool) for l in leaves]
        for i, rows in self.parts[p]:
            if rows is None:
                masks[i][...] = True
            else:
                masks[i][np.asarray(rows)] = True
        return jax.tree_util.tree_unflatten(self.treedef, masks)


def _path_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def make_fragments(params, layers: int, layers_per_fragment: int = 0, fragments: int = 0,
                   pattern: str = "strided", embed_fragment: str = "first") -> Fragments:
    """Assign every parameter (or stacked row) of `params` to a fragment."""
    if pattern not in PATTERNS:
        raise ConfigError("pattern", f"{pattern!r} is not one of {PATTERNS}")
    P_total = num_fragments(layers, layers_per_fragment, fragments, embed_fragment)
    P = P_total - (embed_fragment == "own")
    embed_p = {"first": block_fragment(0, layers, P, pattern),
               "last": block_fragment(layers - 1, layers, P, pattern), "own": P}[embed_fragment]
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    parts: list[list] = [[] for _ in range(P_total)]
    names: list[list[str]] = [[] for _ in range(P_total)]
    sizes = [0] * P_total
    for i, (path, leaf) in enumerate(flat):
        name = _path_name(path)
        keys = [str(getattr(k, "key", k)) for k in path]
        blk = next((int(m.group(1)) for k in keys if (m := _BLOCK_RE.match(k))), None)
        if "blocks" in keys:  # nn.scan: leading axis is the layer
            by_p: dict[int, list[int]] = {}
            for row in range(leaf.shape[0]):
                by_p.setdefault(block_fragment(row, layers, P, pattern), []).append(row)
            for p, rows in by_p.items():
                parts[p].append((i, tuple(rows)))
                names[p].append(f"{name}[{','.join(map(str, rows))}]")
                sizes[p] += len(rows) * int(np.prod(leaf.shape[1:]))
            continue
        p = embed_p if blk is None else block_fragment(blk, layers, P, pattern)
        parts[p].append((i, None))
        names[p].append(name)
        sizes[p] += int(np.prod(leaf.shape))
    for p in range(P_total):
        if not parts[p]:
            raise ConfigError("fragments", f"fragment {p} would be empty; use fewer fragments")
    return Fragments(tuple(tuple(x) for x in parts), tuple(tuple(n) for n in names), tuple(sizes),
                     treedef, tuple(tuple(l.shape) for _, l in flat))
