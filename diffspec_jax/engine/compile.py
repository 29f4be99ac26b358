"""Compilation without surprises: the jitted steps of a plan (:func:`build_programs`; ``jit(shard_map(...))`` with
a mesh, by :func:`diffspec_jax.sharding.jit_sharded`, the one such builder, with the layouts of
:func:`program_specs`, which the server's slot programs share), traced under the plan's kernel choice
(:func:`bind`), their ahead-of-time compiled versions that time compilation apart (:class:`_Program`), JAX's
persistent compilation cache (:func:`enable_compilation_cache`) and the cache-capacity buckets
(:func:`capacity_bucket`).

Nothing here keeps programs between calls: a :class:`~diffspec_jax.engine.session.Session` holds them."""

from __future__ import annotations

import collections
import functools
import os
import time
from types import SimpleNamespace

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_compilation_cache
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from diffspec_jax import sharding
from diffspec_jax.cache import ATTENTION_TILE, round_capacity
from diffspec_jax.engine.loop import _block, block_out_specs, loop_specs
from diffspec_jax.engine.prefill import PrefillAcc, _prefill_chunk, _start_decode
from diffspec_jax.engine.retrieve import _retrieve
from diffspec_jax.engine.state import Plan, _init_state, state_specs
from diffspec_jax.engine.verify import Cycle, _spec_cycle, _target_cycle, _tree_cycle
from pallas_kernels.common import use_deterministic, use_kernels

#: the environment variable naming JAX's persistent compilation cache directory (``0``: leave the cache off)
COMPILATION_CACHE_ENV = "DIFFSPEC_COMPILATION_CACHE"

#: programs that take at least this long to compile are written to the persistent cache (JAX's default is 1 s)
CACHE_MIN_COMPILE_SECS = 0.1


def _spec_tree(key):
    return None if key is None else jax.tree_util.tree_unflatten(key[0], key[1])


def param_spec_key(params) -> tuple | None:
    """A hashable description of how ``params`` are sharded (its tree and each leaf's PartitionSpec)."""
    if params is None:
        return None
    leaves, treedef = jax.tree_util.tree_flatten(params)
    return treedef, tuple(x.sharding.spec for x in leaves)


def bind(fn, plan: Plan):
    """``fn(plan, ...)``, traced under the plan's kernel choice (``plan.kernels``: what every kernel selector of
    :mod:`pallas_kernels.dispatch` picks inside it) and its attention form (``SpecConfig.deterministic``)."""

    def bound(*args, **kwargs):
        with use_kernels(plan.kernels), use_deterministic(plan.spec.deterministic):
            return fn(plan, *args, **kwargs)

    return functools.wraps(fn)(bound)


#: the XLA options of a deterministic plan's programs (:func:`compiler_options`)
DETERMINISTIC_COMPILER_OPTIONS = {"xla_allow_excess_precision": False, "xla_gpu_autotune_level": 0,
                                  "xla_gpu_enable_triton_gemm": False}


def compiler_options(plan: Plan) -> dict | None:
    """XLA options of the plan's programs. A deterministic plan (``SpecConfig.deterministic``):

    * keeps every bfloat16 intermediate rounded as its op's type says (``xla_allow_excess_precision`` off). XLA
      otherwise may keep a fused intermediate in float32, so a value's rounding would depend on what else the
      program computes from it: the verify step, which also taps hidden states for the draft, then rounded some
      values differently from target-only decoding (2 of 16 demo-pair prompts differed on an H200 with the
      attention alone made deterministic; self-drafting, which taps nothing, none);
    * runs every matrix product as cuBLAS's heuristic picks it, never timed (``xla_gpu_autotune_level`` 0, Triton
      GEMMs off). Autotuning picks a kernel per program and per compilation by timing candidates, so a row's
      product could split its inner dimension one way in a 5-row step and another in a 60-row one, or change
      from one run to the next. On an H100 with Llama-3.1-8B's shapes (``benchmarks/gemm_invariance.py``,
      ``benchmarks/results/gemm_invariance_h100/``) the first 5 rows' bits changed with the row count (10 or 60
      against 5) and between two runs of the same program under autotuning; with these options no bit changed
      at 5, 10, 60 or 2048 rows. On a CPU the two GPU options do nothing."""
    return dict(DETERMINISTIC_COMPILER_OPTIONS) if plan.spec.deterministic else None


class CompileClock:
    """Seconds spent compiling (tracing, lowering, XLA compilation or a persistent-cache load) in one call, and
    how many programs were compiled (``count``)."""

    def __init__(self):
        self.seconds = 0.0
        self.count = 0


def _layout(x):
    """An array's sharding as a compiled executable tells layouts apart: a ``NamedSharding`` without its trailing
    unsharded dimensions (``P(None, "tp", None, None)`` lays out a K/V pool as ``P(None, "tp")`` does, the spelling
    a ``shard_map``'s outputs come back with), so a state created with its specs and the same state returned by a
    program share one executable."""
    s = getattr(x, "sharding", None)
    if not isinstance(s, NamedSharding):
        return s
    spec = tuple(s.spec)
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return s.mesh, spec, s.memory_kind


def _signature(args) -> tuple:
    """What a compiled executable is specific to: the pytree structure and each leaf's shape, dtype, weak type and
    layout (:func:`_layout`)."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    return treedef, tuple((x.shape, x.dtype, bool(getattr(x, "weak_type", False)), _layout(x)) for x in leaves)


class _Program:
    """A jitted step compiled ahead of time (``jit(...).lower(*args).compile()``) the first time it meets an
    argument signature, so compilation is timed apart from execution.

    Before compiling, the arguments are waited for: the device is then idle, and the wall time of the caller's
    region minus the compile time is exactly its run time (prefill, decode). The executables of the last
    ``max_entries`` signatures are kept (they live as long as the session's entry for the plan).
    """

    def __init__(self, jitted, max_entries: int = 16):
        self.jitted = jitted
        self.max_entries = max_entries
        self._exe: collections.OrderedDict = collections.OrderedDict()

    def __call__(self, clock: CompileClock, *args):
        key = _signature(args)
        exe = self._exe.get(key)
        if exe is None:
            jax.block_until_ready(args)
            t = time.perf_counter()
            exe = self.jitted.lower(*args).compile()
            clock.seconds += time.perf_counter() - t
            clock.count += 1
            self._exe[key] = exe
            while len(self._exe) > self.max_entries:
                self._exe.popitem(last=False)
        else:
            self._exe.move_to_end(key)
        return exe(*args)


_SPEC_NAMES = ("tparams", "dparams", "state", "loop", "block_out", "acc", "row", "rows2", "ranks", "same")


def program_specs(plan: Plan, tspec_key=None, dspec_key=None) -> SimpleNamespace:
    """How the arguments and results of the plan's programs are laid out on its mesh: the one definition that
    :func:`build_programs` (``generate()``) and the server's slot programs
    (:func:`~diffspec_jax.engine.slots.slot_programs`) share. Without a mesh every field is ``None`` (nothing is
    mapped).

    ``tparams`` / ``dparams``: the params' specs (from :func:`param_spec_key`); ``state``, ``loop``, ``block_out``:
    :func:`~diffspec_jax.engine.state.state_specs`, :func:`~diffspec_jax.engine.loop.loop_specs`,
    :func:`~diffspec_jax.engine.loop.block_out_specs`; ``acc``: the prefill accumulator (query heads over ``tp``);
    ``row`` / ``rows2``: per-row arrays ``[B]`` / ``[B, X]`` (batch over ``dp``); ``ranks``: ``[ranks, B, ...]``,
    what each tensor-parallel rank computed for itself (its ``[1, B, ...]``), stacked over ``tp`` (retrieval
    anchors: the host checks that the ranks agree); ``same``: a value every shard holds whole (scalars, stop ids,
    a request slot's inputs).
    """
    if plan.mesh is None:
        return SimpleNamespace(**dict.fromkeys(_SPEC_NAMES))
    dp = sharding.DP if plan.dp > 1 else None
    tp = sharding.TP
    row, rows2 = P(dp), P(dp, None)
    return SimpleNamespace(
        tparams=_spec_tree(tspec_key), dparams=_spec_tree(dspec_key), state=state_specs(plan),
        loop=loop_specs(plan), block_out=block_out_specs(plan),
        acc=PrefillAcc(logits=rows2, aux=rows2, score_q=P(dp, tp, None), score_lse=P(dp, tp)),
        row=row, rows2=rows2, ranks=P(tp, dp), same=P())


def sharded_program(plan: Plan, fn, donate, ins, outs):
    """``fn(plan, ...)`` jitted (:func:`bind`), with ``donate`` (an index or a tuple of them) donated; with a
    mesh, mapped per shard with the specs ``ins`` / ``outs`` (:func:`program_specs`; ignored without a mesh)."""
    return sharding.jit_sharded(bind(fn, plan), plan.mesh, ins, outs,
                                donate if isinstance(donate, tuple) else (donate,), compiler_options(plan))


def init_program(plan: Plan, fn, specs) -> _Program:
    """``fn`` (a program that creates a zeroed state or accumulator) jitted, its outputs laid out by ``specs``
    (:func:`program_specs`) on the plan's mesh, as the programs that take them expect."""
    if plan.mesh is None:
        return _Program(jax.jit(fn))
    return _Program(jax.jit(fn, out_shardings=sharding.named(specs, plan.mesh)))


def build_programs(plan: Plan, tspec_key=None, dspec_key=None) -> SimpleNamespace:
    """The jitted steps of ``plan``: plain ``jit`` without a mesh, ``jit(shard_map(...))`` with one (the params
    laid out as ``tspec_key`` / ``dspec_key`` describe, :func:`param_spec_key`; every argument as
    :func:`program_specs` says). A :class:`~diffspec_jax.engine.session.Session` keeps them per plan, so repeated
    :func:`generate` calls reuse the compilations.

    ``cycle(tparams, dparams, state, active)`` is the K-deep chain (or target-only) cycle; ``cycle_at(d)`` the
    d-deep chain taking per-sequence depths; ``tree_cycle(tparams, dparams, state, active, caps, budget)`` the tree
    cycle; ``block(c)`` the device loop of up to ``c`` cycles, ``(tparams, dparams, state, loop, stops, caps,
    budget) -> (state, loop, BlockOut)`` (state and loop donated). ``programs`` holds the ahead-of-time
    compiled :class:`_Program` versions :func:`generate` runs: ``prefill_first`` (a prompt's first chunk) and
    ``prefill_chunk`` (the others), ``start_decode`` (``(state, acc, lengths, context)``, the context ``None`` unless
    the plan's drafter reads the prompts, :attr:`~diffspec_jax.engine.state.Plan.drafter_context`), ``retrieve``,
    ``block(c)`` and ``init(batch, target_dtype, draft_dtype)`` (``(key) -> DecodeState``).
    """
    sp = program_specs(plan, tspec_key, dspec_key)
    make = functools.partial(sharded_program, plan)
    tparams, dparams, st, row, rows2 = sp.tparams, sp.dparams, sp.state, sp.row, sp.rows2
    chunk_ins = (tparams, dparams, st, sp.acc, rows2, rows2, row, row)
    cycle_out = Cycle(st, rows2, row, row, row, row)
    out = SimpleNamespace(
        prefill_chunk=make(_prefill_chunk, 2, chunk_ins, (st, sp.acc)),
        prefill_first=make(functools.partial(_prefill_chunk, first=True), 2, chunk_ins, (st, sp.acc)),
        start_decode=make(_start_decode, 0, (st, sp.acc, row, rows2 if plan.drafter_context else None),
                          (st, row)),
        retrieve=make(_retrieve, 2, (tparams, dparams, st, row), (st, sp.ranks)),
        cycle=make(_spec_cycle if plan.speculative else _target_cycle, 2, (tparams, dparams, st, row), cycle_out))
    out.cycle_at = functools.lru_cache(maxsize=None)(
        lambda d: make(functools.partial(_spec_cycle, depth=d), 2, (tparams, dparams, st, row, row), cycle_out))
    if plan.tree_mode:
        out.tree_cycle = make(_tree_cycle, 2, (tparams, dparams, st, row, rows2, row), cycle_out)
    caps_spec, budget_spec = (rows2, row) if plan.tree_mode else (None, None)
    out.block = functools.lru_cache(maxsize=None)(
        lambda c: make(functools.partial(_block, cycles=c), (2, 3),
                       (tparams, dparams, st, sp.loop, sp.same, caps_spec, budget_spec), (st, sp.loop, sp.block_out)))

    def init(batch, target_dtype, draft_dtype, pools=True):
        def fn(key):  # (pools=False: a paged state without its pools, which the caller keeps: a prefix cache)
            return _init_state(plan, batch, target_dtype, draft_dtype, 0, pools=pools).replace(rng=key)

        return init_program(plan, fn, st)

    out.programs = SimpleNamespace(
        prefill_chunk=_Program(out.prefill_chunk), prefill_first=_Program(out.prefill_first),
        start_decode=_Program(out.start_decode),
        retrieve=_Program(out.retrieve), block=functools.lru_cache(maxsize=None)(lambda c: _Program(out.block(c))),
        init=functools.lru_cache(maxsize=None)(init))
    return out


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
def _jax_cache_config_before() -> SimpleNamespace:
    """JAX's cache settings as the first :func:`generate` call found them (``dir``, ``min_secs``), and the directory
    :func:`enable_compilation_cache` applied last (``applied``)."""
    return SimpleNamespace(dir=jax.config.jax_compilation_cache_dir,
                           min_secs=float(jax.config.jax_persistent_cache_min_compile_time_secs), applied=None)


def enable_compilation_cache() -> str | None:
    """Point JAX's persistent compilation cache at :func:`compilation_cache_setting` (every :func:`generate` call
    runs this; it changes nothing once applied, and nothing happens at import time).

    A cache directory configured for JAX itself (``JAX_COMPILATION_CACHE_DIR``, or ``jax_compilation_cache_dir``
    set to anything but what this function applied) is left alone. Otherwise programs whose compilation takes at
    least :data:`CACHE_MIN_COMPILE_SECS` (or the user's lower threshold) are kept, so a new process loads the
    engine's programs instead of compiling them again. Returns the directory in use (``None``: no persistent
    cache).
    """
    first = _jax_cache_config_before()
    current = jax.config.jax_compilation_cache_dir
    if first.dir is not None or os.environ.get("JAX_COMPILATION_CACHE_DIR") or current not in (None, first.applied):
        return current
    want = compilation_cache_setting()
    if current == want:
        return want
    jax.config.update("jax_compilation_cache_dir", want)
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      min(first.min_secs, CACHE_MIN_COMPILE_SECS) if want is not None else first.min_secs)
    jax_compilation_cache.reset_cache()  # the cache object is created once per directory: let the next compilation open the new one
    first.applied = want
    return want


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
