"""Chain verification: how many drafted tokens the target accepts, and which tokens are emitted.

Both functions take the target's K+1 rows for the verify block ``[last, d_1..d_K]`` (row i predicts the token
after block token i) and return ``(m, emitted)``: ``m`` int32 ``[B]`` accepted drafts (0..K) and ``emitted``
int32 ``[B, K+1]`` whose first ``m + 1`` entries are the tokens to commit (accepted drafts, then the target's
correction or bonus); entries past ``m`` are filler.
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
