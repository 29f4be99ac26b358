"""The device loop: up to ``block_cycles`` decode cycles per dispatch in one ``lax.while_loop`` (:func:`_block`).

Per cycle and sequence it also: appends the emitted tokens to the block's output buffer and ends the sequence at a
stop id or at its token limit (:class:`LoopState` ``done`` / ``count`` / ``limit``); counts cycles, accepted and
drafted tokens and the accepted-depth histogram (:class:`BlockOut`); keeps the adaptive chain depth
(:class:`DepthControl`, an exact integer mirror of :class:`diffspec_jax.adaptive.AdaptiveDepth`); and decides the
DiffSpec retrieval cadence (:class:`Cadence`, an exact integer mirror of
:class:`diffspec_jax.retrieval_control.RetrievalControl`), running the retrieval under ``lax.cond`` on the cycles
where a sequence is due. It records what each cycle decided (:class:`CycleRecord`) for the host controllers to
replay, and ends when every sequence is done or the block's cycle budget is spent. Data-parallel replicas agree
on every branch (the loop's and the retrieval's predicates are reduced over ``dp``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

from diffspec_jax import adaptive, sharding
from diffspec_jax.engine.retrieve import _select_anchors
from diffspec_jax.engine.state import DecodeState, Plan
from diffspec_jax.engine.verify import Cycle, _spec_cycle, _target_cycle, _tree_cycle
from diffspec_jax.retrieval_control import ADAPTIVE_ACCEPT_FACTOR, ADAPTIVE_JACCARD, ADAPTIVE_MAX_INTERVAL, ratio


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


def _loop_cycle(plan: Plan, tparams, dparams, state: DecodeState, active, depths, caps, budget) -> Cycle:
    """The plan's :class:`~diffspec_jax.engine.verify.Cycle`. Adaptive depth runs the batch at its largest depth
    (``lax.switch`` over the K compiled depths)."""
    if not plan.speculative:
        return _target_cycle(plan, tparams, dparams, state, active)
    if plan.spec.tree:
        return _tree_cycle(plan, tparams, dparams, state, active, caps, budget)
    if depths is not None:
        top = _max_global(plan, jnp.where(active, depths, 1))
        branches = [functools.partial(_spec_cycle_at, plan, d) for d in range(1, plan.k + 1)]
        return jax.lax.switch(top - 1, branches, tparams, dparams, state, active, depths)
    return _spec_cycle(plan, tparams, dparams, state, active)


def _emit(loop: LoopState, out: BlockOut, active, emitted, m, stops) -> tuple[LoopState, BlockOut]:
    """Append each active row's ``m + 1`` emitted tokens to the block's buffer, up to and including the first stop
    id or the token that reaches the row's limit (which end the row)."""
    b, k1 = emitted.shape
    j = jnp.arange(k1, dtype=jnp.int32)[None, :]
    valid = active[:, None] & (j <= m[:, None])
    row_stops = stops[None, None, :] if stops.ndim == 1 else stops[:, None, :]  # [S] shared, or [B, S] per row
    is_stop = jnp.any(emitted[:, :, None] == row_stops, axis=-1)
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
    floor = jnp.where(length >= spec.verification.long_context_threshold, spec.verification.long_context_depth, k)
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
    sel = sel.at[bidx[:, 0], root // spec.context.chunk_size].set(True, mode="drop")
    prev = cad.selected
    inter = jnp.sum(sel & prev, axis=1)
    union = jnp.sum(sel | prev, axis=1)
    jn, jd = ratio(ADAPTIVE_JACCARD)
    stable = jnp.any(prev, axis=1) & (inter * jd >= union * jn)
    interval, prev_sum, prev_n = cad.interval, cad.prev_sum, cad.prev_n
    if spec.context.adaptive:
        an, ad = ratio(ADAPTIVE_ACCEPT_FACTOR)
        holds = (cad.accept_n > 0) & (prev_n > 0) & (cad.accept_sum * prev_n * ad >= an * prev_sum * cad.accept_n)
        grown = jnp.where(stable & holds, jnp.minimum(2 * interval, ADAPTIVE_MAX_INTERVAL),
                          spec.context.retrieval_interval)
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
        stops: int32 ``[S]`` stop ids, ``-1`` padded (replicated), or ``[B, S]`` each row's own (the server's
            slots).
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
