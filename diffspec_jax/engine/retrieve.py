"""DiffSpec retrieval: score the context's chunks (the target's attention at the scoring layer, or the draft's
salience against chunk key summaries) and select the anchor chunks of the draft's working cache.

Over a paged target cache the Pallas ``chunk_scores`` kernel reads the scoring layer's pool through the page table
(only the rows up to each sequence's root, no copy); the reference path gathers the per-sequence view a few page
columns at a time (:func:`_paged_chunk_scores`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from diffspec_jax import retrieval
from diffspec_jax.cache import page_view
from diffspec_jax.engine.state import DecodeState, Plan
from pallas_kernels import dispatch


def _select_anchors(plan: Plan, tparams, dparams, state: DecodeState) -> jax.Array:
    """Score the chunks of every sequence's context and select its anchors, int32 ``[B, A]`` (``A = Nmax - 1``)."""
    spec, ret = plan.spec, state.retrieval
    c = spec.context.chunk_size
    root = state.length - 1
    if spec.context.scorer == "attention":  # each shard sums its query heads; one psum gives identical scores
        tc = state.target_cache
        if tc.paged and retrieval.scores_by_kernel(c, ret.score_lse):  # the kernel reads the pool through the table
            scores = dispatch.chunk_scores(ret.score_q, ret.score_lse, tc.layer_keys(plan.score_layer), root, chunk=c,
                                           pages=tc.pages, page_size=tc.page_size)
        elif tc.paged:
            scores = _paged_chunk_scores(ret.score_q, ret.score_lse, tc, tc.layer_keys(plan.score_layer), root, c)
        else:
            scores = dispatch.chunk_scores(ret.score_q, ret.score_lse, tc.layer_keys(plan.score_layer), root, chunk=c)
        if plan.tp_axis is not None:
            scores = jax.lax.psum(scores, plan.tp_axis)
        scores = scores / plan.target.num_attention_heads
    else:  # salience: the upcoming root entry's draft query against the chunk key summaries
        q = plan.drafter.root_query(plan, dparams, state)
        scores = retrieval.salience_scores(_gather_heads(plan, q, 1), _gather_heads(plan, ret.chunk_sum, 2), root,
                                           c)
    summaries = None if ret.chunk_sum is None else _gather_heads(plan, ret.chunk_sum, 2)
    return retrieval.select_chunks(scores, root, c, spec.max_chunks, spec.context.keep_sink_chunk,
                                   spec.context.redundancy_weight, summaries)


#: positions (summed over the batch) of the scoring layer's keys a paged cache gathers at once to score chunks
PAGED_SCORE_TOKENS = 1 << 18


def _paged_chunk_scores(q, lse, cache, buf, root, chunk: int):
    """Chunk scores over a paged cache on the reference path (the Pallas kernel reads the pool through the page
    table instead, copying nothing): the scoring layer's keys gathered through the page table a group of page
    columns at a time (at most :data:`PAGED_SCORE_TOKENS` positions over the batch per group: 512 MiB at
    Llama-3.1-8B shapes), each group scored as a cache of its own. A chunk's score reads its own positions only
    (the log-sum-exp is given), so groups of whole chunks score exactly as the whole cache does.
    Returns float32 ``[B, ceil(capacity / chunk)]``."""
    b, maxp = cache.pages.shape
    p = cache.page_size
    cols = max(1, min(maxp, (PAGED_SCORE_TOKENS // b) // p))
    cols = -(-cols * p // chunk) * chunk // p if chunk > p else cols  # whole chunks per group
    groups = -(-maxp // cols)
    pages = jnp.pad(cache.pages, ((0, 0), (0, groups * cols - maxp)), constant_values=-1)

    def group(g):
        view = page_view(buf, jax.lax.dynamic_slice_in_dim(pages, g * cols, cols, axis=1), p)
        return dispatch.chunk_scores(q, lse, view, root - g * cols * p, chunk=chunk)

    scores = jax.lax.map(group, jnp.arange(groups)) if groups > 1 else group(0)[None]
    scores = jnp.moveaxis(scores, 0, 1).reshape(b, -1)
    return scores[:, :retrieval.num_chunks(maxp * p, chunk)]


def _retrieve(plan: Plan, tparams, dparams, state: DecodeState, mask):
    """Score chunks and replace the selection of the sequences in ``mask`` (bool ``[B]``).

    Returns the state and each shard's anchors ``[1, B, A]`` (stacked over ``tp`` by the caller's out specs), so
    the host can check that every rank selected the same chunks.
    """
    ret = state.retrieval
    anchors = jnp.where(mask[:, None], _select_anchors(plan, tparams, dparams, state), ret.anchors)
    return state.replace(retrieval=ret.replace(anchors=anchors)), anchors[None]


def _gather_heads(plan: Plan, x: jax.Array, axis: int) -> jax.Array:
    """All heads of a sharded draft's per-head array (replicated drafts already hold them)."""
    if plan.draft_axis is None:
        return x
    return jax.lax.all_gather(x, plan.draft_axis, axis=axis, tiled=True)
