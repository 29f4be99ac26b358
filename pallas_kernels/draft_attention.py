"""Pallas kernel: the draft's attention over its fixed-capacity working cache (split-K flash decoding).

Inputs:
    q: ``[B, T, Hq, D]`` rotated queries (T = 1..K+1 rows per sequence: the root or chain steps).
    k, v: ``[B, W, Hkv, D]`` working cache (``Hq % Hkv == 0``, GQA).
    q_local: int32 ``[B, T]`` local positions: slot s is visible to a query at position p iff ``s <= p``
        (per-sequence valid lengths come from these positions).
    scale: softmax scale (1 / sqrt(D)).
Output:
    ``[B, T, Hq, D]`` in ``q.dtype``; softmax statistics in float32, probabilities cast to ``v.dtype`` for the
    ``p @ v`` product (as the reference does).

Grid ``(B, Hkv, splits)``: each program takes the ``T x G`` query rows of one KV head (padded to 16 for the dot)
and one contiguous range of slots, walks it in ``block`` tiles with an online softmax, and writes unnormalised
partial outputs with their (max, sum) statistics; a small XLA epilogue merges the splits
(:func:`pallas_kernels.common.merge_splits`, shared with :mod:`pallas_kernels.cache_attention`). Tiles wholly
past the last visible slot are not read. Bytes moved: one read of the visible K and V slots.
Reference: :func:`diffspec_jax.working_cache.draft_attention_reference` (same signature).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import (NEG, call_options, dot_precision, merge_splits, next_pow2, online_softmax_step,
                                   rows_to_heads)


def _kernel(q_ref, k_ref, v_ref, pos_ref, o_ref, m_ref, l_ref, *, rows, group, steps, block, tiles_per_split,
            num_slots, head_dim, scale, precision):
    from jax.experimental.pallas import triton as plgpu

    b, g, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    r = jnp.arange(rows)
    real = r < steps * group
    t_of = jnp.where(real, r // group, 0)
    head = g * group + r % group
    d = jnp.arange(head_dim)[None, :]
    q = plgpu.load(q_ref.at[b, t_of[:, None], head[:, None], d], mask=real[:, None], other=jnp.zeros((), q_ref.dtype))
    qpos = plgpu.load(pos_ref.at[b, t_of], mask=real, other=-1)
    first = s * tiles_per_split * block
    last_visible = jnp.max(qpos)
    n_tiles = jnp.clip((last_visible - first + block) // block, 0, tiles_per_split)

    def body(i, carry):
        slots = first + i * block + jnp.arange(block)
        inside = slots < num_slots
        k = plgpu.load(k_ref.at[b, slots[:, None], g, d], mask=inside[:, None], other=jnp.zeros((), k_ref.dtype))
        v = plgpu.load(v_ref.at[b, slots[:, None], g, d], mask=inside[:, None], other=jnp.zeros((), v_ref.dtype))
        visible = (slots[None, :] <= qpos[:, None]) & inside[None, :]
        return online_softmax_step(carry, q, k, v, visible, scale=scale, precision=precision)

    init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), NEG, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, n_tiles, body, init)
    plgpu.store(o_ref.at[b, g, s, r[:, None], d], acc)
    plgpu.store(m_ref.at[b, g, s, r], m)
    plgpu.store(l_ref.at[b, g, s, r], l)


@functools.partial(jax.jit, static_argnames=("scale", "block", "split_slots"))
def draft_attention(q, k, v, q_local, *, scale, block=64, split_slots=256):
    """Draft attention over the working cache (see the module docstring for shapes, dtypes and semantics)."""
    b, t, hq, d = q.shape
    w, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    rows = next_pow2(t * group, 16)
    block = min(block, next_pow2(w, 16))
    n_tiles = -(-w // block)
    tiles_per_split = max(1, min(n_tiles, split_slots // block))
    splits = -(-n_tiles // tiles_per_split)
    kernel = functools.partial(_kernel, rows=rows, group=group, steps=t, block=block,
                               tiles_per_split=tiles_per_split, num_slots=w, head_dim=d, scale=scale,
                               precision=dot_precision(q.dtype))
    o, m, l = pl.pallas_call(
        kernel,
        grid=(b, hkv, splits),
        out_shape=(jax.ShapeDtypeStruct((b, hkv, splits, rows, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, splits, rows), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, splits, rows), jnp.float32)),
        name="draft_attention",
        **call_options(num_warps=4, num_stages=2),
    )(q, k, v, q_local.astype(jnp.int32))
    out, _ = merge_splits(o, m, l)                                  # [B, Hkv, rows, D]
    return rows_to_heads(out, t, group).astype(q.dtype)             # row = t * group + head-in-group
