"""The EAGLE-3 drafter (:class:`Eagle3Drafter`): the draft's entries stored as the prefill goes, then each cycle
its step 0 (commit the pending entries, rebuild the working cache, run the root) and a chain of K proposals
(:func:`draft_propose`) or an EAGLE-style dynamic tree (:func:`draft_propose_tree`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from diffspec_jax import retrieval, sharding, tree, working_cache
from diffspec_jax.config import ModelConfig, SpecConfig
from diffspec_jax.engine.drafting import Drafter, Proposal
from diffspec_jax.engine.state import DecodeState, Plan, _rows
from diffspec_jax.models import eagle3
from diffspec_jax.models.layers import attention_dense
from diffspec_jax.sampling import processed_logprobs


def _draft_choose(plan: Plan, dparams, key, logits_d):
    """A draft token (target id) and, when sampling drafts, the target-vocabulary q it was drawn from."""
    if plan.sampling.greedy or plan.spec.draft_sampling == "argmax":
        return eagle3.to_target_ids(dparams, jnp.argmax(logits_d, axis=-1).astype(jnp.int32)), None
    logp = processed_logprobs(logits_d, plan.sampling)
    idx = jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)
    b, vd = logp.shape
    cols = jnp.arange(vd, dtype=jnp.int32) + dparams["d2t"]
    q = jnp.zeros((b, plan.target.vocab_size), jnp.float32).at[:, cols].set(jnp.exp(logp))
    return eagle3.to_target_ids(dparams, idx), q


def _draft_root(plan: Plan, dparams, state: DecodeState, active):
    """Draft step 0: commit the pending entries, rebuild the working cache, run the root.

    Returns ``(cache, retrieval_state, n [B], window [B], local [B, 1] root slot, h2 [B, 1, H], logits [B, 1, Vd])``.
    """
    dc, spec = plan.draft, plan.spec
    k1 = spec.num_speculative_tokens + 1
    positions = (state.length - state.pend_count)[:, None] + jnp.arange(k1, dtype=jnp.int32)[None, :]
    ax = plan.draft_axis
    z, residual = eagle3.entry_inputs(dc, dparams, state.pend_tokens, state.pend_feats, from_target=True,
                                      axis_name=ax)
    q, k, v = eagle3.qkv(dparams, z)
    paged = dict(pages=state.target_cache.pages, page_size=state.target_cache.page_size)
    cache = working_cache.commit(dc, spec, state.draft_cache, k, v, positions, **paged)
    ret = state.retrieval
    if ret is not None and ret.chunk_sum is not None:
        valid = (jnp.arange(k1)[None, :] < state.pend_count[:, None]) & active[:, None]
        ret = ret.replace(chunk_sum=retrieval.update_chunk_sums(ret.chunk_sum, k, positions, valid,
                                                               spec.context.chunk_size))
    root = state.length - 1
    rrow = state.pend_count - 1
    q_r, k_r, v_r, res_r = (_rows(x, rrow)[:, None] for x in (q, k, v, residual))
    if ret is not None:
        ret = ret.replace(draft_q=q_r[:, 0].astype(jnp.float32))
    if spec.uses_working_cache:
        anchors = ret.anchors if plan.diffspec else None
        idx, n, window = working_cache.history_indices(anchors, root, spec.context.chunk_size,
                                                       working_cache.history_slots(spec))
        cache = working_cache.gather_rope_write(dc, cache, idx, **paged)
        local = n[:, None]
        cache = working_cache.write_slots(cache, eagle3.rope(dc, k_r, local), v_r, local)
    else:  # full: the store is the working cache at absolute positions; commit already placed the root
        n, window = root, root
        local = n[:, None]
    attn = working_cache.draft_attention(dc, cache, eagle3.rope(dc, q_r, local), local)
    h2, logits = eagle3.finish(dc, dparams, res_r, attn, ax)
    return cache, ret, n, window, local, h2, logits


def draft_propose(plan: Plan, dparams, state: DecodeState, active, key, depth: int | None = None):
    """Draft step 0 (commit pending entries, rebuild, root) and a chain of ``depth`` (default K) proposals.

    Returns:
        ``(drafts int32 [B, depth], q float32 [B, depth, V] or None (argmax drafting), draft_cache,
        retrieval_state, n [B] history length, window [B] rolling-window tokens)``.
    """
    dc, ax = plan.draft, plan.draft_axis
    depth = plan.spec.num_speculative_tokens if depth is None else depth
    cache, ret, n, window, local, h2, logits = _draft_root(plan, dparams, state, active)
    drafts, qs = [], []
    for j in range(depth):
        key, sub = jax.random.split(key)
        tok, qp = _draft_choose(plan, dparams, sub, logits[:, 0])
        drafts.append(tok)
        qs.append(qp)
        if j == depth - 1:
            break
        z, residual = eagle3.entry_inputs(dc, dparams, tok[:, None], h2, from_target=False, axis_name=ax)
        qj, kj, vj = eagle3.qkv(dparams, z)
        local = local + 1
        cache = working_cache.write_slots(cache, eagle3.rope(dc, kj, local), vj, local)
        attn = working_cache.draft_attention(dc, cache, eagle3.rope(dc, qj, local), local)
        h2, logits = eagle3.finish(dc, dparams, residual, attn, ax)
    q_all = None if qs[0] is None else jnp.stack(qs, axis=1)
    return jnp.stack(drafts, axis=1), q_all, cache, ret, n, window


def _top_children(dparams, logits_d: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
    """Each row's ``width`` most likely draft tokens: ``(log-probabilities float32, target ids int32)``."""
    logp = jax.nn.log_softmax(logits_d.astype(jnp.float32), axis=-1)
    vals, idx = jax.lax.top_k(logp, width)
    return vals, eagle3.to_target_ids(dparams, idx.astype(jnp.int32))


def draft_propose_tree(plan: Plan, dparams, state: DecodeState, active, caps, budget):
    """Draft step 0 and an EAGLE-style dynamic tree (:mod:`diffspec_jax.tree`) of depth K.

    Args:
        caps: int32 ``[B, K]`` children kept per frontier node at each depth (from the branching controller).
        budget: int32 ``[B]`` tree nodes to keep (<= ``diffspec_max_tree_nodes``).
    Returns:
        ``(tree, draft_cache, retrieval_state, n [B], window [B])``. Tree nodes attend to the working cache up
        to the root (slot ``n``) and to their ancestors (an LSE merge of the two parts); their K/V never enter
        the draft's store or working cache.
    """
    dc, spec, ax = plan.draft, plan.spec, plan.draft_axis
    depth_max, width, num_nodes = spec.num_speculative_tokens, spec.verification.topk, spec.verification.max_nodes
    cache, ret, n, window, local, h2, logits = _draft_root(plan, dparams, state, active)
    b = n.shape[0]
    scale = dc.head_dim ** -0.5
    rank = jnp.arange(width)[None, :]
    f_score, f_tok = _top_children(dparams, logits[:, 0], width)              # depth 1 = the frontier
    f_score = jnp.where(rank < caps[:, :1], f_score, -jnp.inf)
    f_pool = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (b, width))
    pool = dict(score=[f_score], parent=[jnp.full((b, width), -1, jnp.int32)], token=[f_tok],
                depth=[jnp.ones((b, width), jnp.int32)])
    f_h2 = jnp.broadcast_to(h2, (b, width, h2.shape[-1]))
    slots = (depth_max - 1) * width
    hkv = cache.work_k.shape[2]
    tk = jnp.zeros((b, max(slots, 1), hkv, dc.head_dim), cache.work_k.dtype)
    tv = jnp.zeros_like(tk)
    anc = jnp.zeros((b, width, max(slots, 1)), bool)
    prefix_mask = jnp.broadcast_to(jnp.arange(cache.work_k.shape[1])[None, None, :] <= n[:, None, None],
                                   (b, width, cache.work_k.shape[1]))
    stopped = jnp.zeros((b,), bool)
    track_mass = spec.verification.threshold > 0
    mass = _best_mass(pool["score"], budget, num_nodes) if track_mass else None
    pool_size = width
    for d in range(1, depth_max):                                             # run depth d, propose depth d + 1
        z, residual = eagle3.entry_inputs(dc, dparams, f_tok, f_h2, from_target=False, axis_name=ax)
        q, k, v = eagle3.qkv(dparams, z)
        pos = jnp.broadcast_to(n[:, None] + d, (b, width))
        q, k = eagle3.rope(dc, q, pos), eagle3.rope(dc, k, pos)
        own = (d - 1) * width + jnp.arange(width)
        tk = tk.at[:, own].set(k.astype(tk.dtype))
        tv = tv.at[:, own].set(v.astype(tv.dtype))
        anc = anc | (jnp.arange(tk.shape[1])[None, None, :] == own[None, :, None])
        out_p, lse_p = attention_dense(q, cache.work_k, cache.work_v, prefix_mask, scale)
        out_t, lse_t = attention_dense(q, tk, tv, anc, scale)
        h2, logits = eagle3.finish(dc, dparams, residual, tree.merge_attention(out_p, lse_p, out_t, lse_t), ax)
        c_score, c_tok = _top_children(dparams, logits, width)                # [B, W, W]
        c_score = f_score[:, :, None] + c_score
        c_score = jnp.where((rank[:, None, :] < caps[:, d, None, None]) & ~stopped[:, None, None], c_score, -jnp.inf)
        c_score = c_score.reshape(b, width * width)
        c_parent = jnp.repeat(f_pool, width, axis=1)
        pool["score"].append(c_score)
        pool["parent"].append(c_parent)
        pool["token"].append(c_tok.reshape(b, width * width))
        pool["depth"].append(jnp.full((b, width * width), d + 1, jnp.int32))
        if track_mass:  # stop deeper levels once a level adds too little mass to the kept set
            new_mass = _best_mass(pool["score"], budget, num_nodes)
            stopped = stopped | (new_mass - mass < spec.verification.threshold)
            mass = new_mass
        pick = jnp.argsort(-c_score, axis=1, stable=True)[:, :width]          # the next frontier
        f_score = jnp.take_along_axis(c_score, pick, axis=1)
        f_tok = jnp.take_along_axis(c_tok.reshape(b, -1), pick, axis=1)
        f_pool = pool_size + pick.astype(jnp.int32)
        parent_f = pick // width
        f_h2 = jnp.take_along_axis(h2, parent_f[:, :, None], axis=1)
        anc = jnp.take_along_axis(anc, parent_f[:, :, None], axis=1)
        pool_size += width * width
    cat = {name: jnp.concatenate(parts, axis=1) for name, parts in pool.items()}
    t = tree.select_nodes(cat["score"], cat["parent"], cat["token"], cat["depth"], budget, num_nodes,
                          state.last_token, depth_max)
    return t, cache, ret, n, window


def _best_mass(scores: list, budget: jax.Array, num_nodes: int) -> jax.Array:
    """Draft probability mass of the best ``budget`` pool entries so far, float32 ``[B]``."""
    s = jnp.concatenate(scores, axis=1)
    top = jax.lax.top_k(s, min(num_nodes, s.shape[1]))[0]
    return jnp.sum(jnp.where(jnp.arange(top.shape[1])[None, :] < budget[:, None], jnp.exp(top), 0.0), axis=1)


@dataclass(frozen=True)
class Eagle3Drafter(Drafter):
    """The EAGLE-3 draft (``plan.draft``, its params ``dparams``) as a :class:`~diffspec_jax.engine.drafting.Drafter`,
    selected by passing a loaded draft. Its cache is a :class:`~diffspec_jax.working_cache.DraftCache` (with a
    store of entries per position under a working-cache policy, paged beside the target's K/V in a paged state).

    Attributes:
        proposer: a custom draft function with :func:`draft_propose`'s signature and result (without ``depth``),
            used instead of it (``generate(proposer=...)``: tests use oracles); ``None``: :func:`draft_propose`.
    """

    proposer: Callable | None = None
    name: ClassVar[str] = "eagle3"
    model: ClassVar[bool] = True
    needs_draft: ClassVar[bool] = True

    def spec_for(self, spec: SpecConfig, target: ModelConfig, *, alone: bool) -> SpecConfig:
        return spec

    def label(self, spec: SpecConfig) -> str:
        return spec.context.policy

    def init_cache(self, plan, batch, target_dtype, draft_dtype, pool_rows):
        dc = plan.draft
        if dc is None:  # (a custom proposer without a draft)
            return None
        kv_d = sharding.kv_heads_for(dc.num_key_value_heads, plan.draft_tp, "the draft")
        return working_cache.DraftCache.create(dc, plan.spec, batch, plan.capacity, draft_dtype, num_kv_heads=kv_d,
                                               pool_rows=pool_rows)

    def cache_specs(self, plan, dp, tp):
        if plan.draft is None:
            return None
        dtp = tp if plan.draft_tp > 1 else None
        heads = P(dp, None, dtp, None)
        store = None
        if plan.spec.uses_working_cache:  # paged: one pool shared by every row
            store = P(None, None, dtp, None) if plan.paging is not None else heads
        return working_cache.DraftCache(work_k=heads, work_v=heads, store_k=store, store_v=store)

    def prefill(self, plan, dparams, state, out, next_tokens, start, last):
        """Store the draft entries of the chunk's positions (entry p: token p + 1 with the target's features at
        p); entry P - 1 is committed later, by the first step 0."""
        if plan.draft is None:
            return state
        w = next_tokens.shape[1]
        tcache = state.target_cache
        positions = start[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]
        z, _ = eagle3.entry_inputs(plan.draft, dparams, next_tokens, out.aux, from_target=True,
                                   axis_name=plan.draft_axis)
        _, k, v = eagle3.qkv(dparams, z)
        dcache = working_cache.commit(plan.draft, plan.spec, state.draft_cache, k, v, positions,
                                      pages=tcache.pages, page_size=tcache.page_size)
        state = state.replace(draft_cache=dcache)
        ret = state.retrieval
        if ret is not None and ret.chunk_sum is not None:
            ret = ret.replace(chunk_sum=retrieval.update_chunk_sums(
                ret.chunk_sum, k, positions, positions < last[:, None], plan.spec.context.chunk_size))
            state = state.replace(retrieval=ret)
        return state

    def propose(self, plan, tparams, dparams, state, active, key, depth: int) -> Proposal:
        if self.proposer is None:
            drafts, q, dcache, ret, n, window = draft_propose(plan, dparams, state, active, key, depth)
        else:
            drafts, q, dcache, ret, n, window = self.proposer(plan, dparams, state, active, key)
            drafts, q = drafts[:, :depth], None if q is None else q[:, :depth]
        return Proposal(drafts, q, state.replace(draft_cache=dcache, retrieval=ret), n, window)

    def root_query(self, plan, dparams, state):
        """The draft's query of the upcoming root entry, float32 ``[B, Hq_d, D_d]`` (the salience scorer's)."""
        rrow = state.pend_count - 1
        z, _ = eagle3.entry_inputs(plan.draft, dparams, _rows(state.pend_tokens, rrow)[:, None],
                                   _rows(state.pend_feats, rrow)[:, None], from_target=True,
                                   axis_name=plan.draft_axis)
        return eagle3.qkv(dparams, z)[0][:, 0].astype(jnp.float32)

    def propose_tree(self, plan, dparams, state, active, caps, budget):
        """:func:`draft_propose_tree`: ``(tree, state, n [B], window [B])``."""
        t, dcache, ret, n, window = draft_propose_tree(plan, dparams, state, active, caps, budget)
        return t, state.replace(draft_cache=dcache, retrieval=ret), n, window
