"""diffspec-jax: long-context speculative decoding (EAGLE-3 + DiffSpec working cache) on JAX/XLA.

Public API (stable):

* :func:`load_target` -- load a Llama-3.x / Qwen3 target from a Hugging Face or Orbax directory;
* :func:`forward` -- full-sequence float32 logits of a loaded target.
"""

from diffspec_jax.config import ModelConfig, RopeConfig
from diffspec_jax.errors import CheckpointError, ConfigError, DiffspecError, InputError, UnsupportedModelError
from diffspec_jax.target import TargetModel, forward, load_target

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "ConfigError", "DiffspecError", "InputError", "ModelConfig", "RopeConfig",
    "TargetModel", "UnsupportedModelError", "forward", "load_target",
]
