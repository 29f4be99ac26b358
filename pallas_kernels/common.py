"""Shared helpers of the Pallas kernels.

**Lowering.** The kernels use Pallas's Triton lowering on GPUs (``compiler_params=CompilerParams`` of
``jax.experimental.pallas.triton``) rather than Mosaic GPU. Why: their core is a data-dependent *row gather*
(history positions of the working cache, a sequence's K-cache rows), which the Triton lowering expresses
directly as vector-indexed loads with masks; on Hopper, Mosaic GPU has no TMA gather (Blackwell only) and would
need per-row asynchronous copies and warpgroup-level code for the same thing. The cost: JAX 0.11 deprecates the
Triton lowering (it remains in JAX 0.10 to 0.12, the versions this project supports), block dimensions must be
powers of two, and there is no TMA. Each kernel has a pure-JAX reference with the same signature, and the module
that owns the reference picks one of the two by :func:`kernel_backend` (:mod:`pallas_kernels.dispatch` lists
them), so porting one to Mosaic GPU later changes nothing else.

**The choice** is configuration (:attr:`diffspec_jax.SpecConfig.kernels`: ``auto`` / ``reference`` / ``pallas``;
``$DIFFSPEC_KERNELS`` only gives its default, read when the config is built). The engine traces each program under
its plan's choice (:func:`use_kernels`); :func:`kernel_backend` returns the innermost one while tracing, and the
device default (:func:`resolve_kernels` of ``"auto"``) outside any, e.g. for a model function called directly.

**Indexing.** Every load and store indexes all four dimensions with broadcastable integer arrays (no slices):
that single form is what both the Triton lowering (pointer arithmetic) and the CPU interpreter accept for gathers,
strided columns and masks, so the interpreted kernel *is* the compiled kernel.

**Split-K attention.** The two attention kernels (:mod:`pallas_kernels.draft_attention`,
:mod:`pallas_kernels.cache_attention`) share their inner tile step (:func:`online_softmax_step`), their split merge
epilogue (:func:`merge_splits`) and their query-row packing (row ``t * G + j`` = step t, head j of a KV head's
group; :func:`rows_to_heads` undoes it).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import jax
import jax.numpy as jnp

from diffspec_jax.errors import ConfigError

#: the finite "minus infinity" of the softmax statistics, in the kernels and their references
#: (:data:`diffspec_jax.models.layers.NEG_INF`)
NEG = -1e30
BACKENDS = ("reference", "pallas")


#: the backend chosen by the innermost :func:`use_kernels` (``None``: none is active); a context variable, so each
#: thread that traces (the server's engine thread, a caller's) sees only its own choice
_CHOICE: contextvars.ContextVar[str | None] = contextvars.ContextVar("diffspec_kernels", default=None)


def resolve_kernels(choice: str) -> str:
    """The backend of a kernel choice: ``"auto"`` is Pallas on GPUs and the pure-JAX references elsewhere
    (``"pallas"`` on a CPU interprets the kernels: slow, for tests)."""
    if choice == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    if choice not in BACKENDS:
        raise ConfigError(f"kernels must be one of {('auto',) + BACKENDS}, got {choice!r}")
    return choice


#: whether the innermost :func:`use_deterministic` asks for row-invariant attention (``False`` outside any)
_DETERMINISTIC: contextvars.ContextVar[bool] = contextvars.ContextVar("diffspec_deterministic", default=False)


@contextlib.contextmanager
def use_deterministic(on: bool) -> Iterator[bool]:
    """Trace the attention kernels inside the block in their deterministic form (:attr:`diffspec_jax.SpecConfig.
    deterministic`: every query row's result independent of how many rows share the call and where its block
    starts); the engine traces each program under its plan's setting."""
    token = _DETERMINISTIC.set(bool(on))
    try:
        yield bool(on)
    finally:
        _DETERMINISTIC.reset(token)


def deterministic() -> bool:
    """The innermost :func:`use_deterministic` setting while tracing (``False`` outside any)."""
    return _DETERMINISTIC.get()


@contextlib.contextmanager
def use_kernels(choice: str) -> Iterator[str]:
    """Trace (or call) the kernel selectors with ``choice`` (``auto`` / ``reference`` / ``pallas``) inside the
    block; yields the resolved backend."""
    token = _CHOICE.set(resolve_kernels(choice))
    try:
        yield _CHOICE.get()
    finally:
        _CHOICE.reset(token)


def kernel_backend() -> str:
    """``"pallas"`` or ``"reference"``: the innermost :func:`use_kernels` choice, else the device default. The
    selectors read it when they are traced, so a compiled function keeps the choice it was traced with (the
    engine's programs are traced under their plan's choice, which is part of their compile key)."""
    choice = _CHOICE.get()
    return resolve_kernels("auto") if choice is None else choice


def interpret_mode() -> bool:
    """Pallas kernels are compiled on GPUs and interpreted everywhere else."""
    return jax.default_backend() != "gpu"


def pow2_pieces(start: int, stop: int) -> list[tuple[int, int]]:
    """Split ``[start, stop)`` into ``(offset, size)`` pieces whose sizes are powers of two (Triton block sizes)."""
    pieces = []
    while start < stop:
        size = 1 << ((stop - start).bit_length() - 1)
        pieces.append((start, size))
        start += size
    return pieces


def next_pow2(n: int, lo: int = 1) -> int:
    return max(lo, 1 << max(0, int(n) - 1).bit_length())


def call_options(num_warps: int = 4, num_stages: int = 2) -> dict:
    """``pallas_call`` keyword arguments: interpret on CPU, Triton compiler parameters on GPU."""
    if interpret_mode():
        return {"interpret": True}
    from jax.experimental.pallas import triton as plgpu

    return {"compiler_params": plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)}


def dot_precision(dtype) -> tuple:
    """Full float32 precision for float32 operands (Triton's default float32 dot is TF32)."""
    hi = jax.lax.Precision.HIGHEST
    return (hi, hi) if jnp.dtype(dtype) == jnp.float32 else (jax.lax.Precision.DEFAULT,) * 2


def matmul(a, b, *, trans_b: bool = False, precision=None):
    """2-D product with float32 accumulation inside a kernel (``b`` transposed when ``trans_b``).

    ``lax.dot_general`` lowers to a Triton dot (``pl.dot`` is gone from JAX 0.12) and to a plain dot in interpret
    mode; ``precision=dot_precision(dtype)`` keeps float32 operands in IEEE float32.
    """
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def paged_rows(pt_ref, b, pos, visible, page_size: int):
    """Inside a Pallas GPU kernel: where sequence ``b``'s positions ``pos`` (int32 vector) lie in its K/V buffer,
    as ``(sequence index, rows)``. Contiguous buffers (``page_size`` 0): ``(b, pos)``. A paged pool
    ``[1, H, (N + 1) * P, D]``: ``(0, pages[b, pos // P] * P + pos % P)`` through the page table ``pt_ref`` ``[B,
    max_pages]``, its entries loaded only where ``visible`` (past a sequence's pages they may be anything)."""
    if not page_size:
        return b, pos
    from jax.experimental.pallas import triton as plgpu

    col = jnp.clip(pos // page_size, 0, pt_ref.shape[1] - 1)
    page = plgpu.load(pt_ref.at[b, col], mask=visible, other=0)
    return 0, page * page_size + pos % page_size


def pow2(e: jax.Array) -> jax.Array:
    """``2 ** e`` in float32, exactly, for int32 ``e`` in [-126, 127] (built from its exponent bits)."""
    return jax.lax.bitcast_convert_type(((e + 127) << 23).astype(jnp.int32), jnp.float32)


def exponent(x: jax.Array) -> jax.Array:
    """``floor(log2(x))`` of positive normal float32 ``x``, exactly (its exponent bits), as int32; -127 for 0."""
    return ((jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32) >> 23) & 0xFF) - 127


#: float16 operands of the fp8 path are scaled into [2 ** HALF_TOP, 2 ** (HALF_TOP + 1)) per row: far from float16's
#: overflow (65504) and 2 ** 22 above its smallest normal value, so only entries that small next to the row's largest
#: lose bits (bfloat16 keeps 8 bits at any magnitude; float16 keeps 11 bits over that range)
HALF_TOP = 8


def half_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(x * 2 ** -e as float16, 2 ** e [R] float32)`` of float32 rows ``x [R, N]`` with ``e`` per row such that
    the row's largest magnitude lands in ``[2 ** HALF_TOP, 2 ** (HALF_TOP + 1))`` (power-of-two scalings: exact in
    float32; all-zero rows keep e = 0)."""
    m = jnp.max(jnp.abs(x), axis=1)
    e = jnp.where(m > 0, jnp.clip(exponent(m) - HALF_TOP, -120, 120), 0)
    return (x * pow2(-e)[:, None]).astype(jnp.float16), pow2(e)


def online_softmax_step(carry, q, k, v, visible, *, scale, precision, k_scale=None, v_scale=None, q_pow2=None):
    """One key tile of an online softmax, inside a kernel (float32 statistics).

    Args:
        carry: ``(acc [R, D], m [R], l [R])`` float32: unnormalised output, running max and running sum of
            ``exp(logit - m)`` of each query row (initially 0, :data:`NEG`, 0).
        q: ``[R, D]`` query rows (cast to ``k.dtype`` for the product); k, v: ``[N, D]`` the tile's keys / values.
        visible: bool, broadcastable to ``[R, N]``: which (row, key) pairs count. Invisible keys get no weight,
            so their values must be finite (load them masked, as zeros).
        scale: softmax scale; precision: :func:`dot_precision` of the operands.
        k_scale, v_scale: float32 ``[N]`` per-row scales of 8-bit keys and values (``float8_e4m3fn`` k, v, upcast
            exactly to q's dtype in registers): the logits are ``(q . k) * scale * k_scale`` per key column and
            the value product ``(p * v_scale) @ v`` (``None``: full-precision k, v).
        q_pow2: float32 ``[R]``, only with a float16 ``q`` from :func:`half_rows`: the power of two each query row
            was divided by. float16 products then run on row-normalised operands: the logits are
            ``(q . k) * q_pow2 * scale * k_scale`` and the probabilities' row ``(p * v_scale)`` enters the value
            product divided by a power of two bounding it (the row's tile maximum ``exp(max logit - m)`` times the
            tile's largest ``v_scale``), multiplied back after it, so no weight overflows float16 or sinks into its
            subnormals unless it is ``2 ** -22`` of the row's largest.
    Returns:
        The updated carry; probabilities are cast to ``v.dtype`` (q's for 8-bit values) for the ``p @ v`` product.
    """
    acc, m, l = carry
    if k_scale is not None:
        k, v = k.astype(q.dtype), v.astype(q.dtype)
    logits = matmul(q.astype(k.dtype), k, trans_b=True, precision=precision) * scale
    if q_pow2 is not None:
        logits = logits * q_pow2[:, None]
    if k_scale is not None:
        logits = logits * k_scale[None, :]
    logits = jnp.where(visible, logits, NEG)
    top = jnp.max(logits, axis=1)
    m_new = jnp.maximum(m, top)
    p = jnp.where(visible, jnp.exp(logits - m_new[:, None]), 0.0)
    corr = jnp.exp(m - m_new)
    l = l * corr + jnp.sum(p, axis=1)
    pv = p if v_scale is None else p * v_scale[None, :]
    if q_pow2 is None:
        return acc * corr[:, None] + matmul(pv.astype(v.dtype), v, precision=precision), m_new, l
    bound = jnp.exp(top - m_new) * jnp.max(v_scale)         # >= every entry of the row's pv (0: the row saw nothing)
    e = jnp.where(bound > 0, jnp.clip(exponent(bound) + 1 - (HALF_TOP + 6), -120, 120), 0)  # rows below 2 ** 14
    part = matmul((pv * pow2(-e)[:, None]).astype(jnp.float16), v, precision=precision)
    return acc * corr[:, None] + part * pow2(e)[:, None], m_new, l


def pairwise_sum(x: jax.Array, axis: int) -> jax.Array:
    """The sum over ``axis`` in a fixed balanced tree: zero-padded to a power of two, then halved level by level
    (element ``2i`` plus element ``2i + 1``), one elementwise op per level. Each output element's rounding then
    depends on its own operands alone (never on the array's other extents, as a reduction's may), and trailing
    zeros leave it unchanged (``x + 0`` is exact)."""
    n = x.shape[axis]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, width - n)
        x = jnp.pad(x, pad)
    while x.shape[axis] > 1:
        even = jax.lax.slice_in_dim(x, 0, None, 2, axis)
        odd = jax.lax.slice_in_dim(x, 1, None, 2, axis)
        x = even + odd
    return jax.lax.squeeze(x, (axis % x.ndim,))


def merge_splits_ordered(o, m, l, live):
    """:func:`merge_splits` with the splits added in a fixed tree over the split index (:func:`pairwise_sum`;
    ``live`` required): the sum of a query row is then the same whatever the other rows and however many splits
    follow its last live one (those add exact zeros), where a reduction over the split axis may reassociate by
    shape. The deterministic attention's epilogue, log2(splits) elementwise levels. (With the splits added one after
    another instead, 128 a layer at 64K, the deterministic decode step took 1.87x the default one on an H200; with
    the tree 1.17x: ``benchmarks/results/deterministic_steps_unrolled_merge_h200.json`` and
    ``deterministic_steps_h200.json``.)"""
    live = live[:, None, :, None]
    m = jnp.where(live, m, NEG)
    m_all = jnp.max(m, axis=2)                                      # order-free: a max is exact
    w = jnp.where(live, jnp.exp(m - m_all[:, :, None]), 0.0)        # [B, H, splits, R]
    den = pairwise_sum(l * w, axis=2)
    out = pairwise_sum(jnp.where(live[..., None], o, 0.0) * w[..., None], axis=2)
    return out / den[..., None], m_all + jnp.log(den)


def merge_splits(o, m, l, live=None):
    """XLA epilogue of a split-K kernel: merge the per-split partial results of every query row.

    Args:
        o: float32 ``[B, H, splits, R, D]`` unnormalised partial outputs; m, l: float32 ``[B, H, splits, R]``
            their running max and sum (as :func:`online_softmax_step` leaves them).
        live: optional bool ``[B, splits]``: splits that saw at least one key. The others are ignored, so their
            ``o`` may be left unwritten (any bits, NaN included); without it every split takes part.
    Returns:
        ``(out [B, H, R, D], lse [B, H, R])`` float32: softmax output and natural log-sum-exp of the logits over
        every split. A row no key reached (a sum of 0) gets NaN / -inf: the caller decides what it means.
    """
    if live is not None:
        live = live[:, None, :, None]
        m = jnp.where(live, m, NEG)
    m_all = jnp.max(m, axis=2, keepdims=True)
    w_split = jnp.exp(m - m_all)                                    # [B, H, splits, R]
    if live is not None:
        w_split = jnp.where(live, w_split, 0.0)
        o = jnp.where(live[..., None], o, 0.0)
    den = jnp.sum(l * w_split, axis=2)
    out = jnp.sum(o * w_split[..., None], axis=2) / den[..., None]
    return out, m_all[:, :, 0] + jnp.log(den)


def rows_to_heads(x, steps: int, group: int):
    """``[B, Hkv, R, ...]`` packed query rows (row ``t * group + j``, ``R >= steps * group``) to
    ``[B, steps, Hkv * group, ...]`` (query head ``h * group + j`` of KV head h)."""
    b, hkv = x.shape[:2]
    x = x[:, :, : steps * group].reshape(b, hkv, steps, group, *x.shape[3:])
    return jnp.moveaxis(x, 2, 1).reshape(b, steps, hkv * group, *x.shape[4:])
