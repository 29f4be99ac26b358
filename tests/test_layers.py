"""Attention and RoPE building blocks against dense NumPy references on random inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import layer_temp_growth
from diffspec_jax.models.layers import (
    apply_rope, attention_dense, attention_tiled, causal_mask, rms_norm, rope_cos_sin,
)


def np_attention(q, k, v, q_pos):
    """Dense causal GQA in float64: returns (out [B,T,Hq,D], lse [B,T,Hq])."""
    b, t, hq, d = q.shape
    g = hq // k.shape[2]
    out = np.zeros((b, t, hq, v.shape[-1]))
    lse = np.zeros((b, t, hq))
    for bi in range(b):
        for ti in range(t):
            for h in range(hq):
                s = k[bi, :, h // g] @ q[bi, ti, h] / np.sqrt(d)
                s = np.where(np.arange(k.shape[1]) <= q_pos[bi, ti], s, -np.inf)
                m = s.max()
                lse[bi, ti, h] = m + np.log(np.exp(s - m).sum())
                out[bi, ti, h] = np.exp(s - lse[bi, ti, h]) @ v[bi, :, h // g]
    return out, lse


@pytest.mark.parametrize("tile", [16, 64])
def test_tiled_and_dense_attention_match_numpy(tile):
    rng = np.random.default_rng(0)
    b, t, hq, hkv, d, s = 2, 5, 6, 2, 8, 64
    q, k, v = (rng.standard_normal(x) for x in [(b, t, hq, d), (b, s, hkv, d), (b, s, hkv, d)])
    q_pos = np.array([[3, 10, 20, 40, 63], [0, 1, 2, 17, 30]])
    ref_out, ref_lse = np_attention(q, k, v, q_pos)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    out, lse = attention_dense(f32(q), f32(k), f32(v), causal_mask(jnp.asarray(q_pos), s), d ** -0.5)
    np.testing.assert_allclose(out, ref_out, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-5)
    out_t, lse_t = attention_tiled(f32(q), f32(k), f32(v), jnp.asarray(q_pos), d ** -0.5, tile)
    np.testing.assert_allclose(out_t, ref_out, atol=2e-5)
    np.testing.assert_allclose(lse_t, ref_lse, atol=2e-5)
    kh, vh = f32(k.swapaxes(1, 2)), f32(v.swapaxes(1, 2))  # the target cache's heads-first layout
    out_h, lse_h = attention_dense(f32(q), kh, vh, causal_mask(jnp.asarray(q_pos), s), d ** -0.5, heads_first=True)
    out_ht, lse_ht = attention_tiled(f32(q), kh, vh, jnp.asarray(q_pos), d ** -0.5, tile, heads_first=True)
    for o, lse_ in ((out_h, lse_h), (out_ht, lse_ht)):
        np.testing.assert_allclose(o, ref_out, atol=2e-5)
        np.testing.assert_allclose(lse_, ref_lse, atol=2e-5)


def test_tiled_attention_never_reads_past_the_last_query():
    """Keys beyond max(q_pos) are NaN: the tiled path must not visit their tiles at all."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((1, 2, 2, 4)), jnp.float32)
    k = np.asarray(rng.standard_normal((1, 64, 1, 4)), np.float32)
    v = k.copy()
    k[:, 32:] = np.nan
    v[:, 32:] = np.nan
    out, lse = attention_tiled(q, jnp.asarray(k), jnp.asarray(v), jnp.asarray([[5, 31]]), 0.5, 16)
    assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(lse)).all()


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rope_matches_rotation_matrices(interleaved, partial):
    rng = np.random.default_rng(2)
    d = 16
    rot = int(d * partial)
    inv = 1.0 / (10000 ** (np.arange(0, rot, 2) / rot))
    x = rng.standard_normal((1, 3, 2, d))
    pos = np.array([[0, 7, 1000]])
    cos, sin = rope_cos_sin(jnp.asarray(pos), inv.astype(np.float32))
    ours = np.asarray(apply_rope(jnp.asarray(x, jnp.float32), cos, sin, interleaved=interleaved))
    ref = x.copy()
    for t in range(3):
        for j in range(rot // 2):
            a = pos[0, t] * inv[j]
            i1, i2 = (2 * j, 2 * j + 1) if interleaved else (j, j + rot // 2)
            x1, x2 = x[0, t, :, i1], x[0, t, :, i2]
            ref[0, t, :, i1] = x1 * np.cos(a) - x2 * np.sin(a)
            ref[0, t, :, i2] = x2 * np.cos(a) + x1 * np.sin(a)
    np.testing.assert_allclose(ours, ref, atol=2e-4)  # float32 angles at position 1000


def test_rms_norm_statistics_in_float32():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 8)) * 300
    w = rng.standard_normal(8)
    ref = w * x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(rms_norm(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), 1e-5), ref,
                               rtol=1e-5)
    bf = rms_norm(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), 1e-5)
    assert bf.dtype == jnp.bfloat16 and np.isfinite(np.asarray(bf, np.float32)).all()


@pytest.mark.parametrize("heads_first", [True, False])
def test_write_rows_matches_numpy(heads_first):
    """Cache writes land at each sequence's positions (ragged, one block running past the end: those rows are
    dropped), in both cache layouts, against a NumPy loop."""
    from diffspec_jax.cache import write_rows

    rng = np.random.default_rng(3)
    b, t, h, s, d = 3, 5, 2, 20, 4
    buf = rng.standard_normal((b, h, s, d) if heads_first else (b, s, h, d)).astype(np.float32)
    rows = rng.standard_normal((b, t, h, d)).astype(np.float32)
    pos = np.array([[0, 1, 2, 3, 4], [17, 18, 19, 20, 21], [5, 7, 9, 11, 13]], np.int32)
    out = np.asarray(jax.jit(lambda *a: write_rows(*a, heads_first=heads_first))(buf, rows, pos))
    ref = buf.copy()
    for i in range(b):
        for j in range(t):
            if pos[i, j] < s:
                if heads_first:
                    ref[i, :, pos[i, j]] = rows[i, j]
                else:
                    ref[i, pos[i, j]] = rows[i, j]
    np.testing.assert_array_equal(out, ref)


def test_tiled_attention_keeps_no_carry_per_layer():
    """The tiled reference loop (float32 prefill on a GPU) in a program of many layers: its temporaries grow by
    less than half a float32 running output per layer from 4 to 16 layers (tile 0 runs outside the loop, so the
    carry depends on the queries; a zero-filled one grew by one running output per layer here)."""
    rng = np.random.default_rng(47)
    b, t, hq, hkv, s, d = 1, 512, 8, 2, 4096, 64
    q = jnp.asarray(rng.standard_normal((b, t, hq, d)), jnp.float32)
    bufs = [jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.float32) for _ in range(32)]
    pos = jnp.arange(3000, 3000 + t, dtype=jnp.int32)[None]
    growth, carry = layer_temp_growth(
        lambda q, k, v: attention_tiled(q, k, v, pos, 0.125, 256, heads_first=True)[0], q, bufs)
    assert growth < 12 * carry / 2, (growth, carry)
