"""Self-drafting: the target proposes its own K tokens over its working set (``generate(target, "self", ...)``).

The proposer (:func:`self_propose`) is the target's cached step with the same weights, run K times on one token at a
time; only where its attention layers read from changes with the policy (docs/self_drafting.md):

* ``recent``: the sink chunk 0 and a window of the most recent positions (StreamingLLM-like);
* ``diffspec``: the chunks DiffSpec's target-guided scoring selects from the verify pass's attention (the retrieval
  cadence, scoring and selection of docs/method.md sections 2 to 4, unchanged), plus the sink chunk and the window;
* ``full``: the whole target cache (a sanity mode: greedy drafts are the target's own tokens).

The two working-set policies read a :class:`~diffspec_jax.working_set.WorkingSet` of ``diffspec_token_budget``
positions per sequence (the sink chunk is always kept: :func:`self_draft_spec`). Verification is the chain cycle's,
unchanged, over the full cache, so greedy output is the target's and sampling keeps its distribution: a sampled
draft token comes with the processed distribution it was drawn from (``draft_sampling="sample"``), an argmax draft
with a one-hot q, as :func:`diffspec_jax.verification.rejection_accept` expects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp

from diffspec_jax import working_set
from diffspec_jax.config import ModelConfig, SpecConfig
from diffspec_jax.engine.drafting import Drafter, Proposal
from diffspec_jax.engine.state import DecodeState, Plan
from diffspec_jax.errors import ConfigError
from diffspec_jax.models import family
from diffspec_jax.sampling import processed_logprobs

#: the ``draft`` argument of :func:`diffspec_jax.generate` (and ``--draft``) that selects self-drafting
SELF = "self"


def is_self(draft) -> bool:
    """Whether ``draft`` asks for self-drafting (the string ``"self"``)."""
    return isinstance(draft, str) and draft == SELF


def self_draft_spec(spec: SpecConfig, target: ModelConfig) -> SpecConfig:
    """The :class:`SpecConfig` a self-drafting run uses: ``spec`` with the sink chunk kept (working-set policies),
    after checking what self-drafting supports.

    Raises:
        ConfigError: tree drafting, the salience scorer or a redundancy weight (they need a draft model's keys), a
            budget too small for the sink chunk, or a scoring layer the target does not have.
    """
    if spec.tree:
        raise ConfigError("self-drafting proposes chains: diffspec_verification_mode='tree' needs an EAGLE-3 draft")
    if not spec.uses_working_cache:
        return spec
    if spec.context.needs_summaries:
        raise ConfigError("self-drafting scores chunks with the target's attention: diffspec_scorer='salience' "
                          "and diffspec_redundancy_weight > 0 need an EAGLE-3 draft's keys")
    spec.context.check_target(target)
    try:
        spec.check_history_budget(sink=True)  # the working set always holds the sink chunk
    except ConfigError as exc:
        raise ConfigError(f"self-drafting always keeps the sink chunk: {exc}") from None
    return spec.replace(context=spec.context.with_sink())


def _choose(plan: Plan, key, logits):
    """A draft token from the self-draft's logits ``[B, V]`` and, when sampling drafts, its processed distribution
    (the same processing verification applies to the target's logits)."""
    if plan.sampling.greedy or plan.spec.draft_sampling == "argmax":
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
    logp = processed_logprobs(logits, plan.sampling)
    return jax.random.categorical(key, logp, axis=-1).astype(jnp.int32), jnp.exp(logp)


def self_propose(plan: Plan, tparams, state: DecodeState, active, key, depth: int | None = None):
    """Refresh the working set (policies ``recent`` / ``diffspec``) and draft a chain of ``depth`` (default K)
    tokens with the target over it.

    Draft step j runs token ``last_token`` (j = 0) or ``d_j`` at absolute position ``length + j``, written at
    working slot ``n + j``, attending to the history slots and the chain's earlier steps. With ``full`` the steps
    run on the target cache itself (rows ``length ..`` are overwritten by verification); for a hybrid target their
    recurrent states are dropped either way.

    Returns:
        ``(drafts int32 [B, depth], q float32 [B, depth, V] or None, working set (None for full), retrieval state,
        n [B] history length, window [B] window tokens, target cache)``.
    """
    spec, fam = plan.spec, family(plan.target)
    depth = plan.k if depth is None else depth
    tcache, length = state.target_cache, state.length
    ws = None
    if not spec.uses_working_cache:
        cache, start, n, window = tcache, length, length, length
    else:
        chunk = spec.context.chunk_size
        anchors = working_set.effective_anchors(state.retrieval.anchors if plan.diffspec else None, length, chunk,
                                                spec.max_chunks - 1)
        ws = working_set.refresh(state.draft_cache, tcache, anchors, length, state.pend_count, active, chunk,
                                 state.pend_tokens.shape[1])
        cache = tcache.replace(k=ws.k, v=ws.v, pages=None, page_size=0)  # the working set: rows per sequence
        start, n, window = ws.length, ws.length, ws.count
    rows = jnp.zeros((length.shape[0], 1), jnp.int32)
    tok, drafts, qs = state.last_token, [], []
    for j in range(depth):
        out, cache = fam.step(plan.target, tparams, cache, tok[:, None], start + j, rows, axis_name=plan.tp_axis,
                              rope_positions=(length + j)[:, None])
        key, sub = jax.random.split(key)
        tok, q = _choose(plan, sub, out.logits[:, 0])
        drafts.append(tok)
        qs.append(q)
    if ws is not None:
        ws = ws.replace(k=cache.k, v=cache.v)
    else:
        tcache = tcache.replace(k=cache.k, v=cache.v)
    q_all = None if qs[0] is None else jnp.stack(qs, axis=1)
    return jnp.stack(drafts, axis=1), q_all, ws, state.retrieval, n, window, tcache


@dataclass(frozen=True)
class SelfDrafter(Drafter):
    """Self-drafting as a :class:`~diffspec_jax.engine.drafting.Drafter`: its cache is the target's
    :class:`~diffspec_jax.working_set.WorkingSet` (policies with a working cache; none with ``full``)."""

    name: ClassVar[str] = SELF
    model: ClassVar[bool] = True

    def spec_for(self, spec: SpecConfig, target: ModelConfig, *, alone: bool) -> SpecConfig:
        return self_draft_spec(spec, target)

    def label(self, spec: SpecConfig) -> str:
        return f"{SELF}-{spec.context.policy}"

    def init_cache(self, plan, batch, target_dtype, draft_dtype, pool_rows):
        if not plan.spec.uses_working_cache:
            return None
        return working_set.WorkingSet.create(plan.target, plan.spec, batch, target_dtype, tp=plan.tp)

    def cache_specs(self, plan, dp, tp):
        return working_set.WorkingSet.specs(plan.target, dp, tp) if plan.spec.uses_working_cache else None

    def propose(self, plan, tparams, dparams, state, active, key, depth: int) -> Proposal:
        drafts, q, ws, ret, n, window, tcache = self_propose(plan, tparams, state, active, key, depth)
        return Proposal(drafts, q, state.replace(draft_cache=ws, retrieval=ret, target_cache=tcache), n, window)

    def reset_row(self, plan, state, row):
        """The row's working set is rebuilt at its first draft."""
        ws = state.draft_cache
        if ws is None:
            return state
        return state.replace(draft_cache=ws.replace(built=ws.built.at[row].set(working_set.UNBUILT)))
