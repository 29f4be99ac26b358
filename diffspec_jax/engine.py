"""The decoding engine: prefill, the draft -> verify -> accept cycle, retrieval, and ``generate()``.

Data path of one chain cycle (``_spec_cycle``, one jitted function, state donated):

1. **Draft step 0.** The entries committed by the previous verification (``pend_*``: token ``x_{t+1}`` paired
   with target aux features ``F_t``) are projected to pre-RoPE K/V (one layer: no attention needed) and stored
   at their absolute positions; for working-cache policies the cache is rebuilt (gather-RoPE-write of the
   history) and the root entry placed at slot ``n``; the root runs attention and proposes ``d_1``.
2. **Chain.** Steps j = 1..K-1 feed ``(d_j, h2)`` at local position ``n + j``.
3. **Verify.** The target runs ``[last_token, d_1..d_K]`` at positions ``length .. length + K`` in one step,
   returning logits, aux features and (DiffSpec) the scoring layer's queries and LSE.
4. **Accept.** Greedy or rejection sampling gives ``m`` accepted drafts and the bonus; ``length += m + 1``; the
   m + 1 verified entries become the next cycle's pending entries; the committed row's query and LSE are kept
   for retrieval. Hybrid targets (Qwen3.5) verify with per-position state snapshots and the family's ``commit``
   rolls their DeltaNet conv / recurrent states back to the state after the last accepted token (KV needs no
   rollback: rows beyond the committed length are masked and overwritten).

The host decides the retrieval cadence per sequence (``_RetrievalControl``) and calls the jitted ``_retrieve``
on due cycles only; everything on the device has static shapes, so nothing recompiles between cycles.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from diffspec_jax import adaptive, retrieval, sharding, tree, verification, working_cache
from pallas_kernels import dispatch
from diffspec_jax.cache import HybridCache, KVCache, create_cache, move_rows, round_capacity
from diffspec_jax.config import DraftConfig, ModelConfig, SamplingConfig, SpecConfig
from diffspec_jax.errors import ConfigError, InputError
from diffspec_jax.models import eagle3, ensure_tree_supported, family
from diffspec_jax.retrieval_control import RetrievalControl
from diffspec_jax.sampling import choose, processed_logprobs
from diffspec_jax.target import DEFAULT_PREFILL_CHUNK, TargetModel, check_token_ids, pad_prompts, plan_prefill
from diffspec_jax.models.layers import attention_dense
from diffspec_jax.working_cache import DraftCache

# ------------------------------------------------------------------------------------------------ state
@struct.dataclass
class DecodeState:
    """Everything that changes per cycle (batch-first arrays; ``rng`` is the only unbatched leaf).

    Attributes:
        target_cache: the target :class:`KVCache` (:class:`HybridCache` for hybrid targets).
        draft_cache: the draft's :class:`DraftCache` (``None`` without a draft).
        retrieval: :class:`retrieval.RetrievalState` (``diffspec`` policy only).
        length: int32 ``[B]`` committed target length: positions ``0..length-1`` are valid in the target cache.
        last_token: int32 ``[B]`` the newest emitted token, at position ``length``, not yet run by the target.
        pend_tokens: int32 ``[B, K+1]`` tokens of draft entries awaiting projection (row i at position
            ``length - pend_count + i``); pend_feats: ``[B, K+1, A*Ht]`` their target aux features;
            pend_count: int32 ``[B]`` how many rows are real (the last real row is the root, ``length - 1``).
        seq_id: int32 ``[B]`` the prompt index of each row (rows are reordered when finished ones are dropped).
        rng: the sampling key.
    """

    target_cache: KVCache | HybridCache
    draft_cache: DraftCache | None
    retrieval: retrieval.RetrievalState | None
    length: jax.Array
    last_token: jax.Array
    pend_tokens: jax.Array
    pend_feats: jax.Array
    pend_count: jax.Array
    seq_id: jax.Array
    rng: jax.Array

    def take(self, rows: np.ndarray) -> DecodeState:
        """Keep batch rows ``rows`` (compaction when sequences finish)."""
        idx = jnp.asarray(rows, jnp.int32)
        pick = lambda x: jnp.take(x, idx, axis=0)  # noqa: E731
        rng = self.rng
        return jax.tree_util.tree_map(pick, self.replace(rng=jnp.zeros((len(rows),), jnp.uint32))).replace(rng=rng)


@dataclass(frozen=True)
class Plan:
    """Static description of a run (a hashable ``jit`` static argument)."""

    target: ModelConfig
    draft: DraftConfig | None
    spec: SpecConfig
    sampling: SamplingConfig
    aux_layers: tuple[int, ...]
    capacity: int
    proposer: Callable | None = None
    mesh: Mesh | None = None
    draft_tp: int = 1
    kernels: str = "reference"  # "pallas" or "reference" (pallas_kernels.dispatch), part of the compile key

    @property
    def tp(self) -> int:
        return sharding.mesh_size(self.mesh, sharding.TP)

    @property
    def dp(self) -> int:
        return sharding.mesh_size(self.mesh, sharding.DP)

    @property
    def tp_axis(self) -> str | None:
        """Axis name for the target's collectives (``None`` without a mesh)."""
        return sharding.TP if self.mesh is not None else None

    @property
    def draft_axis(self) -> str | None:
        """Axis name for a sharded draft (``None``: the draft is replicated)."""
        return sharding.TP if self.mesh is not None and self.draft_tp > 1 else None

    @property
    def speculative(self) -> bool:
        return self.draft is not None or self.proposer is not None

    @property
    def k(self) -> int:
        return self.spec.num_speculative_tokens if self.speculative else 0

    @property
    def diffspec(self) -> bool:
        return self.draft is not None and self.spec.draft_context_policy == "diffspec"

    @property
    def score_layer(self) -> int | None:
        """Target layer whose queries/LSE are captured (``diffspec`` with the attention scorer)."""
        if self.diffspec and self.spec.diffspec_scorer == "attention":
            return self.spec.scoring_layer(self.target)
        return None

    @property
    def num_chunks(self) -> int:
        return retrieval.num_chunks(self.capacity, self.spec.diffspec_chunk_size)


def _init_state(plan: Plan, batch: int, target_dtype, draft_dtype, seed: int) -> DecodeState:
    tc, dc = plan.target, plan.draft
    feat = len(plan.aux_layers) * tc.hidden_size if dc is not None else 1
    k1 = plan.k + 1
    kv_d = sharding.kv_heads_for(dc.num_key_value_heads, plan.draft_tp, "the draft") if dc is not None else 0
    ret = None
    if plan.diffspec:
        hq = tc.num_attention_heads
        ret = retrieval.RetrievalState(
            anchors=jnp.full((batch, plan.spec.max_chunks - 1), -1, jnp.int32),
            score_q=jnp.zeros((batch, hq, tc.head_dim), jnp.float32),
            score_lse=jnp.zeros((batch, hq), jnp.float32),
            draft_q=jnp.zeros((batch, dc.num_attention_heads, dc.head_dim), jnp.float32),
            chunk_sum=(jnp.zeros((batch, plan.num_chunks, kv_d, dc.head_dim), jnp.float32)
                       if retrieval.needs_summaries(plan.spec) else None))
    return DecodeState(
        target_cache=create_cache(tc, batch, plan.capacity, target_dtype, tp=plan.tp),
        draft_cache=DraftCache.create(dc, plan.spec, batch, plan.capacity, draft_dtype, num_kv_heads=kv_d)
        if dc is not None else None,
        retrieval=ret,
        length=jnp.zeros((batch,), jnp.int32), last_token=jnp.zeros((batch,), jnp.int32),
        pend_tokens=jnp.zeros((batch, k1), jnp.int32),
        pend_feats=jnp.zeros((batch, k1, feat), target_dtype),
        pend_count=jnp.zeros((batch,), jnp.int32), seq_id=jnp.arange(batch, dtype=jnp.int32),
        rng=jax.random.PRNGKey(seed))


def _rows(x: jax.Array, row: jax.Array) -> jax.Array:
    """``x[b, row[b]]`` for x ``[B, T, ...]``, row int ``[B]`` -> ``[B, ...]``."""
    idx = row.reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.take_along_axis(x, idx, axis=1)[:, 0]


# ---------------------------------------------------------------------------------------------- prefill
@struct.dataclass
class _PrefillAcc:
    """Per-sequence values of each prompt's last position, filled by the chunk that contains it."""

    logits: jax.Array      # [B, V]
    aux: jax.Array         # [B, A*Ht]
    score_q: jax.Array     # [B, Hq, D]
    score_lse: jax.Array   # [B, Hq]


def _prefill_chunk(plan: Plan, tparams, dparams, state: DecodeState, acc: _PrefillAcc, tokens, next_tokens,
                   start, lengths):
    """Target prefill of one chunk; the draft's K/V of the chunk's entries are projected and stored."""
    b, w = tokens.shape
    last = lengths - 1
    rows = jnp.clip(last - start, 0, w - 1)[:, None]
    out, tcache = family(plan.target).step(plan.target, tparams, state.target_cache, tokens, start, rows,
                                           aux_layers=plan.aux_layers if plan.draft is not None else (),
                                           score_layer=plan.score_layer, axis_name=plan.tp_axis,
                                           num_valid=jnp.clip(lengths - start, 0, w))  # padding stays out of states
    in_chunk = (last >= start) & (last < start + w)
    sel = lambda new, old: jnp.where(in_chunk.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)  # noqa: E731
    acc = acc.replace(logits=sel(out.logits[:, 0], acc.logits))
    state = state.replace(target_cache=tcache)
    if plan.draft is not None:
        acc = acc.replace(aux=sel(_rows(out.aux, rows[:, 0]), acc.aux))
        positions = start[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]
        z, _ = eagle3.entry_inputs(plan.draft, dparams, next_tokens, out.aux, from_target=True,
                                   axis_name=plan.draft_axis)
        _, k, v = eagle3.qkv(dparams, z)
        dcache = working_cache.commit(plan.draft, plan.spec, state.draft_cache, k, v, positions)
        state = state.replace(draft_cache=dcache)
        ret = state.retrieval
        if ret is not None and ret.chunk_sum is not None:  # entry P-1 is committed later, by the first step 0
            ret = ret.replace(chunk_sum=retrieval.update_chunk_sums(
                ret.chunk_sum, k, positions, positions < last[:, None], plan.spec.diffspec_chunk_size))
            state = state.replace(retrieval=ret)
    if out.score_q is not None:
        acc = acc.replace(score_q=sel(out.score_q[:, 0], acc.score_q), score_lse=sel(out.score_lse[:, 0],
                                                                                      acc.score_lse))
    return state, acc


def _start_decode(plan: Plan, state: DecodeState, acc: _PrefillAcc, lengths):
    """Sample the first token x_P and make entry P-1 (x_P, F_{P-1}) the pending root."""
    rng, key = _split(plan, state.rng)
    first = choose(key, acc.logits, plan.sampling)
    k1 = plan.k + 1
    state = state.replace(
        rng=rng, length=lengths.astype(jnp.int32), last_token=first,
        pend_tokens=jnp.zeros_like(state.pend_tokens).at[:, 0].set(first),
        pend_feats=jnp.zeros_like(state.pend_feats).at[:, 0].set(acc.aux.astype(state.pend_feats.dtype))
        if plan.draft is not None else state.pend_feats,
        pend_count=jnp.ones_like(lengths, jnp.int32) if k1 > 1 else state.pend_count)
    if state.retrieval is not None and plan.score_layer is not None:
        state = state.replace(retrieval=state.retrieval.replace(score_q=acc.score_q, score_lse=acc.score_lse))
    return state, first


# ------------------------------------------------------------------------------------------------ draft
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
    cache = working_cache.commit(dc, spec, state.draft_cache, k, v, positions)
    ret = state.retrieval
    if ret is not None and ret.chunk_sum is not None:
        valid = (jnp.arange(k1)[None, :] < state.pend_count[:, None]) & active[:, None]
        ret = ret.replace(chunk_sum=retrieval.update_chunk_sums(ret.chunk_sum, k, positions, valid,
                                                               spec.diffspec_chunk_size))
    root = state.length - 1
    rrow = state.pend_count - 1
    q_r, k_r, v_r, res_r = (_rows(x, rrow)[:, None] for x in (q, k, v, residual))
    if ret is not None:
        ret = ret.replace(draft_q=q_r[:, 0].astype(jnp.float32))
    if spec.uses_working_cache:
        anchors = ret.anchors if plan.diffspec else None
        idx, n, window = working_cache.history_indices(anchors, root, spec.diffspec_chunk_size,
                                                       working_cache.history_slots(spec))
        cache = working_cache.gather_rope_write(dc, cache, idx)
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
    depth_max, width, num_nodes = spec.num_speculative_tokens, spec.diffspec_tree_topk, spec.diffspec_max_tree_nodes
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
    track_mass = spec.diffspec_tree_threshold > 0
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
            stopped = stopped | (new_mass - mass < spec.diffspec_tree_threshold)
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


# ------------------------------------------------------------------------------------------------ cycles
def _spec_cycle(plan: Plan, tparams, dparams, state: DecodeState, active, depth_rows=None, *,
                depth: int | None = None):
    """One draft -> verify -> accept chain cycle.

    ``depth`` (static, default K) is the chain length this compilation drafts and verifies; ``depth_rows``
    (int32 ``[B]``, optional) caps each sequence's accepted drafts below it (adaptive depth: a batch runs at its
    largest depth). Returns ``(state, emitted [B, K+1], m [B], n [B], window [B])``.
    """
    rng, k_draft, k_verify = _split(plan, state.rng, 3)
    depth = plan.k if depth is None else depth
    if plan.proposer is not None:
        drafts, q, dcache, ret, n, window = plan.proposer(plan, dparams, state, active, k_draft)
        drafts, q = drafts[:, :depth], None if q is None else q[:, :depth]
    else:
        drafts, q, dcache, ret, n, window = draft_propose(plan, dparams, state, active, k_draft, depth)
    block = jnp.concatenate([state.last_token[:, None], drafts], axis=1)
    rows = jnp.broadcast_to(jnp.arange(depth + 1, dtype=jnp.int32), block.shape)
    fam = family(plan.target)
    out, tcache = fam.step(plan.target, tparams, state.target_cache, block, state.length, rows,
                           aux_layers=plan.aux_layers if plan.draft is not None else (),
                           score_layer=plan.score_layer, axis_name=plan.tp_axis, snapshots=True)
    if plan.sampling.greedy:
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
    state, emitted, m = _accept(plan, state, active, rng, tcache, dcache, ret, out, m, emitted, path)
    return state, emitted, m, n, window


def _pad_cols(x: jax.Array, width: int) -> jax.Array:
    """Zero-pad axis 1 of ``x`` to ``width``."""
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, width - x.shape[1])
    return jnp.pad(x, pad)


def _accept(plan: Plan, state: DecodeState, active, rng, tcache, dcache, ret, out, m, emitted, path):
    """Commit ``m`` accepted tokens + the correction/bonus: lengths, pending draft entries (features of the verify
    rows ``path [B, m+1 ...]``), the scoring query of the deepest accepted row. ``emitted [B, <= K+1]``."""
    k1 = plan.k + 1
    emitted = _pad_cols(emitted, k1)
    bonus = _rows(emitted, m)
    col = jnp.arange(k1)[None, :]
    pend_tokens = jnp.where(col <= m[:, None], emitted, 0)
    keep = lambda new, old: jnp.where(active.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)  # noqa: E731
    last = _rows(path, m)
    if ret is not None and out.score_q is not None:
        ret = ret.replace(score_q=keep(_rows(out.score_q, last), ret.score_q),
                          score_lse=keep(_rows(out.score_lse, last), ret.score_lse))
    feats = state.pend_feats
    if out.aux is not None:
        feats = _pad_cols(jnp.take_along_axis(out.aux, path[:, :, None], axis=1).astype(feats.dtype), k1)
    state = state.replace(
        target_cache=tcache, draft_cache=dcache, retrieval=ret, rng=rng,
        length=keep(state.length + m + 1, state.length), last_token=keep(bonus, state.last_token),
        pend_tokens=keep(pend_tokens, state.pend_tokens), pend_feats=keep(feats, state.pend_feats),
        pend_count=keep(m + 1, state.pend_count))
    return state, emitted, m


def _tree_cycle(plan: Plan, tparams, dparams, state: DecodeState, active, caps, budget):
    """One tree cycle: draft tree -> one tree-masked target step -> walk -> move the accepted path's KV rows.

    ``caps`` int32 ``[B, K]`` and ``budget`` int32 ``[B]`` come from the host's branching and budget controllers.
    Returns ``(state, emitted [B, K+1], m [B], n [B], window [B], tree_size [B])``.
    """
    rng, _, k_verify = _split(plan, state.rng, 3)
    spec = plan.spec
    depth = plan.k
    t, dcache, ret, n, window = draft_propose_tree(plan, dparams, state, active, caps, budget)
    mask = tree.ancestry_mask(t.parents, t.valid, depth)
    rows = jnp.broadcast_to(jnp.arange(t.tokens.shape[1], dtype=jnp.int32), t.tokens.shape)
    fam = family(plan.target)
    out, tcache = fam.step(plan.target, tparams, state.target_cache, t.tokens, state.length, rows,
                           aux_layers=plan.aux_layers, score_layer=plan.score_layer, axis_name=plan.tp_axis,
                           tree=(t.depth, mask))
    if plan.sampling.greedy:
        m, path, emitted = verification.tree_greedy_accept(out.logits, t, depth)
    else:
        m, path, emitted = verification.tree_rejection_accept(
            k_verify, processed_logprobs(out.logits, plan.sampling), t, depth, spec.diffspec_tree_topk)
    m = jnp.where(active, m, 0)
    path = jnp.where(active[:, None], path, jnp.arange(depth + 1, dtype=jnp.int32)[None, :])
    tcache = move_rows(tcache, state.length, path)
    state, emitted, m = _accept(plan, state, active, rng, tcache, dcache, ret, out, m, emitted, path)
    return state, emitted, m, n, window, t.size
def _target_cycle(plan: Plan, tparams, dparams, state: DecodeState, active):
    """Autoregressive baseline: one target step on ``last_token``; same cache machinery."""
    rng, key = _split(plan, state.rng)
    rows = jnp.zeros((state.length.shape[0], 1), jnp.int32)
    out, tcache = family(plan.target).step(plan.target, tparams, state.target_cache, state.last_token[:, None],
                                           state.length, rows, axis_name=plan.tp_axis,
                                           num_valid=active.astype(jnp.int32))
    tok = choose(key, out.logits[:, 0], plan.sampling)
    zero = jnp.zeros_like(state.length)
    state = state.replace(target_cache=tcache, rng=rng, length=jnp.where(active, state.length + 1, state.length),
                          last_token=jnp.where(active, tok, state.last_token))
    return state, tok[:, None], zero, zero, zero


def _retrieve(plan: Plan, tparams, dparams, state: DecodeState, mask):
    """Score chunks and replace the selection of the sequences in ``mask`` (bool ``[B]``).

    Returns the state and each shard's anchors ``[1, B, A]`` (stacked over ``tp`` by the caller's out specs), so
    the host can check that every rank selected the same chunks.
    """
    spec, ret = plan.spec, state.retrieval
    c = spec.diffspec_chunk_size
    root = state.length - 1
    if spec.diffspec_scorer == "attention":  # each shard sums its query heads; one psum gives identical scores
        k_cache = state.target_cache.layer_keys(plan.score_layer)
        scores = dispatch.chunk_scores(ret.score_q, ret.score_lse, k_cache, root, chunk=c)
        if plan.tp_axis is not None:
            scores = jax.lax.psum(scores, plan.tp_axis)
        scores = scores / plan.target.num_attention_heads
    else:  # salience: the upcoming root entry's draft query against the chunk key summaries
        rrow = state.pend_count - 1
        z, _ = eagle3.entry_inputs(plan.draft, dparams, _rows(state.pend_tokens, rrow)[:, None],
                                   _rows(state.pend_feats, rrow)[:, None], from_target=True,
                                   axis_name=plan.draft_axis)
        q = eagle3.qkv(dparams, z)[0][:, 0].astype(jnp.float32)
        scores = retrieval.salience_scores(_gather_heads(plan, q, 1), _gather_heads(plan, ret.chunk_sum, 2), root,
                                           c)
    summaries = None if ret.chunk_sum is None else _gather_heads(plan, ret.chunk_sum, 2)
    anchors = retrieval.select_chunks(scores, root, c, spec.max_chunks, spec.diffspec_keep_sink_chunk,
                                      spec.diffspec_redundancy_weight, summaries)
    anchors = jnp.where(mask[:, None], anchors, ret.anchors)
    return state.replace(retrieval=ret.replace(anchors=anchors)), anchors[None]


def _gather_heads(plan: Plan, x: jax.Array, axis: int) -> jax.Array:
    """All heads of a sharded draft's per-head array (replicated drafts already hold them)."""
    if plan.draft_axis is None:
        return x
    return jax.lax.all_gather(x, plan.draft_axis, axis=axis, tiled=True)


def _split(plan: Plan, rng: jax.Array, n: int = 2):
    """Split the replicated key; data-parallel replicas fold in their index so their samples are independent."""
    keys = jax.random.split(rng, n)
    if plan.mesh is not None and plan.dp > 1:
        dp = jax.lax.axis_index(sharding.DP)
        return (keys[0],) + tuple(jax.random.fold_in(k, dp) for k in keys[1:])
    return tuple(keys)


# ------------------------------------------------------------------------------------------ compilation
def state_specs(plan: Plan) -> DecodeState:
    """PartitionSpecs of every :class:`DecodeState` leaf (batch over ``dp``; heads over ``tp``)."""
    dp = sharding.DP if plan.dp > 1 else None
    tp = sharding.TP
    dtp = tp if plan.draft_tp > 1 else None
    dheads = P(dp, None, dtp, None)
    dcache = None
    if plan.draft is not None:
        store = dheads if plan.spec.uses_working_cache else None
        dcache = DraftCache(work_k=dheads, work_v=dheads, store_k=store, store_v=store)
    ret = None
    if plan.diffspec:
        ret = retrieval.RetrievalState(anchors=P(dp, None), score_q=P(dp, tp, None), score_lse=P(dp, tp),
                                       draft_q=P(dp, dtp, None),
                                       chunk_sum=dheads if retrieval.needs_summaries(plan.spec) else None)
    return DecodeState(target_cache=family(plan.target).cache_specs(plan.target, dp, tp), draft_cache=dcache,
                       retrieval=ret,
                       length=P(dp), last_token=P(dp), pend_tokens=P(dp, None), pend_feats=P(dp, None, None),
                       pend_count=P(dp), seq_id=P(dp), rng=P())


def _spec_tree(key):
    return None if key is None else jax.tree_util.tree_unflatten(key[0], key[1])


def param_spec_key(params) -> tuple | None:
    """A hashable description of how ``params`` are sharded (its tree and each leaf's PartitionSpec)."""
    if params is None:
        return None
    leaves, treedef = jax.tree_util.tree_flatten(params)
    return treedef, tuple(x.sharding.spec for x in leaves)


@functools.lru_cache(maxsize=64)
def compiled(plan: Plan, tspec_key=None, dspec_key=None) -> SimpleNamespace:
    """The jitted steps of ``plan``: plain ``jit`` without a mesh, ``jit(shard_map(...))`` with one. Cached per
    plan, so repeated :func:`generate` calls reuse the compilations.

    ``cycle(tparams, dparams, state, active)`` is the K-deep chain (or target-only) cycle; ``cycle_at(d)`` the
    d-deep chain taking per-sequence depths (adaptive depth; compiled once per depth used);
    ``tree_cycle(tparams, dparams, state, active, caps, budget)`` the tree cycle.
    """
    dp = sharding.DP if plan.dp > 1 else None
    tp = sharding.TP
    row, rows2 = P(dp), P(dp, None)

    def make(fn, donate, ins, outs):
        if plan.mesh is None:
            return jax.jit(functools.partial(fn, plan), donate_argnums=(donate,))
        mapped = jax.shard_map(functools.partial(fn, plan), mesh=plan.mesh, in_specs=ins, out_specs=outs,
                               check_vma=False)
        return jax.jit(mapped, donate_argnums=(donate,))

    st = state_specs(plan) if plan.mesh is not None else None
    tparams, dparams = _spec_tree(tspec_key), _spec_tree(dspec_key)
    acc = _PrefillAcc(logits=rows2, aux=rows2, score_q=P(dp, tp, None), score_lse=P(dp, tp))
    cycle_out = (st, rows2, row, row, row)
    out = SimpleNamespace(
        prefill_chunk=make(_prefill_chunk, 2, (tparams, dparams, st, acc, rows2, rows2, row, row), (st, acc)),
        start_decode=make(_start_decode, 0, (st, acc, row), (st, row)),
        retrieve=make(_retrieve, 2, (tparams, dparams, st, row), (st, P(tp, dp, None))),
        cycle=make(_spec_cycle if plan.speculative else _target_cycle, 2, (tparams, dparams, st, row), cycle_out))
    out.cycle_at = functools.lru_cache(maxsize=None)(
        lambda d: make(functools.partial(_spec_cycle, depth=d), 2, (tparams, dparams, st, row, row), cycle_out))
    if plan.speculative and plan.spec.tree:
        out.tree_cycle = make(_tree_cycle, 2, (tparams, dparams, st, row, rows2, row), cycle_out + (row,))
    return out


def init_state(plan: Plan, batch: int, target_dtype, draft_dtype, seed: int) -> DecodeState:
    """A zeroed :class:`DecodeState`, created directly with its shardings when the plan has a mesh."""
    make = functools.partial(_init_state, plan, batch, target_dtype, draft_dtype, seed)
    if plan.mesh is None:
        return make()
    return jax.jit(make, out_shardings=sharding.named(state_specs(plan), plan.mesh))()


# ------------------------------------------------------------------------------------------- host side
class _RetrievalControl(RetrievalControl):
    """The engine's view: one counter set per prompt, reported as ``{"aggregate", "per_sequence"}``."""

    def status(self, real: int | None = None) -> dict[str, Any]:
        idx = list(range(len(self.c) if real is None else real))
        return {"aggregate": self.aggregate(idx), "per_sequence": [self.c[i].report() for i in idx]}


class _ShapeControl:
    """Host side of the draft's shape per sequence: adaptive chain depth, or the tree's branching caps and node
    budget (:mod:`diffspec_jax.adaptive`); picks the compiled cycle and feeds it per-row inputs."""

    def __init__(self, plan: Plan, lengths: np.ndarray):
        spec, n = plan.spec, len(lengths)
        self.k, self.nodes = plan.k, spec.diffspec_max_tree_nodes
        self.tree = plan.speculative and spec.tree
        self.adaptive = plan.speculative and spec.diffspec_adaptive_profile
        self.histogram = [0] * (self.k + 1)
        self.drafted = 0
        self.tree_nodes = 0
        self._size = self._depths = None
        if self.tree:
            self.caps = [adaptive.make_caps_controller(spec.diffspec_tree_branching, self.k, spec.diffspec_tree_topk)
                         for _ in range(n)]
            self.budget = [adaptive.NodeBudget(spec.diffspec_max_tree_nodes, self.k) if self.adaptive else None
                           for _ in range(n)]
        elif self.adaptive:
            self.depth = [adaptive.AdaptiveDepth(self.k, spec.diffspec_long_context_threshold,
                                                 spec.diffspec_long_context_depth) for _ in range(n)]
            for d, length in zip(self.depth, lengths):
                d.start(int(length))

    def run(self, fns, tparams, dparams, state, live: np.ndarray, rows: np.ndarray):
        """One cycle of the right compiled kind; returns ``(state, emitted, m, n, window)``."""
        act = jnp.asarray(live)
        if self.tree:
            caps = np.stack([self.caps[s].caps() for s in rows]).astype(np.int32)
            budget = np.array([self.nodes if self.budget[s] is None else self.budget[s].budget for s in rows],
                              np.int32)
            state, emitted, m, n, window, size = fns.tree_cycle(tparams, dparams, state, act, jnp.asarray(caps),
                                                                jnp.asarray(budget))
            self._size = np.asarray(size)
            return state, emitted, m, n, window
        if self.adaptive:
            self._depths = np.array([self.depth[s].depth for s in rows], np.int32)
            top = int(self._depths[live].max()) if live.any() else self.k
            return fns.cycle_at(top)(tparams, dparams, state, act, jnp.asarray(self._depths))
        return fns.cycle(tparams, dparams, state, act)

    def observe(self, row: int, seq: int, m: int, length: int) -> None:
        """Book sequence ``seq``'s verification (device row ``row``): ``m`` accepted drafts, committed ``length``."""
        if not self.k:
            return
        self.histogram[m] += 1
        if self.tree:
            self.caps[seq].record(m)
            if self.budget[seq] is not None:
                self.budget[seq].observe(m)
            self.tree_nodes += int(self._size[row])
            self.drafted += int(self._size[row])
        elif self.adaptive:
            self.drafted += int(self._depths[row])
            self.depth[seq].observe(m + 1, length)
        else:
            self.drafted += self.k

    def report(self, real: int) -> dict[str, Any] | None:
        if self.tree:
            return {"per_sequence": [{"branching": self.caps[i].snapshot(),
                                      "node_budget": self.budget[i].snapshot() if self.budget[i] else None}
                                     for i in range(real)]}
        if self.adaptive:
            return {"per_sequence": [{"depth": d.depth, "floor": d.floor} for d in self.depth[:real]]}
        return None


@dataclass
class GenerateStats:
    """Statistics of one :func:`generate` call (``dataclasses.asdict`` / :meth:`to_dict` give a dict).

    ``mean_acceptance_length`` counts tokens emitted per verification (accepted drafts + 1), over all sequences;
    ``acceptance_length_per_sequence[i]`` is the same for prompt i alone (None for a prompt that had no
    verification);
    ``acceptance_per_position[i]`` counts verifications that accepted draft position i (tree: depth i + 1);
    ``accepted_depth_histogram[d]`` counts verifications that accepted exactly d drafts; ``drafted_tokens`` counts
    drafted tokens that could be accepted (chain depth, or tree nodes); ``mean_tree_size`` is the mean number of
    tree nodes per verification (tree mode); ``drafting`` holds the per-sequence controllers' final state
    (adaptive depth, or the tree's branching profile and node budget).
    """

    num_sequences: int = 0
    new_tokens: int = 0
    num_speculative_tokens: int = 0
    draft_context_policy: str | None = None
    cycles: int = 0
    sequence_cycles: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    mean_acceptance_length: float | None = None
    acceptance_length_per_sequence: list[float | None] = field(default_factory=list)
    acceptance_per_position: list[int] = field(default_factory=list)
    verification_mode: str | None = None
    accepted_depth_histogram: list[int] = field(default_factory=list)
    mean_tree_size: float | None = None
    drafting: dict[str, Any] | None = None
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens_per_s: float | None = None
    retrieval: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class GenerateResult:
    """``tokens``: the generated ids per prompt (prompt excluded); ``stats``: :class:`GenerateStats`."""

    tokens: list[list[int]]
    stats: GenerateStats


def _validate(target: TargetModel, draft, prompts, max_new_tokens: int, spec: SpecConfig,
              sampling: SamplingConfig) -> list[list[int]]:
    if not isinstance(spec, SpecConfig):
        raise ConfigError(f"spec must be a SpecConfig, got {type(spec).__name__}")
    if not isinstance(sampling, SamplingConfig):
        raise ConfigError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise InputError("prompts must be a non-empty list of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)):
            raise InputError(f"prompt {i} is text; pass token ids (tokenize first)")
        if len(p) == 0:
            raise InputError(f"prompt {i} is empty; every prompt needs at least one token")
        out.append([int(t) for t in check_token_ids(p, target.config.vocab_size, f"prompt {i}")])
    if draft is not None:
        if draft.config.vocab_size != target.config.vocab_size:
            raise ConfigError(f"vocabulary mismatch: draft vocab_size {draft.config.vocab_size} vs target "
                              f"{target.config.vocab_size}")
        draft.config.resolve_aux_layers(target.config)
        if spec.draft_context_policy == "diffspec":
            spec.scoring_layer(target.config)
        if spec.tree:
            ensure_tree_supported(target.config)
    return out


def generate(target: TargetModel, draft, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             spec: SpecConfig = SpecConfig(), sampling: SamplingConfig = SamplingConfig(), seed: int = 0,
             stop_token_ids: Sequence[int] | None = None, max_cache_len: int | None = None,
             prefill_chunk: int = DEFAULT_PREFILL_CHUNK, on_tokens: Callable[[int, list[int]], None] | None = None,
             progress: bool = False, proposer: Callable | None = None, mesh: Mesh | None = None) -> GenerateResult:
    """Generate continuations of ``prompts`` with speculative decoding (or the target alone when ``draft=None``).

    Args:
        target: from :func:`diffspec_jax.load_target`; draft: from :func:`diffspec_jax.load_draft` or ``None``.
        prompts: a list of token-id lists (lengths may differ).
        max_new_tokens: exactly this many tokens per prompt unless a stop token comes first.
        spec: :class:`SpecConfig` (K, draft context policy, DiffSpec settings); ignored without a draft.
        sampling: :class:`SamplingConfig` (temperature 0 = greedy).
        seed: sampling seed.
        stop_token_ids: generation of a sequence stops after one of these (default: the target's EOS ids;
            ``()`` never stops early).
        max_cache_len: cache capacity per sequence (default: the longest prompt + max_new_tokens + K + 1).
        on_tokens: called as ``on_tokens(i, new_ids)`` whenever prompt i gains tokens (streaming).
        progress: show a progress bar on stderr.
        proposer: a custom draft function with the signature of :func:`draft_propose` (tests use an oracle).
        mesh: a ``("dp", "tp")`` mesh from :func:`diffspec_jax.make_mesh` for tensor (and data) parallelism;
            the draft is sharded like the target or replicated per ``spec.draft_tensor_parallel_size``.
    Returns:
        :class:`GenerateResult` with ``.tokens`` and ``.stats``.
    Raises:
        InputError / ConfigError for bad input (empty prompt, prompt longer than the cache, ...).
    """
    prompts = _validate(target, draft, prompts, max_new_tokens, spec, sampling)
    tc = target.config
    speculative = draft is not None or proposer is not None
    if proposer is not None and spec.tree:
        raise ConfigError("a custom proposer drafts chains; it cannot be combined with diffspec_verification_mode="
                          "'tree'")
    k = spec.num_speculative_tokens if speculative else 0
    if spec.tree and speculative:
        k_block = spec.diffspec_max_tree_nodes  # the tree block occupies max_tree_nodes + 1 cache rows
    else:
        k_block = k
    lengths = np.array([len(p) for p in prompts], np.int32)
    need = int(lengths.max()) + max_new_tokens + k_block + 1
    if need - k_block - 1 > tc.max_position_embeddings:
        raise InputError(f"the longest prompt ({lengths.max()} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"the target's context window (max_position_embeddings {tc.max_position_embeddings})")
    if max_cache_len is not None and max_cache_len < need:
        raise InputError(f"the longest prompt ({lengths.max()} tokens) + max_new_tokens ({max_new_tokens}) + "
                         f"{'max_tree_nodes' if k_block != k else 'K'} + 1 = {need} positions exceed the cache "
                         f"capacity max_cache_len={max_cache_len}")
    draft_tp = 1
    if mesh is not None and draft is not None:
        tp = sharding.mesh_size(mesh, sharding.TP)
        draft_tp = tp if spec.draft_tensor_parallel_size is None else spec.draft_tensor_parallel_size
        if draft_tp not in (1, tp):
            raise ConfigError(f"draft_tensor_parallel_size must be 1 (replicated draft) or the target's tp={tp}, "
                              f"got {draft_tp}")
    plan = Plan(target=tc, draft=draft.config if draft is not None else None, spec=spec, sampling=sampling,
                aux_layers=draft.aux_layers if draft is not None else (),
                capacity=round_capacity(max_cache_len or need), proposer=proposer, mesh=mesh, draft_tp=draft_tp,
                kernels=dispatch.kernel_backend())
    stops = set(tc.eos_token_ids if stop_token_ids is None else stop_token_ids)
    tparams, dparams = prepare_params(target, draft, mesh, draft_tp)
    fns = compiled(plan, param_spec_key(tparams) if mesh is not None else None,
                   param_spec_key(dparams) if mesh is not None else None)
    real = len(prompts)
    if plan.dp > 1 and real % plan.dp:  # pad the batch to a multiple of the data-parallel axis with dummy rows
        prompts = prompts + [prompts[0]] * (plan.dp - real % plan.dp)
        lengths = np.array([len(p) for p in prompts], np.int32)
    batch = len(prompts)
    stats = GenerateStats(num_sequences=real, num_speculative_tokens=k,
                          draft_context_policy=spec.draft_context_policy if draft is not None else None,
                          acceptance_per_position=[0] * k)
    ctl = _RetrievalControl(spec, batch) if plan.diffspec else None
    shape = _ShapeControl(plan, lengths)
    stats.verification_mode = "tree" if shape.tree else "linear" if speculative else None

    t0 = time.perf_counter()
    state = init_state(plan, batch, target.dtype, dparams["fc"].dtype if dparams else target.dtype, seed)
    width, n_chunks = plan_prefill(lengths, prefill_chunk)
    tokens = pad_prompts(prompts, width * n_chunks + 1)
    acc = _PrefillAcc(logits=jnp.zeros((batch, tc.vocab_size), jnp.float32),
                      aux=jnp.zeros((batch, max(1, len(plan.aux_layers) * tc.hidden_size)), target.dtype),
                      score_q=jnp.zeros((batch, tc.num_attention_heads, tc.head_dim), jnp.float32),
                      score_lse=jnp.zeros((batch, tc.num_attention_heads), jnp.float32))
    jl = jnp.asarray(lengths)
    for c in range(n_chunks):
        s = c * width
        state, acc = fns.prefill_chunk(tparams, dparams, state, acc, jnp.asarray(tokens[:, s:s + width]),
                                       jnp.asarray(tokens[:, s + 1:s + width + 1]),
                                       jnp.full((batch,), s, jnp.int32), jl)
    state, first = fns.start_decode(state, acc, jl)
    first = np.asarray(first)
    out: list[list[int]] = [[] for _ in range(batch)]
    done = np.arange(batch) >= real
    host_len = lengths.astype(np.int64).copy()

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=real * max_new_tokens, unit="tok", leave=False)

    def emit(seq: int, toks) -> None:
        added = []
        for t in toks:
            if done[seq]:
                break
            out[seq].append(int(t))
            added.append(int(t))
            if int(t) in stops or len(out[seq]) >= max_new_tokens:
                done[seq] = True
        if added:
            if on_tokens is not None:
                on_tokens(seq, added)
            if bar is not None:
                bar.update(len(added))

    for b in range(real):
        emit(b, [first[b]])
    if ctl is not None:
        state = _retrieve_after_prefill(plan, fns, ctl, tparams, dparams, state, host_len, real)
    jax.block_until_ready(state.length)
    stats.prefill_s = time.perf_counter() - t0

    t1 = time.perf_counter()
    rows = np.arange(batch)  # device row -> sequence
    seq_cycles, seq_accepted = np.zeros(batch, np.int64), np.zeros(batch, np.int64)
    while not done.all():
        live = ~done[rows]
        size = 1 << (int(live.sum()) - 1).bit_length()
        size = -(-size // plan.dp) * plan.dp
        if size <= len(rows) // 2:  # compact: finished sequences stop costing work
            keep = rows[live]
            fill = [r for r in range(len(rows)) if not live[r]][: size - len(keep)]
            order = np.concatenate([np.nonzero(live)[0], np.array(fill, np.int64)]).astype(np.int64)
            state = state.take(order)
            rows = rows[order]
            live = ~done[rows]
        state, emitted, m, n, window = shape.run(fns, tparams, dparams, state, live, rows)
        emitted, m, n, window = (np.asarray(x) for x in (emitted, m, n, window))
        stats.cycles += 1
        due = np.zeros(len(rows), bool)
        for r, seq in enumerate(rows):
            if not live[r]:
                continue
            seq_cycles[seq] += 1
            if k:
                seq_accepted[seq] += int(m[r])
                for i in range(int(m[r])):
                    stats.acceptance_per_position[i] += 1
            host_len[seq] += int(m[r]) + 1
            shape.observe(r, seq, int(m[r]), int(host_len[seq]))
            emit(seq, emitted[r, : int(m[r]) + 1])
            if ctl is not None:
                ctl.observe(seq, emitted=int(m[r]) + 1, working_len=int(n[r]), window=int(window[r]))
                due[r] = ctl.due(seq, int(host_len[seq]) - 1)
        if ctl is not None and due.any():
            state = _timed_retrieve(fns, ctl, tparams, dparams, state, due, rows, host_len, after_prefill=False)
    jax.block_until_ready(state.length)
    stats.decode_s = time.perf_counter() - t1
    if bar is not None:
        bar.close()
    stats.new_tokens = sum(len(o) for o in out)
    stats.sequence_cycles, stats.accepted_tokens = int(seq_cycles.sum()), int(seq_accepted.sum())
    stats.drafted_tokens = shape.drafted
    stats.accepted_depth_histogram = shape.histogram
    stats.mean_tree_size = shape.tree_nodes / stats.sequence_cycles if shape.tree and stats.sequence_cycles else None
    stats.drafting = shape.report(real)
    if stats.sequence_cycles:
        stats.mean_acceptance_length = (stats.accepted_tokens + stats.sequence_cycles) / stats.sequence_cycles
    stats.acceptance_length_per_sequence = [float((a + c) / c) if c else None
                                            for a, c in zip(seq_accepted[:real], seq_cycles[:real])]
    decoded = stats.new_tokens - real  # the first token of each sequence comes from prefill
    stats.decode_tokens_per_s = decoded / stats.decode_s if stats.decode_s > 0 and decoded > 0 else None
    if ctl is not None:
        stats.retrieval = ctl.status(real)
    return GenerateResult(tokens=out[:real], stats=stats)


def prepare_params(target: TargetModel, draft, mesh: Mesh | None, draft_tp: int = 1):
    """Params as the plan needs them: unchanged without a mesh; otherwise in tensor-parallel layout on the mesh
    (memoised per model and mesh, see :func:`sharding.prepare`)."""
    if mesh is None:
        return target.params, draft.params if draft is not None else None
    tparams = sharding.prepare(target, mesh, sharding.mesh_size(mesh, sharding.TP))
    return tparams, sharding.prepare(draft, mesh, draft_tp) if draft is not None else None


def _timed_retrieve(fns, ctl, tparams, dparams, state, mask, rows, host_len, *, after_prefill):
    t = time.perf_counter()
    state, anchors = fns.retrieve(tparams, dparams, state, jnp.asarray(mask))
    anchors = np.asarray(anchors)  # [ranks, B, A]: every tensor-parallel rank's selection
    ms = (time.perf_counter() - t) * 1e3 / max(1, int(mask.sum()))
    for r in np.nonzero(mask)[0]:
        ctl.record(int(rows[r]), anchors[:, r], int(host_len[rows[r]]) - 1, ms, after_prefill)
    return state


def _retrieve_after_prefill(plan, fns, ctl, tparams, dparams, state, host_len, real):
    """DiffSpec's retrieval right after prefill, from the last prompt position's query (when switched on)."""
    if not plan.spec.diffspec_retrieve_after_prefill:
        for i in range(real):
            ctl.skip_prefill(i)
        return state
    mask = np.array([b < real and not ctl.fits(int(host_len[b]) - 1) for b in range(len(host_len))])
    if mask.any():
        state = _timed_retrieve(fns, ctl, tparams, dparams, state, mask, np.arange(len(host_len)), host_len,
                                after_prefill=True)
    return state
