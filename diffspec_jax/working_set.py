"""The self-draft's working set: a compact copy of the target's own KV rows that the target drafts over.

With ``generate(target, "self", ...)`` the target proposes its K tokens with the same weights, but every attention
layer reads this working set instead of the full cache (docs/self_drafting.md); verification still reads the full
cache. The working set holds, per attention layer, ``[B, Hkv, W, D]`` buffers (heads first, like the target cache;
W = Hb + K rounded up to a multiple of 64, Hb = ``SpecConfig.history_budget``):

* slots ``0 .. n_anchor - 1``: the **anchor** tokens (complete chunks: the sink chunk 0, plus DiffSpec's selected
  chunks), ascending;
* slots ``n_anchor .. n_anchor + count - 1``: the **window**, a ring of ``R = Hb - n_anchor`` slots holding the most
  recent other committed positions; ``ptr`` is the slot (relative to ``n_anchor``) the next committed token
  overwrites, the oldest once the ring is full;
* slots ``n .. n + K - 1`` (``n = n_anchor + count``): the draft steps' own K/V of the current cycle (stale rows from
  earlier cycles lie past the step being run, so they are never visible).

The rows are the target cache's rows themselves, copied: keys are stored post-RoPE at their absolute positions, so
nothing is re-rotated, and a draft step rotates its own token at its absolute position too (``rope_positions``).
Attention is order-free, so the slots need not be sorted; ``pos`` records which absolute position each history
slot holds (``-1``: empty).

Two updates keep it equal, as a set, to ``anchors + the most recent Hb - |anchor tokens| other positions < length``
(the history of :func:`diffspec_jax.working_cache.history_indices`, docs/method.md section 3.2, with the root
included, since the self-draft runs the token after it):

* :func:`rebuild`, when a sequence's anchors differ from those it was built from: gather every history row of every
  layer from the target cache (one read of ``Hb`` rows per layer);
* :func:`append`, every other cycle: the target's K/V of the tokens the last verification committed (at most
  K + 1) enter the ring, overwriting its oldest rows. New positions are never anchor tokens (anchors are complete
  chunks before the newest one), so the ring keeps exactly the most recent ``R`` non-anchor positions.

:func:`refresh` does both (the rebuild under ``lax.cond``, only on cycles where some sequence needs it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P

from diffspec_jax.cache import round_capacity, write_rows
from diffspec_jax.config import ModelConfig, SpecConfig
from diffspec_jax.mesh import kv_heads_for
from diffspec_jax.working_cache import history_indices

#: sentinel of :attr:`WorkingSet.built` before the first build (no anchors row equals it)
UNBUILT = -2
#: window positions sort after anchor positions in :func:`layout` (positions stay far below it)
_WINDOW_KEY = 1 << 30
#: the slots per layer are a multiple of this
WIDTH_MULTIPLE = 64


@struct.dataclass
class WorkingSet:
    """The self-draft's working set of a batch (see the module docstring).

    Attributes:
        k, v: one ``[B, Hkv_local, W, D]`` buffer per attention layer (the target cache's ``k`` / ``v`` order).
        pos: int32 ``[B, Hb]`` the absolute position held in each history slot, ``-1`` for an empty slot.
        n_anchor: int32 ``[B]`` anchor tokens (slots ``0 .. n_anchor - 1``); count: int32 ``[B]`` window tokens;
        ptr: int32 ``[B]`` the ring slot (``0 .. Hb - n_anchor - 1``) the next committed token takes.
        built: int32 ``[B, A]`` the anchor chunks of the last rebuild (``UNBUILT`` before the first).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    pos: jax.Array
    n_anchor: jax.Array
    count: jax.Array
    ptr: jax.Array
    built: jax.Array

    @property
    def length(self) -> jax.Array:
        """int32 ``[B]`` history tokens n; the draft's chain runs at slots ``n ..``."""
        return self.n_anchor + self.count

    def pools(self) -> tuple:
        """The leaves a paged state's rows share: none (a working set is per row; see
        :meth:`diffspec_jax.working_cache.DraftCache.pools`)."""
        return None, None

    def with_pools(self, store_k, store_v) -> WorkingSet:
        return self

    @classmethod
    def create(cls, config: ModelConfig, spec: SpecConfig, batch: int, dtype, *, tp: int = 1) -> WorkingSet:
        """Zero buffers for ``config``'s attention layers at ``spec``'s budget (global shapes of a ``tp``-way layout,
        KV heads repeated as in :func:`diffspec_jax.cache.create_cache`)."""
        shape = (batch, kv_heads_for(config.num_key_value_heads, tp, "the target"), width(spec), config.head_dim)
        zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in config.full_attention_layers)  # noqa: E731
        z = lambda: jnp.zeros((batch,), jnp.int32)  # noqa: E731 (distinct buffers: the state is donated)
        return cls(k=zeros(), v=zeros(), pos=jnp.full((batch, spec.history_budget), -1, jnp.int32), n_anchor=z(),
                   count=z(), ptr=z(), built=jnp.full((batch, spec.max_chunks - 1), UNBUILT, jnp.int32))

    @classmethod
    def specs(cls, config: ModelConfig, dp: str | None, tp: str | None) -> WorkingSet:
        """PartitionSpecs of every leaf (batch over ``dp``, KV heads over ``tp``, as the target cache)."""
        heads, row, n = P(dp, tp, None, None), P(dp), len(config.full_attention_layers)
        return cls(k=(heads,) * n, v=(heads,) * n, pos=P(dp, None), n_anchor=row, count=row, ptr=row,
                   built=P(dp, None))


def width(spec: SpecConfig) -> int:
    """Slots per layer: the history budget plus the K draft steps, rounded up to a multiple of
    :data:`WIDTH_MULTIPLE` (2048 at the default budget of 2048 and K = 4)."""
    return round_capacity(spec.history_budget + spec.num_speculative_tokens, WIDTH_MULTIPLE)


def sink_anchors(length: jax.Array, chunk: int, num: int) -> jax.Array:
    """int32 ``[B, num]``: the sink chunk 0 once it is complete (``length >= chunk``), ``-1`` elsewhere."""
    b = length.shape[0]
    return jnp.full((b, num), -1, jnp.int32).at[:, 0].set(jnp.where(length >= chunk, 0, -1))


def effective_anchors(anchors: jax.Array | None, length: jax.Array, chunk: int, num: int) -> jax.Array:
    """The anchors the working set holds: DiffSpec's selection when it has one (it keeps the sink itself), else the
    sink chunk alone (the ``recent`` policy, and ``diffspec`` before its first retrieval)."""
    sink = sink_anchors(length, chunk, num)
    if anchors is None:
        return sink
    return jnp.where(jnp.any(anchors >= 0, axis=1, keepdims=True), anchors, sink)


def layout(anchors: jax.Array, length: jax.Array, chunk: int, slots: int
           ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The history slots after a rebuild: ``(pos [B, slots], n_anchor [B], count [B])`` with the anchor tokens
    first and the window after them, each ascending (positions ``< length``; ``-1`` padded)."""
    idx, n, window = history_indices(anchors, length, chunk, slots)
    in_anchor = (idx >= 0) & jnp.any(idx[:, :, None] // chunk == anchors[:, None, :], axis=2)
    big = jnp.iinfo(jnp.int32).max
    key = jnp.sort(jnp.where(idx < 0, big, jnp.where(in_anchor, idx, idx + _WINDOW_KEY)), axis=1)
    pos = jnp.where(key == big, -1, jnp.where(key >= _WINDOW_KEY, key - _WINDOW_KEY, key))
    return pos.astype(jnp.int32), (n - window).astype(jnp.int32), window.astype(jnp.int32)


def rebuild(ws: WorkingSet, target_cache, anchors: jax.Array, length: jax.Array, chunk: int) -> WorkingSet:
    """Gather the whole history (:func:`layout` of ``anchors`` before ``length``) of every layer from the target
    cache into slots ``0 .. Hb - 1``."""
    pos, n_anchor, count = layout(anchors, length, chunk, ws.pos.shape[1])

    def fill(work, buf):
        return jax.lax.dynamic_update_slice_in_dim(work, target_cache.gather(buf, pos).astype(work.dtype), 0, axis=2)

    ring = ws.pos.shape[1] - n_anchor
    return ws.replace(k=tuple(map(fill, ws.k, target_cache.k)), v=tuple(map(fill, ws.v, target_cache.v)), pos=pos,
                      n_anchor=n_anchor, count=count, ptr=count % ring, built=anchors)


def refresh(ws: WorkingSet, target_cache, anchors: jax.Array, length: jax.Array, pend: jax.Array, active: jax.Array,
            chunk: int, max_new: int) -> WorkingSet:
    """The working set for a draft step 0 at committed ``length``: rows whose ``anchors`` changed since their last
    build are rebuilt, the others gain the ``pend`` (``<= max_new``) tokens committed since the last cycle."""
    appended = append(ws, target_cache, length - pend, pend, active, max_new)
    need = active & jnp.any(anchors != ws.built, axis=1)

    def with_rebuild():
        new = rebuild(ws, target_cache, anchors, length, chunk)
        pick = lambda a, b: jnp.where(need.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)  # noqa: E731
        return jax.tree_util.tree_map(pick, new, appended)

    return jax.lax.cond(jnp.any(need), with_rebuild, lambda: appended)


def append(ws: WorkingSet, target_cache, start: jax.Array, num: jax.Array, active: jax.Array, max_new: int
           ) -> WorkingSet:
    """Put the target's K/V of positions ``start .. start + num - 1`` (``num <= max_new``) into the ring of the
    ``active`` rows, oldest first, overwriting the ring's oldest rows; when more than the ring's ``R`` slots arrive
    at once only the newest ``R`` are written (the others would be overwritten at once)."""
    b, hb = ws.pos.shape
    i = jnp.arange(max_new, dtype=jnp.int32)[None, :]
    ring = (hb - ws.n_anchor)[:, None]
    num = jnp.where(active, num, 0)[:, None]
    valid = (i < num) & (i >= num - ring)
    positions = start[:, None] + i
    slots = jnp.where(valid, ws.n_anchor[:, None] + (ws.ptr[:, None] + i) % ring, ws.k[0].shape[2])  # else dropped
    src = jnp.where(valid, positions, -1)

    def put(work, buf):
        return write_rows(work, jnp.swapaxes(target_cache.gather(buf, src), 1, 2), slots, heads_first=True)

    bidx = jnp.broadcast_to(jnp.arange(b)[:, None], slots.shape)
    return ws.replace(k=tuple(map(put, ws.k, target_cache.k)), v=tuple(map(put, ws.v, target_cache.v)),
                      pos=ws.pos.at[bidx, slots].set(positions, mode="drop"),
                      count=jnp.minimum(ws.count + num[:, 0], ring[:, 0]), ptr=(ws.ptr + num[:, 0]) % ring[:, 0])
