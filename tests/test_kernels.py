"""Pallas kernels (interpreted on the CPU, compiled on a GPU) against their pure-JAX references on fresh random
inputs, with poisoned outputs, ragged batches and padding; and the engine running on them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_prompts
from diffspec_jax.kv_quant import quantize
from diffspec_jax.models.layers import NEG_INF, attention_prefix, rope_cos_sin
from diffspec_jax.retrieval import head_sum_scores
from diffspec_jax.working_cache import draft_attention_reference, gather_rope_write_reference
from pallas_kernels import dispatch
from pallas_kernels.cache_attention import cache_attention, default_splits, default_tiling, launch_plan
from pallas_kernels.chunk_scores import chunk_scores
from pallas_kernels.draft_attention import draft_attention
from pallas_kernels.gather_rope_write import gather_rope_write

@pytest.fixture(autouse=True)
def full_float32_matmuls():
    """References in true float32 (XLA on GPUs defaults to TF32 for float32 products)."""
    with jax.default_matmul_precision("highest"):
        yield


TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=1e-2, atol=1e-2)}
DTYPES = [jnp.float32, jnp.bfloat16]


def close(a, b, dtype):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved, rot_frac", [(False, 1.0), (True, 1.0), (False, 0.5), (True, 0.25)])
def test_gather_rope_write(dtype, interleaved, rot_frac):
    rng = np.random.default_rng(hash((str(dtype), interleaved, rot_frac)) % 2**32)
    b, s, hkv, d, w, n = 3, 200, 2, 32, 48, 40
    sk = jnp.asarray(rng.standard_normal((b, s, hkv, d)), dtype)
    sv = jnp.asarray(rng.standard_normal((b, s, hkv, d)), dtype)
    poison = jnp.full((b, w, hkv, d), jnp.nan, dtype)
    idx = np.full((b, n), -1, np.int32)  # ragged: 40, 17 and 0 real rows
    idx[0] = np.sort(rng.choice(s, n, replace=False))
    idx[1, :17] = np.sort(rng.choice(s, 17, replace=False))
    rot = int(d * rot_frac)
    inv = (1.0 / 10000.0 ** (np.arange(0, rot, 2) / rot)).astype(np.float32)
    cos, sin = rope_cos_sin(jnp.arange(n), inv)
    k, v = gather_rope_write(sk, sv, poison, poison, jnp.asarray(idx), cos, sin, interleaved=interleaved)
    rk, rv = gather_rope_write_reference(sk, sv, poison, poison, jnp.asarray(idx), cos, sin, interleaved=interleaved)
    for out, ref in ((k, rk), (v, rv)):
        assert out.dtype == dtype
        assert np.isfinite(np.asarray(out[:, :n], np.float32)).all()  # every history row written
        assert np.isnan(np.asarray(out[:, n:], np.float32)).all()  # slots past the history untouched
        close(out[:, :n], ref[:, :n], dtype)
    assert not np.asarray(k[2, :n], np.float32).any()  # padding rows are zeros


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [16, 64])
def test_chunk_scores(dtype, chunk):
    rng = np.random.default_rng(chunk)
    b, hq, hkv, d, s = 4, 8, 2, 32, 300  # GQA 4:1; 300 is not a multiple of the 256 tile nor of the chunk
    q = jnp.asarray(rng.standard_normal((b, hq, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, hkv, s, d)), dtype)  # the target cache's layout
    root = jnp.asarray([299, 150, 0, 70])
    lse = jax.nn.logsumexp(jnp.where(jnp.arange(s)[None, None, :] <= root[:, None, None],
                                     jnp.einsum("bkgd,bksd->bkgs", q.reshape(b, hkv, 4, d),
                                                k.astype(jnp.float32)).reshape(b, hq, s) * d ** -0.5, -jnp.inf),
                           axis=-1)
    ours = chunk_scores(q, lse, k, root, chunk=chunk)
    ref = head_sum_scores(q, lse, k, root, chunk)
    assert ours.shape == ref.shape == (b, -(-s // chunk))
    close(ours, ref, jnp.float32 if dtype == jnp.float32 else jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(ours)[2, 1:], 0)  # root 0: only chunk 0 scores
    assert np.asarray(ours).sum(1).min() > 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t, w", [(1, 40), (4, 40), (4, 300)])
def test_draft_attention(dtype, t, w):
    rng = np.random.default_rng(t * 1000 + w)
    b, hq, hkv, d = 3, 8, 2, 32
    q = jnp.asarray(rng.standard_normal((b, t, hq, d)), dtype)
    k = jnp.asarray(rng.standard_normal((b, w, hkv, d)), dtype)
    v = jnp.asarray(rng.standard_normal((b, w, hkv, d)), dtype)
    base = np.array([w - t, 3, w // 2])  # ragged valid lengths, one very short
    q_local = jnp.asarray(base[:, None] + np.arange(t)[None, :])
    ours = draft_attention(q, k, v, q_local, scale=d ** -0.5)
    ref = draft_attention_reference(q, k, v, q_local, scale=d ** -0.5)
    assert ours.dtype == dtype and ours.shape == ref.shape
    close(ours, ref, dtype)


def _cache_inputs(rng, b, t, hq, hkv, s, d, dtype):
    """Queries, a heads-first cache (clean, and poisoned with NaN at and past each length) and ragged lengths:
    0 (sees nothing), S (the whole cache), one across a tile edge, one inside the first tile."""
    q = jnp.asarray(rng.standard_normal((b, t, hq, d)), dtype)
    k = jnp.asarray(rng.standard_normal((b, hkv, s, d)), dtype)
    v = jnp.asarray(rng.standard_normal((b, hkv, s, d)), dtype)
    lengths = jnp.asarray([0, s, s // 2 + 3, 5], jnp.int32)[:b]
    beyond = (jnp.arange(s)[None, None, :, None] >= lengths[:, None, None, None])
    return q, k, v, jnp.where(beyond, jnp.nan, k), jnp.where(beyond, jnp.nan, v), lengths


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t, group, s, d, opts", [
    (1, 4, 100, 32, {}),                                          # one split (the default plan at this size)
    (5, 4, 300, 32, {}),                                          # verify rows: the default 128-row tiles
    (5, 1, 300, 32, dict(block=32, splits=4)),                    # 4 splits of 3 tiles, S not a multiple of 32
    (13, 4, 77, 24, dict(block=16, splits=3, max_rows=16)),       # 4 row blocks of 16 rows, head_dim 24 (padded)
])
def test_cache_attention(dtype, t, group, s, d, opts):
    rng = np.random.default_rng(hash((str(dtype), t, group, s)) % 2**32)
    b, hkv = 4, 2
    q, k, v, k_poison, v_poison, lengths = _cache_inputs(rng, b, t, hkv * group, hkv, s, d, dtype)
    plan = launch_plan(b, t, hkv * group, hkv, s, **opts)
    assert plan.splits == opts.get("splits", 1) and plan.block * plan.tiles_per_split * plan.splits >= s
    out, lse = cache_attention(q, k_poison, v_poison, lengths, scale=d ** -0.5, **opts)
    ref_out, ref_lse = attention_prefix(q, k, v, lengths, d ** -0.5)  # the reference on the clean cache
    assert out.dtype == dtype and out.shape == q.shape and lse.dtype == jnp.float32 and lse.shape == (b, t, hkv * group)
    assert np.isfinite(np.asarray(out, np.float32)).all()  # no poisoned row leaked
    assert not np.asarray(out[0], np.float32).any() and (np.asarray(lse[0]) == NEG_INF).all()  # length 0
    close(out, ref_out, dtype)
    close(lse, ref_lse, dtype)


@pytest.mark.parametrize("t, opts", [(1, {}), (5, dict(block=16, splits=3)), (13, dict(block=16, max_rows=16))])
def test_cache_attention_causal(t, opts):
    """The chain form: query t sees the prefix and block rows 0..t written after it (ragged prefixes, one of them
    empty, one whose block runs into the end of the cache, one starting a split's range); rows past each query's
    end are poisoned with NaN."""
    rng = np.random.default_rng(31 + t)
    b, hkv, group, s, d = 5, 2, 4, 90, 32
    q = jnp.asarray(rng.standard_normal((b, t, hkv * group, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.float32)
    lengths = jnp.asarray([0, s - t, 37, 3, 64], jnp.int32)  # 64: the block starts a split of 2 x 16 rows
    beyond = jnp.arange(s)[None, None, :, None] >= (lengths + t)[:, None, None, None]
    out, lse = cache_attention(q, jnp.where(beyond, jnp.nan, k), jnp.where(beyond, jnp.nan, v), lengths,
                               scale=d ** -0.5, causal=True, **opts)
    end = np.asarray(lengths)[:, None] + np.arange(t)[None, :] + 1          # [B, T]: rows each query sees
    logits = np.einsum("btkgd,bksd->btkgs", np.asarray(q).reshape(b, t, hkv, group, d), np.asarray(k)) * d ** -0.5
    logits = np.where(np.arange(s)[None, None, None, None, :] < end[:, :, None, None, None], logits, -np.inf)
    ref_lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    p = np.exp(logits - ref_lse[..., None])
    ref_out = np.einsum("btkgs,bksd->btkgd", p, np.asarray(v)).reshape(b, t, hkv * group, d)
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), ref_lse.reshape(b, t, hkv * group), rtol=2e-5, atol=2e-5)
    ours = attention_prefix(q, k, v, lengths, d ** -0.5, causal=True)          # the reference form agrees too
    np.testing.assert_allclose(np.asarray(ours[0]), ref_out, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("t, page, block", [(1, 32, 16), (5, 16, 16), (5, 16, 32)])
def test_cache_attention_paged_tiles(t, page, block):
    """Through a shuffled page table, with tiles inside one page (pages of 32 and tiles of 16; 16 and 16) and tiles
    spanning two pages (16 and 32): the same bits as the contiguous cache. Rows past each sequence's block are NaN
    in both, so a row read from the wrong page shows. (One table entry per tile instead of one per row was measured
    1-2% slower on the H200: ``benchmarks/results/paged_h200/kernel_sweep/``; the kernel loads one per row.)"""
    rng = np.random.default_rng(7 * t + page + block)
    b, hkv, group, s, d = 3, 2, 4, 128, 32
    q = jnp.asarray(rng.standard_normal((b, t, hkv * group, d)), jnp.float32)
    lengths = jnp.asarray([0, s - t, 45], jnp.int32)
    beyond = jnp.arange(s)[None, None, :, None] >= (lengths + t)[:, None, None, None]
    k, v = (jnp.where(beyond, jnp.nan, jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.float32))
            for _ in range(2))
    n = s // page
    perm = rng.permutation(b * n).reshape(b, n).astype(np.int32)
    pool = lambda x: jnp.zeros((1, hkv, b * n * page, d), x.dtype).at[  # noqa: E731
        0, :, (perm[:, :, None] * page + np.arange(page)).reshape(b, -1)].set(jnp.swapaxes(x, 1, 2))
    attend = lambda k, v, **kw: cache_attention(q, k, v, lengths, scale=d ** -0.5, causal=True, block=block,  # noqa
                                                splits=2, **kw)
    want = attend(k, v)
    got = attend(pool(k), pool(v), pages=jnp.asarray(perm), page_size=page)
    for a, w in zip(got, want):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_array_equal(np.asarray(a), np.asarray(w))


@pytest.mark.parametrize("paged, fp8", [(False, False), (True, False), (False, True)])
def test_cache_attention_deterministic_rows(monkeypatch, paged, fp8):
    """The deterministic form: a query row's output and lse are the same bits whether it runs alone (T = 1) or as
    any row j of a chain block of K + 1 = 5 that starts j rows earlier, over a cache read directly or through a
    shuffled page table, or over 8-bit rows (float16 operands, normalised per row and tile); and they match the
    reference. Tiles of 16 and splits of 32 rows (patched down from the GPU sizes), so rows cross tile and split
    edges at fresh random positions; bfloat16, as served."""
    import pallas_kernels.cache_attention as ca

    monkeypatch.setattr(ca, "DETERMINISTIC_BLOCK", 16)
    monkeypatch.setattr(ca, "DETERMINISTIC_SPLIT_ROWS", 32)
    rng = np.random.default_rng(101 + paged)
    b, hkv, group, s, d, k1, page = 2, 2, 4, 144, 32, 5, 16
    q_all = jnp.asarray(rng.standard_normal((b, s, hkv * group, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.bfloat16)
    extra = {}
    if paged:  # the same cache as a pool of shuffled pages
        n = s // page
        perm = rng.permutation(b * n).reshape(b, n).astype(np.int32)
        pool = lambda x: jnp.zeros((1, hkv, b * n * page, d), x.dtype).at[  # noqa: E731
            0, :, (perm[:, :, None] * page + np.arange(page)).reshape(b, -1)].set(jnp.swapaxes(x, 1, 2))
        k, v, extra = pool(k), pool(v), dict(pages=jnp.asarray(perm), page_size=page)
    rows = (k, v)
    if fp8:  # 8-bit rows with a scale each, as an fp8 cache stores them
        kq, vq = quantize(k), quantize(v)
        k, v, rows, extra = kq.values, vq.values, (kq, vq), dict(k_scale=kq.scale, v_scale=vq.scale)
    attend = lambda q, start: cache_attention(q, k, v, start, scale=d ** -0.5, causal=True,  # noqa: E731
                                              deterministic=True, **extra)
    for p in rng.choice(np.arange(k1, s - k1), 6, replace=False):
        alone = attend(q_all[:, p:p + 1], jnp.full((b,), p, jnp.int32))
        for j in range(k1):
            block = attend(q_all[:, p - j:p - j + k1], jnp.full((b,), p - j, jnp.int32))
            assert np.array_equal(np.asarray(block[0][:, j]), np.asarray(alone[0][:, 0])), (p, j)
            assert np.array_equal(np.asarray(block[1][:, j]), np.asarray(alone[1][:, 0])), (p, j)
    starts = jnp.asarray([s - k1, 37], jnp.int32)
    out, lse = attend(q_all[:, 40:40 + k1], starts)
    kv = rows if not paged else tuple(jnp.swapaxes(x[0, :, (perm[:, :, None] * page + np.arange(page))
                                                        .reshape(b, -1)], 1, 2) for x in (k, v))
    ref = attention_prefix(q_all[:, 40:40 + k1], *kv, starts, d ** -0.5, causal=True)
    close(out, ref[0], jnp.bfloat16)
    close(lse, ref[1], jnp.bfloat16)


def test_cache_attention_split_plan():
    """The default split counts: a few programs per SM (132) at batch 1 and 8 (8 KV heads, block 64)."""
    assert default_splits(1, 8, 65536, 64, sms=132) == 66 and default_splits(8, 8, 65536, 64, sms=132) == 9
    assert default_splits(1, 8, 8192, 64, sms=132) == 32  # ranges of at least 256 rows
    assert default_splits(1, 8, 100, 64, sms=132) == 1
    p = launch_plan(1, 5, 32, 8, 65536, block=64)
    assert (p.rows, p.row_blocks, p.block) == (32, 1, 64) and p.tiles_per_split * p.splits >= 1024
    p = launch_plan(2, 51, 32, 8, 4096, splits=1000)  # tree block: 204 rows in 2 blocks; splits capped at tiles
    assert (p.rows, p.row_blocks, p.tiles_per_split, p.splits) == (128, 2, 1, 64)
    with pytest.raises(ValueError, match="power of two"):
        launch_plan(1, 1, 8, 2, 100, block=48)
    # default tiling by query rows per program: decode (16) 64-row tiles, verify (32) 128-row tiles, trees 64
    assert [default_tiling(r) for r in (16, 32, 64, 128)] == [(64, 2), (128, 3), (128, 3), (64, 2)]
    assert [default_tiling(r, paged=True) for r in (16, 32, 64, 128)] == [(64, 2), (128, 2), (128, 2), (64, 2)]
    assert launch_plan(8, 1, 32, 8, 65536).block == 64 and launch_plan(8, 5, 32, 8, 65536).block == 128
    assert [default_tiling(r, paged=True, fp8=True) for r in (16, 32, 128)] == [(128, 3), (128, 3), (64, 2)]


def test_dispatch_cache_attention(monkeypatch):
    rng = np.random.default_rng(7)
    q, k, v, _, _, lengths = _cache_inputs(rng, 3, 2, 4, 2, 40, 16, jnp.float32)
    with dispatch.use_kernels("reference"):
        ref = dispatch.cache_attention(q, k, v, lengths, scale=0.25)
    for a, b in zip(ref, attention_prefix(q, k, v, lengths, 0.25)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with dispatch.use_kernels("pallas"):
        ours = dispatch.cache_attention(q, k, v, lengths, scale=0.25)
    for a, b in zip(ours, ref):
        close(a, b, jnp.float32)


def test_dispatch_choice_and_override(monkeypatch):
    """The choice is SpecConfig.kernels ($DIFFSPEC_KERNELS only its default, read when the config is built); the
    selectors follow the innermost use_kernels, else the device default, and never read the environment."""
    from diffspec_jax import SpecConfig
    from diffspec_jax.errors import ConfigError

    device = "pallas" if jax.default_backend() == "gpu" else "reference"
    monkeypatch.delenv("DIFFSPEC_KERNELS", raising=False)
    assert dispatch.kernel_backend() == device and SpecConfig().kernels == "auto"
    monkeypatch.setenv("DIFFSPEC_KERNELS", "pallas")
    assert dispatch.kernel_backend() == device  # not read at trace time
    spec = SpecConfig()
    assert spec.kernels == "pallas" and SpecConfig.from_flat({"kernels": "reference"}).kernels == "reference"
    with dispatch.use_kernels(spec.kernels) as chosen:
        assert chosen == "pallas" and dispatch.kernel_backend() == "pallas"
        with dispatch.use_kernels("reference"):
            assert dispatch.kernel_backend() == "reference"
        assert dispatch.kernel_backend() == "pallas"
    assert dispatch.kernel_backend() == device
    monkeypatch.setenv("DIFFSPEC_KERNELS", "triton")
    with pytest.raises(ConfigError, match="DIFFSPEC_KERNELS must be one of"):
        SpecConfig()
    with pytest.raises(ConfigError, match="kernels must be one of"):
        SpecConfig(kernels="triton")


@pytest.mark.parametrize("tp", [1, 2])
def test_engine_on_pallas_kernels_matches_reference(tp, targets, drafts):
    """DiffSpec decoding with every kernel in Pallas (interpreted on CPUs), also inside shard_map at TP2."""
    from diffspec_jax import SpecConfig, generate, make_mesh

    if jax.device_count() < tp:  # the CPU suite always has 4 virtual devices; a one-GPU run has 1
        pytest.skip(f"needs {tp} devices, {jax.device_count()} visible")

    prompts = random_prompts(12, (90, 41))
    spec = SpecConfig.from_flat(dict(draft_context_policy="diffspec", diffspec_chunk_size=8, diffspec_token_budget=40,
                                     num_speculative_tokens=3, diffspec_retrieval_interval=2))
    ref = generate(targets["llama"], drafts["llama"], prompts, max_new_tokens=12, spec=spec.replace(kernels="reference"),
                   stop_token_ids=())
    ours = generate(targets["llama"], drafts["llama"], prompts, max_new_tokens=12, spec=spec.replace(kernels="pallas"),
                    stop_token_ids=(),
                    mesh=make_mesh(tp) if tp > 1 else None)
    assert ours.tokens == ref.tokens
    assert [s["anchor_chunks"] for s in ours.stats.retrieval["per_sequence"]] == \
        [s["anchor_chunks"] for s in ref.stats.retrieval["per_sequence"]]


def test_deterministic_speculation_equals_target_only(targets, drafts):
    """SpecConfig(deterministic=True) through the public generate() with every kernel in Pallas (interpreted): the
    speculative greedy tokens equal target-only decoding's under the same setting (whose steps run as K + 1-row
    blocks), which equal plain target-only decoding's; over a paged cache; a tree is refused by name."""
    from diffspec_jax import SpecConfig, Tree, generate
    from diffspec_jax.errors import ConfigError

    prompts = random_prompts(14, (70, 33))
    spec = SpecConfig.from_flat(dict(draft_context_policy="diffspec", diffspec_chunk_size=8, diffspec_token_budget=40,
                                     num_speculative_tokens=3, diffspec_retrieval_interval=2, kernels="pallas",
                                     deterministic=True))
    kw = dict(max_new_tokens=10, stop_token_ids=())
    plain = generate(targets["llama"], None, prompts, spec=spec.replace(deterministic=False), **kw).tokens
    alone = generate(targets["llama"], None, prompts, spec=spec, **kw).tokens
    assert alone == plain
    assert generate(targets["llama"], drafts["llama"], prompts, spec=spec, page_size=16, **kw).tokens == alone
    with pytest.raises(ConfigError, match="chains at a fixed depth"):
        spec.replace(verification=Tree())
