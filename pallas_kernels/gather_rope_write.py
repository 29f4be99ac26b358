"""Pallas kernel: gather the history rows of the canonical store, rotate keys at local positions, write the
working cache in place.

Inputs:
    store_k, store_v: ``[B, S, Hkv, D]`` pre-RoPE canonical draft store (any float dtype).
    work_k, work_v: ``[B, W, Hkv, D]`` working cache; aliased to the outputs (``input_output_aliases``), so
        under a donating ``jit`` it is updated in place. Rows ``N..W-1`` are left untouched.
    idx: int32 ``[B, N]`` absolute positions to gather, ``-1`` = padding (written as zero rows); N <= W.
    cos, sin: float32 ``[N, R/2]`` RoPE tables of local positions ``0..N-1`` (R = rotary dims, R <= D).
    interleaved: rotate pairs ``(2j, 2j+1)`` (GPT-J) instead of halves ``(j, j + R/2)`` (Llama).
Outputs:
    ``(work_k, work_v)`` with ``work_k[b, n] = rope(store_k[b, idx[b, n]], n)`` and ``work_v[b, n] =
    store_v[b, idx[b, n]]`` for n < N, in the working cache's dtype; the unrotated ``D - R`` dims pass through.

One launch for the whole batch: grid ``(B, ceil(N / block_rows), Hkv)``; each program gathers ``block_rows`` rows
of one KV head (vector-indexed loads), rotates in float32 and stores. Bytes moved: one read of the gathered K and
V rows, one write of the working-cache rows (plus N int32 indices and the tables), the minimum for a rebuild.
Reference: :func:`diffspec_jax.working_cache.gather_rope_write_reference` (same signature).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import call_options, pow2_pieces


def _kernel(idx_ref, cos_ref, sin_ref, sk_ref, sv_ref, _wk_in, _wv_in, wk_ref, wv_ref, *, block_rows, n_rows,
            half, head_dim, interleaved, shared):
    from jax.experimental.pallas import triton as plgpu

    b, t, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    sb = 0 if shared else b                               # a paged store: one pool, idx already holds pool rows
    rows = t * block_rows + jnp.arange(block_rows)
    in_range = rows < n_rows
    pos = plgpu.load(idx_ref.at[b, rows], mask=in_range, other=-1)
    valid = (pos >= 0)[:, None]
    src = jnp.where(pos >= 0, pos, 0)[:, None]
    dst = rows[:, None]
    keep = in_range[:, None]
    j = jnp.arange(half)[None, :]
    cos = plgpu.load(cos_ref.at[rows[:, None], j], mask=keep, other=0.0)
    sin = plgpu.load(sin_ref.at[rows[:, None], j], mask=keep, other=0.0)
    cols_a, cols_b = (2 * j, 2 * j + 1) if interleaved else (j, j + half)
    zk, zv = jnp.zeros((), sk_ref.dtype), jnp.zeros((), sv_ref.dtype)
    x1 = plgpu.load(sk_ref.at[sb, src, h, cols_a], mask=valid, other=zk).astype(jnp.float32)
    x2 = plgpu.load(sk_ref.at[sb, src, h, cols_b], mask=valid, other=zk).astype(jnp.float32)
    dtype = wk_ref.dtype
    plgpu.store(wk_ref.at[b, dst, h, cols_a], (x1 * cos - x2 * sin).astype(dtype), mask=keep)
    plgpu.store(wk_ref.at[b, dst, h, cols_b], (x2 * cos + x1 * sin).astype(dtype), mask=keep)
    for start, size in pow2_pieces(2 * half, head_dim):  # dims past the rotary part pass through
        cols = start + jnp.arange(size)[None, :]
        x = plgpu.load(sk_ref.at[sb, src, h, cols], mask=valid, other=zk)
        plgpu.store(wk_ref.at[b, dst, h, cols], x.astype(dtype), mask=keep)
    for start, size in pow2_pieces(0, head_dim):
        cols = start + jnp.arange(size)[None, :]
        x = plgpu.load(sv_ref.at[sb, src, h, cols], mask=valid, other=zv)
        plgpu.store(wv_ref.at[b, dst, h, cols], x.astype(wv_ref.dtype), mask=keep)


@functools.partial(jax.jit, static_argnames=("interleaved", "block_rows"))
def gather_rope_write(store_k, store_v, work_k, work_v, idx, cos, sin, *, interleaved=False, block_rows=64):
    """Gather-RoPE-write (see the module docstring for shapes, dtypes and semantics). A store of batch 1 under a
    batch of ``B > 1`` rows is a paged pool ``[1, (N + 1) * P, Hkv, D]`` and ``idx`` its pool rows
    (:func:`diffspec_jax.working_cache.gather_rope_write` maps positions through the page table)."""
    b, n = idx.shape
    hkv, d = store_k.shape[2], store_k.shape[3]
    half = cos.shape[1]
    if half & (half - 1):
        raise ValueError(f"the Pallas gather-RoPE-write needs a power-of-two rotary half width, got {half}")
    block_rows = min(block_rows, 1 << max(0, (n - 1).bit_length()))
    kernel = functools.partial(_kernel, block_rows=block_rows, n_rows=n, half=half, head_dim=d,
                               interleaved=interleaved, shared=store_k.shape[0] != b)
    return pl.pallas_call(
        kernel,
        grid=(b, pl.cdiv(n, block_rows), hkv),
        out_shape=(jax.ShapeDtypeStruct(work_k.shape, work_k.dtype), jax.ShapeDtypeStruct(work_v.shape, work_v.dtype)),
        input_output_aliases={5: 0, 6: 1},
        name="gather_rope_write",
        **call_options(num_warps=4, num_stages=1),
    )(idx.astype(jnp.int32), cos.astype(jnp.float32), sin.astype(jnp.float32), store_k, store_v, work_k, work_v)
