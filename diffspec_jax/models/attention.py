"""Attention of a target step over its KV cache: one entry point, three implementations.

Every cached target step (prefill chunk, decode, chain verification, tree verification) writes its ``T`` new
K/V rows at ``start .. start + T - 1`` and attends to the committed prefix (rows ``< start``) plus the block of
new rows under a block mask (causal for chains and prefill, the ancestry mask for trees). :func:`cache_attention`
computes exactly that and picks how:

* **reference** (CPUs, and ``DIFFSPEC_KERNELS=reference``): one dense masked attention over the whole buffer for
  steps of up to :data:`DENSE_ATTENTION_MAX_TOKENS` tokens, the tiled online-softmax loop of
  :func:`diffspec_jax.models.layers.attention_tiled` for longer (prefill) chunks. These are the numerics every
  test checks against transformers.
* **fast** (``DIFFSPEC_KERNELS=pallas``, the default on GPUs): a decode or chain-verify step is one call of
  :func:`pallas_kernels.cache_attention.cache_attention` in its causal form over the buffer with the block already
  written (split-K flash decoding: the ``T x G`` query rows of a KV head share one read of each KV tile, so
  verifying K + 1 tokens reads the cache once, like a decode step). A tree block and a prefill chunk compute
  the prefix and the block separately and merge them by their log-sum-exp
  (:func:`diffspec_jax.models.layers.merge_attention`): the prefix by the same kernel (trees) or cuDNN's flash
  attention (prefill), the block densely under its ancestry mask (trees) or by cuDNN causal flash attention
  (prefill; a prompt's first chunk, called with ``prefix=False``, skips the prefix call and the merge). Nothing
  of size ``[T, S]`` is ever built.
* On a CPU with ``DIFFSPEC_KERNELS=pallas`` the fast path runs with the Pallas kernel interpreted and XLA in
  place of cuDNN, so its decomposition and merge are tested without a GPU.
* On a TPU, prefill chunks whose width and cache capacity are whole multiples of :data:`SPLASH_BLOCK` take the
  same decomposition on JAX's splash attention (:func:`_splash`: causal over the block, segment ids for the
  prefix), whatever the kernel choice; decode and verification keep the reference there (the Pallas kernels
  are Triton ones). Tests run it interpreted on a CPU; no TPU has run it yet.

cuDNN flash attention needs bfloat16 or float16 operands; float32 prefill on a GPU keeps the tiled XLA loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as sa

from diffspec_jax.cache import ATTENTION_TILE, page_view, write_paged, write_rows
from diffspec_jax.kv_quant import dequantize, encode_like, is_fp8, parts, rowwise
from diffspec_jax.models.layers import NEG_INF, attention_dense, attention_prefix, attention_tiled, merge_attention
from pallas_kernels import cache_attention as cache_attention_kernel
from pallas_kernels.common import deterministic, kernel_backend

#: steps with at most this many new tokens per sequence attend densely over the cache (decode, verification,
#: tree blocks); longer ones (prefill chunks) use the tiled (reference) or flash (fast) path
DENSE_ATTENTION_MAX_TOKENS = 64


def causal_block_mask(batch: int, t: int) -> jax.Array:
    """bool ``[B, T, T]``: block row i sees block rows ``0..i`` (chains and prefill chunks)."""
    tri = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    return jnp.broadcast_to(tri[None], (batch, t, t))


def full_mask(start: jax.Array, block_mask: jax.Array, capacity: int) -> jax.Array:
    """bool ``[B, T, S]`` over the whole buffer for a block written at rows ``start .. start + T - 1``: the
    committed prefix (rows ``< start``) plus the block rows that ``block_mask [B, T, T]`` marks."""
    t = block_mask.shape[1]
    rel = jnp.arange(capacity, dtype=jnp.int32)[None, None, :] - start[:, None, None]
    in_block = (rel >= 0) & (rel < t)
    idx = jnp.broadcast_to(jnp.clip(rel, 0, t - 1), (block_mask.shape[0], t, capacity))
    return (rel < 0) | (in_block & jnp.take_along_axis(block_mask, idx, axis=2))


def fast_path() -> bool:
    """True when the fast implementations are chosen (:func:`pallas_kernels.common.kernel_backend`)."""
    return kernel_backend() == "pallas"


def run_cache_attention(q, k, v, lengths, *, scale, causal=False, pages=None, page_size=0):
    """:func:`pallas_kernels.cache_attention.cache_attention` or its reference
    :func:`~diffspec_jax.models.layers.attention_prefix` (same contract: ``(out, lse)`` over the committed prefix,
    and with ``causal`` over the chain block written after it), by :func:`fast_path`. With ``pages`` (a paged
    cache: ``k``, ``v`` are pools ``[1, Hkv, (N + 1) * P, D]``) the kernel reads the pool through the page table; the
    reference reads the gathered per-sequence view. 8-bit buffers (:class:`~diffspec_jax.kv_quant.Fp8Rows`) are
    read as stored and dequantized inside the products, by the kernel and the reference alike."""
    if fast_path():
        (kq, ks), (vq, vs) = parts(k), parts(v)
        return cache_attention_kernel.cache_attention(q, kq, vq, lengths, scale=scale, causal=causal, pages=pages,
                                                      page_size=page_size, deterministic=deterministic(),
                                                      k_scale=ks, v_scale=vs)
    if pages is not None:
        k, v = page_view(k, pages, page_size), page_view(v, pages, page_size)
    return attention_prefix(q, k, v, lengths, scale, causal=causal)


def _cudnn_ok(x: jax.Array) -> bool:
    return jax.default_backend() == "gpu" and x.dtype in (jnp.bfloat16, jnp.float16)


def _cudnn(q, k, v, *, scale, layout, mask, q_len=None, kv_len=None):
    """cuDNN flash attention returning ``(out, lse)`` with lse float32 ``[B, Hq, T]`` (natural log, scaled logits).

    jax.nn.dot_product_attention casts the softmax statistics to the output dtype; the lower-level call keeps
    them in float32, which the log-sum-exp merge needs."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    kind = {"padding": cudnn.MaskType.PADDING, "causal": cudnn.MaskType.CAUSAL}[mask]
    return cudnn.dot_product_attention(q, k, v, q_seqlen=q_len, kv_seqlen=kv_len, scale=scale, mask_type=kind,
                                       qkv_layout=layout, return_residual=True)


#: query and key rows per splash-attention block (TPU prefill): chunk widths and cache capacities must divide by it
SPLASH_BLOCK = 128


def _on_tpu() -> bool:
    return jax.default_backend() == "tpu"


def _splash_ok(q: jax.Array, s_len: int) -> bool:
    """Splash attention (JAX's Pallas TPU flash kernel) serves this prefill chunk: a TPU, and a chunk width and a
    key length in whole :data:`SPLASH_BLOCK` blocks."""
    return _on_tpu() and q.shape[1] % SPLASH_BLOCK == 0 and s_len % SPLASH_BLOCK == 0


def _splash(q, k, v, scale, *, kv_start=None):
    """GQA through splash attention: q ``[B, T, Hq, D]``, k and v ``[B, Hkv, S, D]`` (heads first). ``kv_start``
    ``None``: causal attention of the block over itself (``S == T``); else int32 ``[B]``: every query sees key rows
    ``0 .. kv_start[b] - 1`` (the committed prefix, by segment ids). Returns ``(out [B, T, Hq, D], lse float32
    [B, T, Hq])``, natural log-sum-exp of the scaled logits. Compiled on a TPU, interpreted elsewhere (tests)."""
    b, t, hq, d = q.shape
    hkv, s_len = k.shape[1], k.shape[2]
    g = hq // hkv
    shape = (t, s_len)
    head_mask = sa.CausalMask(shape) if kv_start is None else sa.FullMask(shape)
    blocks = sa.BlockSizes(block_q=SPLASH_BLOCK, block_kv=SPLASH_BLOCK, block_kv_compute=SPLASH_BLOCK)
    interpret = jax.default_backend() != "tpu"  # the device itself (tests patch _on_tpu)
    kernel = sa.make_splash_mqa_single_device(sa.MultiHeadMask([head_mask] * g), block_sizes=blocks,
                                              save_residuals=True, interpret=interpret)
    qg = jnp.transpose((q * scale).astype(q.dtype).reshape(b, t, hkv, g, d), (0, 2, 3, 1, 4))  # [B, Hkv, G, T, D]
    if kv_start is None:
        run = jax.vmap(jax.vmap(lambda qq, kk, vv: kernel(qq, kk, vv)))
        out, (lse,) = run(qg, k, v)
    else:
        seg_q = jnp.zeros((b, t), jnp.int32)
        seg_kv = (jnp.arange(s_len, dtype=jnp.int32)[None, :] >= kv_start[:, None]).astype(jnp.int32)
        per_head = lambda qq, kk, vv, sq, skv: kernel(qq, kk, vv, segment_ids=sa.SegmentIds(sq, skv))  # noqa: E731
        run = jax.vmap(jax.vmap(per_head, in_axes=(0, 0, 0, None, None)))
        out, (lse,) = run(qg, k, v, seg_q, seg_kv)
    out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, hq, d)
    return out.astype(q.dtype), jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, t, hq).astype(jnp.float32)


def flash_prefix(q, k_buf, v_buf, start, scale):
    """Prefill queries ``[B, T, Hq, D]`` over the first ``start[b]`` rows of ``[B, Hkv, S, D]`` buffers.
    Returns ``(out [B, T, Hq, D], lse float32 [B, T, Hq])``; an empty prefix gives 0 and NEG_INF. Without cuDNN
    (CPUs only: :func:`cache_attention` keeps float32 GPU prefill on the tiled loop) the dense reference runs; on a
    TPU, splash attention."""
    if _splash_ok(q, k_buf.shape[2]):
        out, lse = _splash(q, k_buf, v_buf, scale, kv_start=start.astype(jnp.int32))
    elif _cudnn_ok(q):
        b, t = q.shape[:2]
        out, lse = _cudnn(jnp.swapaxes(q, 1, 2), k_buf, v_buf, scale=scale, layout="BNTH", mask="padding",
                          q_len=jnp.full((b,), t, jnp.int32), kv_len=start.astype(jnp.int32))
        out, lse = jnp.swapaxes(out, 1, 2), jnp.swapaxes(lse, 1, 2).astype(jnp.float32)
    else:
        return attention_prefix(q, k_buf, v_buf, start, scale)
    empty = (start <= 0)[:, None, None]
    return jnp.where(empty[..., None], jnp.zeros((), out.dtype), out), jnp.where(empty, NEG_INF, lse)


#: the fewest cache rows per segment of an 8-bit prefix that a prefill chunk dequantizes at a time
#: (:func:`flash_prefix_fp8`; a segment is at least the chunk's width)
FP8_PREFIX_SEGMENT = 4096


def flash_prefix_fp8(q, k_buf, v_buf, start, scale, *, pages=None, page_size=0):
    """:func:`flash_prefix` over 8-bit buffers (:class:`~diffspec_jax.kv_quant.Fp8Rows`, contiguous ``[B, Hkv, S,
    D]`` or a pool read through ``pages``): the prefix in segments of ``max(T, FP8_PREFIX_SEGMENT)`` rows (whole
    pages), each gathered, dequantized to q's dtype and attended by the flash kernel, the parts merged by their
    log-sum-exp in a loop that skips segments past every row's prefix. So a prefill chunk runs on cuDNN (which reads
    full-precision operands only) and dequantizes one segment at a time, a temporary the size of the chunk's own
    rows, never the cache. Returns ``(out [B, T, Hq, D], lse float32 [B, T, Hq])``."""
    seg = max(q.shape[1], FP8_PREFIX_SEGMENT)
    if pages is not None:
        seg = -(-seg // page_size) * page_size
        per = seg // page_size
        n = -(-pages.shape[1] // per)
        table = jnp.pad(pages, ((0, 0), (0, n * per - pages.shape[1])))  # past every prefix: never visible
    else:
        reach = k_buf.shape[2]
        n = -(-reach // seg)
    start = start.astype(jnp.int32)

    def rows(buf, i):  # segment i of one buffer, [B, Hkv, seg, D], 8-bit as stored
        if pages is None:
            pos = jnp.clip(i * seg + jnp.arange(seg), 0, reach - 1)  # rows past the buffer: never visible
            return rowwise(lambda a: jnp.take(a, pos, axis=2), buf)
        cols = jax.lax.dynamic_slice_in_dim(table, i * per, per, axis=1)
        return page_view(buf, cols, page_size)

    def part(carry, i):
        def merge(c):
            k, v = (dequantize(rows(buf, i), q.dtype) for buf in (k_buf, v_buf))
            return merge_attention(c[0], c[1], *flash_prefix(q, k, v, jnp.clip(start - i * seg, 0, seg), scale))
        return jax.lax.cond(jnp.any(start > i * seg), merge, lambda c: c, carry), None

    # The running output starts as q * 0, not as zeros: a loop carry that depends on nothing is one XLA may make for
    # every layer at the program's start (29 x 512 MB at a 32K chunk on an H100: issue 41's 128K x 1 fp8 run peaked
    # at 46.9 GB against bf16's 40.7). (A query row holding inf or NaN attends to NaN either way.) Every segment
    # stays inside the loop: one dequantized outside it depends on the buffers alone, and could be hoisted likewise.
    init = (q.astype(jnp.float32) * 0, jnp.full(q.shape[:3], NEG_INF, jnp.float32))
    (out, lse), _ = jax.lax.scan(part, init, jnp.arange(n, dtype=jnp.int32))
    return out.astype(q.dtype), lse


def flash_causal(q, k, v, scale):
    """Causal attention of a block over itself: q ``[B, T, Hq, D]``, k, v ``[B, T, Hkv, D]`` (row i sees rows
    ``0..i``). Returns ``(out [B, T, Hq, D], lse float32 [B, T, Hq])``. cuDNN on GPUs, splash attention on TPUs."""
    if _splash_ok(q, k.shape[1]):
        return _splash(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), scale)
    if not _cudnn_ok(q):
        return attention_dense(q, k, v, causal_block_mask(q.shape[0], q.shape[1]), scale)
    out, lse = _cudnn(q, k, v, scale=scale, layout="BTNH", mask="causal")
    return out, jnp.swapaxes(lse, 1, 2).astype(jnp.float32)


def write_block(k: jax.Array, v: jax.Array, k_buf: jax.Array, v_buf: jax.Array, start: jax.Array, *,
                prefix: bool = True, pages: jax.Array | None = None, page_size: int = 0
                ) -> tuple[jax.Array, jax.Array]:
    """A step's new K/V ``[B, T, Hkv, D]`` written into the layer's ``[B, Hkv, S, D]`` buffers at rows
    ``start .. start + T - 1`` (rows past the buffer are dropped). ``prefix=False`` (static) promises ``start == 0``
    for every row (a prompt's first prefill chunk): one in-place slice update instead of a scatter. With ``pages``
    the buffers are pools and the rows go through the page table (:func:`diffspec_jax.cache.write_paged`). 8-bit
    buffers take the rows quantized (``k``, ``v`` may come quantized already:
    :func:`diffspec_jax.kv_quant.encode_like`)."""
    t = k.shape[1]
    if pages is not None:
        slots = start[:, None].astype(jnp.int32) + jnp.arange(t, dtype=jnp.int32)[None, :]
        return (write_paged(k_buf, k, pages, slots, page_size), write_paged(v_buf, v, pages, slots, page_size))
    if not prefix and t <= k_buf.shape[2]:
        def put(buf, rows):
            return jax.lax.dynamic_update_slice_in_dim(buf, jnp.swapaxes(rows, 1, 2).astype(buf.dtype), 0, axis=2)

        return (rowwise(put, k_buf, encode_like(k_buf, k)), rowwise(put, v_buf, encode_like(v_buf, v)))
    slots = start[:, None].astype(jnp.int32) + jnp.arange(t, dtype=jnp.int32)[None, :]
    return write_rows(k_buf, k, slots, heads_first=True), write_rows(v_buf, v, slots, heads_first=True)


def cache_attention(q: jax.Array, k: jax.Array, v: jax.Array, k_buf: jax.Array, v_buf: jax.Array,
                    start: jax.Array, scale: float, *, positions: jax.Array | None = None,
                    block_mask: jax.Array | None = None, prefix: bool = True, pages: jax.Array | None = None,
                    page_size: int = 0):
    """Write a step's new K/V into the layer's buffers and attend its queries over prefix + block.

    Args:
        q: ``[B, T, Hq, D]`` rotated queries; k, v: ``[B, T, Hkv, D]`` the step's rotated keys and values.
        k_buf, v_buf: ``[B, Hkv, S, D]`` the layer's cache buffers (heads first).
        start: int32 ``[B]`` committed length: block row i is written at row ``start + i``.
        positions: int32 ``[B, T]`` RoPE positions (default ``start + i``); only the tiled reference prefill
            reads them (a tree's rows are written at ``start + i`` but rotated at ``start + depth``).
        block_mask: bool ``[B, T, T]`` which block rows each block row sees (default causal; trees pass their
            ancestry mask). Prefill chunks (``T > DENSE_ATTENTION_MAX_TOKENS``) must be causal.
        prefix: static; ``False`` promises ``start == 0`` for every row (a prompt's first prefill chunk): its rows
            are written by one slice update (no scatter), and the fast path skips the prefix attention and the
            merge. Decode and verification steps ignore it.
        pages, page_size: a paged cache (:class:`diffspec_jax.cache.KVCache`): ``k_buf``, ``v_buf`` are the
            layer's pools ``[1, Hkv, (N + 1) * P, D]`` and ``pages [B, max_pages]`` maps positions to pool rows. Decode,
            verification and tree blocks read the pool through the table (the Pallas kernel; the references read
            the gathered view); a prefill chunk over a prefix reads the gathered view of its prefix.
        8-bit buffers (:class:`~diffspec_jax.kv_quant.Fp8Rows`, ``kv_cache_dtype="fp8"``): the block's K/V are
            quantized first, written, and every path attends to the quantized rows (the block's own rows too, in
            a tree's block attention and a prefill chunk's causal part), so a row's attention reads the same
            values in a prefill chunk, a decode step, a chain verify block and a tree block.
    Returns:
        ``((out [B, T, Hq, D] in q.dtype, lse [B, T, Hq] float32), k_buf, v_buf)``.
    """
    b, t = q.shape[:2]
    slots = start[:, None].astype(jnp.int32) + jnp.arange(t, dtype=jnp.int32)[None, :]
    positions = slots if positions is None else positions
    k, v = encode_like(k_buf, k), encode_like(v_buf, v)  # the block as stored: every path below reads these
    kb, vb = write_block(k, v, k_buf, v_buf, start, prefix=prefix, pages=pages, page_size=page_size)
    paged = dict(pages=pages, page_size=page_size)
    view = (lambda buf: buf) if pages is None else (lambda buf: page_view(buf, pages, page_size))  # noqa: E731
    dense = t <= DENSE_ATTENTION_MAX_TOKENS
    if not dense and block_mask is not None:
        raise ValueError(f"a block of {t} > {DENSE_ATTENTION_MAX_TOKENS} tokens must be causal (prefill)")
    # the flash prefill needs cuDNN (GPU, bf16/fp16); on a CPU its XLA stand-ins run (tests of the decomposition);
    # a TPU runs its prefill chunks on splash attention whatever the kernel choice (the Pallas kernels are GPU ones)
    capacity = kb.shape[2] if pages is None else pages.shape[1] * page_size
    splash = not dense and _splash_ok(q, capacity) and not is_fp8(kb)  # (an 8-bit TPU prefill: the tiled loop)
    flash = dense or _cudnn_ok(q) or jax.default_backend() != "gpu"
    if not (fast_path() or splash) or not flash:
        if dense:
            mask = full_mask(start, causal_block_mask(b, t) if block_mask is None else block_mask, capacity)
            return attention_dense(q, view(kb), view(vb), mask, scale, heads_first=True), kb, vb
        return attention_tiled(q, view(kb), view(vb), positions, scale, min(ATTENTION_TILE, capacity),
                               heads_first=True), kb, vb
    if dense and block_mask is None:  # a chain: one kernel over the prefix and the block just written
        return run_cache_attention(q, kb, vb, start.astype(jnp.int32), scale=scale, causal=True, **paged), kb, vb
    if dense:  # a tree block: the prefix by the kernel, the block under its ancestry mask, merged
        prefix = run_cache_attention(q, kb, vb, start.astype(jnp.int32), scale=scale, **paged)
        block = attention_dense(q, k, v, block_mask, scale)
        out, lse = merge_attention(prefix[0], prefix[1], block[0], block[1])
        return (out.astype(q.dtype), lse), kb, vb
    # an 8-bit chunk's own rows as stored, dequantized for the flash kernel (a chunk-sized temporary)
    own = (dequantize(k, q.dtype), dequantize(v, q.dtype)) if is_fp8(kb) else (k.astype(q.dtype), v.astype(q.dtype))
    block = flash_causal(q, *own, scale)
    if not prefix:  # a prompt's first chunk: nothing before it, nothing to merge
        return (block[0].astype(q.dtype), block[1]), kb, vb
    if is_fp8(kb):  # cuDNN and splash read full-precision operands: the prefix dequantized segment by segment
        before = flash_prefix_fp8(q, kb, vb, start, scale, **paged)
    else:
        before = flash_prefix(q, view(kb), view(vb), start, scale)
    out, lse = merge_attention(before[0], before[1], block[0], block[1])
    return (out.astype(q.dtype), lse), kb, vb
