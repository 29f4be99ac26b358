"""Pallas kernel: per-chunk attention-probability scores from one query row per sequence, tile by tile.

Inputs:
    q: float32 ``[B, Hq, D]`` post-RoPE query rows of the scoring layer (the last committed position).
    lse: float32 ``[B, Hq]`` their log-sum-exp over positions ``0..r`` (from the verify pass).
    k_cache: ``[B, Hkv, S, D]`` post-RoPE keys of that layer (the target cache's layout; bf16 or float32, or
        ``float8_e4m3fn`` with ``k_scale`` float32 ``[B, Hkv, S, 1]``, one scale per row: the logits are then
        ``(q . k8) * k_scale``, the 8-bit rows upcast to bf16 in registers), ``Hq % Hkv == 0``.
    root: int32 ``[B]`` the root position r; keys past it contribute nothing.
    chunk: C, a power of two.
    pages, page_size (optional, a paged cache): ``k_cache`` (and ``k_scale``) are then the pool
        ``[1, Hkv, (N + 1) * P, D]`` (``[1, Hkv, (N + 1) * P, 1]``) and ``pages`` int32 ``[B, max_pages]`` the page
        table: sequence b's position p lives at pool row ``pages[b, p // P] * P + p % P`` (P = ``page_size``,
        static), and ``S = max_pages * P``. Table entries past a sequence's root (unallocated: the sentinel N, or
        anything) are never read.
Output:
    float32 ``[B, ceil(S / C)]``: ``sum_h mean_{t in chunk, t <= r} exp(q_h . k_g(h)(t) / sqrt(D) - lse_h)`` --
    the **head sum** of the mean probability per valid token (the caller ``psum``s over tensor-parallel shards and
    divides by the number of query heads).

Grid ``(B, ceil(S / (block * tiles)), Hkv)``: each program walks ``tiles`` consecutive ``block``-position tiles
of one KV head's keys (a software-pipelined loop: the next tile loads while this one computes), reads each once,
computes the probabilities of that head's query group in registers (a padded ``[16, D] x [D, block]`` dot per KV
head in the cache's dtype with float32 accumulation: IEEE float32 for float32 keys; bf16 keys take a bf16 copy of
q) and reduces them to ``block / C`` chunk sums per KV head (summed over KV heads by a small XLA epilogue), so the
``[Hq, S]`` probabilities never reach device memory. Rows past the root are masked off and not read, and tiles
wholly past it are not walked (a trip count clipped by the root, so a program whose range lies past the root loads
no key nor table entry; the epilogue scores their chunks 0). Over a paged pool each tile's rows are loaded through
the page table (one more small vector load of ``block`` table entries per tile, masked like the rows), so paging
costs no copy. Bytes moved: one read of ``K[0..r]`` (and, paged, of the table entries of positions ``0..r``) +
``B x S / C`` float32 outputs.
Reference: :func:`diffspec_jax.retrieval.head_sum_scores` (same signature; over a paged pool, the per-sequence
view gathered through the table: :func:`diffspec_jax.retrieval.run_chunk_scores`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import call_options, dot_precision, matmul, next_pow2, paged_rows


def _kernel(q_ref, lse_ref, k_ref, root_ref, *refs, block, tiles, chunk, seq_len, group, head_dim, num_chunks,
            precision, fp8, page_size):
    from jax.experimental.pallas import triton as plgpu

    refs = list(refs)
    pt_ref = refs.pop(0) if page_size else None
    ks_ref = refs.pop(0) if fp8 else None
    (out_ref,) = refs
    b, t, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    root = plgpu.load(root_ref.at[b])
    rows = jnp.arange(next_pow2(group, 16))
    in_group = rows < group
    heads = g * group + rows
    d = jnp.arange(head_dim)[None, :]
    q = plgpu.load(q_ref.at[b, heads[:, None], d], mask=in_group[:, None], other=0.0)
    lse = plgpu.load(lse_ref.at[b, heads], mask=in_group, other=0.0)
    per_tile = block // chunk
    first = t * tiles * block
    # tiles wholly past the root are not walked (a data-dependent trip count): their chunks score 0 in the epilogue
    n_tiles = jnp.clip((jnp.minimum(root + 1, seq_len) - first + block - 1) // block, 0, tiles)

    def body(i, carry):  # a software-pipelined walk over this program's tiles
        start = first + i * block
        pos = start + jnp.arange(block)
        visible = (pos <= root) & (pos < seq_len)  # masked-off rows are not read
        sb, row = paged_rows(pt_ref, b, pos, visible, page_size)  # (table entries past the root never read)
        k = plgpu.load(k_ref.at[sb, g, row[:, None], d], mask=visible[:, None], other=jnp.zeros((), k_ref.dtype))
        if fp8:
            k = k.astype(jnp.bfloat16)
        logits = matmul(q.astype(k.dtype), k, trans_b=True, precision=precision) * (head_dim ** -0.5)
        if fp8:
            logits = logits * plgpu.load(ks_ref.at[sb, g, row, 0], mask=visible, other=0.0)[None, :]
        p = jnp.where(in_group[:, None] & visible[None, :], jnp.exp(logits - lse[:, None]), 0.0)
        sums = jnp.sum(jnp.sum(p, axis=0).reshape(per_tile, chunk), axis=1)
        chunk_ids = start // chunk + jnp.arange(per_tile)
        counts = jnp.clip(root + 1 - chunk_ids * chunk, 0, chunk)
        scores = jnp.where(counts > 0, sums / jnp.maximum(counts, 1).astype(jnp.float32), 0.0)
        plgpu.store(out_ref.at[b, g, chunk_ids], scores, mask=chunk_ids < num_chunks)
        return carry

    jax.lax.fori_loop(0, n_tiles, body, 0)


@functools.partial(jax.jit, static_argnames=("chunk", "block", "tiles", "page_size"))
def chunk_scores(q, lse, k_cache, root, *, chunk, block=128, tiles=8, k_scale=None, pages=None, page_size=0):
    """Head-summed chunk scores (see the module docstring for shapes, dtypes and semantics; ``k_scale`` with
    8-bit keys; ``pages`` and ``page_size`` over a paged pool)."""
    b, hq, d = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    if chunk & (chunk - 1):
        raise ValueError(f"the Pallas chunk_scores kernel needs a power-of-two chunk size, got {chunk}")
    if pages is not None:
        if page_size <= 0 or pages.ndim != 2 or pages.shape[0] != b or k_cache.shape[0] != 1:
            raise ValueError(f"chunk_scores: pages {pages.shape} (page size {page_size}) do not fit q {q.shape} and "
                             f"a pool {k_cache.shape}")
        s = pages.shape[1] * page_size
    elif page_size:
        raise ValueError("chunk_scores: page_size without pages")
    elif k_cache.shape[0] != b:
        raise ValueError(f"chunk_scores: q {q.shape} does not fit k_cache {k_cache.shape}")
    if k_scale is not None and k_scale.shape != k_cache.shape[:3] + (1,):
        raise ValueError(f"chunk_scores: 8-bit keys {k_cache.shape} need k_scale {k_cache.shape[:3] + (1,)}, "
                         f"got {k_scale.shape}")
    block = max(block, chunk)
    tiles = max(1, min(tiles, -(-s // block)))
    num_chunks = -(-s // chunk)
    root = root.astype(jnp.int32)
    kernel = functools.partial(_kernel, block=block, tiles=tiles, chunk=chunk, seq_len=s, group=hq // hkv,
                               head_dim=d, num_chunks=num_chunks, fp8=k_scale is not None,
                               page_size=page_size if pages is not None else 0,
                               precision=dot_precision(jnp.bfloat16 if k_scale is not None else k_cache.dtype))
    extra = (() if pages is None else (pages.astype(jnp.int32),)) + (
        () if k_scale is None else (k_scale.astype(jnp.float32),))
    per_head = pl.pallas_call(
        kernel,
        grid=(b, pl.cdiv(s, block * tiles), hkv),
        out_shape=jax.ShapeDtypeStruct((b, hkv, num_chunks), jnp.float32),
        name="chunk_scores",
        **call_options(num_warps=4, num_stages=3),
    )(q.astype(jnp.float32), lse.astype(jnp.float32), k_cache, root, *extra)
    # chunks wholly past the root lie in tiles no program walked (their outputs were never written): they score 0
    scored = (jnp.arange(num_chunks) * chunk)[None, :] <= root[:, None]
    return jnp.where(scored, jnp.sum(per_head, axis=1), 0.0)
