"""Fixed-capacity KV caches as pytrees.

The target cache holds one K and one V buffer per layer, ``[B, S, Hkv, D]``, indexed by **absolute position**.
Entries are written with a bounded scatter (positions ``>= S`` are dropped, never clamped onto valid rows) and
read under a causal position mask, so a buffer never needs clearing: rows beyond a sequence's committed length
hold stale values (rejected drafts, prompt padding) that are overwritten before any query can see them.
Separate per-layer buffers let XLA update each in place when the cache is donated to ``jit``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from diffspec_jax.config import ModelConfig

#: key tile of the chunked-prefill attention; cache capacities are rounded up to a multiple of it
ATTENTION_TILE = 256


def round_capacity(capacity: int, tile: int = ATTENTION_TILE) -> int:
    """Capacity rounded up to a whole number of attention tiles (at least one tile)."""
    if capacity <= 0:
        raise ValueError(f"cache capacity must be > 0, got {capacity}")
    return -(-capacity // tile) * tile


@struct.dataclass
class KVCache:
    """Per-layer K/V buffers.

    Attributes:
        k, v: tuples of ``num_layers`` arrays ``[B, S, Hkv_local, D]`` (``Hkv_local`` is the shard's KV heads).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    @classmethod
    def create(cls, config: ModelConfig, batch: int, capacity: int, dtype=jnp.bfloat16,
               num_kv_heads: int | None = None) -> KVCache:
        """Zero-filled cache of ``round_capacity(capacity)`` positions per sequence."""
        shape = (batch, round_capacity(capacity), num_kv_heads or config.num_key_value_heads, config.head_dim)
        layers = range(config.num_hidden_layers)
        return cls(k=tuple(jnp.zeros(shape, dtype) for _ in layers), v=tuple(jnp.zeros(shape, dtype) for _ in layers))


def write_rows(buf: jax.Array, rows: jax.Array, positions: jax.Array) -> jax.Array:
    """Scatter ``rows [B, T, ...]`` into ``buf [B, S, ...]`` at ``positions [B, T]``; out-of-range rows are dropped."""
    bidx = jnp.broadcast_to(jnp.arange(buf.shape[0])[:, None], positions.shape)
    return buf.at[bidx, positions].set(rows.astype(buf.dtype), mode="drop")
