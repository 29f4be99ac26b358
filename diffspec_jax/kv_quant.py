"""The 8-bit target K/V cache (``kv_cache_dtype="fp8"``): rows stored as ``float8_e4m3fn`` with one float32 scale
per (token, KV head).

A layer's K (or V) buffer is then an :class:`Fp8Rows` pytree instead of one array: ``values`` has the buffer's shape
(``[B, Hkv, S, D]``, or a paged pool ``[1, Hkv, (N + 1) * P, D]``) in e4m3, ``scale`` the same shape with a last
axis of 1 in float32, so every row operation of the cache (scatter, page gather, window copy, tree move) applies to both
leaves alike (``jax.tree_util.tree_map``). A row ``x [D]`` of one token and head is stored as
``values = round_e4m3(x / s)`` with ``s = max|x| / 448`` (448 is e4m3's largest finite value; ``s = 1`` for an
all-zero row), so ``x ~= values * s``.

Why one scale per token and head: it needs no calibration data; an outlier token only coarsens its own row; each
row's scale is computed and written once, with the row (a page never needs requantizing as it fills); and a page's
bytes depend on its tokens alone, so prefix caching and page sharing work unchanged. Why float32 scales: the scale
is exact (``max|x| / 448`` in float32, no second rounding) and four-byte aligned; it costs 4 bytes per 128-byte row
at Llama's head size, 3% of the fp8 cache (bf16 scales would save 1.5%).

Attention never dequantizes the cache into a full-precision copy: scores are ``(q . values_k) * s_k`` per key
column and the value product is ``(p * s_v) @ values_v``, with the e4m3 values upcast (exactly) to the query's
dtype inside the product (:func:`diffspec_jax.models.layers.attention_dense`, the Pallas kernels).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

#: the storage type of an 8-bit cache's values, and its largest finite magnitude
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0


@struct.dataclass
class Fp8Rows:
    """One layer's K or V buffer in 8 bits (see the module docstring).

    Attributes:
        values: ``float8_e4m3fn [..., S, D]`` the rows divided by their scale.
        scale: float32 ``[..., S, 1]`` one scale per row (token and head).
    """

    values: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The values' shape (the buffer's shape as a full-precision one would have it)."""
        return self.values.shape

    @classmethod
    def zeros(cls, shape: tuple[int, ...]) -> Fp8Rows:
        """An all-zero buffer of ``shape`` (values 0, scales 0)."""
        return cls(values=jnp.zeros(shape, FP8), scale=jnp.zeros(tuple(shape[:-1]) + (1,), jnp.float32))


def quantize(x: jax.Array) -> Fp8Rows:
    """Rows ``x [..., D]`` (any float dtype) as :class:`Fp8Rows`: ``scale = max|x| / 448`` over the last axis (1 where
    the row is all zero), ``values = x / scale`` rounded to e4m3 (clipped to +-448, so a rounding past it never
    turns into e4m3's NaN)."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return Fp8Rows(values=jnp.clip(x32 / scale, -FP8_MAX, FP8_MAX).astype(FP8), scale=scale)


def dequantize(rows: Fp8Rows, dtype=jnp.float32) -> jax.Array:
    """``values * scale`` in ``dtype`` (for small row sets: a working set's rows, a test; attention never calls it
    on the cache)."""
    return (rows.values.astype(jnp.float32) * rows.scale).astype(dtype)


def is_fp8(buf: Any) -> bool:
    """Whether a cache buffer is stored in 8 bits."""
    return isinstance(buf, Fp8Rows)


def encode_like(buf: Any, rows: jax.Array | Fp8Rows) -> jax.Array | Fp8Rows:
    """``rows`` in ``buf``'s storage: quantized when ``buf`` is :class:`Fp8Rows` and they are not yet; as they are
    otherwise (already quantized rows, e.g. ones moved within the cache, are never requantized)."""
    return quantize(rows) if is_fp8(buf) and not is_fp8(rows) else rows


def parts(buf: jax.Array | Fp8Rows) -> tuple[jax.Array, jax.Array | None]:
    """``(values, scale)`` of an 8-bit buffer, ``(buf, None)`` of a full-precision one."""
    return (buf.values, buf.scale) if is_fp8(buf) else (buf, None)


def rowwise(fn, buf, *more):
    """``fn`` applied to each leaf of ``buf`` (the array itself, or an 8-bit buffer's values and scale), with the
    matching leaves of ``more`` (same structure) as further arguments: a row operation that moves rows without
    looking at them (a scatter, a gather through the page table, a window copy)."""
    return jax.tree_util.tree_map(fn, buf, *more)


def row_dtype(buf: jax.Array | Fp8Rows, compute_dtype) -> Any:
    """The dtype a buffer's rows enter a product in: ``compute_dtype`` (the query's) for 8-bit values (upcast
    exactly: every e4m3 value is a bfloat16 value), the buffer's own otherwise."""
    return jnp.dtype(compute_dtype) if is_fp8(buf) else buf.dtype
