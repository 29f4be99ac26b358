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


def _run(backend, q, k, v, kb, vb, start, block_mask=None):
    fn = jax.jit(lambda *a: cache_attention(*a, 0.25, block_mask=block_mask))  # traced per backend
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
