"""config.json parsing: both dialects, defaults, and a named refusal for every unsupported feature."""

import dataclasses
import json

import numpy as np
import pytest

from diffspec_jax import ModelConfig
from diffspec_jax.config import DraftConfig, RopeConfig
from diffspec_jax.errors import ConfigError, UnsupportedModelError

BASE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}


def test_v4_dialect_rope_theta_and_rope_scaling():
    cfg = ModelConfig.from_dict({**BASE, "rope_theta": 500000.0, "torch_dtype": "bfloat16", "eos_token_id": [5, 7],
                                 "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    assert cfg.rope == RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=8192)
    assert cfg.dtype == "bfloat16" and cfg.eos_token_ids == (5, 7)
    assert cfg.head_dim == 16  # missing head_dim -> hidden / heads


def test_very_old_type_key_and_missing_original_max():
    cfg = ModelConfig.from_dict({**BASE, "rope_scaling": {"type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 2.0}})
    assert cfg.rope.rope_type == "llama3"
    assert cfg.rope.original_max_position_embeddings == 4096  # defaults to max_position_embeddings
    assert cfg.rope.theta == 10000.0


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3_5MoeForCausalLM"])
def test_a_target_config_without_rope_theta_is_refused(arch):
    """Issue 38: with rope_parameters / rope_theta removed, transformers falls back to a default base and silently
    computes another model; targets are refused instead (EAGLE-3 drafts keep the default: their training configs
    carry none)."""
    bare = {k: v for k, v in BASE.items() if k != "rope_theta"}
    for cfg in (bare, {**bare, "rope_parameters": {"rope_type": "default"}}, {**bare, "rope_scaling": None}):
        with pytest.raises(ConfigError, match="x.json: no rope_theta .* add the value it was trained with"):
            ModelConfig.from_dict({**cfg, "architectures": [arch]}, source="x.json")
    draft = {**bare, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1, "draft_vocab_size": 500}
    assert DraftConfig.from_dict(draft).rope.theta == 10000.0


def test_an_eos_id_outside_the_vocabulary_is_refused():
    for eos in (1000, [5, 1000], 10**9):
        with pytest.raises(ConfigError, match=r"x.json: eos_token_id .*1000.* outside the vocabulary \[0, 1000\)"
                           if eos != 10**9 else "outside the vocabulary"):
            ModelConfig.from_dict({**BASE, "eos_token_id": eos}, source="x.json")
    cfg = ModelConfig.from_dict({**BASE, "eos_token_id": 999})
    with pytest.raises(ConfigError, match="eos_token_ids 1000 lies outside"):
        dataclasses.replace(cfg, eos_token_ids=(999, 1000))


def test_v5_dialect_rope_parameters_and_dtype():
    cfg = ModelConfig.from_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                                 "head_dim": 24, "dtype": "float32", "tie_word_embeddings": True,
                                 "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}})
    assert cfg.qk_norm and cfg.tie_word_embeddings and cfg.head_dim == 24
    assert cfg.rope.theta == 1e6 and cfg.rope.rope_type == "default" and cfg.dtype == "float32"


def test_v5_and_v4_files_of_transformers_agree(tmp_path):
    """transformers writes v5; the same values spelled in v4 parse to the same config."""
    import transformers

    v5 = transformers.LlamaConfig(**{k: v for k, v in BASE.items() if k not in ("architectures",)},
                                  rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 64})
    v5.save_pretrained(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in d
    v4 = {**BASE, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}
    a, b = ModelConfig.from_pretrained(tmp_path), ModelConfig.from_dict(v4)
    assert a.rope == b.rope and a.num_key_value_heads == b.num_key_value_heads


def test_to_hf_dict_round_trips():
    cfg = ModelConfig.from_dict({**BASE, "rope_theta": 5e5, "eos_token_id": 3})
    assert ModelConfig.from_dict(cfg.to_hf_dict()) == cfg


@pytest.mark.parametrize("patch, needle", [
    ({"architectures": ["MixtralForCausalLM"]}, "architecture 'MixtralForCausalLM' is not supported"),
    ({"architectures": [], "model_type": "gpt2"}, "architecture"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, "rope type 'dynamic' is not supported"),
    ({"kv_lora_rank": 512, "q_lora_rank": 1536}, "multi-head latent attention (MLA)"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantized checkpoints are not supported"),
    ({"attention_bias": True}, "attention_bias=true is not supported"),
    ({"use_sliding_window": True}, "sliding-window attention"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"text_config": {}, "hidden_size": None}, "multimodal wrapper"),
])
def test_unsupported_features_are_refused_by_name(patch, needle):
    d = {**BASE, **patch}
    d = {k: v for k, v in d.items() if v is not None}
    with pytest.raises(UnsupportedModelError) as info:
        ModelConfig.from_dict(d)
    assert needle in str(info.value)


@pytest.mark.parametrize("patch, needle", [
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"hidden_size": 0}, "hidden_size must be a positive integer"),
    ({"vocab_size": None}, "required key 'vocab_size'"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps must be > 0"),
])
def test_invalid_values_are_refused(patch, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        ModelConfig.from_dict({**BASE, **patch})


def test_missing_and_corrupt_config_file(tmp_path):
    from diffspec_jax.errors import CheckpointError

    with pytest.raises(CheckpointError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("rope", [
    dict(rope_type="default", rope_theta=10000.0),
    dict(rope_type="default", rope_theta=1e6),
    dict(rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=8192),
    dict(rope_type="llama3", rope_theta=1e4, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=64),
])
def test_inv_freq_matches_transformers_to_one_ulp(rope):
    """Angles at 100K+ positions only agree if the float32 inverse frequencies agree to the last bit or so."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=2, rope_parameters=rope)
    if rope["rope_type"] == "default":
        inv, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_cfg)
    else:
        inv, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg)
    ours = ModelConfig.from_dict({**BASE, "hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2,
                                  "rope_parameters": rope}).rope.inv_freq(128)
    ulps = np.abs(ours.view(np.int32).astype(np.int64) - inv.numpy().view(np.int32).astype(np.int64))
    assert ulps.max() <= 1 and (ulps > 0).sum() <= 2, ulps
