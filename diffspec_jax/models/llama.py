"""Llama-3.x and Qwen3 decoders as pure functions of a params pytree.

Qwen3 is Llama plus a per-head RMSNorm on q and k before RoPE and an explicit ``head_dim``.

Params pytree (weights ``[in, out]``; head axes explicit so tensor parallelism can split them; every leaf, its
checkpoint tensor, sharding and init are declared in :func:`param_table`)::

    {"embed": [V, H], "final_norm": [H], "lm_head": [H, V] (absent when tied),
     "layers": [ {"attn_norm": [H], "wq": [H, Hq, D], "wk": [H, Hkv, D], "wv": [H, Hkv, D],
                  "wo": [Hq, D, H], "q_norm": [D], "k_norm": [D] (Qwen3 only),
                  "mlp_norm": [H], "w_gate": [H, I], "w_up": [H, I], "w_down": [I, H]}, ... ]}

That is the checkpoint layout (what loaders produce and checkpoints store). :func:`load_target
<diffspec_jax.target.load_target>` serves the **fused** layout of :func:`fuse_projections` (``wqkv [H, Hkv, G + 2,
D]`` and ``w_gate_up [H, 2, I]`` per layer), which is faster at decode; every function here takes either.

The code is written for one tensor-parallel shard: head and intermediate counts come from the weight shapes,
and when ``axis_name`` is given the row-parallel products (``wo``, ``w_down``) end in a ``psum`` over it.
On one device (``axis_name=None``) the same code is the whole model.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from diffspec_jax.cache import KVCache
from diffspec_jax.config import ModelConfig
from diffspec_jax.models.attention import (DENSE_ATTENTION_MAX_TOKENS, cache_attention,  # noqa: F401 (re-exported)
                                           run_cache_attention, write_block)
from diffspec_jax.models import params as tables
from diffspec_jax.models.layers import (
    add_residual, apply_rope, attention_dense, causal_mask, embed_lookup, gather_vocab, layer_boundary,
    residual_dtype, rms_norm, rope_cos_sin, swiglu,
)
from diffspec_jax.models.params import NORM, Linear, Param, is_shape  # noqa: F401 (is_shape re-exported)

Params = dict[str, Any]


def param_table(config: ModelConfig, *, prefix: str | None = None, fused: bool = False) -> tables.Table:
    """One :class:`~diffspec_jax.models.params.Param` per leaf, in checkpoint order (``prefix``: the decoder's
    key prefix, default ``"model."``). ``fused=True``: the serving layout of :func:`fuse_projections` (its
    ``wqkv`` / ``w_gate_up`` are not checkpoint tensors: checkpoints hold the separate projections)."""
    prefix = "model." if prefix is None else prefix
    h, i, d, v = config.hidden_size, config.intermediate_size, config.head_dim, config.vocab_size
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    rows = [Param(("embed",), (v, h), ("vocab", None), f"{prefix}embed_tokens.weight"),
            Param(("final_norm",), (h,), (None,), f"{prefix}norm.weight", init=NORM)]
    if not config.tie_word_embeddings:
        rows.append(Param(("lm_head",), (h, v), (None, "vocab"), "lm_head.weight", Linear()))
    for n in range(config.num_hidden_layers):
        lay, p = ("layers", n), f"{prefix}layers.{n}."
        rows += [Param(lay + ("attn_norm",), (h,), (None,), f"{p}input_layernorm.weight", init=NORM),
                 Param(lay + ("mlp_norm",), (h,), (None,), f"{p}post_attention_layernorm.weight", init=NORM)]
        if fused:
            rows.append(Param(lay + ("wqkv",), (h, hkv, hq // hkv + 2, d), (None, "kv_groups", None, None)))
        else:
            rows += [Param(lay + ("wq",), (h, hq, d), (None, "heads", None), f"{p}self_attn.q_proj.weight", Linear()),
                     Param(lay + ("wk",), (h, hkv, d), (None, "kv_heads", None), f"{p}self_attn.k_proj.weight",
                           Linear()),
                     Param(lay + ("wv",), (h, hkv, d), (None, "kv_heads", None), f"{p}self_attn.v_proj.weight",
                           Linear())]
        rows.append(Param(lay + ("wo",), (hq, d, h), ("heads", None, None), f"{p}self_attn.o_proj.weight",
                          Linear(n_in=2)))
        if fused:
            rows.append(Param(lay + ("w_gate_up",), (h, 2, i), (None, None, "mlp")))
        else:
            rows += [Param(lay + ("w_gate",), (h, i), (None, "mlp"), f"{p}mlp.gate_proj.weight", Linear()),
                     Param(lay + ("w_up",), (h, i), (None, "mlp"), f"{p}mlp.up_proj.weight", Linear())]
        rows.append(Param(lay + ("w_down",), (i, h), ("mlp", None), f"{p}mlp.down_proj.weight", Linear()))
        if config.qk_norm:
            rows += [Param(lay + ("q_norm",), (d,), (None,), f"{p}self_attn.q_norm.weight", init=NORM),
                     Param(lay + ("k_norm",), (d,), (None,), f"{p}self_attn.k_norm.weight", init=NORM)]
    return tuple(rows)


def param_shapes(config: ModelConfig) -> Params:
    """The params pytree with shape tuples as leaves (the layout every loader must produce)."""
    return tables.shapes(param_table(config))


def init_params(config: ModelConfig, seed: int = 0, dtype=jnp.float32, scale: float = 0.08) -> Params:
    """Random params (normal weights with std ``scale``; norm weights ``1 + 0.2 * normal``) for tests and demos."""
    return tables.init(param_table(config), seed, dtype, scale)


@struct.dataclass
class StepOutput:
    """What one target step returns besides the updated cache.

    Attributes:
        logits: float32 ``[B, R, V]`` at the requested rows.
        aux: ``[B, T, A * H]`` residual-stream inputs of the requested layers (HF ``hidden_states`` indices),
            concatenated in the requested order, for every new token; ``None`` when no layer was requested.
        score_q: float32 ``[B, R, Hq_local, D]`` post-norm, post-RoPE queries of the scoring layer at the rows.
        score_lse: float32 ``[B, R, Hq_local]`` their log-sum-exp over every visible key (scaled logits).
        states: hybrid models only (``snapshots=True``): the recurrent-state snapshots of every position, which
            the family's ``commit`` selects from after acceptance; ``None`` otherwise.
    """

    logits: jax.Array
    aux: jax.Array | None = None
    score_q: jax.Array | None = None
    score_lse: jax.Array | None = None
    states: Any = None


def _lm_head(config: ModelConfig, params: Params, x: jax.Array, axis_name: str | None, norm=rms_norm) -> jax.Array:
    """Final norm and LM head (vocabulary-parallel under tensor parallelism: local logits, then an all-gather, so
    every shard holds identical full logits). ``norm`` is the family's RMSNorm."""
    x = norm(x, params["final_norm"], config.rms_norm_eps)
    if config.tie_word_embeddings:
        logits = jnp.einsum("bth,vh->btv", x, params["embed"], preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("bth,hv->btv", x, params["lm_head"], preferred_element_type=jnp.float32)
    return gather_vocab(logits, config.vocab_size, axis_name)


def fuse_projections(config: ModelConfig, params: Params) -> Params:
    """The serving layout: each layer's q/k/v projections as one matrix and gate/up as another.

    One ``[H, ...]`` product per group instead of three (two) at decode, where every product reads its whole
    weight for a handful of rows: on an H200 the separate k/v products (8 MiB each for Llama-3.1-8B) ran at a
    fifth of the memory bandwidth; fusing took the 8B decode step at 8K x 1 from 9.35 to 5.77 ms (with the
    heads-first cache, where XLA also fused the separate v product into the cache scatter) and from 6.47 to 5.24 ms
    with the old cache layout (``benchmarks/decode_ablation.py``).

    Per layer, ``wq, wk, wv`` become ``wqkv [H, Hkv, G + 2, D]`` (for KV head j: its G = Hq / Hkv query heads,
    then its key, then its value) and ``w_gate, w_up`` become ``w_gate_up [H, 2, I]``; every other leaf is kept.
    Grouping by KV head keeps each group whole when the heads are split for tensor parallelism. Layers already
    fused are returned as they are; :func:`split_projections` is the inverse.
    """
    return {**params, "layers": [fuse_layer(lp) for lp in params["layers"]]}


def fuse_layers_in_place(params: Params) -> Params:
    """:func:`fuse_projections` for a loader that owns ``params``: its layer list is rewritten in place, layer by
    layer, so one layer's separate weights at most are alive beside the fused ones (no second copy of the model,
    and no model-sized holes left in the device allocator). Returns ``params``."""
    layers = params["layers"]
    for i in range(len(layers)):
        layers[i] = fuse_layer(layers[i])
    return params


def fuse_layer(lp: Params) -> Params:
    """One layer of :func:`fuse_projections`."""
    if "wqkv" in lp:
        return lp
    h, hkv, d = lp["wk"].shape
    g = lp["wq"].shape[1] // hkv
    xp = jnp if isinstance(lp["wq"], jax.Array) else np
    qkv = xp.concatenate([lp["wq"].reshape(h, hkv, g, d), lp["wk"][:, :, None], lp["wv"][:, :, None]], axis=2)
    gate_up = xp.stack([lp["w_gate"], lp["w_up"]], axis=1)
    rest = {k: v for k, v in lp.items() if k not in ("wq", "wk", "wv", "w_gate", "w_up")}
    return {**rest, "wqkv": qkv, "w_gate_up": gate_up}


def split_projections(config: ModelConfig, params: Params) -> Params:
    """The checkpoint layout (``wq, wk, wv, w_gate, w_up``) of params fused by :func:`fuse_projections`."""
    layers = []
    for lp in params["layers"]:
        if "wqkv" not in lp:
            layers.append(lp)
            continue
        w = lp["wqkv"]
        h, hkv, g2, d = w.shape
        rest = {k: v for k, v in lp.items() if k not in ("wqkv", "w_gate_up")}
        layers.append({**rest, "wq": w[:, :, : g2 - 2].reshape(h, hkv * (g2 - 2), d), "wk": w[:, :, g2 - 2],
                       "wv": w[:, :, g2 - 1], "w_gate": lp["w_gate_up"][:, 0], "w_up": lp["w_gate_up"][:, 1]})
    return {**params, "layers": layers}


def _project_qkv(lp: Params, h: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``h [B, T, H]`` -> q ``[B, T, Hq, D]``, k and v ``[B, T, Hkv, D]`` (fused or separate weights)."""
    if "wqkv" not in lp:
        return tuple(jnp.einsum("bth,hnd->btnd", h, lp[n]) for n in ("wq", "wk", "wv"))
    w = lp["wqkv"]
    y = jnp.einsum("bth,hkjd->btkjd", h, w)
    b, t, hkv, g2, d = y.shape
    return y[:, :, :, : g2 - 2].reshape(b, t, hkv * (g2 - 2), d), y[:, :, :, g2 - 2], y[:, :, :, g2 - 1]


def _project_q(lp: Params, h: jax.Array) -> jax.Array:
    """``h [B, T, H]`` -> q ``[B, T, Hq, D]`` alone (fused or separate weights)."""
    if "wqkv" not in lp:
        return jnp.einsum("bth,hnd->btnd", h, lp["wq"])
    w = lp["wqkv"]
    y = jnp.einsum("bth,hkjd->btkjd", h, w[:, :, : w.shape[2] - 2])
    return y.reshape(*y.shape[:2], -1, y.shape[-1])


def _project_kv(lp: Params, h: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``h [B, T, H]`` -> k and v ``[B, T, Hkv, D]`` alone (fused or separate weights)."""
    if "wqkv" not in lp:
        return tuple(jnp.einsum("bth,hnd->btnd", h, lp[n]) for n in ("wk", "wv"))
    w = lp["wqkv"]
    y = jnp.einsum("bth,hkjd->btkjd", h, w[:, :, w.shape[2] - 2:])
    return y[:, :, :, 0], y[:, :, :, 1]


def mlp(lp: Params, x: jax.Array) -> jax.Array:
    """The SwiGLU MLP of a layer (fused ``w_gate_up`` or separate ``w_gate`` / ``w_up``)."""
    if "w_gate_up" not in lp:
        return swiglu(x, lp["w_gate"], lp["w_up"], lp["w_down"], residual_dtype())
    w = lp["w_gate_up"]
    y = (x @ w.reshape(w.shape[0], -1)).reshape(*x.shape[:-1], 2, w.shape[2])
    return jnp.matmul(jax.nn.silu(y[..., 0, :]) * y[..., 1, :], lp["w_down"], preferred_element_type=residual_dtype())


def _attention_block(config: ModelConfig, lp: Params, x: jax.Array, cos: jax.Array, sin: jax.Array,
                     attend, axis_name: str | None):
    """Pre-norm attention sub-block. ``attend(q, k, v) -> (out, lse)`` decides where keys come from."""
    h = rms_norm(x, lp["attn_norm"], config.rms_norm_eps)
    q, k, v = _project_qkv(lp, h)
    if config.qk_norm:
        q = rms_norm(q, lp["q_norm"], config.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], config.rms_norm_eps)
    q = apply_rope(q, cos, sin, interleaved=config.rope.interleaved)
    k = apply_rope(k, cos, sin, interleaved=config.rope.interleaved)
    out, lse = attend(q, k, v)
    o = jnp.einsum("btnd,ndh->bth", out, lp["wo"], preferred_element_type=residual_dtype())
    if axis_name is not None:
        o = jax.lax.psum(o, axis_name)
    return add_residual(x, o), q, lse


def _last_layer_at_rows(config: ModelConfig, lp: Params, x: jax.Array, cos: jax.Array, sin: jax.Array,
                        rows: jax.Array, k_buf: jax.Array, v_buf: jax.Array, start: jax.Array, scale: float, *,
                        prefix: bool, axis_name: str | None, paged: dict):
    """The last layer of a prefill chunk whose one output row per sequence (``rows [B, 1]``, the prompt's last
    position) is all that leaves the model: every token's K and V are written into the cache, but the query,
    attention, output projection and MLP run for that row alone (the rest of the chunk's rows would feed no
    later layer). At 64K tokens on an H200 that is one layer's flash attention and MLP, about 3% of the prefill.

    The row attends to cache rows ``0 .. start + rows`` (its causal prefix, the chunk's rows before it included)
    through the decode kernel (:func:`~diffspec_jax.models.attention.run_cache_attention`); ``paged`` holds the
    cache's ``pages`` and ``page_size`` (both ``None`` / 0 for a contiguous cache).

    Returns ``(x at the rows [B, 1, H] (after the layer), its rotated query [B, 1, Hq, D], its lse [B, 1, Hq],
    k_buf, v_buf)``.
    """
    eps = config.rms_norm_eps
    h = rms_norm(x, lp["attn_norm"], eps)
    k, v = _project_kv(lp, h)
    at = lambda a: jnp.take_along_axis(a, rows[:, :, None], axis=1)  # noqa: E731 - [B, T, ...] -> [B, 1, ...]
    q = _project_q(lp, at(h))
    if config.qk_norm:
        q, k = rms_norm(q, lp["q_norm"], eps), rms_norm(k, lp["k_norm"], eps)
    q = apply_rope(q, at(cos), at(sin), interleaved=config.rope.interleaved)
    k = apply_rope(k, cos, sin, interleaved=config.rope.interleaved)
    kb, vb = write_block(k, v, k_buf, v_buf, start, prefix=prefix, **paged)
    out, lse = run_cache_attention(q, kb, vb, (start + rows[:, 0] + 1).astype(jnp.int32), scale=scale, **paged)
    o = jnp.einsum("btnd,ndh->bth", out, lp["wo"], preferred_element_type=residual_dtype())
    if axis_name is not None:
        o = jax.lax.psum(o, axis_name)
    return _mlp_block(config, lp, add_residual(at(x), o), axis_name), q, lse, kb, vb


def _mlp_block(config: ModelConfig, lp: Params, x: jax.Array, axis_name: str | None) -> jax.Array:
    m = mlp(lp, rms_norm(x, lp["mlp_norm"], config.rms_norm_eps))
    if axis_name is not None:
        m = jax.lax.psum(m, axis_name)
    return add_residual(x, m)


def forward(config: ModelConfig, params: Params, tokens: jax.Array, *, axis_name: str | None = None,
            attention: str = "dense") -> jax.Array:
    """Full-sequence forward without a cache (the reference path, and the training path).

    Args:
        tokens: int32 ``[B, T]``, every sequence starting at position 0.
        attention: ``"dense"`` (explicit ``[T, T]`` mask, the reference) or ``"flash"``
            (``jax.nn.dot_product_attention``: cuDNN flash attention on GPUs for long training sequences).
    Returns:
        float32 logits ``[B, T, V]``.
    """
    return forward_aux(config, params, tokens, axis_name=axis_name, attention=attention)[0]


def forward_aux(config: ModelConfig, params: Params, tokens: jax.Array, *, aux_layers: tuple[int, ...] = (),
                axis_name: str | None = None, attention: str = "dense") -> tuple[jax.Array, jax.Array | None]:
    """:func:`forward` that also returns the residual-stream inputs of ``aux_layers`` (HF ``hidden_states``
    indices), concatenated ``[B, T, A*H]`` in the requested order (``None`` when none are requested)."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cos, sin = rope_cos_sin(positions, config.rope.inv_freq(config.head_dim))
    scale = config.head_dim ** -0.5
    if attention == "dense":
        mask = causal_mask(positions, t)
        attend = lambda q, k, v: attention_dense(q, k, v, mask, scale)  # noqa: E731
    elif attention == "flash":
        impl = "cudnn" if jax.default_backend() == "gpu" else None
        attend = lambda q, k, v: (jax.nn.dot_product_attention(  # noqa: E731
            q, k, v, scale=scale, is_causal=True, implementation=impl), None)
    else:
        raise ValueError(f"attention must be 'dense' or 'flash', got {attention!r}")
    x = embed_lookup(params["embed"], tokens, axis_name)
    aux = []
    for i, lp in enumerate(params["layers"]):
        aux.extend((j, x) for j, a in enumerate(aux_layers) if a == i)
        x, _, _ = _attention_block(config, lp, x, cos, sin, attend, axis_name)
        x = _mlp_block(config, lp, x, axis_name)
    return _lm_head(config, params, x, axis_name), concat_aux(aux, aux_layers, len(params["layers"]))


def concat_aux(aux: list, aux_layers: tuple[int, ...], num_layers: int) -> jax.Array | None:
    """The collected ``(request index, [B, T, H])`` aux inputs concatenated in the requested order,
    ``[B, T, A * H]`` (``None`` when none were requested)."""
    if not aux_layers:
        return None
    if len(aux) != len(aux_layers):
        raise ValueError(f"aux layers {aux_layers} must be HF indices in 0..{num_layers - 1}")
    return jnp.concatenate([a for _, a in sorted(aux, key=lambda p: p[0])], axis=-1)


def step(config: ModelConfig, params: Params, cache: KVCache, tokens: jax.Array, start: jax.Array,
         rows: jax.Array, *, aux_layers: tuple[int, ...] = (), score_layer: int | None = None,
         axis_name: str | None = None, tree: tuple[jax.Array, jax.Array] | None = None,
         first_chunk: bool = False, rope_positions: jax.Array | None = None) -> tuple[StepOutput, KVCache]:
    """Run ``T`` new tokens per sequence against the cache and write their K/V into it.

    Serves prefill chunks (T = chunk), decode (T = 1) and verification (T = K + 1) with one code path.

    Args:
        cache: the :class:`KVCache` (donate it under ``jit``; it is updated in place).
        tokens: int32 ``[B, T]`` new tokens; sequence b's token t sits at absolute position ``start[b] + t``.
        start: int32 ``[B]`` position of each sequence's first new token (= its committed length).
        rows: int32 ``[B, R]`` rows of ``tokens`` whose logits (and scoring query / LSE) are returned.
        aux_layers: HF ``hidden_states`` indices (0..L-1; index i = input of layer i) to return for all T rows.
        score_layer: layer whose post-RoPE queries and LSE are returned at ``rows`` (``None``: none).
        axis_name: tensor-parallel mesh axis (``None`` on one device).
        tree: ``(depth int32 [B, T], ancestry bool [B, T, T])`` to verify a draft tree (:mod:`diffspec_jax.tree`):
            token t is written at row ``start + t`` but rotated at position ``start + depth[t]``, and attends to
            the committed prefix (rows ``< start``) plus the block rows its ancestry row marks.
        first_chunk: static; ``True`` promises ``start == 0`` for every sequence (a prompt's first prefill chunk):
            attention then skips the (empty) prefix (:func:`diffspec_jax.models.attention.cache_attention`).
        rope_positions: int32 ``[B, T]`` RoPE positions of the new tokens (default ``start + t``), for a cache whose
            rows are not absolute positions: the self-draft's working set (:mod:`diffspec_jax.working_set`) holds
            post-RoPE rows of scattered positions compactly, so its token t is written at row ``start + t`` but
            rotated at its absolute position. Steps of at most ``DENSE_ATTENTION_MAX_TOKENS`` tokens; not combined
            with ``tree``.
    Returns:
        ``(StepOutput, updated cache)``. Positions ``>= capacity`` are not written (and must not be queried).

    A prefill chunk (more than ``DENSE_ATTENTION_MAX_TOKENS`` tokens) with one row per sequence runs its last layer
    at that row only (:func:`_last_layer_at_rows`); every token's K/V is still written.
    """
    b, t = tokens.shape
    positions = start[:, None].astype(jnp.int32) + jnp.arange(t, dtype=jnp.int32)[None, :]
    if tree is not None:
        positions = start[:, None].astype(jnp.int32) + tree[0]
    elif rope_positions is not None:
        positions = rope_positions.astype(jnp.int32)
    cos, sin = rope_cos_sin(positions, config.rope.inv_freq(config.head_dim))
    scale = config.head_dim ** -0.5
    block_mask = None if tree is None else tree[1]
    x = embed_lookup(params["embed"], tokens, axis_name)
    aux, new_k, new_v = [], [], []
    score_q = score_lse = None
    # a prefill chunk needs its last layer at the output rows only (decode, verification and trees need every row)
    rows_only = t > DENSE_ATTENTION_MAX_TOKENS and rows.shape[1] == 1 and tree is None and rope_positions is None
    last = len(params["layers"]) - 1
    paged = dict(pages=cache.pages, page_size=cache.page_size)
    for i, lp in enumerate(params["layers"]):
        aux.extend((j, x) for j, a in enumerate(aux_layers) if a == i)
        k_buf, v_buf = cache.k[i], cache.v[i]
        if rows_only and i == last:
            x, q, lse, kb, vb = _last_layer_at_rows(config, lp, x, cos, sin, rows, k_buf, v_buf, start, scale,
                                                    prefix=not first_chunk, axis_name=axis_name, paged=paged)
            new_k.append(kb)
            new_v.append(vb)
            if i == score_layer:
                score_q, score_lse = q.astype(jnp.float32), lse
            continue

        def attend(q, k, v, k_buf=k_buf, v_buf=v_buf):
            out, kb, vb = cache_attention(q, k, v, k_buf, v_buf, start, scale, positions=positions,
                                          block_mask=block_mask, prefix=not first_chunk, **paged)
            new_k.append(kb)
            new_v.append(vb)
            return out

        x, q, lse = _attention_block(config, lp, x, cos, sin, attend, axis_name)
        if i == score_layer:
            score_q = jnp.take_along_axis(q.astype(jnp.float32), rows[:, :, None, None], axis=1)
            score_lse = jnp.take_along_axis(lse, rows[:, :, None], axis=1)
        x = layer_boundary(_mlp_block(config, lp, x, axis_name))
    logits = _lm_head(config, params, x if rows_only else jnp.take_along_axis(x, rows[:, :, None], axis=1),
                      axis_name)
    aux_out = concat_aux(aux, aux_layers, len(params["layers"]))
    return StepOutput(logits=logits, aux=aux_out, score_q=score_q, score_lse=score_lse), cache.replace(
        k=tuple(new_k), v=tuple(new_v))
