"""Pick the Pallas kernel or its pure-JAX reference for each hot path.

Default: Pallas on GPU, the pure-JAX reference elsewhere (CPU, TPU). ``DIFFSPEC_KERNELS=reference|pallas`` in
the environment overrides the choice; ``pallas`` on a CPU runs the kernels in interpret mode (slow: for tests).
The decision is made at trace time, so it is fixed for the life of a compiled function.

Every function here has the signature of its reference (in :mod:`diffspec_jax.working_cache`,
:mod:`diffspec_jax.retrieval` and :mod:`diffspec_jax.models.layers`) and of its kernel (in :mod:`pallas_kernels`),
so callers never branch.
"""

from __future__ import annotations

import os

import jax

from diffspec_jax.errors import ConfigError

BACKENDS = ("reference", "pallas")


def kernel_backend() -> str:
    """``"pallas"`` or ``"reference"`` for this process (environment override, else by the default device)."""
    choice = os.environ.get("DIFFSPEC_KERNELS", "").strip().lower()
    if choice:
        if choice not in BACKENDS:
            raise ConfigError(f"DIFFSPEC_KERNELS must be one of {BACKENDS}, got {choice!r}")
        return choice
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def interpret_mode() -> bool:
    """Pallas kernels are compiled on GPUs and interpreted everywhere else."""
    return jax.default_backend() != "gpu"


def gather_rope_write(store_k, store_v, work_k, work_v, idx, cos, sin, *, interleaved=False):
    """See :func:`pallas_kernels.gather_rope_write.gather_rope_write`."""
    if kernel_backend() == "pallas":
        from pallas_kernels.gather_rope_write import gather_rope_write as kernel

        return kernel(store_k, store_v, work_k, work_v, idx, cos, sin, interleaved=interleaved)
    from diffspec_jax.working_cache import gather_rope_write_reference

    return gather_rope_write_reference(store_k, store_v, work_k, work_v, idx, cos, sin, interleaved=interleaved)


def chunk_scores(q, lse, k_cache, root, *, chunk):
    """See :func:`pallas_kernels.chunk_scores.chunk_scores` (head sums of the per-chunk mean probability)."""
    if kernel_backend() == "pallas" and chunk & (chunk - 1) == 0 and lse is not None:
        from pallas_kernels.chunk_scores import chunk_scores as kernel

        return kernel(q, lse, k_cache, root, chunk=chunk)
    from diffspec_jax.retrieval import head_sum_scores

    return head_sum_scores(q, lse, k_cache, root, chunk)


def draft_attention(q, k, v, q_local, *, scale):
    """See :func:`pallas_kernels.draft_attention.draft_attention`."""
    if kernel_backend() == "pallas":
        from pallas_kernels.draft_attention import draft_attention as kernel

        return kernel(q, k, v, q_local, scale=scale)
    from diffspec_jax.working_cache import draft_attention_reference

    return draft_attention_reference(q, k, v, q_local, scale=scale)


def cache_attention(q, k, v, lengths, *, scale, causal=False):
    """See :func:`pallas_kernels.cache_attention.cache_attention` (``(out, lse)`` over the committed prefix, and
    with ``causal`` over the chain block written after it)."""
    if kernel_backend() == "pallas":
        from pallas_kernels.cache_attention import cache_attention as kernel

        return kernel(q, k, v, lengths, scale=scale, causal=causal)
    from diffspec_jax.models.layers import attention_prefix

    return attention_prefix(q, k, v, lengths, scale, causal=causal)
