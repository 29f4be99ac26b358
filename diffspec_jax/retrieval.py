"""DiffSpec retrieval: chunk scoring and selection (pure-JAX references), and the device-side retrieval state.

Scoring (``attention`` scorer, docs/method.md section 2). For one sequence with root r (last committed position),
scoring-layer query ``q_h`` (post-RoPE) and its log-sum-exp ``LSE_h`` over positions ``0..r``::

    p_h(t)     = exp(s * q_h . k_{g(h)}(t) - LSE_h)        exact attention probability the target gave to t
    score_h(c) = (1 / v_c) * sum_{t in chunk c, t <= r} p_h(t)    v_c = valid tokens of chunk c
    score(c)   = (1 / H) * sum_h score_h(c)                  mean over *all* query heads

The ``salience`` scorer instead scores each chunk by the draft root query against the chunk's mean pre-RoPE
draft key (a per-chunk summary kept up to date as entries are committed), needing no target query.

Selection (section 3.1): keep the newest chunk ``floor(r / C)``, optionally chunk 0 (sink), then the
top-scoring other chunks (ties toward the lower index) up to Nmax = Hb / C chunks. The selected chunks other
than the newest are the **anchors** (complete chunks); the newest becomes part of the rolling window.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from diffspec_jax.cache import page_view
from diffspec_jax.kv_quant import parts
from pallas_kernels import chunk_scores as chunk_scores_kernel
from pallas_kernels.common import kernel_backend

NO_SCORE = -jnp.inf


@struct.dataclass
class RetrievalState:
    """Per-sequence retrieval inputs and selection (device arrays, batch first).

    Attributes:
        anchors: int32 ``[B, A]`` anchor chunk ids sorted ascending, ``-1`` padded (A = Nmax).
        score_q: float32 ``[B, Hq, D]`` scoring-layer query of the last committed position (post-RoPE).
        score_lse: float32 ``[B, Hq]`` its log-sum-exp over positions ``0..r``.
        draft_q: float32 ``[B, Hq_d, D_d]`` the draft root query (pre-RoPE) of the last step 0 (salience).
        chunk_sum: float32 ``[B, Nc, Hkv_d, D_d]`` sums of committed pre-RoPE draft keys per chunk, or ``None``
            when neither the salience scorer nor the redundancy penalty needs chunk summaries.
    """

    anchors: jax.Array
    score_q: jax.Array
    score_lse: jax.Array
    draft_q: jax.Array
    chunk_sum: jax.Array | None = None


def num_chunks(capacity: int, chunk: int) -> int:
    return -(-capacity // chunk)


# ----------------------------------------------------------------------------------------------- scoring
def chunk_scores_reference(q: jax.Array, lse: jax.Array | None, k_cache: jax.Array, root: jax.Array, chunk: int
                           ) -> jax.Array:
    """Attention-probability chunk scores (the pure-JAX reference of the ``chunk_scores`` kernel).

    Args:
        q: float32 ``[B, Hq, D]`` post-RoPE query rows; lse: float32 ``[B, Hq]`` from the verify pass, or
            ``None`` to recompute it over positions ``0..r`` (both give the same scores).
        k_cache: ``[B, Hkv, S, D]`` post-RoPE keys of the scoring layer (the target cache's layout; or its 8-bit
            rows, :class:`~diffspec_jax.kv_quant.Fp8Rows`, scaled per key column); root: int32 ``[B]`` r.
        chunk: C (``S`` need not be a multiple; the last chunk is partial).
    Returns:
        float32 ``[B, ceil(S / C)]``: mean probability per valid token of each chunk, averaged over query heads;
        chunks with no token ``<= r`` score 0. (Under tensor parallelism each shard sums its local heads and
        the caller ``psum``s, then divides by the global head count: see :func:`head_sum_scores`.)
    """
    return head_sum_scores(q, lse, k_cache, root, chunk) / q.shape[1]


def head_sum_scores(q: jax.Array, lse: jax.Array | None, k_cache: jax.Array, root: jax.Array, chunk: int) -> jax.Array:
    """``sum_h score_h(c)`` over the heads present in ``q`` (the per-shard part of the attention score)."""
    b, hq, d = q.shape
    hkv, s_len = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    scale = d ** -0.5
    values, ks = parts(k_cache)
    logits = jnp.einsum("bkgd,bksd->bkgs", q.reshape(b, hkv, g, d).astype(jnp.float32),
                        values.astype(jnp.float32)) * scale
    if ks is not None:  # 8-bit keys: (q . k8) * s_k per key column
        logits = logits * ks[:, :, None, :, 0]
    valid = jnp.arange(s_len)[None, :] <= root[:, None]  # [B, S]
    if lse is None:
        lse = jax.nn.logsumexp(jnp.where(valid[:, None, None, :], logits, -jnp.inf), axis=-1).reshape(b, hq)
    p = jnp.where(valid[:, None, None, :], jnp.exp(logits - lse.reshape(b, hkv, g)[..., None]), 0.0)
    p = jnp.sum(p, axis=(1, 2))  # sum over heads: [B, S]
    nc = num_chunks(s_len, chunk)
    pad = nc * chunk - s_len
    per_chunk = jnp.pad(p, ((0, 0), (0, pad))).reshape(b, nc, chunk).sum(-1)
    counts = jnp.pad(valid, ((0, 0), (0, pad))).reshape(b, nc, chunk).sum(-1)
    return jnp.where(counts > 0, per_chunk / jnp.maximum(counts, 1), 0.0)


def scores_by_kernel(chunk: int, lse: jax.Array | None) -> bool:
    """Whether :func:`run_chunk_scores` takes the Pallas kernel: the Pallas backend, chunks of a power-of-two size
    and ``lse`` given."""
    return kernel_backend() == "pallas" and chunk & (chunk - 1) == 0 and lse is not None


def run_chunk_scores(q, lse, k_cache, root, *, chunk, pages=None, page_size=0):
    """:func:`head_sum_scores` by :func:`pallas_kernels.chunk_scores.chunk_scores` (when :func:`scores_by_kernel`)
    or by the reference. With ``pages`` (a paged cache: ``k_cache`` is the pool ``[1, Hkv, (N + 1) * P, D]``, or its
    8-bit rows) the kernel reads the pool through the page table; the reference scores the per-sequence view
    gathered through it (:func:`diffspec_jax.cache.page_view`, a copy of ``B x max_pages x P`` rows)."""
    if scores_by_kernel(chunk, lse):
        values, ks = parts(k_cache)
        return chunk_scores_kernel.chunk_scores(q, lse, values, root, chunk=chunk, k_scale=ks, pages=pages,
                                                page_size=page_size)
    if pages is not None:
        k_cache = page_view(k_cache, pages, page_size)
    return head_sum_scores(q, lse, k_cache, root, chunk)


def salience_scores(draft_q: jax.Array, chunk_sum: jax.Array, root: jax.Array, chunk: int) -> jax.Array:
    """Chunk scores from summaries: mean over draft query heads of ``q_h . mean_key_{g(h)}(c) / sqrt(D)``.

    Args:
        draft_q: float32 ``[B, Hq, D]`` (pre-RoPE); chunk_sum: float32 ``[B, Nc, Hkv, D]``; root: int32 ``[B]``.
    Returns:
        float32 ``[B, Nc]`` (``-inf`` for chunks with no token ``<= r``).
    """
    b, hq, d = draft_q.shape
    nc, hkv = chunk_sum.shape[1], chunk_sum.shape[2]
    counts = jnp.clip(root[:, None] + 1 - jnp.arange(nc)[None, :] * chunk, 0, chunk)
    mean_k = chunk_sum / jnp.maximum(counts, 1)[:, :, None, None]
    s = jnp.einsum("bkgd,bckd->bc", draft_q.reshape(b, hkv, hq // hkv, d), mean_k) * (d ** -0.5) / hq
    return jnp.where(counts > 0, s, NO_SCORE)


def update_chunk_sums(chunk_sum: jax.Array, k: jax.Array, positions: jax.Array, valid: jax.Array, chunk: int
                      ) -> jax.Array:
    """Add committed pre-RoPE draft keys ``k [B, T, Hkv, D]`` at ``positions [B, T]`` where ``valid [B, T]``."""
    b = k.shape[0]
    bidx = jnp.broadcast_to(jnp.arange(b)[:, None], positions.shape)
    add = jnp.where(valid[..., None, None], k.astype(jnp.float32), 0.0)
    return chunk_sum.at[bidx, positions // chunk].add(add, mode="drop")


# --------------------------------------------------------------------------------------------- selection
def select_chunks(scores: jax.Array, root: jax.Array, chunk: int, max_chunks: int, keep_sink: bool,
                  redundancy_weight: float = 0.0, summaries: jax.Array | None = None) -> jax.Array:
    """Select anchor chunks (the pure-JAX reference of selection).

    Args:
        scores: float32 ``[B, Nc]``; root: int32 ``[B]``; max_chunks: Nmax.
        keep_sink: always keep chunk 0.
        redundancy_weight: lambda >= 0; with ``summaries [B, Nc, F]`` a chunk's score is discounted by
            ``lambda * max cosine similarity`` to the chunks already selected (greedy, one chunk at a time).
    Returns:
        int32 ``[B, Nmax - 1]`` anchor chunk ids (all selected chunks except the newest), sorted ascending and
        ``-1`` padded. When all ``ceil((r + 1) / C)`` chunks fit, every complete chunk is an anchor.
    """
    b, nc = scores.shape
    newest = root // chunk
    ids = jnp.arange(nc)[None, :]
    candidate = ids < newest[:, None]  # complete chunks only; the newest is kept separately
    forced = jnp.zeros((b, nc), bool)
    if keep_sink:
        forced = (ids == 0) & candidate
    free_slots = max_chunks - 1
    score = jnp.where(candidate & ~forced, scores.astype(jnp.float32), NO_SCORE)
    n_pick = free_slots - (1 if keep_sink else 0)
    if redundancy_weight > 0 and summaries is not None:
        picked = _greedy_redundancy(score, forced, newest, summaries.reshape(b, nc, -1), n_pick,
                                    redundancy_weight)
    else:
        order = jnp.argsort(-score, axis=1, stable=True)[:, :n_pick]  # stable: ties toward the lower index
        ok = jnp.take_along_axis(score, order, axis=1) > NO_SCORE
        picked = jnp.zeros((b, nc), bool).at[jnp.arange(b)[:, None], order].set(ok)
    chosen = picked | forced
    anchors = jnp.sort(jnp.where(chosen, ids, nc), axis=1)
    if nc < free_slots:  # fewer chunks than slots (a short cache): pad
        anchors = jnp.pad(anchors, ((0, 0), (0, free_slots - nc)), constant_values=nc)
    anchors = anchors[:, :free_slots]
    return jnp.where(anchors == nc, -1, anchors).astype(jnp.int32)


def _greedy_redundancy(score, forced, newest, summaries, n_pick, weight):
    """Greedy selection with score(c) - weight * max cosine similarity to the chunks selected so far."""
    unit = summaries / jnp.maximum(jnp.linalg.norm(summaries, axis=-1, keepdims=True), 1e-12)

    def sim_to(c):
        return jnp.einsum("bcf,bf->bc", unit, jnp.take_along_axis(unit, c[:, None, None], axis=1)[:, 0])

    def body(_, carry):
        chosen, sim_max = carry
        adjusted = jnp.where(chosen, NO_SCORE, score - weight * sim_max)
        best = jnp.argmax(adjusted, axis=1)  # the first maximum: ties toward the lower index
        ok = jnp.take_along_axis(adjusted, best[:, None], axis=1)[:, 0] > NO_SCORE
        chosen = chosen | (jax.nn.one_hot(best, score.shape[1], dtype=bool) & ok[:, None])
        return chosen, jnp.where(ok[:, None], jnp.maximum(sim_max, sim_to(best)), sim_max)

    sim_max = sim_to(newest)  # the newest chunk is always selected first
    sim_max = jnp.where(jnp.any(forced, axis=1, keepdims=True), jnp.maximum(sim_max, sim_to(newest * 0)), sim_max)
    chosen, _ = jax.lax.fori_loop(0, n_pick, body, (forced, sim_max))
    return chosen & ~forced

