"""Tiny random checkpoints for tests and the interim demo, built offline.

Two backends write the same Hugging Face layout:

* ``"transformers"`` (needs torch): instantiates ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` /
  ``Qwen3_5MoeForCausalLM`` / ``Qwen3_5MoeForConditionalGeneration`` (depth-1 vision tower) from a transformers
  config and calls ``save_pretrained``, so key names and shapes are transformers' own (Qwen3.5 experts are then
  written per expert; ``expert_layout="fused"`` rewrites them in the official fused layout);
* ``"numpy"`` (no torch): random params from :func:`diffspec_jax.models.llama.init_params`, written by
  :func:`checkpoints_tools.hf.save_hf` with the config written by the transformers config class.

Weights are random (normal, std ``scale``; norm weights ``1 + 0.2 * normal``, never all ones, so a missing norm
weight is caught). Such models compute garbage text: they exist to check numerics, never quality.

CLI::

    python -m checkpoints_tools.make_tiny OUT_DIR [--arch llama|qwen3|qwen3_5_moe] [--backend numpy|transformers]
        [--seed N] [--wrapper] [--expert-layout fused|per_expert]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file

from checkpoints_tools.hf import INDEX_FILE, SINGLE_FILE, fuse_experts, save_eagle3, save_hf, write_safetensors
from diffspec_jax.config import DraftConfig, ModelConfig, RopeConfig
from diffspec_jax.models import eagle3, family

TINY_DEFAULTS: dict[str, dict[str, Any]] = {
    # Llama-3.1 in miniature: GQA 4/2, llama3 rope whose original context (64) is far below max positions
    "llama": dict(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  rms_norm_eps=1e-5, max_position_embeddings=1024, tie_word_embeddings=False,
                  rope=RopeConfig(theta=10000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=64),
                  bos_token_id=1, eos_token_ids=(2,)),
    # Qwen3 in miniature: tied embeddings, q/k norm, head_dim (24) != hidden / heads (16)
    "qwen3": dict(architecture="Qwen3ForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                  rms_norm_eps=1e-6, max_position_embeddings=1024, tie_word_embeddings=True,
                  rope=RopeConfig(theta=1_000_000.0), bos_token_id=1, eos_token_ids=(2,)),
    # Qwen3.5-MoE in miniature: 3 Gated DeltaNet layers + 1 gated-attention layer, 8 experts top-2 + a shared
    # expert, partial RoPE (8 of 32 dims), head_dim * heads (128) != hidden (64), 2 key / 4 value DeltaNet heads
    "qwen3_5_moe": dict(architecture="Qwen3_5MoeForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=32,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                        rms_norm_eps=1e-6, max_position_embeddings=1024, tie_word_embeddings=False,
                        rope=RopeConfig(theta=10000.0, partial_rotary_factor=0.25),
                        layer_types=("linear_attention",) * 3 + ("full_attention",), linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                        linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
                        shared_expert_intermediate_size=48, bos_token_id=1, eos_token_ids=(2,)),
}
#: the depth-1 vision tower of tiny Qwen3_5MoeForConditionalGeneration checkpoints (ignored by the loader)
TINY_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, patch_size=4, spatial_merge_size=1,
                   temporal_patch_size=1, num_position_embeddings=16)


def tiny_config(arch: str = "llama", **overrides: Any) -> ModelConfig:
    """A tiny :class:`ModelConfig` (``arch`` in ``llama`` / ``qwen3`` / ``qwen3_5_moe``) with any field overridden
    (``architecture="Qwen3_5MoeForConditionalGeneration"`` gives the multimodal wrapper)."""
    if arch not in TINY_DEFAULTS:
        raise ValueError(f"unknown tiny architecture {arch!r} (choose from {', '.join(TINY_DEFAULTS)})")
    return ModelConfig(**{**TINY_DEFAULTS[arch], **overrides})


def transformers_config(config: ModelConfig):
    """The matching transformers config object (``LlamaConfig`` / ``Qwen3Config`` / ``Qwen3_5MoeTextConfig`` /
    ``Qwen3_5MoeConfig`` with a depth-1 vision tower)."""
    import transformers

    if config.architecture == "Qwen3_5MoeForConditionalGeneration":
        d = config.to_hf_dict()
        return transformers.Qwen3_5MoeConfig(text_config=d["text_config"], vision_config=dict(
            TINY_VISION, out_hidden_size=config.hidden_size), tie_word_embeddings=config.tie_word_embeddings,
            architectures=d["architectures"])
    cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config,
           "qwen3_5_moe_text": transformers.Qwen3_5MoeTextConfig}[config.model_type]
    return cls(**config.to_hf_dict())


def _transformers_class(config: ModelConfig):
    import transformers

    return {"LlamaForCausalLM": transformers.LlamaForCausalLM, "Qwen3ForCausalLM": transformers.Qwen3ForCausalLM,
            "Qwen3_5MoeForCausalLM": transformers.Qwen3_5MoeForCausalLM,
            "Qwen3_5MoeForConditionalGeneration": transformers.Qwen3_5MoeForConditionalGeneration,
            }[config.architecture]


def _random_value(name: str, p, scale: float, zero_centred: bool):
    """The random init of one torch parameter: norms never all ones (Qwen3.5's zero-centred norms ``0.2 * normal``),
    DeltaNet decay rates ``exp(A_log)`` in [0.05, 1] so the recurrent state keeps a memory of many tokens."""
    import torch

    if "linear_attn.norm" in name:  # the one plain-weight norm of Qwen3.5
        return 1.0 + 0.2 * torch.randn_like(p)
    if "norm" in name:
        return 0.2 * torch.randn_like(p) + (0.0 if zero_centred else 1.0)
    if name.endswith("A_log"):
        return torch.empty_like(p).uniform_(math.log(0.05), 0.0)
    if name.endswith("dt_bias"):
        return 0.5 * torch.randn_like(p)
    if "conv1d" in name:
        return 0.3 * torch.randn_like(p)
    return scale * torch.randn_like(p)


def make_tiny(out_dir: str | Path, arch: str = "llama", *, backend: str = "numpy", seed: int = 0,
              dtype: str = "float32", scale: float = 0.08, max_shard_bytes: int | None = None,
              expert_layout: str = "fused", **overrides: Any) -> Path:
    """Write a tiny random checkpoint to ``out_dir`` and return the path.

    Args:
        arch: ``"llama"``, ``"qwen3"`` or ``"qwen3_5_moe"``; ``overrides`` replace :data:`TINY_DEFAULTS` fields
            (``architecture="Qwen3_5MoeForConditionalGeneration"``: the wrapper, ``model.language_model.*`` keys).
        backend: ``"numpy"`` or ``"transformers"`` (see the module docstring).
        dtype: ``"float32"`` or ``"bfloat16"`` on disk.
        max_shard_bytes: write a sharded checkpoint with an index when the weights exceed this size.
        expert_layout: Qwen3.5 only: ``"fused"`` (``experts.gate_up_proj`` / ``experts.down_proj``) or
            ``"per_expert"`` (``experts.{j}.{gate,up,down}_proj.weight``) on disk.
    """
    config = tiny_config(arch, **overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if expert_layout not in ("fused", "per_expert"):
        raise ValueError(f"expert_layout must be 'fused' or 'per_expert', got {expert_layout!r}")
    if backend == "numpy":
        params = family(config).init_params(config, seed=seed, dtype=jnp.float32, scale=scale)
        save_hf(out, config, params, dtype=dtype, max_shard_bytes=max_shard_bytes, expert_layout=expert_layout)
        transformers_config(config).save_pretrained(out)  # transformers' own config.json
        _mark_random(out, backend, seed)
        return out
    if backend != "transformers":
        raise ValueError(f"unknown backend {backend!r} (choose numpy or transformers)")
    import torch

    torch.manual_seed(seed)
    model = _transformers_class(config)(transformers_config(config)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("model.visual."):
                continue  # the wrapper's vision tower keeps transformers' init (the loader ignores it)
            p.copy_(_random_value(name, p, scale, zero_centred=config.is_hybrid))
    model = model.to({"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
    kwargs = {"max_shard_size": max_shard_bytes} if max_shard_bytes else {}
    model.save_pretrained(out, **kwargs)
    if config.is_hybrid and expert_layout == "fused":
        _fuse_saved_experts(out, config)
    _mark_random(out, backend, seed)
    return out


def _fuse_saved_experts(out: Path, config: ModelConfig) -> None:
    """Rewrite the per-expert tensors that ``save_pretrained`` wrote in the official fused layout."""
    if (out / INDEX_FILE).exists():
        raise ValueError("expert_layout='fused' with the transformers backend needs a single-file checkpoint")
    tensors = fuse_experts(load_file(str(out / SINGLE_FILE)), config.weight_prefix)
    (out / SINGLE_FILE).unlink()
    write_safetensors(out, tensors)


def tiny_draft_config(target: ModelConfig, draft_vocab_size: int | None = None, **overrides: Any) -> DraftConfig:
    """A tiny EAGLE-3 draft config for ``target`` (hidden size shared, 4 heads / 2 KV heads, RoPE theta 10000)."""
    fields: dict[str, Any] = dict(hidden_size=target.hidden_size, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, intermediate_size=2 * target.hidden_size, vocab_size=target.vocab_size,
                                  draft_vocab_size=draft_vocab_size or target.vocab_size,
                                  target_hidden_size=target.hidden_size, rms_norm_eps=1e-5,
                                  max_position_embeddings=2048, rope=RopeConfig(theta=10000.0))
    return DraftConfig(**{**fields, **overrides})


def make_tiny_draft(out_dir: str | Path, target: ModelConfig, *, draft_vocab_size: int | None = None, seed: int = 0,
                    dtype: str = "float32", scale: float = 0.08, used_ids: np.ndarray | None = None,
                    own_embedding: bool = False, **overrides: Any) -> Path:
    """Write a random EAGLE-3 draft for ``target`` in the SpecForge / vLLM layout (``fc``, ``midlayer.*``,
    ``norm``, ``lm_head``, ``d2t``, ``t2d``; ``embed_tokens`` only with ``own_embedding``).

    ``draft_vocab_size`` < the target vocabulary picks ``used_ids`` (default: random) as the draft vocabulary.
    """
    config = tiny_draft_config(target, draft_vocab_size, **overrides)
    params = eagle3.init_params(config, num_aux=3, seed=seed, dtype=jnp.float32, scale=scale, used_ids=used_ids,
                                own_embedding=own_embedding)
    out = Path(out_dir)
    save_eagle3(out, config, params, dtype=dtype, own_embedding=own_embedding)
    _mark_random(out, "numpy", seed)
    return out


def _mark_random(out: Path, backend: str, seed: int) -> None:
    (out / "RANDOM_WEIGHTS.json").write_text(json.dumps(
        {"random": True, "backend": backend, "seed": seed,
         "note": "random weights made by checkpoints_tools.make_tiny; outputs are meaningless"}) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m checkpoints_tools.make_tiny", description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--arch", default="llama", choices=sorted(TINY_DEFAULTS))
    ap.add_argument("--backend", default="numpy", choices=["numpy", "transformers"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--max-shard-bytes", type=int, default=None)
    ap.add_argument("--wrapper", action="store_true",
                    help="qwen3_5_moe: write Qwen3_5MoeForConditionalGeneration (model.language_model.* keys)")
    ap.add_argument("--expert-layout", default="fused", choices=["fused", "per_expert"])
    args = ap.parse_args(argv)
    extra = {"architecture": "Qwen3_5MoeForConditionalGeneration"} if args.wrapper else {}
    if args.wrapper and args.arch != "qwen3_5_moe":
        ap.error("--wrapper needs --arch qwen3_5_moe")
    path = make_tiny(args.out_dir, args.arch, backend=args.backend, seed=args.seed, dtype=args.dtype,
                     max_shard_bytes=args.max_shard_bytes, expert_layout=args.expert_layout, **extra)
    print(f"wrote random tiny {args.arch} checkpoint to {path}")


if __name__ == "__main__":
    main()


__all__ = ["TINY_DEFAULTS", "tiny_config", "tiny_draft_config", "transformers_config", "make_tiny", "make_tiny_draft"]
