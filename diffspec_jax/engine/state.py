"""Decode state and plan: :class:`DecodeState` (everything that changes per cycle), :class:`Plan` (the static
description of a run, a hashable ``jit`` static argument), their zero initialisation and partition specs."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from diffspec_jax import retrieval, sharding, working_set
from diffspec_jax.cache import HybridCache, KVCache, create_cache, create_paged_cache, fp8_specs
from diffspec_jax.cache import pool_rows as cache_pool_rows
from diffspec_jax.config import DraftConfig, ModelConfig, SamplingConfig, SpecConfig
from diffspec_jax.models import family
from diffspec_jax.sampling import SamplingRows
from diffspec_jax.working_cache import DraftCache
from pallas_kernels.common import resolve_kernels


@struct.dataclass
class DecodeState:
    """Everything that changes per cycle (batch-first arrays; ``rng`` is the only unbatched leaf).

    Attributes:
        target_cache: the target :class:`KVCache` (:class:`HybridCache` for hybrid targets).
        draft_cache: the cache the plan's drafter reads through its draft-context policy
            (:meth:`~diffspec_jax.engine.drafting.Drafter.init_cache`): an EAGLE-3 draft's :class:`DraftCache`, a
            self-draft's :class:`~diffspec_jax.working_set.WorkingSet` (none without a working cache), else
            ``None``.
        retrieval: :class:`retrieval.RetrievalState` (``diffspec`` policy only).
        length: int32 ``[B]`` committed target length: positions ``0..length-1`` are valid in the target cache.
        last_token: int32 ``[B]`` the newest emitted token, at position ``length``, not yet run by the target.
        pend_tokens: int32 ``[B, K+1]`` tokens of draft entries awaiting projection (row i at position
            ``length - pend_count + i``); pend_feats: ``[B, K+1, A*Ht]`` their target aux features;
            pend_count: int32 ``[B]`` how many rows are real (the last real row is the root, ``length - 1``).
        seq_id: int32 ``[B]`` the prompt index of each row (rows are reordered when finished ones are dropped).
        rng: the sampling key.
        sampling: :class:`~diffspec_jax.sampling.SamplingRows`, each row's own sampling parameters and key (the
            server's slots), or ``None`` (``generate()``: the plan's static :class:`SamplingConfig` and ``rng``
            serve every row).
        drafter: the plan's :class:`~diffspec_jax.engine.drafting.Drafter`'s own per-row state (batch-first
            arrays; prompt lookup: the token history int32 ``[B, capacity]``), ``None`` without one.
    """

    target_cache: KVCache | HybridCache
    draft_cache: DraftCache | working_set.WorkingSet | None
    retrieval: retrieval.RetrievalState | None
    length: jax.Array
    last_token: jax.Array
    pend_tokens: jax.Array
    pend_feats: jax.Array
    pend_count: jax.Array
    seq_id: jax.Array
    rng: jax.Array
    sampling: SamplingRows | None = None
    drafter: Any = None

    def take(self, rows: np.ndarray) -> DecodeState:
        """Keep batch rows ``rows`` (compaction when sequences finish; a paged state's pools stay whole, the rows'
        page tables go with them)."""
        idx = jnp.asarray(rows, jnp.int32)
        pick = lambda x: jnp.take(x, idx, axis=0)  # noqa: E731
        rng, pools = self.rng, shared_pools(self)
        rest = strip_pools(self).replace(rng=jnp.zeros((len(rows),), jnp.uint32))
        return with_pools(jax.tree_util.tree_map(pick, rest), pools).replace(rng=rng)


def shared_pools(state: DecodeState) -> tuple:
    """The leaves every row shares in a paged state (``()`` when not paged): the target's K/V pools and the draft's
    store pools (``None`` without a store)."""
    tc, dc = state.target_cache, state.draft_cache
    if not tc.paged:
        return ()
    return (tc.k, tc.v) + (dc.pools() if dc is not None else (None, None))


def strip_pools(state: DecodeState) -> DecodeState:
    """``state`` without its shared pools (:func:`shared_pools`): every leaf left is batch-first."""
    if not state.target_cache.paged:
        return state
    state = state.replace(target_cache=state.target_cache.replace(k=(), v=()))
    if state.draft_cache is not None:
        state = state.replace(draft_cache=state.draft_cache.with_pools(None, None))
    return state


def with_pools(state: DecodeState, pools: tuple) -> DecodeState:
    """:func:`strip_pools`'s inverse."""
    if not pools:
        return state
    k, v, sk, sv = pools
    state = state.replace(target_cache=state.target_cache.replace(k=k, v=v))
    if sk is not None:
        state = state.replace(draft_cache=state.draft_cache.with_pools(sk, sv))
    return state


@dataclass(frozen=True)
class Plan:
    """Static description of a run (a hashable ``jit`` static argument)."""

    target: ModelConfig
    draft: DraftConfig | None
    spec: SpecConfig
    sampling: SamplingConfig
    aux_layers: tuple[int, ...]
    capacity: int
    mesh: Mesh | None = None
    draft_tp: int = 1
    #: ``(num_pages, page_size)``: the target's K/V (and the draft's store) live in a pool of pages shared by every
    #: row, addressed through the cache's page table (the server); ``capacity`` is then the page table's reach
    paging: tuple[int, int] | None = None
    #: each row samples with its own parameters and key (``DecodeState.sampling``: the server's request slots);
    #: else every row samples by ``sampling`` (``generate()``)
    row_sampling: bool = False
    #: the :class:`~diffspec_jax.engine.drafting.Drafter` that proposes each cycle's drafts
    #: (:func:`~diffspec_jax.engine.drafter.draft_spec` picks it: the EAGLE-3 draft ``draft``'s, ``"self"``,
    #: ``"ngram"``, prompt lookup in front of a model draft, ...); ``None``: target-only decoding
    drafter: Any = None
    #: the target cache's storage (:data:`diffspec_jax.config.KV_CACHE_DTYPES`): ``"auto"`` (the model dtype) or
    #: ``"fp8"`` (8-bit rows with per-(token, KV head) scales, :mod:`diffspec_jax.kv_quant`); the draft's store and
    #: working cache, and the self-draft's working set, stay in the model dtype
    kv_cache_dtype: str = "auto"

    @property
    def kernels(self) -> str:
        """``"pallas"`` or ``"reference"``: the spec's kernel choice (``SpecConfig.kernels``) on this device; every
        program of the plan is traced under it."""
        return resolve_kernels(self.spec.kernels)

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
        return self.drafter is not None

    @property
    def model_draft(self) -> bool:
        """A model drafts (EAGLE-3 or the target itself), reading the draft-context policy (``spec.context``)."""
        return self.drafter is not None and self.drafter.model

    @property
    def drafter_context(self) -> bool:
        """The drafter reads each prompt's tokens after the prefill (the host sends them)."""
        return self.drafter is not None and self.drafter.needs_context

    @property
    def k(self) -> int:
        return self.spec.num_speculative_tokens if self.speculative else 0

    @property
    def k_block(self) -> int:
        """Draft rows of a verify block, which occupies ``k_block + 1`` cache rows past the committed length: K, or a
        tree's ``max_tree_nodes``."""
        return self.spec.verification.max_nodes if self.tree_mode else self.k

    @property
    def diffspec(self) -> bool:
        """DiffSpec's retrieval runs: a model draft under a policy that retrieves."""
        return self.model_draft and self.spec.context.retrieves

    @property
    def draft_store(self) -> bool:
        """Whether an EAGLE-3 draft keeps a store of entries per position (its working-cache policies), paged beside
        the target's K/V; its entry at p reads the token at p + 1 (:attr:`page_lookahead`)."""
        return self.draft is not None and self.spec.uses_working_cache

    @property
    def page_lookahead(self) -> int:
        """Tokens past a page that its content depends on (:class:`~diffspec_jax.paging.PageManager`)."""
        return 1 if self.draft_store else 0

    @property
    def prefix_reusable(self) -> bool:
        """Whether every per-request state is in pages, so a prefix's pages can serve another request: not with a
        hybrid target's recurrent states, a draft's ``full`` policy (a working cache per row) or the salience
        scorer's chunk summaries (a self-draft's working set is rebuilt from the pages)."""
        return not (self.target.is_hybrid or (self.draft is not None and not self.spec.uses_working_cache)
                    or (self.diffspec and self.spec.context.needs_summaries))

    def prefix_namespace(self, target_dtype) -> str:
        """The hash chain's root for this plan's pages: the models, the dtype and the layout, so two plans share a
        cached page only when its K/V (and draft entries) would be the same."""
        return repr((repr(self.target), repr(self.draft), str(np.dtype(target_dtype)), self.model_draft,
                     self.draft_store, self.tp, self.draft_tp, self.kv_cache_dtype))

    @property
    def score_layer(self) -> int | None:
        """Target layer whose queries/LSE are captured (``diffspec`` with the attention scorer)."""
        if self.diffspec and self.spec.context.scorer == "attention":
            return self.spec.context.layer_for(self.target)
        return None

    @property
    def num_chunks(self) -> int:
        """Chunks of the target cache (DiffSpec's scoring; 0 without a working cache)."""
        return retrieval.num_chunks(self.capacity, self.spec.context.chunk_size) if self.spec.uses_working_cache else 0

    @property
    def tree_mode(self) -> bool:
        """Tree drafting and verification."""
        return self.speculative and self.spec.tree

    @property
    def adaptive_depth(self) -> bool:
        """Adaptive chain depth (chain mode with ``diffspec_adaptive_profile``), kept on the device."""
        return self.speculative and not self.spec.tree and self.spec.verification.adaptive

    @property
    def host_shaped(self) -> bool:
        """Tree mode whose branching caps or node budget change between cycles (host controllers)."""
        return self.tree_mode and self.spec.verification.host_shaped

    @property
    def records(self) -> bool:
        """Whether a block returns its per-cycle :class:`CycleRecord` (the host reads it: the retrieval counters, the
        tree controllers, the adaptive depth's report)."""
        return self.diffspec or self.tree_mode or self.adaptive_depth


def _init_state(plan: Plan, batch: int, target_dtype, draft_dtype, seed: int, pools: bool = True) -> DecodeState:
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
            draft_q=jnp.zeros((batch, dc.num_attention_heads, dc.head_dim) if dc is not None else (batch, 1, 1),
                              jnp.float32),
            chunk_sum=(jnp.zeros((batch, plan.num_chunks, kv_d, dc.head_dim), jnp.float32)
                       if plan.spec.context.needs_summaries else None))
    if plan.paging is None:
        tcache = create_cache(tc, batch, plan.capacity, target_dtype, tp=plan.tp, kv_cache_dtype=plan.kv_cache_dtype)
        pool_rows = None
    else:
        num_pages, page_size = plan.paging if pools else (0, plan.paging[1])  # (no pools: the caller has them)
        if plan.capacity % page_size:
            raise ValueError(f"a paged capacity ({plan.capacity}) must be whole pages of {page_size}")
        tcache = create_paged_cache(tc, batch, num_pages, page_size, plan.capacity // page_size, target_dtype,
                                    tp=plan.tp, kv_cache_dtype=plan.kv_cache_dtype)
        pool_rows = cache_pool_rows(num_pages, page_size)
    drafter = plan.drafter
    return DecodeState(
        target_cache=tcache,
        draft_cache=drafter.init_cache(plan, batch, target_dtype, draft_dtype, pool_rows) if drafter is not None
        else None,
        retrieval=ret,
        length=jnp.zeros((batch,), jnp.int32), last_token=jnp.zeros((batch,), jnp.int32),
        pend_tokens=jnp.zeros((batch, k1), jnp.int32),
        pend_feats=jnp.zeros((batch, k1, feat), target_dtype),
        pend_count=jnp.zeros((batch,), jnp.int32), seq_id=jnp.arange(batch, dtype=jnp.int32),
        rng=jax.random.PRNGKey(seed),
        sampling=SamplingRows.create(batch, plan.capacity) if plan.row_sampling else None,
        drafter=plan.drafter.init(plan, batch) if plan.drafter is not None else None)


def _rows(x: jax.Array, row: jax.Array) -> jax.Array:
    """``x[b, row[b]]`` for x ``[B, T, ...]``, row int ``[B]`` -> ``[B, ...]``."""
    idx = row.reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.take_along_axis(x, idx, axis=1)[:, 0]


def _split(plan: Plan, rng: jax.Array, n: int = 2):
    """Split the replicated key; data-parallel replicas fold in their index so their samples are independent."""
    keys = jax.random.split(rng, n)
    if plan.mesh is not None and plan.dp > 1:
        dp = jax.lax.axis_index(sharding.DP)
        return (keys[0],) + tuple(jax.random.fold_in(k, dp) for k in keys[1:])
    return tuple(keys)


def state_specs(plan: Plan) -> DecodeState:
    """PartitionSpecs of every :class:`DecodeState` leaf (batch over ``dp``; heads over ``tp``)."""
    dp = sharding.DP if plan.dp > 1 else None
    tp = sharding.TP
    dtp = tp if plan.draft_tp > 1 else None
    dheads = P(dp, None, dtp, None)
    drafter = plan.drafter
    dcache = drafter.cache_specs(plan, dp, tp) if drafter is not None else None
    ret = None
    if plan.diffspec:
        ret = retrieval.RetrievalState(anchors=P(dp, None), score_q=P(dp, tp, None), score_lse=P(dp, tp),
                                       draft_q=P(dp, dtp, None),
                                       chunk_sum=dheads if plan.spec.context.needs_summaries else None)
    tcache = family(plan.target).cache_specs(plan.target, dp, tp)
    if plan.paging is not None:  # pools shared by every row (one data-parallel replica: checked by generate())
        pool = P(None, tp, None, None)
        tcache = tcache.replace(k=(pool,) * len(tcache.k), v=(pool,) * len(tcache.v), pages=P(dp, None),
                                page_size=plan.paging[1])
    if plan.kv_cache_dtype == "fp8":
        tcache = fp8_specs(tcache)
    rows = None
    if plan.row_sampling:
        rows = SamplingRows(temperature=P(dp), top_k=P(dp), top_p=P(dp), key=P(dp, None), replay=P(dp, None),
                            replay_end=P(dp))
    return DecodeState(target_cache=tcache, draft_cache=dcache,
                       retrieval=ret,
                       length=P(dp), last_token=P(dp), pend_tokens=P(dp, None), pend_feats=P(dp, None, None),
                       pend_count=P(dp), seq_id=P(dp), rng=P(), sampling=rows,
                       drafter=drafter.specs(plan, dp) if drafter is not None else None)


def init_state(plan: Plan, batch: int, target_dtype, draft_dtype, seed: int) -> DecodeState:
    """A zeroed :class:`DecodeState`, created directly with its shardings when the plan has a mesh."""
    make = functools.partial(_init_state, plan, batch, target_dtype, draft_dtype, seed)
    if plan.mesh is None:
        return make()
    return jax.jit(make, out_shardings=sharding.named(state_specs(plan), plan.mesh))()
