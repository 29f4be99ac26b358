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
* :mod:`~diffspec_jax.engine.controllers`: the host-side draft-shape controllers (tree mode);
* :mod:`~diffspec_jax.engine.rules`: the host-side rules :func:`generate` and the server's slot engine share;
* :mod:`~diffspec_jax.engine.driver`: :func:`generate`, the host side.

The device loop (``_block``, one jitted ``lax.while_loop``, state donated) runs up to ``block_cycles`` cycles per
dispatch. Per cycle and sequence it also: appends the emitted tokens to the block's output buffer and ends the
sequence at a stop id or at its token limit (:class:`LoopState` ``done`` / ``count`` / ``limit``); counts cycles,
accepted and drafted tokens and the accepted-depth histogram (:class:`BlockOut`); keeps the adaptive chain depth
(:class:`DepthControl`, its one definition); and decides the DiffSpec retrieval cadence (:class:`Cadence`, its one
definition), running the retrieval under ``lax.cond`` on the cycles where a sequence is due. The loop ends when every
sequence is done or the block's cycle budget is spent.

The host (``generate``) reads each block's :class:`BlockOut` once, after it has dispatched the next block (the
device never waits for Python): it streams the new tokens, reads the per-cycle :class:`CycleRecord` into its
books (the retrieval counters of ``stats.retrieval``, the adaptive depth's and the tree controllers' reports)
and, between blocks, drops finished sequences from the batch (compaction). Tree mode's branching caps and node
budget stay on the host (:class:`ShapeControl`; their float statistics are not mirrored on the device): they are
inputs of a block, fixed during it. When they change from cycle to cycle (``hazard`` branching, or the adaptive
node budget) the default block is one cycle with no block in flight ahead, so their trajectories are today's,
cycle by cycle; an explicit ``block_cycles > 1`` there updates them between blocks instead.

Everything on the device has static shapes, so nothing recompiles between cycles or blocks; the programs are
compiled ahead of time once per shape (``compile._Program``, their time reported as ``GenerateStats.compile_s``),
the cache capacity is bucketed (:func:`capacity_bucket`) so nearby prompt lengths share programs, and JAX's persistent
compilation cache is switched on at the first ``generate()`` call (:func:`enable_compilation_cache`).
"""

from __future__ import annotations

# the public names of the engine's modules (tests and benchmarks import anything else from its defining module)
from diffspec_jax.engine.state import DecodeState, Plan, init_state, state_specs
from diffspec_jax.engine.prefill import PrefillAcc
from diffspec_jax.engine.propose import draft_propose, draft_propose_tree
from diffspec_jax.engine.self_draft import SELF, is_self, self_draft_spec, self_propose
from diffspec_jax.engine.loop import (
    BlockOut, Cadence, CycleRecord, DepthControl, LoopState, block_out_specs, cadence_due, cadence_record,
    depth_observe, fresh_cadence, loop_specs, start_cadence, start_depth)
from diffspec_jax.engine.compile import (
    CACHE_MIN_COMPILE_SECS, COMPILATION_CACHE_ENV, CompileClock, bind, build_programs, capacity_bucket,
    compilation_cache_setting, enable_compilation_cache, param_spec_key, program_specs)
from diffspec_jax.engine.session import Session, compiled, default_session
from diffspec_jax.engine.controllers import ShapeControl
from diffspec_jax.engine.rules import (
    DEFAULT_BLOCK_CYCLES, STOP_IDS_MULTIPLE, block_cycles, draft_dtype, first_chunk_program, make_plan, replay,
    retrieves_after_prefill, stop_ids, validate)
from diffspec_jax.engine.driver import GenerateResult, GenerateStats, generate

__all__ = [
    "DecodeState", "Plan", "init_state", "state_specs", "PrefillAcc", "draft_propose", "draft_propose_tree", "SELF",
    "is_self", "self_draft_spec", "self_propose", "BlockOut", "Cadence", "CycleRecord", "DepthControl", "LoopState",
    "block_out_specs", "cadence_due", "cadence_record", "depth_observe", "fresh_cadence", "loop_specs",
    "start_cadence", "start_depth", "CACHE_MIN_COMPILE_SECS", "COMPILATION_CACHE_ENV", "CompileClock", "bind",
    "build_programs", "capacity_bucket", "compilation_cache_setting", "enable_compilation_cache", "param_spec_key",
    "program_specs", "Session", "compiled", "default_session", "ShapeControl", "DEFAULT_BLOCK_CYCLES",
    "STOP_IDS_MULTIPLE", "block_cycles", "draft_dtype", "first_chunk_program", "make_plan", "replay",
    "retrieves_after_prefill", "stop_ids", "validate", "GenerateResult", "GenerateStats", "generate",
]
