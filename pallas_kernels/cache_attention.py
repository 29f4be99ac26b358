"""Pallas kernel: the target's decode / verify attention over its KV cache (split-K flash decoding).

Inputs:
    q: ``[B, T, Hq, D]`` rotated queries of the new block (T >= 1: 1 for a decode step, K + 1 for a verify step,
        more for a tree verify block).
    k, v: ``[B, Hkv, S, D]`` one layer of the target cache (heads first, indexed by absolute position;
        ``Hq % Hkv == 0``, GQA with G = Hq / Hkv).
    lengths: int32 ``[B]`` in ``0..S``: every query of sequence b sees cache rows ``0 .. lengths[b] - 1`` (the
        committed prefix; the caller attends the new block itself and merges the two parts by log-sum-exp,
        :func:`diffspec_jax.models.layers.merge_attention`).
    scale: softmax scale (1 / sqrt(D)).
    causal (static, default False): the chain form, for a block already written at rows ``lengths[b] + t``:
        query t of sequence b sees rows ``0 .. lengths[b] + t`` (the prefix and the block causally), so a decode
        or chain-verify step needs no separate block attention and no merge.
Output:
    ``(out [B, T, Hq, D] in q.dtype, lse [B, T, Hq] float32)``: lse is the natural log-sum-exp of the scaled
    logits over the visible rows. A sequence with nothing visible (``lengths[b] == 0`` without ``causal``) gets
    ``out = 0`` and ``lse = NEG_INF``.
    Softmax statistics in float32, probabilities cast to ``v.dtype`` for the ``p @ v`` product (as the reference
    does).

Grid ``(B, Hkv * row_blocks, splits)``: each program takes up to ``max_rows`` of the ``T x G`` query rows of one
KV head (row ``t * G + j``, padded to a power of two >= 16 for the dot; ``row_blocks = 1`` unless T x G exceeds
``max_rows``, e.g. a large tree block) and one of ``splits`` equal contiguous ranges of whole ``block``-row tiles
that cover its row's prefix (``ceil(ceil(lengths[b] / block) / splits)`` tiles each: a short row's prefix is spread
over all its programs as a long row's is), walks the range with an online softmax (:func:`pallas_kernels.common.online_softmax_step`), so all the query rows of
a KV head share one read of each K and V tile, and writes unnormalised partial outputs with their (max, sum)
statistics. Tiles wholly at or past ``lengths[b]`` are not read (a data-dependent trip count), and a split with no
visible row writes no partial output. In the ``causal`` form the prefix tiles keep this one-dimensional mask, and
the split whose range holds row ``lengths[b]`` then attends the block in one more tile of ``T`` rows (padded to 16)
under the causal mask. A small XLA epilogue (:func:`pallas_kernels.common.merge_splits`) merges the
splits and forms lse. Bytes moved: one read of the visible K and V rows (times ``row_blocks``), plus
``B x Hkv x splits x T x G x (D + 2)`` float32 partials written and read back.

The number of splits (:func:`default_splits`) aims at a few programs per SM at any batch; ``splits``, ``block``,
``max_rows``, ``num_warps`` and ``num_stages`` are static keyword arguments, to tune on the GPU.

**Deterministic form** (``deterministic=True``, :attr:`diffspec_jax.SpecConfig.deterministic`): a query row's result
depends only on its own query and the keys it sees, not on how many rows share the call nor where their block
starts, so a decode step (T = 1), a chain verify block (T = K + 1) and a prefill tail agree to the bit on every row
they share. Tiles of :data:`DETERMINISTIC_BLOCK` rows and splits of :data:`DETERMINISTIC_SPLIT_ROWS` rows sit at
fixed absolute positions (never derived from the batch, T or the cache capacity); the causal form walks the block
rows in the same tiles as the prefix, each row masked at its own position (no separate block tile); a split or
tile a row does not reach adds exact zeros; and the epilogue adds the splits in order
(:func:`pallas_kernels.common.merge_splits_ordered`).
Reference: :func:`diffspec_jax.models.layers.attention_prefix` (same signature and contract).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import (NEG, call_options, dot_precision, merge_splits, merge_splits_ordered, next_pow2,
                                   half_rows, online_softmax_step, paged_rows, rows_to_heads)

#: streaming multiprocessors assumed where the device does not say (the H200's)
DEFAULT_SMS = 132
#: the deterministic form's key tile and split, in cache rows at fixed absolute positions: the verify tiling, and
#: splits small enough for about one wave of programs at 8K x 1 on an H200 (8 KV heads x 16 splits)
DETERMINISTIC_BLOCK, DETERMINISTIC_SPLIT_ROWS = 128, 512


def _sm_count() -> int:
    return int(getattr(jax.devices()[0], "core_count", 0) or DEFAULT_SMS)


#: the most rows :func:`default_splits` counts on to fill the device: a larger static batch (a server's slots) may
#: hold only a few live requests, each of which then still gets enough programs
SPLIT_BATCH = 8


def default_splits(batch: int, programs_per_split: int, seq_len: int, block: int, *, sms: int | None = None,
                   waves: int = 4, min_split_rows: int = 256) -> int:
    """How many ranges to split each row's prefix into: enough for about ``waves`` programs per SM over the grid
    (``batch x programs_per_split x splits`` programs; ``programs_per_split = Hkv x row_blocks``; ``batch`` counted
    up to :data:`SPLIT_BATCH`), but no range shorter than ``min_split_rows`` rows (nor than one ``block`` tile) of a
    ``seq_len``-row cache, so the partial outputs stay small next to the cache rows read. E.g. 132 SMs, 8 KV heads,
    block 64: 64K rows at batch 1 -> 66 (64 after rounding to whole tiles per split), at batch 8 (or 64) -> 9; 8K
    rows at batch 1 -> 32."""
    sms = sms or _sm_count()
    n_tiles = -(-seq_len // block)
    wanted = -(-(waves * sms) // (min(batch, SPLIT_BATCH) * programs_per_split))
    return max(1, min(wanted, seq_len // min_split_rows, n_tiles))


def split_tiles(length, block: int, splits: int):
    """Tiles per split of a row whose prefix holds ``length`` cache rows (int32, any shape): its prefix cut into
    ``splits`` equal ranges of whole ``block``-row tiles (at least one tile), used alike by the kernel's programs
    and by the epilogue that tells which splits saw rows."""
    return jnp.maximum(1, ((length + block - 1) // block + splits - 1) // splits)


def _check_pow2(name: str, n: int, lo: int = 16) -> None:
    if n < lo or n & (n - 1):
        raise ValueError(f"cache_attention: {name} must be a power of two >= {lo}, got {n}")


def default_tiling(rows: int, paged: bool = False, fp8: bool = False) -> tuple[int, int]:
    """``(block, num_stages)`` for programs of ``rows`` query rows, from the H200 sweep
    (``benchmarks/gpu_cache_sweep.sh``, Llama-3.1-8B shapes, committed under ``benchmarks/results/``): a decode step
    (16 rows: G = 4, T = 1) streams best in 64-row tiles with two pipeline stages (64K x 8: 516 us a layer, at the
    copy bandwidth); a verify step (32 rows: T = 5) needs more bytes in flight per program, 128-row tiles with
    three stages (64K x 8: 562 us against 690 us with the decode tiling). Programs of more than 64 rows (tree
    blocks) keep 64-row tiles, whose two stages fit the shared memory beside a large query tile. Over a paged
    cache (``paged``) a verify step's 128-row tiles pipeline better in two stages: each tile's rows wait on its
    page-table load (H200, random page placement, pages of 64: 32K x 8 1.12x the contiguous step against 1.16x
    with three stages, 8K x 8 0.82x against 0.97x: the sweep in docs/serving.md).

    8-bit rows (``fp8``; H100 sweeps, ``benchmarks/kv_fp8_kernel_sweep.py``, pages of 64, float16 operands):
    decode and verify steps take 128-row tiles in three stages, the same bytes per tile as bf16's 64 rows (128K x 1:
    decode 0.69x the bf16 kernel against 0.77x with the bf16 tiling; verify, T = 5, 0.94x against 1.16x)."""
    if fp8 and rows <= 64:
        return (128, 3)
    if 16 < rows <= 64:
        return (128, 2) if paged else (128, 3)
    return (64, 2)


class Plan(NamedTuple):
    rows: int             # query rows per program (a power of two >= 16)
    row_blocks: int       # programs per KV head and split covering the T x G rows
    block: int            # cache rows per tile
    tiles_per_split: int
    splits: int           # ranges of tiles per (sequence, KV head): the grid's last axis


def launch_plan(batch: int, steps: int, q_heads: int, kv_heads: int, seq_len: int, *, block: int | None = None,
                splits: int | None = None, max_rows: int = 128, paged: bool = False,
                deterministic: bool = False, fp8: bool = False) -> Plan:
    """The static launch parameters :func:`cache_attention` uses for these shapes and knobs (``block`` default:
    :func:`default_tiling`; ``splits`` is rounded to whole tiles per split: e.g. 66 wanted over 1024 tiles -> 16
    tiles per split -> 64 splits). ``deterministic``: the fixed tiles and splits of the deterministic form
    (``block`` and ``splits`` must then be left out)."""
    _check_pow2("max_rows", max_rows)
    rows = min(next_pow2(steps * (q_heads // kv_heads), 16), max_rows)
    row_blocks = -(-(steps * (q_heads // kv_heads)) // rows)
    if deterministic:
        if block is not None or splits is not None:
            raise ValueError("cache_attention: the deterministic form fixes block and splits")
        tiles_per_split = DETERMINISTIC_SPLIT_ROWS // DETERMINISTIC_BLOCK
        n_tiles = -(-seq_len // DETERMINISTIC_BLOCK)
        return Plan(rows, row_blocks, DETERMINISTIC_BLOCK, tiles_per_split, -(-n_tiles // tiles_per_split))
    block = default_tiling(rows, paged, fp8)[0] if block is None else block
    _check_pow2("block", block)
    block = min(block, next_pow2(seq_len, 16))
    n_tiles = -(-seq_len // block)
    if splits is None:
        splits = default_splits(batch, kv_heads * row_blocks, seq_len, block)
    tiles_per_split = -(-n_tiles // max(1, min(splits, n_tiles)))
    return Plan(rows, row_blocks, block, tiles_per_split, -(-n_tiles // tiles_per_split))


def _kernel(q_ref, k_ref, v_ref, len_ref, *refs, rows, row_blocks, group, steps, block, tiles_per_split, splits,
            seq_len, head_dim, cols, scale, precision, causal, page_size, deterministic, fp8, upcast):
    from jax.experimental.pallas import triton as plgpu

    refs = list(refs)
    pt_ref = refs.pop(0) if page_size else None
    ks_ref, vs_ref = (refs.pop(0), refs.pop(0)) if fp8 else (None, None)
    o_ref, m_ref, l_ref = refs

    b, gr, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    g, rb = gr // row_blocks, gr % row_blocks
    r = rb * rows + jnp.arange(rows)                      # this program's packed query rows
    real = r < steps * group
    t_of = jnp.where(real, r // group, 0)
    head = g * group + r % group
    d = jnp.arange(cols)[None, :]                         # head_dim padded to a power of two

    def cols_in(mask):                                    # and the padded columns masked off (if any: static)
        return mask if cols == head_dim else mask & (d < head_dim)

    q = plgpu.load(q_ref.at[b, t_of[:, None], head[:, None], d], mask=cols_in(real[:, None]),
                   other=jnp.zeros((), q_ref.dtype))
    q_pow2 = None
    if fp8 and upcast == jnp.float16:  # row-normalised float16 operands (common.half_rows), the e4m3 rows exactly
        q, q_pow2 = half_rows(q.astype(jnp.float32))
    elif fp8:  # the query's dtype: e4m3 rows are exact in bfloat16
        q = q.astype(upcast)
    prefix = plgpu.load(len_ref.at[b])
    inline = causal and deterministic                     # the block rows walked in the prefix's tiles
    length = jnp.clip(prefix + steps if inline else prefix, 0, seq_len)
    if deterministic:  # fixed ranges of absolute positions
        per_split = tiles_per_split
    else:  # the row's own prefix cut into `splits` equal ranges of whole tiles: a short row (a static batch's slot
        # holding a short request) keeps all its programs busy instead of leaving them to the empty end of the cache
        per_split = split_tiles(length, block, splits)
    first = s * per_split * block
    n_tiles = jnp.clip((length - first + block - 1) // block, 0, per_split)

    def tile(carry, pos, visible, seen):
        mask = cols_in(visible[:, None])                  # rows not visible are never read
        sb, row = paged_rows(pt_ref, b, pos, visible, page_size)
        k = plgpu.load(k_ref.at[sb, g, row[:, None], d], mask=mask, other=jnp.zeros((), k_ref.dtype))
        v = plgpu.load(v_ref.at[sb, g, row[:, None], d], mask=mask, other=jnp.zeros((), v_ref.dtype))
        ks = vs = None
        if fp8:                                           # 8-bit rows: one float32 scale per row, 0 if not visible
            ks = plgpu.load(ks_ref.at[sb, g, row, 0], mask=visible, other=0.0)
            vs = plgpu.load(vs_ref.at[sb, g, row, 0], mask=visible, other=0.0)
        return online_softmax_step(carry, q, k, v, seen, scale=scale, precision=precision, k_scale=ks, v_scale=vs,
                                   q_pow2=q_pow2)

    def body(i, carry):                                   # the committed prefix: rows < length
        pos = first + i * block + jnp.arange(block)
        visible = pos < length
        if inline:                                        # and the block, each row up to its own position
            return tile(carry, pos, visible, visible[None, :] & (pos[None, :] <= (prefix + t_of)[:, None]))
        return tile(carry, pos, visible, visible[None, :])

    init = (jnp.zeros((rows, cols), jnp.float32), jnp.full((rows,), NEG, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, n_tiles, body, init)
    saw = n_tiles > 0
    if causal and not inline:  # the block rows prefix .. prefix + steps - 1, once, by the split whose range
        # holds row `prefix`
        owns = s == jnp.minimum(length // (per_split * block), splits - 1)
        width = next_pow2(steps, 16)

        def block_tile(_, carry):
            pos = prefix + jnp.arange(width)
            visible = (pos < prefix + steps) & (pos < seq_len)
            return tile(carry, pos, visible, visible[None, :] & (pos[None, :] <= (prefix + t_of)[:, None]))

        acc, m, l = jax.lax.fori_loop(0, owns.astype(jnp.int32), block_tile, (acc, m, l))
        saw = saw | owns
    plgpu.store(o_ref.at[b, g, s, r[:, None], d], acc, mask=cols_in((real & saw)[:, None]))
    plgpu.store(m_ref.at[b, g, s, r], m, mask=real)
    plgpu.store(l_ref.at[b, g, s, r], l, mask=real)


@functools.partial(jax.jit, static_argnames=("scale", "causal", "block", "splits", "max_rows", "num_warps",
                                             "num_stages", "page_size", "deterministic", "fp8_upcast"))
def cache_attention(q, k, v, lengths, *, scale, causal=False, block=None, splits=None, max_rows=128,
                    num_warps=None, num_stages=None, pages=None, page_size=0, deterministic=False, k_scale=None,
                    v_scale=None, fp8_upcast=None):
    """Attention of new queries over the committed prefix of a heads-first KV cache (see the module docstring
    for shapes, dtypes and semantics).

    8-bit caches: ``k``, ``v`` in ``float8_e4m3fn`` with ``k_scale``, ``v_scale`` float32 ``[B, Hkv, S, 1]`` (or
    ``[1, Hkv, (N + 1) * P, 1]`` pools), one scale per row (:mod:`diffspec_jax.kv_quant`). The kernel loads the 8-bit
    rows and their scales, upcasts the rows in registers (exact) and applies the scales to the logits' and the
    probabilities' columns: ``(q . k8) * s_k``, ``(p * s_v) @ v8``. Nothing is dequantized in device memory.
    ``fp8_upcast`` (static) is the dtype of those products' operands: by default float16 for bf16 / f16 queries
    (the GPU converts e4m3 to float16 in one instruction; the operands are normalised per row by powers of two,
    :func:`pallas_kernels.common.half_rows`, so none overflows float16 or loses bits that bfloat16 would keep;
    H100: 0.71x against 0.79x the bf16 kernel's time with bfloat16 operands at 128K x 1), the query's dtype
    otherwise (a float32 query keeps float32 products). (Products on the e4m3 rows as stored, the other operand
    split into two e4m3 parts, measured slower on an H100 and were removed: both products so, 0.73x the bf16 kernel
    at 128K x 1 decode and 1.43x in verification against float16's 0.685x and 0.94x; the keys' product alone,
    0.757x and 1.14x against 0.707x and 0.97x; ``benchmarks/results/kv_fp8_h100/kernel_sweep_3.json``, ``_4``.)

    Paged caches: ``k``, ``v`` are pools ``[1, Hkv, (N + 1) * P, D]`` and ``pages`` int32 ``[B, max_pages]`` maps
    sequence b's position p to pool row ``pages[b, p // P] * P + p % P`` (``page_size`` = P, static); the kernel
    loads each tile's rows through the table (one more small vector load per tile), so paging costs no copy.

    Tuning knobs (static; ``block`` and ``num_stages`` default to :func:`default_tiling`): ``block`` cache rows
    per tile (a power of two >= 16; capped at the cache length rounded up to a power of two), ``splits`` ranges per (sequence, KV head) (default :func:`default_splits`; capped at
    the number of tiles), ``max_rows`` query rows per program (a power of two >= 16; more rows take
    several row blocks, each reading the KV once), ``num_warps`` (default 4 up to 64 rows per program, else 8)
    and ``num_stages`` (Triton software pipelining of the tile loop). ``deterministic``: the module docstring's
    deterministic form (``block`` and ``splits`` fixed).
    """
    b, t, hq, d = q.shape
    hkv, s_len = k.shape[1], k.shape[2]
    if pages is not None:
        if not page_size or pages.shape[0] != b or k.shape[0] != 1:
            raise ValueError(f"cache_attention: pages {pages.shape} (page size {page_size}) do not fit q {q.shape} "
                             f"and a pool {k.shape}")
        s_len = pages.shape[1] * page_size
    elif page_size:
        raise ValueError("cache_attention: page_size without pages")
    if hq % hkv or k.shape != v.shape or k.shape[0] != (1 if pages is not None else b) or k.shape[3] != d:
        raise ValueError(f"cache_attention: q {q.shape} does not fit k {k.shape} / v {v.shape}")
    fp8 = k_scale is not None
    if fp8 and (v_scale is None or k_scale.shape != k.shape[:3] + (1,) or v_scale.shape != k_scale.shape):
        got = tuple(None if x is None else x.shape for x in (k_scale, v_scale))
        raise ValueError(f"cache_attention: 8-bit k {k.shape} needs k_scale and v_scale of shape {k.shape[:3] + (1,)}, "
                         f"got {got}")
    half = jnp.dtype(q.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    upcast = jnp.dtype(fp8_upcast or (jnp.float16 if half else q.dtype))
    if fp8 and upcast not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(q.dtype)):
        raise ValueError(f"cache_attention: fp8_upcast {fp8_upcast!r}: use 'float16', 'bfloat16' or the query's dtype")
    group = hq // hkv
    lengths = lengths.astype(jnp.int32)
    if causal and t == 1 and not deterministic:  # a decode step: its one query sees rows < length + 1, the plain
        lengths, causal = lengths + 1, False     # form (no block tile)
    rows, row_blocks, block, tiles_per_split, splits = launch_plan(b, t, hq, hkv, s_len, block=block, splits=splits,
                                                                   max_rows=max_rows, paged=pages is not None,
                                                                   deterministic=deterministic, fp8=fp8)
    stages = default_tiling(32 if deterministic else rows, pages is not None, fp8)[1]  # deterministic: verify's
    kernel = functools.partial(_kernel, rows=rows, row_blocks=row_blocks, group=group, steps=t, block=block,
                               tiles_per_split=tiles_per_split, splits=splits, seq_len=s_len, head_dim=d,
                               cols=next_pow2(d, 16), scale=scale, precision=dot_precision(upcast if fp8 else k.dtype),
                               causal=causal, page_size=page_size if pages is not None else 0,
                               deterministic=deterministic, fp8=fp8, upcast=upcast)
    extra = (() if pages is None else (pages.astype(jnp.int32),)) + (
        (k_scale.astype(jnp.float32), v_scale.astype(jnp.float32)) if fp8 else ())
    o, m, l = pl.pallas_call(
        kernel,
        grid=(b, hkv * row_blocks, splits),
        out_shape=(jax.ShapeDtypeStruct((b, hkv, splits, t * group, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, splits, t * group), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, splits, t * group), jnp.float32)),
        name="cache_attention",
        **call_options(num_warps=num_warps or (4 if rows <= 64 else 8),
                       num_stages=num_stages or stages),
    )(q, k, v, lengths, *extra)
    # split j saw rows iff it starts before the length (the kernel's n_tiles > 0); the others wrote no output
    if deterministic:  # the block rows were walked in the prefix's tiles (fixed ranges of absolute positions)
        starts = (jnp.arange(splits) * (tiles_per_split * block))[None, :]
        live = starts < jnp.clip(lengths + (t if causal else 0), 0, s_len)[:, None]
        out, lse = merge_splits_ordered(o, m, l, live)     # [B, Hkv, T * G, D], [B, Hkv, T * G]
    else:  # each row's prefix in `splits` equal ranges of whole tiles (the kernel's per_split)
        prefix = jnp.clip(lengths, 0, s_len)[:, None]
        per = split_tiles(prefix, block, splits) * block
        live = jnp.arange(splits)[None, :] * per < prefix
        if causal:  # and the split that attended the block
            live = live | (jnp.arange(splits)[None, :] == jnp.minimum(prefix // per, splits - 1))
        out, lse = merge_splits(o, m, l, live)             # [B, Hkv, T * G, D], [B, Hkv, T * G]
    empty = (jnp.clip(lengths + (t if causal else 0), 0, s_len) <= 0)[:, None, None]
    out = jnp.where(empty[..., None], 0.0, rows_to_heads(out, t, group))
    lse = jnp.where(empty, NEG, rows_to_heads(lse, t, group))
    return out.astype(q.dtype), lse
