"""Tensor (and data) parallelism: the sharded parameter layout of a loaded model, placed on a mesh.

The layout of every parameter is declared by its model's table (its logical axes, laid out by the rules of
:data:`diffspec_jax.models.params.AXIS_RULES`); the mesh and the KV-head rule live in :mod:`diffspec_jax.mesh`
(re-exported here), the caches' specs in :mod:`diffspec_jax.cache`. The model code is written for one shard (:mod:`diffspec_jax.models.llama`, :mod:`diffspec_jax.models.eagle3`);
the engine wraps whole steps in ``jax.shard_map`` over a mesh with axes ``("dp", "tp")``. Layout on the ``tp``
axis (Megatron style):

* q/k/v projections column-parallel over heads, ``wo`` row-parallel (``psum``); gate/up column-parallel over
  the intermediate dimension, ``down`` row-parallel (``psum``). Norms are replicated.
* KV caches (target cache, draft store, working cache) are sharded over KV heads like the k/v projections.
  When a model has fewer KV heads than ``tp``, each KV head is **repeated** so that every shard holds exactly the
  one KV head its query heads read (``tp`` must be a multiple of the KV heads): KV memory is replicated
  ``tp / Hkv`` times, as in vLLM.
* Embedding and LM head are **vocabulary-parallel**: each shard holds ``V / tp`` rows (the vocabulary is padded
  with zero rows to a multiple of ``tp``); lookups are masked and ``psum``-ed, logits are computed locally and
  all-gathered. A replicated head would be simpler, but at decode it makes every shard read the whole
  ``V x H`` matrix per step (1 GB for Llama-3.1-8B in bf16, a quarter of each shard's weight bytes at TP4);
  vocabulary parallelism divides that by ``tp`` for an all-gather of ``B x T x V`` float32 logits, and every shard
  ends with identical logits, so sampling and acceptance agree everywhere without further communication.
* The draft follows the target's layout with ``draft_tensor_parallel_size == tp``, or is replicated (``1``):
  one-layer drafts are often faster without collectives; its working cache is then replicated too.
* The ``dp`` axis shards the batch (independent replicas); multi-host use goes through
  ``jax.distributed.initialize`` and a mesh over all processes' devices.

Qwen3.5 hybrid MoE (its table, :func:`diffspec_jax.models.qwen35.param_table`):

* Gated attention: query and gate projections column-parallel over query heads (the per-head interleaved
  ``q_proj`` is split into the two at load time), k/v over KV heads (repeated when fewer than ``tp``), ``o`` row
  parallel.
* Gated DeltaNet: heads sharded. q/k projections and their conv taps over key heads, v / z / b / a, ``dt_bias``,
  ``A_log`` over value heads (contiguous blocks keep each value head next to the key head it reads); key heads that
  do not divide by ``tp`` are repeated like KV heads. ``out_proj`` is row-parallel. The conv and recurrent states
  are sharded over the same heads, so the recurrence needs no communication at all.
* Experts are **tensor-parallel**, not expert-parallel: every shard holds every expert's slice of the
  intermediate dimension (gate/up column-, down row-parallel), like the shared expert. Under this Megatron layout
  the activations are replicated on every shard after each ``psum``, so expert parallelism would save no
  communication (there is no token dispatch to avoid) and would add what tensor parallelism does not have:
  routing-dependent load imbalance (the slowest shard sets the step time; at decode a handful of tokens hit a
  handful of experts, often on one shard) and, with static shapes, padding each shard to the worst case. Sliced
  experts give every shard the same work for any routing, the router runs replicated (identical top-k
  everywhere), and routed + shared experts close with one ``psum``, the same collective as a dense MLP. The cost is
  narrower per-shard GEMMs (Qwen3.5-35B-A3B: 512 / tp columns per expert). Expert parallelism pays off when
  activations are token-sharded (data-parallel attention + all-to-all), which this engine does not do.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from diffspec_jax.config import DraftConfig, ModelConfig
from diffspec_jax.errors import ConfigError
from diffspec_jax.mesh import DP, TP, kv_heads_for, make_mesh, mesh_size  # noqa: F401 (the public names stay here)
from diffspec_jax.models import eagle3, family
from diffspec_jax.models import params as tables


def check_target(config: ModelConfig, tp: int) -> None:
    """Refuse a target whose heads or intermediate size do not split over ``tp`` shards."""
    if config.is_hybrid:
        for name in ("linear_num_value_heads", "shared_expert_intermediate_size"):
            if getattr(config, name) % tp:
                raise ConfigError(f"tensor parallelism: the target's {name} ({getattr(config, name)}) is not "
                                  f"divisible by tp={tp}")
        kv_heads_for(config.linear_num_key_heads, tp, "the target's linear attention")
        if config.intermediate_size % tp:
            raise ConfigError(f"tensor parallelism: the target's moe_intermediate_size ({config.intermediate_size}) "
                              f"is not divisible by tp={tp}")
    _check_heads_and_mlp(config, tp, "the target's", "tp")
    kv_heads_for(config.num_key_value_heads, tp, "the target")


def _check_heads_and_mlp(config, tp: int, who: str, what: str) -> None:
    for name in ("num_attention_heads", "intermediate_size"):
        if getattr(config, name) % tp:
            raise ConfigError(f"tensor parallelism: {who} {name} ({getattr(config, name)}) is not divisible by "
                              f"{what}={tp}")


def check_draft(config: DraftConfig, tp: int) -> None:
    _check_heads_and_mlp(config, tp, "the draft's", "draft_tensor_parallel_size")
    kv_heads_for(config.num_key_value_heads, tp, "the draft")


def draft_tp_for(mesh: Mesh | None, requested: int | None, has_draft: bool) -> int:
    """The draft's tensor-parallel size on ``mesh``: ``requested`` (``SpecConfig.draft_tensor_parallel_size``:
    1 = a replicated draft, or the target's tp; ``None`` = the target's tp); 1 without a mesh or an EAGLE-3 draft."""
    if mesh is None or not has_draft:
        return 1
    tp = mesh_size(mesh, TP)
    draft_tp = tp if requested is None else requested
    if draft_tp not in (1, tp):
        raise ConfigError(f"draft_tensor_parallel_size must be 1 (replicated draft) or the target's tp={tp}, "
                          f"got {draft_tp}")
    return draft_tp


def _fused(params: dict) -> bool:
    """Layers in the serving layout of :func:`diffspec_jax.models.llama.fuse_projections`."""
    return bool(params["layers"]) and "wqkv" in params["layers"][0]


def shard_layout_target(config: ModelConfig, params: dict, tp: int) -> tuple[dict, dict]:
    """The target params in tensor-parallel layout (KV heads repeated, vocabulary padded) and their specs, as
    the family's table declares them (checkpoint or fused layout, as ``params`` are)."""
    check_target(config, tp)
    table = family(config).table(config, fused=_fused(params))
    return tables.shard(table, params, tp), tables.partition_specs(table)


def shard_layout_qwen35(config: ModelConfig, params: dict, tp: int) -> tuple[dict, dict]:
    """Qwen3.5-MoE params in tensor-parallel layout (module docstring: heads sharded, experts tensor-parallel);
    :func:`shard_layout_target` of a hybrid config."""
    if not config.is_hybrid:
        raise ConfigError(f"{config.architecture} is not a Qwen3.5 hybrid model")
    return shard_layout_target(config, params, tp)


def shard_layout_draft(config: DraftConfig, params: dict, tp: int) -> tuple[dict, dict]:
    """The draft params in tensor-parallel layout over ``tp`` shards (``tp == 1``: replicated) and their specs."""
    if tp == 1:
        return params, {k: P() for k in params}
    check_draft(config, tp)
    table = eagle3.param_table(config, params["fc"].shape[0] // config.target_hidden_size, own_embedding=True)
    return tables.shard(table, params, tp), tables.partition_specs(table)


def jit_sharded(fn, mesh: Mesh | None, in_specs: Any, out_specs: Any, donate_argnums: tuple[int, ...] = (),
                compiler_options: dict | None = None):
    """``fn`` jitted, and with a mesh mapped over it per shard first (``jit(shard_map(fn))``, the model code being
    written for one shard with explicit collectives); ``compiler_options``: XLA options for its compilation."""
    if mesh is not None:
        fn = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return jax.jit(fn, donate_argnums=donate_argnums, compiler_options=compiler_options)


def put(tree: Any, specs: Any, mesh: Mesh) -> Any:
    """``device_put`` every leaf with ``NamedSharding(mesh, spec)``."""
    return jax.tree_util.tree_map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs,
                                  is_leaf=lambda x: x is None)


def named(specs: Any, mesh: Mesh) -> Any:
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


def prepare(model, mesh: Mesh, tp: int) -> dict:
    """The params of a ``TargetModel`` or ``DraftModel`` in tensor-parallel layout over ``tp`` shards, placed on
    ``mesh`` (new arrays on every call: :class:`diffspec_jax.engine.Session` keeps them per model and mesh)."""
    layout = shard_layout_target if isinstance(model.config, ModelConfig) else shard_layout_draft
    return put(*layout(model.config, model.params, tp), mesh)
