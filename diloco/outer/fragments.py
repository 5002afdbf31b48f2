"""Split the parameter pytree into P fragments of transformer blocks, and flatten a fragment.

Blocks go to fragments by `pattern`:
  sequential: block i → fragment ⌊i·P/L⌋      (fragment 0 = blocks 0,1,2 at 3 per fragment)
  strided:    block i → fragment i mod P      (fragment 0 = blocks 0, P, 2P, …; the paper's default)
Parameters outside the blocks (tied embedding, final norm) follow `embed_fragment`:
  first: with block 0's fragment · last: with block L−1's fragment · own: an extra fragment P.
A fragment is a static list of (leaf, rows): whole leaves, or rows of the leading layer axis when
blocks are stacked by nn.scan. `flatten` gathers them into one fp32 vector (the wire and the pending
slot); `unflatten` scatters back. `subtree` holds them keyed like the parameters (the outer optimizer's view).
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
    keys: tuple[tuple[str, ...], ...] = ()  # each leaf's path (dict keys): `subtree`'s nesting

    @property
    def P(self) -> int:
        return len(self.parts)

    # -- one compiled program per layout: the rows of a stacked leaf as (start, stride, count) --------
    def layout(self, p: int) -> tuple:
        """What a compiled program of fragment p depends on: each part's leaf and, for rows of a stacked
        leaf, their (count, stride) when they form an arithmetic progression (the rows themselves when
        not). Fragments of equal layout share one program; `starts(p)` is its argument."""
        def rows_key(i, rows):
            if rows is None:
                return None
            stride = self._stride(i, rows)
            return ("ap", len(rows), stride) if stride else ("rows", rows)
        return tuple((i, rows_key(i, rows)) for i, rows in self.parts[p])

    def _stride(self, i: int, rows: tuple[int, ...]) -> int:
        """The stride of `rows` of stacked leaf i when a program can read them at a traced start without a
        copy: contiguous rows (stride 1: one dynamic slice), or one row in every `stride` of the whole stack
        (count·stride = the stack's rows: one column of a (count, stride, …) view, the strided pattern);
        0 otherwise (the fragment keeps a program of its own, with static rows)."""
        steps = {b - a for a, b in zip(rows, rows[1:])}
        stride = steps.pop() if len(steps) == 1 else 1 if not steps else 0
        return stride if stride == 1 or (stride and len(rows) * stride == self.shapes[i][0]) else 0

    def starts(self, p: int) -> np.ndarray:
        """(parts with rows,) int32: the first row of each stacked part of fragment p."""
        return np.asarray([rows[0] for _, rows in self.parts[p] if rows is not None], np.int32)

    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Fragments sharing one layout (so one compiled program each), in fragment order."""
        by: dict[tuple, list[int]] = {}
        for p in range(self.P):
            by.setdefault(self.layout(p), []).append(p)
        return tuple(tuple(g) for g in sorted(by.values()))

    def _windows(self, p: int, starts):
        """(leaf index, rows, window) per part: with `starts` (a traced (parts,) int32) a part's rows are read
        at its start as (start, stride, count) (`_stride`): the same program for every fragment of this
        layout; window None: static rows."""
        j = 0
        for i, rows in self.parts[p]:
            if rows is None:
                yield i, None, None
                continue
            stride = self._stride(i, rows) if starts is not None else 0
            yield i, rows, ((starts[j], stride, len(rows)) if stride else None)
            j += 1

    def pieces(self, tree, p: int, starts=None) -> list[jax.Array]:
        """Fragment p of one (un-replicated) parameter tree as its parts, in order: whole leaves, or a
        stacked leaf's rows (count, …). With `starts` (`starts(q)` of any fragment q of p's layout,
        traced) the rows are read at those starts."""
        leaves = jax.tree_util.tree_leaves(tree)
        out = []
        for i, rows, win in self._windows(p, starts):
            leaf = leaves[i]
            if rows is None:
                x = leaf
            elif win is None:
                x = leaf[np.asarray(rows)]
            elif win[1] == 1:
                x = jax.lax.dynamic_slice_in_dim(leaf, win[0], win[2], axis=0)
            else:  # one column of the (count, stride, …) view of the stack: no copy of other rows
                start, stride, count = win
                x = jax.lax.dynamic_index_in_dim(leaf.reshape((count, stride) + leaf.shape[1:]), start, axis=1,
                                                 keepdims=False)
            out.append(x)
        return out

    def flatten(self, tree, p: int, starts=None) -> jax.Array:
        """Fragment p of one parameter tree as a float32 vector (n_p,): its `pieces` end to end."""
        return jnp.concatenate([x.reshape(-1).astype(jnp.float32) for x in self.pieces(tree, p, starts)])

    def split(self, vec: jax.Array, p: int) -> list[jax.Array]:
        """A fragment's flat vector (n_p,) cut into its pieces' shapes (the inverse of `flatten`'s join)."""
        out, off = [], 0
        for i, rows in self.parts[p]:
            shape = self.shapes[i] if rows is None else (len(rows),) + self.shapes[i][1:]
            n = int(np.prod(shape))
            out.append(vec[off:off + n].reshape(shape))
            off += n
        return out

    def unflatten(self, tree, p: int, vec: jax.Array, starts=None):
        """`tree` with fragment p replaced by `vec` (n_p,) (at `starts`, as in `flatten`)."""
        return self.unpieces(tree, p, self.split(vec, p), starts)

    def unpieces(self, tree, p: int, xs, starts=None):
        """`tree` with fragment p's pieces replaced by `xs` (shaped as `pieces` gives them)."""
        leaves = list(jax.tree_util.tree_leaves(tree))
        for (i, rows, win), x in zip(self._windows(p, starts), xs):
            leaf = leaves[i]
            new = x.astype(leaf.dtype)
            if rows is None:
                leaves[i] = new
            elif win is None:
                leaves[i] = leaf.at[np.asarray(rows)].set(new)
            elif win[1] == 1:
                leaves[i] = jax.lax.dynamic_update_slice_in_dim(leaf, new, win[0], axis=0)
            else:
                start, stride, count = win
                view = leaf.reshape((count, stride) + leaf.shape[1:])
                leaves[i] = jax.lax.dynamic_update_index_in_dim(view, new, start, axis=1).reshape(leaf.shape)
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    # -- fragment p as a subtree of the parameters (the outer optimizer's view: one leaf per piece) -----
    def subtree(self, xs, p: int) -> dict:
        """Pieces of fragment p (`pieces` / `split`) as a nested dict keyed like the parameters; its
        leaves (`jax.tree_util.tree_leaves`) are the pieces in order, as the parameters' dicts are sorted."""
        out: dict = {}
        for (i, _), x in zip(self.parts[p], xs):
            *head, last = self.keys[i]
            d = out
            for k in head:
                d = d.setdefault(k, {})
            d[last] = x
        return out

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
                     treedef, tuple(tuple(l.shape) for _, l in flat),
                     tuple(tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path) for path, _ in flat))
