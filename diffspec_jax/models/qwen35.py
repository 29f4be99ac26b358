"""Qwen3.5 hybrid MoE decoder (``Qwen3_5MoeForCausalLM`` and the text path of
``Qwen3_5MoeForConditionalGeneration``) as pure functions of a params pytree.

Every layer is pre-norm: a token mixer (Gated DeltaNet for ``linear_attention`` layers, gated softmax attention
for ``full_attention`` layers) and a sparse MoE MLP with a gated shared expert. All RMSNorms compute
``norm(x) * (1 + w)`` in float32 with zero-centred weights (kept zero-centred in the params, so bfloat16 weights
lose nothing), except the DeltaNet output norm, which is a plain ``w * norm(o) * silu(z)``.

Params pytree (weights ``[in, out]``; head and expert axes explicit so tensor parallelism can split them)::

    {"embed": [V, H], "final_norm": [H], "lm_head": [H, V] (absent when tied),
     "layers": [ full_attention:   {"attn_norm": [H], "wq": [H, Hq, D], "wg": [H, Hq, D] (output gate),
                                    "wk": [H, Hkv, D], "wv": [H, Hkv, D], "q_norm": [D], "k_norm": [D],
                                    "wo": [Hq, D, H], **moe}
                 linear_attention: {"attn_norm": [H], "lin_wq": [H, Hk, dk], "lin_wk": [H, Hk, dk],
                                    "lin_wv": [H, Hv, dv], "conv_q": [W, Hk, dk], "conv_k": [W, Hk, dk],
                                    "conv_v": [W, Hv, dv], "lin_wz": [H, Hv, dv], "lin_wb": [H, Hv],
                                    "lin_wa": [H, Hv], "dt_bias": [Hv], "A_log": [Hv], "lin_norm": [dv],
                                    "lin_wo": [Hv, dv, H], **moe}
                 moe = {"mlp_norm": [H], "router": [H, E], "we_gate": [E, H, I], "we_up": [E, H, I],
                        "we_down": [E, I, H], "ws_gate": [H, Is], "ws_up": [H, Is], "ws_down": [Is, H],
                        "shared_gate": [H, 1]} ]}

(``W`` = conv kernel width; the checkpoint's fused ``in_proj_qkv`` / ``conv1d`` channels are split into q, k, v
and the per-head interleaved ``q_proj`` into query and gate halves by the loader.)

**Gated DeltaNet.** Per token: causal depthwise conv + SiLU over the q/k/v channels; q, k L2-normalised (q also
scaled by ``dk ** -0.5``); ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)``; each key head
serves ``Hv / Hk`` consecutive value heads; per value head the state ``S [dk, dv]`` follows
``S <- e^g S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q``. Steps of up to :data:`RECURRENT_MAX_TOKENS`
tokens (decode, verification) run the recurrence token by token (``lax.scan``) and can return the state after
every position; longer ones (prefill chunks, the full forward) use the chunked parallel (WY / UT-transform) form
over chunks of :data:`DELTA_CHUNK` tokens: ``O(T * chunk)`` memory, never ``O(T^2)``.

**Valid tokens.** A step absorbs only the first ``num_valid[b]`` tokens of each sequence into the conv and
recurrent states (``g = 0`` and ``beta = 0`` leave the state unchanged); the rest (prompt padding) are computed
but leave no trace. KV rows of every token are written as for Llama (position-indexed, masked by length).

**Rollback.** With ``snapshots=True`` the step also returns, per DeltaNet layer, the state before the step and
after each of its tokens (:class:`StateSnapshots`); :func:`commit` keeps the one after the last accepted token.
Truncating KV alone would leave rejected drafts inside the recurrent state.

**MoE.** Router softmax over all experts in float32, top-k, weights always renormalised; experts are SwiGLU,
evaluated as a grouped matmul over the tokens sorted by expert (``jax.lax.ragged_dot``); the shared expert's
output is scaled by ``sigmoid(x @ shared_gate)`` and added. Under tensor parallelism each shard holds a slice of
every expert's intermediate dimension (see :mod:`diffspec_jax.sharding`), and one ``psum`` closes the block.

Written for one tensor-parallel shard like :mod:`diffspec_jax.models.llama`: head, expert-slice and intermediate
counts come from the weight shapes; row-parallel products end in a ``psum`` over ``axis_name``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from diffspec_jax.cache import HybridCache, round_capacity
from diffspec_jax.config import FULL_ATTENTION, ModelConfig
from diffspec_jax.models.layers import (
    apply_rope, embed_lookup, rope_cos_sin,
)
from diffspec_jax.models import llama
from diffspec_jax.models import params as tables
from diffspec_jax.models.attention import cache_attention
from diffspec_jax.models.llama import StepOutput
from diffspec_jax.models.params import Param

Params = dict[str, Any]

#: steps of at most this many tokens per sequence run the DeltaNet recurrence token by token; longer ones use the
#: chunked parallel form
RECURRENT_MAX_TOKENS = 64
#: chunk length of the chunked DeltaNet form (as the reference implementations)
DELTA_CHUNK = 64
#: a family flag: tree verification would need a recurrent-state snapshot per tree node; only chains are verified
SUPPORTS_TREE = False


# ---------------------------------------------------------------------------------------------- params
#: Qwen3.5's norms are zero-centred (``norm(x) * (1 + w)``): random ones lie around zero
ZC_NORM = tables.Normal(0.0, 0.2)


def param_table(config: ModelConfig, *, prefix: str | None = None, fused: bool = False) -> tables.Table:
    """One :class:`~diffspec_jax.models.params.Param` per leaf, in checkpoint order (``prefix``: the decoder's
    key prefix, default the architecture's). On disk the per-head interleaved ``q_proj`` holds query and gate,
    ``in_proj_qkv`` / ``conv1d`` the DeltaNet q, k, v channels and ``experts.gate_up_proj`` the experts' gate and
    up halves (the fused expert layout; :class:`checkpoints_tools.hf.FusedExpertsView` reads per-expert files).

    Random init: zero-centred norms ``0.2 * normal`` (the DeltaNet output norm ``1 + 0.2 * normal``), decay rates
    ``A = exp(A_log)`` in [0.05, 1] and ``dt_bias`` ~ 0.5 normal, so the recurrent states keep a memory of many
    tokens (a random test model should not forget instantly). Qwen3.5 has one layout (``fused`` is refused)."""
    if fused:
        raise ValueError("Qwen3.5 layers have no fused serving layout")
    prefix = config.weight_prefix if prefix is None else prefix
    h, d, v = config.hidden_size, config.head_dim, config.vocab_size
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv, w = config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim
    e, i, s = config.num_experts, config.intermediate_size, config.shared_expert_intermediate_size
    lin, copy, swap, conv = tables.Linear(), tables.Copy(), tables.SwapLast(), tables.DepthwiseConv()
    rows = [Param(("embed",), (v, h), ("vocab", None), f"{prefix}embed_tokens.weight"),
            Param(("final_norm",), (h,), (None,), f"{prefix}norm.weight", init=ZC_NORM)]
    if not config.tie_word_embeddings:
        rows.append(Param(("lm_head",), (h, v), (None, "vocab"), "lm_head.weight", lin))
    for n in range(config.num_hidden_layers):
        lay, p = ("layers", n), f"{prefix}layers.{n}."
        rows += [Param(lay + ("attn_norm",), (h,), (None,), f"{p}input_layernorm.weight", init=ZC_NORM),
                 Param(lay + ("mlp_norm",), (h,), (None,), f"{p}post_attention_layernorm.weight", init=ZC_NORM)]
        if config.layer_type(n) == FULL_ATTENTION:
            a, qg = f"{p}self_attn.", tables.Joint(axis=0, groups=hq)  # q_proj: [query | gate] rows per head
            rows += [
                Param(lay + ("wq",), (h, hq, d), (None, "heads", None), f"{a}q_proj.weight", lin, qg),
                Param(lay + ("wg",), (h, hq, d), (None, "heads", None), f"{a}q_proj.weight", lin, qg),
                Param(lay + ("wk",), (h, hkv, d), (None, "kv_heads", None), f"{a}k_proj.weight", lin),
                Param(lay + ("wv",), (h, hkv, d), (None, "kv_heads", None), f"{a}v_proj.weight", lin),
                Param(lay + ("wo",), (hq, d, h), ("heads", None, None), f"{a}o_proj.weight", tables.Linear(n_in=2)),
                Param(lay + ("q_norm",), (d,), (None,), f"{a}q_norm.weight", init=ZC_NORM),
                Param(lay + ("k_norm",), (d,), (None,), f"{a}k_norm.weight", init=ZC_NORM)]
        else:
            a, ch = f"{p}linear_attn.", tables.Joint(axis=0)  # q, k, v channels one after the other
            key, val = (None, "linear_key_heads", None), (None, "linear_value_heads", None)
            conv_init = tables.Normal(0.0, 0.3)
            rows += [
                Param(lay + ("lin_wq",), (h, hk, dk), key, f"{a}in_proj_qkv.weight", lin, ch),
                Param(lay + ("lin_wk",), (h, hk, dk), key, f"{a}in_proj_qkv.weight", lin, ch),
                Param(lay + ("lin_wv",), (h, hv, dv), val, f"{a}in_proj_qkv.weight", lin, ch),
                Param(lay + ("conv_q",), (w, hk, dk), key, f"{a}conv1d.weight", conv, ch, conv_init),
                Param(lay + ("conv_k",), (w, hk, dk), key, f"{a}conv1d.weight", conv, ch, conv_init),
                Param(lay + ("conv_v",), (w, hv, dv), val, f"{a}conv1d.weight", conv, ch, conv_init),
                Param(lay + ("lin_wz",), (h, hv, dv), val, f"{a}in_proj_z.weight", lin),
                Param(lay + ("lin_wb",), (h, hv), (None, "linear_value_heads"), f"{a}in_proj_b.weight", lin),
                Param(lay + ("lin_wa",), (h, hv), (None, "linear_value_heads"), f"{a}in_proj_a.weight", lin),
                Param(lay + ("dt_bias",), (hv,), ("linear_value_heads",), f"{a}dt_bias", copy,
                      init=tables.Normal(0.0, 0.5)),
                Param(lay + ("A_log",), (hv,), ("linear_value_heads",), f"{a}A_log", copy,
                      init=tables.LogUniform(0.05, 1.0)),
                Param(lay + ("lin_norm",), (dv,), (None,), f"{a}norm.weight", init=tables.NORM),
                Param(lay + ("lin_wo",), (hv, dv, h), ("linear_value_heads", None, None), f"{a}out_proj.weight",
                      tables.Linear(n_in=2))]
        m, gu = f"{p}mlp.", tables.Joint(axis=1)  # experts.gate_up_proj [E, 2I, H]: gate rows first
        rows += [
            Param(lay + ("we_gate",), (e, h, i), (None, None, "mlp"), f"{m}experts.gate_up_proj", swap, gu),
            Param(lay + ("we_up",), (e, h, i), (None, None, "mlp"), f"{m}experts.gate_up_proj", swap, gu),
            Param(lay + ("we_down",), (e, i, h), (None, "mlp", None), f"{m}experts.down_proj", swap),
            Param(lay + ("router",), (h, e), (None, None), f"{m}gate.weight", lin),
            Param(lay + ("ws_gate",), (h, s), (None, "mlp"), f"{m}shared_expert.gate_proj.weight", lin),
            Param(lay + ("ws_up",), (h, s), (None, "mlp"), f"{m}shared_expert.up_proj.weight", lin),
            Param(lay + ("ws_down",), (s, h), ("mlp", None), f"{m}shared_expert.down_proj.weight", lin),
            Param(lay + ("shared_gate",), (h, 1), (None, None), f"{m}shared_expert_gate.weight", lin)]
    return tuple(rows)


def param_shapes(config: ModelConfig) -> Params:
    """The params pytree with shape tuples as leaves (the layout every loader must produce)."""
    return tables.shapes(param_table(config))


def init_params(config: ModelConfig, seed: int = 0, dtype=jnp.float32, scale: float = 0.08) -> Params:
    """Random params for tests (the init rules of :func:`param_table`; weights normal with std ``scale``)."""
    return tables.init(param_table(config), seed, dtype, scale)


# ---------------------------------------------------------------------------------------------- blocks
def rms_norm_zc(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Zero-centred RMSNorm of Qwen3.5: ``(norm(x) * (1 + w))`` in float32, cast back to ``x.dtype``."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def gated_rms_norm(o: jax.Array, z: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """DeltaNet output norm: ``w * norm(o)`` (plain weight, normalised in float32, cast to ``o.dtype`` first)
    times ``silu(z)`` in float32; result in ``o.dtype``."""
    o32 = o.astype(jnp.float32)
    y = (o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + eps)).astype(o.dtype)
    y = weight * y
    return (y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(o.dtype)


def _l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _attention_block(config: ModelConfig, lp: Params, h: jax.Array, cos, sin, attend, axis_name):
    """Gated attention on normed input ``h``: ``o_proj((softmax attention) * sigmoid(gate))``.

    Returns ``(output, post-norm post-RoPE queries, lse)``; ``attend(q, k, v) -> (out, lse)``."""
    eps = config.rms_norm_eps
    q = jnp.einsum("bth,hnd->btnd", h, lp["wq"])
    gate = jnp.einsum("bth,hnd->btnd", h, lp["wg"])
    k = jnp.einsum("bth,hnd->btnd", h, lp["wk"])
    v = jnp.einsum("bth,hnd->btnd", h, lp["wv"])
    q = apply_rope(rms_norm_zc(q, lp["q_norm"], eps), cos, sin)
    k = apply_rope(rms_norm_zc(k, lp["k_norm"], eps), cos, sin)
    out, lse = attend(q, k, v)
    out = out * jax.nn.sigmoid(gate)
    o = jnp.einsum("btnd,ndh->bth", out, lp["wo"])
    if axis_name is not None:
        o = jax.lax.psum(o, axis_name)
    return o, q, lse


def _causal_conv(x: jax.Array, prev: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal conv + SiLU over time.

    Args:
        x: ``[B, T, heads, d]`` new inputs; prev: ``[B, W-1, heads, d]`` the previous ``W - 1`` inputs;
        w: ``[W, heads, d]`` (tap ``W - 1`` multiplies the current input).
    Returns:
        ``(silu(conv) [B, T, heads, d] in x.dtype, the extended input [B, W-1+T, heads, d])``.
    """
    t = x.shape[1]
    xc = jnp.concatenate([prev.astype(x.dtype), x], axis=1)
    xf = xc.astype(jnp.float32)
    wf = w.astype(jnp.float32)
    acc = sum(wf[j] * xf[:, j:j + t] for j in range(w.shape[0]))
    return jax.nn.silu(acc).astype(x.dtype), xc


def _window(xc: jax.Array, start: jax.Array, width: int) -> jax.Array:
    """``xc[b, start[b] : start[b] + width]`` for ``xc [B, L, ...]``."""
    idx = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
    return jnp.take_along_axis(xc, idx.reshape(idx.shape + (1,) * (xc.ndim - 2)), axis=1)


def delta_rule_recurrent(q, k, v, g, beta, state, *, snapshots: bool = False):
    """Gated delta rule, token by token.

    Args:
        q, k: float32 ``[B, T, Hv, dk]`` (normalised, q scaled, already repeated to the value heads);
        v: float32 ``[B, T, Hv, dv]``; g, beta: float32 ``[B, T, Hv]``; state: float32 ``[B, Hv, dk, dv]``.
    Returns:
        ``(o [B, T, Hv, dv], final state, states [B, T+1, Hv, dk, dv] or None)``; ``states[:, 0]`` is the input
        state and ``states[:, t + 1]`` the state after token t.
    """
    def body(s, inp):
        q_t, k_t, v_t, g_t, b_t = inp
        s = s * jnp.exp(g_t)[..., None, None]
        kv = jnp.einsum("bhkv,bhk->bhv", s, k_t)
        delta = (v_t - kv) * b_t[..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        o = jnp.einsum("bhkv,bhk->bhv", s, q_t)
        return s, (o, s) if snapshots else (o, None)

    tm = lambda x: jnp.moveaxis(x, 1, 0)  # noqa: E731
    final, (o, states) = jax.lax.scan(body, state, (tm(q), tm(k), tm(v), tm(g), tm(beta)))
    o = jnp.moveaxis(o, 0, 1)
    if snapshots:
        states = jnp.concatenate([state[:, None], jnp.moveaxis(states, 0, 1)], axis=1)
    return o, final, states


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = DELTA_CHUNK):
    """Gated delta rule in the chunked parallel form (same contract as :func:`delta_rule_recurrent`, no snapshots).

    Within a chunk the delta-rule updates are condensed by the UT transform: with cumulative log decays ``c``,
    ``A[i, j] = beta_i (k_i . k_j) e^(c_i - c_j)`` (j < i), ``U = (I + A)^-1 (beta v)`` and
    ``W = (I + A)^-1 (beta k e^c)``; then per chunk ``v' = U - W S``, ``o = (q e^c) S + [(q_i . k_j)
    e^(c_i - c_j)]_(j <= i) v'`` and ``S <- e^(c_last) S + (k e^(c_last - c))^T v'``. Memory is
    ``O(T * chunk)`` per head. Padding tokens (appended to fill the last chunk) have ``g = beta = 0``.
    """
    b, t, hv, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % chunk
    if pad:
        padded = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
        q, k, v, g, beta = (padded(x) for x in (q, k, v, g, beta))
    n = (t + pad) // chunk
    split = lambda x: jnp.moveaxis(x.reshape((b, n, chunk) + x.shape[2:]), 3, 1)  # noqa: E731 [B, Hv, N, C, ...]
    q, k, v = split(q), split(k), split(v)
    g, beta = (jnp.moveaxis(x.reshape(b, n, chunk, hv), 3, 1) for x in (g, beta))  # [B, Hv, N, C]
    c = jnp.cumsum(g, axis=-1)
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    diff = jnp.where(lower, c[..., :, None] - c[..., None, :], -jnp.inf)
    decay = jnp.exp(diff)                                             # e^(c_i - c_j), j <= i
    kb = k * beta[..., None]
    a = jnp.einsum("bhnid,bhnjd->bhnij", kb, k) * decay
    a = jnp.where(jnp.tril(jnp.ones((chunk, chunk), bool), -1), a, 0.0)  # strictly lower: (I + a) is unit lower
    rhs = jnp.concatenate([v * beta[..., None], kb * jnp.exp(c)[..., None]], axis=-1)
    sol = _unit_lower_solve(a, rhs)
    u, w = sol[..., :dv], sol[..., dv:]
    intra = jnp.einsum("bhnid,bhnjd->bhnij", q, k) * decay
    q_dec = q * jnp.exp(c)[..., None]
    k_dec = k * jnp.exp(c[..., -1:] - c)[..., None]
    chunk_decay = jnp.exp(c[..., -1])                                 # [B, Hv, N]
    per_chunk = lambda x: jnp.moveaxis(x, 2, 0)  # noqa: E731

    def body(s, inp):
        u_n, w_n, qd_n, kd_n, intra_n, cd_n = inp
        v_new = u_n - jnp.einsum("bhck,bhkv->bhcv", w_n, s)
        o = jnp.einsum("bhck,bhkv->bhcv", qd_n, s) + jnp.einsum("bhij,bhjv->bhiv", intra_n, v_new)
        s = s * cd_n[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", kd_n, v_new)
        return s, o

    final, o = jax.lax.scan(body, state, tuple(per_chunk(x) for x in (u, w, q_dec, k_dec, intra, chunk_decay)))
    o = jnp.moveaxis(o, 0, 2).reshape(b, hv, n * chunk, dv)           # [B, Hv, T', dv]
    return jnp.moveaxis(o, 1, 2)[:, :t], final


def _unit_lower_solve(a: jax.Array, b: jax.Array) -> jax.Array:
    """``x = (I + a)^-1 b`` for strictly lower-triangular ``a [..., C, C]`` and ``b [..., C, d]``, by forward
    substitution (``x_i = b_i - a_i x``, row by row; C sequential steps, batched over everything else).

    Deliberately not ``lax.linalg.triangular_solve``: on CPU that is a LAPACK custom call which waits on the
    intra-op thread pool, and inside a multi-device (shard_map) program it can deadlock against the collectives of
    the other devices' programs sharing that pool."""
    def body(i, x):
        row = jax.lax.dynamic_slice_in_dim(a, i, 1, axis=-2)                        # [..., 1, C]
        xi = jax.lax.dynamic_slice_in_dim(b, i, 1, axis=-2) - jnp.einsum("...ij,...jd->...id", row, x)
        return jax.lax.dynamic_update_slice_in_dim(x, xi, i, axis=-2)

    # starting from b itself: row i reads rows j < i only (a is zero elsewhere), all solved by then; and a carry
    # computed from the layer's inputs, unlike zeros, cannot be made for every layer at a program's start
    # (diffspec_jax.models.attention.flash_prefix_fp8 says how that was measured)
    return jax.lax.fori_loop(0, a.shape[-1], body, b)


@struct.dataclass
class StateSnapshots:
    """Per-position DeltaNet states of one step (``snapshots=True``), one entry per DeltaNet layer.

    Attributes:
        conv_q, conv_k, conv_v: ``[B, W-1+T, heads, d]`` the previous ``W - 1`` conv inputs followed by the step's
            T inputs: the conv state after ``n`` tokens is the window ``[n, n + W - 1)``.
        ssm: float32 ``[B, T+1, Hv, dk, dv]``: ``ssm[:, n]`` is the recurrent state after ``n`` of the step's tokens.
    """

    conv_q: tuple[jax.Array, ...]
    conv_k: tuple[jax.Array, ...]
    conv_v: tuple[jax.Array, ...]
    ssm: tuple[jax.Array, ...]


def _deltanet_block(config: ModelConfig, lp: Params, h: jax.Array, conv_prev, ssm, num_valid: jax.Array, *,
                    snapshots: bool, axis_name):
    """Gated DeltaNet on normed input ``h [B, T, H]`` from states ``conv_prev = (q, k, v)`` and ``ssm``.

    Returns ``(output [B, T, H], (conv_q, conv_k, conv_v), ssm, snapshot parts or None)`` where the new states are
    those after ``num_valid[b]`` tokens.
    """
    b, t, _ = h.shape
    width = config.linear_conv_kernel_dim - 1
    q = jnp.einsum("bth,hnd->btnd", h, lp["lin_wq"])
    k = jnp.einsum("bth,hnd->btnd", h, lp["lin_wk"])
    v = jnp.einsum("bth,hnd->btnd", h, lp["lin_wv"])
    z = jnp.einsum("bth,hnd->btnd", h, lp["lin_wz"])
    beta = jax.nn.sigmoid(jnp.einsum("bth,hn->btn", h, lp["lin_wb"])).astype(jnp.float32)
    a = jnp.einsum("bth,hn->btn", h, lp["lin_wa"])
    g = -jnp.exp(lp["A_log"].astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + lp["dt_bias"].astype(jnp.float32))
    (q, xq), (k, xk), (v, xv) = (_causal_conv(x, p, lp[name]) for x, p, name in
                                 zip((q, k, v), conv_prev, ("conv_q", "conv_k", "conv_v")))
    valid = jnp.arange(t, dtype=jnp.int32)[None, :] < num_valid[:, None]
    g = jnp.where(valid[..., None], g, 0.0)
    beta = jnp.where(valid[..., None], beta, 0.0)
    dk = q.shape[-1]
    rep = v.shape[2] // q.shape[2]
    qf = jnp.repeat(_l2norm(q.astype(jnp.float32)) * dk ** -0.5, rep, axis=2)
    kf = jnp.repeat(_l2norm(k.astype(jnp.float32)), rep, axis=2)
    vf = v.astype(jnp.float32)
    states = None
    if snapshots or t <= RECURRENT_MAX_TOKENS:
        o, ssm_new, states = delta_rule_recurrent(qf, kf, vf, g, beta, ssm, snapshots=snapshots)
    else:
        o, ssm_new = delta_rule_chunked(qf, kf, vf, g, beta, ssm)
    o = gated_rms_norm(o.astype(h.dtype), z, lp["lin_norm"], config.rms_norm_eps)
    out = jnp.einsum("btnd,ndh->bth", o, lp["lin_wo"])
    if axis_name is not None:
        out = jax.lax.psum(out, axis_name)
    conv_new = tuple(_window(x, num_valid, width) for x in (xq, xk, xv))
    snap = (xq, xk, xv, states) if snapshots else None
    return out, conv_new, ssm_new, snap


def _moe_block(config: ModelConfig, lp: Params, x: jax.Array, axis_name) -> jax.Array:
    """Sparse MoE + gated shared expert on normed ``x [B, T, H]`` (partial sums under TP, closed by one psum)."""
    b, t, hdim = x.shape
    top_k = config.num_experts_per_tok
    xf = x.reshape(b * t, hdim)
    logits = jnp.einsum("nh,he->ne", xf, lp["router"], preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)                     # [N, k]
    weights = (weights / jnp.sum(weights, axis=-1, keepdims=True)).astype(x.dtype)
    num_experts = lp["we_gate"].shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)                              # rows grouped by expert
    sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    xs = xf[order // top_k]
    gate = jax.lax.ragged_dot(xs, lp["we_gate"], sizes)
    up = jax.lax.ragged_dot(xs, lp["we_up"], sizes)
    ys = jax.lax.ragged_dot(jax.nn.silu(gate) * up, lp["we_down"], sizes)
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(b * t, top_k, hdim)
    routed = jnp.einsum("nkh,nk->nh", y, weights)
    shared = (jax.nn.silu(xf @ lp["ws_gate"]) * (xf @ lp["ws_up"])) @ lp["ws_down"]
    out = routed + jax.nn.sigmoid(xf @ lp["shared_gate"]) * shared
    if axis_name is not None:
        out = jax.lax.psum(out, axis_name)
    return out.reshape(b, t, hdim)


def _lm_head(config: ModelConfig, params: Params, x: jax.Array, axis_name) -> jax.Array:
    return llama._lm_head(config, params, x, axis_name, norm=rms_norm_zc)


# ----------------------------------------------------------------------------------------------- steps
def step(config: ModelConfig, params: Params, cache: HybridCache, tokens: jax.Array, start: jax.Array,
         rows: jax.Array, *, aux_layers: tuple[int, ...] = (), score_layer: int | None = None,
         axis_name: str | None = None, num_valid: jax.Array | None = None, snapshots: bool = False,
         first_chunk: bool = False, rope_positions: jax.Array | None = None) -> tuple[StepOutput, HybridCache]:
    """Run ``T`` new tokens per sequence against the hybrid cache (contract of :func:`llama.step`, plus):

    Args:
        num_valid: int32 ``[B]`` how many of the T tokens enter the DeltaNet states (default: all). KV rows of all
            T tokens are written (position-indexed, harmless beyond a sequence's length).
        snapshots: also return ``StepOutput.states`` (:class:`StateSnapshots`), the DeltaNet states before the step
            and after each token, for :func:`commit` (verification). Forces the token-by-token recurrence.
        first_chunk: as in :func:`llama.step` (every ``start`` is 0).
        rope_positions: int32 ``[B, T]`` RoPE positions of the attention layers' new tokens (default ``start + t``;
            see :func:`llama.step`).
    Returns:
        ``(StepOutput, cache)``; the cache holds the DeltaNet states after ``num_valid`` tokens.
    """
    b, t = tokens.shape
    if score_layer is not None and config.layer_type(score_layer) != FULL_ATTENTION:
        raise ValueError(f"score_layer {score_layer} is not a full-attention layer "
                         f"({list(config.full_attention_layers)})")
    positions = start[:, None].astype(jnp.int32) + jnp.arange(t, dtype=jnp.int32)[None, :]
    if rope_positions is not None:
        positions = rope_positions.astype(jnp.int32)
    nv = jnp.full((b,), t, jnp.int32) if num_valid is None else jnp.asarray(num_valid, jnp.int32)
    cos, sin = rope_cos_sin(positions, config.rope.inv_freq(config.head_dim))
    scale = config.head_dim ** -0.5
    eps = config.rms_norm_eps
    x = embed_lookup(params["embed"], tokens, axis_name)
    aux = []
    new_k, new_v = list(cache.k), list(cache.v)
    conv = [list(cache.conv_q), list(cache.conv_k), list(cache.conv_v)]
    ssm = list(cache.ssm)
    snaps: list = []
    score_q = score_lse = None
    for i, lp in enumerate(params["layers"]):
        aux.extend((j, x) for j, a in enumerate(aux_layers) if a == i)
        h = rms_norm_zc(x, lp["attn_norm"], eps)
        if config.layer_type(i) == FULL_ATTENTION:
            slot = cache.full_layers.index(i)

            def attend(q, k, v, slot=slot):
                out, new_k[slot], new_v[slot] = cache_attention(q, k, v, new_k[slot], new_v[slot], start, scale,
                                                                positions=positions, prefix=not first_chunk,
                                                                pages=cache.pages, page_size=cache.page_size)
                return out

            o, q, lse = _attention_block(config, lp, h, cos, sin, attend, axis_name)
            if i == score_layer:
                score_q = jnp.take_along_axis(q.astype(jnp.float32), rows[:, :, None, None], axis=1)
                score_lse = jnp.take_along_axis(lse, rows[:, :, None], axis=1)
        else:
            slot = cache.linear_layers.index(i)
            prev = tuple(c[slot] for c in conv)
            o, conv_new, ssm[slot], snap = _deltanet_block(config, lp, h, prev, ssm[slot], nv, snapshots=snapshots,
                                                           axis_name=axis_name)
            for c, new in zip(conv, conv_new):
                c[slot] = new.astype(c[slot].dtype)
            snaps.append(snap)
        x = x + o
        x = x + _moe_block(config, lp, rms_norm_zc(x, lp["mlp_norm"], eps), axis_name)
    logits = _lm_head(config, params, jnp.take_along_axis(x, rows[:, :, None], axis=1), axis_name)
    aux_out = llama.concat_aux(aux, aux_layers, len(params["layers"]))
    states = None
    if snapshots:
        states = StateSnapshots(conv_q=tuple(s[0] for s in snaps), conv_k=tuple(s[1] for s in snaps),
                                conv_v=tuple(s[2] for s in snaps), ssm=tuple(s[3] for s in snaps))
    new_cache = cache.replace(k=tuple(new_k), v=tuple(new_v), conv_q=tuple(conv[0]), conv_k=tuple(conv[1]),
                              conv_v=tuple(conv[2]), ssm=tuple(ssm))
    return StepOutput(logits=logits, aux=aux_out, score_q=score_q, score_lse=score_lse, states=states), new_cache


def commit(config: ModelConfig, cache: HybridCache, out: StepOutput, keep: jax.Array) -> HybridCache:
    """Roll the DeltaNet states back to those after ``keep[b]`` of the last step's tokens (0 = before the step).

    After verifying ``[x, d_1..d_K]`` with ``snapshots=True`` and accepting ``m`` drafts, ``keep = m + 1`` (the
    committed tokens x, d_1..d_m; the bonus token is run by the next step); inactive sequences pass 0. KV needs no
    rollback (rows beyond the committed length are masked and overwritten).
    """
    snap = out.states
    if snap is None:
        raise ValueError("commit needs a step run with snapshots=True")
    width = config.linear_conv_kernel_dim - 1
    keep = jnp.asarray(keep, jnp.int32)
    pick = lambda xs, old: tuple(_window(x, keep, width).astype(o.dtype) for x, o in zip(xs, old))  # noqa: E731
    ssm = tuple(jnp.take_along_axis(s, keep[:, None, None, None, None], axis=1)[:, 0] for s in snap.ssm)
    return cache.replace(conv_q=pick(snap.conv_q, cache.conv_q), conv_k=pick(snap.conv_k, cache.conv_k),
                         conv_v=pick(snap.conv_v, cache.conv_v), ssm=ssm)


def empty_cache(config: ModelConfig, params: Params, batch: int, capacity: int) -> HybridCache:
    """A zero cache sized from the (possibly shard-local) params: local head counts come from weight shapes."""
    full = params["layers"][config.full_attention_layers[0]]
    lin = [params["layers"][i] for i in config.linear_attention_layers]
    return HybridCache.create(config, batch, capacity, params["embed"].dtype, num_kv_heads=full["wk"].shape[1],
                              num_linear_key_heads=lin[0]["lin_wq"].shape[1] if lin else None,
                              num_linear_value_heads=lin[0]["lin_wv"].shape[1] if lin else None)


def forward_aux(config: ModelConfig, params: Params, tokens: jax.Array, *, aux_layers: tuple[int, ...] = (),
                axis_name: str | None = None, attention: str = "dense") -> tuple[jax.Array, jax.Array | None]:
    """Full-sequence logits ``[B, T, V]`` (and aux states) without a cache: one :func:`step` from empty states
    (chunked DeltaNet form and tiled attention for long sequences). ``attention`` is accepted for signature
    compatibility with :func:`llama.forward_aux`; the step path decides how attention runs."""
    if attention not in ("dense", "flash"):
        raise ValueError(f"attention must be 'dense' or 'flash', got {attention!r}")
    b, t = tokens.shape
    cache = empty_cache(config, params, b, round_capacity(t))
    rows = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out, _ = step(config, params, cache, tokens, jnp.zeros((b,), jnp.int32), rows, aux_layers=aux_layers,
                  axis_name=axis_name)
    return out.logits, out.aux


def forward(config: ModelConfig, params: Params, tokens: jax.Array, *, axis_name: str | None = None,
            attention: str = "dense") -> jax.Array:
    """Full-sequence forward without a cache: float32 logits ``[B, T, V]``."""
    return forward_aux(config, params, tokens, axis_name=axis_name, attention=attention)[0]
