"""``generate()``: the host side of decoding.

It validates the request, sizes the cache (:func:`~diffspec_jax.engine.compile.capacity_bucket`), runs the prefill,
reads the first token, then keeps one device-loop block in flight ahead of the one it reads
(:func:`~diffspec_jax.engine.loop._block`): per block read it streams the new tokens (and, given a tokenizer, their
text, matching stop strings: :class:`diffspec_jax.stopping.SequenceText`), replays the per-cycle record into the
host controllers (:mod:`diffspec_jax.engine.controllers`) and, between blocks, drops finished sequences from the
batch (compaction).
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
from diffspec_jax.engine.compile import _CompileClock, capacity_bucket, enable_compilation_cache, param_spec_key
from diffspec_jax.engine.controllers import _RetrievalControl, _ShapeControl
from diffspec_jax.engine.loop import Cadence, CycleRecord, DepthControl, LoopState, loop_specs
from diffspec_jax.engine.prefill import _PrefillAcc
from diffspec_jax.engine.drafter import draft_spec, split_draft
from diffspec_jax.engine.session import Session, default_session
from diffspec_jax.engine.prefix_cache import PrefixCache
from diffspec_jax.engine.state import Plan, shared_pools, with_pools
from diffspec_jax.errors import ConfigError, InputError
from diffspec_jax.stopping import FINISH_LENGTH, FINISH_STOP, SequenceText
from diffspec_jax.validation import check_generate_args, check_page_size, check_text_args
from diffspec_jax.models import ensure_tree_supported
from diffspec_jax.target import DEFAULT_PREFILL_CHUNK, TargetModel, check_token_ids, pad_prompts
from pallas_kernels.common import use_kernels

#: cycles per device-loop block (``generate(block_cycles=None)``): the host reads results, streams tokens and
#: updates the progress bar once per block, so streaming latency is at most this many cycles (about 0.1 s at 64K
#: context on an H200), while the host's per-block work (a few ms) hides behind the block in flight
DEFAULT_BLOCK_CYCLES = 16

#: stop ids are passed as a static-size int32 array padded with -1 to a multiple of this (no recompiles for a
#: different stop set of similar size)
STOP_IDS_MULTIPLE = 8


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


def _validate(target: TargetModel, draft, prompts, max_new_tokens: int, spec: SpecConfig,
              sampling: SamplingConfig, block_cycles) -> list[np.ndarray]:
    """Check the arguments :func:`generate` shares with the server; returns the prompts as int32 arrays."""
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


def _put(plan: Plan, tree, specs):
    """Host arrays onto the device, laid out by ``specs`` when the plan has a mesh."""
    if plan.mesh is None:
        return jax.tree_util.tree_map(jnp.asarray, tree)
    return jax.tree_util.tree_map(lambda x, s: jax.device_put(x, NamedSharding(plan.mesh, s)), tree, specs)


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


def _stop_ids(stops: set[int]) -> np.ndarray:
    """Stop ids as int32 ``[S]`` padded with -1 to a multiple of :data:`STOP_IDS_MULTIPLE` (at least one)."""
    ids = sorted(int(s) for s in stops)
    size = max(1, -(-len(ids) // STOP_IDS_MULTIPLE)) * STOP_IDS_MULTIPLE
    return np.array(ids + [-1] * (size - len(ids)), np.int32)


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
    return loop.replace(done=jnp.logical_or(loop.done, _put(plan, mask, P(sharding.DP if plan.dp > 1 else None))))


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
            controllers once per block. Default :data:`DEFAULT_BLOCK_CYCLES` (16): streaming latency of at most
            16 cycles. Tree mode with ``hazard`` branching or the adaptive node budget defaults to 1 (those host
            controllers then change the tree shape every cycle, as they learn); an explicit value there keeps
            the shape fixed within a block.
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
    spec = SpecConfig() if spec is None else spec
    session = default_session() if session is None else session
    if not isinstance(session, Session):
        raise ConfigError(f"session must be a diffspec_jax.engine.Session, got {type(session).__name__}")
    choice = split_draft(draft)
    draft = choice.model
    if choice.drafter is not None and proposer is not None:
        raise ConfigError("a custom proposer drafts alone; it cannot be combined with draft='self' or a named "
                          "drafter")
    prompts = _validate(target, draft, prompts, max_new_tokens, spec, sampling, block_cycles)
    seed, stop_token_ids, max_cache_len, prefill_chunk = check_generate_args(
        target.config.vocab_size, seed=seed, stop_token_ids=stop_token_ids, max_cache_len=max_cache_len,
        prefill_chunk=prefill_chunk, on_tokens=on_tokens, progress=progress, proposer=proposer, mesh=mesh)
    stop = check_text_args(stop, tokenizer, on_text, skip_special_tokens)
    tc = target.config
    spec, drafter = draft_spec(choice, spec, tc, proposer)
    speculative = drafter is not None
    if proposer is not None and spec.tree:
        raise ConfigError("a custom proposer drafts chains; it cannot be combined with diffspec_verification_mode="
                          "'tree'")
    k = spec.num_speculative_tokens if speculative else 0
    if spec.tree and speculative:
        k_block = spec.verification.max_nodes  # the tree block occupies max_tree_nodes + 1 cache rows
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
    draft_tp = sharding.draft_tp_for(mesh, spec.draft_tensor_parallel_size, draft is not None)
    capacity = (round_capacity(max_cache_len) if max_cache_len is not None
                else capacity_bucket(need, tc.max_position_embeddings + k_block + 1))
    if prefix_cache is not None:
        if not isinstance(prefix_cache, PrefixCache):
            raise ConfigError(f"prefix_cache must be a diffspec_jax.PrefixCache, got {type(prefix_cache).__name__}")
        if page_size not in (None, prefix_cache.page_size):
            raise ConfigError(f"page_size={page_size} differs from the prefix cache's ({prefix_cache.page_size})")
        page_size = prefix_cache.page_size
    paging = _paging(page_size, capacity, len(prompts), mesh)
    if prefix_cache is not None:
        paging = (prefix_cache.num_pages, page_size)
    # the stop ids are an input of the device loop, not part of its programs: targets that differ only in their
    # EOS ids share the compiled programs
    plan = Plan(target=dataclasses.replace(tc, eos_token_ids=()),
                draft=draft.config if draft is not None else None, spec=spec, sampling=sampling,
                aux_layers=draft.aux_layers if draft is not None else (), capacity=capacity, mesh=mesh,
                draft_tp=draft_tp, paging=paging, drafter=drafter, kv_cache_dtype=check_kv_cache_dtype(kv_cache_dtype))
    enable_compilation_cache()
    stops = set(tc.eos_token_ids if stop_token_ids is None else stop_token_ids)
    tparams, dparams = session.prepare_params(target, draft, mesh, draft_tp)
    fns = session.programs(plan, param_spec_key(tparams) if mesh is not None else None,
                           param_spec_key(dparams) if mesh is not None else None)
    progs = fns.programs
    real = len(prompts)
    if plan.dp > 1 and real % plan.dp:  # pad the batch to a multiple of the data-parallel axis with dummy rows
        prompts = prompts + [prompts[0]] * (plan.dp - real % plan.dp)
        lengths = np.array([len(p) for p in prompts], np.int32)
    batch = len(prompts)
    # the memory it needs (state, prefill temporaries) against what the device has free, before allocating any
    ddtype = dparams["fc"].dtype if dparams else target.dtype
    device = plan.mesh.devices.flat[0] if plan.mesh is not None else None
    with use_kernels(plan.kernels):  # the default chunk width depends on the kernels (flash prefill on GPUs)
        mem = memory.plan_memory(plan, lengths, prefill_chunk, tparams, dparams, target.dtype, ddtype,
                                 memory.device_memory(device))
    memory.check_fits(mem, max_new_tokens=max_new_tokens)
    cycles = block_cycles or (1 if plan.host_shaped else DEFAULT_BLOCK_CYCLES)
    stats = GenerateStats(num_sequences=real, num_speculative_tokens=k,
                          draft_context_policy=spec.context.policy if plan.model_draft else None,
                          verification_mode="tree" if plan.tree_mode else "linear" if speculative else None,
                          block_cycles=int(cycles), cache_capacity=capacity, memory=mem.to_dict())
    ctl = _RetrievalControl(spec, batch) if plan.diffspec else None
    shape = _ShapeControl(plan, lengths)
    clock = _CompileClock()
    bar = None
    if progress:
        bar = tqdm(total=real * max_new_tokens, unit="tok", leave=False)
    texts = None
    if tokenizer is not None:
        texts = [SequenceText(tokenizer, stop, skip_special_tokens=skip_special_tokens) for _ in range(real)]
    out = _Output(batch, real, max_new_tokens, stops, on_tokens, bar, texts, on_text)

    # ---- prefill, the first token, the retrieval after prefill
    t0 = time.perf_counter()
    starts = np.zeros(batch, np.int32)  # prompt tokens already in the cache (a prefix cache's reused pages)
    run = None
    if prefix_cache is not None:
        run = prefix_cache.admit(plan, prompts, max_new_tokens + k_block + 1, target.dtype)
        starts, table = run.starts, run.table
    elif paging is not None:  # sequence b holds pages b * P' .. (b + 1) * P' - 1 of the pool (P' pages per sequence)
        table = np.arange(paging[0], dtype=np.int32).reshape(batch, -1)
    kept = prefix_cache.pools if prefix_cache is not None else ()
    state = progs.init(batch, target.dtype, ddtype, not kept)(clock, jax.random.PRNGKey(seed))
    if paging is not None:
        state = with_pools(state, kept)
        state = state.replace(target_cache=state.target_cache.replace(pages=_put(plan, table, P(None, None))))
    stats.cached_tokens = [int(x) for x in starts[:real]]
    width = mem.prefill_width
    n_chunks = -(-int((lengths - starts).max()) // width)
    tokens = pad_prompts([p[s:] for p, s in zip(prompts, starts)], width * n_chunks + 1)
    acc = _PrefillAcc(logits=jnp.zeros((batch, tc.vocab_size), jnp.float32),
                      aux=jnp.zeros((batch, max(1, len(plan.aux_layers) * tc.hidden_size)), target.dtype),
                      score_q=jnp.zeros((batch, tc.num_attention_heads, tc.head_dim), jnp.float32),
                      score_lse=jnp.zeros((batch, tc.num_attention_heads), jnp.float32))
    jl = jnp.asarray(lengths)
    for c in range(n_chunks):
        s = c * width
        # the fast attention skips a first chunk's empty prefix; the reference has nothing to skip (one program)
        first = c == 0 and plan.kernels == "pallas" and not starts.any()
        chunk = progs.prefill_first if first else progs.prefill_chunk
        state, acc = chunk(clock, tparams, dparams, state, acc, jnp.asarray(tokens[:, s:s + width]),
                           jnp.asarray(tokens[:, s + 1:s + width + 1]), jnp.asarray(starts + s), jl)
    context = None  # a drafter's view of the prompts (a prefix cache's reused pages hold no tokens)
    if plan.drafter_context:
        context = _put(plan, pad_prompts(prompts, capacity), P(sharding.DP if plan.dp > 1 else None, None))
    state, first = progs.start_decode(clock, state, acc, jl, context)
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
    out.stopped.clear()  # the first tokens' stop strings are in the initial done flags
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
            if res.done[r]:
                out.end(seq)
        loop = _stop_rows(plan, loop, rows, out)
        hist += res.hist.sum(axis=0)
        if res.record is not None:
            _replay(res.record, int(res.steps), used, host_len, shape, ctl, call_ms)
        live = ~out.done[rows]
        if live.any():  # compact: finished sequences stop costing work (the next dispatch runs the smaller batch)
            size = 1 << (int(live.sum()) - 1).bit_length()
            size = -(-size // plan.dp) * plan.dp
            # the smaller state is a copy beside the current one: skipped when the device has no room for it
            if size <= len(rows) // 2 and memory.room_for(mem.state_bytes * size // batch, device):
                fill = np.nonzero(~live)[0][: size - int(live.sum())]
                order = np.concatenate([np.nonzero(live)[0], fill]).astype(np.int64)
                state, loop = state.take(order), loop.take(order)
                rows = rows[order]
    # blocks still in flight started after every sequence had finished (they ran no cycle), or before a stop
    # string ended the last ones (they ran the cycles of one block)
    jax.block_until_ready((state.length, loop.done))
    stats.decode_s = time.perf_counter() - t1 - (clock.seconds - compile_before)
    stats.compile_s = clock.seconds
    if bar is not None:
        bar.close()
    tokens, reasons, texts = out.result(real)
    stats.new_tokens = sum(len(t) for t in tokens)
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
    # tokens the device decoded (stop strings may drop some of them from the result) after each first token
    decoded = sum(len(t) for t in out.tokens[:real]) - real
    stats.decode_tokens_per_s = decoded / stats.decode_s if stats.decode_s > 0 and decoded > 0 else None
    if ctl is not None:
        stats.retrieval = ctl.status(real)
    after = memory.device_memory(device)
    stats.peak_bytes_in_use = after.get("peak_bytes_in_use") if after is not None else None
    if run is not None:  # positions with final K/V: all but the newest token's (and the draft store's pending rows)
        lag = plan.k + 1 if plan.draft is not None else 0
        seqs = [list(prompts[b]) + list(out.tokens[b]) for b in range(real)]
        prefix_cache.release(run, seqs, [len(q) - 1 - lag for q in seqs], shared_pools(state))
    return GenerateResult(tokens=tokens, stats=stats, finish_reasons=reasons, texts=texts)


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
    if plan.spec.context.retrieve_after_prefill:
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
