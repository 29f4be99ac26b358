"""diffspec-jax: long-context speculative decoding (EAGLE-3 + DiffSpec working cache) on JAX/XLA.

Public API (stable):

* :func:`load_target` -- a Llama-3.x / Qwen3 / Qwen3.5-MoE (hybrid) target from a Hugging Face or Orbax directory;
* :func:`load_draft` -- an EAGLE-3 draft (SpecForge / vLLM layout) bound to its target;
* :func:`forward` -- full-sequence float32 logits of a loaded target;
* :func:`generate` -- speculative (or target-only, ``draft=None``) generation, returning ``.tokens`` and ``.stats``;
* :class:`SpecConfig` (its parts :class:`Full` / :class:`Recent` / :class:`DiffSpec`, :class:`Chain` /
  :class:`Tree` and :class:`NGram`), :class:`SamplingConfig` -- frozen, validated settings;
* :func:`make_mesh` -- a ``("dp", "tp")`` device mesh for tensor / data parallelism (``generate(..., mesh=)``).

Importing the package does not import JAX: the configuration classes and errors (NumPy only) load eagerly, and
the JAX-backed names load on first access (PEP 562 module ``__getattr__``). This keeps
:mod:`diffspec_jax.torch_bridge` usable in torch-only processes (e.g. an Ascend serving engine).
"""

from importlib import import_module as _import_module
from typing import TYPE_CHECKING

from diffspec_jax.config import (Chain, DiffSpec, DraftConfig, Full, ModelConfig, NGram, Recent, RopeConfig,
                                 SamplingConfig, SpecConfig, Tree)
from diffspec_jax.errors import (CheckpointError, ConfigError, DiffspecError, InputError, OutOfMemoryError,
                                 UnsupportedModelError)

if TYPE_CHECKING:  # static analysers see the eager imports
    from diffspec_jax.draft import DraftModel, load_draft
    from diffspec_jax.engine import GenerateResult, GenerateStats, generate
    from diffspec_jax.engine.prefix_cache import PrefixCache
    from diffspec_jax.mesh import make_mesh
    from diffspec_jax.target import TargetModel, forward, load_target
del TYPE_CHECKING  # the namespace holds the public API (and the submodules imported so far), nothing else

__version__ = "0.1.0"

#: JAX-backed public names -> the module that defines them (imported on first access)
_LAZY = {
    "DraftModel": "diffspec_jax.draft", "load_draft": "diffspec_jax.draft",
    "GenerateResult": "diffspec_jax.engine", "GenerateStats": "diffspec_jax.engine",
    "generate": "diffspec_jax.engine", "PrefixCache": "diffspec_jax.engine.prefix_cache",
    "make_mesh": "diffspec_jax.mesh",
    "TargetModel": "diffspec_jax.target", "forward": "diffspec_jax.target", "load_target": "diffspec_jax.target",
}

__all__ = [
    "Chain", "CheckpointError", "ConfigError", "DiffSpec", "DiffspecError", "DraftConfig", "DraftModel", "Full",
    "GenerateResult", "GenerateStats", "InputError", "ModelConfig", "NGram", "OutOfMemoryError", "PrefixCache", "Recent",
    "RopeConfig",
    "SamplingConfig", "SpecConfig", "TargetModel", "Tree",
    "UnsupportedModelError", "forward", "generate", "load_draft", "load_target", "make_mesh",
]


def __getattr__(name: str) -> object:
    """Load a JAX-backed public name on first access and cache it in the package namespace.

    Only the names in ``_LAZY`` resolve here; anything else raises ``AttributeError`` so that
    ``from diffspec_jax import engine`` still imports the submodule. (Importing the CLI module
    ``diffspec_jax.generate`` rebinds ``diffspec_jax.generate`` to that module, which is callable.)
    """
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'diffspec_jax' has no attribute {name!r}")
    value = getattr(_import_module(module), name)
    globals().setdefault(name, value)  # a submodule bound meanwhile (diffspec_jax.generate) keeps its binding
    return globals()[name]


def __dir__() -> list[str]:
    """The public API, the version, the submodules imported so far and the module's dunders; no private or
    imported helper names."""
    return sorted(set(__all__) | {n for n in globals() if not n.startswith("_") or n.endswith("__")})
