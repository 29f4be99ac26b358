"""Parameter tables: one declaration per parameter, from which shapes, random init, tensor-parallel layout and
the Hugging Face checkpoint layout are all derived.

A model's table (``param_table(config, ...)`` in :mod:`~diffspec_jax.models.llama`,
:mod:`~diffspec_jax.models.qwen35`, :mod:`~diffspec_jax.models.eagle3`) is a tuple of :class:`Param`, one per leaf
of its params pytree, built from the config. Each row says

* where the leaf sits (``path``, e.g. ``("layers", 3, "wq")``) and its ``shape``;
* its logical ``axes`` (a name or ``None`` per dimension); :data:`AXIS_RULES` say how each name is laid out over
  the tensor-parallel mesh axis (split, KV heads repeated, vocabulary padded, fused q/k/v groups regrouped);
* the Hugging Face tensor it is stored as (``hf``) and how (``transform``: PyTorch ``Linear`` ``[out, in]`` or
  a copy, ...); rows that share one tensor (e.g. Qwen3.5's ``q_proj`` = query and gate) carry the same ``hf`` and
  a :class:`Joint` saying how their parts are concatenated, in the table's order;
* its random initialisation (``init``, a callable ``(rng, shape, scale) -> ndarray``).

Derived here: :func:`shapes`, :func:`init`, :func:`partition_specs`, :func:`shard` (the tensor-parallel layout of
given params), :func:`hf_names` and :func:`hf_tensors` / :func:`from_hf` / :func:`to_hf` (what
:mod:`checkpoints_tools.hf` reads and writes). Adding a model is one module with its forward functions and its table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from diffspec_jax.mesh import TP, kv_heads_for

Path = tuple  # ("embed",) or ("layers", 3, "wq")

#: logical axes (what a table's ``axes`` name) -> how they are laid out over the ``tp`` mesh axis:
#: ``split``: sharded as they are (the size must divide by tp; checked by :mod:`diffspec_jax.sharding`);
#: ``repeat``: KV-type heads, each repeated up to :func:`~diffspec_jax.mesh.kv_heads_for` heads, then sharded;
#: ``pad``: the vocabulary, padded with zero rows to a multiple of tp, then sharded;
#: ``regroup``: the KV groups of a fused ``wqkv [H, Hkv, G + 2, D]``, regrouped like repeated KV heads, then sharded
AXIS_RULES = {
    "heads": "split", "mlp": "split", "linear_value_heads": "split",
    "kv_heads": "repeat", "linear_key_heads": "repeat",
    "vocab": "pad",
    "kv_groups": "regroup",
}


# ------------------------------------------------------------------------------------------------ init rules
@dataclass(frozen=True)
class Normal:
    """``mean + std * N(0, 1)``; ``std=None`` takes the ``scale`` passed to :func:`init`."""

    mean: float = 0.0
    std: float | None = None

    def __call__(self, rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> np.ndarray:
        x = (scale if self.std is None else self.std) * rng.standard_normal(shape)
        return x if self.mean == 0.0 else self.mean + x


@dataclass(frozen=True)
class LogUniform:
    """``log(U(low, high))`` (e.g. decay rates whose exponent lies in ``[low, high]``)."""

    low: float
    high: float

    def __call__(self, rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> np.ndarray:
        return np.log(rng.uniform(self.low, self.high, shape))


#: a weight: normal with the ``scale`` given to :func:`init`
WEIGHT = Normal()
#: an RMSNorm weight around one, never all ones (so a norm weight lost on the way is caught)
NORM = Normal(1.0, 0.2)


# ------------------------------------------------------------------------------------ checkpoint transforms
@dataclass(frozen=True)
class Copy:
    """Stored as it is."""

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(shape)

    def load(self, a, shape):
        return a

    def save(self, a, shape):
        return a


@dataclass(frozen=True)
class Linear:
    """A PyTorch ``Linear`` weight ``[out, in]``, held as ``[*in dims, *out dims]`` (the first ``n_in`` dims are the
    input; head axes explicit, e.g. ``wq [H, Hq, D]`` from ``q_proj [Hq * D, H]``, ``wo [Hq, D, H]`` with
    ``n_in=2``)."""

    n_in: int = 1

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return math.prod(shape[self.n_in:]), math.prod(shape[: self.n_in])

    def load(self, a, shape):
        return a.T.reshape(shape)

    def save(self, a, shape):
        return a.reshape(math.prod(shape[: self.n_in]), math.prod(shape[self.n_in:])).T


@dataclass(frozen=True)
class SwapLast:
    """Stored with the last two axes swapped (MoE experts ``[E, out, in]`` on disk, ``[E, in, out]`` here)."""

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(shape[:-2]) + (shape[-1], shape[-2])

    def load(self, a, shape):
        return a.swapaxes(-1, -2)

    def save(self, a, shape):
        return a.swapaxes(-1, -2)


@dataclass(frozen=True)
class DepthwiseConv:
    """A depthwise ``Conv1d`` weight ``[channels, 1, W]``, held taps first as ``[W, *channel dims]``."""

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return math.prod(shape[1:]), 1, shape[0]

    def load(self, a, shape):
        return a[:, 0, :].T.reshape(shape)

    def save(self, a, shape):
        return a.reshape(shape[0], -1).T[:, None, :]


@dataclass(frozen=True)
class Joint:
    """Several rows stored as one tensor: their stored forms concatenated along ``axis`` in table order, in
    ``groups`` interleaved blocks (``groups=Hq`` for a per-head interleaved ``[query | gate]`` projection)."""

    axis: int = 0
    groups: int = 1


# -------------------------------------------------------------------------------------------------- the row
@dataclass(frozen=True)
class Param:
    """One parameter (one leaf of a params pytree).

    Attributes:
        path: where the leaf sits, e.g. ``("layers", 3, "wq")``.
        shape: its shape in the params layout.
        axes: one logical axis name (a key of :data:`AXIS_RULES`) or ``None`` per dimension; at most one named.
        hf: the Hugging Face tensor it is stored as (``None``: not stored in the checkpoint's float tensors:
            handled by its loader, or a serving-only leaf).
        transform: how it is laid out in that tensor (:class:`Copy`, :class:`Linear`, ...).
        joint: set when several rows share ``hf`` (see :class:`Joint`).
        init: ``(rng, shape, scale) -> ndarray`` (default :data:`WEIGHT`).
        dtype: a fixed dtype (e.g. ``"int32"`` for an index table); ``None``: the model's dtype.
    """

    path: Path
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    hf: str | None = None
    transform: Any = Copy()
    joint: Joint | None = None
    init: Callable[[np.random.Generator, tuple[int, ...], float], np.ndarray] = WEIGHT
    dtype: str | None = None

    def __post_init__(self):
        if len(self.axes) != len(self.shape):
            raise ValueError(f"{self.path}: {len(self.axes)} axes for a {len(self.shape)}-d shape {self.shape}")
        named = [a for a in self.axes if a is not None]
        if len(named) > 1 or any(a not in AXIS_RULES for a in named):
            raise ValueError(f"{self.path}: axes {self.axes} must name at most one of {sorted(AXIS_RULES)}")
        if self.joint is not None and self.hf is None:
            raise ValueError(f"{self.path}: a joint row needs its tensor name")

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """This row's part in its stored form."""
        return self.transform.hf_shape(self.shape)


Table = tuple[Param, ...]


# ------------------------------------------------------------------------------------------------ pytrees
def get_leaf(tree: Any, path: Path) -> Any:
    """The leaf of ``tree`` at ``path``."""
    for key in path:
        tree = tree[key]
    return tree


def set_leaf(tree: dict, path: Path, value: Any) -> None:
    """Put ``value`` at ``path``, creating dicts (string keys) and lists (integer keys) on the way."""
    node = tree
    for key, nxt in zip(path[:-1], path[1:]):
        if isinstance(key, int):
            while len(node) <= key:
                node.append({} if not isinstance(nxt, int) else [])
            node = node[key]
        else:
            node = node.setdefault(key, [] if isinstance(nxt, int) else {})
    node[path[-1]] = value


def build(table: Table, leaf: Callable[[Param], Any]) -> dict:
    """The params-shaped pytree with ``leaf(row)`` at every row's path."""
    out: dict = {}
    for p in table:
        set_leaf(out, p.path, leaf(p))
    return out


def is_shape(x: Any) -> bool:
    """A shape tuple (a leaf of :func:`shapes`)."""
    return isinstance(x, tuple) and all(isinstance(n, int) for n in x)


def _path_of(keypath) -> Path:
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in keypath)


def leaf_paths(tree: Any, is_leaf=None) -> list[Path]:
    """The paths of a pytree's leaves in JAX's flattening order (dict keys sorted)."""
    return [_path_of(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]]


# ----------------------------------------------------------------------------------------------- derived
def shapes(table: Table) -> dict:
    """The params pytree with shape tuples as leaves (the layout every loader must produce)."""
    return build(table, lambda p: tuple(p.shape))


def init(table: Table, seed: int = 0, dtype=jnp.float32, scale: float = 0.08, *, order: str = "tree",
         fixed: dict[Path, Any] | None = None) -> dict:
    """Random params for tests and demos: each row's ``init`` drawn from one ``np.random.default_rng(seed)``.

    Args:
        scale: the standard deviation of :data:`WEIGHT` rows.
        order: the order rows draw in: ``"tree"`` (JAX's flattening order of the params, dict keys sorted) or
            ``"declared"`` (the table's); part of what a seed means, so fixed per model.
        fixed: values for some paths (nothing is drawn for them).
    """
    if order not in ("tree", "declared"):
        raise ValueError(f"order must be 'tree' or 'declared', got {order!r}")
    rows = {p.path: p for p in table}
    paths = list(rows) if order == "declared" else leaf_paths(shapes(table), is_leaf=is_shape)
    fixed = fixed or {}
    rng = np.random.default_rng(seed)
    out: dict = {}
    for path in paths:
        p = rows[path]
        value = fixed[path] if path in fixed else p.init(rng, p.shape, scale)
        set_leaf(out, path, jnp.asarray(value, p.dtype or dtype))
    return out


def partition_specs(table: Table, axis: str = TP) -> dict:
    """The PartitionSpec of every leaf: the dimension with a logical axis over ``axis``; ``P()`` for
    replicated leaves."""
    def spec(p: Param) -> P:
        return P(*(axis if a is not None else None for a in p.axes)) if any(p.axes) else P()

    return build(table, spec)


def shard(table: Table, params: Any, tp: int) -> dict:
    """``params`` (laid out as ``table`` declares) in the ``tp``-way tensor-parallel layout of
    :data:`AXIS_RULES`: KV-type heads repeated, the vocabulary padded, fused q/k/v groups regrouped; the
    partition specs are :func:`partition_specs` of the same table."""
    ours = {p.path for p in table}
    theirs = set(leaf_paths(params))
    if ours != theirs:
        raise ValueError(f"params do not match their table: missing {sorted(ours - theirs)[:3]}, unknown "
                         f"{sorted(theirs - ours)[:3]}")
    return build(table, lambda p: _lay_out(p, get_leaf(params, p.path), tp))


def _lay_out(p: Param, x: jax.Array, tp: int) -> jax.Array:
    named = [(i, a) for i, a in enumerate(p.axes) if a is not None]
    if not named:
        return x
    i, name = named[0]
    rule = AXIS_RULES[name]
    if rule == "repeat":
        heads = kv_heads_for(x.shape[i], tp, f"parameter {'.'.join(map(str, p.path))}")
        return jnp.repeat(x, heads // x.shape[i], axis=i) if heads != x.shape[i] else x
    if rule == "pad":
        pad = (-x.shape[i]) % tp
        if not pad:
            return x
        widths = [(0, 0)] * x.ndim
        widths[i] = (0, pad)
        return jnp.pad(x, widths)
    if rule == "regroup":
        return _regroup_qkv(x, kv_heads_for(x.shape[i], tp, f"parameter {'.'.join(map(str, p.path))}"))
    return x


def _regroup_qkv(w: jax.Array, groups: int) -> jax.Array:
    """A fused ``wqkv [H, Hkv, G + 2, D]`` (:func:`diffspec_jax.models.llama.fuse_projections`) as ``groups``
    KV groups: with more groups than KV heads, each head's G queries are split in ``r = groups / Hkv`` parts and
    every part gets a copy of the head's key and value (the fused form of repeating KV heads)."""
    h, hkv, g2, d = w.shape
    r = groups // hkv
    if r == 1:
        return w
    q = w[:, :, : g2 - 2].reshape(h, hkv, r, (g2 - 2) // r, d)
    kv = jnp.broadcast_to(w[:, :, None, g2 - 2:], (h, hkv, r, 2, d))
    return jnp.concatenate([q, kv], axis=3).reshape(h, groups, (g2 - 2) // r + 2, d)


# ---------------------------------------------------------------------------------------------- checkpoints
def hf_names(table: Table) -> dict[Path, str]:
    """Leaf path -> the Hugging Face tensor it is read from (rows stored in the checkpoint only)."""
    return {p.path: p.hf for p in table if p.hf is not None}


def hf_tensors(table: Table) -> dict[str, tuple[Param, ...]]:
    """Hugging Face tensor name -> the rows stored in it (one, or the parts of a joint tensor in table order),
    in the order the tensors first appear in the table."""
    out: dict[str, list[Param]] = {}
    for p in table:
        if p.hf is not None:
            out.setdefault(p.hf, []).append(p)
    for name, rows in out.items():
        if len(rows) > 1 and (rows[0].joint is None or any(r.joint != rows[0].joint for r in rows)):
            raise ValueError(f"rows {[r.path for r in rows]} share tensor {name!r} without one Joint")
    return {name: tuple(rows) for name, rows in out.items()}


def hf_shape(rows: tuple[Param, ...]) -> tuple[int, ...]:
    """The stored shape of the tensor holding ``rows`` (see :func:`hf_tensors`)."""
    if len(rows) == 1:
        return rows[0].hf_shape
    axis = rows[0].joint.axis
    first = list(rows[0].hf_shape)
    first[axis] = sum(r.hf_shape[axis] for r in rows)
    return tuple(first)


def from_hf(rows: tuple[Param, ...], a: np.ndarray) -> list[np.ndarray]:
    """The leaves of ``rows`` from their stored tensor ``a`` (one per row)."""
    if len(rows) == 1:
        return [rows[0].transform.load(a, rows[0].shape)]
    axis, groups = rows[0].joint.axis, rows[0].joint.groups
    sizes = [r.hf_shape[axis] // groups for r in rows]
    blocks = a.reshape(a.shape[:axis] + (groups, sum(sizes)) + a.shape[axis + 1:])
    parts = np.split(blocks, np.cumsum(sizes)[:-1], axis=axis + 1)
    return [r.transform.load(part.reshape(r.hf_shape), r.shape) for r, part in zip(rows, parts)]


def to_hf(rows: tuple[Param, ...], leaves: list) -> np.ndarray:
    """The stored tensor of ``rows`` from their leaves (the inverse of :func:`from_hf`)."""
    if len(rows) == 1:
        return rows[0].transform.save(leaves[0], rows[0].shape)
    axis, groups = rows[0].joint.axis, rows[0].joint.groups
    parts = []
    for r, x in zip(rows, leaves):
        s = r.hf_shape
        parts.append(r.transform.save(x, r.shape).reshape(s[:axis] + (groups, s[axis] // groups) + s[axis + 1:]))
    return np.concatenate(parts, axis=axis + 1).reshape(hf_shape(rows))
