"""The 8-bit (fp8) target K/V cache (issue 41): quantization, the attention kernels and their references against
dense NumPy attention over the dequantized rows, a transformers-built checkpoint's logits on an fp8 cache against
the float32 cache, losslessness of speculation relative to the fp8-cache target, and the setting's validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import hf_logits, layer_temp_growth, random_prompts, rel_err
from diffspec_jax.errors import ConfigError
from diffspec_jax.kv_quant import FP8_MAX, Fp8Rows, dequantize, quantize
from diffspec_jax.models import attention as target_attention
from diffspec_jax.models.layers import attention_prefix
from diffspec_jax.retrieval import head_sum_scores
from pallas_kernels.cache_attention import cache_attention
from pallas_kernels.chunk_scores import chunk_scores
from pallas_kernels.common import use_kernels


def _dense_numpy(q, k, v, lengths, scale, causal):
    """float64 GQA over the first ``lengths[b]`` rows (and, ``causal``, the block's rows up to each query's own) of
    dequantized heads-first ``k``, ``v`` ``[B, Hkv, S, D]``."""
    b, t, hq, d = q.shape
    g = hq // k.shape[1]
    out = np.zeros((b, t, hq, d))
    lse = np.zeros((b, t, hq))
    for bi in range(b):
        for ti in range(t):
            n = lengths[bi] + (ti + 1 if causal else 0)
            for h in range(hq):
                s = k[bi, h // g, :n] @ q[bi, ti, h] * scale
                lse[bi, ti, h] = np.log(np.sum(np.exp(s - s.max()))) + s.max()
                out[bi, ti, h] = np.exp(s - lse[bi, ti, h]) @ v[bi, h // g, :n]
    return out, lse


def test_fp8_rows_kernels_and_references_match_dense_numpy():
    """Round trip within e4m3's rounding; the cache_attention kernel (interpreted; plain, causal, paged and its
    deterministic form) and the reference equal dense float64 attention over the dequantized rows; chunk_scores
    too. Fresh random rows with an outlier token, an all-zero row, ragged lengths."""
    rng = np.random.default_rng(41)
    b, t, hkv, g, s, d, page = 2, 3, 2, 4, 96, 32, 16
    hq = hkv * g
    x = rng.standard_normal((2, b, hkv, s, d)) * np.exp(rng.uniform(-3, 3, (2, b, hkv, s, 1)))
    x[0, 0, 1, 7] *= 300.0   # an outlier token: only its own row's scale grows
    x[1, 1, 0, 11] = 0.0     # an all-zero row: scale 1, values 0
    k32, v32 = (jnp.asarray(a, jnp.float32) for a in x)
    kq, vq = quantize(k32), quantize(v32)
    assert kq.values.dtype == jnp.float8_e4m3fn and kq.scale.shape == (b, hkv, s, 1) and kq.scale.dtype == jnp.float32
    kd, vd = (np.asarray(dequantize(r), np.float64) for r in (kq, vq))
    # round trip: e4m3 keeps 3 mantissa bits (relative error <= 2^-4), subnormals (below 2^-6 x scale) an absolute
    # 2^-10 x scale; every row's largest element maps to 448 exactly
    amax = np.abs(x[0]).max(-1, keepdims=True)
    bound = np.maximum(np.abs(x[0]) * 2.0 ** -4, amax / FP8_MAX * 2.0 ** -10) * (1 + 1e-6)
    assert (np.abs(kd - x[0]) <= bound).all()
    assert np.asarray(jnp.max(jnp.abs(kq.values.astype(jnp.float32)), -1)).min() == FP8_MAX
    assert (np.asarray(vq.scale)[1, 0, 11] == 1.0) and not np.asarray(vq.values[1, 0, 11], np.float32).any()
    assert np.abs(kd[0, 1, 6]).max() < 1e-2 * np.abs(kd[0, 1, 7]).max()  # the outlier's neighbours keep their own scale

    q = jnp.asarray(rng.standard_normal((b, t, hq, d)), jnp.float32)
    lengths = np.array([37, 80])
    scale = d ** -0.5
    pages = rng.permutation(b * s // page).reshape(b, s // page).astype(np.int32)  # a random page table

    def pool(rows: Fp8Rows) -> Fp8Rows:  # the same rows laid out in a shuffled pool [1, Hkv, N * P, D]
        def one(a):
            out = np.zeros((1, hkv, b * s, a.shape[-1]), np.asarray(a).dtype)
            for bi in range(b):
                for j, p in enumerate(pages[bi]):
                    out[0, :, p * page:(p + 1) * page] = np.asarray(a)[bi, :, j * page:(j + 1) * page]
            return jnp.asarray(out)
        return Fp8Rows(values=one(rows.values), scale=one(rows.scale))

    kp, vp = pool(kq), pool(vq)
    for causal in (False, True):
        want_out, want_lse = _dense_numpy(np.asarray(q, np.float64), kd, vd, lengths, scale, causal)
        ref = attention_prefix(q, kq, vq, jnp.asarray(lengths), scale, causal=causal)
        runs = {"reference": ref,
                "kernel": cache_attention(q, kq.values, vq.values, jnp.asarray(lengths), scale=scale, causal=causal,
                                          k_scale=kq.scale, v_scale=vq.scale),
                "paged kernel": cache_attention(q, kp.values, vp.values, jnp.asarray(lengths), scale=scale,
                                                causal=causal, pages=jnp.asarray(pages), page_size=page,
                                                k_scale=kp.scale, v_scale=vp.scale)}
        if causal:
            runs["deterministic kernel"] = cache_attention(q, kq.values, vq.values, jnp.asarray(lengths), scale=scale,
                                                           causal=True, deterministic=True, k_scale=kq.scale,
                                                           v_scale=vq.scale)
        for name, (out, lse) in runs.items():
            np.testing.assert_allclose(np.asarray(out), want_out, rtol=2e-5, atol=2e-5, err_msg=name)
            np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=2e-5, atol=2e-5, err_msg=name)
    # chunk scores of the last committed row: the reference against NumPy over the dequantized keys, and the kernel
    # (8-bit keys upcast to bf16 in registers, so it takes a bf16 copy of q, as over a bf16 cache) against NumPy with
    # that copy of q
    root = jnp.asarray(lengths - 1)
    qs, chunk = q[:, 0], 16
    valid = np.arange(s)[None, :] <= np.asarray(root)[:, None]
    counts = valid.reshape(b, -1, chunk).sum(-1)

    def scores_numpy(qrows):
        logits = np.einsum("bkgd,bksd->bkgs", np.asarray(qrows, np.float64).reshape(b, hkv, g, d), kd) * scale
        m = np.where(valid[:, None, None], logits, -np.inf)
        lse = np.log(np.exp(m - m.max(-1, keepdims=True)).sum(-1)) + m.max(-1)
        p = np.where(valid[:, None, None], np.exp(logits - lse[..., None]), 0.0).sum((1, 2))
        return np.where(counts > 0, p.reshape(b, -1, chunk).sum(-1) / np.maximum(counts, 1), 0.0), lse

    want, lse = scores_numpy(qs)
    lse_j = jnp.asarray(lse.reshape(b, hq), jnp.float32)
    np.testing.assert_allclose(np.asarray(head_sum_scores(qs, lse_j, kq, root, chunk)), want, rtol=1e-5, atol=1e-6)
    want_bf16 = scores_numpy(qs.astype(jnp.bfloat16).astype(jnp.float32))[0]
    np.testing.assert_allclose(np.asarray(chunk_scores(qs, jnp.asarray(scores_numpy(qs.astype(jnp.bfloat16).astype(
        jnp.float32))[1].reshape(b, hq), jnp.float32), kq.values, root, chunk=chunk, k_scale=kq.scale)),
        want_bf16, rtol=1e-4, atol=1e-6)


def test_fp8_kernel_float16_operands_keep_extreme_rows():
    """The kernel's float16 path (bf16 queries: e4m3 rows upcast to float16, row-normalised operands) against dense
    float64 attention, where plain float16 operands would fail: queries of 1e5 (past float16's 65504) and of 1e-6
    (its subnormals), and a diffuse row whose answer comes from hundreds of keys of weight ~1e-5 with small values
    (weights x value scales of ~1e-10 sink below float16's smallest subnormal unless normalised). It must be as
    close as the bfloat16 path, to the output's bf16 rounding."""
    rng = np.random.default_rng(43)
    b, hkv, g, s, d = 3, 2, 4, 1024, 32
    k = rng.standard_normal((b, hkv, s, d))
    v = rng.standard_normal((b, hkv, s, d)) * 1e-4
    q = rng.standard_normal((b, 2, hkv * g, d))
    q[0] *= 1e5 / np.abs(q[0]).max()
    q[1] *= 1e-6
    k[2, :, 100] = 0.0                                        # sequence 2: every query aligned with key 100 ...
    q[2] = 0.0
    q[2, ..., 0] = 40.0
    k[2, :, 100, 0] = 1.0
    v[2, :, 100] = 0.0                                        # ... whose value is 0: the rest (weights ~e^-7) decide
    kq, vq = quantize(jnp.asarray(k, jnp.float32)), quantize(jnp.asarray(v, jnp.float32))
    kd, vd = (np.asarray(dequantize(r), np.float64) for r in (kq, vq))
    qb = jnp.asarray(q, jnp.bfloat16)
    lengths = np.array([1000, 777, 900])
    want, want_lse = _dense_numpy(np.asarray(qb, np.float64), kd, vd, lengths, d ** -0.5, True)
    errs = {}
    for upcast in ("bfloat16", "float16"):
        out, lse = cache_attention(qb, kq.values, vq.values, jnp.asarray(lengths), scale=d ** -0.5, causal=True,
                                   k_scale=kq.scale, v_scale=vq.scale, fp8_upcast=upcast)
        top = np.abs(want).max(-1, keepdims=True)
        errs[upcast] = float((np.abs(np.asarray(out, np.float64) - want) / top).max())
        np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-3, atol=1e-3, err_msg=upcast)
    assert errs["float16"] <= 2.0 ** -8, errs                  # the output's own bf16 rounding: 2^-9 of an element
    assert errs["float16"] <= 1.5 * errs["bfloat16"], errs


def test_fp8_prefill_chunk_reads_its_prefix_in_dequantized_segments(monkeypatch):
    """A prefill chunk over an 8-bit prefix on the fast path (cuDNN on a GPU, XLA here) dequantizes the prefix one
    segment at a time (``flash_prefix_fp8``: segments of 80 rows here, skipped past every prefix) and merges the
    parts: output, log-sum-exp and the written rows equal the reference's tiled loop over the same 8-bit rows,
    contiguous and through a shuffled page table, with ragged prefixes (one empty, one spanning 6 segments)."""
    monkeypatch.setattr(target_attention, "FP8_PREFIX_SEGMENT", 32)
    rng = np.random.default_rng(45)
    b, t, hq, hkv, s, d, page = 3, 80, 4, 2, 512, 16, 16
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    q, k, v = f(b, t, hq, d), f(b, t, hkv, d), f(b, t, hkv, d)
    kb, vb = quantize(f(b, hkv, s, d)), quantize(f(b, hkv, s, d))
    start = jnp.asarray([0, 200, 431], jnp.int32)
    pages = rng.permutation(b * s // page).reshape(b, s // page).astype(np.int32)

    def pool(rows):  # the same rows in a shuffled pool [1, Hkv, (N + 1) * P, D] (the last page: scratch)
        def one(a):
            a = np.asarray(a)
            out = np.zeros((1, hkv, (b * s // page + 1) * page, a.shape[-1]), a.dtype)
            for bi in range(b):
                for j, pg in enumerate(pages[bi]):
                    out[0, :, pg * page:(pg + 1) * page] = a[bi, :, j * page:(j + 1) * page]
            return jnp.asarray(out)
        return Fp8Rows(values=one(rows.values), scale=one(rows.scale))

    def run(backend, kb, vb, pages=None):
        fn = jax.jit(lambda *a: target_attention.cache_attention(*a, 0.25, pages=pages, page_size=page if
                                                                 pages is not None else 0))
        with use_kernels(backend), jax.default_matmul_precision("highest"):
            (out, lse), kb2, _ = fn(q, k, v, kb, vb, start)
        rows = kb2 if pages is None else target_attention.page_view(kb2, pages, page)
        return np.asarray(out), np.asarray(lse), np.asarray(dequantize(rows))

    want = run("reference", kb, vb)
    for got in (run("pallas", kb, vb), run("pallas", pool(kb), pool(vb), jnp.asarray(pages))):
        for a, w in zip(got, want):
            np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-5)


def test_fp8_prefix_segments_keep_no_buffer_per_layer(monkeypatch):
    """A program of many layers, each attending an 8-bit prefix segment by segment (``flash_prefix_fp8``), must not
    keep a buffer per layer alive: its temporaries (compiled on this CPU) stay flat from 4 to 16 layers. A loop
    started from zeros (which depend on nothing) grew by about 13 running outputs here, and on an H100 held 29 of
    512 MB at once; a segment dequantized outside the loop grew by one segment a layer."""
    monkeypatch.setattr(target_attention, "FP8_PREFIX_SEGMENT", 512)
    rng = np.random.default_rng(46)
    b, t, hq, hkv, s, d = 1, 512, 8, 2, 4096, 64
    q = jnp.asarray(rng.standard_normal((b, t, hq, d)), jnp.bfloat16)
    bufs = [quantize(jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.float32)) for _ in range(32)]
    start = jnp.asarray([3000], jnp.int32)
    growth, carry = layer_temp_growth(
        lambda q, k, v: target_attention.flash_prefix_fp8(q, k, v, start, 0.125)[0], q, bufs)
    assert growth < carry, (growth, carry)


def test_fp8_cache_logits_against_the_float32_cache(targets, hf_models):
    """A transformers-built tiny Llama: prefill (chunks of 64, over a prefix) and cached decode steps of 1 and 5
    tokens on an fp8 cache against the float32 cache (which matches transformers to 1e-5) and transformers itself:
    the error is quantization's (neither zero nor large), on the reference and the fast (interpreted Pallas) paths,
    which agree with each other."""
    from diffspec_jax import target as tgt
    from pallas_kernels.common import use_kernels

    model = targets["llama"]
    rng = np.random.default_rng(8)
    seqs = rng.integers(0, model.config.vocab_size, (2, 112))
    lengths = [70, 100]
    ref = hf_logits(hf_models["llama"], seqs)
    got = {}
    for kernels, kind in (("reference", "auto"), ("reference", "fp8"), ("pallas", "fp8")):
        with use_kernels(kernels):
            cache = tgt.create_cache(model, 2, 128, kv_cache_dtype=kind)
            last, cache = tgt.prefill(model, cache, [list(s[:n]) for s, n in zip(seqs, lengths)], chunk=64)
            rows = [np.asarray(last)[:, None]]
            start = np.array(lengths)
            for n in (1, 5):
                lg, cache = tgt.decode(model, cache, np.stack([seqs[i, start[i]:start[i] + n] for i in range(2)]),
                                       start)
                rows.append(np.asarray(lg).reshape(2, n, -1))
                start = start + n
        got[kernels, kind] = np.concatenate(rows, axis=1)  # [B, 7, V]
    want = np.stack([ref[i, lengths[i] - 1:lengths[i] + 6] for i in range(2)])
    err = {key: (float(np.abs(v - want).max()), rel_err(v, want)) for key, v in got.items()}
    print("max abs / norm-relative logit error against transformers:", err)
    assert err["reference", "auto"][1] < 1e-5
    assert 1e-4 < err["reference", "fp8"][1] < 0.1  # e4m3 rows: about 2^-4 relative per element
    assert rel_err(got["pallas", "fp8"], got["reference", "fp8"]) < 1e-4  # both paths read the same 8-bit rows


def test_fp8_speculation_equals_target_only_on_the_fp8_cache(targets, drafts):
    """Greedy speculation on the fp8 cache returns exactly target-only greedy decoding on the fp8 cache: an EAGLE-3
    chain with DiffSpec retrieval (paged, every kernel in Pallas, interpreted: the chunk scores read the 8-bit keys),
    a tree block (its own rows attended quantized, as the later steps read them), and the self-draft (its working
    set holds dequantized rows; verification reads the 8-bit cache)."""
    from diffspec_jax import SpecConfig, generate

    model, draft = targets["llama"], drafts["llama"]
    prompts = random_prompts(3, (90, 41))
    kw = dict(max_new_tokens=14, stop_token_ids=(), kv_cache_dtype="fp8")
    alone = generate(model, None, prompts, **kw)
    diffspec = SpecConfig.from_flat(dict(draft_context_policy="diffspec", diffspec_chunk_size=8,
                                         diffspec_token_budget=40, num_speculative_tokens=3,
                                         diffspec_retrieval_interval=2))
    tree = SpecConfig.from_flat(dict(num_speculative_tokens=3, diffspec_verification_mode="tree",
                                     diffspec_max_tree_nodes=6, diffspec_tree_topk=2))
    recent = SpecConfig.from_flat(dict(draft_context_policy="recent", diffspec_chunk_size=8, diffspec_token_budget=40,
                                       num_speculative_tokens=3))
    runs = {"chain, paged, pallas": generate(model, draft, prompts, spec=diffspec.replace(kernels="pallas"),
                                             page_size=16, **kw),
            "tree, paged": generate(model, draft, prompts, spec=tree, page_size=16, **kw),
            "self": generate(model, "self", prompts, spec=recent, **kw)}
    for name, res in runs.items():
        assert res.tokens == alone.tokens, name
    assert runs["chain, paged, pallas"].stats.retrieval["aggregate"]["retrievals"] > 0


def test_kv_cache_dtype_setting_and_page_bytes(targets, capsys):
    """A bad value is a ConfigError naming the choices (generate(), EngineConfig, target.create_cache) and a usage
    error on the command line (exit 2, one line); an fp8 page of Llama-3.1-8B shapes takes 132 of a bf16 page's
    256 bytes per (token, KV head, layer): the server's pool holds 1.94x the tokens."""
    from benchmarks.long_context import shapes
    from diffspec_jax import SamplingConfig, SpecConfig, generate
    from diffspec_jax import target as tgt
    from diffspec_jax.engine.memory import page_bytes, prefill_token_bytes
    from diffspec_jax.engine.state import Plan
    from diffspec_jax.generate import main
    from diffspec_jax.serving.scheduler import EngineConfig

    for bad in ("int8", "fp16", None):
        with pytest.raises(ConfigError, match=r"kv_cache_dtype must be one of \('auto', 'fp8'\)"):
            generate(targets["llama"], None, [[1, 2, 3]], max_new_tokens=2, kv_cache_dtype=bad)
        with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
            EngineConfig(kv_cache_dtype=bad)
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        tgt.create_cache(targets["llama"], 1, 16, kv_cache_dtype="e5m2")
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit) as exc:
        main(["--kv-cache-dtype", "int8", "--prompt-ids", "1,2"])
    assert exc.value.code == 2
    assert "--kv-cache-dtype: invalid choice: 'int8' (choose from auto, fp8)" in capsys.readouterr().err.replace(
        "'auto', 'fp8'", "auto, fp8")
    tc, _ = shapes(quick=False)
    plan = Plan(target=tc, draft=None, spec=SpecConfig(), sampling=SamplingConfig(), aux_layers=(), capacity=1024,
                paging=(16, 64))
    bf16, fp8 = (page_bytes(p, jnp.bfloat16, jnp.bfloat16) for p in (plan, Plan(**{**plan.__dict__,
                                                                                   "kv_cache_dtype": "fp8"})))
    per_row = tc.num_hidden_layers * 2 * tc.num_key_value_heads * 64
    assert (bf16, fp8) == (per_row * 256, per_row * 132)
    assert bf16 / fp8 > 1.9
    assert prefill_token_bytes(tc, fp8=True) > prefill_token_bytes(tc)  # the fp8 prefix segments count


def test_server_engine_on_a_mesh_with_an_fp8_pool(targets, drafts):
    """The slot engine with kv_cache_dtype="fp8" at tp 2 with a replicated draft: its pool's pages are counted at
    their 8-bit size (the start-up line says so), the pool is sharded by KV heads (values and scales alike), and
    concurrent greedy requests, two of them reusing a document's pages from the prefix cache, return exactly what
    generate() returns for each alone on the fp8 cache."""
    import queue

    import diffspec_jax as dj
    from diffspec_jax.serving.scheduler import EngineConfig, Request, SamplingParams, SlotEngine

    model, draft = targets["llama"], drafts["llama"]
    spec = dj.SpecConfig.from_flat(dict(num_speculative_tokens=3, draft_context_policy="diffspec", diffspec_chunk_size=8,
                                        diffspec_token_budget=40, draft_tensor_parallel_size=1))
    doc = random_prompts(51, (40,))[0]
    asks = [(doc, 6), (doc + [5, 6, 7], 9), (doc + [9], 7), (random_prompts(52, (23,))[0], 11)]
    alone = [dj.generate(model, draft, [p], max_new_tokens=n, spec=spec, stop_token_ids=(), max_cache_len=128,
                         kv_cache_dtype="fp8").tokens[0] for p, n in asks]
    config = dict(max_num_seqs=4, max_model_len=96, block_size=16, prefill_chunk=32, tensor_parallel_size=2)
    engine = SlotEngine(model, draft, spec, EngineConfig(kv_cache_dtype="fp8", **config), eos_token_ids=())
    tc = model.config
    local_heads = tc.num_key_value_heads // 2
    # a page: 16 tokens of 8-bit K and V rows and their float32 scales in every layer (this device's KV heads), and
    # the replicated draft's store rows in float32
    assert engine.page_bytes == 16 * (tc.num_hidden_layers * 2 * local_heads * (tc.head_dim + 4)
                                      + 2 * 4 * draft.config.num_key_value_heads * draft.config.head_dim)
    assert "K/V pool (fp8" in engine.pool_summary()
    engine.start()
    try:
        pool = engine._state.target_cache.k[0]
        assert pool.values.dtype == jnp.float8_e4m3fn and len(pool.values.addressable_shards) == 2
        assert pool.scale.addressable_shards[0].data.shape[1] == local_heads
        finished = queue.Queue()

        def run(batch):
            reqs = [Request(p, SamplingParams(max_tokens=n, ignore_eos=True),
                            lambda e: finished.put(e.kind) if e.kind in ("finish", "error") else None) for p, n in batch]
            for r in reqs:
                engine.submit(r)
            assert [finished.get(timeout=120) for _ in reqs] == ["finish"] * len(reqs)
            return reqs

        first = run(asks[:1])
        rest = run(asks[1:])
        assert [r.tokens for r in first + rest] == alone
        assert [r.cached_tokens for r in rest[:2]] == [32, 32]
    finally:
        engine.stop()
