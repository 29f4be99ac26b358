"""Paged K/V: a step over a pool of pages read through a page table equals the same step over contiguous
per-sequence buffers (outputs, log-sum-exps and the rows written), for decode, chain verification, tree blocks
and prefill chunks, on the reference path and the (interpreted) Pallas kernel; rows on unallocated pages are
never read and never written."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffspec_jax.cache import KVCache, move_rows, page_rows, page_view, pool_rows, write_paged
from diffspec_jax.models.attention import cache_attention
from pallas_kernels.common import use_kernels

P = 16          # page size
PAGES = 8       # table columns per sequence: capacity 128


def _paged_copy(rng, bufs, lengths, extra_pages=3):
    """Pools holding each ``buf [B, H, S, D]``'s first ``lengths[b]`` rows of each sequence on randomly placed
    pages (the same for every buf), the rest of each table unallocated; returns ``([pool [1, H, N * P, D]], pages
    [B, PAGES])``."""
    b, h, s, d = bufs[0].shape
    need = [-(-n // P) for n in lengths]
    n = sum(need) + extra_pages
    order = rng.permutation(n)
    pages = np.full((b, PAGES), n, np.int32)  # n = unallocated
    at = 0
    for i, k in enumerate(need):
        pages[i, :k] = order[at:at + k]
        at += k
    pos = np.stack([np.arange(s)] * b)
    pos = jnp.asarray(np.where(pos < np.asarray(lengths)[:, None], pos, -1))
    pools = [write_paged(jnp.asarray(rng.standard_normal((1, h, pool_rows(n, P), d)), buf.dtype),  # garbage elsewhere
                         jnp.swapaxes(buf, 1, 2), jnp.asarray(pages), pos, P) for buf in bufs]
    return pools, jnp.asarray(pages)


def _run(backend, q, k, v, kb, vb, start, block_mask=None, pages=None):
    fn = jax.jit(lambda *a: cache_attention(*a, 0.25, block_mask=block_mask, pages=pages,
                                            page_size=P if pages is not None else 0))
    with use_kernels(backend):
        (out, lse), kb2, vb2 = fn(q, k, v, kb, vb, start)
    return np.asarray(out, np.float32), np.asarray(lse), kb2


def _tree_mask(b, t, rng):
    anc = np.zeros((b, t, t), bool)
    for s in range(b):
        par = [-1] + [int(rng.integers(0, i)) for i in range(1, t)]
        for i in range(t):
            j = i
            while j >= 0:
                anc[s, i, j] = True
                j = par[j]
    return jnp.asarray(anc)


@pytest.mark.parametrize("backend, t, starts, tree", [
    ("pallas", 1, (1, 70, 33), False), ("pallas", 5, (37, 0, 100), False), ("pallas", 6, (17, 64, 2), True),
    ("reference", 5, (37, 0, 100), False), ("reference", 80, (0, 16, 40), False)])
def test_paged_step_equals_contiguous(backend, t, starts, tree):
    """Decode (T=1), chain verification (T=5) and a tree block on the Pallas kernel (interpreted on a CPU); chain
    verification and a prefill chunk (T=80, the tiled loop) on the references."""
    rng = np.random.default_rng(t + sum(starts) + tree)
    b, hq, hkv, d = 3, 4, 2, 16
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    q, k, v = f(b, t, hq, d), f(b, t, hkv, d), f(b, t, hkv, d)
    kb, vb = f(b, hkv, PAGES * P, d), f(b, hkv, PAGES * P, d)
    start = jnp.asarray(starts, jnp.int32)
    ends = [s + t for s in starts]  # the pages a step may write must be allocated
    (kp, vp), pages = _paged_copy(rng, [kb, vb], ends)
    mask = _tree_mask(b, t, rng) if tree else None
    with jax.default_matmul_precision("highest"):
        ref = _run(backend, q, k, v, kb, vb, start, mask)
        got = _run(backend, q, k, v, kp, vp, start, mask, pages=pages)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-5, atol=1e-5)
    view = np.asarray(page_view(got[2], pages, P))
    for i, e in enumerate(ends):  # every written row through the table, and the prefix unchanged
        np.testing.assert_array_equal(view[i, :, :e], np.asarray(ref[2])[i, :, :e])


def test_page_rows_unallocated_and_out_of_range():
    """Positions on unallocated pages (id 5, or anything past the pool), past the table or negative map into the
    scratch page (rows 5P .. 6P - 1), inside the pool."""
    pages = jnp.asarray([[2, 0, 5], [1, 9, 5]], jnp.int32)  # 5 pages: id 5 = unallocated; 9: garbage
    pos = jnp.asarray([[0, 17, 33, 48, -1], [3, 16, 40, 47, 1000]], jnp.int32)
    rows = np.asarray(page_rows(pages, pos, P, pool_rows(5, P)))
    s = 5 * P
    np.testing.assert_array_equal(rows, [[32, 1, s + 1, s, s + 15], [19, s, s + 8, s + 15, s + 1000 % P]])


def test_write_paged_lands_only_on_owned_pages_and_the_scratch_page():
    """Empty slots' rows (an all-unallocated table), rows past a table and negative positions are written inside
    the scratch page, never past the pool: every other pool row, page 0's first row in every head included (the row
    an index one past a heads-first pool's end would name), keeps its value."""
    rng = np.random.default_rng(7)
    n, h, d = 4, 3, 8
    pool = jnp.asarray(rng.standard_normal((1, h, pool_rows(n, P), d)), jnp.float32)
    pages = jnp.asarray([[1, n, n], [n, n, n], [n, n, n]], jnp.int32)  # slot 0 owns page 1; slots 1, 2 are empty
    pos = jnp.asarray([[3, 4, 20, 60, -2], [0, 1, 2, 3, 4], [40, 41, 42, 43, 44]], jnp.int32)
    rows = jnp.asarray(rng.standard_normal((3, 5, h, d)), jnp.float32)
    out = np.asarray(jax.jit(write_paged, static_argnums=4)(pool, rows, pages, pos, P))
    before = np.asarray(pool)
    np.testing.assert_array_equal(out[0, :, P + 3], np.asarray(rows)[0, 0])  # slot 0's rows on its page
    np.testing.assert_array_equal(out[0, :, P + 4], np.asarray(rows)[0, 1])
    for j in range(4):  # an empty slot's rows went to the scratch page (rows no other write names)
        np.testing.assert_array_equal(out[0, :, n * P + j], np.asarray(rows)[1, j])
    keep = np.ones(pool_rows(n, P), bool)
    keep[[P + 3, P + 4]] = False
    keep[n * P:] = False  # the scratch page may hold anything
    np.testing.assert_array_equal(out[0][:, keep], before[0][:, keep])


def test_move_rows_paged_equals_contiguous():
    """A verified tree's accepted path moved to consecutive rows, through the page table."""
    rng = np.random.default_rng(3)
    buf = jnp.asarray(rng.standard_normal((2, 2, PAGES * P, 8)), jnp.float32)
    start = jnp.asarray([20, 50], jnp.int32)
    src = jnp.asarray([[0, 2, 5], [0, 1, 4]], jnp.int32)
    dense = move_rows(KVCache(k=(buf,), v=(buf,)), start, src)
    (pool,), pages = _paged_copy(rng, [buf], [60, 60])
    paged = move_rows(KVCache(k=(pool,), v=(pool,), pages=pages, page_size=P), start, src)
    view = np.asarray(page_view(paged.k[0], pages, P))
    np.testing.assert_array_equal(view[:, :, :60], np.asarray(dense.k[0])[:, :, :60])


@pytest.mark.parametrize("chunk", [8, 32])
def test_paged_chunk_scores_in_groups_equal_the_whole_cache(monkeypatch, chunk):
    """DiffSpec's chunk scores over a paged cache, its keys gathered a few page columns at a time, equal the scores
    over the contiguous cache (chunks smaller and larger than a page)."""
    from diffspec_jax import retrieval
    from diffspec_jax.engine import retrieve

    rng = np.random.default_rng(chunk)
    buf = jnp.asarray(rng.standard_normal((3, 2, PAGES * P, 16)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((3, 4, 16)), jnp.float32)
    root = jnp.asarray([100, 37, 127], jnp.int32)
    lse = jnp.asarray(rng.standard_normal((3, 4)) + 3, jnp.float32)
    (pool,), pages = _paged_copy(rng, [buf], [128, 128, 128])
    monkeypatch.setattr(retrieve, "PAGED_SCORE_TOKENS", 3 * 2 * P)  # groups of two page columns
    got = retrieve._paged_chunk_scores(q, lse, KVCache(k=(pool,), v=(pool,), pages=pages, page_size=P), pool, root,
                                       chunk)
    want = retrieval.head_sum_scores(q, lse, buf, root, chunk)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)


def _scores_numpy(q, lse, keys, root, chunk):
    """float64 head-summed chunk scores of ``keys [B, Hkv, S, D]`` (rows past each root ignored)."""
    b, hq, d = q.shape
    hkv, s = keys.shape[1], keys.shape[2]
    logits = np.einsum("bkgd,bksd->bkgs", q.reshape(b, hkv, hq // hkv, d), keys) * d ** -0.5
    valid = np.arange(s)[None, :] <= root[:, None]
    p = np.where(valid[:, None, None], np.exp(logits - lse.reshape(b, hkv, -1)[..., None]), 0.0).sum((1, 2))
    nc = -(-s // chunk)
    sums = np.pad(p, ((0, 0), (0, nc * chunk - s))).reshape(b, nc, chunk).sum(-1)
    counts = np.pad(valid, ((0, 0), (0, nc * chunk - s))).reshape(b, nc, chunk).sum(-1)
    return np.where(counts > 0, sums / np.maximum(counts, 1), 0.0)


@pytest.mark.parametrize("chunk, kind", [(8, "float32"), (32, "bfloat16"), (8, "fp8"), (32, "fp8")])
def test_paged_chunk_scores_kernel_reads_the_pool_through_the_table(chunk, kind):
    """The (interpreted) Pallas chunk_scores kernel over a pool read through a randomly placed page table equals
    dense float64 scores of each sequence's rows up to its root, and the contiguous kernel over the gathered view;
    table entries past the root are the sentinel N or garbage (never dereferenced). Chunks smaller and larger than
    a page; float32, bf16 and 8-bit keys."""
    from diffspec_jax import retrieval
    from diffspec_jax.kv_quant import quantize
    from pallas_kernels.chunk_scores import chunk_scores

    rng = np.random.default_rng(chunk + len(kind))
    b, hq, hkv, d = 4, 8, 2, 16
    root = np.array([127, 37, 0, 70])  # 37: inside a partially filled page; 0: the first row only
    need = root // P + 1
    n = int(need.sum()) + 3  # a few pages nobody holds
    order = rng.permutation(n)
    pages = np.full((b, PAGES), n, np.int32)  # n = unallocated
    pages[1::2] = rng.integers(-10 ** 6, 10 ** 6, (b // 2, PAGES))  # garbage past the root
    at = 0
    for i, k in enumerate(need):
        pages[i, :k] = order[at:at + k]
        at += k
    q = rng.standard_normal((b, hq, d))
    lse = rng.standard_normal((b, hq)) + 3
    raw = rng.standard_normal((1, hkv, n * P, d)) * np.exp(rng.uniform(-1, 1, (1, hkv, n * P, 1)))
    if kind == "fp8":
        pool = quantize(jnp.asarray(raw, jnp.float32))
        keys, ks = pool.values, pool.scale
        dense = np.asarray(keys, np.float64) * np.asarray(ks, np.float64)
        q_seen = np.asarray(jnp.asarray(q, jnp.bfloat16), np.float64)  # 8-bit rows meet a bf16 copy of q
    else:
        pool = keys = jnp.asarray(raw, kind)
        ks = None
        dense = np.asarray(keys, np.float64)
        q_seen = q if kind == "float32" else np.asarray(jnp.asarray(q, jnp.bfloat16), np.float64)
    rows = np.clip(pages, 0, n - 1)[:, :, None] * P + np.arange(P)  # each sequence's rows, [B, PAGES, P]
    seq_keys = np.moveaxis(dense[0][:, rows.reshape(b, -1)], 0, 1)  # [B, Hkv, PAGES * P, D]
    want = _scores_numpy(q_seen, lse, seq_keys, root, chunk)
    args = (jnp.asarray(q, jnp.float32), jnp.asarray(lse, jnp.float32))
    tiling = dict(chunk=chunk, block=16, tiles=2)  # several programs per sequence, some wholly past a root
    got = np.asarray(chunk_scores(*args, keys, jnp.asarray(root), k_scale=ks, pages=jnp.asarray(pages),
                                  page_size=P, **tiling))
    assert got.shape == (b, PAGES * P // chunk)
    rtol = 1e-5 if kind == "float32" else 1e-4
    np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-7)
    assert not got[np.arange(got.shape[1])[None, :] * chunk > root[:, None]].any()  # chunks past the root: 0
    view = page_view(pool, jnp.asarray(pages), P)
    vk, vs = (view.values, view.scale) if kind == "fp8" else (view, None)
    contiguous = np.asarray(chunk_scores(*args, vk, jnp.asarray(root), k_scale=vs, **tiling))
    np.testing.assert_allclose(got, contiguous, rtol=1e-6, atol=1e-9)
    with use_kernels("reference"):  # the dispatcher's reference over a paged pool: the gathered view
        ref = retrieval.run_chunk_scores(*args, pool, jnp.asarray(root), chunk=chunk, pages=jnp.asarray(pages),
                                         page_size=P)
    np.testing.assert_allclose(np.asarray(ref), _scores_numpy(q, lse, seq_keys, root, chunk), rtol=1e-5, atol=1e-7)
