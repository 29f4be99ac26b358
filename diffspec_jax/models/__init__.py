"""Model families: which code runs a target, chosen from its :class:`~diffspec_jax.config.ModelConfig`.

``family(config)`` returns a :class:`Family` whose functions share one signature across families, so the target
handle, the engine and the sharding code never branch on the architecture:

* ``param_shapes(config)``, ``init_params(config, seed, dtype, scale)``: the params layout;
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
* ``create_cache(config, batch, capacity, dtype, *, tp)`` and ``cache_specs(config, dp, tp)``;
* ``tensor_maps(config)``: HF key -> params leaf; ``shard_layout(config, params, tp)``: the TP layout;
* ``supports_tree``: whether tree verification could be used (see :func:`ensure_tree_supported`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

from diffspec_jax.config import ModelConfig
from diffspec_jax.errors import UnsupportedModelError


@dataclass(frozen=True)
class Family:
    """The functions that run one model family (see the module docstring for the shared signatures)."""

    name: str
    supports_tree: bool
    param_shapes: Callable[..., Any]
    init_params: Callable[..., Any]
    forward: Callable[..., Any]
    forward_aux: Callable[..., Any]
    step: Callable[..., Any]
    commit: Callable[..., Any]
    create_cache: Callable[..., Any]
    cache_specs: Callable[..., Any]
    tensor_maps: Callable[..., Any]
    shard_layout: Callable[..., Any]


def _llama_step(config, params, cache, tokens, start, rows, *, aux_layers=(), score_layer=None, axis_name=None,
                num_valid=None, snapshots=False, tree=None, first_chunk=False, rope_positions=None):
    """Attention-only models need neither: KV rows are position-indexed and masked by length."""
    from diffspec_jax.models import llama

    del num_valid, snapshots
    return llama.step(config, params, cache, tokens, start, rows, aux_layers=aux_layers, score_layer=score_layer,
                      axis_name=axis_name, tree=tree, first_chunk=first_chunk, rope_positions=rope_positions)


def _identity_commit(config, cache, out, keep):
    del config, out, keep
    return cache


@functools.lru_cache(maxsize=None)
def _build(name: str) -> Family:
    from checkpoints_tools import hf
    from diffspec_jax import cache, sharding

    if name == "llama":
        from diffspec_jax.models import llama

        return Family(name="llama", supports_tree=True, param_shapes=llama.param_shapes,
                      init_params=llama.init_params, forward=llama.forward, forward_aux=llama.forward_aux,
                      step=_llama_step, commit=_identity_commit, create_cache=cache.create_cache,
                      cache_specs=sharding.cache_specs, tensor_maps=hf.llama_tensor_maps,
                      shard_layout=sharding.shard_layout_target)
    if name == "qwen3_5_moe":
        from diffspec_jax.models import qwen35

        return Family(name="qwen3_5_moe", supports_tree=qwen35.SUPPORTS_TREE, param_shapes=qwen35.param_shapes,
                      init_params=qwen35.init_params, forward=qwen35.forward, forward_aux=qwen35.forward_aux,
                      step=qwen35.step, commit=qwen35.commit, create_cache=cache.create_cache,
                      cache_specs=sharding.cache_specs, tensor_maps=hf.qwen35_tensor_maps,
                      shard_layout=sharding.shard_layout_target)
    raise UnsupportedModelError(f"unknown model family {name!r}")


def family(config: ModelConfig) -> Family:
    """The :class:`Family` that runs ``config``."""
    return _build(config.family)


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
