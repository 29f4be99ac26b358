"""The draft's KV: a canonical pre-RoPE store and the working cache the draft attends to.

Layouts (per sequence; Hkv = draft KV heads, D = head_dim):

* ``full`` policy (plain EAGLE-3): no separate store. The working cache *is* the store, ``[B, S, Hkv, D]``
  with S the target cache capacity, keys rotated at their **absolute** positions; the root sits at slot
  ``n = r`` (its absolute position) and chain step j at ``n + j``.
* ``recent`` / ``diffspec``: the canonical store ``[B, S, Hkv, D]`` holds **pre-RoPE** K and V of committed
  draft entries at absolute positions; the working cache ``[B, W, Hkv, D]`` (W = ``diffspec_token_budget``)
  is rebuilt at every draft step 0 by gather-RoPE-write: the history rows (sorted absolute positions, ``-1``
  padded) are gathered from the store, keys rotated at **local** positions ``0..n-1``, and written to slots
  ``0..n-1``; the root goes to slot ``n``, chain step j to ``n + j``.

The draft attends causally over local slot positions (slot s is visible to a query at local position p iff
s <= p), so stale slots beyond the current query are never read. Everything has static shapes.

The pure-JAX functions here (:func:`gather_rope_write_reference`, :func:`draft_attention_reference`) are the
references the Pallas kernels and the torch bridge are tested against; :func:`run_gather_rope_write` and
:func:`run_draft_attention` pick the kernel or the reference (:func:`pallas_kernels.common.kernel_backend`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from diffspec_jax.cache import page_rows, page_view, write_paged, write_rows
from diffspec_jax.config import DraftConfig, SpecConfig
from diffspec_jax.models import eagle3
from diffspec_jax.models.layers import apply_rope, attention_dense, causal_mask, rope_cos_sin
from pallas_kernels import draft_attention as draft_attention_kernel
from pallas_kernels import gather_rope_write as gather_rope_write_kernel
from pallas_kernels.common import kernel_backend


@struct.dataclass
class DraftCache:
    """Draft K/V of a batch.

    Attributes:
        work_k, work_v: ``[B, W, Hkv, D]`` working cache (keys rotated at local positions).
        store_k, store_v: ``[B, S, Hkv, D]`` canonical pre-RoPE store, or ``None`` for the ``full`` policy.
    """

    work_k: jax.Array
    work_v: jax.Array
    store_k: jax.Array | None = None
    store_v: jax.Array | None = None

    def pools(self) -> tuple:
        """The leaves a paged state's rows share: the store ``(store_k, store_v)`` (``(None, None)`` without one)."""
        return self.store_k, self.store_v

    def with_pools(self, store_k, store_v) -> DraftCache:
        """:meth:`pools` replaced (``None``: taken out, so that every leaf left is batch-first)."""
        return self.replace(store_k=store_k, store_v=store_v)

    @classmethod
    def create(cls, config: DraftConfig, spec: SpecConfig, batch: int, capacity: int, dtype,
               num_kv_heads: int | None = None, pool_rows: int | None = None) -> DraftCache:
        """Zero-filled buffers: ``capacity`` = the target cache capacity (absolute positions); ``num_kv_heads``
        overrides the config's (KV heads repeated for tensor parallelism). ``pool_rows`` (``recent`` /
        ``diffspec``): the store is a pool ``[1, pool_rows, Hkv, D]`` paged by the target cache's page table."""
        hkv, d = num_kv_heads or config.num_key_value_heads, config.head_dim
        if pool_rows is not None and spec.uses_working_cache:
            w = jnp.zeros((batch, spec.context.token_budget, hkv, d), dtype)
            s = jnp.zeros((1, pool_rows, hkv, d), dtype)
            return cls(work_k=w, work_v=w.copy(), store_k=s, store_v=s.copy())
        if not spec.uses_working_cache:
            z = jnp.zeros((batch, capacity, hkv, d), dtype)
            return cls(work_k=z, work_v=z.copy())
        w = jnp.zeros((batch, spec.context.token_budget, hkv, d), dtype)
        s = jnp.zeros((batch, capacity, hkv, d), dtype)
        return cls(work_k=w, work_v=w.copy(), store_k=s, store_v=s.copy())


def history_slots(spec: SpecConfig) -> int:
    """Maximum history length n: the policy's capacity rule (``budget - K - 1`` for ``recent``, Hb (whole chunks)
    for ``diffspec``)."""
    return spec.context.history_slots(spec.num_speculative_tokens)


def commit(config: DraftConfig, spec: SpecConfig, cache: DraftCache, k: jax.Array, v: jax.Array,
           positions: jax.Array, pages: jax.Array | None = None, page_size: int = 0) -> DraftCache:
    """Store the K/V of draft entries computed from target features at their absolute positions.

    Args:
        k, v: pre-RoPE ``[B, T, Hkv, D]``; positions: int32 ``[B, T]`` (rows past the capacity are dropped).
        pages, page_size: the target cache's page table when the store is paged (its rows go through it).
    ``full`` rotates the keys at their absolute positions into the working cache; the other policies write the
    pre-RoPE rows to the canonical store.
    """
    if not spec.uses_working_cache:
        k_rot = eagle3.rope(config, k, positions)
        return cache.replace(work_k=write_rows(cache.work_k, k_rot, positions),
                             work_v=write_rows(cache.work_v, v, positions))
    if pages is not None:
        return cache.replace(store_k=write_paged(cache.store_k, k, pages, positions, page_size, heads_first=False),
                             store_v=write_paged(cache.store_v, v, pages, positions, page_size, heads_first=False))
    return cache.replace(store_k=write_rows(cache.store_k, k, positions),
                         store_v=write_rows(cache.store_v, v, positions))


def history_indices(anchor_chunks: jax.Array | None, root: jax.Array, chunk: int, slots: int
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The draft's history at step 0: anchor tokens plus a rolling window of the most recent other positions.

    ``history = anchor tokens U W``, sorted, where W is the most recent positions ``< root`` that are not anchor
    tokens, up to ``slots - |anchor tokens|`` of them (docs/method.md section 3.2). The root is never included.

    Args:
        anchor_chunks: int32 ``[B, A]`` selected complete chunk ids (``-1`` = empty slot), or ``None``
            (no anchors: a plain sliding window, the ``recent`` policy and the state before any retrieval).
        root: int32 ``[B]`` root position r.
        chunk: chunk size C; slots: maximum history length (Hb).
    Returns:
        ``(idx [B, slots] int32 sorted absolute positions padded with -1, n [B], window [B])`` where n is the
        history length and window = |W|.
    """
    b = root.shape[0]
    cand = root[:, None] - slots + jnp.arange(slots)[None, :]  # the last `slots` positions before the root
    if anchor_chunks is None:
        idx = jnp.where(cand >= 0, cand, -1)
        n = jnp.minimum(root, slots)
        return _compact_sorted(idx, slots), n, n
    valid_anchor = anchor_chunks >= 0
    anchor_tok = jnp.where(valid_anchor[:, :, None], anchor_chunks[:, :, None] * chunk + jnp.arange(chunk),
                           -1).reshape(b, -1)
    anchor_tok = jnp.where(anchor_tok < root[:, None], anchor_tok, -1)
    n_anchor = jnp.sum(anchor_tok >= 0, axis=1)
    in_anchor = jnp.any(valid_anchor[:, None, :] & (cand[:, :, None] // chunk == anchor_chunks[:, None, :]), axis=2)
    free = (cand >= 0) & ~in_anchor
    rank_from_top = jnp.cumsum(free[:, ::-1], axis=1)[:, ::-1]  # 1 = the most recent free position
    take = free & (rank_from_top <= (slots - n_anchor)[:, None])
    window = jnp.where(take, cand, -1)
    merged = jnp.concatenate([anchor_tok, window], axis=1)
    w = jnp.sum(take, axis=1)
    return _compact_sorted(merged, slots), n_anchor + w, w


def _compact_sorted(idx: jax.Array, slots: int) -> jax.Array:
    """Sort valid entries (>= 0) ascending to the front, pad with -1, keep ``slots`` columns."""
    big = jnp.iinfo(jnp.int32).max
    s = jnp.sort(jnp.where(idx >= 0, idx, big), axis=1)[:, :slots]
    return jnp.where(s == big, -1, s).astype(jnp.int32)


def gather_rope_write(config: DraftConfig, cache: DraftCache, idx: jax.Array, pages: jax.Array | None = None,
                      page_size: int = 0) -> DraftCache:
    """Rebuild the working cache: ``working[0:N] = rope(store[idx], local 0..N-1)``; ``-1`` rows become zeros.

    Args:
        idx: int32 ``[B, N]`` sorted absolute positions, ``-1`` padded (from :func:`history_indices`).
        pages, page_size: the target cache's page table when the store is paged (the kernel reads pool rows,
            the reference the sequences' page views).
    Runs the Pallas kernel or :func:`gather_rope_write_reference` (:func:`run_gather_rope_write`).
    """
    store_k, store_v = cache.store_k, cache.store_v
    if pages is not None and kernel_backend() == "pallas":  # the kernel reads pool rows
        idx = jnp.where(idx >= 0, page_rows(pages, idx, page_size, store_k.shape[1]), -1)
    elif pages is not None:  # the reference reads the sequences' page views: a page lookup fused into its
        # row gather was recomputed for every element copied (5x the gather's time on the demo pair, XLA:CPU)
        store_k, store_v = (page_view(s, pages, page_size, heads_first=False) for s in (store_k, store_v))
    local = jnp.arange(idx.shape[1], dtype=jnp.int32)
    cos, sin = rope_cos_sin(local, config.rope.inv_freq(config.head_dim))
    k, v = run_gather_rope_write(store_k, store_v, cache.work_k, cache.work_v, idx, cos, sin,
                                 interleaved=config.rope.interleaved)
    return cache.replace(work_k=k, work_v=v)


def run_gather_rope_write(store_k, store_v, work_k, work_v, idx, cos, sin, *, interleaved=False):
    """:func:`pallas_kernels.gather_rope_write.gather_rope_write` or :func:`gather_rope_write_reference` (same
    signature), by :func:`pallas_kernels.common.kernel_backend`."""
    fn = gather_rope_write_kernel.gather_rope_write if kernel_backend() == "pallas" else gather_rope_write_reference
    return fn(store_k, store_v, work_k, work_v, idx, cos, sin, interleaved=interleaved)


def gather_rope_write_reference(store_k, store_v, work_k, work_v, idx, cos, sin, *, interleaved=False):
    """Pure-JAX gather-RoPE-write (the contract of the Pallas kernel).

    Args:
        store_k, store_v: ``[B, S, Hkv, D]`` pre-RoPE canonical store, or a paged pool ``[1, (N + 1) * P, Hkv, D]``
            whose rows ``idx`` names (every sequence gathers from the one pool).
        work_k, work_v: ``[B, W, Hkv, D]`` working cache (rows ``0..N-1`` are overwritten, the rest kept).
        idx: int32 ``[B, N]`` absolute positions to gather, ``-1`` = padding (written as zero rows), N <= W.
        cos, sin: float32 ``[N, R/2]`` RoPE tables of local positions ``0..N-1`` (R = rotary dims <= D).
        interleaved: rotate pairs ``(2j, 2j+1)`` instead of halves ``(j, j + R/2)``.
    Returns:
        ``(work_k, work_v)`` with keys rotated at local positions and values copied (store dtype -> work dtype).
    """
    safe = jnp.minimum(jnp.maximum(idx, 0), store_k.shape[1] - 1)
    valid = (idx >= 0)[:, :, None, None]
    if store_k.shape[0] != idx.shape[0]:  # a paged pool: one store for every sequence
        take = lambda store: jnp.take(store[0], safe, axis=0)  # noqa: E731
    else:
        take = lambda store: jnp.take_along_axis(store, safe[:, :, None, None], axis=1)  # noqa: E731
    k = jnp.where(valid, take(store_k), 0)
    v = jnp.where(valid, take(store_v), 0)
    k = apply_rope(k, cos[None], sin[None], interleaved=interleaved)
    return (jax.lax.dynamic_update_slice_in_dim(work_k, k.astype(work_k.dtype), 0, axis=1),
            jax.lax.dynamic_update_slice_in_dim(work_v, v.astype(work_v.dtype), 0, axis=1))


def write_slots(cache: DraftCache, k_rot: jax.Array, v: jax.Array, slots: jax.Array) -> DraftCache:
    """Write rotated keys and values ``[B, T, Hkv, D]`` into working-cache slots ``[B, T]``."""
    return cache.replace(work_k=write_rows(cache.work_k, k_rot, slots), work_v=write_rows(cache.work_v, v, slots))


def draft_attention(config: DraftConfig, cache: DraftCache, q_rot: jax.Array, q_local: jax.Array) -> jax.Array:
    """Draft attention of queries ``[B, T, Hq, D]`` at local positions ``[B, T]`` over the working cache.

    Runs the Pallas kernel or :func:`draft_attention_reference` (:func:`run_draft_attention`).
    """
    return run_draft_attention(q_rot, cache.work_k, cache.work_v, q_local, scale=config.head_dim ** -0.5)


def run_draft_attention(q, k, v, q_local, *, scale):
    """:func:`pallas_kernels.draft_attention.draft_attention` or :func:`draft_attention_reference` (same
    signature), by :func:`pallas_kernels.common.kernel_backend`."""
    fn = draft_attention_kernel.draft_attention if kernel_backend() == "pallas" else draft_attention_reference
    return fn(q, k, v, q_local, scale=scale)


def draft_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, q_local: jax.Array, *, scale: float
                              ) -> jax.Array:
    """Pure-JAX draft attention (the contract of the Pallas kernel).

    Args:
        q: ``[B, T, Hq, D]`` rotated queries; k, v: ``[B, W, Hkv, D]`` working cache (GQA, ``Hq % Hkv == 0``).
        q_local: int32 ``[B, T]`` local positions: slot s is visible to a query at position p iff ``s <= p``.
    Returns:
        ``[B, T, Hq, D]`` in ``q.dtype`` (float32 softmax).
    """
    out, _ = attention_dense(q, k, v, causal_mask(q_local, k.shape[1]), scale)
    return out
