"""Slots: requests joining and leaving a running batch between device blocks (the server's continuous batching,
:mod:`diffspec_jax.serving.scheduler`).

A batch of ``B`` rows ("slots") at a fixed cache capacity is created once; every function here is a pure function
of ``(plan, ..., state, ..., slot)`` with a traced ``slot`` index, so one compiled program serves every slot and
every prompt length up to the capacity:

* :func:`slot_reset`: clear the slot's per-sequence state that is not indexed by position (lengths, pending draft
  entries, retrieval state, the recurrent states of hybrid targets, a self-draft's working set) and set its sampling parameters and key. KV
  rows are never cleared: rows beyond a committed length are masked and overwritten (as in ``generate()``).
* :func:`slot_prefill`: one prefill chunk of one prompt (a fixed width ``W``) into the slot's rows of the target
  cache and the draft's store, by the engine's own :func:`~diffspec_jax.engine.prefill._prefill_chunk` on the
  slot's batch-1 view (its attention reads the slot's whole prefix); of the target's K/V only the chunk's ``W``
  positions are written back into the batch cache; the host runs these chunks back to back or between decode
  blocks of the other slots (:mod:`diffspec_jax.serving.scheduler`).
* :func:`slot_start`: after the last chunk, the first token and the pending root entry
  (:func:`~diffspec_jax.engine.prefill._start_decode`), DiffSpec's retrieval after prefill
  (:func:`~diffspec_jax.engine.retrieve._retrieve`), and the slot's row of the :class:`LoopState` (live, token
  count, limit, a fresh retrieval cadence and depth controller), so the next block decodes it.
* :func:`slot_release`: mark the slot done (a cancelled request, a stop string): the device loop's masked rows
  then cost it nothing more.

Decoding itself is the engine's device loop (:func:`~diffspec_jax.engine.loop._block`) over all ``B`` rows, with
each row's own stop ids (``stops [B, S]``) and, through :class:`~diffspec_jax.sampling.SamplingRows` in the state,
its own temperature, top-k, top-p and key.

On a tensor-parallel mesh (a plan with ``mesh``, ``dp = 1``) these functions run per shard, as ``generate()``'s
steps do, laid out by the same :func:`~diffspec_jax.engine.compile.program_specs`: the paged pools sharded by KV
heads, the page table, lengths and every per-row array whole on every shard, the slot index and a prompt chunk
given to every shard whole. Slicing a slot's row out of the batch touches the batch axis only, so each shard
writes its own heads of the pages; retrieval scores are made whole on every rank (summed over the ranks' heads, or
gathered) before the selection, so every rank selects the same chunks (:func:`slot_start` returns each rank's
selection for the host to check).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp

from diffspec_jax import working_cache
from diffspec_jax.cache import HybridCache
from diffspec_jax.engine.compile import _Program, init_program, program_specs, sharded_program
from diffspec_jax.engine.loop import LoopState, fresh_cadence, start_cadence, start_depth
from diffspec_jax.engine.prefill import PrefillAcc, _prefill_chunk, _start_decode
from diffspec_jax.engine.retrieve import _retrieve
from diffspec_jax.engine.rules import positions_needed
from diffspec_jax.engine.state import DecodeState, Plan, _init_state, shared_pools, strip_pools, with_pools
from diffspec_jax.errors import ConfigError
from diffspec_jax.kv_quant import rowwise
from diffspec_jax.models import eagle3
from diffspec_jax.sampling import SamplingRows


def _take(tree, slot):
    """The batch-1 view ``[slot:slot+1]`` of every (batch-first) leaf."""
    return jax.tree_util.tree_map(lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=0), tree)


def _put(tree, rows, slot):
    """Write batch-1 ``rows`` into row ``slot`` of every leaf of ``tree``."""
    return jax.tree_util.tree_map(
        lambda x, y: jax.lax.dynamic_update_slice_in_dim(x, jnp.asarray(y, x.dtype), slot, axis=0), tree, rows)


def _put_window(cache, rows, slot, start, width: int):
    """Write the batch-1 target cache ``rows`` of a prefill chunk back into row ``slot`` of ``cache``: of each K/V
    buffer ``[B, H, S, D]`` only the ``width`` positions from ``start`` that the chunk wrote (a window clamped into
    the buffer, as ``dynamic_slice`` clamps it: rows of the window outside the chunk are the slot's own, unchanged),
    the not position-indexed states (a hybrid target's conv and recurrent states) whole."""
    def window(buf, row):
        at = jnp.clip(start, 0, buf.shape[2] - width)
        piece = jax.lax.dynamic_slice(row, (0, 0, at, 0), (1, row.shape[1], width, row.shape[3]))
        return jax.lax.dynamic_update_slice(buf, piece.astype(buf.dtype), (slot, 0, at, 0))

    k = tuple(rowwise(window, b, r) for b, r in zip(cache.k, rows.k))  # (an 8-bit buffer: values and scales alike)
    v = tuple(rowwise(window, b, r) for b, r in zip(cache.v, rows.v))
    return _put(cache.replace(k=(), v=()), rows.replace(k=(), v=()), slot).replace(k=k, v=v)


def _set(x: jax.Array, slot, value) -> jax.Array:
    """``x`` with row ``slot`` set to ``value`` (broadcast to one row)."""
    return _put(x, jnp.broadcast_to(jnp.asarray(value, x.dtype), (1,) + x.shape[1:]), slot)


def _rows(state: DecodeState, slot) -> DecodeState:
    """The slot's batch-1 :class:`DecodeState` (the unbatched ``rng`` passed through; a paged state's pools are
    shared, and the slot's page-table row addresses them)."""
    return with_pools(_take(strip_pools(state).replace(rng=None), slot).replace(rng=state.rng), shared_pools(state))


def init_slots(plan: Plan, batch: int, target_dtype, draft_dtype) -> tuple[DecodeState, LoopState]:
    """``batch`` empty slots: a zeroed :class:`DecodeState` with per-row sampling, and a :class:`LoopState` where
    every row is done."""
    state = _init_state(plan, batch, target_dtype, draft_dtype, 0)
    if state.sampling is None:  # (a plan without row_sampling, outside the slot programs)
        state = state.replace(sampling=SamplingRows.create(batch, plan.capacity))
    zero = jnp.zeros((batch,), jnp.int32)
    cad = fresh_cadence(plan, batch) if plan.diffspec else None
    depth = start_depth(plan, zero) if plan.adaptive_depth else None
    loop = LoopState(done=jnp.ones((batch,), bool), count=zero, limit=zero, cadence=cad, depth=depth)
    return state, loop


def parked_length(plan: Plan) -> int:
    """The committed length of a slot between :func:`slot_reset` and :func:`slot_start`: its verify block
    (``k_block + 1`` rows: K + 1, or a tree's ``max_tree_nodes + 1``) ends at the capacity, so every write and read
    of a masked cycle stays inside the cache, past any prompt (a request needs ``prompt + max_tokens <=
    max_model_len <= capacity - k_block - 1``)."""
    return plan.capacity - positions_needed(plan, 0)


def slot_reset(plan: Plan, state: DecodeState, slot, temperature, top_k, top_p, key) -> DecodeState:
    """Clear slot ``slot`` for a new request and set its sampling row (``key`` uint32 ``[2]``).

    Until :func:`slot_start` the slot's committed length is :func:`parked_length`: the decode blocks that run while
    its prompt is prefilled (the slot masked as done) write their K/V rows and draft entries for it at the end of
    the cache, which no prompt reaches, instead of over the prompt."""
    state = state.replace(length=_set(state.length, slot, parked_length(plan)),
                          last_token=_set(state.last_token, slot, 0),
                          pend_tokens=_set(state.pend_tokens, slot, 0), pend_feats=_set(state.pend_feats, slot, 0),
                          pend_count=_set(state.pend_count, slot, 0), seq_id=_set(state.seq_id, slot, slot))
    ret = state.retrieval
    if ret is not None:
        ret = ret.replace(anchors=_set(ret.anchors, slot, -1), score_q=_set(ret.score_q, slot, 0),
                          score_lse=_set(ret.score_lse, slot, 0), draft_q=_set(ret.draft_q, slot, 0),
                          chunk_sum=None if ret.chunk_sum is None else _set(ret.chunk_sum, slot, 0))
        state = state.replace(retrieval=ret)
    if plan.drafter is not None:  # (a self-draft's working set is rebuilt at the slot's first draft)
        state = plan.drafter.reset_row(plan, state, slot)
    tc = state.target_cache
    if isinstance(tc, HybridCache):  # recurrent states start from zero (KV rows need no clearing)
        zero = lambda bufs: tuple(_set(b, slot, 0) for b in bufs)  # noqa: E731
        state = state.replace(target_cache=tc.replace(conv_q=zero(tc.conv_q), conv_k=zero(tc.conv_k),
                                                      conv_v=zero(tc.conv_v), ssm=zero(tc.ssm)))
    rows = state.sampling
    return state.replace(sampling=rows.replace(
        temperature=_set(rows.temperature, slot, temperature), top_k=_set(rows.top_k, slot, top_k),
        top_p=_set(rows.top_p, slot, top_p), key=_set(rows.key, slot, key)))


def slot_prefill(plan: Plan, tparams, dparams, state: DecodeState, acc: PrefillAcc, slot, tokens, next_tokens,
                 start, length, *, first: bool = False) -> tuple[DecodeState, PrefillAcc, jax.Array]:
    """One prefill chunk of the prompt in slot ``slot``: ``tokens`` / ``next_tokens`` int32 ``[1, W]`` (the prompt
    from ``start`` and shifted by one, zero-padded), ``start`` and ``length`` (the prompt's) int32 ``[1]``;
    ``first`` (static): the prompt's first chunk (``start`` 0; the fast attention skips the empty prefix).

    Returns ``(state, acc, prompt tokens prefilled so far int32 [])``: the last is a small output that is not
    donated to the next call, so the host can wait for a chunk to finish (the scheduler paces its prefill with
    it)."""
    rows, acc = _prefill_chunk(plan, tparams, dparams, _rows(state, slot), acc, tokens, next_tokens, start, length,
                               first=first)
    if state.target_cache.paged:  # the chunk wrote the shared pools through the slot's pages: take them whole
        state = with_pools(_put(strip_pools(state).replace(rng=None), strip_pools(rows).replace(rng=None), slot),
                           shared_pools(rows)).replace(rng=state.rng)
        return state, acc, jnp.minimum(start[0] + tokens.shape[1], length[0])
    # the target cache: only the chunk's positions go back (the rest of the slot's rows are unchanged)
    tcache = _put_window(state.target_cache, rows.target_cache, slot, start[0], tokens.shape[1])
    small = lambda s: s.replace(rng=None, target_cache=None)  # noqa: E731
    state = _put(small(state), small(rows), slot).replace(rng=state.rng, target_cache=tcache)
    return state, acc, jnp.minimum(start[0] + tokens.shape[1], length[0])


def slot_start(plan: Plan, tparams, dparams, state: DecodeState, loop: LoopState, acc: PrefillAcc, slot, length,
               limit, stops, retrieve, replay, replay_end, context=None):
    """Start decoding slot ``slot`` after its prefill.

    Args:
        length: int32 ``[1]`` the prompt length; limit: int32 ``[]`` the request's token limit; stops: int32
            ``[S]`` its stop ids (``-1`` padded); retrieve: bool ``[]`` run DiffSpec's retrieval after prefill
            now; replay: int32 ``[1, capacity]`` and replay_end: int32 ``[1]``: tokens the slot emits again at the
            positions below ``replay_end`` (its prompt and the tokens it generated before a preemption; ``[0]``:
            none), recomputed through the decode loop's verify steps
            (:attr:`~diffspec_jax.sampling.SamplingRows.replay`); context: int32 ``[1, capacity]`` the slot's
            whole context, zero padded, for the plan's drafter when it reads it
            (:attr:`~diffspec_jax.engine.state.Plan.drafter_context`; else ``None``).
    Returns:
        ``(state, loop, first token int32 [], anchors int32 [1, 1, A])``: the retrieval's anchors as this
        tensor-parallel rank selected them (zeros without DiffSpec), stacked over the ranks by the program's out
        specs (``[ranks, 1, A]``), so the host can check that every rank selected the same chunks.
    """
    rows = _rows(state, slot)
    rows = rows.replace(sampling=rows.sampling.replace(replay=replay, replay_end=replay_end))
    rows, first = _start_decode(plan, rows, acc, length, context)
    ranks = jnp.zeros((1, 1, max(1, plan.spec.max_chunks - 1)), jnp.int32)
    if plan.diffspec:
        rows, ranks = _retrieve(plan, tparams, dparams, rows, retrieve[None])
    anchors = ranks[0, 0]
    # only the small per-sequence leaves changed (caches are untouched): write those back
    small = lambda s: s.replace(rng=None, target_cache=None,  # noqa: E731
                                draft_cache=None)
    state = _put(small(state), small(rows), slot).replace(rng=state.rng, target_cache=state.target_cache,
                                                          draft_cache=state.draft_cache)
    done = jnp.any(first[0] == stops) | (limit <= 1)
    loop = loop.replace(done=_set(loop.done, slot, done), count=_set(loop.count, slot, 1),
                        limit=_set(loop.limit, slot, limit))
    if loop.cadence is not None:
        loop = loop.replace(cadence=_put(loop.cadence, start_cadence(plan, retrieve[None], anchors[None], length - 1),
                                         slot))
    if loop.depth is not None:
        loop = loop.replace(depth=_put(loop.depth, start_depth(plan, length), slot))
    return state, loop, first[0], ranks


def slot_flush(plan: Plan, dparams, state: DecodeState, slot) -> DecodeState:
    """Project slot ``slot``'s pending draft entries into the draft's store (a request leaving a paged state): the
    store then holds an entry for every position whose target K/V is committed, so every full page of the request
    can be reused whole (a follow-up turn's prompt repeats all of it). The entries are what the next draft step 0
    would have written (:func:`~diffspec_jax.engine.propose._draft_root`); the rows past the pending count are not
    written."""
    rows = _rows(state, slot)
    k1 = plan.k + 1
    i = jnp.arange(k1, dtype=jnp.int32)[None, :]
    positions = jnp.where(i < rows.pend_count[:, None], (rows.length - rows.pend_count)[:, None] + i, -1)
    z, _ = eagle3.entry_inputs(plan.draft, dparams, rows.pend_tokens, rows.pend_feats, from_target=True,
                               axis_name=plan.draft_axis)
    _, k, v = eagle3.qkv(dparams, z)
    tc = rows.target_cache
    store = working_cache.commit(plan.draft, plan.spec, rows.draft_cache, k, v, positions, pages=tc.pages,
                                 page_size=tc.page_size)
    return state.replace(draft_cache=state.draft_cache.replace(store_k=store.store_k, store_v=store.store_v))


def slot_release(plan: Plan, loop: LoopState, slot) -> LoopState:
    """Mark slot ``slot`` done: the device loop stops decoding it (its rows stay masked until the next admission)."""
    return loop.replace(done=_set(loop.done, slot, True))


def slot_programs(plan: Plan, tspec_key=None, dspec_key=None) -> SimpleNamespace:
    """The ahead-of-time compiled :class:`_Program` of each slot function for ``plan`` (state, loop and the
    prefill accumulator donated): ``reset``, ``prefill`` (``prefill_first``: a prompt's first chunk), ``start``,
    ``release``, ``flush``, and ``init(batch, target_dtype, draft_dtype)`` (:func:`init_slots`) and
    ``acc(target_dtype)`` (a batch-1 :meth:`PrefillAcc.zeros <diffspec_jax.engine.prefill.PrefillAcc.zeros>`).
    With a mesh they run per shard like ``generate()``'s programs, laid out by the same
    :func:`~diffspec_jax.engine.compile.program_specs` (the params as ``tspec_key`` / ``dspec_key`` describe); a
    slot's own inputs (its index, prompt chunk, sampling parameters) go to every shard whole. A
    :class:`~diffspec_jax.engine.session.Session` keeps them per plan."""
    if not plan.row_sampling:
        raise ValueError("slot programs need a plan with row_sampling (each slot samples by its own parameters)")
    if plan.dp > 1:
        raise ConfigError(f"request slots share one page pool, which a data-parallel mesh (dp={plan.dp}) would have "
                          f"to split: use a mesh with dp=1 (tensor parallelism only)")
    sp = program_specs(plan, tspec_key, dspec_key)
    st, ls, acc, one = sp.state, sp.loop, sp.acc, sp.same

    def make(fn, donate, ins, outs):
        return _Program(sharded_program(plan, fn, donate, ins, outs))

    chunk_ins = (sp.tparams, sp.dparams, st, acc) + (one,) * 5

    @functools.lru_cache(maxsize=None)
    def init(batch, target_dtype, draft_dtype):
        return init_program(plan, lambda: init_slots(plan, batch, target_dtype, draft_dtype), (st, ls))

    @functools.lru_cache(maxsize=None)
    def new(target_dtype):
        return init_program(plan, lambda: PrefillAcc.zeros(plan, 1, target_dtype), acc)

    return SimpleNamespace(
        reset=make(slot_reset, 0, (st,) + (one,) * 5, st),
        prefill=make(slot_prefill, (2, 3), chunk_ins, (st, acc, one)),
        prefill_first=make(functools.partial(slot_prefill, first=True), (2, 3), chunk_ins, (st, acc, one)),
        start=make(slot_start, (2, 3), (sp.tparams, sp.dparams, st, ls, acc) + (one,) * 8,
                   (st, ls, one, sp.ranks)),
        release=make(slot_release, 0, (ls, one), ls),
        flush=make(slot_flush, 1, (sp.dparams, st, one), st),
        init=init, acc=new)
