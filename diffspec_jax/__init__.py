"""diffspec-jax: long-context speculative decoding (EAGLE-3 + DiffSpec working cache) on JAX/XLA.

Public API (stable):

* :func:`load_target` -- a Llama-3.x / Qwen3 target from a Hugging Face or Orbax directory;
* :func:`load_draft` -- an EAGLE-3 draft (SpecForge / vLLM layout) bound to its target;
* :func:`forward` -- full-sequence float32 logits of a loaded target;
* :func:`generate` -- speculative (or target-only, ``draft=None``) generation, returning ``.tokens`` and ``.stats``;
* :class:`SpecConfig`, :class:`SamplingConfig` -- frozen, validated settings;
* :func:`make_mesh` -- a ``("dp", "tp")`` device mesh for tensor / data parallelism (``generate(..., mesh=)``).
"""

from diffspec_jax.config import DraftConfig, ModelConfig, RopeConfig, SamplingConfig, SpecConfig
from diffspec_jax.draft import DraftModel, load_draft
from diffspec_jax.engine import GenerateResult, GenerateStats, generate
from diffspec_jax.sharding import make_mesh
from diffspec_jax.errors import CheckpointError, ConfigError, DiffspecError, InputError, UnsupportedModelError
from diffspec_jax.target import TargetModel, forward, load_target

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "ConfigError", "DiffspecError", "DraftConfig", "DraftModel", "GenerateResult",
    "GenerateStats", "InputError", "ModelConfig", "RopeConfig", "SamplingConfig", "SpecConfig", "TargetModel",
    "UnsupportedModelError", "forward", "generate", "load_draft", "load_target", "make_mesh",
]
