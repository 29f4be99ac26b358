"""The slot engine: continuous batching over a static number of request slots, speculative decoding included.

One :class:`SlotEngine` owns a batch of ``max_num_seqs`` slots whose K/V live in one pool of pages (a slot holds
the pages its request needs, through its page table; :mod:`diffspec_jax.paging` keeps the books, the prefix cache
and preemption) and runs in its own thread. Requests wait in a bounded queue; every waiting request that a free
slot and the pool can take is admitted at once, the full pages of its prompt that the prefix cache holds are
reused, and the rest is prefilled into that slot in chunks of one fixed width, a short tail in narrow ones (not
with a deterministic plan: :data:`NARROW_TAIL_CHUNKS`)
(:mod:`diffspec_jax.engine.slots`; the admission with the fewest tokens left goes first), then it decodes with the others in the engine's device loop
(:func:`~diffspec_jax.engine.loop._block`, every slot with its own stop ids, sampling parameters, key, working
cache and retrieval cadence). It leaves when it is done (a stop id, its token limit, a stop string, a
cancellation, its timeout) and the slot is reused.

Prefill is scheduled in one of two modes:

* **a wave** forms when requests are admitted while no slot decodes (the server starting, or every request of the
  last wave done): their prompts are prefilled back to back, without decode blocks in between, and once the
  wave's last chunk has run on the device its slots start together (first tokens, then decode blocks), as an
  offline ``generate()`` batch does: a request's first token waits for the wave's prefill, its later tokens do
  not. The host keeps at most :data:`PREFILL_AHEAD` chunks in flight, so a request that arrives while the wave's
  prefill runs joins it instead of waiting for interleaved chunks.
* **interleaved**: while slots decode, at most ``max_prefill_per_block`` prompt tokens (whole chunks, at least
  one) are prefilled between two decode blocks, so the running requests' inter-token latency grows by at most
  that much prefill per block.

Every program is compiled once, at warm-up; no mix of prompt lengths, sampling parameters, arrivals or prefill
modes compiles again (:attr:`SlotEngine.compiles` counts the engine's programs, :attr:`SlotEngine.xla_compiles`
every XLA compilation of the process).

As in ``generate()`` the host reads a block right after it has dispatched the next one, whether or not the device
reports the first finished yet, so results reach the requests exactly one block behind the device. (On a GPU the
call that dispatches a block returns only once the block's loop has run, its exit test being read back every
cycle, so the block before it is done. Reading a block only once ``is_ready()`` happened to say so, as an earlier
version did, delivered some blocks a block late: on the H200, with 8 clients, p99 inter-token latency went to 2.1x
its median.) First tokens are the exception: a request's first token, when no block before it is unread, is read
before the next block is dispatched, so time to first token does not wait for a block. Results reach a request
through its ``sink`` (called on the engine thread with :class:`Event` values); what happens to the text
(detokenization, stop strings) is the request's ``output`` processor, also run on the engine thread. A failure
while one request is admitted, prefilled, started or delivered fails that request alone (an ``error`` event, 500)
as long as the batch's device state is intact; a failure of the device programs fails every request, stops the
engine (:attr:`SlotEngine.error`) and calls :attr:`SlotEngine.on_failure`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import queue
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import jax
import numpy as np

from diffspec_jax.cache import round_capacity
from diffspec_jax.config import SamplingConfig, SpecConfig, check_kv_cache_dtype
from diffspec_jax.engine.compile import CompileClock, enable_compilation_cache, param_spec_key
from diffspec_jax.engine import memory
from diffspec_jax.engine.controllers import ShapeControl
from diffspec_jax.engine.drafter import draft_spec, split_draft
from diffspec_jax.engine.rules import (
    block_cycles, draft_dtype, first_chunk_program, make_plan, positions_needed, replay, retrieves_after_prefill,
    stop_ids, validate)
from diffspec_jax.engine.session import Session, default_session
from diffspec_jax.errors import ConfigError, DiffspecError, InputError
from diffspec_jax.mesh import make_mesh
from diffspec_jax.models.attention import DENSE_ATTENTION_MAX_TOKENS
from diffspec_jax.paging import OutOfPages, PageManager
from diffspec_jax.retrieval_control import RetrievalBook
from diffspec_jax.sampling import seed_key
from diffspec_jax.target import REFERENCE_PREFILL_CHUNK, TargetModel, check_token_ids
from diffspec_jax.utils import BACKEND_COMPILE_EVENT
from diffspec_jax.validation import check_bool, check_int, check_page_size, check_real

#: stop ids per request (the target's EOS ids included): a static width, so no stop set recompiles anything
MAX_STOP_IDS = 16
#: ``max_model_len`` when none is given: the target's context window, at most this
DEFAULT_MAX_MODEL_LEN = 4096
#: prefill chunk width on GPUs (CPUs: ``REFERENCE_PREFILL_CHUNK``): long enough for an efficient prefill, short
#: enough that a chunk interleaved between two decode blocks does not stall the running requests for long
GPU_PREFILL_CHUNK = 2048
#: tokens per K/V page on GPUs and elsewhere when ``block_size`` is not given: on an H200 a paged verify step
#: (32K x 8, Llama-3.1-8B shapes) read pages of 64 rows at 1.08x the contiguous step, every tile of 128 rows then
#: spanning two pages; pages of 128 rows hold a whole tile (docs/serving.md, "Measured")
GPU_BLOCK_SIZE, REFERENCE_BLOCK_SIZE = 128, 64
#: a prompt's tail of at most this many narrow (64-token) chunks is prefilled in those rather than one full chunk:
#: a hit in the prefix cache leaves one to two pages (the last page is reused only if the token after it matches
#: too), and a narrow chunk reads the cached prefix through the page table, where a full one would gather it.
#: Deterministic plans (``SpecConfig.deterministic``) never do: a narrow chunk's attention is a verify step's, whose
#: rounding differs from a full chunk's, so its positions' K/V (and later a greedy near-tie) would differ from
#: ``generate()`` alone's, which prefills in full-width chunks
NARROW_TAIL_CHUNKS = 4
#: prefill chunks in flight while a wave forms (the host waits for the oldest before it dispatches another)
PREFILL_AHEAD = 2
#: seconds the engine waits for a message while a wave's last chunks finish on the device
WAVE_POLL_S = 0.002
#: the window of the tokens/s gauge, seconds
RATE_WINDOW_S = 10.0


class QueueFull(DiffspecError):
    """The waiting queue is at ``max_waiting``: try again later (HTTP 503 with ``Retry-After``)."""


class EngineStopped(DiffspecError):
    """The engine is not running (not started, stopped, or stopped by an error)."""


@dataclass(frozen=True)
class EngineConfig:
    """Settings of a :class:`SlotEngine` (validated at construction).

    Attributes:
        max_num_seqs: request slots decoded together (the static batch) [8].
        max_model_len: the most tokens (prompt + generated) of one request [the target's context window, at most
            :data:`DEFAULT_MAX_MODEL_LEN`]; the cache capacity is this + the verify block, bucketed.
        prefill_chunk: prompt tokens per prefill chunk, one fixed width [512 on CPUs, :data:`GPU_PREFILL_CHUNK` on
            GPUs; at most the capacity].
        block_cycles: decode cycles per device block [16; 1 for tree mode with host-shaped trees].
        max_prefill_per_block: prompt tokens prefilled between two decode blocks while slots decode, rounded down
            to whole chunks (at least one) [one chunk]: the bound on how long a decode block waits behind prefill
            work. A larger value admits long prompts sooner (more throughput when requests arrive while others
            decode) at the cost of longer gaps between the running requests' tokens.
        max_waiting: requests waiting for a slot (beyond those the free slots take) at which
            :meth:`SlotEngine.submit` refuses more [256].
        request_timeout: seconds a request may take from submission to its last token (``None``: no limit)
            [600].
        block_size: tokens per page of the paged K/V pool (a power of two, 16 to 256) [:data:`GPU_BLOCK_SIZE`
            (128) on GPUs, :data:`REFERENCE_BLOCK_SIZE` (64) elsewhere].
        num_kv_blocks: pages in the pool (``None``: sized by ``kv_cache_memory_fraction`` on a device that reports
            its memory, else what ``max_num_seqs`` requests of ``max_model_len`` tokens need) [None].
        kv_cache_memory_fraction: the share of the device's memory the process may fill; the pool gets what is left
            of it after the weights [0.9].
        prefix_caching: reuse the K/V (and the draft's store) of full pages whose tokens a new request repeats
            [True; off for hybrid targets and the draft's ``full`` policy, whose state is not all in pages].
        tensor_parallel_size: devices the target is sharded over (a ``("dp", "tp")`` mesh of ``dp = 1`` over the
            first this many devices, :func:`diffspec_jax.make_mesh`), as ``generate(..., mesh=make_mesh(tp))``: the
            programs run per shard, the K/V pool is sharded by KV heads, the draft is sharded like the target or
            replicated as ``SpecConfig.draft_tensor_parallel_size`` says [1: one device].
        kv_cache_dtype: the target's K/V storage, ``"auto"`` (the model's dtype) or ``"fp8"`` (8-bit rows with a
            float32 scale per token and KV head, :mod:`diffspec_jax.kv_quant`: a page takes about half the bytes,
            so the pool holds about 1.9x the tokens) ["auto"].
    """

    max_num_seqs: int = 8
    max_model_len: int | None = None
    prefill_chunk: int | None = None
    block_cycles: int | None = None
    max_prefill_per_block: int | None = None
    max_waiting: int = 256
    request_timeout: float | None = 600.0
    block_size: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory_fraction: float = 0.9
    prefix_caching: bool = True
    tensor_parallel_size: int = 1
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        check_int(self.max_num_seqs, "max_num_seqs", min=1, max=4096)
        check_int(self.max_model_len, "max_model_len", min=2, none_ok=True)
        check_int(self.prefill_chunk, "prefill_chunk", min=1, none_ok=True)
        check_int(self.block_cycles, "block_cycles", min=1, none_ok=True)
        check_int(self.max_prefill_per_block, "max_prefill_per_block", min=1, none_ok=True)
        check_int(self.max_waiting, "max_waiting", min=0)
        check_real(self.request_timeout, "request_timeout", min=0.0, min_open=True, none_ok=True)
        if self.block_size is not None:
            check_page_size(self.block_size, "block_size")
        check_int(self.num_kv_blocks, "num_kv_blocks", min=1, none_ok=True)
        check_real(self.kv_cache_memory_fraction, "kv_cache_memory_fraction", min=0.0, max=1.0, min_open=True)
        check_bool(self.prefix_caching, "prefix_caching")
        check_int(self.tensor_parallel_size, "tensor_parallel_size", min=1)
        check_kv_cache_dtype(self.kv_cache_dtype)

    def prefill_width(self) -> int:
        """The prefill chunk's width before the cap at the cache capacity: ``prefill_chunk``, else the backend's
        default (also what ``generate()`` alone must be given to prefill a prompt in the same chunks)."""
        return self.prefill_chunk or (GPU_PREFILL_CHUNK if jax.default_backend() == "gpu" else REFERENCE_PREFILL_CHUNK)


@dataclass(frozen=True)
class SamplingParams:
    """One request's decoding parameters (validated at construction; errors are :class:`InputError`).

    Attributes:
        max_tokens: the most tokens to generate (>= 1).
        temperature, top_p, top_k: as :class:`SamplingConfig` (temperature 0 = greedy).
        seed: the request's sampling seed (``None``: a random one); a seed gives the same tokens whatever else
            runs in the batch.
        stop_token_ids: ids that end the request besides the target's EOS ids.
        ignore_eos: the EOS ids do not end the request.
    """

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        check_int(self.max_tokens, "max_tokens", min=1, error=InputError)
        try:
            cfg = SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
        except ConfigError as exc:
            raise InputError(str(exc)) from None
        object.__setattr__(self, "temperature", cfg.temperature)
        check_int(self.seed, "seed", min=-(2 ** 63), max=2 ** 64 - 1, none_ok=True, error=InputError)
        ids = tuple(check_int(t, f"stop_token_ids[{i}]", min=0, error=InputError)
                    for i, t in enumerate(self.stop_token_ids))
        object.__setattr__(self, "stop_token_ids", ids)
        check_bool(self.ignore_eos, "ignore_eos", error=InputError)


class OutputProcessor(Protocol):
    """What a request does with its tokens, run on the engine thread (:class:`diffspec_jax.stopping.SequenceText`
    is one): ``push(ids) -> (text that became final, ids)``, ``stopped`` (a stop string has matched: the request
    ends) and ``finish() -> (the rest of the text, ids)``."""

    stopped: bool

    def push(self, ids: Sequence[int]) -> tuple[str, list[int]]: ...

    def finish(self) -> tuple[str, list[int]]: ...


@dataclass
class Event:
    """What a request's sink receives: ``kind`` ``"tokens"`` (``token_ids`` and their ``text``), ``"finish"``
    (``finish_reason`` ``stop`` / ``length`` / ``abort``, with the usage counts) or ``"error"`` (``status``,
    ``message``, ``error_type``: the request failed)."""

    kind: str
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    status: int | None = None
    message: str | None = None
    error_type: str | None = None


class Request:
    """A request in the engine: prompt ids, :class:`SamplingParams`, ``sink(Event)`` (called on the engine
    thread), an optional :class:`OutputProcessor` and ``timeout`` (seconds from submission; default the engine's
    ``request_timeout``)."""

    def __init__(self, prompt_ids: Sequence[int], params: SamplingParams, sink: Callable[[Event], None],
                 output: OutputProcessor | None = None, request_id: str | None = None, timeout: float | None = None):
        self.id = request_id or uuid.uuid4().hex
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.params = params
        self.sink = sink
        self.output = output
        self.seed = params.seed % 2 ** 64 if params.seed is not None else secrets.randbits(64)
        self.arrival = time.monotonic()
        self.timeout = check_real(timeout, "timeout", min=0.0, min_open=True, none_ok=True, error=InputError)
        self.deadline: float | None = None
        self.tokens: list[int] = []
        self.finished = False
        self.finish_reason: str | None = None
        self.slot: int | None = None
        self.phase: str | None = None  # None (waiting), "prefill", "decode"
        self.cached_tokens: int | None = None  # prompt tokens served from the prefix cache (first admission)
        self.preemptions = 0
        self.admitted_seq = 0  # the engine's admission counter when it last joined a slot
        self.committed = 0  # positions of its current admission committed to the page manager
        #: tokens it generated before a preemption that its current admission has not re-emitted yet
        #: (:meth:`SlotEngine._admit`: the device replays them; they are not delivered twice)
        self.replay_left = 0
        self.first_token_at: float | None = None
        #: ``time.monotonic()`` when it was last admitted, its last prefill chunk and its start were dispatched
        #: (benchmarks break the time to its first token down with them)
        self.marks: dict[str, float] = {}
        self.cycles = 0
        self.accepted = 0


@dataclass
class _Admission:
    """A prompt being prefilled into a slot, chunk by chunk."""

    req: Request
    slot: int
    tokens: np.ndarray  # int32 [n_chunks * W + 1]: the context from ``start`` on, zero padded
    n_chunks: int  # chunks of the full width the context from ``start`` spans (its tail may run in narrow ones)
    acc: Any
    chunk: int = 0  # chunks dispatched
    start: int = 0  # the first position prefilled (the prefix before it is served from cached pages)
    length: int = 0  # the context's tokens: the prompt, and after a preemption the tokens generated before it
    done: int = 0  # tokens from ``start`` prefilled so far

    @property
    def left(self) -> int:
        """Context tokens still to prefill."""
        return self.length - self.start - self.done


class SlotEngine:
    """Continuous batching over fixed slots (see the module docstring).

    Args:
        target, draft: loaded models (``draft=None``: the target alone; ``draft="self"``: the target drafts for
            itself over its working set, :mod:`diffspec_jax.engine.self_draft`).
        spec: :class:`SpecConfig` (K, draft context, verification, kernels; default ``SpecConfig()``).
        config: :class:`EngineConfig`.
        eos_token_ids: the ids that end every request unless it asks ``ignore_eos`` (default: the target
            config's EOS ids).
        session: the :class:`~diffspec_jax.engine.session.Session` holding the compiled programs and the params
            laid out on the mesh (default: the process's :func:`~diffspec_jax.engine.session.default_session`).

    Raises :class:`~diffspec_jax.errors.ConfigError` for settings that cannot run: among them a
    ``tensor_parallel_size`` beyond the visible devices, or that the target's (or a sharded draft's) heads or MLP
    width do not divide, and a ``draft_tensor_parallel_size`` other than 1 or the target's.
        on_failure: called with the exception, on the engine thread, when the engine thread fails (after every
            request in it was failed): the server stops its process there (:attr:`on_failure`).
    """

    def __init__(self, target: TargetModel, draft=None, spec: SpecConfig | None = None,
                 config: EngineConfig = EngineConfig(), eos_token_ids: Sequence[int] | None = None,
                 session: Session | None = None, on_failure: Callable[[BaseException], Any] | None = None):
        if not isinstance(config, EngineConfig):
            raise ConfigError(f"config must be an EngineConfig, got {type(config).__name__}")
        spec = SpecConfig() if spec is None else spec
        self.session = session = default_session() if session is None else session
        choice = split_draft(draft)
        draft = choice.model
        validate(target, draft, [[0]], 1, spec, SamplingConfig(), config.block_cycles)
        spec, self.drafter = draft_spec(choice, spec, target.config)
        if spec.draft_sampling != "argmax":
            raise ConfigError(f"draft_sampling={spec.draft_sampling!r}: request slots draft by argmax (each slot "
                              f"samples with its own settings at verification); use draft_sampling='argmax'")
        tc = target.config
        self.target, self.draft, self.spec, self.config = target, draft, spec, config
        tp = config.tensor_parallel_size
        self.mesh = make_mesh(tp) if tp > 1 else None
        plan = make_plan(target, draft, spec, SamplingConfig(), 0, mesh=self.mesh, drafter=self.drafter,
                         row_sampling=True)
        self.max_model_len = config.max_model_len or min(tc.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        if self.max_model_len > tc.max_position_embeddings:
            raise ConfigError(f"max_model_len {self.max_model_len} exceeds the target's context window "
                              f"(max_position_embeddings {tc.max_position_embeddings})")
        self.num_slots = b = config.max_num_seqs
        # the page table reaches max_model_len + the verify block, plus whole pages never allocated that hold a
        # parked slot's masked writes (slots.parked_length)
        psize = self.page_size = config.block_size or (GPU_BLOCK_SIZE if jax.default_backend() == "gpu"
                                                       else REFERENCE_BLOCK_SIZE)
        #: pages one request of ``max_model_len`` tokens needs
        self.request_pages = -(-positions_needed(plan, self.max_model_len) // psize)
        capacity = round_capacity((self.request_pages + -(-positions_needed(plan, 0) // psize))
                                  * psize)  # (whole attention tiles, for the tiled prefill)
        self.max_pages = capacity // psize
        plan = dataclasses.replace(plan, capacity=capacity, paging=(1, psize), kv_cache_dtype=config.kv_cache_dtype)
        # the params laid out on the mesh (refusing heads that do not divide), before the pool is sized beside them
        self.tparams, self.dparams = session.prepare_params(target, draft, self.mesh, plan.draft_tp)
        ddtype = draft_dtype(target, self.dparams)
        device = self.mesh.devices.flat[0] if self.mesh is not None else None
        #: bytes of one page on each device (with a mesh: its KV heads of the target's K/V and of a sharded draft's
        #: store, a replicated draft's whole store)
        self.page_bytes = memory.page_bytes(plan, target.dtype, ddtype)
        self.num_pages = self._pool_pages(config, capacity, self.page_bytes, psize, device)
        need = self.request_pages
        if self.num_pages < need:
            raise ConfigError(f"the KV pool has {self.num_pages} pages of {psize} tokens, fewer than one request of "
                              f"max_model_len {self.max_model_len} needs ({need}): lower max_model_len or give the "
                              f"pool more pages (num_kv_blocks, kv_cache_memory_fraction)")
        self.plan = plan = dataclasses.replace(plan, paging=(self.num_pages, psize))
        self.prefix_caching = config.prefix_caching and plan.prefix_reusable
        self._namespace = plan.prefix_namespace(target.dtype)
        #: the draft's store lags the committed length by the pending entries (projected at the next draft step 0)
        self._store_lag = plan.k + 1 if plan.draft_store else 0
        #: a preempted request's generated tokens are replayed by the decode loop (chains and the target alone);
        #: tree blocks prefill them with its prompt
        self._replays = not plan.tree_mode
        self.pager = self._new_pager()
        self._table = np.full((b, self.max_pages), self.num_pages, np.int32)
        self._table_dirty = True
        self._admitted = 0  # admission counter: preemption takes the most recently admitted request
        self.prefill_chunk = min(config.prefill_width(), capacity)
        #: the replay buffer of a start that replays nothing and whose drafter reads no context (never read)
        self._no_context = np.zeros((1, capacity), np.int32)
        #: prefill chunks between two decode blocks while slots decode
        self.chunks_per_block = max(1, (config.max_prefill_per_block or self.prefill_chunk) // self.prefill_chunk)
        self.block_cycles = block_cycles(plan, config.block_cycles)
        self.eos = tuple(tc.eos_token_ids if eos_token_ids is None else eos_token_ids)
        if len(self.eos) > MAX_STOP_IDS:
            raise ConfigError(f"{len(self.eos)} EOS ids; at most {MAX_STOP_IDS} stop ids fit a slot")
        check_token_ids(list(self.eos) or [0], tc.vocab_size, "eos_token_ids")
        enable_compilation_cache()
        self.clock = CompileClock()
        keys = (param_spec_key(self.tparams), param_spec_key(self.dparams)) if self.mesh is not None else (None, None)
        self._progs = session.slot_programs(plan, *keys)
        self._block = session.programs(plan, *keys).programs.block(int(self.block_cycles))
        self._init = self._progs.init(b, target.dtype, ddtype)
        self._acc = self._progs.acc(target.dtype)
        self._book = RetrievalBook(spec, b) if plan.diffspec else None
        self._shape = ShapeControl(plan, b)
        self._host_len = np.zeros(b, np.int64)
        self._stops = np.full((b, MAX_STOP_IDS), -1, np.int32)
        self._stopsets: list[frozenset] = [frozenset()] * b
        self.slots: list[Request | None] = [None] * b
        self._waiting: collections.deque[Request] = collections.deque()
        self._inbox: queue.Queue = queue.Queue()
        self._pending: collections.deque = collections.deque()
        self._admissions: dict[int, _Admission] = {}  # slot -> its prompt being prefilled
        self._forming = False  # a wave forms: admitted while no slot decodes; its slots start together
        self._starting: list[_Admission] = []  # the wave's prefilled admissions, waiting for the rest of it
        self._chunks_since_block = 0
        self._chunk_marks: collections.deque = collections.deque()  # chunks in flight (forming a wave)
        self._lock = threading.Lock()
        self._queued = 0  # submitted, not yet admitted or dropped (inbox + waiting)
        self._free = b  # slots without a request
        self._rate: collections.deque = collections.deque()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._listening = False
        self.ready = threading.Event()
        self.error: BaseException | None = None
        #: ``on_failure(exc)``: what to do when the engine thread fails (see the constructor)
        self.on_failure = on_failure
        self.xla_compiles = 0
        self.warmup_compiles: int | None = None
        self.warmup_xla_compiles: int | None = None
        self.counters = collections.Counter()
        #: garbage collections while serving (after warm-up): full (generation 2) ones, seconds paused, longest pause
        self.gc_full_collections, self.gc_pause_s, self.gc_pause_max_s = 0, 0.0, 0.0
        self._gc_started: float | None = None
        self._state = self._loop = None

    def _new_pager(self) -> PageManager:
        return PageManager(self.num_pages, self.page_size, prefix_caching=self.prefix_caching,
                           namespace=self._namespace, lookahead=self.plan.page_lookahead)

    @staticmethod
    def _pool_pages(config: EngineConfig, capacity: int, page_bytes: int, page_size: int, device=None) -> int:
        """Pages of the K/V pool: ``num_kv_blocks``, else what ``kv_cache_memory_fraction`` of the device's memory
        holds beside what is in use (the weights), else (a device that does not report its memory, e.g. a CPU)
        what ``max_num_seqs`` requests of the full capacity need, as fixed slots reserved. ``page_bytes`` and the
        memory are per device (``device``: the mesh's first, every shard holding the same share: its KV heads of
        every page, its slice of the weights)."""
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        fixed = config.max_num_seqs * (capacity // page_size)
        stats = memory.device_memory(device)
        if stats is None or "bytes_limit" not in stats:
            return fixed
        room = config.kv_cache_memory_fraction * stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        return max(1, min(int(room // page_bytes), fixed))

    # ------------------------------------------------------------------------------------------- public API
    def pool_summary(self) -> str:
        """One line on the K/V pool: its storage, pages, tokens, bytes a page, how many max-length requests fit,
        prefix caching."""
        tokens = self.num_pages * self.page_size
        fit = self.num_pages // self.request_pages
        caching = "on" if self.prefix_caching else ("off" if not self.config.prefix_caching else
                                                    "off (this model's state is not all in pages)")
        kind = "fp8: e4m3 rows, a float32 scale per token and KV head" if self.plan.kv_cache_dtype == "fp8" else \
            str(np.dtype(self.target.dtype))
        return (f"K/V pool ({kind}): {self.num_pages} pages x {self.page_size} tokens = {tokens} tokens, "
                f"{self.page_bytes / 1024:.1f} KiB a page per device, {fit} request(s) of max_model_len at once; "
                f"prefix caching {caching}")

    def parallel_summary(self) -> str:
        """Where the programs run: ``one device``, or the tensor-parallel mesh and the draft's layout on it."""
        if self.mesh is None:
            return "one device"
        draft = ("" if self.draft is None else ", the draft replicated" if self.plan.draft_tp == 1
                 else ", the draft sharded like it")
        return f"the target sharded over {self.plan.tp} devices (tp {self.plan.tp}{draft})"

    @property
    def capacity(self) -> int:
        return self.plan.capacity

    @property
    def compiles(self) -> int:
        """The engine's programs compiled so far (warm-up included)."""
        return self.clock.count

    def start(self, warmup: bool = True) -> SlotEngine:
        """Create the slots, compile every program (``warmup``: by running one throw-away request through
        them), move every object then alive out of the garbage collector's generations (``gc.freeze()``: later
        collections never walk the compiled programs' Python objects again) and start the engine thread.
        Returns ``self``."""
        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        self._listening = True
        self._state, self._loop = self._init(self.clock)
        if warmup:
            self._warmup()
        # what compiling left on the heap (hundreds of thousands of long-lived objects) leaves the collector's view:
        # a full collection over it took 90-150 ms on a development CPU, holding the GIL: every stream waits
        gc.collect()
        gc.freeze()
        gc.callbacks.append(self._on_gc)
        self.warmup_compiles, self.warmup_xla_compiles = self.compiles, self.xla_compiles
        self._thread = threading.Thread(target=self._run, name="diffspec-slot-engine", daemon=True)
        self._thread.start()
        self.ready.set()
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the engine thread (requests still in it are aborted)."""
        self._stopping = True
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)
        if self._listening:
            jax.monitoring.unregister_event_duration_listener(self._on_event)
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
            self._listening = False

    def submit(self, req: Request) -> None:
        """Queue ``req`` (thread-safe). Raises :class:`InputError` for a request that cannot run here,
        :class:`QueueFull` when ``max_waiting`` requests wait already, :class:`EngineStopped`."""
        self.check_request(len(req.prompt_ids), req.params.max_tokens)
        check_token_ids(req.prompt_ids, self.target.config.vocab_size, "the prompt")
        n_stop = len(set(req.params.stop_token_ids) | (set() if req.params.ignore_eos else set(self.eos)))
        if n_stop > MAX_STOP_IDS:
            raise InputError(f"{len(req.params.stop_token_ids)} stop token ids; at most "
                             f"{MAX_STOP_IDS - len(self.eos)} fit beside the model's EOS ids")
        check_token_ids(list(req.params.stop_token_ids) or [0], self.target.config.vocab_size, "stop_token_ids")
        if self.error is not None or self._stopping or not self.ready.is_set():
            raise EngineStopped("the engine is not running" + (f" (it failed: {self.error})" if self.error else ""))
        with self._lock:
            waiting = self._queued - self._free  # what the free slots cannot take
            if waiting >= self.config.max_waiting:
                self.counters["rejected_queue_full"] += 1
                raise QueueFull(f"{waiting} requests are waiting for a slot (max_waiting="
                                f"{self.config.max_waiting}); retry later")
            self._queued += 1
        timeout = req.timeout if req.timeout is not None else self.config.request_timeout
        if timeout is not None:
            req.deadline = req.arrival + timeout
        self._inbox.put(("submit", req))

    def check_request(self, prompt_tokens: int, max_tokens: int) -> None:
        """:class:`InputError` unless a prompt of ``prompt_tokens`` and ``max_tokens`` new tokens fit
        ``max_model_len``."""
        if prompt_tokens < 1:
            raise InputError("the prompt is empty; it needs at least one token")
        if prompt_tokens + max_tokens > self.max_model_len:
            raise InputError(f"this model's maximum context length is {self.max_model_len} tokens; the request has "
                             f"{prompt_tokens} prompt tokens and max_tokens {max_tokens} ({prompt_tokens + max_tokens}"
                             f" in all): shorten the prompt or lower max_tokens")
        # (the pool holds at least one max_model_len request: checked at construction)

    def abort(self, request_id: str) -> None:
        """Cancel a request (thread-safe): it leaves the queue or its slot; its sink gets ``finish`` with
        ``finish_reason="abort"`` unless it had finished."""
        self._inbox.put(("abort", request_id))

    def abort_all(self) -> None:
        """Cancel every request submitted so far (thread-safe), as :meth:`abort` cancels one: a server shutting
        down ends the requests it stopped waiting for."""
        self._inbox.put(("abort_all", None))

    def metrics(self) -> dict[str, Any]:
        """A snapshot of the engine's gauges and counters (thread-safe)."""
        now = time.monotonic()
        with self._lock:
            while self._rate and self._rate[0][0] < now - RATE_WINDOW_S:
                self._rate.popleft()
            recent = sum(n for _, n in self._rate)
            span = min(RATE_WINDOW_S, now - self._rate[0][0]) if self._rate else 0.0
            c = dict(self.counters)
            queued = self._queued
        running = sum(1 for r in self.slots if r is not None)
        queued = max(0, queued)
        cycles = c.get("cycles", 0)
        pages = self.pager.stats
        return {"requests_running": running, "requests_waiting": queued, "slots_used": running,
                "slots_total": self.num_slots, "tokens_per_s": recent / span if span > 0 else 0.0,
                "kv_blocks_used": pages.used, "kv_blocks_cached": pages.evictable, "kv_blocks_total": pages.total,
                "kv_block_size": self.page_size, "prefix_cache_queries": pages.prefix_queries,
                "prefix_cache_hits": pages.prefix_hits, "prefix_caching": self.prefix_caching,
                "mean_acceptance_length": (c.get("accepted", 0) + cycles) / cycles if cycles else None,
                "policy": self.policy, "compiles": self.compiles, "compile_s": self.clock.seconds,
                "xla_compiles": self.xla_compiles,
                "compiles_after_warmup": self.compiles - (self.warmup_compiles or 0),
                "xla_compiles_after_warmup": self.xla_compiles - (self.warmup_xla_compiles or 0),
                "gc_full_collections": self.gc_full_collections, "gc_pause_s": self.gc_pause_s,
                "gc_pause_max_s": self.gc_pause_max_s,
                "healthy": self.error is None and self.ready.is_set() and not self._stopping, **{
                    f"total_{k}": v for k, v in c.items()}}

    @property
    def policy(self) -> str:
        """The drafting policy, as metrics label it: ``target-only``, the draft context policy, ``self-`` and the
        self-draft's policy, or a drafter's name (``ngram``; ``ngram+`` before a draft's policy it is in front of)."""
        return self.drafter.label(self.spec) if self.drafter is not None else "target-only"

    # ----------------------------------------------------------------------------------------- engine thread
    def _bump(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counters[key] += n

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            self.xla_compiles += 1

    def _on_gc(self, phase: str, info: dict) -> None:
        """``gc.callbacks`` hook: every collection holds the GIL, so its pause delays every stream."""
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            pause, self._gc_started = time.perf_counter() - self._gc_started, None
            self.gc_pause_s += pause
            self.gc_pause_max_s = max(self.gc_pause_max_s, pause)
            self.gc_full_collections += info.get("generation") == 2

    def _warmup(self) -> None:
        """Compile every program: a throw-away request through admission and decoding (each block program holds
        the greedy and the sampling branches), and a second one released while it decodes."""
        events = []
        # the first chunk, a later full one and a narrow tail (as long as max_model_len allows them)
        two_chunks = max(1, min(2 * self.prefill_chunk + 1, self.max_model_len - 2))
        req = Request([0] * two_chunks, SamplingParams(max_tokens=2, seed=0, ignore_eos=True), events.append)
        self._waiting.append(req)
        while not req.finished:
            self._step()
        req = Request([0], SamplingParams(max_tokens=self.max_model_len - 1, seed=0, ignore_eos=True), events.append)
        self._waiting.append(req)
        while req.phase != "decode":
            self._step()
        self._finish(req, "abort", release=True)
        while self._pending:
            self._read_one()
        self._chunks_since_block = 0
        self.counters.clear()
        # a fresh page manager: the warm-up's pages are all free, its prefix-cache counters gone
        self.pager = self._new_pager()
        with self._lock:  # the warm-up requests went around submit(): every slot is free again
            self._rate.clear()
            self._queued, self._free = 0, self.num_slots
        if self._book is not None:
            self._book = RetrievalBook(self.spec, self.num_slots)

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._step()
        except BaseException as exc:  # a device program failed: the batch state is gone, fail every request
            self.error = exc
            for req in list(self._waiting) + [r for r in self.slots if r is not None]:
                self._fail(req, 500, f"the engine failed: {type(exc).__name__}: {exc}", "internal_error")
            self._drain_failed()
            if self.on_failure is not None:
                self.on_failure(exc)
            raise
        for req in list(self._waiting) + [r for r in self.slots if r is not None]:
            self._finish(req, "abort", release=False)

    @contextlib.contextmanager
    def _alone(self, req: Request, what: str):
        """Run the block for ``req`` alone: if it raises while the batch's device state is intact, ``req`` fails
        (500) and the engine goes on. A failure that lost the batch state (a program that consumed its donated
        inputs) stops the engine."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001  (whatever one request's preparation raises)
            if any(x.is_deleted() for x in jax.tree_util.tree_leaves((self._state, self._loop))
                   if isinstance(x, jax.Array)):
                raise
            self._fail(req, 500, f"{what} the request failed: {type(exc).__name__}: {exc}", "internal_error")

    def _drain_failed(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                self._fail(item, 500, "the engine failed", "internal_error")

    def _idle(self) -> bool:
        return not (self._waiting or self._admissions or self._starting or self._pending or any(self.slots))

    def _decoding(self) -> bool:
        return any(r is not None and r.phase == "decode" for r in self.slots)

    def _step(self) -> None:
        """One iteration: take messages, expire timeouts, admit waiting requests into the free slots, prefill (a
        wave's chunks, or the chunks allowed between two blocks), one block (reading everything dispatched before
        it), then read the results that are ready (and wait for the oldest when nothing was dispatched)."""
        settling = self._forming and not self._admissions  # a wave's last chunks run on the device
        self._take_messages(block=self._idle() or settling, timeout=WAVE_POLL_S if settling else 0.1)
        self._expire()
        self._admit()
        did = self._prefill()
        if not self._forming and self._decoding():
            self._make_room()
            # first tokens at the head of the queue (a wave's, or a request started while no block was unread) go
            # out before the next block: on a GPU its dispatch holds the host until its loop has run
            while self._pending and self._pending[0][0] == "start":
                self._read_one()
        if not self._forming and self._decoding():
            self._dispatch_block()
            did = True
            # everything dispatched before this block is read now: one block behind, never two (module docstring)
            newest = self._pending[-1]
            while self._pending[0] is not newest:
                self._read_one()
        self._read_ready()
        if self._pending and not did:
            self._read_one()

    def _take_messages(self, block: bool, timeout: float = 0.1) -> None:
        try:
            msg = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, item = msg
            if kind == "submit":
                self._waiting.append(item)
            elif kind == "abort":
                self._abort(item)
            elif kind == "abort_all":
                self._abort(None)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _abort(self, request_id: str | None) -> None:
        """End request ``request_id`` (``None``: every waiting and running request) with finish reason abort."""
        for req in list(self._waiting) + [r for r in self.slots if r is not None]:
            if request_id is None or req.id == request_id:
                self._finish(req, "abort", release=True)

    def _expire(self) -> None:
        now = time.monotonic()
        for req in list(self._waiting) + [r for r in self.slots if r is not None]:
            if req.deadline is not None and now > req.deadline:
                self._bump("timeouts", 1)
                self._fail(req, 504, f"the request ran past its timeout ({req.deadline - req.arrival:g} s)",
                           "timeout")

    # admission ------------------------------------------------------------------------------------------
    def _admit(self) -> None:
        """Every waiting request that a free slot and the page pool can take joins, in order (its slot reset, its
        pages taken, the cached run of its prompt's full pages reused, the rest laid out in prefill chunks).
        Admissions that begin while no slot decodes form a wave (see the module docstring)."""
        while self._waiting and None in self.slots:
            req = self._waiting[0]
            replay = self._replays and bool(req.tokens)
            ids = np.asarray(req.prompt_ids, np.int32) if replay else self._context(req)
            try:  # (one walk of the prompt's hash chain: a refused admission changes nothing)
                adm = self.pager.admit(req.id, ids, reserve=max(0, self._reserve(req) - len(ids)),  # what _start takes
                                       max_cached=self._replay_start(req, ids) if replay else None)
            except OutOfPages:
                if not any(self.slots):  # nothing will free pages: cannot happen (construction checks one fits)
                    raise RuntimeError(f"request {req.id} does not fit an idle KV pool") from None
                return
            self._waiting.popleft()
            with self._lock:
                self._queued -= 1
                self._free -= 1
            slot = self.slots.index(None)
            self.slots[slot], req.slot, req.phase = req, slot, "prefill"
            req.marks["admitted"] = time.monotonic()
            req.committed = adm.cached_tokens
            req.replay_left = len(req.tokens) if replay else 0
            if req.cached_tokens is None:
                req.cached_tokens = adm.cached_tokens
            self._set_table(slot, adm.pages)
            self._admitted += 1
            req.admitted_seq = self._admitted
            with self._alone(req, "admitting"):
                p = req.params
                self._state = self._progs.reset(self.clock, self._state, np.int32(slot), np.float32(p.temperature),
                                                np.int32(p.top_k), np.float32(p.top_p), seed_key(req.seed))
                w, start = self.prefill_chunk, adm.cached_tokens
                n = -(-(len(ids) - start) // w)
                tokens = np.zeros(n * w + 1, np.int32)
                tokens[:len(ids) - start] = ids[start:]
                self._admissions[slot] = _Admission(req, slot, tokens, n, self._acc(self.clock), start=start,
                                                    length=len(ids))

    def _padded_context(self, req: Request) -> np.ndarray:
        """The request's tokens so far (:meth:`_context`), zero padded to the capacity: int32 ``[1, capacity]``."""
        ids = self._context(req)
        out = np.zeros((1, self.capacity), np.int32)
        out[0, :len(ids)] = ids
        return out

    @staticmethod
    def _context(req: Request) -> np.ndarray:
        """A request's tokens so far: its prompt and the tokens it generated (after a preemption its slot holds
        them again once recomputed: replayed by the decode loop, or prefilled with the prompt in tree mode)."""
        return np.asarray(req.prompt_ids + req.tokens, np.int32)

    def _replay_start(self, req: Request, prompt: np.ndarray) -> int:
        """Where a preempted request's prompt is prefilled again from: the cached run of its full pages, cut back to
        a chunk boundary of its first admission (which began at ``req.cached_tokens``), so every prompt position is
        recomputed by the same chunk program over the same rows as the first time, to the bit; then its generated
        tokens are replayed through verify steps as they were produced (:attr:`SamplingRows.replay
        <diffspec_jax.sampling.SamplingRows.replay>`). When fewer pages than the first admission reused are still
        cached, the prompt's chunks cannot repeat the first ones (the recomputed rows may round differently)."""
        hit, first = self.pager.cached_prefix(prompt), req.cached_tokens or 0
        if hit < first:
            return hit
        return first + (hit - first) // self.prefill_chunk * self.prefill_chunk

    def _commit(self, req: Request, computed: int) -> None:
        """Tell the page manager that ``req``'s positions below ``computed`` are final (never moving backwards, never
        past its pages): its full pages there join the prefix cache."""
        held = len(self.pager.page_table(req.id)) * self.page_size
        req.committed = max(req.committed, min(computed, held))
        self.pager.commit(req.id, self._context(req), req.committed)

    def _set_table(self, slot: int, pages: Sequence[int]) -> None:
        self._table[slot] = self.num_pages  # unallocated
        self._table[slot, :len(pages)] = pages
        self._table_dirty = True

    def _sync_table(self) -> None:
        """The host's page table into the device state (before a program that reads or writes the cache)."""
        if self._table_dirty:
            tc = self._state.target_cache  # (laid out as the programs left it: every shard holds the whole table)
            self._state = self._state.replace(target_cache=tc.replace(
                pages=jax.device_put(self._table.copy(), tc.pages.sharding)))
            self._table_dirty = False

    def _grow(self, req: Request, length: int) -> bool:
        """Pages so ``req`` covers ``length`` positions; when the pool is short, preempt the most recently admitted
        requests (``req`` itself last). Returns whether ``req`` still holds its slot."""
        while True:
            try:
                new = self.pager.grow(req.id, length)
            except OutOfPages:
                victims = [r for r in self.slots if r is not None and r is not req]
                victim = max(victims, key=lambda r: r.admitted_seq) if victims else req
                if victim.admitted_seq < req.admitted_seq:
                    victim = req
                self._preempt(victim)
                if victim is req:
                    return False
                continue
            if new:
                self._set_table(req.slot, self.pager.page_table(req.id))
            return True

    def _preempt(self, req: Request) -> None:
        """Free ``req``'s slot and pages and put it back at the front of the queue: it is admitted again later and
        recomputes its prompt and the tokens it generated (which it keeps: nothing is delivered twice)."""
        self._leave(req, release=True, finished=False)  # its completed pages stay cached for its re-admission
        req.slot, req.phase = None, None
        req.preemptions += 1
        self._waiting.appendleft(req)
        with self._lock:
            self._queued += 1
        self._bump("preemptions", 1)

    def _reserve(self, req: Request) -> int:
        """Positions ``req`` may write before the host reads its next results: its committed length, two blocks of
        accepted tokens (one in flight, one being dispatched) and a verify block, capped at its token limit."""
        known = len(req.prompt_ids) + len(req.tokens)
        ahead = 2 * self.block_cycles * (self.plan.k + 1)
        return positions_needed(self.plan, min(known + ahead, len(req.prompt_ids) + req.params.max_tokens))

    def _prefill(self) -> bool:
        """Dispatch prefill chunks, the admission with the fewest tokens left first: while a wave forms, every
        chunk (at most :data:`PREFILL_AHEAD` in flight), and the wave's slots start together once its last chunk
        has run on the device; while slots decode, up to :attr:`chunks_per_block` since the last block, each slot
        starting after its last chunk. Returns whether anything was dispatched."""
        self._forming = bool(self._admissions or self._starting) and not self._decoding()
        did = False
        while self._admissions:
            if self._forming:
                if len(self._chunk_marks) >= PREFILL_AHEAD:  # stay close to the device: late arrivals join
                    jax.block_until_ready(self._chunk_marks.popleft())
                    self._take_messages(block=False)  # a cancellation leaves the wave now, not after its prefill
                    if not self._admissions:
                        break
            elif self._chunks_since_block >= self.chunks_per_block:
                break
            a = min(self._admissions.values(), key=lambda a: a.left)
            with self._alone(a.req, "prefilling"):
                self._prefill_chunk(a)
            did = True
            if a.req.finished:  # its prefill failed: it left its slot
                continue
            if not a.left:
                a.req.marks["prefilled"] = time.monotonic()
                del self._admissions[a.slot]
                if self._forming:
                    self._starting.append(a)
                else:
                    with self._alone(a.req, "starting"):
                        self._start(a)
        if not self._admissions:
            # the wave starts once its prefill is done on the device: until then a request that arrives joins it
            while self._chunk_marks and self._chunk_marks[0].is_ready():
                self._chunk_marks.popleft()
            if not self._chunk_marks:
                for a in self._starting:
                    with self._alone(a.req, "starting"):
                        self._start(a)
                    did = True
                self._starting.clear()
                self._forming = False
        return did

    def _prefill_chunk(self, a: _Admission) -> None:
        """Dispatch the admission's next prefill chunk: the full width, or, for a tail of at most
        :data:`NARROW_TAIL_CHUNKS` narrow chunks (what is left after a prefix-cache hit, or a prompt's last tokens),
        the narrow width (:data:`~diffspec_jax.models.attention.DENSE_ATTENTION_MAX_TOKENS`), whose attention reads
        the cached prefix through the page table like a verify step instead of gathering it for the flash
        prefill."""
        s, left = a.done, a.left
        narrow = min(self.prefill_chunk, DENSE_ATTENTION_MAX_TOKENS)
        tail = left <= NARROW_TAIL_CHUNKS * narrow and not self.spec.deterministic  # (see NARROW_TAIL_CHUNKS)
        w = narrow if tail else self.prefill_chunk
        length = np.array([a.length], np.int32)
        first = first_chunk_program(self.plan, a.start + s, full_width=w == self.prefill_chunk)
        chunk = self._progs.prefill_first if first else self._progs.prefill
        self._sync_table()
        self._state, a.acc, mark = chunk(self.clock, self.tparams, self.dparams, self._state, a.acc,
                                         np.int32(a.slot), a.tokens[None, s:s + w],
                                         a.tokens[None, s + 1:s + w + 1], np.array([a.start + s], np.int32), length)
        a.done, a.chunk = min(a.done + w, a.length - a.start), a.chunk + 1
        self._chunks_since_block += 1
        if self._forming:
            self._chunk_marks.append(mark)
        self._bump("prefill_chunks", 1)

    def _start(self, a: _Admission) -> None:
        req, slot, plan = a.req, a.slot, self.plan
        if self.slots[slot] is not req:  # preempted while it waited to start (an earlier start took its pages)
            return
        length = np.array([a.length], np.int32)
        n = int(length[0])
        p = req.params
        # the tokens it replays (none past replay_end: 0 when it replays nothing), and its drafter's context (a
        # prefix cache's reused pages hold no tokens); built only where one of them reads it
        used = req.replay_left or self.plan.drafter_context
        context = self._padded_context(req) if used else self._no_context
        replay_end = np.array([len(req.prompt_ids) + len(req.tokens) if req.replay_left else 0], np.int32)
        # the context's full pages are final (with a draft store: below its last position, whose entry is pending)
        self._commit(req, n - 1 if self._store_lag else n)
        if not self._grow(req, self._reserve(req)):
            return
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos))
        self._stopsets[slot] = frozenset(stops)
        self._stops[slot] = stop_ids(stops, MAX_STOP_IDS)
        retrieve = bool(retrieves_after_prefill(plan, length)[0])
        self._shape.reset(slot)
        if self._book is not None:
            self._book.reset(slot)
        self._host_len[slot] = n
        self._sync_table()
        self._state, self._loop, first, anchors = self._progs.start(
            self.clock, self.tparams, self.dparams, self._state, self._loop, a.acc, np.int32(slot), length,
            np.int32(p.max_tokens - len(req.tokens) + req.replay_left), self._stops[slot].copy(), np.bool_(retrieve),
            context, replay_end, context if self.plan.drafter_context else None)
        req.phase = "decode"
        req.marks["started"] = time.monotonic()
        self._pending.append(("start", req, slot, first, anchors, retrieve))

    # decoding -------------------------------------------------------------------------------------------
    def _make_room(self) -> None:
        """Pages for what every decoding request may write in the next block (:meth:`_reserve`), preempting the
        most recently admitted requests when the pool runs short."""
        for req in [r for r in self.slots if r is not None and r.phase == "decode"]:
            if req.slot is not None and self.slots[req.slot] is req:  # (an earlier growth may have preempted it)
                self._grow(req, self._reserve(req))

    def _dispatch_block(self) -> None:
        self._sync_table()
        caps, budget = self._shape.block_inputs(np.arange(self.num_slots))
        owners = [r if r is not None and r.phase == "decode" else None for r in self.slots]
        self._state, self._loop, res = self._block(self.clock, self.tparams, self.dparams, self._state, self._loop,
                                                   self._stops.copy(), caps, budget)
        self._chunks_since_block = 0
        self._bump("blocks", 1)
        self._pending.append(("block", res, owners))

    def _read_ready(self) -> None:
        """Read the results at the head of the queue that the device has finished (no waiting)."""
        while self._pending and all(x.is_ready() for x in jax.tree_util.tree_leaves(self._pending[0][1:])
                                    if isinstance(x, jax.Array)):
            self._read_one()

    def _read_one(self) -> None:
        item = self._pending.popleft()
        if item[0] == "start":
            _, req, slot, first, anchors, retrieve = item
            first, anchors = jax.device_get((first, anchors))  # anchors [ranks, 1, A]: every rank's selection
            with self._alone(req, "starting"):
                self._started(req, slot, int(first), anchors[:, 0], retrieve)
        else:
            _, res, owners = item
            self._read_block(jax.device_get(res), owners)

    def _current(self, req: Request | None, slot: int) -> bool:
        return req is not None and not req.finished and self.slots[slot] is req

    def _started(self, req: Request, slot: int, first: int, anchors: np.ndarray, retrieve: bool) -> None:
        if not self._current(req, slot):
            return
        if self._book is not None:
            if retrieve:
                self._book.retrieved(slot, anchors, len(req.prompt_ids) - 1, 0.0, True)
                self._bump("retrievals", 1)
                self._check_ranks(anchors, np.bool_(True))
            elif not self.spec.context.retrieve_after_prefill:
                self._book.skip_prefill(slot)
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
            self._bump("prompt_tokens", len(req.prompt_ids))
        self._deliver(req, [first])
        if self._current(req, slot):
            if first in self._stopsets[slot]:
                self._finish(req, "stop", release=False)
            elif len(req.tokens) >= req.params.max_tokens:
                self._finish(req, "length", release=False)

    def _read_block(self, res, owners: list) -> None:
        keep = np.array([self._current(r, i) for i, r in enumerate(owners)])
        if res.record is not None:
            rec = res.record.replace(live=res.record.live & keep[None, :])
            replay(rec, int(res.steps), np.arange(self.num_slots), self._host_len, self._shape, self._book, 0.0)
            if rec.due is not None:
                self._bump("retrievals", int((rec.due & rec.live).sum()))
                self._check_ranks(rec.anchors, rec.due & rec.live)
        for r in np.nonzero(keep)[0]:
            req = owners[r]
            req.cycles += int(res.cycles[r])
            req.accepted += int(res.accepted[r])
            self._bump("cycles", int(res.cycles[r]))
            self._bump("accepted", int(res.accepted[r]))
            toks = res.tokens[r, :int(res.new[r])].tolist()
            self._deliver(req, toks)
            if self._current(req, r) and bool(res.done[r]):
                stopped = bool(toks) and toks[-1] in self._stopsets[r]
                self._finish(req, "stop" if stopped else "length", release=False)

    def _check_ranks(self, anchors: np.ndarray, retrieved: np.ndarray) -> None:
        """Count the retrievals (``retrieved``, bool ``[...]``) whose tensor-parallel ranks selected different chunks
        (``anchors`` int ``[ranks, ..., A]``: every rank's own selection; one rank without a mesh). Nonzero is a bug:
        each rank's draft would read another working cache (the output stays the target's, acceptance drops)."""
        differ = np.any(anchors != anchors[:1], axis=(0, anchors.ndim - 1))
        n = int(np.sum(differ & retrieved))
        if n:
            self._bump("retrieval_rank_mismatches", n)

    def _deliver(self, req: Request, toks: list[int]) -> None:
        """Hand new tokens to the request: its output processor (stop strings) and its sink. A failure here fails
        this request only."""
        if req.replay_left and toks:  # tokens it had returned before a preemption, emitted again: not twice
            n = min(req.replay_left, len(toks))
            at = len(req.tokens) - req.replay_left
            if toks[:n] != req.tokens[at:at + n]:
                self._bump("replay_mismatches", 1)
            req.replay_left -= n
            toks = toks[n:]
            self._bump("replayed_tokens", n)
        if not toks:
            return
        try:
            text, cut = None, None
            if req.output is not None:  # token by token, so a stop string ends the request at its last token
                body = toks[:-1] if toks[-1] in self._stopsets[req.slot] else toks  # a stop id is not text
                pieces = []
                for i, t in enumerate(body):
                    pieces.append(req.output.push([t])[0])
                    if req.output.stopped:
                        cut = i
                        break
                text = "".join(pieces)
            if cut is not None:
                toks = toks[:cut + 1]
            req.tokens.extend(toks)
            with self._lock:
                self.counters["generation_tokens"] += len(toks)
                self._rate.append((time.monotonic(), len(toks)))
            req.sink(Event("tokens", token_ids=toks, text=text))
            if cut is not None:
                self._finish(req, "stop", release=True)
        except Exception as exc:  # noqa: BLE001  (any failure of this request's processing)
            self._fail(req, 500, f"processing the request's output failed: {type(exc).__name__}: {exc}",
                       "internal_error")

    # leaving ----------------------------------------------------------------------------------------------
    def _leave(self, req: Request, release: bool, finished: bool = True) -> None:
        """Take ``req`` out of the queue or its slot (``release``: mark the slot done on the device), and give back
        its pages: those it completed stay in the prefix cache until evicted. ``req.finished`` is set last (a
        thread that waits for it then sees the slot, the pages and the finish reason settled); a preemption leaves
        it ``False``."""
        try:
            self._take_out(req, release)
        finally:
            req.finished = finished

    def _take_out(self, req: Request, release: bool) -> None:
        if req.slot is None:
            if req in self._waiting:
                self._waiting.remove(req)
                with self._lock:
                    self._queued -= 1
            return
        slot = req.slot
        if self.slots[slot] is req:
            if slot in self._admissions and self._admissions[slot].req is req:
                del self._admissions[slot]
            elif any(a.req is req for a in self._starting):
                self._starting = [a for a in self._starting if a.req is not req]
            elif release and req.phase == "decode" and self.error is None:
                self._loop = self._progs.release(self.clock, self._loop, np.int32(slot))
            if req.id in self.pager:
                if req.phase == "decode" and self.error is None:  # every position but the newest token's is final
                    if self._store_lag:  # once the draft's pending entries are in its store
                        self._state = self._progs.flush(self.clock, self.dparams, self._state, np.int32(slot))
                    self._commit(req, len(req.prompt_ids) + len(req.tokens) - req.replay_left - 1)
                self.pager.free(req.id)
            self._set_table(slot, ())
            self.slots[slot] = None
            with self._lock:
                self._free += 1

    def _finish(self, req: Request, reason: str, release: bool) -> None:
        if req.finished:
            return
        req.finish_reason = reason
        self._leave(req, release)
        self._bump(f"finished_{reason}")
        try:
            tail = req.output.finish()[0] if req.output is not None and reason != "abort" else None
            if tail:
                req.sink(Event("tokens", text=tail))
            req.sink(Event("finish", finish_reason=reason, prompt_tokens=len(req.prompt_ids),
                           completion_tokens=len(req.tokens), cached_tokens=req.cached_tokens or 0))
        except Exception:  # noqa: BLE001  (a broken sink must not stop the engine)
            self._bump("sink_errors", 1)

    def _fail(self, req: Request, status: int, message: str, error_type: str) -> None:
        if req.finished:
            return
        req.finish_reason = "error"
        self._leave(req, release=True)
        self._bump("failed", 1)
        try:
            req.sink(Event("error", status=status, message=message, error_type=error_type,
                           prompt_tokens=len(req.prompt_ids), completion_tokens=len(req.tokens)))
        except Exception:  # noqa: BLE001
            self._bump("sink_errors", 1)
