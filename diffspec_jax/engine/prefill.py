"""Prefill: the target's chunked prefill of ragged prompts (an EAGLE-3 draft's K/V of each chunk projected and stored
as it goes), then the first sampled token, which becomes the pending root entry of the first cycle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from diffspec_jax.engine.state import DecodeState, Plan, _rows, _split
from diffspec_jax.models import family
from diffspec_jax.sampling import choose, choose_rows, split_rows


@struct.dataclass
class PrefillAcc:
    """Per-sequence values of each prompt's last position, filled by the chunk that contains it."""

    logits: jax.Array      # [B, V]
    aux: jax.Array         # [B, A*Ht]
    score_q: jax.Array     # [B, Hq, D]
    score_lse: jax.Array   # [B, Hq]

    @classmethod
    def zeros(cls, plan: Plan, batch: int, target_dtype) -> PrefillAcc:
        """An empty accumulator of ``batch`` prompts (``generate()``'s batch, or a server slot's one)."""
        tc = plan.target
        return cls(logits=jnp.zeros((batch, tc.vocab_size), jnp.float32),
                   aux=jnp.zeros((batch, max(1, len(plan.aux_layers) * tc.hidden_size)), target_dtype),
                   score_q=jnp.zeros((batch, tc.num_attention_heads, tc.head_dim), jnp.float32),
                   score_lse=jnp.zeros((batch, tc.num_attention_heads), jnp.float32))


def _prefill_chunk(plan: Plan, tparams, dparams, state: DecodeState, acc: PrefillAcc, tokens, next_tokens,
                   start, lengths, *, first: bool = False):
    """Target prefill of one chunk, then the drafter's :meth:`~diffspec_jax.engine.drafting.Drafter.prefill` (an
    EAGLE-3 draft stores the chunk's entries). ``first`` (static): the prompts' first chunk (every ``start`` is 0),
    whose attention has no prefix to read."""
    b, w = tokens.shape
    last = lengths - 1
    rows = jnp.clip(last - start, 0, w - 1)[:, None]
    out, tcache = family(plan.target).step(plan.target, tparams, state.target_cache, tokens, start, rows,
                                           aux_layers=plan.aux_layers,
                                           score_layer=plan.score_layer, axis_name=plan.tp_axis,
                                           num_valid=jnp.clip(lengths - start, 0, w),  # padding stays out of states
                                           first_chunk=first)
    in_chunk = (last >= start) & (last < start + w)
    sel = lambda new, old: jnp.where(in_chunk.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)  # noqa: E731
    acc = acc.replace(logits=sel(out.logits[:, 0], acc.logits))
    state = state.replace(target_cache=tcache)
    if out.aux is not None:
        acc = acc.replace(aux=sel(_rows(out.aux, rows[:, 0]), acc.aux))
    if plan.drafter is not None:
        state = plan.drafter.prefill(plan, dparams, state, out, next_tokens, start, last)
    if out.score_q is not None:
        acc = acc.replace(score_q=sel(out.score_q[:, 0], acc.score_q), score_lse=sel(out.score_lse[:, 0],
                                                                                      acc.score_lse))
    return state, acc


def _start_decode(plan: Plan, state: DecodeState, acc: PrefillAcc, lengths, context=None):
    """Sample the first token x_P and make entry P-1 (x_P, F_{P-1}) the pending root; the plan's
    :class:`~diffspec_jax.engine.drafting.Drafter` prepares its state (from ``context``, int32 ``[B, capacity]``,
    the prompts zero padded, when it reads them: ``None`` otherwise)."""
    rng, key = _split(plan, state.rng)
    if state.sampling is None:
        first = choose(key, acc.logits, plan.sampling)
    else:  # each row samples with its own parameters and key (the server's slots)
        keys, row_key = split_rows(state.sampling.key)
        first = state.sampling.replayed(lengths, choose_rows(row_key, acc.logits, state.sampling))
        state = state.replace(sampling=state.sampling.replace(key=keys))
    k1 = plan.k + 1
    state = state.replace(
        rng=rng, length=lengths.astype(jnp.int32), last_token=first,
        pend_tokens=jnp.zeros_like(state.pend_tokens).at[:, 0].set(first),
        pend_feats=jnp.zeros_like(state.pend_feats).at[:, 0].set(acc.aux.astype(state.pend_feats.dtype))
        if plan.aux_layers else state.pend_feats,
        pend_count=jnp.ones_like(lengths, jnp.int32) if k1 > 1 else state.pend_count)
    if state.retrieval is not None and plan.score_layer is not None:
        state = state.replace(retrieval=state.retrieval.replace(score_q=acc.score_q, score_lse=acc.score_lse))
    if plan.drafter is not None:
        state = state.replace(drafter=plan.drafter.prepare(plan, state.drafter, context, lengths, first))
    return state, first
