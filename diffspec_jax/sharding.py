"""Tensor (and data) parallelism: the mesh, the sharded parameter layout, and partition specs of the state.

The model code is written for one shard (:mod:`diffspec_jax.models.llama`, :mod:`diffspec_jax.models.eagle3`);
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

Qwen3.5 hybrid MoE (:func:`shard_layout_qwen35`):

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

import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from diffspec_jax.config import DraftConfig, ModelConfig
from diffspec_jax.errors import ConfigError

TP, DP = "tp", "dp"


def make_mesh(tp: int = 1, dp: int = 1, devices: list | None = None) -> Mesh:
    """A ``("dp", "tp")`` mesh over the first ``dp * tp`` devices (Auto axes, so jit reshards inputs as needed).

    Works with CPU virtual devices (``XLA_FLAGS=--xla_force_host_platform_device_count=N``), one GPU or several;
    with ``jax.distributed.initialize`` the devices of every process are included.
    """
    devices = list(devices if devices is not None else jax.devices())
    if tp < 1 or dp < 1:
        raise ConfigError(f"mesh sizes must be >= 1, got tp={tp}, dp={dp}")
    if dp * tp > len(devices):
        raise ConfigError(f"a mesh of dp={dp} x tp={tp} needs {dp * tp} devices, only {len(devices)} are visible")
    return Mesh(np.array(devices[: dp * tp]).reshape(dp, tp), (DP, TP))


def mesh_size(mesh: Mesh | None, axis: str) -> int:
    return 1 if mesh is None else int(mesh.shape[axis])


def kv_heads_for(num_kv_heads: int, tp: int, what: str) -> int:
    """KV heads after repetition for ``tp`` shards (refusing layouts that cannot be split)."""
    if num_kv_heads % tp == 0:
        return num_kv_heads
    if tp % num_kv_heads == 0:
        return tp
    raise ConfigError(f"tensor parallelism: {what} has {num_kv_heads} KV heads, which neither divide by tp={tp} nor "
                      f"divide tp")


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


def _pad_rows(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    pad = (-x.shape[axis]) % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _with_vocab_parallel_ends(params: dict, layers: list, specs: list, tp: int) -> tuple[dict, dict]:
    """Assemble a target's TP params and specs: vocabulary-parallel embedding / LM head (padded to a multiple of
    ``tp``), replicated final norm, and the given per-layer params and specs."""
    out = {"embed": _pad_rows(params["embed"], 0, tp), "final_norm": params["final_norm"], "layers": layers}
    spec = {"embed": P(TP, None), "final_norm": P(), "layers": specs}
    if "lm_head" in params:
        out["lm_head"] = _pad_rows(params["lm_head"], 1, tp)
        spec["lm_head"] = P(None, TP)
    return out, spec


def _repeat_kv(w: jax.Array, heads: int) -> jax.Array:
    """Repeat KV heads (axis 1 of ``[in, Hkv, D]``) up to ``heads``; each copy stays next to its original."""
    return jnp.repeat(w, heads // w.shape[1], axis=1) if heads != w.shape[1] else w


def shard_layout_target(config: ModelConfig, params: dict, tp: int) -> tuple[dict, dict]:
    """The target params in tensor-parallel layout (KV heads repeated, vocabulary padded) and their specs."""
    if config.is_hybrid:
        return shard_layout_qwen35(config, params, tp)
    check_target(config, tp)
    kv = kv_heads_for(config.num_key_value_heads, tp, "the target")
    col, row = P(None, TP, None), P(TP, None, None)
    layout = {"wq": col, "wk": col, "wv": col, "wo": row, "w_gate": P(None, TP), "w_up": P(None, TP),
              "w_down": P(TP, None), "wqkv": P(None, TP, None, None), "w_gate_up": P(None, None, TP)}
    layers, specs = [], []
    for lp in params["layers"]:
        if "wqkv" in lp:
            layers.append({**lp, "wqkv": _regroup_qkv(lp["wqkv"], kv)})
        else:
            layers.append({**lp, "wk": _repeat_kv(lp["wk"], kv), "wv": _repeat_kv(lp["wv"], kv)})
        specs.append({k: layout.get(k, P()) for k in lp})
    return _with_vocab_parallel_ends(params, layers, specs, tp)


def _regroup_qkv(w: jax.Array, groups: int) -> jax.Array:
    """A fused ``wqkv [H, Hkv, G + 2, D]`` (:func:`diffspec_jax.models.llama.fuse_projections`) as ``groups``
    KV groups: with more groups than KV heads, each head's G queries are split in ``r = groups / Hkv`` parts and
    every part gets a copy of the head's key and value (the fused form of :func:`_repeat_kv`)."""
    h, hkv, g2, d = w.shape
    r = groups // hkv
    if r == 1:
        return w
    q = w[:, :, : g2 - 2].reshape(h, hkv, r, (g2 - 2) // r, d)
    kv = jnp.broadcast_to(w[:, :, None, g2 - 2:], (h, hkv, r, 2, d))
    return jnp.concatenate([q, kv], axis=3).reshape(h, groups, (g2 - 2) // r + 2, d)


#: per-leaf specs of the Qwen3.5 layers (leaves not named here are replicated)
_QWEN35_SPECS = {
    "wq": P(None, TP, None), "wg": P(None, TP, None), "wk": P(None, TP, None), "wv": P(None, TP, None),
    "wo": P(TP, None, None),
    "lin_wq": P(None, TP, None), "lin_wk": P(None, TP, None), "lin_wv": P(None, TP, None),
    "conv_q": P(None, TP, None), "conv_k": P(None, TP, None), "conv_v": P(None, TP, None),
    "lin_wz": P(None, TP, None), "lin_wb": P(None, TP), "lin_wa": P(None, TP), "dt_bias": P(TP), "A_log": P(TP),
    "lin_wo": P(TP, None, None),
    "we_gate": P(None, None, TP), "we_up": P(None, None, TP), "we_down": P(None, TP, None),
    "ws_gate": P(None, TP), "ws_up": P(None, TP), "ws_down": P(TP, None),
}


def shard_layout_qwen35(config: ModelConfig, params: dict, tp: int) -> tuple[dict, dict]:
    """Qwen3.5-MoE params in tensor-parallel layout (module docstring: heads sharded, experts tensor-parallel)."""
    check_target(config, tp)
    kv = kv_heads_for(config.num_key_value_heads, tp, "the target")
    lk = kv_heads_for(config.linear_num_key_heads, tp, "the target's linear attention")
    repeat = {"wk": kv, "wv": kv, "lin_wq": lk, "lin_wk": lk, "conv_q": lk, "conv_k": lk}
    layers, specs = [], []
    for lp in params["layers"]:
        layers.append({k: _repeat_kv(w, repeat[k]) if k in repeat else w for k, w in lp.items()})
        specs.append({k: _QWEN35_SPECS.get(k, P()) for k in lp})
    return _with_vocab_parallel_ends(params, layers, specs, tp)


def cache_specs(config: ModelConfig, dp: str | None, tp: str | None = TP):
    """PartitionSpecs of the target cache of ``config`` (batch over ``dp``, heads over ``tp``)."""
    from diffspec_jax.cache import HybridCache, KVCache

    heads = P(dp, tp, None, None)  # [B, Hkv, S, D]
    if not config.is_hybrid:
        n = config.num_hidden_layers
        return KVCache(k=(heads,) * n, v=(heads,) * n)
    nf, nl = len(config.full_attention_layers), len(config.linear_attention_layers)
    conv = P(dp, None, tp, None)  # [B, kernel - 1, heads, head_dim]
    return HybridCache(k=(heads,) * nf, v=(heads,) * nf, conv_q=(conv,) * nl, conv_k=(conv,) * nl,
                       conv_v=(conv,) * nl, ssm=(P(dp, tp, None, None),) * nl,
                       full_layers=config.full_attention_layers, linear_layers=config.linear_attention_layers)


def shard_layout_draft(config: DraftConfig, params: dict, tp: int) -> tuple[dict, dict]:
    """The draft params in tensor-parallel layout over ``tp`` shards (``tp == 1``: replicated) and their specs."""
    if tp == 1:
        return params, {k: P() for k in params}
    check_draft(config, tp)
    kv = kv_heads_for(config.num_key_value_heads, tp, "the draft")
    col, row = P(None, TP, None), P(TP, None, None)
    out = {**params, "wk": _repeat_kv(params["wk"], kv), "wv": _repeat_kv(params["wv"], kv),
           "lm_head": _pad_rows(params["lm_head"], 1, tp), "embed": _pad_rows(params["embed"], 0, tp)}
    spec = {k: P() for k in params}
    spec.update(wq=col, wk=col, wv=col, wo=row, w_gate=P(None, TP), w_up=P(None, TP), w_down=P(TP, None),
                lm_head=P(None, TP), embed=P(TP, None))
    return out, spec


def put(tree: Any, specs: Any, mesh: Mesh) -> Any:
    """``device_put`` every leaf with ``NamedSharding(mesh, spec)``."""
    return jax.tree_util.tree_map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs,
                                  is_leaf=lambda x: x is None)


def named(specs: Any, mesh: Mesh) -> Any:
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


_PREPARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def prepare(model, mesh: Mesh, tp: int) -> dict:
    """The params of a ``TargetModel`` or ``DraftModel`` in tensor-parallel layout over ``tp`` shards, placed on
    ``mesh``. Done once per (model, mesh, tp) and memoised: later calls return the same arrays."""
    per_model = _PREPARED.setdefault(model, {})
    if (mesh, tp) not in per_model:
        layout = shard_layout_target if isinstance(model.config, ModelConfig) else shard_layout_draft
        per_model[(mesh, tp)] = put(*layout(model.config, model.params, tp), mesh)
    return per_model[(mesh, tp)]
