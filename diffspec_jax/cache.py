"""Fixed-capacity KV caches as pytrees.

The target cache holds one K and one V buffer per layer, ``[B, Hkv, S, D]`` (heads before positions), indexed by
**absolute position**. Heads-first is the layout the attention products read directly: with positions before
heads, XLA copies (transposes) every layer's buffers on each step at batch > 1: for Llama-3.1-8B shapes on an
H200, a 3.7x slower step at 32K x 8 and 32 GiB of temporaries at 64K x 8 (``benchmarks/decode_ablation.py``).
Entries are written with a bounded scatter (positions ``>= S`` are dropped, never clamped onto valid rows) and
read under a causal position mask, so a buffer never needs clearing: rows beyond a sequence's committed length
hold stale values (rejected drafts, prompt padding) that are overwritten before any query can see them.
Separate per-layer buffers let XLA update each in place when the cache is donated to ``jit``.

With ``kv_cache_dtype="fp8"`` each K/V buffer is an :class:`~diffspec_jax.kv_quant.Fp8Rows` (e4m3 rows and a float32
scale per row, of the same leading shape): writes quantize the rows they are given, and every row operation here
(scatter, page gather, tree move) moves values and scales alike.

Hybrid targets (Qwen3.5: Gated DeltaNet + gated attention) use :class:`HybridCache`: K/V buffers for the
full-attention layers only, and for each DeltaNet layer its conv state (the last ``kernel - 1`` pre-conv inputs)
and its recurrent state. Those states are *not* position-indexed: a token that should not count (prompt padding,
a rejected draft) must never be absorbed into them, which is why hybrid steps take the number of valid tokens and
verification keeps a snapshot per position (see :mod:`diffspec_jax.models.qwen35`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P

from diffspec_jax.config import ModelConfig
from diffspec_jax.kv_quant import Fp8Rows, dequantize, encode_like, is_fp8, rowwise
from diffspec_jax.mesh import TP, kv_heads_for

#: key tile of the chunked-prefill attention; cache capacities are rounded up to a multiple of it
ATTENTION_TILE = 256


def round_capacity(capacity: int, tile: int = ATTENTION_TILE) -> int:
    """Capacity rounded up to a whole number of attention tiles (at least one tile)."""
    if capacity <= 0:
        raise ValueError(f"cache capacity must be > 0, got {capacity}")
    return -(-capacity // tile) * tile


class _LayerBuffers:
    """What every cache answers from its first K buffer ``[B, Hkv, S, D]`` (or, paged, from its page table)."""

    k: tuple[jax.Array, ...]
    pages: jax.Array | None
    page_size: int

    @property
    def paged(self) -> bool:
        return self.pages is not None

    @property
    def batch(self) -> int:
        return self.pages.shape[0] if self.paged else self.k[0].shape[0]

    @property
    def capacity(self) -> int:
        """Positions per sequence (paged: page-table columns x page size)."""
        return self.pages.shape[1] * self.page_size if self.paged else self.k[0].shape[2]

    def gather(self, buf: jax.Array | Fp8Rows, pos: jax.Array) -> jax.Array:
        """Rows at absolute positions ``pos [B, N]`` of one layer's buffer as ``[B, H, N, D]`` (zero where
        ``pos < 0``), through the page table when paged; an 8-bit buffer's rows come dequantized (float32)."""
        if is_fp8(buf):
            return dequantize(rowwise(lambda leaf: self.gather(leaf, pos), buf))
        if self.paged:
            rows = page_rows(self.pages, pos, self.page_size, buf.shape[2])
            got = jnp.moveaxis(jnp.take(buf[0], jnp.minimum(rows, buf.shape[2] - 1), axis=1), 0, 1)
        else:
            got = jnp.take_along_axis(buf, jnp.maximum(pos, 0)[:, None, :, None], axis=2)
        return jnp.where((pos >= 0)[:, None, :, None], got, jnp.zeros((), buf.dtype))

    @property
    def fp8(self) -> bool:
        """Whether the K/V rows are stored in 8 bits (:mod:`diffspec_jax.kv_quant`)."""
        return bool(self.k) and is_fp8(self.k[0])

    def layer_view(self, buf: jax.Array) -> jax.Array:
        """One layer's buffer as ``[B, Hkv, S, D]`` by absolute position (paged: gathered through the page table,
        a materialised copy; the hot attention paths read the pool directly instead)."""
        return page_view(buf, self.pages, self.page_size) if self.paged else buf


@struct.dataclass
class KVCache(_LayerBuffers):
    """Per-layer K/V buffers, contiguous per sequence or paged.

    Attributes:
        k, v: tuples of ``num_layers`` arrays ``[B, Hkv_local, S, D]`` (``Hkv_local`` is the shard's KV heads), or,
            paged, ``[1, Hkv_local, (N + 1) * P, D]``: one pool of ``N`` pages of ``P`` rows shared by every sequence.
        pages: ``None`` (contiguous), or int32 ``[B, max_pages]``: sequence b's position p lives in pool row
            ``pages[b, p // P] * P + p % P``; an entry ``>= N`` (or ``< 0``) is an unallocated page, whose writes
            land in the scratch page and whose reads are never visible (:func:`page_rows`).

    A pool holds :func:`pool_rows` rows: its ``N`` pages and one more, the **scratch page** (index ``N``, the
    unallocated entry of every page table). Rows that must not land anywhere (an empty slot's verify rows, a
    parked slot's, prompt padding past a sequence's pages) are written there, inside the buffer, instead of at an
    index past its end that the scatter must drop, and a Pallas kernel loading through an unallocated entry (an
    empty slot's attention, a draft gather) reads the scratch page instead of memory past the pool. No query ever
    sees a scratch row.
        page_size: static ``P`` (0 when contiguous).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    pages: jax.Array | None = None
    page_size: int = struct.field(pytree_node=False, default=0)

    def layer_keys(self, layer: int) -> jax.Array:
        """The K buffer of decoder layer ``layer``."""
        return self.k[layer]

    @classmethod
    def create(cls, config: ModelConfig, batch: int, capacity: int, dtype=jnp.bfloat16,
               num_kv_heads: int | None = None, kv_cache_dtype: str = "auto") -> KVCache:
        """Zero-filled cache of ``round_capacity(capacity)`` positions per sequence (``kv_cache_dtype="fp8"``: rows
        in 8 bits, :func:`zero_buffers`)."""
        if config.is_hybrid:
            raise ValueError(f"{config.architecture} is a hybrid model: create its cache with HybridCache.create or "
                             f"diffspec_jax.cache.create_cache")
        shape = (batch, num_kv_heads or config.num_key_value_heads, round_capacity(capacity), config.head_dim)
        n = config.num_hidden_layers
        return cls(k=zero_buffers(shape, dtype, kv_cache_dtype, n), v=zero_buffers(shape, dtype, kv_cache_dtype, n))

    @classmethod
    def create_paged(cls, config: ModelConfig, batch: int, num_pages: int, page_size: int, max_pages: int,
                     dtype=jnp.bfloat16, num_kv_heads: int | None = None, kv_cache_dtype: str = "auto") -> KVCache:
        """Zero-filled pools of ``num_pages`` pages of ``page_size`` rows per layer (and the scratch page:
        :func:`pool_rows`), and a page table of ``batch x max_pages`` entries, all unallocated (``num_pages``)."""
        shape = (1, num_kv_heads or config.num_key_value_heads, pool_rows(num_pages, page_size), config.head_dim)
        n = config.num_hidden_layers
        return cls(k=zero_buffers(shape, dtype, kv_cache_dtype, n), v=zero_buffers(shape, dtype, kv_cache_dtype, n),
                   pages=jnp.full((batch, max_pages), num_pages, jnp.int32), page_size=page_size)


@struct.dataclass
class HybridCache(_LayerBuffers):
    """The cache of a hybrid target (Qwen3.5): KV for full-attention layers, conv + recurrent state for DeltaNet.

    Attributes:
        k, v: one ``[B, Hkv_local, S, D]`` buffer per full-attention layer (``k[j]`` belongs to layer
            ``full_layers[j]``), position-indexed like :class:`KVCache`.
        conv_q, conv_k, conv_v: one ``[B, kernel - 1, heads_local, head_dim]`` buffer per DeltaNet layer (``j`` ->
            layer ``linear_layers[j]``): the last ``kernel - 1`` pre-conv q / k / v inputs (model dtype).
        ssm: one float32 ``[B, Hv_local, dk, dv]`` recurrent state per DeltaNet layer.
        full_layers, linear_layers: static layer indices (part of the tree structure, not leaves).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    conv_q: tuple[jax.Array, ...]
    conv_k: tuple[jax.Array, ...]
    conv_v: tuple[jax.Array, ...]
    ssm: tuple[jax.Array, ...]
    full_layers: tuple[int, ...] = struct.field(pytree_node=False, default=())
    linear_layers: tuple[int, ...] = struct.field(pytree_node=False, default=())
    pages: jax.Array | None = None
    page_size: int = struct.field(pytree_node=False, default=0)

    def layer_keys(self, layer: int) -> jax.Array:
        """The K buffer of decoder layer ``layer`` (a full-attention layer)."""
        if layer not in self.full_layers:
            raise ValueError(f"layer {layer} is not a full-attention layer (those are {list(self.full_layers)})")
        return self.k[self.full_layers.index(layer)]

    @classmethod
    def create(cls, config: ModelConfig, batch: int, capacity: int, dtype=jnp.bfloat16, *,
               num_kv_heads: int | None = None, num_linear_key_heads: int | None = None,
               num_linear_value_heads: int | None = None, kv_cache_dtype: str = "auto") -> HybridCache:
        """Zero-filled cache (zero conv and recurrent states = the state before the first token)."""
        full, linear = config.full_attention_layers, config.linear_attention_layers
        kv = (batch, num_kv_heads or config.num_key_value_heads, round_capacity(capacity), config.head_dim)
        w = config.linear_conv_kernel_dim - 1
        hk = num_linear_key_heads or config.linear_num_key_heads
        hv = num_linear_value_heads or config.linear_num_value_heads
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        zeros = lambda shape, dt, n: tuple(jnp.zeros(shape, dt) for _ in range(n))  # noqa: E731
        return cls(k=zero_buffers(kv, dtype, kv_cache_dtype, len(full)),
                   v=zero_buffers(kv, dtype, kv_cache_dtype, len(full)),
                   conv_q=zeros((batch, w, hk, dk), dtype, len(linear)),
                   conv_k=zeros((batch, w, hk, dk), dtype, len(linear)),
                   conv_v=zeros((batch, w, hv, dv), dtype, len(linear)),
                   ssm=zeros((batch, hv, dk, dv), jnp.float32, len(linear)),
                   full_layers=full, linear_layers=linear)


def zero_buffers(shape: tuple[int, ...], dtype, kv_cache_dtype: str, n: int) -> tuple:
    """``n`` zero K (or V) buffers of ``shape``: arrays of ``dtype`` (``kv_cache_dtype="auto"``), or
    :class:`~diffspec_jax.kv_quant.Fp8Rows` (``"fp8"``)."""
    if kv_cache_dtype == "fp8":
        return tuple(Fp8Rows.zeros(shape) for _ in range(n))
    if kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")
    return tuple(jnp.zeros(shape, dtype) for _ in range(n))


def create_cache(config: ModelConfig, batch: int, capacity: int, dtype=jnp.bfloat16, *, tp: int = 1,
                 kv_cache_dtype: str = "auto") -> KVCache | HybridCache:
    """The right cache for ``config`` (global shapes for a ``tp``-way tensor-parallel layout: heads that do not
    divide by ``tp`` are repeated, as :mod:`diffspec_jax.sharding` lays out the projections); ``kv_cache_dtype``
    ``"fp8"`` stores the attention layers' K/V in 8 bits (:mod:`diffspec_jax.kv_quant`)."""
    kv = kv_heads_for(config.num_key_value_heads, tp, "the target")
    if not config.is_hybrid:
        return KVCache.create(config, batch, capacity, dtype, num_kv_heads=kv, kv_cache_dtype=kv_cache_dtype)
    return HybridCache.create(config, batch, capacity, dtype, num_kv_heads=kv,
                              num_linear_key_heads=kv_heads_for(config.linear_num_key_heads, tp,
                                                                "the target's linear attention"),
                              kv_cache_dtype=kv_cache_dtype)


def create_paged_cache(config: ModelConfig, batch: int, num_pages: int, page_size: int, max_pages: int,
                       dtype=jnp.bfloat16, *, tp: int = 1, kv_cache_dtype: str = "auto") -> KVCache | HybridCache:
    """The paged cache for ``config``: K/V pools of ``num_pages`` pages of ``page_size`` rows per attention layer,
    a ``batch x max_pages`` page table (all unallocated), and for a hybrid target its per-sequence DeltaNet states
    (those are not position-indexed, so they are never paged)."""
    kv = kv_heads_for(config.num_key_value_heads, tp, "the target")
    if not config.is_hybrid:
        return KVCache.create_paged(config, batch, num_pages, page_size, max_pages, dtype, num_kv_heads=kv,
                                    kv_cache_dtype=kv_cache_dtype)
    cache = create_cache(config, batch, 1, dtype, tp=tp)
    pool = (1, kv, pool_rows(num_pages, page_size), config.head_dim)
    n = len(config.full_attention_layers)
    return cache.replace(k=zero_buffers(pool, dtype, kv_cache_dtype, n), v=zero_buffers(pool, dtype, kv_cache_dtype, n),
                         pages=jnp.full((batch, max_pages), num_pages, jnp.int32), page_size=page_size)


def pool_rows(num_pages: int, page_size: int) -> int:
    """Rows of a pool of ``num_pages`` pages of ``page_size``: the pages and the scratch page (:class:`KVCache`)."""
    return (num_pages + 1) * page_size


def page_rows(pages: jax.Array, positions: jax.Array, page_size: int, rows: int) -> jax.Array:
    """Pool rows of absolute ``positions`` (int ``[B, T]``) under the page table ``pages [B, max_pages]``:
    ``pages[b, p // P] * P + p % P``, for a pool of ``rows`` rows whose last page is the scratch page
    (:func:`pool_rows`). A position that is negative, past the table, or on an unallocated page maps to a row of
    the scratch page: writes there land inside the buffer and no read of it is ever visible."""
    positions = positions.astype(jnp.int32)
    col = positions // page_size
    page = jnp.take_along_axis(pages, jnp.clip(col, 0, pages.shape[1] - 1), axis=1)
    row = page * page_size + positions % page_size
    scratch = rows - page_size
    ok = (positions >= 0) & (col < pages.shape[1]) & (page >= 0) & (row < scratch)
    return jnp.where(ok, row, scratch + positions % page_size).astype(jnp.int32)


def page_view(buf: jax.Array | Fp8Rows, pages: jax.Array, page_size: int, *, heads_first: bool = True
              ) -> jax.Array | Fp8Rows:
    """A pool ``[1, H, (N + 1) * P, D]`` (``heads_first``) or ``[1, (N + 1) * P, H, D]`` read as per-sequence buffers
    ``[B, H, max_pages * P, D]`` (or ``[B, max_pages * P, H, D]``) through ``pages [B, max_pages]``; unallocated
    pages read as the scratch page (never visible: they lie past every committed length). An 8-bit pool gives an
    8-bit view (values and scales gathered alike)."""
    if is_fp8(buf):
        return rowwise(lambda leaf: page_view(leaf, pages, page_size, heads_first=heads_first), buf)
    n = buf.shape[2 if heads_first else 1] // page_size
    b, m = pages.shape
    idx = jnp.clip(pages, 0, n - 1)
    if heads_first:
        h, d = buf.shape[1], buf.shape[3]
        pool = buf[0].reshape(h, n, page_size, d)
        return jnp.moveaxis(jnp.take(pool, idx, axis=1), 0, 1).reshape(b, h, m * page_size, d)
    pool = buf[0].reshape((n, page_size) + buf.shape[2:])
    return jnp.take(pool, idx, axis=0).reshape((b, m * page_size) + buf.shape[2:])


def write_paged(buf: jax.Array, rows: jax.Array, pages: jax.Array, positions: jax.Array, page_size: int, *,
                heads_first: bool = True) -> jax.Array:
    """:func:`write_rows` into a pool (``[1, H, (N + 1) * P, D]`` heads first, or ``[1, (N + 1) * P, ...]``):
    ``rows [B, T, ...]`` land at the pool rows of ``positions [B, T]`` (:func:`page_rows`), unallocated ones in the
    scratch page. An 8-bit pool takes the rows quantized (:func:`diffspec_jax.kv_quant.encode_like`)."""
    if is_fp8(buf):
        return rowwise(lambda b, r: write_paged(b, r, pages, positions, page_size, heads_first=heads_first), buf,
                       encode_like(buf, rows))
    axis = 2 if heads_first else 1
    flat = page_rows(pages, positions, page_size, buf.shape[axis]).reshape(1, -1)
    return write_rows(buf, rows.reshape((1, -1) + rows.shape[2:]), flat, heads_first=heads_first)


def fp8_specs(specs: KVCache | HybridCache) -> KVCache | HybridCache:
    """The specs of an 8-bit cache from a full-precision one's: each K/V buffer's values and scales sharded alike
    (the scales' last axis of 1 is never split)."""
    both = lambda spec: Fp8Rows(values=spec, scale=spec)  # noqa: E731
    return specs.replace(k=tuple(map(both, specs.k)), v=tuple(map(both, specs.v)))


def cache_specs(config: ModelConfig, dp: str | None, tp: str | None = TP) -> KVCache | HybridCache:
    """PartitionSpecs of the target cache of ``config`` (batch over ``dp``, heads over ``tp``)."""
    heads = P(dp, tp, None, None)  # [B, Hkv, S, D]
    if not config.is_hybrid:
        n = config.num_hidden_layers
        return KVCache(k=(heads,) * n, v=(heads,) * n)
    nf, nl = len(config.full_attention_layers), len(config.linear_attention_layers)
    conv = P(dp, None, tp, None)  # [B, kernel - 1, heads, head_dim]
    return HybridCache(k=(heads,) * nf, v=(heads,) * nf, conv_q=(conv,) * nl, conv_k=(conv,) * nl,
                       conv_v=(conv,) * nl, ssm=(P(dp, tp, None, None),) * nl,
                       full_layers=config.full_attention_layers, linear_layers=config.linear_attention_layers)


def write_rows(buf: jax.Array, rows: jax.Array, positions: jax.Array, *, heads_first: bool = False) -> jax.Array:
    """Scatter ``rows [B, T, ...]`` into ``buf`` at ``positions [B, T]``; out-of-range rows are dropped.

    ``buf`` is ``[B, S, ...]``, or ``[B, H, S, D]`` when ``heads_first`` (the target cache; ``rows`` stay
    ``[B, T, H, D]``). A sequence's positions must be distinct (its T rows land on T different rows): the target
    cache's scatter is declared free of collisions and writes one ``[H, D]`` window per (sequence, row). An 8-bit
    buffer takes the rows quantized (:func:`diffspec_jax.kv_quant.encode_like`)."""
    if is_fp8(buf):
        return rowwise(lambda b, r: write_rows(b, r, positions, heads_first=heads_first), buf, encode_like(buf, rows))
    bidx = jnp.broadcast_to(jnp.arange(buf.shape[0])[:, None], positions.shape)
    if heads_first:
        dims = jax.lax.ScatterDimensionNumbers(update_window_dims=(2, 3), inserted_window_dims=(0, 2),
                                               scatter_dims_to_operand_dims=(0, 2))
        return jax.lax.scatter(buf, jnp.stack([bidx, positions.astype(bidx.dtype)], axis=-1),
                               rows.astype(buf.dtype), dims, unique_indices=True,
                               mode=jax.lax.GatherScatterMode.FILL_OR_DROP)
    return buf.at[bidx, positions].set(rows.astype(buf.dtype), mode="drop")


def move_rows(cache: KVCache | HybridCache, start: jax.Array, src: jax.Array) -> KVCache | HybridCache:
    """Copy rows ``start + src[:, i]`` to ``start + i`` in every layer (the accepted path of a verified tree).

    Args:
        start: int32 ``[B]`` first row of the block (the committed length before verification).
        src: int32 ``[B, R]`` block-relative source rows, ``src[:, i] >= i``; columns past a sequence's accepted
            path may hold anything (they land beyond the new committed length, where rows are stale by design).
    """
    dst = start[:, None] + jnp.arange(src.shape[1], dtype=jnp.int32)[None, :]
    if cache.paged:  # through the page table: gather the path's pool rows, write them to the block's first rows
        def move_paged(buf):
            rows_from = page_rows(cache.pages, start[:, None] + src, cache.page_size, buf.shape[2])
            rows = jnp.take(buf[0], jnp.minimum(rows_from, buf.shape[2] - 1), axis=1)  # [H, B, R, D]
            return write_paged(buf, jnp.moveaxis(rows, 0, 2), cache.pages, dst, cache.page_size)

        return cache.replace(k=tuple(rowwise(move_paged, b) for b in cache.k),
                             v=tuple(rowwise(move_paged, b) for b in cache.v))
    idx = (start[:, None] + src)[:, None, :, None]

    def move(buf):  # [B, H, S, D]: gather the path's rows as [B, H, R, D], write them back as [B, R, H, D]
        rows = jnp.take_along_axis(buf, jnp.minimum(idx, buf.shape[2] - 1), axis=2)
        return write_rows(buf, jnp.swapaxes(rows, 1, 2), dst, heads_first=True)

    return cache.replace(k=tuple(rowwise(move, b) for b in cache.k), v=tuple(rowwise(move, b) for b in cache.v))
