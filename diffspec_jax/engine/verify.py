"""Cycles: draft -> verify -> accept (chain, tree, or the target alone), pure functions of ``(params, state,
inputs)``.

Data path of one chain cycle (:func:`_spec_cycle`), steps 1 and 2 being the plan's
:class:`~diffspec_jax.engine.drafting.Drafter`'s :meth:`~diffspec_jax.engine.drafting.Drafter.propose` (here the
EAGLE-3 drafter's):

1. **Draft step 0.** The entries committed by the previous verification (``pend_*``: token ``x_{t+1}`` paired
   with target aux features ``F_t``) are projected to pre-RoPE K/V (one layer: no attention needed) and stored
   at their absolute positions; for working-cache policies the cache is rebuilt (gather-RoPE-write of the
   history) and the root entry placed at slot ``n``; the root runs attention and proposes ``d_1``.
2. **Chain.** Steps j = 1..K-1 feed ``(d_j, h2)`` at local position ``n + j``. (Self-drafting runs the target
   over its working set instead; prompt lookup proposes from its own state, alone or, on the rows where it finds a
   proposal, in front of either draft.)
3. **Verify.** The target runs ``[last_token, d_1..d_K]`` at positions ``length .. length + K`` in one step,
   returning logits, aux features and (DiffSpec) the scoring layer's queries and LSE.
4. **Accept.** Greedy or rejection sampling gives ``m`` accepted drafts and the bonus; ``length += m + 1``; the
   m + 1 verified entries become the next cycle's pending entries (and the drafter's update); the committed row's
   query and LSE are kept for retrieval. Hybrid targets (Qwen3.5) verify with per-position state snapshots and the
   family's ``commit`` rolls their DeltaNet conv / recurrent states back to the state after the last accepted token
   (KV needs no rollback: rows beyond the committed length are masked and overwritten).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from diffspec_jax import tree, verification
from diffspec_jax.cache import move_rows
from diffspec_jax.engine.state import DecodeState, Plan, _rows, _split
from diffspec_jax.models import family
from diffspec_jax.sampling import choose, choose_rows, processed_logprobs, processed_logprobs_rows, split_rows


class Cycle(NamedTuple):
    """One cycle's result (every cycle returns it: chain, tree and target-only).

    Attributes:
        state: the :class:`DecodeState` after it.
        emitted: int32 ``[B, K+1]`` each row's accepted drafts and the correction or bonus token (the first
            ``m + 1`` are real).
        m: int32 ``[B]`` accepted drafts (0 for inactive rows).
        n, window: int32 ``[B]`` the draft's history length and rolling-window tokens (zeros without a working
            cache).
        drafted: int32 ``[B]`` tokens drafted (the chain's depth, a tree's size, 0 target-only).
    """

    state: DecodeState
    emitted: jax.Array
    m: jax.Array
    n: jax.Array
    window: jax.Array
    drafted: jax.Array


def _spec_cycle(plan: Plan, tparams, dparams, state: DecodeState, active, depth_rows=None, *,
                depth: int | None = None) -> Cycle:
    """One draft -> verify -> accept chain cycle: the plan's drafter proposes, the target verifies.

    ``depth`` (static, default K) is the chain length this compilation drafts and verifies; ``depth_rows``
    (int32 ``[B]``, optional) caps each sequence's accepted drafts below it (adaptive depth: a batch runs at its
    largest depth).
    """
    rng, k_draft, k_verify = _split(plan, state.rng, 3)
    depth = plan.k if depth is None else depth
    p = plan.drafter.propose(plan, tparams, dparams, state, active, k_draft, depth)
    state, drafts, q = p.state, p.drafts, p.q
    if state.sampling is not None:  # a replaying row verifies the tokens it had generated (SamplingRows.replay)
        drafts = state.sampling.replayed(state.length[:, None] + 1 + jnp.arange(depth, dtype=jnp.int32), drafts)
    block = jnp.concatenate([state.last_token[:, None], drafts], axis=1)
    rows = jnp.broadcast_to(jnp.arange(depth + 1, dtype=jnp.int32), block.shape)
    fam = family(plan.target)
    out, tcache = fam.step(plan.target, tparams, state.target_cache, block, state.length, rows,
                           aux_layers=plan.aux_layers, score_layer=plan.score_layer, axis_name=plan.tp_axis,
                           snapshots=True)
    if state.sampling is not None:
        state, m, emitted = _accept_rows(state, active, out.logits, drafts, q)
        m, emitted = replay_accept(state.sampling, state.length, out.logits, m, emitted)
    elif plan.sampling.greedy:
        m, emitted = verification.greedy_accept(out.logits, drafts)
    else:
        m, emitted = verification.rejection_accept(k_verify, processed_logprobs(out.logits, plan.sampling),
                                                   drafts, q)
    if depth_rows is not None:  # emitted[j] is a valid target token at every j <= m, so truncating is lossless
        m = jnp.minimum(m, depth_rows)
    m = jnp.where(active, m, 0)
    # rollback: recurrent states after the m + 1 committed tokens (inactive sequences: before the step)
    tcache = fam.commit(plan.target, tcache, out, jnp.where(active, m + 1, 0))
    path = jnp.broadcast_to(jnp.arange(depth + 1, dtype=jnp.int32), m.shape + (depth + 1,))
    state, emitted, m = _accept(plan, state, active, rng, tcache, out, m, emitted, path)
    drafted = jnp.full_like(m, depth) if depth_rows is None else depth_rows
    return Cycle(state, emitted, m, p.n, p.window, drafted)


def _pad_cols(x: jax.Array, width: int) -> jax.Array:
    """Zero-pad axis 1 of ``x`` to ``width``."""
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, width - x.shape[1])
    return jnp.pad(x, pad)


def _accept(plan: Plan, state: DecodeState, active, rng, tcache, out, m, emitted, path):
    """Commit ``m`` accepted tokens + the correction/bonus: lengths, pending draft entries (features of the verify
    rows ``path [B, m+1 ...]``), the scoring query of the deepest accepted row, the drafter's update.
    ``emitted [B, <= K+1]``."""
    k1 = plan.k + 1
    length = state.length
    emitted = _pad_cols(emitted, k1)
    bonus = _rows(emitted, m)
    col = jnp.arange(k1)[None, :]
    pend_tokens = jnp.where(col <= m[:, None], emitted, 0)
    keep = lambda new, old: jnp.where(active.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)  # noqa: E731
    last = _rows(path, m)
    ret = state.retrieval
    if ret is not None and out.score_q is not None:
        ret = ret.replace(score_q=keep(_rows(out.score_q, last), ret.score_q),
                          score_lse=keep(_rows(out.score_lse, last), ret.score_lse))
    feats = state.pend_feats
    if out.aux is not None:
        feats = _pad_cols(jnp.take_along_axis(out.aux, path[:, :, None], axis=1).astype(feats.dtype), k1)
    state = state.replace(
        target_cache=tcache, retrieval=ret, rng=rng,
        length=keep(state.length + m + 1, state.length), last_token=keep(bonus, state.last_token),
        pend_tokens=keep(pend_tokens, state.pend_tokens), pend_feats=keep(feats, state.pend_feats),
        pend_count=keep(m + 1, state.pend_count))
    if plan.drafter is not None:
        state = state.replace(drafter=plan.drafter.update(plan, state.drafter, length, active, emitted, m))
    return state, emitted, m


def _tree_cycle(plan: Plan, tparams, dparams, state: DecodeState, active, caps, budget) -> Cycle:
    """One tree cycle: draft tree (the EAGLE-3 drafter's
    :meth:`~diffspec_jax.engine.propose.Eagle3Drafter.propose_tree`) -> one tree-masked target step -> walk -> move
    the accepted path's KV rows. ``drafted`` is the tree's size.

    ``caps`` int32 ``[B, K]`` and ``budget`` int32 ``[B]`` come from the host's branching and budget controllers.
    """
    rng, _, k_verify = _split(plan, state.rng, 3)
    spec = plan.spec
    depth = plan.k
    t, state, n, window = plan.drafter.propose_tree(plan, dparams, state, active, caps, budget)
    mask = tree.ancestry_mask(t.parents, t.valid, depth)
    rows = jnp.broadcast_to(jnp.arange(t.tokens.shape[1], dtype=jnp.int32), t.tokens.shape)
    fam = family(plan.target)
    out, tcache = fam.step(plan.target, tparams, state.target_cache, t.tokens, state.length, rows,
                           aux_layers=plan.aux_layers, score_layer=plan.score_layer, axis_name=plan.tp_axis,
                           tree=(t.depth, mask))
    if state.sampling is not None:
        state, m, path, emitted = _tree_accept_rows(plan, state, active, out.logits, t)
    elif plan.sampling.greedy:
        m, path, emitted = verification.tree_greedy_accept(out.logits, t, depth)
    else:
        m, path, emitted = verification.tree_rejection_accept(
            k_verify, processed_logprobs(out.logits, plan.sampling), t, depth, spec.verification.topk)
    m = jnp.where(active, m, 0)
    path = jnp.where(active[:, None], path, jnp.arange(depth + 1, dtype=jnp.int32)[None, :])
    tcache = move_rows(tcache, state.length, path)
    state, emitted, m = _accept(plan, state, active, rng, tcache, out, m, emitted, path)
    return Cycle(state, emitted, m, n, window, t.size)


def _target_cycle(plan: Plan, tparams, dparams, state: DecodeState, active) -> Cycle:
    """Autoregressive baseline: one target step on ``last_token``; same cache machinery.

    Deterministic plans (``SpecConfig.deterministic``) run the step as a chain verify block: ``last_token`` and K
    copies of it, logits at all K + 1 rows, row 0's taken. Its matrix products then have the verify step's
    shapes, so each of its rows rounds as a verify row does; the copies' K/V land past the committed length,
    where no query sees them before the next step overwrites them."""
    rng, key = _split(plan, state.rng)
    b = state.length.shape[0]
    t = plan.spec.num_speculative_tokens + 1 if plan.spec.deterministic else 1
    rows = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out, tcache = family(plan.target).step(plan.target, tparams, state.target_cache,
                                           jnp.broadcast_to(state.last_token[:, None], (b, t)), state.length, rows,
                                           axis_name=plan.tp_axis, num_valid=active.astype(jnp.int32))
    if state.sampling is None:
        tok = choose(key, out.logits[:, 0], plan.sampling)
    else:
        state, row_key = _row_keys(state, active)
        tok = state.sampling.replayed(state.length + 1, choose_rows(row_key, out.logits[:, 0], state.sampling))
    zero = jnp.zeros_like(state.length)
    state = state.replace(target_cache=tcache, rng=rng, length=jnp.where(active, state.length + 1, state.length),
                          last_token=jnp.where(active, tok, state.last_token))
    return Cycle(state, tok[:, None], zero, zero, zero, zero)


# ------------------------------------------------------------------ per-row sampling (DecodeState.sampling)
def _row_keys(state: DecodeState, active):
    """Advance the active rows' own keys; returns ``(state, the key each row uses now [B, 2])``."""
    rows = state.sampling
    keys, use = split_rows(rows.key)
    keys = jnp.where(active[:, None], keys, rows.key)
    return state.replace(sampling=rows.replace(key=keys)), use


def _accept_rows(state: DecodeState, active, logits, drafts, q):
    """Chain acceptance row by row: greedy rows take the greedy prefix, sampled rows rejection-sample with their
    own parameters and key (skipped when no row samples). Returns ``(state, m [B], emitted [B, K+1])``."""
    state, keys = _row_keys(state, active)
    rows = state.sampling
    m_g, e_g = verification.greedy_accept(logits, drafts)

    def sampled():
        m_s, e_s = verification.rejection_accept_rows(keys, processed_logprobs_rows(logits, rows), drafts, q)
        return jnp.where(rows.greedy, m_g, m_s), jnp.where(rows.greedy[:, None], e_g, e_s)

    m, emitted = jax.lax.cond(jnp.any(~rows.greedy), sampled, lambda: (m_g, e_g))
    return state, m, emitted


def replay_accept(rows, length, logits, m, emitted):
    """Acceptance of the rows that replay tokens they had generated before a preemption
    (:attr:`~diffspec_jax.sampling.SamplingRows.replay`): their drafts at positions below ``replay_end`` were
    replaced by those tokens, which are taken whatever the target says (what the request already returned), so at
    least ``f = clip(replay_end - 1 - length, 0, K)`` drafts count as accepted. A row whose own acceptance stopped
    short of ``f`` (its target disagreed with a replayed token) takes the target's choice at row ``f`` (the argmax, or
    a sample of the row's distribution with a key of its own) after them; every emitted position below
    ``replay_end`` is the replayed token. Other rows are unchanged. ``logits [B, K+1, V]``, ``m [B]``, ``emitted
    [B, K+1]``."""
    k = emitted.shape[1] - 1
    f = jnp.clip(rows.replay_end - 1 - length, 0, k)
    short = m < f
    own = jax.lax.cond(jnp.any(short), lambda: choose_rows(
        split_rows(rows.key, 3)[2], jnp.take_along_axis(logits, f[:, None, None], axis=1)[:, 0], rows),
        lambda: jnp.zeros_like(m))
    col = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    emitted = jnp.where(short[:, None] & (col == f[:, None]), own[:, None], emitted)
    emitted = rows.replayed(length[:, None] + 1 + col, emitted)
    return jnp.maximum(m, f), emitted


def _tree_accept_rows(plan: Plan, state: DecodeState, active, logits, t):
    """Tree acceptance row by row (see :func:`_accept_rows`). Returns ``(state, m, path, emitted)``."""
    state, keys = _row_keys(state, active)
    rows = state.sampling
    depth = plan.k
    g = verification.tree_greedy_accept(logits, t, depth)

    def sampled():
        s = verification.tree_rejection_accept_rows(keys, processed_logprobs_rows(logits, rows), t, depth,
                                                    plan.spec.verification.topk)
        pick = lambda a, b: jnp.where(rows.greedy.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)  # noqa: E731
        return tuple(pick(a, b) for a, b in zip(g, s))

    m, path, emitted = jax.lax.cond(jnp.any(~rows.greedy), sampled, lambda: g)
    return state, m, path, emitted
