"""Draft trees with static shapes: layout, ancestry masks, node selection and LSE-merged attention.

A tree of one cycle is ``T = max_tree_nodes + 1`` rows per sequence (row 0 = the root, the last emitted token at
position ``length``; rows 1.. = drafted nodes ordered by depth, so a parent's row is always smaller than its
children's). Padding rows are marked invalid. A depth-d node sits at RoPE position ``length + d`` in the target
(and local ``n + d`` in the draft's working cache); in the target's KV cache it is written at row ``length + i``
(its block index), and after verification the accepted path is moved to consecutive rows
(:func:`diffspec_jax.cache.move_rows`).

Construction (EAGLE's dynamic tree, docs/method.md section 9): the root's top ``w`` draft tokens form depth 1; each
further level runs the frontier (``w`` nodes) through the draft in one batch, each node keeps its top
``caps[d]`` children scored by cumulative draft log-probability, and the best ``w`` of those become the next
frontier. Every candidate joins a pool; the final tree is the ``budget`` best-scored pool entries. Scores never
increase along a path, and ties are broken toward the lower pool index (parents precede children), so the
selection is ancestry-closed; :func:`select_nodes` still enforces closure explicitly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from diffspec_jax.errors import InputError
from diffspec_jax.models import layers


@struct.dataclass
class Tree:
    """One cycle's draft trees (batch-first, ``T = max_tree_nodes + 1`` rows; row 0 = root).

    Attributes:
        tokens: int32 ``[B, T]`` target token ids (row 0: the root token).
        parents: int32 ``[B, T]`` parent row (``-1`` for the root and padding rows).
        depth: int32 ``[B, T]`` depth (root 0).
        valid: bool ``[B, T]`` real rows (row 0 always).
    """

    tokens: jax.Array
    parents: jax.Array
    depth: jax.Array
    valid: jax.Array

    @property
    def size(self) -> jax.Array:
        """int32 ``[B]`` drafted nodes (the root excluded)."""
        return jnp.sum(self.valid, axis=1).astype(jnp.int32) - 1


def validate_parents(parents) -> None:
    """Host check of a parent vector (row 0 = root with parent ``-1``; every other parent precedes its child).

    Raises:
        InputError: naming the first offending row.
    """
    p = np.asarray(parents)
    if p.ndim != 1 or p.size == 0 or p[0] != -1:
        raise InputError(f"a tree's row 0 must be the root with parent -1, got parents {p.tolist()}")
    for i in range(1, p.size):
        if not 0 <= p[i] < i:
            raise InputError(f"tree row {i} has parent {int(p[i])}: parents must precede their children "
                             f"(0 <= parent < row)")


def ancestry_mask(parents: jax.Array, valid: jax.Array, max_depth: int) -> jax.Array:
    """bool ``[B, T, T]``: ``mask[b, i, j]`` = row j is row i or one of its ancestors (invalid rows see only
    themselves).

    Args:
        parents: int32 ``[B, T]`` (``-1`` = no parent); valid: bool ``[B, T]``; max_depth: the deepest depth.
    """
    t = parents.shape[1]
    eye = jnp.eye(t, dtype=jnp.float32)[None]
    step = jax.nn.one_hot(jnp.where(valid, parents, -1), t, dtype=jnp.float32)  # [B, T, T]: row -> its parent
    mask, reach = eye, eye
    for _ in range(max_depth):
        reach = jnp.einsum("bij,bjk->bik", reach, step)
        mask = mask + reach
    return mask > 0


def merge_attention(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array) -> jax.Array:
    """Softmax attention over two disjoint key sets (:func:`diffspec_jax.models.layers.merge_attention`, output
    only). out_a, out_b: ``[B, T, H, D]``; lse_a, lse_b: float32 ``[B, T, H]``."""
    return layers.merge_attention(out_a, lse_a, out_b, lse_b)[0]


def select_nodes(scores: jax.Array, pool_parent: jax.Array, pool_tokens: jax.Array, pool_depth: jax.Array,
                 budget: jax.Array, num_nodes: int, root_token: jax.Array, max_depth: int) -> Tree:
    """The final tree: the ``budget`` best-scored pool candidates, ordered by pool index, as a :class:`Tree`.

    Args:
        scores: float32 ``[B, P]`` cumulative draft log-probabilities (``-inf`` = not a candidate); the pool is
            ordered so that every parent's index is smaller than its children's.
        pool_parent: int32 ``[B, P]`` parent pool index (``-1`` = the root).
        pool_tokens, pool_depth: int32 ``[B, P]``.
        budget: int32 ``[B]`` nodes to keep (<= num_nodes); num_nodes: the static node capacity N.
        root_token: int32 ``[B]``.
    Returns:
        a :class:`Tree` of ``N + 1`` rows.
    """
    b, p = scores.shape
    order = jnp.argsort(-scores, axis=1, stable=True)[:, :num_nodes]  # best first, ties -> lower pool index
    rank = jnp.arange(num_nodes)[None, :]
    keep = (rank < budget[:, None]) & jnp.isfinite(jnp.take_along_axis(scores, order, axis=1))
    big = jnp.iinfo(jnp.int32).max
    sel = jnp.sort(jnp.where(keep, order, big), axis=1)  # kept pool indices ascending, padding last
    ok = sel < big
    sel = jnp.where(ok, sel, 0)
    row_of = jnp.full((b, p + 1), -1, jnp.int32)  # pool index + 1 -> tree row (column 0: the root -> row 0)
    row_of = row_of.at[:, 0].set(0)
    rows = jnp.arange(1, num_nodes + 1, dtype=jnp.int32)[None, :]
    bidx = jnp.arange(b)[:, None]
    row_of = row_of.at[bidx, jnp.where(ok, sel + 1, p + 1)].set(jnp.broadcast_to(rows, sel.shape), mode="drop")
    parent = jnp.take_along_axis(row_of, jnp.take_along_axis(pool_parent, sel, axis=1) + 1, axis=1)
    valid = ok & (parent >= 0)
    full_valid = jnp.concatenate([jnp.ones((b, 1), bool), valid], axis=1)
    parents = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), jnp.where(valid, parent, -1)], axis=1)
    for _ in range(max_depth):  # closure: a node whose parent is not in the tree is dropped (with its subtree)
        full_valid = full_valid & ((parents < 0) | jnp.take_along_axis(full_valid, jnp.maximum(parents, 0), axis=1))
        full_valid = full_valid.at[:, 0].set(True)
    parents = jnp.where(full_valid, parents, -1)
    tokens = jnp.concatenate([root_token[:, None], jnp.take_along_axis(pool_tokens, sel, axis=1)], axis=1)
    depth = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.take_along_axis(pool_depth, sel, axis=1)], axis=1)
    return Tree(tokens=jnp.where(full_valid, tokens, 0).astype(jnp.int32), parents=parents.astype(jnp.int32),
                depth=jnp.where(full_valid, depth, 0).astype(jnp.int32), valid=full_valid)
