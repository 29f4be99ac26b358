"""The target's cache attention: the fast path (prefix kernel / flash prefill, merged with the block by
log-sum-exp) against the reference path (one dense masked attention, or the tiled loop), on fresh random inputs.

On a CPU the fast path runs the Pallas kernel interpreted and XLA in place of cuDNN (so the decomposition and
the merge are what is tested); on a GPU the same tests run the compiled kernel and cuDNN flash attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffspec_jax.models.attention import DENSE_ATTENTION_MAX_TOKENS, cache_attention
from diffspec_jax.target import bucket, default_prefill_chunk, plan_prefill
from pallas_kernels.common import use_kernels

#: bfloat16 operands on a GPU (cuDNN needs them), float32 on a CPU
DTYPE = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
TOL = dict(rtol=2e-2, atol=2e-2) if DTYPE == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True)
def full_float32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def _run(backend, q, k, v, kb, vb, start, block_mask=None, prefix=True):
    fn = jax.jit(lambda *a: cache_attention(*a, 0.25, block_mask=block_mask, prefix=prefix))  # traced per backend
    with use_kernels(backend):
        (out, lse), kb2, vb2 = fn(q, k, v, kb, vb, start)
    return np.asarray(out, np.float32), np.asarray(lse), np.asarray(kb2, np.float32)


def _inputs(rng, b, t, hq, hkv, s, d=16):
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), DTYPE)  # noqa: E731
    return f(b, t, hq, d), f(b, t, hkv, d), f(b, t, hkv, d), f(b, hkv, s, d), f(b, hkv, s, d)


@pytest.mark.parametrize("t, starts", [(5, (37, 0, 250)), (1, (1, 200, 64)), (128, (0, 0, 0)), (128, (128, 0, 3))])
def test_fast_matches_reference(t, starts):
    """Decode (T=1), verification (T=5) and prefill chunks (T=128 > the dense limit; first chunk and a chunk
    with a prefix): outputs, log-sum-exps and the written cache agree; ragged starts include an empty prefix."""
    rng = np.random.default_rng(t + sum(starts))
    q, k, v, kb, vb = _inputs(rng, 3, t, 4, 2, 512)
    start = jnp.asarray(starts, jnp.int32)
    ref = _run("reference", q, k, v, kb, vb, start)
    fast = _run("pallas", q, k, v, kb, vb, start)
    assert (t > DENSE_ATTENTION_MAX_TOKENS) == (t == 128)
    for a, r in zip(fast, ref):
        np.testing.assert_allclose(a, r, **TOL)


def test_first_chunk_without_prefix():
    """A prompt's first prefill chunk, promised to start at 0 (``prefix=False``), skips the prefix: same result."""
    rng = np.random.default_rng(11)
    q, k, v, kb, vb = _inputs(rng, 2, 128, 4, 2, 256)
    start = jnp.zeros((2,), jnp.int32)
    ref = _run("reference", q, k, v, kb, vb, start)
    with use_kernels("pallas"):
        (out, lse), kb2, _ = jax.jit(lambda *a: cache_attention(*a, 0.25, prefix=False))(q, k, v, kb, vb, start)
    for a, r in zip((out, lse, kb2), ref):
        np.testing.assert_allclose(np.asarray(a, np.float32), r, **TOL)


def test_fast_tree_block_matches_reference():
    """A tree block: each row sees the prefix and the block rows its ancestry marks."""
    rng = np.random.default_rng(5)
    q, k, v, kb, vb = _inputs(rng, 2, 6, 4, 1, 256)
    parents = [[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 2, 3, 4]]
    anc = np.zeros((2, 6, 6), bool)
    for b, par in enumerate(parents):
        for i in range(6):
            j = i
            while j >= 0:
                anc[b, i, j] = True
                j = par[j]
    start = jnp.asarray([100, 7], jnp.int32)
    ref = _run("reference", q, k, v, kb, vb, start, jnp.asarray(anc))
    fast = _run("pallas", q, k, v, kb, vb, start, jnp.asarray(anc))
    for a, r in zip(fast, ref):
        np.testing.assert_allclose(a, r, **TOL)


def test_prefill_plan():
    """Chunk widths: powers of two up to 512, then four steps per octave; the CPU default chunk is 512 and the
    fast GPU default holds up to 128K tokens per chunk."""
    assert [bucket(n, hi=1 << 20) for n in (5, 300, 513, 641, 40000, 65536, 65537)] == \
        [16, 512, 640, 768, 40960, 65536, 81920]
    assert plan_prefill([1000, 10], 512) == (512, 2)
    with use_kernels("reference"):
        assert default_prefill_chunk(1) == 512
    if jax.default_backend() == "gpu":
        with use_kernels("pallas"):
            assert default_prefill_chunk(1) == 131072 and default_prefill_chunk(8) == 16384
            assert plan_prefill([65536]) == (65536, 1)


@pytest.mark.parametrize("qk_norm, fused, backend", [(False, True, "reference"), (True, False, "pallas")])
def test_prefill_last_layer_at_the_output_row_only(qk_norm, fused, backend):
    """A prefill chunk with one output row per sequence runs its last layer at that row alone (fewer FLOPs): the
    logits, the scoring query and log-sum-exp at the row, and every layer's written K/V match the full chunk (the
    same step asked for two rows, which runs every layer at every row); ragged starts (one prompt already holds a
    prefix) and a first chunk; Llama (fused projections, reference kernels) and Qwen3 (q/k norms, separate
    projections, the fast path)."""
    from diffspec_jax.cache import KVCache
    from diffspec_jax.config import ModelConfig, RopeConfig
    from diffspec_jax.models import llama

    cfg = ModelConfig(architecture="Qwen3ForCausalLM" if qk_norm else "LlamaForCausalLM", vocab_size=97,
                      hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                      rope=RopeConfig(theta=10000.0))
    rng = np.random.default_rng(5 + qk_norm)
    params = llama.init_params(cfg, seed=int(rng.integers(1 << 30)), scale=0.2)
    if fused:
        params = llama.fuse_projections(cfg, params)
    t = DENSE_ATTENTION_MAX_TOKENS + 32
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, t)), jnp.int32)
    last = cfg.num_hidden_layers - 1

    def step(start, rows, first):
        cache = KVCache.create(cfg, 2, 256, jnp.float32)
        cache = cache.replace(k=tuple(jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in cache.k),
                              v=tuple(jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in cache.v))
        fn = jax.jit(lambda c, s, r: llama.step(cfg, params, c, tokens, s, r, score_layer=last, first_chunk=first))
        return fn(cache, jnp.asarray(start, jnp.int32), jnp.asarray(rows, jnp.int32))

    def flops(r):  # the one-row step does less work: its last layer skips the chunk's other rows
        cache = KVCache.create(cfg, 2, 256, jnp.float32)
        fn = jax.jit(lambda c, s, r: llama.step(cfg, params, c, tokens, s, r, score_layer=last))
        cost = fn.lower(cache, jnp.zeros((2,), jnp.int32), jnp.zeros((2, r), jnp.int32)).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    if backend == "reference":
        assert flops(1) < 0.9 * flops(2)
    for start, first in (((0, 40), False), ((0, 0), True)):
        seed = int(rng.integers(1 << 30))
        rows = rng.integers(0, t, (2, 1))
        with use_kernels(backend):
            rng = np.random.default_rng(seed)  # the same random cache contents for both calls
            one, c1 = step(start, rows, first)
            rng = np.random.default_rng(seed)
            two, c2 = step(start, np.concatenate([rows, rows], axis=1), first)
        np.testing.assert_allclose(one.logits[:, 0], two.logits[:, 0], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(one.score_q[:, 0], two.score_q[:, 0], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(one.score_lse[:, 0], two.score_lse[:, 0], rtol=1e-4, atol=1e-4)
        for a, b in zip(c1.k + c1.v, c2.k + c2.v):  # the last layer's K/V from its own products: rounding
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
        rng = np.random.default_rng(seed + 1)


def test_tpu_prefill_runs_on_splash_attention(monkeypatch):
    """On a TPU, prefill chunks run on JAX's splash attention whatever the kernel choice (here interpreted on the
    CPU, the TPU check patched): a first chunk (causal over itself) and a chunk after ragged prefixes (one of them
    empty) match the reference path; a chunk width off the splash block keeps the reference."""
    import diffspec_jax.models.attention as A

    rng = np.random.default_rng(23)
    q, k, v, kb, vb = _inputs(rng, 3, 128, 4, 2, 512, d=128)
    cases = [(jnp.zeros((3,), jnp.int32), False), (jnp.asarray([0, 128, 37], jnp.int32), True)]
    want = [_run("reference", q, k, v, kb, vb, s, prefix=prefix) for s, prefix in cases]
    calls = []
    real = A._splash
    monkeypatch.setattr(A, "_on_tpu", lambda: True)
    monkeypatch.setattr(A, "_splash", lambda *a, **kw: calls.append(kw.get("kv_start") is not None) or real(*a, **kw))
    for (start, prefix), ref in zip(cases, want):
        got = _run("reference", q, k, v, kb, vb, start, prefix=prefix)
        for a, r in zip(got, ref):
            np.testing.assert_allclose(a, r, **TOL)
    assert calls == [False, False, True]  # the first chunk: causal only; then causal + the prefix, merged
    calls.clear()
    _run("reference", q[:, :96], k[:, :96], v[:, :96], kb, vb, cases[1][0])
    assert calls == []
