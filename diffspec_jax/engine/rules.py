"""Host-side rules that :func:`~diffspec_jax.engine.driver.generate` and the server's slot engine
(:class:`diffspec_jax.serving.scheduler.SlotEngine`, over :mod:`diffspec_jax.engine.slots`) share, each written
once: checking a request's arguments (:func:`validate`), the :class:`~diffspec_jax.engine.state.Plan` of a run
(:func:`make_plan`), the cache positions a sequence needs (:func:`positions_needed`), cycles per device block (:func:`block_cycles`), the draft's dtype (:func:`draft_dtype`), which program runs a prefill chunk
(:func:`first_chunk_program`), stop ids as a device input (:func:`stop_ids`), which rows retrieve right after
prefill (:func:`retrieves_after_prefill`), and reading a block's per-cycle record into the host's books
(:func:`replay`).

The device's own controllers (the retrieval cadence and the adaptive chain depth, their fresh rows included) are
defined once, in :mod:`diffspec_jax.engine.loop`; the host reads what they decided from each block's
:class:`~diffspec_jax.engine.loop.CycleRecord`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from diffspec_jax import sharding
from diffspec_jax.config import SamplingConfig, SpecConfig
from diffspec_jax.engine.controllers import ShapeControl
from diffspec_jax.engine.loop import CycleRecord
from diffspec_jax.engine.state import Plan
from diffspec_jax.errors import ConfigError, InputError
from diffspec_jax.models import ensure_tree_supported
from diffspec_jax.retrieval_control import RetrievalBook
from diffspec_jax.target import TargetModel, check_token_ids

#: cycles per device-loop block (``generate(block_cycles=None)``, the server's ``EngineConfig.block_cycles``): the
#: host reads results, streams tokens and updates the progress bar once per block, so streaming latency is at most
#: this many cycles (about 0.1 s at 64K context on an H200), while the host's per-block work (a few ms) hides behind
#: the block in flight
DEFAULT_BLOCK_CYCLES = 16

#: stop ids are passed as a static-size int32 array padded with -1 to a multiple of this (no recompiles for a
#: different stop set of similar size)
STOP_IDS_MULTIPLE = 8


def _is_int(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, np.integer))


def validate(target: TargetModel, draft, prompts, max_new_tokens: int, spec: SpecConfig, sampling: SamplingConfig,
             block_cycles) -> list[np.ndarray]:
    """Check the arguments :func:`generate` shares with the server (the server checks its settings with one
    one-token prompt); returns the prompts as int32 arrays. ``draft`` is a loaded draft or ``None``."""
    if not isinstance(spec, SpecConfig):
        raise ConfigError(f"spec must be a SpecConfig, got {type(spec).__name__}")
    if not isinstance(sampling, SamplingConfig):
        raise ConfigError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if block_cycles is not None and (not _is_int(block_cycles) or block_cycles < 1):
        raise ConfigError(f"block_cycles must be an integer >= 1 (or None for the default), got {block_cycles!r}")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise InputError("prompts must be a non-empty list of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)):
            raise InputError(f"prompt {i} is text; pass token ids (tokenize first)")
        if len(p) == 0:
            raise InputError(f"prompt {i} is empty; every prompt needs at least one token")
        out.append(check_token_ids(p, target.config.vocab_size, f"prompt {i}"))  # int32 [T]: no per-token Python
    if spec.deterministic and target.config.is_hybrid:
        raise ConfigError("deterministic covers attention-only targets: a hybrid target's DeltaNet layers scan a "
                          "verify block's rows in another order than single decode steps; leave deterministic off")
    if draft is not None:
        if draft.config.vocab_size != target.config.vocab_size:
            raise ConfigError(f"vocabulary mismatch: draft vocab_size {draft.config.vocab_size} vs target "
                              f"{target.config.vocab_size}")
        draft.config.resolve_aux_layers(target.config)
        spec.context.check_target(target.config)
        if spec.tree:
            ensure_tree_supported(target.config)
    return out


def make_plan(target: TargetModel, draft, spec: SpecConfig, sampling: SamplingConfig, capacity: int, *, mesh=None,
              drafter=None, paging=None,
              row_sampling: bool = False) -> Plan:
    """The :class:`Plan` of a run (``draft``: a loaded draft or ``None``). The target's EOS ids are left out: stop
    ids are an input of the device loop (:func:`stop_ids`), not part of its programs, so targets that differ only
    in them share the compiled programs. A plan built before its capacity is known (``capacity=0``) already
    answers :attr:`~Plan.k` and :attr:`~Plan.k_block`."""
    draft_tp = sharding.draft_tp_for(mesh, spec.draft_tensor_parallel_size, draft is not None)
    return Plan(target=dataclasses.replace(target.config, eos_token_ids=()),
                draft=draft.config if draft is not None else None, spec=spec, sampling=sampling,
                aux_layers=draft.aux_layers if draft is not None else (), capacity=capacity, mesh=mesh,
                draft_tp=draft_tp, paging=paging, row_sampling=row_sampling, drafter=drafter)


def positions_needed(plan: Plan, tokens: int) -> int:
    """Cache positions a sequence of ``tokens`` tokens (prompt and generated) needs: the verify block of its last
    cycle writes :attr:`~Plan.k_block` + 1 rows past its committed length (K + 1, or a tree's ``max_tree_nodes +
    1``)."""
    return tokens + plan.k_block + 1


def block_cycles(plan: Plan, requested: int | None) -> int:
    """Cycles per device block: ``requested``, else :data:`DEFAULT_BLOCK_CYCLES`, or 1 for tree mode with
    host-shaped trees (their controllers then change the tree shape every cycle)."""
    return int(requested or (1 if plan.host_shaped else DEFAULT_BLOCK_CYCLES))


def draft_dtype(target: TargetModel, dparams):
    """The dtype of the draft's state: its weights' (a loaded draft's prepared params), else the target's."""
    return dparams["fc"].dtype if dparams else target.dtype


def first_chunk_program(plan: Plan, start: int, full_width: bool = True) -> bool:
    """Whether the prefill chunk from prompt position ``start`` runs the first-chunk program: the fast attention
    skips a first chunk's empty prefix (a full-width chunk from position 0); the reference kernels have nothing
    to skip (one program)."""
    return start == 0 and full_width and plan.kernels == "pallas"


def stop_ids(stops, width: int | None = None) -> np.ndarray:
    """Stop ids as the device loop takes them: int32 ``[S]``, sorted, padded with -1 to ``width`` or (``None``) to
    a multiple of :data:`STOP_IDS_MULTIPLE` (at least one)."""
    ids = sorted(int(s) for s in stops)
    size = width if width is not None else max(1, -(-len(ids) // STOP_IDS_MULTIPLE)) * STOP_IDS_MULTIPLE
    if len(ids) > size:
        raise ConfigError(f"{len(ids)} stop ids; at most {size} fit")
    return np.array(ids + [-1] * (size - len(ids)), np.int32)


def retrieves_after_prefill(plan: Plan, lengths: np.ndarray) -> np.ndarray:
    """bool ``[B]``: the rows of prompt ``lengths`` that DiffSpec's retrieval runs for right after prefill (when
    ``retrieve_after_prefill`` is on), from the last prompt position's query: those whose context does not fit the
    history budget (scoring would change nothing)."""
    lengths = np.asarray(lengths)
    if not (plan.diffspec and plan.spec.context.retrieve_after_prefill):
        return np.zeros(lengths.shape, bool)
    return lengths - 1 > plan.spec.history_budget


def replay(rec: CycleRecord, steps: int, rows: np.ndarray, host_len: np.ndarray, shape: ShapeControl,
           book: RetrievalBook | None, call_ms: float | None) -> None:
    """Read a block's per-cycle record into the host's books, cycle by cycle as the device decided: the committed
    lengths ``host_len`` (per sequence), the draft's shape (tree caps and node budget learn from it; the adaptive
    depth is read), and the retrieval counters (the cadence's decisions and the retrievals' anchors, each booked
    with ``call_ms`` split over the rows that retrieved after that cycle). ``rows[r]``: the sequence in batch row
    ``r``."""
    for c in range(steps):
        due_rows = []
        for r in np.nonzero(rec.live[c])[0]:
            seq, m = int(rows[r]), int(rec.m[c, r])
            host_len[seq] += m + 1
            shape.observe(seq, m, None if rec.depth is None else (int(rec.depth[c, r]), int(rec.floor[c, r])))
            if book is not None:
                due = bool(rec.due[c, r])
                book.cycle(seq, due=due, since=int(rec.since[c, r]), interval=int(rec.interval[c, r]),
                           working_len=int(rec.n[c, r]), window=int(rec.window[c, r]))
                if due:
                    due_rows.append(r)
        for r in due_rows:
            seq = int(rows[r])
            book.retrieved(seq, rec.anchors[:, c, r], int(host_len[seq]) - 1, (call_ms or 0.0) / len(due_rows),
                           after_prefill=False)
