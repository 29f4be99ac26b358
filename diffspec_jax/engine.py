"""The decoding engine: prefill, the draft -> verify -> accept cycle, retrieval, the device decode loop and
``generate()``.

Data path of one chain cycle (``_spec_cycle``, a pure function of ``(params, state, inputs)``):

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

The device loop (``_block``, one jitted ``lax.while_loop``, state donated) runs up to ``block_cycles`` cycles per
dispatch. Per cycle and sequence it also: appends the emitted tokens to the block's output buffer and ends the
sequence at a stop id or at its token limit (:class:`LoopState` ``done`` / ``count`` / ``limit``); counts cycles,
accepted and drafted tokens and the accepted-depth histogram (:class:`BlockOut`); keeps the adaptive chain depth
(:class:`DepthControl`, an exact integer mirror of :class:`diffspec_jax.adaptive.AdaptiveDepth`); and decides the
DiffSpec retrieval cadence (:class:`Cadence`, an exact integer mirror of
:class:`diffspec_jax.retrieval_control.RetrievalControl`), running the retrieval under ``lax.cond`` on the cycles
where a sequence is due. The loop ends when every sequence is done or the block's cycle budget is spent.

The host (``generate``) reads each block's :class:`BlockOut` once, after it has dispatched the next block (the
device never waits for Python): it streams the new tokens, replays the per-cycle :class:`CycleRecord` into the
host controllers (the retrieval counters of ``stats.retrieval``, the adaptive-depth and tree controllers' reports)
and, between blocks, drops finished sequences from the batch (compaction). Tree mode's branching caps and node
budget stay on the host (:class:`_ShapeControl`; their float statistics are not mirrored on the device): they are
inputs of a block, fixed during it. When they change from cycle to cycle (``hazard`` branching, or the adaptive
node budget) the default block is one cycle with no block in flight ahead, so their trajectories are today's,
cycle by cycle; an explicit ``block_cycles > 1`` there updates them between blocks instead.

Everything on the device has static shapes, so nothing recompiles between cycles or blocks; the programs are
compiled ahead of time once per shape (:class:`_Program`, their time reported as ``GenerateStats.compile_s``), the
cache capacity is bucketed (:func:`capacity_bucket`) so nearby prompt lengths share programs, and JAX's persistent
compilation cache is switched on at the first ``generate()`` call (:func:`enable_compilation_cache`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from diffspec_jax import adaptive, retrieval, sharding, tree, verification, working_cache
from pallas_kernels import dispatch
from diffspec_jax.cache import ATTENTION_TILE, HybridCache, KVCache, create_cache, move_rows, round_capacity
from diffspec_jax.config import DraftConfig, ModelConfig, SamplingConfig, SpecConfig
from diffspec_jax.errors import ConfigError, InputError
from diffspec_jax.models import eagle3, ensure_tree_supported, family
from diffspec_jax.retrieval_control import (ADAPTIVE_ACCEPT_FACTOR, ADAPTIVE_JACCARD, ADAPTIVE_MAX_INTERVAL,
                                            RetrievalControl, ratio)
from diffspec_jax.sampling import choose, processed_logprobs
from diffspec_jax.target import DEFAULT_PREFILL_CHUNK, TargetModel, check_token_ids, pad_prompts, plan_prefill
from diffspec_jax.models.layers import attention_dense
from diffspec_jax.working_cache import DraftCache

#: cycles per device-loop block (``generate(block_cycles=None)``): the host reads results, streams tokens and
#: updates the progress bar once per block, so streaming latency is at most this many cycles (about 0.1 s at 64K
#: context on an H200), while the host's per-block work (a few ms) hides behind the block in flight
DEFAULT_BLOCK_CYCLES = 16
#: stop ids are passed as a static-size int32 array padded with -1 to a multiple of this (no recompiles for a
#: different stop set of similar size)
STOP_IDS_MULTIPLE = 8
#: the environment variable naming JAX's persistent compilation cache directory (``0``: leave the cache off)
COMPILATION_CACHE_ENV = "DIFFSPEC_COMPILATION_CACHE"
#: programs that take at least this long to compile are written to the persistent cache (JAX's default is 1 s)
CACHE_MIN_COMPILE_SECS = 0.1


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

    @property
    def tree_mode(self) -> bool:
        """Tree drafting and verification."""
        return self.speculative and self.spec.tree

    @property
    def adaptive_depth(self) -> bool:
        """Adaptive chain depth (chain mode with ``diffspec_adaptive_profile``), kept on the device."""
        return self.speculative and not self.spec.tree and self.spec.diffspec_adaptive_profile

    @property
    def host_shaped(self) -> bool:
        """Tree mode whose branching caps or node budget change between cycles (host controllers)."""
        return self.tree_mode and (self.spec.diffspec_tree_branching == "hazard" or self.spec.diffspec_adaptive_profile)

    @property
    def records(self) -> bool:
        """Whether a block returns its per-cycle :class:`CycleRecord` (some host controller replays it)."""
        return self.diffspec or self.tree_mode or self.adaptive_depth


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


# --------------------------------------------------------------------------------------------- retrieval
def _select_anchors(plan: Plan, tparams, dparams, state: DecodeState) -> jax.Array:
    """Score the chunks of every sequence's context and select its anchors, int32 ``[B, A]`` (``A = Nmax - 1``)."""
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
    return retrieval.select_chunks(scores, root, c, spec.max_chunks, spec.diffspec_keep_sink_chunk,
                                   spec.diffspec_redundancy_weight, summaries)


def _retrieve(plan: Plan, tparams, dparams, state: DecodeState, mask):
    """Score chunks and replace the selection of the sequences in ``mask`` (bool ``[B]``).

    Returns the state and each shard's anchors ``[1, B, A]`` (stacked over ``tp`` by the caller's out specs), so
    the host can check that every rank selected the same chunks.
    """
    ret = state.retrieval
    anchors = jnp.where(mask[:, None], _select_anchors(plan, tparams, dparams, state), ret.anchors)
    return state.replace(retrieval=ret.replace(anchors=anchors)), anchors[None]


# ------------------------------------------------------------------------------------------- device loop
@struct.dataclass
class Cadence:
    """The DiffSpec retrieval cadence per sequence on the device: an exact integer mirror of
    :class:`diffspec_jax.retrieval_control.RetrievalCounters`' private fields (all ``[B]`` unless noted).

    Attributes:
        since: int32 cycles since the last retrieval; interval: int32 the current interval.
        accept_sum, accept_n: int32 emitted tokens (m + 1) and verifications since the last retrieval.
        prev_sum, prev_n: int32 the same over the period before the last retrieval (``prev_n == 0``: none yet).
        selected: bool ``[B, Nc]`` the chunk set of the last retrieval (anchors + the newest chunk; all False before
            the first).
    """

    since: jax.Array
    interval: jax.Array
    accept_sum: jax.Array
    accept_n: jax.Array
    prev_sum: jax.Array
    prev_n: jax.Array
    selected: jax.Array


@struct.dataclass
class DepthControl:
    """Adaptive chain depth per sequence on the device, an exact integer mirror of
    :class:`diffspec_jax.adaptive.AdaptiveDepth`: int32 ``[B]`` ``depth`` (the next cycle's), ``floor``, and the
    runs of ``good`` and ``bad`` cycles."""

    depth: jax.Array
    floor: jax.Array
    good: jax.Array
    bad: jax.Array


@struct.dataclass
class LoopState:
    """Per-sequence decode-loop state carried from block to block beside :class:`DecodeState` (batch-first).

    Attributes:
        done: bool ``[B]`` the sequence has ended (stop id, token limit, or a padding row).
        count: int32 ``[B]`` tokens emitted so far (the prefill's first token included).
        limit: int32 ``[B]`` the sequence's token limit (``max_new_tokens``; 0 for padding rows).
        cadence: :class:`Cadence` (``diffspec`` policy only); depth: :class:`DepthControl` (adaptive chain depth).
    """

    done: jax.Array
    count: jax.Array
    limit: jax.Array
    cadence: Cadence | None = None
    depth: DepthControl | None = None

    def take(self, rows: np.ndarray) -> LoopState:
        """Keep batch rows ``rows`` (compaction)."""
        idx = jnp.asarray(rows, jnp.int32)
        return jax.tree_util.tree_map(lambda x: jnp.take(x, idx, axis=0), self)


@struct.dataclass
class CycleRecord:
    """What each cycle of a block decided, for the host controllers to replay (``[C, B]`` unless noted; rows of
    cycles past ``BlockOut.steps`` are zero).

    Attributes:
        live: bool, the row was verified this cycle; m: int32 accepted drafts.
        n, window: int32 the draft's history length and rolling-window tokens (``diffspec``).
        due: bool, the row retrieved after this cycle (``diffspec``).
        anchors: int32 ``[ranks, C, B, A]`` every tensor-parallel rank's anchors after the cycle (``diffspec``).
        depth: int32 the chain depth the row drafted (adaptive depth).
    """

    live: jax.Array
    m: jax.Array
    n: jax.Array | None = None
    window: jax.Array | None = None
    due: jax.Array | None = None
    anchors: jax.Array | None = None
    depth: jax.Array | None = None


@struct.dataclass
class BlockOut:
    """A block's results, read by the host once per block (batch rows as in the block's input).

    Attributes:
        tokens: int32 ``[B, C * (K + 1)]`` tokens emitted during the block (the first ``new[b]`` of row b).
        new: int32 ``[B]``; done: bool ``[B]`` (after the block).
        cycles, accepted, drafted: int32 ``[B]`` verifications of the row, accepted drafts and drafted tokens (chain
            depth or tree nodes) during the block; hist: int32 ``[B, K + 1]`` verifications by accepted drafts.
        steps: int32 ``[]`` loop iterations (batch cycles) run.
        record: :class:`CycleRecord` or ``None`` (no host controller needs one).
    """

    tokens: jax.Array
    new: jax.Array
    done: jax.Array
    cycles: jax.Array
    accepted: jax.Array
    drafted: jax.Array
    hist: jax.Array
    steps: jax.Array
    record: CycleRecord | None = None


def _any_global(plan: Plan, x: jax.Array) -> jax.Array:
    """``any(x)`` over the whole batch (every data-parallel replica agrees, so they all branch alike)."""
    y = jnp.any(x)
    if plan.mesh is not None and plan.dp > 1:
        y = jax.lax.psum(y.astype(jnp.int32), sharding.DP) > 0
    return y


def _max_global(plan: Plan, x: jax.Array) -> jax.Array:
    y = jnp.max(x)
    if plan.mesh is not None and plan.dp > 1:
        y = jax.lax.pmax(y, sharding.DP)
    return y


def _block_out_init(plan: Plan, b: int, cycles: int) -> BlockOut:
    k1 = plan.k + 1
    zb = jnp.zeros((b,), jnp.int32)
    zc = jnp.zeros((cycles, b), jnp.int32)
    rec = None
    if plan.records:
        rec = CycleRecord(live=jnp.zeros((cycles, b), bool), m=zc)
        if plan.diffspec:
            rec = rec.replace(n=zc, window=zc, due=jnp.zeros((cycles, b), bool),
                              anchors=jnp.zeros((cycles, b, plan.spec.max_chunks - 1), jnp.int32))
        if plan.adaptive_depth:
            rec = rec.replace(depth=zc)
    return BlockOut(tokens=jnp.zeros((b, cycles * k1), jnp.int32), new=zb, done=jnp.zeros((b,), bool), cycles=zb,
                    accepted=zb, drafted=zb, hist=jnp.zeros((b, k1), jnp.int32), steps=jnp.zeros((), jnp.int32),
                    record=rec)


def _spec_cycle_at(plan: Plan, depth: int, tparams, dparams, state, active, depth_rows):
    return _spec_cycle(plan, tparams, dparams, state, active, depth_rows, depth=depth)


def _loop_cycle(plan: Plan, tparams, dparams, state: DecodeState, active, depths, caps, budget):
    """The plan's cycle: ``(state, emitted [B, K+1], m [B], n [B], window [B], drafted [B])``. Adaptive depth runs
    the batch at its largest depth (``lax.switch`` over the K compiled depths)."""
    if not plan.speculative:
        state, emitted, m, n, window = _target_cycle(plan, tparams, dparams, state, active)
        return state, emitted, m, n, window, jnp.zeros_like(m)
    if plan.spec.tree:
        state, emitted, m, n, window, size = _tree_cycle(plan, tparams, dparams, state, active, caps, budget)
        return state, emitted, m, n, window, size
    if depths is not None:
        top = _max_global(plan, jnp.where(active, depths, 1))
        branches = [functools.partial(_spec_cycle_at, plan, d) for d in range(1, plan.k + 1)]
        state, emitted, m, n, window = jax.lax.switch(top - 1, branches, tparams, dparams, state, active, depths)
        return state, emitted, m, n, window, depths
    state, emitted, m, n, window = _spec_cycle(plan, tparams, dparams, state, active)
    return state, emitted, m, n, window, jnp.full_like(m, plan.k)


def _emit(loop: LoopState, out: BlockOut, active, emitted, m, stops) -> tuple[LoopState, BlockOut]:
    """Append each active row's ``m + 1`` emitted tokens to the block's buffer, up to and including the first stop
    id or the token that reaches the row's limit (which end the row)."""
    b, k1 = emitted.shape
    j = jnp.arange(k1, dtype=jnp.int32)[None, :]
    valid = active[:, None] & (j <= m[:, None])
    is_stop = jnp.any(emitted[:, :, None] == stops[None, None, :], axis=-1)
    ends = valid & (is_stop | (j + 1 >= (loop.limit - loop.count)[:, None]))
    ended = jnp.any(ends, axis=1)
    take = jnp.where(ended, jnp.argmax(ends, axis=1).astype(jnp.int32) + 1, m + 1)
    take = jnp.where(active, take, 0)
    width = out.tokens.shape[1]
    cols = jnp.where(j < take[:, None], out.new[:, None] + j, width)  # past the buffer: dropped
    tokens = out.tokens.at[jnp.arange(b)[:, None], cols].set(emitted, mode="drop")
    loop = loop.replace(count=loop.count + take, done=loop.done | (active & ended))
    return loop, out.replace(tokens=tokens, new=out.new + take)


def _count(plan: Plan, out: BlockOut, active, m, drafted) -> BlockOut:
    a = active.astype(jnp.int32)
    out = out.replace(cycles=out.cycles + a, accepted=out.accepted + jnp.where(active, m, 0),
                      drafted=out.drafted + jnp.where(active, drafted, 0))
    if plan.k:
        out = out.replace(hist=out.hist + jax.nn.one_hot(m, plan.k + 1, dtype=jnp.int32) * a[:, None])
    return out


def _depth_observe(plan: Plan, dc: DepthControl, active, m, length) -> DepthControl:
    """:meth:`diffspec_jax.adaptive.AdaptiveDepth.observe` for the active rows, in integers: the accepted share
    ``m / depth`` is compared with the decimal thresholds as fractions (exactly what the float test decides)."""
    spec, k = plan.spec, plan.k
    floor = jnp.where(length >= spec.diffspec_long_context_threshold, spec.diffspec_long_context_depth, k)
    gn, gd = ratio(adaptive.DEPTH_GOOD_FRAC)
    bn, bd = ratio(adaptive.DEPTH_BAD_FRAC)
    good_c = m * gd >= gn * dc.depth
    bad_c = m * bd <= bn * dc.depth
    good = jnp.where(good_c, dc.good + 1, 0)
    bad = jnp.where(good_c, 0, jnp.where(bad_c, dc.bad + 1, 0))
    depth = dc.depth
    up = (good >= adaptive.DEPTH_GOOD_COUNT) & (depth < k)
    depth, good = jnp.where(up, depth + 1, depth), jnp.where(up, 0, good)
    down = (bad >= adaptive.DEPTH_BAD_COUNT) & (depth > floor)
    depth, bad = jnp.where(down, depth - 1, depth), jnp.where(down, 0, bad)
    depth = jnp.maximum(depth, floor)
    keep = lambda new, old: jnp.where(active, new, old).astype(jnp.int32)  # noqa: E731
    return DepthControl(depth=keep(depth, dc.depth), floor=keep(floor, dc.floor), good=keep(good, dc.good),
                        bad=keep(bad, dc.bad))


def _cadence_record(plan: Plan, cad: Cadence, due, anchors, root) -> Cadence:
    """:meth:`RetrievalControl.record` (a decode retrieval) for the rows in ``due``: Jaccard overlap of the chunk
    sets and the acceptance-period test as integer comparisons (exactly the host's decisions)."""
    spec = plan.spec
    b, nc = cad.selected.shape
    bidx = jnp.arange(b)[:, None]
    sel = jnp.zeros_like(cad.selected).at[bidx, jnp.where(anchors >= 0, anchors, nc)].set(True, mode="drop")
    sel = sel.at[bidx[:, 0], root // spec.diffspec_chunk_size].set(True, mode="drop")
    prev = cad.selected
    inter = jnp.sum(sel & prev, axis=1)
    union = jnp.sum(sel | prev, axis=1)
    jn, jd = ratio(ADAPTIVE_JACCARD)
    stable = jnp.any(prev, axis=1) & (inter * jd >= union * jn)
    interval, prev_sum, prev_n = cad.interval, cad.prev_sum, cad.prev_n
    if spec.diffspec_adaptive_profile:
        an, ad = ratio(ADAPTIVE_ACCEPT_FACTOR)
        holds = (cad.accept_n > 0) & (prev_n > 0) & (cad.accept_sum * prev_n * ad >= an * prev_sum * cad.accept_n)
        grown = jnp.where(stable & holds, jnp.minimum(2 * interval, ADAPTIVE_MAX_INTERVAL),
                          spec.diffspec_retrieval_interval)
        interval = jnp.where(due, grown, interval)
        prev_sum, prev_n = jnp.where(due, cad.accept_sum, prev_sum), jnp.where(due, cad.accept_n, prev_n)
    zero = jnp.zeros_like(cad.since)
    return Cadence(since=jnp.where(due, zero, cad.since), interval=interval.astype(jnp.int32),
                   accept_sum=jnp.where(due, zero, cad.accept_sum), accept_n=jnp.where(due, zero, cad.accept_n),
                   prev_sum=prev_sum, prev_n=prev_n, selected=jnp.where(due[:, None], sel, prev))


def _cadence_due(plan: Plan, cad: Cadence, active, m, root) -> tuple[Cadence, jax.Array]:
    """:meth:`RetrievalControl.observe` (``m + 1`` emitted) and :meth:`RetrievalControl.due` for the active rows
    after a cycle that left root ``root``; returns the cadence and ``due`` bool ``[B]``."""
    a = active.astype(jnp.int32)
    since = cad.since + a
    cad = cad.replace(accept_sum=cad.accept_sum + jnp.where(active, m + 1, 0), accept_n=cad.accept_n + a,
                      since=since)
    return cad, active & (since >= cad.interval) & (root > plan.spec.history_budget)


def _cadence_step(plan: Plan, tparams, dparams, state: DecodeState, cad: Cadence, active, m):
    """After a cycle: book it (:func:`_cadence_due`) and retrieve for the due rows (under ``lax.cond``: cycles with
    no due row skip the scoring). Returns ``(state, cadence, due [B])``."""
    root = state.length - 1
    cad, due = _cadence_due(plan, cad, active, m, root)
    old = state.retrieval.anchors
    anchors = jax.lax.cond(
        _any_global(plan, due),
        lambda: jnp.where(due[:, None], _select_anchors(plan, tparams, dparams, state), old), lambda: old)
    state = state.replace(retrieval=state.retrieval.replace(anchors=anchors))
    return state, _cadence_record(plan, cad, due, anchors, root), due


def _block(plan: Plan, tparams, dparams, state: DecodeState, loop: LoopState, stops, caps, budget, *,
           cycles: int):
    """Up to ``cycles`` decode cycles in one ``lax.while_loop``, ending early when every row is done.

    Args:
        state: :class:`DecodeState`; loop: :class:`LoopState` (both donated).
        stops: int32 ``[S]`` stop ids, ``-1`` padded (replicated).
        caps: int32 ``[B, K]``, budget: int32 ``[B]``: tree mode's branching caps and node budgets for the whole
            block (``None`` in chain mode).
    Returns:
        ``(state, loop, BlockOut)``.
    """
    out = _block_out_init(plan, state.length.shape[0], cycles)

    def body(carry):
        i, _, state, loop, out = carry
        active = ~loop.done
        depths = None if loop.depth is None else loop.depth.depth
        state, emitted, m, n, window, drafted = _loop_cycle(plan, tparams, dparams, state, active, depths, caps,
                                                            budget)
        loop, out = _emit(loop, out, active, emitted, m, stops)
        out = _count(plan, out, active, m, drafted)
        rec = out.record
        if rec is not None:
            rec = rec.replace(live=rec.live.at[i].set(active), m=rec.m.at[i].set(jnp.where(active, m, 0)))
        if loop.depth is not None:
            rec = rec.replace(depth=rec.depth.at[i].set(depths))
            loop = loop.replace(depth=_depth_observe(plan, loop.depth, active, m, state.length))
        if loop.cadence is not None:
            state, cad, due = _cadence_step(plan, tparams, dparams, state, loop.cadence, active, m)
            loop = loop.replace(cadence=cad)
            rec = rec.replace(n=rec.n.at[i].set(n), window=rec.window.at[i].set(window), due=rec.due.at[i].set(due),
                              anchors=rec.anchors.at[i].set(state.retrieval.anchors))
        return i + 1, _any_global(plan, ~loop.done), state, loop, out.replace(record=rec)

    init = (jnp.zeros((), jnp.int32), _any_global(plan, ~loop.done), state, loop, out)
    steps, _, state, loop, out = jax.lax.while_loop(lambda c: (c[0] < cycles) & c[1], body, init)
    rec = out.record
    if rec is not None and rec.anchors is not None:
        rec = rec.replace(anchors=rec.anchors[None])  # [1, C, B, A] per shard: stacked over tp by the out specs
    return state, loop, out.replace(steps=steps, done=loop.done, record=rec)


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


def loop_specs(plan: Plan) -> LoopState:
    """PartitionSpecs of the :class:`LoopState` (batch over ``dp``, replicated over ``tp``)."""
    dp = sharding.DP if plan.dp > 1 else None
    row = P(dp)
    cad = Cadence(since=row, interval=row, accept_sum=row, accept_n=row, prev_sum=row, prev_n=row,
                  selected=P(dp, None)) if plan.diffspec else None
    depth = DepthControl(depth=row, floor=row, good=row, bad=row) if plan.adaptive_depth else None
    return LoopState(done=row, count=row, limit=row, cadence=cad, depth=depth)


def block_out_specs(plan: Plan) -> BlockOut:
    """PartitionSpecs of a :class:`BlockOut` (batch over ``dp``; the anchors' rank axis over ``tp``)."""
    dp = sharding.DP if plan.dp > 1 else None
    row, rows2, per_cycle = P(dp), P(dp, None), P(None, dp)
    rec = None
    if plan.records:
        rec = CycleRecord(live=per_cycle, m=per_cycle)
        if plan.diffspec:
            rec = rec.replace(n=per_cycle, window=per_cycle, due=per_cycle, anchors=P(sharding.TP, None, dp, None))
        if plan.adaptive_depth:
            rec = rec.replace(depth=per_cycle)
    return BlockOut(tokens=rows2, new=row, done=row, cycles=row, accepted=row, drafted=row, hist=rows2, steps=P(),
                    record=rec)


def _spec_tree(key):
    return None if key is None else jax.tree_util.tree_unflatten(key[0], key[1])


def param_spec_key(params) -> tuple | None:
    """A hashable description of how ``params`` are sharded (its tree and each leaf's PartitionSpec)."""
    if params is None:
        return None
    leaves, treedef = jax.tree_util.tree_flatten(params)
    return treedef, tuple(x.sharding.spec for x in leaves)


class _CompileClock:
    """Seconds spent compiling (tracing, lowering, XLA compilation or a persistent-cache load) in one call."""

    def __init__(self):
        self.seconds = 0.0


def _signature(args) -> tuple:
    """What a compiled executable is specific to: the pytree structure and each leaf's shape, dtype, weak type and
    sharding (as ``jit``'s own cache keys them)."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    return treedef, tuple((x.shape, x.dtype, bool(getattr(x, "weak_type", False)), getattr(x, "sharding", None))
                          for x in leaves)


class _Program:
    """A jitted step compiled ahead of time (``jit(...).lower(*args).compile()``) the first time it meets an
    argument signature, so compilation is timed apart from execution.

    Before compiling, the arguments are waited for: the device is then idle, and the wall time of the caller's
    region minus the compile time is exactly its run time (prefill, decode). The executables of the last
    ``max_entries`` signatures are kept (they live as long as :func:`compiled`'s entry for the plan).
    """

    def __init__(self, jitted, max_entries: int = 16):
        self.jitted = jitted
        self.max_entries = max_entries
        self._exe: collections.OrderedDict = collections.OrderedDict()

    def __call__(self, clock: _CompileClock, *args):
        key = _signature(args)
        exe = self._exe.get(key)
        if exe is None:
            jax.block_until_ready(args)
            t = time.perf_counter()
            exe = self.jitted.lower(*args).compile()
            clock.seconds += time.perf_counter() - t
            self._exe[key] = exe
            while len(self._exe) > self.max_entries:
                self._exe.popitem(last=False)
        else:
            self._exe.move_to_end(key)
        return exe(*args)


@functools.lru_cache(maxsize=64)
def compiled(plan: Plan, tspec_key=None, dspec_key=None) -> SimpleNamespace:
    """The jitted steps of ``plan``: plain ``jit`` without a mesh, ``jit(shard_map(...))`` with one. Cached per
    plan, so repeated :func:`generate` calls reuse the compilations.

    ``cycle(tparams, dparams, state, active)`` is the K-deep chain (or target-only) cycle; ``cycle_at(d)`` the
    d-deep chain taking per-sequence depths; ``tree_cycle(tparams, dparams, state, active, caps, budget)`` the tree
    cycle; ``block(c)`` the device loop of up to ``c`` cycles, ``(tparams, dparams, state, loop, stops, caps,
    budget) -> (state, loop, BlockOut)`` (state and loop donated). ``programs`` holds the ahead-of-time
    compiled :class:`_Program` versions :func:`generate` runs: ``prefill_chunk``, ``start_decode``, ``retrieve``,
    ``block(c)`` and ``init(batch, target_dtype, draft_dtype)`` (``(key) -> DecodeState``).
    """
    dp = sharding.DP if plan.dp > 1 else None
    tp = sharding.TP
    row, rows2 = P(dp), P(dp, None)

    def make(fn, donate, ins, outs):
        donate = donate if isinstance(donate, tuple) else (donate,)
        if plan.mesh is None:
            return jax.jit(functools.partial(fn, plan), donate_argnums=donate)
        mapped = jax.shard_map(functools.partial(fn, plan), mesh=plan.mesh, in_specs=ins, out_specs=outs,
                               check_vma=False)
        return jax.jit(mapped, donate_argnums=donate)

    mesh = plan.mesh is not None
    st = state_specs(plan) if mesh else None
    ls = loop_specs(plan) if mesh else None
    bo = block_out_specs(plan) if mesh else None
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
    if plan.tree_mode:
        out.tree_cycle = make(_tree_cycle, 2, (tparams, dparams, st, row, rows2, row), cycle_out + (row,))
    caps_spec, budget_spec = (rows2, row) if plan.tree_mode else (None, None)
    out.block = functools.lru_cache(maxsize=None)(
        lambda c: make(functools.partial(_block, cycles=c), (2, 3),
                       (tparams, dparams, st, ls, P(), caps_spec, budget_spec), (st, ls, bo)))

    def init(batch, target_dtype, draft_dtype):
        def fn(key):
            return _init_state(plan, batch, target_dtype, draft_dtype, 0).replace(rng=key)

        if not mesh:
            return _Program(jax.jit(fn))
        return _Program(jax.jit(fn, out_shardings=sharding.named(state_specs(plan), plan.mesh)))

    out.programs = SimpleNamespace(
        prefill_chunk=_Program(out.prefill_chunk), start_decode=_Program(out.start_decode),
        retrieve=_Program(out.retrieve), block=functools.lru_cache(maxsize=None)(lambda c: _Program(out.block(c))),
        init=functools.lru_cache(maxsize=None)(init))
    return out


def init_state(plan: Plan, batch: int, target_dtype, draft_dtype, seed: int) -> DecodeState:
    """A zeroed :class:`DecodeState`, created directly with its shardings when the plan has a mesh."""
    make = functools.partial(_init_state, plan, batch, target_dtype, draft_dtype, seed)
    if plan.mesh is None:
        return make()
    return jax.jit(make, out_shardings=sharding.named(state_specs(plan), plan.mesh))()


# ------------------------------------------------------------------------------------ compilation cache
def compilation_cache_setting(environ=None) -> str | None:
    """The directory :func:`enable_compilation_cache` points JAX's persistent compilation cache at: the value of
    ``DIFFSPEC_COMPILATION_CACHE`` when it names a directory, ``None`` (off) when it is ``0`` / ``off`` / ``false``
    / ``no``, else ``$XDG_CACHE_HOME/diffspec_jax/jax_cache`` (default ``~/.cache/diffspec_jax/jax_cache``)."""
    env = os.environ if environ is None else environ
    value = (env.get(COMPILATION_CACHE_ENV) or "").strip()
    if value.lower() in ("0", "off", "false", "no", "none"):
        return None
    if value:
        return os.path.abspath(os.path.expanduser(value))
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "diffspec_jax", "jax_cache")


@functools.lru_cache(maxsize=1)
def _jax_cache_config_before() -> tuple[str | None, float]:
    """JAX's cache directory and minimum compile time as the first :func:`generate` call found them."""
    return jax.config.jax_compilation_cache_dir, float(jax.config.jax_persistent_cache_min_compile_time_secs)


def enable_compilation_cache() -> str | None:
    """Point JAX's persistent compilation cache at :func:`compilation_cache_setting` (every :func:`generate` call
    runs this; it changes nothing once applied, and nothing at import time).

    A cache directory the user configured for JAX itself (``jax_compilation_cache_dir`` set before the first
    ``generate()`` call, or ``JAX_COMPILATION_CACHE_DIR``) is left alone. Otherwise programs that compile in at
    least :data:`CACHE_MIN_COMPILE_SECS` are kept (JAX's own threshold, 1 s, if the user lowered it already, the
    lower one), so a new process loads the engine's programs instead of compiling them again. Returns the
    directory in use (``None``: no persistent cache).
    """
    user_dir, user_min = _jax_cache_config_before()
    if user_dir is not None or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return jax.config.jax_compilation_cache_dir
    want = compilation_cache_setting()
    if jax.config.jax_compilation_cache_dir == want:
        return want
    from jax.experimental.compilation_cache import compilation_cache as cc

    jax.config.update("jax_compilation_cache_dir", want)
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      min(user_min, CACHE_MIN_COMPILE_SECS) if want is not None else user_min)
    cc.reset_cache()  # the cache object is created once per directory: let the next compilation open the new one
    return want


# --------------------------------------------------------------------------------------------- capacity
def capacity_bucket(need: int, limit: int | None = None) -> int:
    """The cache capacity for ``need`` positions: ``need`` rounded up to a quarter-octave step ``2^n x {1, 1.25,
    1.5, 1.75}`` (at least one attention tile, a whole number of tiles), so nearby prompt lengths share compiled
    programs (up to 25% more cache memory, about 12% on average; pass ``max_cache_len`` to pin the capacity);
    never above ``limit`` (what the context window and the verify block can use) unless ``need`` itself is."""
    if need <= ATTENTION_TILE:
        width = ATTENTION_TILE
    else:
        step = (1 << (need - 1).bit_length()) // 8  # a quarter of the octave below the next power of two
        width = -(-need // step) * step
    width = round_capacity(width)
    if limit is not None:
        width = min(width, max(round_capacity(need), round_capacity(limit)))
    return width


# ------------------------------------------------------------------------------------------- host side
class _RetrievalControl(RetrievalControl):
    """The engine's view: one counter set per prompt, reported as ``{"aggregate", "per_sequence"}``."""

    def status(self, real: int | None = None) -> dict[str, Any]:
        idx = list(range(len(self.c) if real is None else real))
        return {"aggregate": self.aggregate(idx), "per_sequence": [self.c[i].report() for i in idx]}

    def device_cadence(self, seqs: np.ndarray, num_chunks: int) -> dict[str, np.ndarray]:
        """The counters of sequences ``seqs`` as :class:`Cadence` arrays (the device loop's starting point)."""
        cs = [self.c[s] for s in seqs]
        col = lambda f: np.array([int(f(c)) for c in cs], np.int32)  # noqa: E731
        selected = np.zeros((len(cs), num_chunks), bool)
        for r, c in enumerate(cs):
            selected[r, list(c._selected or ())] = True
        return dict(since=col(lambda c: c._since), interval=col(lambda c: c.interval),
                    accept_sum=col(lambda c: c._accept_sum), accept_n=col(lambda c: c._accept_n),
                    prev_sum=col(lambda c: c._prev_sum), prev_n=col(lambda c: c._prev_n), selected=selected)


class _ShapeControl:
    """Host side of the draft's shape per sequence (:mod:`diffspec_jax.adaptive`).

    Tree mode: the branching caps and node budget are kept here (their statistics are floats the device does not
    mirror); they are a block's inputs (:meth:`block_inputs`) and learn from each block's per-cycle record
    (:meth:`observe`). Adaptive chain depth: decided on the device (:class:`DepthControl`); the host controllers
    replay the record, check that they would have chosen the same depths, and give the report.
    """

    def __init__(self, plan: Plan, lengths: np.ndarray):
        spec, n = plan.spec, len(lengths)
        self.k, self.nodes = plan.k, spec.diffspec_max_tree_nodes
        self.tree = plan.tree_mode
        self.adaptive = plan.speculative and spec.diffspec_adaptive_profile
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

    def device_depth(self, seqs: np.ndarray) -> dict[str, np.ndarray] | None:
        """The adaptive depths of sequences ``seqs`` as :class:`DepthControl` arrays (``None``: not adaptive)."""
        if self.tree or not self.adaptive:
            return None
        zero = np.zeros(len(seqs), np.int32)
        return dict(depth=np.array([self.depth[s].depth for s in seqs], np.int32),
                    floor=np.array([self.depth[s].floor for s in seqs], np.int32), good=zero, bad=zero.copy())

    def block_inputs(self, seqs: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Tree mode: the caps int32 ``[B, K]`` and node budgets int32 ``[B]`` of rows ``seqs`` for the next block."""
        if not self.tree:
            return None, None
        caps = np.stack([self.caps[s].caps() for s in seqs]).astype(np.int32)
        budget = np.array([self.nodes if self.budget[s] is None else self.budget[s].budget for s in seqs], np.int32)
        return caps, budget

    def observe(self, seq: int, m: int, length: int, depth: int | None) -> None:
        """Book sequence ``seq``'s verification: ``m`` accepted drafts, committed ``length``, drafted at ``depth``
        (adaptive chain depth: what the device chose, checked against the host controller)."""
        if self.tree:
            self.caps[seq].record(m)
            if self.budget[seq] is not None:
                self.budget[seq].observe(m)
        elif self.adaptive:
            d = self.depth[seq]
            if depth != d.depth:
                raise RuntimeError(f"the device drafted sequence {seq} at depth {depth}, its host controller says "
                                   f"{d.depth}: the on-device adaptive depth diverged (a bug)")
            d.observe(m + 1, length)

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

    Times (seconds, compilation excluded from all but ``compile_s``): ``compile_s`` is the time this call spent
    compiling programs (tracing, lowering and XLA compilation, or loading them from the persistent cache; 0 when
    every program was already compiled in this process); ``ttft_s`` runs from the call to the first generated
    token being on the host; ``prefill_s`` covers the cache set-up, the prefill, the first token and the
    retrieval after prefill; ``decode_s`` the device loop until the last token; ``decode_tokens_per_s`` is the
    tokens decoded after the first one per second of ``decode_s``.

    Device loop: ``block_cycles`` cycles at most per block, ``blocks`` blocks dispatched, ``host_syncs`` reads of
    results by the host (the first token, the retrieval after prefill, one per block read); ``cache_capacity`` is
    the cache positions per sequence (:func:`capacity_bucket`).

    ``retrieval`` (DiffSpec) holds the ``retrieval_status`` counters; their ``retrieval_ms`` is the wall time of a
    standalone retrieval call (the one after prefill, or a probe that changes nothing when none ran), booked for
    every retrieval call inside the device loop and split over the sequences it served, as the time of each call
    was split before the loop moved onto the device.
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
    compile_s: float = 0.0
    ttft_s: float | None = None
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens_per_s: float | None = None
    block_cycles: int = 0
    blocks: int = 0
    host_syncs: int = 0
    cache_capacity: int = 0
    retrieval: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class GenerateResult:
    """``tokens``: the generated ids per prompt (prompt excluded); ``stats``: :class:`GenerateStats`."""

    tokens: list[list[int]]
    stats: GenerateStats


def _validate(target: TargetModel, draft, prompts, max_new_tokens: int, spec: SpecConfig,
              sampling: SamplingConfig, block_cycles) -> list[list[int]]:
    if not isinstance(spec, SpecConfig):
        raise ConfigError(f"spec must be a SpecConfig, got {type(spec).__name__}")
    if not isinstance(sampling, SamplingConfig):
        raise ConfigError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if block_cycles is not None and (isinstance(block_cycles, bool) or not isinstance(block_cycles, (int, np.integer))
                                     or block_cycles < 1):
        raise ConfigError(f"block_cycles must be an integer >= 1 (or None for the default), got {block_cycles!r}")
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


def _put(plan: Plan, tree, specs):
    """Host arrays onto the device, laid out by ``specs`` when the plan has a mesh."""
    if plan.mesh is None:
        return jax.tree_util.tree_map(jnp.asarray, tree)
    return jax.tree_util.tree_map(lambda x, s: jax.device_put(x, NamedSharding(plan.mesh, s)), tree, specs)


def _stop_ids(stops: set[int]) -> np.ndarray:
    """Stop ids as int32 ``[S]`` padded with -1 to a multiple of :data:`STOP_IDS_MULTIPLE` (at least one)."""
    ids = sorted(int(s) for s in stops)
    size = max(1, -(-len(ids) // STOP_IDS_MULTIPLE)) * STOP_IDS_MULTIPLE
    return np.array(ids + [-1] * (size - len(ids)), np.int32)


class _Output:
    """The host's copy of the generated tokens: per-sequence lists, done flags, streaming and the progress bar."""

    def __init__(self, batch: int, real: int, max_new_tokens: int, stops: set[int], on_tokens, bar):
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.done = np.arange(batch) >= real
        self.max_new, self.stops, self.on_tokens, self.bar = max_new_tokens, stops, on_tokens, bar

    def first(self, seq: int, tok: int) -> None:
        """The prefill's token of sequence ``seq``, which may end it already."""
        self.add(seq, [tok])
        self.done[seq] = tok in self.stops or self.max_new <= 1

    def add(self, seq: int, toks: list[int]) -> None:
        if not toks:
            return
        self.tokens[seq].extend(toks)
        if self.on_tokens is not None:
            self.on_tokens(seq, toks)
        if self.bar is not None:
            self.bar.update(len(toks))


def generate(target: TargetModel, draft, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             spec: SpecConfig = SpecConfig(), sampling: SamplingConfig = SamplingConfig(), seed: int = 0,
             stop_token_ids: Sequence[int] | None = None, max_cache_len: int | None = None,
             prefill_chunk: int = DEFAULT_PREFILL_CHUNK, on_tokens: Callable[[int, list[int]], None] | None = None,
             progress: bool = False, proposer: Callable | None = None, mesh: Mesh | None = None,
             block_cycles: int | None = None) -> GenerateResult:
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
        max_cache_len: cache capacity per sequence (default: the longest prompt + max_new_tokens + K + 1, rounded
            up to a coarse bucket, :func:`capacity_bucket`, so that nearby prompt lengths reuse the compiled
            programs).
        on_tokens: called as ``on_tokens(i, new_ids)`` whenever prompt i gains tokens (streaming: once per
            prompt for the first token, then once per block and prompt).
        progress: show a progress bar on stderr (updated once per block).
        proposer: a custom draft function with the signature of :func:`draft_propose` (tests use an oracle).
        mesh: a ``("dp", "tp")`` mesh from :func:`diffspec_jax.make_mesh` for tensor (and data) parallelism;
            the draft is sharded like the target or replicated per ``spec.draft_tensor_parallel_size``.
        block_cycles: decode cycles per device-loop dispatch; the host reads results, streams and updates its
            controllers once per block. Default :data:`DEFAULT_BLOCK_CYCLES` (16): streaming latency of at most
            16 cycles. Tree mode with ``hazard`` branching or the adaptive node budget defaults to 1 (those host
            controllers then change the tree shape every cycle, as they learn); an explicit value there keeps
            the shape fixed within a block.
    Returns:
        :class:`GenerateResult` with ``.tokens`` and ``.stats``.
    Raises:
        InputError / ConfigError for bad input (empty prompt, prompt longer than the cache, ...).
    """
    t_call = time.perf_counter()
    prompts = _validate(target, draft, prompts, max_new_tokens, spec, sampling, block_cycles)
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
    capacity = (round_capacity(max_cache_len) if max_cache_len is not None
                else capacity_bucket(need, tc.max_position_embeddings + k_block + 1))
    plan = Plan(target=tc, draft=draft.config if draft is not None else None, spec=spec, sampling=sampling,
                aux_layers=draft.aux_layers if draft is not None else (), capacity=capacity, proposer=proposer,
                mesh=mesh, draft_tp=draft_tp, kernels=dispatch.kernel_backend())
    enable_compilation_cache()
    stops = set(tc.eos_token_ids if stop_token_ids is None else stop_token_ids)
    tparams, dparams = prepare_params(target, draft, mesh, draft_tp)
    fns = compiled(plan, param_spec_key(tparams) if mesh is not None else None,
                   param_spec_key(dparams) if mesh is not None else None)
    progs = fns.programs
    real = len(prompts)
    if plan.dp > 1 and real % plan.dp:  # pad the batch to a multiple of the data-parallel axis with dummy rows
        prompts = prompts + [prompts[0]] * (plan.dp - real % plan.dp)
        lengths = np.array([len(p) for p in prompts], np.int32)
    batch = len(prompts)
    cycles = block_cycles or (1 if plan.host_shaped else DEFAULT_BLOCK_CYCLES)
    stats = GenerateStats(num_sequences=real, num_speculative_tokens=k,
                          draft_context_policy=spec.draft_context_policy if draft is not None else None,
                          verification_mode="tree" if plan.tree_mode else "linear" if speculative else None,
                          block_cycles=int(cycles), cache_capacity=capacity)
    ctl = _RetrievalControl(spec, batch) if plan.diffspec else None
    shape = _ShapeControl(plan, lengths)
    clock = _CompileClock()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=real * max_new_tokens, unit="tok", leave=False)
    out = _Output(batch, real, max_new_tokens, stops, on_tokens, bar)

    # ---- prefill, the first token, the retrieval after prefill
    t0 = time.perf_counter()
    ddtype = dparams["fc"].dtype if dparams else target.dtype
    state = progs.init(batch, target.dtype, ddtype)(clock, jax.random.PRNGKey(seed))
    width, n_chunks = plan_prefill(lengths, prefill_chunk)
    tokens = pad_prompts(prompts, width * n_chunks + 1)
    acc = _PrefillAcc(logits=jnp.zeros((batch, tc.vocab_size), jnp.float32),
                      aux=jnp.zeros((batch, max(1, len(plan.aux_layers) * tc.hidden_size)), target.dtype),
                      score_q=jnp.zeros((batch, tc.num_attention_heads, tc.head_dim), jnp.float32),
                      score_lse=jnp.zeros((batch, tc.num_attention_heads), jnp.float32))
    jl = jnp.asarray(lengths)
    for c in range(n_chunks):
        s = c * width
        state, acc = progs.prefill_chunk(clock, tparams, dparams, state, acc, jnp.asarray(tokens[:, s:s + width]),
                                         jnp.asarray(tokens[:, s + 1:s + width + 1]),
                                         jnp.full((batch,), s, jnp.int32), jl)
    state, first = progs.start_decode(clock, state, acc, jl)
    first = np.asarray(first)
    stats.host_syncs += 1
    stats.ttft_s = time.perf_counter() - t_call - clock.seconds
    for b in range(real):
        out.first(b, int(first[b]))
    call_ms = None
    if ctl is not None:
        state, call_ms = _retrieve_after_prefill(plan, progs, clock, ctl, tparams, dparams, state, lengths, real)
        stats.host_syncs += 1
    jax.block_until_ready(state.length)
    stats.prefill_s = time.perf_counter() - t0 - clock.seconds

    # ---- the device loop, one block in flight ahead of the one the host reads
    compile_before = clock.seconds
    t1 = time.perf_counter()
    rows = np.arange(batch)  # device row -> sequence
    loop = _put(plan, _loop_init(plan, ctl, shape, out, rows, real, max_new_tokens), loop_specs(plan))
    stop_arr = _put(plan, _stop_ids(stops), P())
    program = progs.block(int(cycles))
    ahead = 1 if plan.host_shaped and cycles == 1 else 2  # blocks in flight: 1 when a block's inputs need the last
    pending: collections.deque = collections.deque()
    seq_cycles, seq_accepted = np.zeros(batch, np.int64), np.zeros(batch, np.int64)
    drafted, hist = np.zeros(batch, np.int64), np.zeros(plan.k + 1, np.int64)
    host_len = lengths.astype(np.int64).copy()
    tree_specs = (P(sharding.DP if plan.dp > 1 else None, None), P(sharding.DP if plan.dp > 1 else None))
    while not out.done.all():
        while len(pending) < ahead:
            caps, budget = shape.block_inputs(rows)
            if caps is not None:
                caps, budget = _put(plan, (caps, budget), tree_specs)
            state, loop, res = program(clock, tparams, dparams, state, loop, stop_arr, caps, budget)
            stats.blocks += 1
            pending.append((res, rows))
        res, used = pending.popleft()
        res = jax.device_get(res)
        stats.host_syncs += 1
        stats.cycles += int(res.steps)
        for r, seq in enumerate(used):
            seq_cycles[seq] += int(res.cycles[r])
            seq_accepted[seq] += int(res.accepted[r])
            drafted[seq] += int(res.drafted[r])
            out.add(seq, res.tokens[r, : int(res.new[r])].tolist())
            out.done[seq] = out.done[seq] or bool(res.done[r])
        hist += res.hist.sum(axis=0)
        if res.record is not None:
            _replay(res.record, int(res.steps), used, host_len, shape, ctl, call_ms)
        live = ~out.done[rows]
        if live.any():  # compact: finished sequences stop costing work (the next dispatch runs the smaller batch)
            size = 1 << (int(live.sum()) - 1).bit_length()
            size = -(-size // plan.dp) * plan.dp
            if size <= len(rows) // 2:
                fill = np.nonzero(~live)[0][: size - int(live.sum())]
                order = np.concatenate([np.nonzero(live)[0], fill]).astype(np.int64)
                state, loop = state.take(order), loop.take(order)
                rows = rows[order]
    # blocks still in flight started after every sequence had finished: they ran no cycle
    jax.block_until_ready((state.length, loop.done))
    stats.decode_s = time.perf_counter() - t1 - (clock.seconds - compile_before)
    stats.compile_s = clock.seconds
    if bar is not None:
        bar.close()
    stats.new_tokens = sum(len(o) for o in out.tokens)
    stats.sequence_cycles, stats.accepted_tokens = int(seq_cycles.sum()), int(seq_accepted.sum())
    stats.drafted_tokens = int(drafted.sum())
    stats.accepted_depth_histogram = [int(x) for x in hist]
    stats.acceptance_per_position = [int(hist[i + 1:].sum()) for i in range(k)]
    stats.mean_tree_size = stats.drafted_tokens / stats.sequence_cycles if plan.tree_mode and stats.sequence_cycles \
        else None
    stats.drafting = shape.report(real)
    if stats.sequence_cycles:
        stats.mean_acceptance_length = (stats.accepted_tokens + stats.sequence_cycles) / stats.sequence_cycles
    stats.acceptance_length_per_sequence = [float((a + c) / c) if c else None
                                            for a, c in zip(seq_accepted[:real], seq_cycles[:real])]
    decoded = stats.new_tokens - real  # the first token of each sequence comes from prefill
    stats.decode_tokens_per_s = decoded / stats.decode_s if stats.decode_s > 0 and decoded > 0 else None
    if ctl is not None:
        stats.retrieval = ctl.status(real)
    return GenerateResult(tokens=out.tokens[:real], stats=stats)


def _loop_init(plan: Plan, ctl, shape: _ShapeControl, out: _Output, rows: np.ndarray, real: int,
               max_new_tokens: int) -> LoopState:
    """The :class:`LoopState` of rows ``rows`` after prefill, as host arrays (rows >= ``real`` are padding)."""
    cad = depth = None
    if ctl is not None:
        cad = Cadence(**ctl.device_cadence(rows, plan.num_chunks))
    d = shape.device_depth(rows)
    if d is not None:
        depth = DepthControl(**d)
    return LoopState(done=out.done[rows].copy(), count=np.array([len(out.tokens[s]) for s in rows], np.int32),
                     limit=np.where(rows < real, max_new_tokens, 0).astype(np.int32), cadence=cad, depth=depth)


def _replay(rec: CycleRecord, steps: int, rows: np.ndarray, host_len: np.ndarray, shape: _ShapeControl, ctl,
            call_ms: float | None) -> None:
    """Feed a block's per-cycle record to the host controllers, cycle by cycle as the device decided (the retrieval
    counters check every due decision against their own)."""
    for c in range(steps):
        due_rows = []
        for r in np.nonzero(rec.live[c])[0]:
            seq, m = int(rows[r]), int(rec.m[c, r])
            host_len[seq] += m + 1
            shape.observe(seq, m, int(host_len[seq]), None if rec.depth is None else int(rec.depth[c, r]))
            if ctl is not None:
                ctl.observe(seq, emitted=m + 1, working_len=int(rec.n[c, r]), window=int(rec.window[c, r]))
                due = ctl.due(seq, int(host_len[seq]) - 1)
                if due != bool(rec.due[c, r]):
                    raise RuntimeError(f"sequence {seq}: the device loop's retrieval cadence (due={not due}) and its "
                                       f"host controller (due={due}) diverged (a bug)")
                if due:
                    due_rows.append(r)
        for r in due_rows:
            seq = int(rows[r])
            ctl.record(seq, rec.anchors[:, c, r], int(host_len[seq]) - 1, (call_ms or 0.0) / len(due_rows), False)


def prepare_params(target: TargetModel, draft, mesh: Mesh | None, draft_tp: int = 1):
    """Params as the plan needs them: unchanged without a mesh; otherwise in tensor-parallel layout on the mesh
    (memoised per model and mesh, see :func:`sharding.prepare`)."""
    if mesh is None:
        return target.params, draft.params if draft is not None else None
    tparams = sharding.prepare(target, mesh, sharding.mesh_size(mesh, sharding.TP))
    return tparams, sharding.prepare(draft, mesh, draft_tp) if draft is not None else None


def _timed_retrieve(progs, clock, ctl, tparams, dparams, state, mask, lengths, *, after_prefill):
    """One standalone retrieval for the rows in ``mask``; returns ``(state, wall ms of the call)`` (compile
    excluded) and books it, split over the rows."""
    before, t = clock.seconds, time.perf_counter()
    state, anchors = progs.retrieve(clock, tparams, dparams, state, jnp.asarray(mask))
    anchors = np.asarray(anchors)  # [ranks, B, A]: every tensor-parallel rank's selection
    ms = (time.perf_counter() - t - (clock.seconds - before)) * 1e3
    for r in np.nonzero(mask)[0]:
        ctl.record(int(r), anchors[:, r], int(lengths[r]) - 1, ms / int(mask.sum()), after_prefill)
    return state, ms


def _retrieve_after_prefill(plan, progs, clock, ctl, tparams, dparams, state, lengths, real):
    """DiffSpec's retrieval right after prefill, from the last prompt position's query (when switched on). Returns
    ``(state, ms)``: the wall time of a standalone retrieval call, timed on this one, or on a probe that selects
    for no row (nothing changes) when no row retrieves now."""
    b = len(lengths)
    mask = np.zeros(b, bool)
    if plan.spec.diffspec_retrieve_after_prefill:
        mask = np.array([i < real and not ctl.fits(int(lengths[i]) - 1) for i in range(b)])
    else:
        for i in range(real):
            ctl.skip_prefill(i)
    if mask.any():
        return _timed_retrieve(progs, clock, ctl, tparams, dparams, state, mask, lengths, after_prefill=True)
    before, t = clock.seconds, time.perf_counter()
    state, anchors = progs.retrieve(clock, tparams, dparams, state, jnp.asarray(mask))
    np.asarray(anchors)
    return state, (time.perf_counter() - t - (clock.seconds - before)) * 1e3
