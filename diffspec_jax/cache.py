"""Fixed-capacity KV caches as pytrees.

The target cache holds one K and one V buffer per layer, ``[B, Hkv, S, D]`` (heads before positions), indexed by
**absolute position**. Heads-first is the layout the attention products read directly: with positions before
heads, XLA copies (transposes) every layer's buffers on each step at batch > 1: for Llama-3.1-8B shapes on an
H200, a 3.7x slower step at 32K x 8 and 32 GiB of temporaries at 64K x 8 (``benchmarks/decode_ablation.py``).
Entries are written with a bounded scatter (positions ``>= S`` are dropped, never clamped onto valid rows) and
read under a causal position mask, so a buffer never needs clearing: rows beyond a sequence's committed length
hold stale values (rejected drafts, prompt padding) that are overwritten before any query can see them.
Separate per-layer buffers let XLA update each in place when the cache is donated to ``jit``.

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
from diffspec_jax.mesh import TP, kv_heads_for

#: key tile of the chunked-prefill attention; cache capacities are rounded up to a multiple of it
ATTENTION_TILE = 256


def round_capacity(capacity: int, tile: int = ATTENTION_TILE) -> int:
    """Capacity rounded up to a whole number of attention tiles (at least one tile)."""
    if capacity <= 0:
        raise ValueError(f"cache capacity must be > 0, got {capacity}")
    return -(-capacity // tile) * tile


class _LayerBuffers:
    """What every cache answers from its first K buffer ``[B, Hkv, S, D]``."""

    k: tuple[jax.Array, ...]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]


@struct.dataclass
class KVCache(_LayerBuffers):
    """Per-layer K/V buffers.

    Attributes:
        k, v: tuples of ``num_layers`` arrays ``[B, Hkv_local, S, D]`` (``Hkv_local`` is the shard's KV heads).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    def layer_keys(self, layer: int) -> jax.Array:
        """The K buffer of decoder layer ``layer``."""
        return self.k[layer]

    @classmethod
    def create(cls, config: ModelConfig, batch: int, capacity: int, dtype=jnp.bfloat16,
               num_kv_heads: int | None = None) -> KVCache:
        """Zero-filled cache of ``round_capacity(capacity)`` positions per sequence."""
        if config.is_hybrid:
            raise ValueError(f"{config.architecture} is a hybrid model: create its cache with HybridCache.create or "
                             f"diffspec_jax.cache.create_cache")
        shape = (batch, num_kv_heads or config.num_key_value_heads, round_capacity(capacity), config.head_dim)
        layers = range(config.num_hidden_layers)
        return cls(k=tuple(jnp.zeros(shape, dtype) for _ in layers), v=tuple(jnp.zeros(shape, dtype) for _ in layers))


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

    def layer_keys(self, layer: int) -> jax.Array:
        """The K buffer of decoder layer ``layer`` (a full-attention layer)."""
        if layer not in self.full_layers:
            raise ValueError(f"layer {layer} is not a full-attention layer (those are {list(self.full_layers)})")
        return self.k[self.full_layers.index(layer)]

    @classmethod
    def create(cls, config: ModelConfig, batch: int, capacity: int, dtype=jnp.bfloat16, *,
               num_kv_heads: int | None = None, num_linear_key_heads: int | None = None,
               num_linear_value_heads: int | None = None) -> HybridCache:
        """Zero-filled cache (zero conv and recurrent states = the state before the first token)."""
        full, linear = config.full_attention_layers, config.linear_attention_layers
        kv = (batch, num_kv_heads or config.num_key_value_heads, round_capacity(capacity), config.head_dim)
        w = config.linear_conv_kernel_dim - 1
        hk = num_linear_key_heads or config.linear_num_key_heads
        hv = num_linear_value_heads or config.linear_num_value_heads
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        zeros = lambda shape, dt, n: tuple(jnp.zeros(shape, dt) for _ in range(n))  # noqa: E731
        return cls(k=zeros(kv, dtype, len(full)), v=zeros(kv, dtype, len(full)),
                   conv_q=zeros((batch, w, hk, dk), dtype, len(linear)),
                   conv_k=zeros((batch, w, hk, dk), dtype, len(linear)),
                   conv_v=zeros((batch, w, hv, dv), dtype, len(linear)),
                   ssm=zeros((batch, hv, dk, dv), jnp.float32, len(linear)),
                   full_layers=full, linear_layers=linear)


def create_cache(config: ModelConfig, batch: int, capacity: int, dtype=jnp.bfloat16, *, tp: int = 1
                 ) -> KVCache | HybridCache:
    """The right cache for ``config`` (global shapes for a ``tp``-way tensor-parallel layout: heads that do not
    divide by ``tp`` are repeated, as :mod:`diffspec_jax.sharding` lays out the projections)."""
    kv = kv_heads_for(config.num_key_value_heads, tp, "the target")
    if not config.is_hybrid:
        return KVCache.create(config, batch, capacity, dtype, num_kv_heads=kv)
    return HybridCache.create(config, batch, capacity, dtype, num_kv_heads=kv,
                              num_linear_key_heads=kv_heads_for(config.linear_num_key_heads, tp,
                                                                "the target's linear attention"))


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
    cache's scatter is declared free of collisions and writes one ``[H, D]`` window per (sequence, row)."""
    bidx = jnp.broadcast_to(jnp.arange(buf.shape[0])[:, None], positions.shape)
    if heads_first:
        dims = jax.lax.ScatterDimensionNumbers(update_window_dims=(2, 3), inserted_window_dims=(0, 2),
                                               scatter_dims_to_operand_dims=(0, 2))
        return jax.lax.scatter(buf, jnp.stack([bidx, positions.astype(bidx.dtype)], axis=-1),
                               rows.astype(buf.dtype), dims, unique_indices=True,
                               mode=jax.lax.GatherScatterMode.FILL_OR_DROP)
    return buf.at[bidx, positions].set(rows.astype(buf.dtype), mode="drop")


def move_rows(cache: KVCache, start: jax.Array, src: jax.Array) -> KVCache:
    """Copy rows ``start + src[:, i]`` to ``start + i`` in every layer (the accepted path of a verified tree).

    Args:
        start: int32 ``[B]`` first row of the block (the committed length before verification).
        src: int32 ``[B, R]`` block-relative source rows, ``src[:, i] >= i``; columns past a sequence's accepted
            path may hold anything (they land beyond the new committed length, where rows are stale by design).
    """
    dst = start[:, None] + jnp.arange(src.shape[1], dtype=jnp.int32)[None, :]
    idx = (start[:, None] + src)[:, None, :, None]

    def move(buf):  # [B, H, S, D]: gather the path's rows as [B, H, R, D], write them back as [B, R, H, D]
        rows = jnp.take_along_axis(buf, jnp.minimum(idx, buf.shape[2] - 1), axis=2)
        return write_rows(buf, jnp.swapaxes(rows, 1, 2), dst, heads_first=True)

    return cache.replace(k=tuple(move(b) for b in cache.k), v=tuple(move(b) for b in cache.v))
