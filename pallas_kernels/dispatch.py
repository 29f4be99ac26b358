"""Every hot path's Pallas kernel or its pure-JAX reference, in one list.

The choice (:func:`kernel_backend`: the active :func:`use_kernels` choice, i.e. ``SpecConfig.kernels`` inside the
engine's programs, else Pallas on GPUs and the references elsewhere) is made where each reference lives, by its
``run_*`` function; this module names them together:

* :func:`gather_rope_write`: :func:`pallas_kernels.gather_rope_write.gather_rope_write` or
  :func:`diffspec_jax.working_cache.gather_rope_write_reference` (by :func:`diffspec_jax.working_cache.run_gather_rope_write`);
* :func:`chunk_scores`: :func:`pallas_kernels.chunk_scores.chunk_scores` or :func:`diffspec_jax.retrieval.head_sum_scores`
  (by :func:`diffspec_jax.retrieval.run_chunk_scores`; over a paged pool, ``pages`` and ``page_size``, the kernel reads
  through the page table and the reference scores the gathered view);
* :func:`draft_attention`: :func:`pallas_kernels.draft_attention.draft_attention` or
  :func:`diffspec_jax.working_cache.draft_attention_reference` (by :func:`diffspec_jax.working_cache.run_draft_attention`);
* :func:`cache_attention`: :func:`pallas_kernels.cache_attention.cache_attention` or
  :func:`diffspec_jax.models.layers.attention_prefix` (by :func:`diffspec_jax.models.attention.run_cache_attention`).

Every function has the signature of its reference and of its kernel, so callers never branch.
"""

from __future__ import annotations

from diffspec_jax.models.attention import run_cache_attention as cache_attention
from diffspec_jax.retrieval import run_chunk_scores as chunk_scores
from diffspec_jax.working_cache import run_draft_attention as draft_attention
from diffspec_jax.working_cache import run_gather_rope_write as gather_rope_write
from pallas_kernels.common import BACKENDS, interpret_mode, kernel_backend, resolve_kernels, use_kernels

__all__ = ["BACKENDS", "cache_attention", "chunk_scores", "draft_attention", "gather_rope_write", "interpret_mode",
           "kernel_backend", "resolve_kernels", "use_kernels"]
