"""The decoding engine: prefill, the draft -> verify -> accept cycle, retrieval, the device decode loop and
``generate()``. The modules follow the data path:

* :mod:`~diffspec_jax.engine.state`: :class:`DecodeState` (what changes per cycle), :class:`Plan` (what does not);
* :mod:`~diffspec_jax.engine.prefill`: the chunked prefill and the first token;
* :mod:`~diffspec_jax.engine.drafting`: the :class:`~diffspec_jax.engine.drafting.Drafter` protocol (prepare after
  prefill, propose K tokens, update after acceptance, ...); :mod:`~diffspec_jax.engine.drafter`: the registry of
  drafters and the reading of a ``draft`` argument;
* the drafters: :mod:`~diffspec_jax.engine.propose` (EAGLE-3: the draft's step 0 and its chain or tree,
  :func:`draft_propose`), :mod:`~diffspec_jax.engine.self_draft` (the target drafting for itself over its working
  set, ``draft="self"``), :mod:`~diffspec_jax.engine.ngram` (prompt lookup, ``draft="ngram"``);
* :mod:`~diffspec_jax.engine.verify`: the cycles (draft -> verify -> accept; chain, tree, target alone);
* :mod:`~diffspec_jax.engine.retrieve`: DiffSpec's chunk scoring and selection;
* :mod:`~diffspec_jax.engine.loop`: the device loop, a block of cycles in one ``lax.while_loop``;
* :mod:`~diffspec_jax.engine.compile`: building the compiled programs, the persistent compilation cache, capacity
  buckets;
* :mod:`~diffspec_jax.engine.session`: :class:`Session`, the runtime object that keeps compiled programs and
  prepared (sharded) params between calls;
* :mod:`~diffspec_jax.engine.controllers`: the host-side retrieval and draft-shape controllers;
* :mod:`~diffspec_jax.engine.driver`: :func:`generate`, the host side.

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

# every name of the former single-module engine, importable from here (tests and benchmarks use private ones)
from diffspec_jax.engine.state import (  # noqa: F401
    DecodeState, Plan, _init_state, _rows, _split, init_state, state_specs)
from diffspec_jax.engine.prefill import _PrefillAcc, _prefill_chunk, _start_decode  # noqa: F401
from diffspec_jax.engine.propose import (  # noqa: F401
    _best_mass, _draft_choose, _draft_root, _top_children, draft_propose, draft_propose_tree)
from diffspec_jax.engine.self_draft import SELF, is_self, self_draft_spec, self_propose  # noqa: F401
from diffspec_jax.engine.verify import _accept, _pad_cols, _spec_cycle, _target_cycle, _tree_cycle  # noqa: F401
from diffspec_jax.engine.retrieve import _gather_heads, _retrieve, _select_anchors  # noqa: F401
from diffspec_jax.engine.loop import (  # noqa: F401
    BlockOut, Cadence, CycleRecord, DepthControl, LoopState, _any_global, _block, _block_out_init, _cadence_due,
    _cadence_record, _cadence_step, _count, _depth_observe, _emit, _loop_cycle, _max_global, _spec_cycle_at,
    block_out_specs, loop_specs)
from diffspec_jax.engine.compile import (  # noqa: F401
    CACHE_MIN_COMPILE_SECS, COMPILATION_CACHE_ENV, _CompileClock, _jax_cache_config_before, _Program, _signature,
    _spec_tree, bind, build_programs, capacity_bucket, compilation_cache_setting, enable_compilation_cache,
    param_spec_key, program_specs)
from diffspec_jax.engine.session import Session, compiled, default_session  # noqa: F401
from diffspec_jax.engine.controllers import _RetrievalControl, _ShapeControl  # noqa: F401
from diffspec_jax.engine.driver import (  # noqa: F401
    DEFAULT_BLOCK_CYCLES, STOP_IDS_MULTIPLE, GenerateResult, GenerateStats, _loop_init, _Output, _put, _replay,
    _retrieve_after_prefill, _stop_ids, _timed_retrieve, _validate, generate)
