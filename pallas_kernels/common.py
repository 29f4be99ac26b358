"""Shared helpers of the Pallas kernels.

**Lowering.** The kernels use Pallas's Triton lowering on GPUs (``compiler_params=CompilerParams`` of
``jax.experimental.pallas.triton``) rather than Mosaic GPU. Why: their core is a data-dependent *row gather*
(history positions of the working cache, a sequence's K-cache rows), which the Triton lowering expresses
directly as vector-indexed loads with masks; on Hopper, Mosaic GPU has no TMA gather (Blackwell only) and would
need per-row asynchronous copies and warpgroup-level code for the same thing. The cost: JAX 0.11 deprecates the
Triton lowering (it remains in JAX 0.10 to 0.12, the versions this project supports), block dimensions must be
powers of two, and there is no TMA. Each kernel sits behind :mod:`pallas_kernels.dispatch` next to a pure-JAX
reference with the same signature, so porting one to Mosaic GPU later changes nothing else.

**Indexing.** Every load and store indexes all four dimensions with broadcastable integer arrays (no slices):
that single form is what both the Triton lowering (pointer arithmetic) and the CPU interpreter accept for gathers,
strided columns and masks, so the interpreted kernel *is* the compiled kernel.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.dispatch import interpret_mode


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
    import jax

    hi = jax.lax.Precision.HIGHEST
    return (hi, hi) if jnp.dtype(dtype) == jnp.float32 else (jax.lax.Precision.DEFAULT,) * 2


def matmul(a, b, *, trans_b: bool = False, precision=None):
    """2-D product with float32 accumulation inside a kernel (``b`` transposed when ``trans_b``).

    ``lax.dot_general`` lowers to a Triton dot (``pl.dot`` is gone from JAX 0.12) and to a plain dot in interpret
    mode; ``precision=dot_precision(dtype)`` keeps float32 operands in IEEE float32.
    """
    import jax

    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)
