"""Building blocks shared by every model: RMSNorm, RoPE, GQA attention, SwiGLU.

Conventions: activations are ``[batch, tokens, ...]``; attention heads are an explicit axis
(``[B, T, heads, head_dim]``); weights are ``[in, out]`` (transposed from PyTorch). Normalisation statistics,
softmax and log-sum-exp are computed in float32 whatever the activation dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from diffspec_jax.kv_quant import Fp8Rows, parts, row_dtype, rowwise
from pallas_kernels.common import NEG, deterministic

#: finite "minus infinity" for masked scores: keeps exp() and max() free of NaN on fully masked tiles (the Pallas
#: kernels' too)
NEG_INF = NEG


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Llama RMSNorm: ``weight * (x * rsqrt(mean(x^2) + eps))``, statistics in float32.

    Args:
        x: ``[..., H]`` any float dtype. weight: ``[H]``.
    Returns:
        ``[..., H]`` in ``x.dtype`` (promoted with ``weight.dtype``).
    """
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * y.astype(x.dtype)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray | jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables for integer positions.

    Args:
        positions: int ``[...]`` absolute (or local) positions.
        inv_freq: float32 ``[R/2]`` from :meth:`RopeConfig.inv_freq`.
    Returns:
        ``(cos, sin)``, float32 ``[..., R/2]`` each (the half-width table; :func:`apply_rope` expands it).
    """
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(freqs), jnp.sin(freqs)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, *, interleaved: bool = False) -> jax.Array:
    """Rotate the first ``R = 2 * cos.shape[-1]`` dims of every head; the rest pass through.

    Args:
        x: ``[B, T, heads, D]``.
        cos, sin: float32 ``[B, T, R/2]`` (from :func:`rope_cos_sin`).
        interleaved: rotate pairs ``(x0, x1), (x2, x3), ...`` (GPT-J) instead of halves (Llama rotate-half).
    Returns:
        ``[B, T, heads, D]`` in ``x.dtype``; arithmetic in float32.
    """
    half = cos.shape[-1]
    rot, rest = x[..., : 2 * half].astype(jnp.float32), x[..., 2 * half:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = jnp.stack([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).reshape(rot.shape)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return jnp.concatenate([out.astype(x.dtype), rest], axis=-1) if rest.shape[-1] else out.astype(x.dtype)


def _dot_operands(*xs: jax.Array) -> tuple[jax.Array, ...]:
    """Operands of a float32-accumulating product: as they are, except on the CPU, where half-precision ones are
    widened to float32 (exactly) because XLA:CPU's library dot refuses ``bf16 x bf16 -> f32``, which it picks for
    the heads-first cache products once the cache is large enough."""
    if jax.default_backend() != "cpu":
        return xs
    return tuple(x.astype(jnp.float32) if x.dtype in (jnp.bfloat16, jnp.float16) else x for x in xs)


def _grouped(q: jax.Array, num_kv_heads: int) -> jax.Array:
    b, t, hq, d = q.shape
    return q.reshape(b, t, num_kv_heads, hq // num_kv_heads, d)


def _column_scale(scale: jax.Array | None, heads_first: bool) -> jax.Array | None:
    """An 8-bit buffer's per-row scales ``[B, Hkv, S, 1]`` (``[B, S, Hkv, 1]`` unless ``heads_first``) as
    ``[B, Hkv, 1, 1, S]``, to multiply the grouped ``[B, Hkv, G, T, S]`` scores or probabilities column-wise."""
    if scale is None:
        return None
    s = scale[..., 0] if heads_first else jnp.swapaxes(scale[..., 0], 1, 2)
    return s[:, :, None, None, :]


def _scaled_scores(qg, k, scale: float, kv: str, heads_first: bool) -> jax.Array:
    """float32 ``[B, Hkv, G, T, S]`` scaled logits of grouped queries over keys ``k`` (an array or
    :class:`~diffspec_jax.kv_quant.Fp8Rows`: ``(q . values) * s_k`` per key column, the values upcast exactly to
    the query's dtype inside the product)."""
    values, ks = parts(k)
    s = jnp.einsum(f"btkgd,{kv}->bkgts", *_dot_operands(qg, values.astype(row_dtype(k, qg.dtype))),
                   preferred_element_type=jnp.float32) * scale
    return s if ks is None else s * _column_scale(ks, heads_first)


def _weighted_values(p, v, kv: str, out: str, heads_first: bool, compute_dtype) -> jax.Array:
    """float32 ``p @ v`` of probabilities ``p [B, Hkv, G, T, S]`` over values ``v`` (an array or
    :class:`~diffspec_jax.kv_quant.Fp8Rows`: ``(p * s_v) @ values``); ``p`` enters the product in the values'
    dtype (the query's for 8-bit values); ``out`` the einsum's output subscripts."""
    values, vs = parts(v)
    dt = row_dtype(v, compute_dtype)
    if vs is not None:
        p = p * _column_scale(vs, heads_first)
    return jnp.einsum(f"bkgts,{kv}->{out}", *_dot_operands(p.astype(dt), values.astype(dt)),
                      preferred_element_type=jnp.float32)


def attention_dense(q: jax.Array, k: jax.Array | Fp8Rows, v: jax.Array | Fp8Rows, mask: jax.Array, scale: float, *,
                    heads_first: bool = False) -> tuple[jax.Array, jax.Array]:
    """Grouped-query attention over all keys with an explicit mask (the reference form).

    Args:
        q: ``[B, T, Hq, D]``; k, v: ``[B, S, Hkv, D]`` with ``Hq % Hkv == 0`` (``[B, Hkv, S, D]`` when
            ``heads_first``: the target cache's layout, whose batch and head axes lead so that the two products
            need no transposed copy of the cache), or 8-bit rows (:class:`~diffspec_jax.kv_quant.Fp8Rows` of
            those shapes), dequantized inside the products: ``(q . k8) * s_k`` and ``(p * s_v) @ v8``.
        mask: bool ``[B, T, S]``, true where query t may attend key s. Every row needs one true entry.
        scale: softmax scale (``1/sqrt(D)``).
    Returns:
        ``(out [B, T, Hq, D] in q.dtype, lse [B, T, Hq] float32)``; lse is the log-sum-exp of the scaled,
        masked logits of each query row and head.
    """
    b, t, hq, d = q.shape
    hkv = k.shape[1 if heads_first else 2]
    qg = _grouped(q, hkv)
    kv = "bksd" if heads_first else "bskd"
    s = _scaled_scores(qg, k, scale, kv, heads_first)
    s = jnp.where(mask[:, None, None, :, :], s, NEG_INF)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse[..., None])
    out = _weighted_values(p, v, kv, "btkgd", heads_first, q.dtype)
    lse = jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, t, hq)
    return out.reshape(b, t, hq, v.shape[-1]).astype(q.dtype), lse


def attention_prefix(q: jax.Array, k: jax.Array | Fp8Rows, v: jax.Array | Fp8Rows, lengths: jax.Array, scale: float, *,
                     causal: bool = False) -> tuple[jax.Array, jax.Array]:
    """GQA of new queries over the first ``lengths[b]`` rows of a heads-first cache (the reference form of
    :func:`pallas_kernels.cache_attention.cache_attention`).

    Args:
        q: ``[B, T, Hq, D]``; k, v: ``[B, Hkv, S, D]`` (or 8-bit rows); lengths: int32 ``[B]`` in ``0..S``: every
            query of sequence b sees rows ``0 .. lengths[b] - 1`` (the committed prefix).
        causal: query t also sees rows ``lengths[b] .. lengths[b] + t`` (a chain block already written there).
    Returns:
        ``(out [B, T, Hq, D] in q.dtype, lse [B, T, Hq] float32)``. A sequence that sees nothing
        (``lengths[b] == 0`` without ``causal``): ``out`` 0 and ``lse`` :data:`NEG_INF`, so a log-sum-exp merge
        gives it no weight.
    """
    b, t = q.shape[:2]
    end = lengths[:, None] + (jnp.arange(t)[None, :] + 1 if causal else 0)            # [B, T] rows seen
    visible = jnp.arange(k.shape[2])[None, None, :] < end[:, :, None]
    out, lse = attention_dense(q, k, v, visible, scale, heads_first=True)
    empty = (end[:, :1] <= 0)[:, :, None]
    return jnp.where(empty[..., None], jnp.zeros((), out.dtype), out), jnp.where(empty, NEG_INF, lse)


def merge_attention(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
                    ) -> tuple[jax.Array, jax.Array]:
    """Softmax attention over two disjoint key sets from each part's output and log-sum-exp.

    Args:
        out_a, out_b: ``[B, T, H, D]``; lse_a, lse_b: float32 ``[B, T, H]`` (:data:`NEG_INF` = an empty part).
    Returns:
        ``(e^(lse_a - lse) out_a + e^(lse_b - lse) out_b`` in out_a's dtype, ``lse = logaddexp(lse_a, lse_b))``.
    """
    lse = jnp.logaddexp(lse_a, lse_b)
    wa = jnp.exp(lse_a - lse)[..., None]
    wb = jnp.exp(lse_b - lse)[..., None]
    return (wa * out_a.astype(jnp.float32) + wb * out_b.astype(jnp.float32)).astype(out_a.dtype), lse


def causal_mask(q_pos: jax.Array, num_keys: int) -> jax.Array:
    """bool ``[B, T, S]``: key s is visible to the query at position p iff ``s <= p``."""
    return jnp.arange(num_keys)[None, None, :] <= q_pos[:, :, None]


def attention_tiled(q: jax.Array, k: jax.Array | Fp8Rows, v: jax.Array | Fp8Rows, q_pos: jax.Array, scale: float,
                    tile: int, *, heads_first: bool = False) -> tuple[jax.Array, jax.Array]:
    """Causal GQA over a position-indexed cache, key tile by key tile (online softmax).

    Never materialises more than ``[B, Hq, T, tile]`` scores, and visits only the tiles up to the largest
    query position (a data-dependent trip count). Same contract as :func:`attention_dense` with
    ``mask = causal_mask(q_pos, S)``.

    Args:
        q: ``[B, T, Hq, D]``; k, v: ``[B, S, Hkv, D]`` (``[B, Hkv, S, D]`` when ``heads_first``), or 8-bit
            rows (dequantized inside each tile's products, as :func:`attention_dense`), ``S % tile == 0``;
            q_pos: int ``[B, T]``.
    """
    b, t, hq, d = q.shape
    seq_axis = 2 if heads_first else 1
    s_len, hkv = k.shape[seq_axis], k.shape[3 - seq_axis]
    kv = "bksd" if heads_first else "bskd"
    g = hq // hkv
    if s_len % tile:
        raise ValueError(f"cache length {s_len} is not a multiple of the attention tile {tile}")
    qg = _grouped(q, hkv)
    n_tiles = jnp.minimum((jnp.max(q_pos) + tile) // tile, s_len // tile)
    qp = q_pos[:, None, None, :, None]

    def body(i, carry):
        m, l, acc = carry
        start = i * tile
        kt, vt = (rowwise(lambda x: jax.lax.dynamic_slice_in_dim(x, start, tile, axis=seq_axis), buf) for buf in (k, v))
        s = _scaled_scores(qg, kt, scale, kv, heads_first)
        visible = (start + jnp.arange(tile))[None, None, None, None, :] <= qp
        s = jnp.where(visible, s, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        l = l * corr + jnp.sum(p, axis=-1)
        acc = acc * corr[..., None] + _weighted_values(p, vt, kv, "bkgtd", heads_first, q.dtype)
        return m_new, l, acc

    init = (jnp.full((b, hkv, g, t), NEG_INF, jnp.float32), jnp.zeros((b, hkv, g, t), jnp.float32),
            jnp.zeros((b, hkv, g, t, v.shape[-1]), jnp.float32))
    # tile 0 (every row sees key 0) outside the loop: a loop carry that depends on nothing is one XLA may make for
    # every layer at a program's start (diffspec_jax.models.attention.flash_prefix_fp8 says how that was measured)
    m, l, acc = jax.lax.fori_loop(1, n_tiles, body, body(0, init))
    out = acc / l[..., None]
    lse = m + jnp.log(l)
    out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, hq, v.shape[-1])
    return out.astype(q.dtype), jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, t, hq)


def embed_lookup(embed: jax.Array, tokens: jax.Array, axis_name: str | None = None) -> jax.Array:
    """Embedding rows ``[..., H]`` of int tokens.

    With ``axis_name`` the table is the shard's vocabulary slice ``[V / tp, H]`` (shard i holds ids
    ``i * V/tp .. (i+1) * V/tp - 1``): each shard looks up the ids it owns, zeros elsewhere, and a ``psum``
    assembles the rows (exact: one shard contributes each row).
    """
    if axis_name is None:
        return embed[tokens]
    v_local = embed.shape[0]
    local = tokens - jax.lax.axis_index(axis_name) * v_local
    owned = (local >= 0) & (local < v_local)
    rows = jnp.where(owned[..., None], embed[jnp.clip(local, 0, v_local - 1)], jnp.zeros((), embed.dtype))
    return jax.lax.psum(rows, axis_name)


def gather_vocab(logits: jax.Array, vocab_size: int, axis_name: str | None = None) -> jax.Array:
    """Vocabulary-parallel logits ``[..., V / tp]`` -> the full ``[..., V]`` on every shard (all-gather, then drop
    the padding that made V divisible by tp)."""
    if axis_name is None:
        return logits
    return jax.lax.all_gather(logits, axis_name, axis=logits.ndim - 1, tiled=True)[..., :vocab_size]


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, out_dtype=None) -> jax.Array:
    """SwiGLU MLP: ``down(silu(x @ gate) * (x @ up))``. x ``[..., H]``; weights ``[H, I]``, ``[H, I]``, ``[I, H]``;
    ``out_dtype``: the down projection's result type (default the operands')."""
    return jnp.matmul(jax.nn.silu(x @ w_gate) * (x @ w_up), w_down, preferred_element_type=out_dtype)


def add_residual(x: jax.Array, y: jax.Array) -> jax.Array:
    """``x + y`` in ``x``'s dtype. A float32 ``y`` (a deterministic plan's output projection,
    :func:`residual_dtype`) is added in float32 and rounded once, the same bits whether or not XLA fuses the add
    into the product (a GEMM epilogue adds before rounding; an unfused add rounds the product first)."""
    if y.dtype == x.dtype:
        return x + y
    return (x.astype(jnp.float32) + y.astype(jnp.float32)).astype(x.dtype)


def layer_boundary(x: jax.Array) -> jax.Array:
    """The residual stream leaving a decoder layer. While a deterministic plan is traced it passes an optimization
    barrier, so XLA compiles each layer the same way whether or not the program also taps the stream for a draft
    (EAGLE-3's aux hidden states): on an H200 a tapped verify step's logits differed in up to 20% of their bits
    from the untapped step's on the same inputs, and matched to the bit with the barrier (issue 40)."""
    return jax.lax.optimization_barrier(x) if deterministic() else x


def residual_dtype():
    """The result type of the products feeding the residual stream: float32 while a deterministic plan is
    traced (:func:`pallas_kernels.common.deterministic`), else the operands' (``None``)."""
    return jnp.float32 if deterministic() else None
