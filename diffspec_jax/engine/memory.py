"""Device memory accounting of :func:`~diffspec_jax.generate`: what a call holds, what a prefill chunk needs beside
it, the chunk width that fits, and the up-front check that refuses a batch the device cannot hold.

A call holds, on each device (``*_bytes`` are per device: sharded arrays count their shard):

* the **weights** (target and draft params, already on the device when the call starts);
* the **state** (:class:`~diffspec_jax.engine.state.DecodeState`, allocated once and donated from program to
  program): the target's K/V, ``layers x 2 x B x Hkv x capacity x D x itemsize`` (a hybrid target's recurrent
  states with it), the draft's store and working cache (or the self-draft's working set), and small per-row
  arrays. :func:`state_bytes` takes it from the shapes :func:`~diffspec_jax.engine.state._init_state` creates
  (``jax.eval_shape``: exact, nothing allocated);
* the **temporaries** of the program running, the largest being a prefill chunk's activations
  (:func:`prefill_temp_bytes`); decode and verification steps need a few MB.

A prefill chunk of ``B x W`` tokens keeps, per token (``it`` = the activations' itemsize, ``H`` = hidden size,
``A`` = target layers whose inputs feed the draft (0 without one), ``Hq, Hkv, D`` = attention heads and head
size, ``M`` = MLP width (``I``, or ``top_k x I + shared`` for MoE), ``r`` = the token's copies in the MLP (1, or
``top_k`` for MoE); heads and ``M`` per tensor-parallel shard)::

    residual     = it * H * (1 + A)                            the residual stream and the draft's aux inputs
    attention    = it * (2H + 2Q + 2 Hq D) + 4 * 2 Hq (D + 1)  norm, q/k/v before and after RoPE (Q = their
                                                               width), the block and prefix outputs; float32 merge
                   [+ 4 * Hq * (2 tile + D + 2) on the tiled reference loop: float32 scores of one key tile]
                   [+ (8 + it) * Hq * (D + 2) + 2 Hkv * (D + 4 + it D) with an fp8 cache on the flash path: the
                    prefix attended segment by segment (:func:`~diffspec_jax.models.attention.flash_prefix_fp8`),
                    its float32 running output and their merge, and one segment's 8-bit rows (values and scale)
                    gathered and dequantized, a segment being as many rows as the chunk is wide (at least
                    :data:`~diffspec_jax.models.attention.FP8_PREFIX_SEGMENT`)]
                   [hybrids: at least it * (2H + 2 Ql) + 4 * Hv * (8 max(Dk, Dv) + 2 C), Gated DeltaNet's
                    projections (Ql wide) and its chunked form's float32 q, k, v, decayed copies, u, w and
                    output over Hv value heads, and [C, C] intra-chunk matrices (C = DELTA_CHUNK)]
    mlp          = it * (2 r H + 3 M) + 4 E                    the gate/up pair, their product, the sorted copies
                                                               (MoE), float32 router probabilities over E experts
    draft        = it_d * (A H + 6 Hd + (Hq_d + 2 Hkv_d) D_d)  the draft's projection of the chunk's entries
    per token    = residual + max(attention, mlp, draft)

plus ``B`` rows of float32 logits. For Llama-3.1-8B shapes in bfloat16 that is 108 KiB per token target-only
(132 KiB with an EAGLE-3 draft); the allocation that failed in issue 37 (64K x 8 through ``generate()``, so
chunks of 8 x 16384 tokens) was 12.5 GiB, 100 KiB per token.

Chunk width (:func:`memory_chunk_cap`): the backend's default (:func:`diffspec_jax.target.default_prefill_chunk`:
up to :data:`~diffspec_jax.target.FLASH_PREFILL_TOKENS` tokens per chunk on flash attention), capped so that one
chunk's temporaries take at most :data:`PREFILL_TEMP_SHARE` of the memory left free beside the state: the largest
power of two ``W >= MIN_PREFILL_CHUNK`` with ``B x W x per token <= share x room`` (powers of two keep the
compiled widths few). A 64K prompt at batch 1 stays one chunk on an H200; at batch 8 the chunks narrow until
their activations fit beside the 86 GB of K/V.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import asdict, dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from diffspec_jax.config import DraftConfig, ModelConfig
from diffspec_jax.engine.state import Plan, _init_state, state_specs
from diffspec_jax.errors import OutOfMemoryError
from diffspec_jax.models import attention
from diffspec_jax.models.qwen35 import DELTA_CHUNK
from diffspec_jax.target import default_prefill_chunk, plan_prefill

#: the share of the memory left free beside the state (device limit - in use - state) that one prefill chunk's
#: temporaries may take; the rest covers XLA's other buffers, fragmentation and the estimate's error
PREFILL_TEMP_SHARE = 0.125
#: the narrowest chunk the memory cap picks (a wider one that does not fit is narrowed down to this)
MIN_PREFILL_CHUNK = 256
#: the float32 key tile of the tiled reference prefill (``min(ATTENTION_TILE, capacity)``)
_TILE = 256

GiB = float(1 << 30)


def device_memory(device=None) -> dict[str, int] | None:
    """The device's allocator statistics (``bytes_limit``, ``bytes_in_use``, ``peak_bytes_in_use``, ...) as
    ``jax.Device.memory_stats()`` reports them (default device: ``jax.devices()[0]``), or ``None`` where the
    device reports no limit (CPUs)."""
    try:
        stats = (device or jax.devices()[0]).memory_stats()
    except Exception:  # noqa: BLE001 - a backend without the call reports nothing
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return {k: int(v) for k, v in stats.items() if isinstance(v, (int, np.integer))}


def room_for(nbytes: int, device=None) -> bool:
    """Whether ``nbytes`` more fit in the device's free memory now (``True`` where it does not report it)."""
    stats = device_memory(device)
    return stats is None or stats["bytes_limit"] - stats.get("bytes_in_use", 0) >= nbytes


def _leaf_bytes(x, spec=None, mesh=None) -> int:
    """Bytes of one array (or ShapeDtypeStruct) on one device: its shard under ``spec`` on ``mesh``, or the
    shard its own sharding gives it, or the whole array."""
    shape = tuple(x.shape)
    if mesh is not None and spec is not None:
        shape = NamedSharding(mesh, spec).shard_shape(shape)
    elif getattr(x, "sharding", None) is not None and hasattr(x.sharding, "shard_shape"):
        shape = x.sharding.shard_shape(shape)
    return int(math.prod(shape)) * np.dtype(x.dtype).itemsize


def tree_bytes(tree) -> int:
    """Bytes of every array of ``tree`` on one device (a sharded array counts one shard)."""
    return sum(_leaf_bytes(x) for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "shape"))


def state_bytes(plan: Plan, batch: int, target_dtype, draft_dtype) -> dict[str, int]:
    """Bytes per device of the :class:`~diffspec_jax.engine.state.DecodeState` :func:`generate` creates for
    ``batch`` rows: ``{"kv": the target cache, "draft": the draft's store and working cache (the self-draft's
    working set), "other": the rest}``, from the shapes of ``_init_state`` (nothing is allocated; remembered per
    plan, batch and dtypes, since tracing a large model's state takes milliseconds)."""
    return dict(_state_bytes(plan, int(batch), np.dtype(target_dtype), np.dtype(draft_dtype)))


@functools.lru_cache(maxsize=64)
def _state_bytes(plan: Plan, batch: int, target_dtype, draft_dtype) -> tuple:
    shapes = jax.eval_shape(lambda: _init_state(plan, batch, target_dtype, draft_dtype, 0))
    specs = state_specs(plan) if plan.mesh is not None else None

    def part(name: str) -> int:
        tree = getattr(shapes, name)
        if tree is None:
            return 0
        if specs is None:
            return tree_bytes(tree)
        sizes = jax.tree_util.tree_map(lambda s, x: _leaf_bytes(x, s, plan.mesh), getattr(specs, name), tree,
                                       is_leaf=lambda s: isinstance(s, P))
        return sum(jax.tree_util.tree_leaves(sizes))

    total = part("target_cache"), part("draft_cache")
    rest = sum(part(n) for n in ("retrieval", "length", "last_token", "pend_tokens", "pend_feats", "pend_count",
                                 "seq_id", "rng", "sampling", "drafter"))
    return ("kv", total[0]), ("draft", total[1]), ("other", rest)


def page_bytes(plan: Plan, target_dtype, draft_dtype) -> int:
    """Bytes per device of one page of a paged plan's pool (``plan.paging``): the target's K/V of ``page_size``
    positions in every attention layer and, with a ``recent`` / ``diffspec`` draft, its store's rows. From the
    shapes of :func:`~diffspec_jax.engine.state._init_state`: a pool of two pages less a pool of one."""
    one, two = (dataclasses.replace(plan, paging=(n, plan.paging[1])) for n in (1, 2))
    size = lambda p: sum(state_bytes(p, 1, target_dtype, draft_dtype).values())  # noqa: E731
    return size(two) - size(one)


def prefill_token_bytes(target: ModelConfig, draft: DraftConfig | None = None, aux_layers: int = 0, *,
                        itemsize: int = 2, draft_itemsize: int | None = None, flash: bool = True,
                        tp: int = 1, fp8: bool = False) -> int:
    """Bytes one token of a prefill chunk keeps live at the chunk's peak (the module docstring's formula);
    ``aux_layers``: target layers whose inputs the draft reads; ``flash``: attention on a flash kernel (else the
    tiled reference loop's float32 scores count); ``tp``: tensor-parallel shards (heads and MLP split); ``fp8``: an
    8-bit K/V cache (on the flash path its prefix is dequantized and attended segment by segment: a segment's rows
    and the running output count)."""
    c, it = target, int(itemsize)
    h, d = c.hidden_size, c.head_dim
    hq, hkv = max(1, c.num_attention_heads // tp), max(1, c.num_key_value_heads // tp)
    a = aux_layers if draft is not None else 0
    residual = it * h * (1 + a)
    q = (hq * (2 if c.is_hybrid else 1) + 2 * hkv) * d  # Qwen3.5's gated attention projects a gate beside q
    attn = it * (2 * h + 2 * q + 2 * hq * d) + 4 * 2 * hq * (d + 1)
    if c.is_hybrid:  # Gated DeltaNet's chunked form: float32 q, k, v (per value head), decayed copies, u, w, output
        hv = max(1, c.linear_num_value_heads // tp)
        dmax = max(c.linear_key_head_dim, c.linear_value_head_dim)
        delta = it * (2 * h + 2 * (2 * c.linear_key_dim + 2 * c.linear_value_dim) // tp) \
            + 4 * hv * (8 * dmax + 2 * DELTA_CHUNK)
        attn = max(attn, delta)
    if not flash:
        attn += 4 * hq * (2 * _TILE + d + 2)
    elif fp8:
        attn += (8 + it) * hq * (d + 2) + 2 * hkv * (d + 4 + it * d)
    if c.is_hybrid and c.num_experts:
        k = max(1, c.num_experts_per_tok)
        mlp = it * (2 * k * h + 3 * (k * c.intermediate_size + c.shared_expert_intermediate_size) // tp) \
            + 4 * c.num_experts
    else:
        mlp = it * (2 * h + 3 * c.intermediate_size // tp)
    peak = max(attn, mlp)
    if draft is not None:
        dit = int(draft_itemsize or itemsize)
        peak = max(peak, dit * (a * h + 6 * draft.hidden_size
                                + (draft.num_attention_heads + 2 * draft.num_key_value_heads) * draft.head_dim))
    return residual + peak


def prefill_temp_bytes(token_bytes: int, batch: int, width: int, vocab_size: int, hidden: int,
                       itemsize: int = 2) -> int:
    """The temporaries of one prefill chunk of ``batch x width`` tokens: ``token_bytes`` per token plus the output
    rows (float32 logits and their hidden states, a few copies)."""
    return int(batch) * int(width) * int(token_bytes) + int(batch) * (3 * 4 * int(vocab_size) + 8 * itemsize * hidden)


def memory_chunk_cap(batch: int, token_bytes: int, room: int, *, share: float = PREFILL_TEMP_SHARE,
                     min_width: int = MIN_PREFILL_CHUNK) -> int:
    """The chunk sizing rule: the largest power of two ``W >= min_width`` whose chunk of ``batch x W`` tokens
    (``token_bytes`` each) takes at most ``share x room`` bytes; ``min_width`` when none does (the caller then
    checks that it fits at all)."""
    budget = share * max(0, int(room))
    tokens = int(budget // (max(1, int(batch)) * max(1, int(token_bytes))))
    if tokens < min_width:
        return int(min_width)
    return 1 << (tokens.bit_length() - 1)


@dataclass(frozen=True)
class MemoryPlan:
    """What one :func:`generate` call needs per device and what the device has (``None``: it does not say).

    ``weights_bytes``: target + draft params (already resident); ``kv_bytes``, ``draft_bytes``,
    ``other_state_bytes``: the state (:func:`state_bytes`); ``prefill_temp_bytes``: one prefill chunk of
    ``local_batch x prefill_width`` tokens (:func:`prefill_temp_bytes`; ``local_batch``: the rows on one device),
    ``prefill_chunks`` of them;
    ``bytes_limit`` / ``bytes_in_use``: the device's allocator before the state is created."""

    batch: int
    local_batch: int
    capacity: int
    weights_bytes: int
    kv_bytes: int
    draft_bytes: int
    other_state_bytes: int
    prefill_token_bytes: int
    prefill_width: int
    prefill_chunks: int
    prefill_temp_bytes: int
    bytes_limit: int | None = None
    bytes_in_use: int | None = None

    @property
    def state_bytes(self) -> int:
        return self.kv_bytes + self.draft_bytes + self.other_state_bytes

    @property
    def need_bytes(self) -> int:
        """What the call allocates beside what is already in use: the state and the largest temporary."""
        return self.state_bytes + self.prefill_temp_bytes

    @property
    def free_bytes(self) -> int | None:
        return None if self.bytes_limit is None else self.bytes_limit - (self.bytes_in_use or 0)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "state_bytes": self.state_bytes, "need_bytes": self.need_bytes,
                "free_bytes": self.free_bytes}


def _size(n: int) -> str:
    """Bytes for a message: GiB, MiB or KiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"


def check_fits(mp: MemoryPlan, *, max_new_tokens: int) -> None:
    """Raise :class:`~diffspec_jax.errors.OutOfMemoryError` when ``mp`` needs more than the device has free (no
    check where the device does not report its memory)."""
    free = mp.free_bytes
    if free is None or mp.need_bytes <= free:
        return
    room = free - mp.state_bytes
    fixes = [f"fewer prompts (batch {mp.batch})", f"a smaller max_new_tokens ({max_new_tokens}) or shorter prompts "
             f"(the cache holds {mp.capacity} positions per sequence)"]
    fits = room // max(1, mp.local_batch * mp.prefill_token_bytes) if room > 0 else 0
    if fits >= 16:
        fixes.append(f"a smaller prefill_chunk (the prefill temporaries of at most about {fits} tokens per sequence "
                     f"fit)")
    advice = ", ".join(fixes[:-1]) + " or " + fixes[-1]
    if jax.default_backend() == "gpu":
        advice += "; or give JAX more of the device (XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 by default)"
    raise OutOfMemoryError(
        f"this batch does not fit in device memory: it needs {_size(mp.need_bytes)} (target K/V "
        f"{_size(mp.kv_bytes)}, draft store and working cache {_size(mp.draft_bytes)}, other state "
        f"{_size(mp.other_state_bytes)}, prefill temporaries {_size(mp.prefill_temp_bytes)} for chunks of "
        f"{mp.local_batch} x {mp.prefill_width} tokens) beside the weights ({_size(mp.weights_bytes)}, already on the "
        f"device); the device has {_size(mp.bytes_limit)}, {_size(mp.bytes_in_use or 0)} in use, {_size(free)} free. "
        f"Pass {advice}")


def plan_memory(plan: Plan, lengths, prefill_chunk: int | None, tparams, dparams, target_dtype, draft_dtype,
                stats: dict[str, int] | None) -> MemoryPlan:
    """The :class:`MemoryPlan` of a call: its state, its weights and its prefill chunking. ``prefill_chunk``
    ``None`` = the backend's default (:func:`diffspec_jax.target.default_prefill_chunk`) capped by
    :func:`memory_chunk_cap` when ``stats`` (:func:`device_memory`) gives the device's memory; call it under the
    plan's kernel choice (the default and the formula depend on it)."""
    batch = len(lengths)
    part = state_bytes(plan, batch, target_dtype, draft_dtype)
    weights = tree_bytes(tparams) + (tree_bytes(dparams) if dparams is not None else 0)
    tc = plan.target
    itemsize = np.dtype(target_dtype).itemsize
    flash = attention.fast_path() and (jax.default_backend() != "gpu" or itemsize == 2)
    token = prefill_token_bytes(tc, plan.draft, len(plan.aux_layers), itemsize=itemsize,
                                draft_itemsize=np.dtype(draft_dtype).itemsize, flash=flash, tp=plan.tp,
                                fp8=plan.kv_cache_dtype == "fp8")
    local = max(1, batch // plan.dp)
    chunk = prefill_chunk
    if chunk is None:
        chunk = default_prefill_chunk(batch)
        if stats is not None:
            room = stats["bytes_limit"] - stats.get("bytes_in_use", 0) - sum(part.values())
            chunk = min(chunk, memory_chunk_cap(local, token, room))
    width, n_chunks = plan_prefill(lengths, chunk)
    return MemoryPlan(batch=batch, local_batch=local, capacity=plan.capacity, weights_bytes=weights, kv_bytes=part["kv"],
                      draft_bytes=part["draft"], other_state_bytes=part["other"], prefill_token_bytes=token,
                      prefill_width=int(width), prefill_chunks=int(n_chunks),
                      prefill_temp_bytes=prefill_temp_bytes(token, local, width, tc.vocab_size, tc.hidden_size,
                                                            itemsize),
                      bytes_limit=None if stats is None else stats["bytes_limit"],
                      bytes_in_use=None if stats is None else stats.get("bytes_in_use", 0))
