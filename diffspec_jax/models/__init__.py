"""Model families: which code runs a target, chosen from its :class:`~diffspec_jax.config.ModelConfig`.

``family(config)`` returns a :class:`Family` whose functions share one signature across families, so the target
handle, the engine and the sharding code never branch on the architecture:

* ``table(config, *, prefix=None, fused=False)``: the parameter table (:mod:`diffspec_jax.models.params`), from
  which ``param_shapes(config)`` and ``init_params(config, seed, dtype, scale)``, the tensor-parallel layout
  (:mod:`diffspec_jax.sharding`) and the checkpoint layout (:mod:`checkpoints_tools.hf`) are derived;
* ``forward(config, params, tokens, *, axis_name)`` / ``forward_aux(...)``: full sequence, no cache;
* ``step(config, params, cache, tokens, start, rows, *, aux_layers, score_layer, axis_name, num_valid,
  snapshots, tree, first_chunk, rope_positions)``: the cached step (prefill chunks, decode, verification).
  ``num_valid [B]`` says how many of the T tokens are real (prompt padding is not); ``snapshots=True`` keeps what
  :func:`commit` needs; ``tree`` (families with ``supports_tree`` only) verifies a draft tree (see
  :func:`diffspec_jax.models.llama.step`); ``first_chunk=True`` (static) promises every ``start`` is 0 (a prompt's
  first prefill chunk); ``rope_positions [B, T]`` rotates the new tokens at other positions than their cache rows (the
  self-draft's working set);
* ``commit(config, cache, out, keep)``: after acceptance, make the cache hold the state after ``keep[b]`` of the
  verified tokens (identity for pure-attention models, whose KV is truncated by length; state rollback for
  hybrid ones);
* ``cache_specs(config, dp, tp)``: the partition specs of its cache (:func:`diffspec_jax.cache.create_cache`
  builds the cache itself);
* ``supports_tree``: whether tree verification could be used (see :func:`ensure_tree_supported`).

Adding a family is one module (its table and forward functions) and one entry in :data:`FAMILIES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from diffspec_jax import cache
from diffspec_jax.config import ModelConfig
from diffspec_jax.errors import UnsupportedModelError
from diffspec_jax.models import llama, qwen35


@dataclass(frozen=True)
class Family:
    """The functions that run one model family (see the module docstring for the shared signatures)."""

    name: str
    supports_tree: bool
    table: Callable[..., Any]
    param_shapes: Callable[..., Any]
    init_params: Callable[..., Any]
    forward: Callable[..., Any]
    forward_aux: Callable[..., Any]
    step: Callable[..., Any]
    commit: Callable[..., Any]
    cache_specs: Callable[..., Any]


def _llama_step(config, params, cache, tokens, start, rows, *, aux_layers=(), score_layer=None, axis_name=None,
                num_valid=None, snapshots=False, tree=None, first_chunk=False, rope_positions=None):
    """Attention-only models need neither: KV rows are position-indexed and masked by length."""
    del num_valid, snapshots
    return llama.step(config, params, cache, tokens, start, rows, aux_layers=aux_layers, score_layer=score_layer,
                      axis_name=axis_name, tree=tree, first_chunk=first_chunk, rope_positions=rope_positions)


def _identity_commit(config, cache, out, keep):
    del config, out, keep
    return cache


#: every supported family by :attr:`ModelConfig.family`
FAMILIES = {
    "llama": Family(name="llama", supports_tree=True, table=llama.param_table, param_shapes=llama.param_shapes,
                    init_params=llama.init_params, forward=llama.forward, forward_aux=llama.forward_aux,
                    step=_llama_step, commit=_identity_commit, cache_specs=cache.cache_specs),
    "qwen3_5_moe": Family(name="qwen3_5_moe", supports_tree=qwen35.SUPPORTS_TREE, table=qwen35.param_table,
                          param_shapes=qwen35.param_shapes, init_params=qwen35.init_params, forward=qwen35.forward,
                          forward_aux=qwen35.forward_aux, step=qwen35.step, commit=qwen35.commit,
                          cache_specs=cache.cache_specs),
}


def family(config: ModelConfig) -> Family:
    """The :class:`Family` that runs ``config``."""
    if config.family not in FAMILIES:
        raise UnsupportedModelError(f"unknown model family {config.family!r}")
    return FAMILIES[config.family]


def ensure_tree_supported(config: ModelConfig) -> None:
    """The hook every tree-verification path must call first.

    Raises:
        UnsupportedModelError: for families without tree support. Qwen3.5's Gated DeltaNet layers would need a
            recurrent + conv state snapshot per tree node (and a tree-masked recurrence), so it verifies chains only.
    """
    fam = family(config)
    if not fam.supports_tree:
        raise UnsupportedModelError(
            f"tree verification is not supported for {config.architecture} (model family {fam.name!r}): its linear-"
            f"attention (Gated DeltaNet) layers carry recurrent state that would need a snapshot per tree node; use "
            f"chain verification (the default)")
