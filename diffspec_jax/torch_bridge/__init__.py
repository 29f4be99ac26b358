"""The torch / torch_npu bridge: DiffSpec's draft-side operations and runtime for torch serving engines.

Importing this package does not import JAX (only torch and NumPy); JAX is loaded lazily by :func:`to_jax` and
:func:`from_jax`. See ``diffspec_jax/torch_bridge/README.md`` for how an engine plugs it in.

* Operations (same contracts as the JAX references, see :mod:`diffspec_jax.torch_bridge.ops`):
  :func:`rope_cos_sin`, :func:`apply_rope`, :func:`head_sum_scores`, :func:`chunk_scores`,
  :func:`paged_head_sum_scores`, :func:`paged_chunk_scores`, :func:`salience_scores`, :func:`update_chunk_sums`,
  :func:`select_chunks`, :func:`history_indices`, :func:`gather_rope_write`, :func:`draft_attention`.
* Runtime: :class:`DiffspecRuntime` (slots, canonical store, cadence, ``retrieval_status``), :class:`PagedKeys`,
  :class:`WorkingCache`.
* Devices: :func:`select_device` (npu > cuda > cpu), :func:`resolve_dtype`, :func:`to_jax` / :func:`from_jax`
  (DLPack, zero-copy on CPU and CUDA).
* Errors: :class:`BridgeError` (a :class:`~diffspec_jax.DiffspecError`, hence a ``ValueError``),
  :class:`SlotError`, :class:`BridgeInputError`.
"""

from diffspec_jax.torch_bridge.device import device_type, from_jax, npu_available, resolve_dtype, select_device, to_jax
from diffspec_jax.torch_bridge.errors import BridgeError, BridgeInputError, SlotError
from diffspec_jax.torch_bridge.ops import (
    apply_rope, chunk_scores, draft_attention, gather_rope_write, head_sum_scores, history_indices,
    paged_chunk_scores, paged_head_sum_scores, rope_cos_sin, salience_scores, select_chunks, update_chunk_sums,
)
from diffspec_jax.torch_bridge.runtime import DiffspecRuntime, PagedKeys, SlotCounters, WorkingCache

__all__ = [
    "BridgeError", "BridgeInputError", "DiffspecRuntime", "PagedKeys", "SlotCounters", "SlotError", "WorkingCache",
    "apply_rope", "chunk_scores", "device_type", "draft_attention", "from_jax", "gather_rope_write",
    "head_sum_scores", "history_indices", "npu_available", "paged_chunk_scores", "paged_head_sum_scores",
    "resolve_dtype", "rope_cos_sin", "salience_scores", "select_chunks", "select_device", "to_jax",
    "update_chunk_sums",
]
