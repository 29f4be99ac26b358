"""``generate()``: the host side of decoding, as the steps of one token's path.

:func:`generate` checks the request and makes its :class:`Plan` (:func:`_prepare`: the cache capacity,
:func:`~diffspec_jax.engine.compile.capacity_bucket`, the compiled programs, the memory check), runs the prefill and
reads the first token (:func:`_prefill`, with DiffSpec's retrieval after prefill), then decodes in device-loop
blocks, one block in flight ahead of the one it reads (:func:`_decode`,
:func:`~diffspec_jax.engine.loop._block`): per block read it streams the new tokens (and, given a tokenizer, their
text, matching stop strings: :class:`diffspec_jax.stopping.SequenceText`), reads the per-cycle record into the
host's books (:func:`~diffspec_jax.engine.rules.replay`) and, between blocks, drops finished sequences from the
batch (compaction); :func:`_finish` gathers the result and its statistics. The rules these steps share with the
server's slot engine are in :mod:`diffspec_jax.engine.rules`.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from diffspec_jax import sharding
from diffspec_jax.cache import round_capacity
from diffspec_jax.config import SamplingConfig, SpecConfig, check_kv_cache_dtype
from diffspec_jax.engine import memory
from diffspec_jax.engine.compile import CompileClock, capacity_bucket, enable_compilation_cache, param_spec_key
from diffspec_jax.engine.controllers import ShapeControl
from diffspec_jax.engine.drafter import draft_spec, split_draft
from diffspec_jax.engine.loop import LoopState, loop_specs, start_cadence, start_depth
from diffspec_jax.engine.prefill import PrefillAcc
from diffspec_jax.engine.prefix_cache import PrefixCache
from diffspec_jax.engine.rules import (
    block_cycles as cycles_per_block, draft_dtype, first_chunk_program, make_plan, positions_needed, replay,
    retrieves_after_prefill, stop_ids, validate)
from diffspec_jax.engine.session import Session, default_session
from diffspec_jax.engine.state import DecodeState, Plan, shared_pools, with_pools
from diffspec_jax.errors import ConfigError, InputError
from diffspec_jax.retrieval_control import RetrievalBook
from diffspec_jax.stopping import FINISH_LENGTH, FINISH_STOP, SequenceText
from diffspec_jax.target import DEFAULT_PREFILL_CHUNK, TargetModel, pad_prompts
from diffspec_jax.validation import check_generate_args, check_page_size, check_text_args
from pallas_kernels.common import use_kernels


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

    Memory: ``memory`` holds the memory model's figures of the call, per device
    (:meth:`diffspec_jax.engine.memory.MemoryPlan.to_dict`: weights, K/V, the rest of the state, one prefill
    chunk's width, count and temporaries, and the device's limit and bytes in use before the call, ``None`` where
    it does not report them); ``peak_bytes_in_use`` is the device's peak bytes in use after the call (the
    process's high-water mark: this call's own peak when the call raised it; ``None`` on CPUs).

    ``cached_tokens[i]``: prompt i's leading tokens served from a prefix cache (``generate(prefix_cache=...)``), not
    prefilled.

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
    cached_tokens: list[int] = field(default_factory=list)
    retrieval: dict[str, Any] | None = None
    memory: dict[str, Any] | None = None
    peak_bytes_in_use: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class GenerateResult:
    """What :func:`generate` returns, per prompt (prompt excluded).

    Attributes:
        tokens: the generated ids. They end with the stop id that ended the sequence, if one did; a stop string
            drops every token after the fewest that hold the text before it (a token straddling the match, part
            text before it and part stop string, is kept, so ``decode(tokens)`` then runs a few characters past
            ``texts[i]``).
        stats: :class:`GenerateStats`.
        finish_reasons: ``"stop"`` when a stop id (EOS) or a stop string ended the sequence, ``"length"`` when it
            reached ``max_new_tokens``.
        texts: with a ``tokenizer``: the decoded text, cut exactly before the first stop string
            (``tokenizer.decode(tokens, skip_special_tokens=...)`` when none matched); ``None`` without one.
    """

    tokens: list[list[int]]
    stats: GenerateStats
    finish_reasons: list[str] = field(default_factory=list)
    texts: list[str] | None = None


def _put(plan: Plan, tree, specs):
    """Host arrays onto the device, laid out by ``specs`` when the plan has a mesh."""
    if plan.mesh is None:
        return jax.tree_util.tree_map(jnp.asarray, tree)
    return jax.tree_util.tree_map(lambda x, s: jax.device_put(x, NamedSharding(plan.mesh, s)), tree, specs)


def _rows_spec(plan: Plan, *rest) -> P:
    """The PartitionSpec of a batch-first host array (batch over ``dp``)."""
    return P(sharding.DP if plan.dp > 1 else None, *rest)


def _paging(page_size: int | None, capacity: int, batch: int, mesh: Mesh | None) -> tuple[int, int] | None:
    """``Plan.paging`` for ``generate(page_size=...)``: a pool of whole pages per sequence (``capacity``, a multiple
    of the attention tile, is one of the page size)."""
    if page_size is None:
        return None
    check_page_size(page_size)
    if mesh is not None and sharding.mesh_size(mesh, sharding.DP) > 1:
        raise ConfigError("a paged cache (page_size) holds one pool for the whole batch: use a mesh without "
                          "data parallelism (dp=1)")
    return batch * (capacity // page_size), page_size


class _Output:
    """The host's copy of the generated tokens: per-sequence lists, done flags, streaming, stop strings and the
    progress bar.

    ``done[s]``: sequence s needs no more cycles (the device ended it, a stop string did, or it is padding);
    ``cut[s]``: a stop string ended it (its later tokens are ignored); ``stopped`` lists the sequences a stop
    string ended since the driver last told the device (:func:`_stop_rows`).
    """

    def __init__(self, batch: int, real: int, max_new_tokens: int, stops: set[int], on_tokens, bar,
                 texts: list[SequenceText] | None = None, on_text=None):
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.done = np.arange(batch) >= real
        self.ended = self.done.copy()
        self.cut = np.zeros(batch, bool)
        self.stopped: list[int] = []
        self.max_new, self.stops, self.on_tokens, self.bar = max_new_tokens, stops, on_tokens, bar
        self.texts, self.on_text = texts, on_text

    def first(self, seq: int, tok: int) -> None:
        """The prefill's token of sequence ``seq``, which may end it already."""
        self.add(seq, [tok])
        if tok in self.stops or self.max_new <= 1:
            self.end(seq)

    def add(self, seq: int, toks: list[int]) -> None:
        if not toks or self.cut[seq]:
            return
        self.tokens[seq].extend(toks)
        if self.bar is not None:
            self.bar.update(len(toks))
        if self.texts is None:
            self._deliver(seq, toks, "")
            return
        text = self.texts[seq]
        piece, ids = text.push(toks)
        self._deliver(seq, ids, piece)
        if text.stopped:
            self.cut[seq] = self.done[seq] = self.ended[seq] = True
            self.stopped.append(seq)

    def end(self, seq: int) -> None:
        """The device ended sequence ``seq`` (a stop id or its token limit): the rest of its text and ids."""
        if self.ended[seq]:
            return
        self.done[seq] = self.ended[seq] = True
        if self.texts is not None:
            piece, ids = self.texts[seq].finish()
            self._deliver(seq, ids, piece)
            self.cut[seq] = self.texts[seq].stopped

    def _deliver(self, seq: int, ids: list[int], text: str) -> None:
        if ids and self.on_tokens is not None:
            self.on_tokens(seq, ids)
        if text and self.on_text is not None:
            self.on_text(seq, text)

    def result(self, real: int) -> tuple[list[list[int]], list[str], list[str] | None]:
        """``(tokens, finish_reasons, texts)`` of the real sequences."""
        reasons = [FINISH_STOP if self.cut[s] or (self.tokens[s] and self.tokens[s][-1] in self.stops)
                   else FINISH_LENGTH for s in range(real)]
        if self.texts is None:
            return self.tokens[:real], reasons, None
        return [t.tokens for t in self.texts], reasons, [t.text for t in self.texts]


def _stop_rows(plan: Plan, loop: LoopState, rows: np.ndarray, out: _Output) -> LoopState:
    """Mark on the device the rows whose sequences a stop string ended (one small dispatch, no host sync): the
    block after the one in flight skips them."""
    if not out.stopped:
        return loop
    mask = np.isin(rows, out.stopped)
    out.stopped.clear()
    return loop.replace(done=jnp.logical_or(loop.done, _put(plan, mask, _rows_spec(plan))))


def generate(target: TargetModel, draft, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             spec: SpecConfig | None = None, sampling: SamplingConfig = SamplingConfig(), seed: int = 0,
             stop_token_ids: Sequence[int] | None = None, max_cache_len: int | None = None,
             prefill_chunk: int = DEFAULT_PREFILL_CHUNK, on_tokens: Callable[[int, list[int]], None] | None = None,
             progress: bool = False, proposer: Callable | None = None, mesh: Mesh | None = None,
             block_cycles: int | None = None, stop: Sequence[str] | str | None = None, tokenizer: Any = None,
             skip_special_tokens: bool = True,
             on_text: Callable[[int, str], None] | None = None, session: Session | None = None,
             page_size: int | None = None, prefix_cache: PrefixCache | None = None,
             kv_cache_dtype: str = "auto") -> GenerateResult:
    """Generate continuations of ``prompts`` with speculative decoding (or the target alone when ``draft=None``).

    Args:
        target: from :func:`diffspec_jax.load_target`; draft: from :func:`diffspec_jax.load_draft`, ``"self"`` (the
            target drafts for itself over its working set: :mod:`diffspec_jax.engine.self_draft`, chains only, the
            sink chunk always kept), ``"ngram"`` (prompt lookup: the continuation of the longest recent n-gram match
            in the sequence, no draft model, :mod:`diffspec_jax.engine.ngram`, settings ``spec.ngram``, chains
            only) or ``None``. ``spec.ngram.first`` with a draft or ``"self"``: prompt lookup where an n-gram
            matches, the draft elsewhere.
        prompts: a list of token-id lists (lengths may differ).
        max_new_tokens: exactly this many tokens per prompt unless a stop token comes first.
        spec: :class:`SpecConfig` (K, draft context, verification, kernels; default ``SpecConfig()``, built at the
            call); K and the draft settings are ignored without a draft.
        sampling: :class:`SamplingConfig` (temperature 0 = greedy).
        seed: sampling seed.
        stop_token_ids: generation of a sequence stops after one of these (default: the target's EOS ids;
            ``()`` never stops early).
        max_cache_len: cache capacity per sequence (default: the longest prompt + max_new_tokens + K + 1, rounded
            up to a coarse bucket, :func:`capacity_bucket`, so that nearby prompt lengths reuse the compiled
            programs).
        prefill_chunk: the widest prefill chunk, in tokens per sequence (default: the backend's,
            :func:`diffspec_jax.target.default_prefill_chunk`, narrowed where the device reports its memory until
            one chunk's temporaries fit beside the state, :func:`diffspec_jax.engine.memory.memory_chunk_cap`).
        on_tokens: called as ``on_tokens(i, new_ids)`` whenever prompt i gains tokens (streaming: once per
            prompt for the first token, then once per block and prompt). With a ``tokenizer`` it gets the ids
            that became final with their text (see ``on_text``), so the pieces add up to ``result.tokens[i]``.
        progress: show a progress bar on stderr (updated once per block).
        proposer: a custom draft function with the signature of :func:`draft_propose` (tests use an oracle).
        mesh: a ``("dp", "tp")`` mesh from :func:`diffspec_jax.make_mesh` for tensor (and data) parallelism;
            the draft is sharded like the target or replicated per ``spec.draft_tensor_parallel_size``.
        block_cycles: decode cycles per device-loop dispatch; the host reads results, streams and updates its
            controllers once per block. Default :data:`~diffspec_jax.engine.rules.DEFAULT_BLOCK_CYCLES` (16):
            streaming latency of at most 16 cycles. Tree mode with ``hazard`` branching or the adaptive node
            budget defaults to 1 (those host controllers then change the tree shape every cycle, as they learn);
            an explicit value there keeps the shape fixed within a block.
        stop: stop strings (one string or a list), matched on the decoded text on the host after each block
            read: the sequence ends at the first occurrence, its text is cut exactly before it and its tokens
            after the fewest that hold that text are dropped (:class:`GenerateResult`). Needs ``tokenizer``.
        tokenizer: the target's tokenizer (``decode(ids, skip_special_tokens=...)``, a transformers tokenizer):
            gives ``result.texts``, stop strings and ``on_text``.
        skip_special_tokens: leave special tokens out of the text (default; stop strings are matched on it).
        on_text: called as ``on_text(i, new_text)`` with text of prompt i as it becomes final (incremental
            decoding never splits a character; a tail that could begin a stop string waits for the next block);
            the pieces add up to ``result.texts[i]``. Needs ``tokenizer``.
        session: the :class:`~diffspec_jax.engine.session.Session` that keeps the compiled programs and prepared
            params (default: :func:`~diffspec_jax.engine.session.default_session`, shared by every call).
        page_size: ``None`` (default): each sequence's K/V in its own buffer; a power of two from 16 to 256: the
            K/V (and the draft's store) in one pool of pages of that many tokens, read through a page table, as the
            server keeps them (:mod:`diffspec_jax.cache`). The output is the same; one data-parallel replica only.
        prefix_cache: a :class:`~diffspec_jax.engine.prefix_cache.PrefixCache` (paged, its page size): each prompt
            reuses the full pages that earlier calls with it computed for the same leading tokens and is prefilled
            from there; this call's pages stay in it (``stats.cached_tokens`` says how many tokens each reused).
        kv_cache_dtype: the target's K/V storage, ``"auto"`` (default: the model's dtype) or ``"fp8"``
            (``float8_e4m3fn`` rows with a float32 scale per token and KV head, dequantized inside attention:
            :mod:`diffspec_jax.kv_quant`); speculation stays lossless relative to the target run on the same cache.
    Returns:
        :class:`GenerateResult` with ``.tokens``, ``.stats``, ``.finish_reasons`` and ``.texts``.
    Raises:
        InputError / ConfigError for bad input (empty prompt, prompt longer than the cache, ...).
        OutOfMemoryError: (an InputError) on a device that reports its memory, the batch's state and one prefill
            chunk's temporaries need more than it has free (:mod:`diffspec_jax.engine.memory`); checked before
            anything is allocated or compiled.
    """
    t_call = time.perf_counter()
    req = _validate(target, draft, prompts, max_new_tokens=max_new_tokens, spec=spec, sampling=sampling,
                    seed=seed, stop_token_ids=stop_token_ids, max_cache_len=max_cache_len,
                    prefill_chunk=prefill_chunk, on_tokens=on_tokens, progress=progress, proposer=proposer, mesh=mesh,
                    block_cycles=block_cycles, stop=stop, tokenizer=tokenizer,
                    skip_special_tokens=skip_special_tokens, on_text=on_text, session=session)  # 1. validate
    plan = _plan(target, req, page_size, prefix_cache, kv_cache_dtype)  # 2. plan: capacity, paging, programs, memory
    call = _prepare(target, req, plan, prefix_cache, t_call)
    state = _prefill(call)  # 3. prefill, the first tokens, the retrieval after prefill
    state, tally = _decode(call, state)  # 4. decode blocks
    return _finish(call, state, tally)  # 5. finish: the result and its statistics


@dataclass
class _Request:
    """A :func:`generate` call's arguments, checked and normalised (:func:`_validate`)."""

    prompts: list[np.ndarray]
    draft: Any  # a loaded draft or None
    drafter: Any  # the plan's Drafter (engine.drafting), None: target-only
    spec: SpecConfig
    sampling: SamplingConfig
    max_new_tokens: int
    seed: int
    stops: set[int]
    max_cache_len: int | None
    prefill_chunk: int | None
    block_cycles: int | None
    mesh: Mesh | None
    session: Session
    stop: tuple[str, ...]
    tokenizer: Any
    skip_special_tokens: bool
    on_tokens: Callable | None
    on_text: Callable | None
    progress: bool


@dataclass
class _Call:
    """What the steps of one :func:`generate` call share: the plan and its programs, the batch (padded to a
    multiple of the data-parallel axis; rows >= ``real`` are padding), the host's books and the statistics."""

    req: _Request
    target: TargetModel
    plan: Plan
    progs: Any
    tparams: Any
    dparams: Any
    prompts: list[np.ndarray]
    lengths: np.ndarray
    real: int
    mem: memory.MemoryPlan
    device: Any
    cycles: int
    stats: GenerateStats
    out: _Output
    shape: ShapeControl
    book: RetrievalBook | None
    clock: CompileClock
    t_call: float
    prefix_cache: PrefixCache | None
    bar: Any = None
    prefix_run: Any = None
    call_ms: float | None = None  # a standalone retrieval's wall time (booked for every retrieval in the loop)
    anchors: np.ndarray | None = None  # int32 [B, A] the retrieval after prefill's (rank 0's)
    retrieved: np.ndarray | None = None  # bool [B] the rows it ran for

    @property
    def batch(self) -> int:
        return len(self.prompts)


def _validate(target: TargetModel, draft, prompts, *, max_new_tokens, spec, sampling, seed, stop_token_ids,
              max_cache_len, prefill_chunk, on_tokens, progress, proposer, mesh, block_cycles, stop, tokenizer,
              skip_special_tokens, on_text, session) -> _Request:
    """Step 1 of :func:`generate`: check every argument (named errors) and resolve the draft choice."""
    spec = SpecConfig() if spec is None else spec
    session = default_session() if session is None else session
    if not isinstance(session, Session):
        raise ConfigError(f"session must be a diffspec_jax.engine.Session, got {type(session).__name__}")
    choice = split_draft(draft)
    if choice.drafter is not None and proposer is not None:
        raise ConfigError("a custom proposer drafts alone; it cannot be combined with draft='self' or a named "
                          "drafter")
    prompts = validate(target, choice.model, prompts, max_new_tokens, spec, sampling, block_cycles)
    seed, stop_token_ids, max_cache_len, prefill_chunk = check_generate_args(
        target.config.vocab_size, seed=seed, stop_token_ids=stop_token_ids, max_cache_len=max_cache_len,
        prefill_chunk=prefill_chunk, on_tokens=on_tokens, progress=progress, proposer=proposer, mesh=mesh)
    stop = check_text_args(stop, tokenizer, on_text, skip_special_tokens)
    spec, drafter = draft_spec(choice, spec, target.config, proposer)
    if proposer is not None and spec.tree:
        raise ConfigError("a custom proposer drafts chains; it cannot be combined with diffspec_verification_mode="
                          "'tree'")
    stops = set(target.config.eos_token_ids if stop_token_ids is None else stop_token_ids)
    return _Request(prompts=prompts, draft=choice.model, drafter=drafter, spec=spec,
                    sampling=sampling, max_new_tokens=int(max_new_tokens), seed=seed, stops=stops,
                    max_cache_len=max_cache_len, prefill_chunk=prefill_chunk, block_cycles=block_cycles,
                    mesh=mesh, session=session, stop=stop, tokenizer=tokenizer,
                    skip_special_tokens=skip_special_tokens, on_tokens=on_tokens, on_text=on_text,
                    progress=progress)


def _plan(target: TargetModel, req: _Request, page_size: int | None, prefix_cache: PrefixCache | None,
          kv_cache_dtype: str = "auto") -> Plan:
    """Step 2 of :func:`generate`: the run's :class:`Plan`: its cache capacity (what the longest prompt with
    ``max_new_tokens`` needs, :func:`~diffspec_jax.engine.rules.positions_needed`, bucketed; or ``max_cache_len``)
    and paging."""
    tc = target.config
    plan = make_plan(target, req.draft, req.spec, req.sampling, 0, mesh=req.mesh, drafter=req.drafter)
    longest = max(len(p) for p in req.prompts)
    need = positions_needed(plan, longest + req.max_new_tokens)
    if longest + req.max_new_tokens > tc.max_position_embeddings:
        raise InputError(f"the longest prompt ({longest} tokens) + max_new_tokens ({req.max_new_tokens}) exceeds "
                         f"the target's context window (max_position_embeddings {tc.max_position_embeddings})")
    if req.max_cache_len is not None and req.max_cache_len < need:
        raise InputError(f"the longest prompt ({longest} tokens) + max_new_tokens ({req.max_new_tokens}) + "
                         f"{'max_tree_nodes' if plan.tree_mode else 'K'} + 1 = {need} positions exceed the cache "
                         f"capacity max_cache_len={req.max_cache_len}")
    capacity = (round_capacity(req.max_cache_len) if req.max_cache_len is not None
                else capacity_bucket(need, positions_needed(plan, tc.max_position_embeddings)))
    if prefix_cache is not None:
        if not isinstance(prefix_cache, PrefixCache):
            raise ConfigError(f"prefix_cache must be a diffspec_jax.PrefixCache, got {type(prefix_cache).__name__}")
        if page_size not in (None, prefix_cache.page_size):
            raise ConfigError(f"page_size={page_size} differs from the prefix cache's ({prefix_cache.page_size})")
        page_size = prefix_cache.page_size
    paging = _paging(page_size, capacity, len(req.prompts), req.mesh)
    if prefix_cache is not None:
        paging = (prefix_cache.num_pages, page_size)
    return dataclasses.replace(plan, capacity=capacity, paging=paging,
                               kv_cache_dtype=check_kv_cache_dtype(kv_cache_dtype))


def _prepare(target: TargetModel, req: _Request, plan: Plan, prefix_cache: PrefixCache | None,
             t_call: float) -> _Call:
    """Step 2 of :func:`generate` (continued): the params and compiled programs of the plan, the batch padded for data
    parallelism, the memory check (before anything is allocated), the statistics and the host's books."""
    enable_compilation_cache()
    tparams, dparams = req.session.prepare_params(target, req.draft, plan.mesh, plan.draft_tp)
    keyed = plan.mesh is not None
    progs = req.session.programs(plan, param_spec_key(tparams) if keyed else None,
                                 param_spec_key(dparams) if keyed else None).programs
    prompts, real = list(req.prompts), len(req.prompts)
    if plan.dp > 1 and real % plan.dp:  # pad the batch to a multiple of the data-parallel axis with dummy rows
        prompts += [prompts[0]] * (plan.dp - real % plan.dp)
    lengths = np.array([len(p) for p in prompts], np.int32)
    batch = len(prompts)
    # the memory it needs (state, prefill temporaries) against what the device has free, before allocating any
    device = plan.mesh.devices.flat[0] if plan.mesh is not None else None
    with use_kernels(plan.kernels):  # the default chunk width depends on the kernels (flash prefill on GPUs)
        mem = memory.plan_memory(plan, lengths, req.prefill_chunk, tparams, dparams, target.dtype,
                                 draft_dtype(target, dparams), memory.device_memory(device))
    memory.check_fits(mem, max_new_tokens=req.max_new_tokens)
    cycles = cycles_per_block(plan, req.block_cycles)
    stats = GenerateStats(num_sequences=real, num_speculative_tokens=plan.k,
                          draft_context_policy=plan.spec.context.policy if plan.model_draft else None,
                          verification_mode="tree" if plan.tree_mode else "linear" if plan.speculative else None,
                          block_cycles=cycles, cache_capacity=plan.capacity, memory=mem.to_dict())
    bar = tqdm(total=real * req.max_new_tokens, unit="tok", leave=False) if req.progress else None
    texts = None
    if req.tokenizer is not None:
        texts = [SequenceText(req.tokenizer, req.stop, skip_special_tokens=req.skip_special_tokens)
                 for _ in range(real)]
    out = _Output(batch, real, req.max_new_tokens, req.stops, req.on_tokens, bar, texts, req.on_text)
    return _Call(req=req, target=target, plan=plan, progs=progs, tparams=tparams, dparams=dparams, prompts=prompts,
                 lengths=lengths, real=real, mem=mem, device=device, cycles=cycles, stats=stats, out=out,
                 shape=ShapeControl(plan, batch), book=RetrievalBook(plan.spec, batch) if plan.diffspec else None,
                 clock=CompileClock(), t_call=t_call, prefix_cache=prefix_cache, bar=bar)


def _prefill(call: _Call) -> DecodeState:
    """Step 3 of :func:`generate`: the cache set-up, the chunked prefill, the first token of every prompt (streamed),
    and DiffSpec's retrieval after prefill."""
    plan, progs, clock, stats, batch = call.plan, call.progs, call.clock, call.stats, call.batch
    t0 = time.perf_counter()
    starts = np.zeros(batch, np.int32)  # prompt tokens already in the cache (a prefix cache's reused pages)
    table = None
    if call.prefix_cache is not None:
        reserve = positions_needed(plan, call.req.max_new_tokens)
        call.prefix_run = call.prefix_cache.admit(plan, call.prompts, reserve, call.target.dtype)
        starts, table = call.prefix_run.starts, call.prefix_run.table
    elif plan.paging is not None:  # sequence b holds pages b * P' .. (b + 1) * P' - 1 of the pool (P' per sequence)
        table = np.arange(plan.paging[0], dtype=np.int32).reshape(batch, -1)
    kept = call.prefix_cache.pools if call.prefix_cache is not None else ()
    state = progs.init(batch, call.target.dtype, draft_dtype(call.target, call.dparams), not kept)(
        clock, jax.random.PRNGKey(call.req.seed))
    if plan.paging is not None:
        state = with_pools(state, kept)
        state = state.replace(target_cache=state.target_cache.replace(pages=_put(plan, table, P(None, None))))
    stats.cached_tokens = [int(x) for x in starts[:call.real]]
    width, lengths = call.mem.prefill_width, call.lengths
    n_chunks = -(-int((lengths - starts).max()) // width)
    tokens = pad_prompts([p[s:] for p, s in zip(call.prompts, starts)], width * n_chunks + 1)
    acc = PrefillAcc.zeros(plan, batch, call.target.dtype)
    jl = jnp.asarray(lengths)
    for s in range(0, n_chunks * width, width):
        chunk = progs.prefill_first if first_chunk_program(plan, int(starts.max()) + s) else progs.prefill_chunk
        state, acc = chunk(clock, call.tparams, call.dparams, state, acc, jnp.asarray(tokens[:, s:s + width]),
                           jnp.asarray(tokens[:, s + 1:s + width + 1]), jnp.asarray(starts + s), jl)
    context = None  # a drafter's view of the prompts (a prefix cache's reused pages hold no tokens)
    if plan.drafter_context:
        context = _put(plan, pad_prompts(call.prompts, plan.capacity), _rows_spec(plan, None))
    state, first = progs.start_decode(clock, state, acc, jl, context)
    first = np.asarray(first)
    stats.host_syncs += 1
    stats.ttft_s = time.perf_counter() - call.t_call - clock.seconds
    for b in range(call.real):
        call.out.first(b, int(first[b]))
    if call.book is not None:
        state = _retrieve_after_prefill(call, state)
        stats.host_syncs += 1
    jax.block_until_ready(state.length)
    stats.prefill_s = time.perf_counter() - t0 - clock.seconds
    return state


def _retrieve_after_prefill(call: _Call, state: DecodeState) -> DecodeState:
    """DiffSpec's retrieval right after prefill, from the last prompt position's query, for the rows
    :func:`~diffspec_jax.engine.rules.retrieves_after_prefill` names, booked with its wall time (compile excluded),
    which is also ``call.call_ms``, the time booked for each retrieval inside the device loop. When no row
    retrieves now, a probe that selects for no row (nothing changes) is timed instead."""
    mask = retrieves_after_prefill(call.plan, call.lengths) & (np.arange(call.batch) < call.real)
    if not call.plan.spec.context.retrieve_after_prefill:
        for i in range(call.real):
            call.book.skip_prefill(i)
    before, t = call.clock.seconds, time.perf_counter()
    state, anchors = call.progs.retrieve(call.clock, call.tparams, call.dparams, state, jnp.asarray(mask))
    anchors = np.asarray(anchors)  # [ranks, B, A]: every tensor-parallel rank's selection
    call.call_ms = ms = (time.perf_counter() - t - (call.clock.seconds - before)) * 1e3
    for r in np.nonzero(mask)[0]:
        call.book.retrieved(int(r), anchors[:, r], int(call.lengths[r]) - 1, ms / int(mask.sum()), True)
    call.anchors, call.retrieved = anchors[0], mask
    return state


def _loop_init(call: _Call) -> LoopState:
    """The :class:`LoopState` after prefill (rows >= ``real`` are padding), on the device: each sequence's fresh
    retrieval cadence (after the retrieval after prefill) and adaptive depth, which the host's report starts from."""
    plan, out, rows = call.plan, call.out, np.arange(call.batch)
    cad = depth = None
    if plan.diffspec:
        cad = start_cadence(plan, call.retrieved, call.anchors, call.lengths - 1)
    if plan.adaptive_depth:
        depth = start_depth(plan, call.lengths)
        for seq, (d, f) in enumerate(zip(np.asarray(depth.depth), np.asarray(depth.floor))):
            call.shape.reset(seq, (int(d), int(f)))
    loop = LoopState(done=out.done.copy(), count=np.array([len(out.tokens[s]) for s in rows], np.int32),
                     limit=np.where(rows < call.real, call.req.max_new_tokens, 0).astype(np.int32), cadence=cad,
                     depth=depth)
    # as host arrays first: rows the rules computed once (a depth and its floor) become distinct device buffers,
    # as the block program, which donates the loop state, needs
    return _put(plan, jax.tree_util.tree_map(np.array, loop), loop_specs(plan))


@dataclass
class _Tally:
    """Per-sequence counts over the blocks read: verifications, accepted and drafted tokens, the committed length,
    and the accepted-depth histogram."""

    cycles: np.ndarray
    accepted: np.ndarray
    drafted: np.ndarray
    length: np.ndarray
    hist: np.ndarray

    @classmethod
    def create(cls, lengths: np.ndarray, k: int) -> _Tally:
        z = lambda: np.zeros(len(lengths), np.int64)  # noqa: E731
        return cls(cycles=z(), accepted=z(), drafted=z(), length=lengths.astype(np.int64).copy(),
                   hist=np.zeros(k + 1, np.int64))


def _decode(call: _Call, state: DecodeState) -> tuple[DecodeState, _Tally]:
    """Step 4 of :func:`generate`: the device loop, one block in flight ahead of the one the host reads (two; one when a
    block's tree shape needs the last block's record), until every sequence is done."""
    plan, stats, out, clock = call.plan, call.stats, call.out, call.clock
    compile_before, t1 = clock.seconds, time.perf_counter()
    rows = np.arange(call.batch)  # device row -> sequence
    loop = _loop_init(call)
    out.stopped.clear()  # the first tokens' stop strings are in the initial done flags
    stops = _put(plan, stop_ids(call.req.stops), P())
    program = call.progs.block(call.cycles)
    ahead = 1 if plan.host_shaped and call.cycles == 1 else 2
    pending: collections.deque = collections.deque()
    tally = _Tally.create(call.lengths, plan.k)
    while not out.done.all():
        while len(pending) < ahead:
            caps, budget = call.shape.block_inputs(rows)
            if caps is not None:
                caps, budget = _put(plan, (caps, budget), (_rows_spec(plan, None), _rows_spec(plan)))
            state, loop, res = program(clock, call.tparams, call.dparams, state, loop, stops, caps, budget)
            stats.blocks += 1
            pending.append((res, rows))
        res, used = pending.popleft()
        _read_block(call, jax.device_get(res), used, tally)
        loop = _stop_rows(plan, loop, rows, out)
        state, loop, rows = _compact(call, state, loop, rows)
    # blocks still in flight started after every sequence had finished (they ran no cycle), or before a stop
    # string ended the last ones (they ran the cycles of one block)
    jax.block_until_ready((state.length, loop.done))
    stats.decode_s = time.perf_counter() - t1 - (clock.seconds - compile_before)
    return state, tally


def _read_block(call: _Call, res, used: np.ndarray, tally: _Tally) -> None:
    """One block's results on the host: stream each row's new tokens, end the rows the device ended, count, and
    read the per-cycle record into the host's books."""
    call.stats.host_syncs += 1
    call.stats.cycles += int(res.steps)
    for r, seq in enumerate(used):
        tally.cycles[seq] += int(res.cycles[r])
        tally.accepted[seq] += int(res.accepted[r])
        tally.drafted[seq] += int(res.drafted[r])
        call.out.add(seq, res.tokens[r, : int(res.new[r])].tolist())
        if res.done[r]:
            call.out.end(seq)
    tally.hist += res.hist.sum(axis=0)
    if res.record is not None:
        replay(res.record, int(res.steps), used, tally.length, call.shape, call.book, call.call_ms)


def _compact(call: _Call, state: DecodeState, loop: LoopState, rows: np.ndarray):
    """Drop finished sequences from the batch: the next dispatch runs a batch of the next power of two (a multiple
    of ``dp``) at most half the size, when the device has room for the smaller state beside the current one.
    Returns ``(state, loop, rows)``."""
    live = ~call.out.done[rows]
    if not live.any():
        return state, loop, rows
    size = 1 << (int(live.sum()) - 1).bit_length()
    size = -(-size // call.plan.dp) * call.plan.dp
    if size <= len(rows) // 2 and memory.room_for(call.mem.state_bytes * size // call.batch, call.device):
        fill = np.nonzero(~live)[0][: size - int(live.sum())]
        order = np.concatenate([np.nonzero(live)[0], fill]).astype(np.int64)
        state, loop, rows = state.take(order), loop.take(order), rows[order]
    return state, loop, rows


def _finish(call: _Call, state: DecodeState, tally: _Tally) -> GenerateResult:
    """Step 5 of :func:`generate`: the result and its statistics; a prefix cache keeps the call's pages."""
    stats, plan, real, out = call.stats, call.plan, call.real, call.out
    stats.compile_s = call.clock.seconds
    if call.bar is not None:
        call.bar.close()
    tokens, reasons, texts = out.result(real)
    stats.new_tokens = sum(len(t) for t in tokens)
    stats.sequence_cycles, stats.accepted_tokens = int(tally.cycles.sum()), int(tally.accepted.sum())
    stats.drafted_tokens = int(tally.drafted.sum())
    stats.accepted_depth_histogram = [int(x) for x in tally.hist]
    stats.acceptance_per_position = [int(tally.hist[i + 1:].sum()) for i in range(plan.k)]
    if stats.sequence_cycles:
        stats.mean_tree_size = stats.drafted_tokens / stats.sequence_cycles if plan.tree_mode else None
        stats.mean_acceptance_length = (stats.accepted_tokens + stats.sequence_cycles) / stats.sequence_cycles
    stats.drafting = call.shape.report(real)
    stats.acceptance_length_per_sequence = [float((a + c) / c) if c else None
                                            for a, c in zip(tally.accepted[:real], tally.cycles[:real])]
    # tokens the device decoded (stop strings may drop some of them from the result) after each first token
    decoded = sum(len(t) for t in out.tokens[:real]) - real
    stats.decode_tokens_per_s = decoded / stats.decode_s if stats.decode_s > 0 and decoded > 0 else None
    if call.book is not None:
        stats.retrieval = call.book.status(real)
    after = memory.device_memory(call.device)
    stats.peak_bytes_in_use = after.get("peak_bytes_in_use") if after is not None else None
    if call.prefix_run is not None:  # positions with final K/V: all but the newest token's (and the draft store's
        lag = plan.k + 1 if plan.draft is not None else 0  # pending rows)
        seqs = [list(call.prompts[b]) + list(out.tokens[b]) for b in range(real)]
        call.prefix_cache.release(call.prefix_run, seqs, [len(q) - 1 - lag for q in seqs], shared_pools(state))
    return GenerateResult(tokens=tokens, stats=stats, finish_reasons=reasons, texts=texts)
