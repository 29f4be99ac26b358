"""Verification: how many drafted tokens the target accepts, and which tokens are emitted.

Chains: both chain functions take the target's K+1 rows for the verify block ``[last, d_1..d_K]`` (row i predicts the token
after block token i) and return ``(m, emitted)``: ``m`` int32 ``[B]`` accepted drafts (0..K) and ``emitted``
int32 ``[B, K+1]`` whose first ``m + 1`` entries are the tokens to commit (accepted drafts, then the target's
correction or bonus); entries past ``m`` are filler.

Trees (:mod:`diffspec_jax.tree` layout, ``T`` rows, row 0 = root): the target's row i predicts the token after
node i's path. Both tree functions return ``(m, path, emitted)``: ``m`` accepted nodes (0..max_depth), ``path``
int32 ``[B, max_depth + 1]`` the rows of the root and the accepted nodes (``path[:, 0] = 0``; entries past ``m`` are
0), ``emitted`` int32 ``[B, max_depth + 1]`` as for chains.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from diffspec_jax.sampling import exponential_race


def accepted_prefix(accept: jax.Array) -> jax.Array:
    """Length of the leading run of ``True`` along the last axis (int32)."""
    return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def greedy_accept(target_logits: jax.Array, drafts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Longest prefix of drafts equal to the target's argmax, plus the target's next token.

    Args:
        target_logits: ``[B, K+1, V]``; drafts: int32 ``[B, K]``.
    Token-identical to greedy decoding with the target alone.
    """
    a = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
    m = accepted_prefix(drafts == a[:, :-1])
    return m, a


def rejection_accept(key: jax.Array, target_logp: jax.Array, drafts: jax.Array,
                     draft_probs: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Speculative rejection sampling (lossless for any draft distribution q).

    Accept ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection emit a token drawn
    from ``norm(max(p_i - q_i, 0))``; when all K are accepted emit a bonus drawn from ``p_{K+1}``.

    Args:
        target_logp: float32 ``[B, K+1, V]`` processed target log-probabilities (same processing as the baseline).
        drafts: int32 ``[B, K]`` drafted target ids.
        draft_probs: float32 ``[B, K, V]`` the distributions the drafts were drawn from, or ``None`` for argmax
            drafting (one-hot q: accept with probability p(d); the residual is p with d removed).
    """
    b, k1, v = target_logp.shape
    k = k1 - 1
    key_u, key_r = jax.random.split(key)
    p = jnp.exp(target_logp)
    p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
    if draft_probs is None:
        q_ext = jax.nn.one_hot(drafts, v, dtype=jnp.float32)
        q_d = jnp.ones_like(p_d)
    else:
        q_ext = draft_probs.astype(jnp.float32)
        q_d = jnp.take_along_axis(q_ext, drafts[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(key_u, p_d.shape)
    m = accepted_prefix(u * q_d < p_d)
    q_ext = jnp.concatenate([q_ext, jnp.zeros((b, 1, v), jnp.float32)], axis=1)  # row K: bonus from p itself
    p_m = jnp.take_along_axis(p, m[:, None, None], axis=1)[:, 0]
    q_m = jnp.take_along_axis(q_ext, m[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_m - q_m, 0.0)
    residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_m)
    recovered = exponential_race(key_r, residual)
    drafts_ext = jnp.concatenate([drafts, jnp.zeros((b, 1), drafts.dtype)], axis=1)
    emitted = jnp.where(jnp.arange(k1)[None, :] < m[:, None], drafts_ext, recovered[:, None])
    return m, emitted.astype(jnp.int32)


def _children(tree, node: jax.Array) -> jax.Array:
    """bool ``[B, T]``: the valid children of row ``node [B]``."""
    return tree.valid & (tree.parents == node[:, None])


def tree_greedy_accept(target_logits: jax.Array, tree, max_depth: int
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Follow the target's argmax from the root while a child carries it; emit the argmaxes along the path plus
    the bonus (token-identical to greedy decoding with the target alone).

    Args:
        target_logits: ``[B, T, V]``; tree: a :class:`diffspec_jax.tree.Tree`; max_depth: the tree's depth limit.
    """
    a = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
    b = a.shape[0]
    cur = jnp.zeros((b,), jnp.int32)
    alive = jnp.ones((b,), bool)
    path = [cur]
    for _ in range(max_depth):
        want = jnp.take_along_axis(a, cur[:, None], axis=1)
        match = _children(tree, cur) & (tree.tokens == want)
        found = alive & jnp.any(match, axis=1)
        child = jnp.argmax(match, axis=1).astype(jnp.int32)
        cur = jnp.where(found, child, cur)
        alive = found
        path.append(jnp.where(found, child, 0))
    path = jnp.stack(path, axis=1)
    m = jnp.sum(path[:, 1:] > 0, axis=1).astype(jnp.int32)
    return m, path, jnp.take_along_axis(a, path, axis=1)


def tree_rejection_accept(key: jax.Array, target_logp: jax.Array, tree, max_depth: int, max_children: int
                          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Multi-draft recursive rejection sampling over a tree of deterministic (one-hot) drafts; lossless.

    At the current node (from the root) with target distribution r = p(row): try its children in row order;
    child x is accepted with probability ``r(x) / sum(r)``; on rejection ``r(x) <- 0`` and the next sibling is
    tried. An accepted child becomes the current node; when no child is accepted a token is drawn from r (the
    correction, or the bonus below a leaf) and the walk ends. Each emitted token is thus distributed exactly as
    the target's processed distribution given the tokens before it.

    Args:
        target_logp: float32 ``[B, T, V]`` processed target log-probabilities; max_children: the most children any
            node has (the tree's top-k), a static bound on the tries per depth.
    """
    b, _, v = target_logp.shape
    p = jnp.exp(target_logp)
    cur = jnp.zeros((b,), jnp.int32)
    alive = jnp.ones((b,), bool)
    final = jnp.zeros((b,), jnp.int32)
    path = [cur]
    cols = jnp.arange(v, dtype=jnp.int32)[None, :]
    for d in range(max_depth + 1):
        r = jnp.take_along_axis(p, cur[:, None, None], axis=1)[:, 0]
        kids = _children(tree, cur)
        order = jnp.cumsum(kids, axis=1) - 1
        accepted = jnp.zeros((b,), bool)
        chosen = jnp.zeros((b,), jnp.int32)
        for i in range(max_children if d < max_depth else 0):
            is_i = kids & (order == i)
            c = jnp.argmax(is_i, axis=1).astype(jnp.int32)
            x = jnp.take_along_axis(tree.tokens, c[:, None], axis=1)
            px = jnp.take_along_axis(r, x, axis=1)[:, 0]
            u = jax.random.uniform(jax.random.fold_in(key, d * max_children + i), (b,))
            trial = alive & ~accepted & jnp.any(is_i, axis=1)
            ok = trial & (u * jnp.sum(r, axis=1) < px)
            chosen = jnp.where(ok, c, chosen)
            accepted = accepted | ok
            r = jnp.where((trial & ~ok)[:, None] & (cols == x), 0.0, r)
        r = jnp.where(jnp.sum(r, axis=1, keepdims=True) > 0, r, jnp.take_along_axis(p, cur[:, None, None],
                                                                                     axis=1)[:, 0])
        draw = exponential_race(jax.random.fold_in(key, (max_depth + 1) * max_children + d), r)
        final = jnp.where(alive & ~accepted, draw, final)
        step = alive & accepted
        cur = jnp.where(step, chosen, cur)
        path.append(jnp.where(step, chosen, 0))
        alive = step
    path = jnp.stack(path[: max_depth + 1], axis=1)
    m = jnp.sum(path[:, 1:] > 0, axis=1).astype(jnp.int32)
    nxt = jnp.take_along_axis(tree.tokens, jnp.concatenate([path[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1),
                              axis=1)
    emitted = jnp.where(jnp.arange(max_depth + 1)[None, :] < m[:, None], nxt, final[:, None])
    return m, path, emitted.astype(jnp.int32)


# ---------------------------------------------------------------------- per-row keys (the server's slots)
def _one_row(fn, key, *batched):
    """``fn(key, *rows)`` on batch-1 slices of ``batched`` (every leaf batch-first), the batch axis removed again."""
    out = fn(key, *jax.tree_util.tree_map(lambda x: x[None], batched))
    return jax.tree_util.tree_map(lambda x: x[0], out)


def rejection_accept_rows(keys: jax.Array, target_logp: jax.Array, drafts: jax.Array,
                          draft_probs: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """:func:`rejection_accept` with each row's own key (``keys`` uint32 ``[B, 2]``): a row's decisions depend on
    its key and its own rows only, never on the rest of the batch."""
    if draft_probs is None:
        return jax.vmap(lambda k, lp, d: _one_row(rejection_accept, k, lp, d))(keys, target_logp, drafts)
    return jax.vmap(lambda k, lp, d, q: _one_row(rejection_accept, k, lp, d, q))(keys, target_logp, drafts,
                                                                                 draft_probs)


def tree_rejection_accept_rows(keys: jax.Array, target_logp: jax.Array, tree, max_depth: int, max_children: int
                               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`tree_rejection_accept` with each row's own key (``keys`` uint32 ``[B, 2]``)."""
    fn = lambda k, lp, t: tree_rejection_accept(k, lp, t, max_depth, max_children)  # noqa: E731
    return jax.vmap(lambda k, lp, t: _one_row(fn, k, lp, t))(keys, target_logp, tree)
