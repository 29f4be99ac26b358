"""The one-layer EAGLE-3 draft as pure functions of a params pytree.

Params pytree (weights ``[in, out]``; A = number of aux layers, Ht = target hidden size)::

    {"fc": [A*Ht, H], "hidden_norm": [H], "input_norm": [H],
     "wq": [2H, Hq, D], "wk": [2H, Hkv, D], "wv": [2H, Hkv, D], "wo": [Hq, D, H],
     "mlp_norm": [H], "w_gate": [H, I], "w_up": [H, I], "w_down": [I, H],
     "final_norm": [H], "lm_head": [H, Vd], "d2t": int32 [Vd], "embed": [V, H]}

``embed`` is the target's embedding unless the checkpoint carries its own; ``d2t`` maps a draft-vocabulary id
to a target id by offset (``target = draft + d2t[draft]``; zeros when the vocabularies are equal).

One draft entry pairs a token ``x_{t+1}`` with a hidden ``g`` at RoPE position ``t``: ``g`` is either the
concatenated target aux states of token ``x_t`` (then ``fc`` applies) or the previous draft step's pre-norm
output ``h2`` (``fc`` does not apply)::

    z        = concat(input_norm(embed[x]), hidden_norm(g))          # the embedding comes first
    residual = g   (hidden_norm(g) when norm_before_residual)
    q, k, v  = z @ wq, z @ wk, z @ wv;  RoPE (draft theta) on q and k
    h        = residual + o_proj(attention)
    h2       = h + mlp(mlp_norm(h))                                    # fed back to the next step
    logits   = lm_head(final_norm(h2))                                 # over the draft vocabulary

Because there is one layer, an entry's K/V depend only on its own (token, g): the draft's "prefill" is a
projection, no attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diffspec_jax.config import DraftConfig
from diffspec_jax.models import params as tables
from diffspec_jax.models.layers import (
    apply_rope, attention_dense, causal_mask, embed_lookup, gather_vocab, rms_norm, rope_cos_sin, swiglu,
)
from diffspec_jax.models.params import Param

Params = dict[str, Any]


#: the layer prefixes EAGLE-3 drafts are published with (SpecForge ``midlayer.``, vLLM ``layers.0.``)
LAYER_PREFIXES = ("midlayer.", "layers.0.")


@dataclass(frozen=True)
class RandomVocabulary:
    """The init of ``d2t``: a random sorted subset of the target vocabulary as offsets (:func:`make_d2t`)."""

    vocab_size: int

    def __call__(self, rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> np.ndarray:
        return make_d2t(np.sort(rng.choice(self.vocab_size, shape[0], replace=False)))


def param_table(config: DraftConfig, num_aux: int = 3, *, layer_prefix: str = "midlayer.",
                own_embedding: bool = False) -> tables.Table:
    """One :class:`~diffspec_jax.models.params.Param` per leaf (SpecForge / vLLM checkpoint names; ``d2t`` is read
    and written apart, with its companion ``t2d``, by :mod:`diffspec_jax.draft` and
    :func:`checkpoints_tools.hf.save_eagle3`). ``embed`` is a row only with ``own_embedding`` (else the target's
    is shared); the draft is sharded like the target's heads, its head and embedding vocabulary-parallel."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    p, lin, norm = layer_prefix, tables.Linear(), tables.NORM
    rows = [Param(("fc",), (num_aux * config.target_hidden_size, h), (None, None), "fc.weight", lin),
            Param(("hidden_norm",), (h,), (None,), f"{p}hidden_norm.weight", init=norm),
            Param(("input_norm",), (h,), (None,), f"{p}input_layernorm.weight", init=norm),
            Param(("wq",), (2 * h, hq, d), (None, "heads", None), f"{p}self_attn.q_proj.weight", lin),
            Param(("wk",), (2 * h, hkv, d), (None, "kv_heads", None), f"{p}self_attn.k_proj.weight", lin),
            Param(("wv",), (2 * h, hkv, d), (None, "kv_heads", None), f"{p}self_attn.v_proj.weight", lin),
            Param(("wo",), (hq, d, h), ("heads", None, None), f"{p}self_attn.o_proj.weight", tables.Linear(n_in=2)),
            Param(("mlp_norm",), (h,), (None,), f"{p}post_attention_layernorm.weight", init=norm),
            Param(("w_gate",), (h, i), (None, "mlp"), f"{p}mlp.gate_proj.weight", lin),
            Param(("w_up",), (h, i), (None, "mlp"), f"{p}mlp.up_proj.weight", lin),
            Param(("w_down",), (i, h), ("mlp", None), f"{p}mlp.down_proj.weight", lin),
            Param(("final_norm",), (h,), (None,), "norm.weight", init=norm),
            Param(("lm_head",), (h, config.draft_vocab_size), (None, "vocab"), "lm_head.weight", lin),
            Param(("d2t",), (config.draft_vocab_size,), (None,), init=RandomVocabulary(config.vocab_size),
                  dtype="int32")]
    if own_embedding:
        rows.append(Param(("embed",), (config.vocab_size, h), ("vocab", None), "embed_tokens.weight"))
    return tuple(rows)


def param_shapes(config: DraftConfig, num_aux: int = 3, own_embedding: bool = False) -> Params:
    """The draft params pytree with shape tuples as leaves (``d2t`` included, int32)."""
    return tables.shapes(param_table(config, num_aux, own_embedding=own_embedding))


def make_d2t(used_ids: np.ndarray) -> np.ndarray:
    """Offsets ``d2t[i] = used[i] - i`` from the sorted target ids of the draft vocabulary (int64, as on disk)."""
    used = np.sort(np.asarray(used_ids, np.int64))
    return used - np.arange(len(used), dtype=np.int64)


def init_params(config: DraftConfig, num_aux: int = 3, seed: int = 0, dtype=jnp.float32, scale: float = 0.08,
                used_ids: np.ndarray | None = None, own_embedding: bool = False) -> Params:
    """Random draft params (tests, ``make_tiny``); ``used_ids`` picks the draft vocabulary (default: random).
    Rows draw in the table's order (what the seeds of existing random drafts mean)."""
    fixed = {("d2t",): make_d2t(used_ids)} if used_ids is not None else None
    return tables.init(param_table(config, num_aux, own_embedding=own_embedding), seed, dtype, scale,
                       order="declared", fixed=fixed)


def entry_inputs(config: DraftConfig, p: Params, tokens: jax.Array, g: jax.Array, *, from_target: bool,
                 axis_name: str | None = None) -> tuple[jax.Array, jax.Array]:
    """``(z [B, T, 2H], residual [B, T, H])`` of entries (tokens int32 ``[B, T]`` in the target vocabulary).

    Args:
        g: ``[B, T, A*Ht]`` target aux states (``from_target=True``: ``fc`` applies) or ``[B, T, H]`` draft h2.
        axis_name: tensor-parallel axis of a sharded draft (vocabulary-parallel embedding).
    """
    if from_target:
        g = g.astype(p["fc"].dtype) @ p["fc"]
    e = embed_lookup(p["embed"], tokens, axis_name).astype(g.dtype)
    eps = config.rms_norm_eps
    g_normed = rms_norm(g, p["hidden_norm"], eps)
    residual = g_normed if config.norm_before_residual else g
    return jnp.concatenate([rms_norm(e, p["input_norm"], eps), g_normed], axis=-1), residual


def qkv(p: Params, z: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pre-RoPE ``q [B, T, Hq, D]``, ``k, v [B, T, Hkv, D]`` of entries."""
    return (jnp.einsum("btc,cnd->btnd", z, p["wq"]), jnp.einsum("btc,cnd->btnd", z, p["wk"]),
            jnp.einsum("btc,cnd->btnd", z, p["wv"]))


def rope(config: DraftConfig, x: jax.Array, positions: jax.Array) -> jax.Array:
    """Apply the draft's RoPE to ``x [B, T, heads, D]`` at int positions ``[B, T]``."""
    cos, sin = rope_cos_sin(positions, config.rope.inv_freq(config.head_dim))
    return apply_rope(x, cos, sin, interleaved=config.rope.interleaved)


def finish(config: DraftConfig, p: Params, residual: jax.Array, attn: jax.Array, axis_name: str | None = None
           ) -> tuple[jax.Array, jax.Array]:
    """From the attention output ``[B, T, Hq, D]`` to ``(h2 [B, T, H], draft logits float32 [B, T, Vd])``.

    With ``axis_name`` (a sharded draft) ``wo`` and ``w_down`` are row-parallel (``psum``) and the head is
    vocabulary-parallel (all-gather).
    """
    o = jnp.einsum("btnd,ndh->bth", attn, p["wo"])
    if axis_name is not None:
        o = jax.lax.psum(o, axis_name)
    h = residual + o.astype(residual.dtype)
    eps = config.rms_norm_eps
    m = swiglu(rms_norm(h, p["mlp_norm"], eps), p["w_gate"], p["w_up"], p["w_down"])
    if axis_name is not None:
        m = jax.lax.psum(m, axis_name)
    h2 = h + m
    logits = jnp.einsum("bth,hv->btv", rms_norm(h2, p["final_norm"], eps), p["lm_head"],
                        preferred_element_type=jnp.float32)
    return h2, gather_vocab(logits, config.draft_vocab_size, axis_name)


def to_target_ids(p: Params, draft_ids: jax.Array) -> jax.Array:
    """Draft-vocabulary ids -> target ids through the d2t offset table."""
    return draft_ids + p["d2t"][draft_ids]


def forward(config: DraftConfig, p: Params, tokens: jax.Array, aux: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Reference forward over a whole sequence of target-feature entries (causal, positions 0..T-1).

    Args:
        tokens: int32 ``[B, T]`` (entry t's token, i.e. ``x_{t+1}``); aux: ``[B, T, A*Ht]`` (features of ``x_t``).
    Returns:
        ``(h2 [B, T, H], logits float32 [B, T, Vd])``.
    """
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    z, residual = entry_inputs(config, p, tokens, aux, from_target=True)
    q, k, v = qkv(p, z)
    attn, _ = attention_dense(rope(config, q, positions), rope(config, k, positions), v,
                              causal_mask(positions, t), config.head_dim ** -0.5)
    return finish(config, p, residual, attn)
