"""Frozen, validated configuration dataclasses.

:class:`ModelConfig` is parsed from a Hugging Face ``config.json`` in either dialect:

* transformers v5: ``rope_parameters = {rope_theta, rope_type, factor, ...}`` and ``dtype``;
* transformers v4 (most Hub checkpoints): top-level ``rope_theta`` + ``rope_scaling`` (key ``rope_type``, or
  ``type`` in very old files) and ``torch_dtype``.

Supported targets: ``LlamaForCausalLM`` (Llama-3.x), ``Qwen3ForCausalLM`` and the Qwen3.5 hybrid MoE family
(``Qwen3_5MoeForCausalLM``, and the text path of the multimodal wrapper ``Qwen3_5MoeForConditionalGeneration``,
whose ``text_config`` is read); RoPE types ``default`` and ``llama3``. Anything else (another architecture, RoPE
type, multi-head latent attention, quantized weights, attention biases, sliding windows) is refused with an
:class:`~diffspec_jax.errors.UnsupportedModelError` that names it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping

import numpy as np

from diffspec_jax.adaptive import check_branching
from diffspec_jax.errors import CheckpointError, ConfigError, UnsupportedModelError
from diffspec_jax.validation import _is_int, _is_real, _show, check_bool, check_int, check_real, read_json_object

#: architecture name -> (model_type, has per-head q/k norm)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "LlamaForCausalLM": ("llama", False),
    "Qwen3ForCausalLM": ("qwen3", True),
    "Qwen3_5MoeForCausalLM": ("qwen3_5_moe_text", True),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5_moe", True),
}
#: the Qwen3.5 hybrid MoE architectures (Gated DeltaNet + gated attention + MoE): model family "qwen3_5_moe"
QWEN35_ARCHITECTURES = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
#: layer types of the hybrid family (``layer_types`` entries)
FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"
SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding parameters.

    Attributes:
        theta: base of the inverse frequencies (``rope_theta``), default 10000.
        rope_type: ``"default"`` or ``"llama3"`` (frequency-dependent scaling of Llama-3.1).
        factor, low_freq_factor, high_freq_factor, original_max_position_embeddings: llama3 parameters.
        partial_rotary_factor: fraction of ``head_dim`` that is rotated (1.0 = all of it).
        interleaved: rotate interleaved pairs (GPT-J style) instead of halves (Llama style, the default).
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    partial_rotary_factor: float = 1.0
    interleaved: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.rope_type, str) or self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope type {self.rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if not _is_real(self.theta) or not math.isfinite(self.theta) or not self.theta > 0:
            raise ConfigError(f"rope_theta must be a finite number > 0, got {_show(self.theta)}")
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            check_real(getattr(self, name), f"rope {name}")
        check_int(self.original_max_position_embeddings, "rope original_max_position_embeddings", min=0)
        check_bool(self.interleaved, "rope interleaved")
        if not _is_real(self.partial_rotary_factor) or not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {_show(self.partial_rotary_factor)}")
        if self.rope_type == "llama3":
            if self.factor <= 0 or self.original_max_position_embeddings <= 0:
                raise ConfigError("llama3 rope needs factor > 0 and original_max_position_embeddings > 0")
            if self.high_freq_factor <= self.low_freq_factor:
                raise ConfigError(
                    f"llama3 rope needs high_freq_factor > low_freq_factor, got "
                    f"{self.high_freq_factor} <= {self.low_freq_factor}"
                )

    def rotary_dim(self, head_dim: int) -> int:
        """Number of rotated dimensions of a head (even)."""
        dim = int(head_dim * self.partial_rotary_factor)
        if dim % 2 or dim <= 0:
            raise ConfigError(f"rotary dimension {dim} (head_dim {head_dim} x {self.partial_rotary_factor}) must be even")
        return dim

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """Inverse frequencies, float32 ``[rotary_dim // 2]``.

        Computed in float32 in the same order of operations as ``transformers``, so each frequency is within
        one float32 ulp of the reference (torch's own ``powf`` is not always correctly rounded, and differs
        between CPU and GPU builds by as much).
        """
        dim = self.rotary_dim(head_dim)
        exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
        # pow correctly rounded to float32, then a float32 reciprocal: within 1 ulp of torch's float32 powf
        power = np.power(np.float64(np.float32(self.theta)), exponents.astype(np.float64)).astype(np.float32)
        inv = (np.float32(1.0) / power).astype(np.float32)
        if self.rope_type == "llama3":
            old = np.float32(self.original_max_position_embeddings)
            low_wavelen = old / np.float32(self.low_freq_factor)
            high_wavelen = old / np.float32(self.high_freq_factor)
            wavelen = np.float32(2 * math.pi) / inv
            scaled = np.where(wavelen > low_wavelen, inv / np.float32(self.factor), inv)
            smooth = (old / wavelen - np.float32(self.low_freq_factor)) / np.float32(
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (np.float32(1) - smooth) * scaled / np.float32(self.factor) + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            inv = np.where(medium, smoothed, scaled).astype(np.float32)
        return inv

    def to_hf(self) -> dict[str, Any]:
        """The ``rope_parameters`` dict of the transformers v5 dialect."""
        out: dict[str, Any] = {"rope_theta": self.theta, "rope_type": self.rope_type}
        if self.rope_type == "llama3":
            out.update(
                factor=self.factor,
                low_freq_factor=self.low_freq_factor,
                high_freq_factor=self.high_freq_factor,
                original_max_position_embeddings=self.original_max_position_embeddings,
            )
        if self.partial_rotary_factor != 1.0:
            out["partial_rotary_factor"] = self.partial_rotary_factor
        return out


def parse_rope(d: dict[str, Any], max_position_embeddings: int, *, default_theta: float | None = 10000.0,
               default_partial: float = 1.0, source: str = "config.json") -> RopeConfig:
    """Build a :class:`RopeConfig` from a config dict in either the v5 or the v4 dialect.

    ``default_theta=None``: ``rope_theta`` is required (a :class:`ConfigError` without it): targets are refused
    rather than run with a guessed base, which would silently change the model."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        # v5 models with several attention types nest one dict per layer type.
        if set(params) != {"full_attention"}:
            raise UnsupportedModelError(f"per-layer-type rope_parameters {sorted(params)} are not supported")
        params = params["full_attention"]
    if not isinstance(params, dict) or not params:
        scaling = d.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise ConfigError(f"{source}: rope_scaling must be a JSON object or null, got {_show(scaling)}")
        params = dict(scaling or {})
        if "rope_theta" in d and d["rope_theta"] is not None:
            params.setdefault("rope_theta", d["rope_theta"])
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    theta = params.get("rope_theta", d.get("rope_theta"))
    if theta is None and default_theta is None:
        raise ConfigError(f"{source}: no rope_theta (neither in rope_parameters nor at the top level): the model "
                          f"rotates positions by it, and a guessed default would silently change its output; add the "
                          f"value it was trained with, e.g. \"rope_parameters\": {{\"rope_type\": \"default\", "
                          f"\"rope_theta\": 500000.0}}")
    theta = default_theta if theta is None else _number(theta, "rope_theta", source)
    partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor", default_partial)) or default_partial
    kwargs: dict[str, Any] = dict(theta=theta, rope_type=rope_type,
                                  partial_rotary_factor=_number(partial, "partial_rotary_factor", source))
    if rope_type == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            if key not in params:
                raise ConfigError(f"{source}: llama3 rope parameters lack {key!r}")
            kwargs[key] = _number(params[key], key, source)
        kwargs["original_max_position_embeddings"] = _integer(
            params.get("original_max_position_embeddings") or max_position_embeddings,
            "original_max_position_embeddings", source)
    return RopeConfig(**kwargs)


def _check_positive_ints(obj: Any, names: tuple[str, ...], prefix: str = "") -> None:
    """Refuse any of ``names`` that is not a positive integer (bools excluded)."""
    for name in names:
        _positive_int(getattr(obj, name), prefix + name)


def _require(d: dict[str, Any], key: str, where: str) -> Any:
    if d.get(key) is None:
        raise ConfigError(f"{where}: required key {key!r} is missing")
    return d[key]


def _integer(value: Any, key: str, source: str) -> int:
    """A config.json integer (an integral float such as ``4096.0`` too); a named error for anything else."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not _is_int(value):
        raise ConfigError(f"{source}: {key} must be an integer, got {_show(value)}")
    return int(value)


def _number(value: Any, key: str, source: str) -> float:
    """A config.json number (int or float, not a string or a bool); a named error for anything else."""
    if not _is_real(value) or not math.isfinite(float(value)):
        raise ConfigError(f"{source}: {key} must be a finite number, got {_show(value)}")
    return float(value)


def _req_int(d: dict[str, Any], key: str, source: str) -> int:
    return _integer(_require(d, key, source), key, source)


def _opt_int(d: dict[str, Any], key: str, source: str, default: Any) -> Any:
    """``d[key]`` as an int; ``default`` when it is absent, null or 0 (as transformers' ``or`` defaults)."""
    value = d.get(key)
    return default if value is None or (_is_int(value) and value == 0) else _integer(value, key, source)


def _opt_number(d: dict[str, Any], key: str, source: str, default: float) -> float:
    value = d.get(key)
    return default if value is None else _number(value, key, source)


def _opt_bool(d: dict[str, Any], key: str, source: str, default: bool) -> bool:
    value = d.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{source}: {key} must be true or false, got {_show(value)}")
    return value


def _token_ids(value: Any, key: str, source: str) -> tuple[int, ...]:
    values = value if isinstance(value, list) else [] if value is None else [value]
    return tuple(_integer(v, key, source) for v in values)


def check_eos_ids(ids: tuple[int, ...], vocab_size: Any, what: str) -> None:
    """Refuse EOS ids outside ``[0, vocab_size)``: the model can never emit them, so generation would silently
    ignore them and run to its token limit (transformers only warns)."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size <= 0:
        return  # the vocabulary size itself is checked where it is parsed
    bad = [int(e) for e in ids if not 0 <= int(e) < vocab_size]
    if bad:
        raise ConfigError(f"{what} {bad[0] if len(bad) == 1 else bad} lies outside the vocabulary [0, {vocab_size}): "
                          f"the model can never emit it, so generation would never stop there; fix the id (or the "
                          f"vocab_size)")


def _check_dict(d: Any, source: str, what: str = "config.json") -> dict[str, Any]:
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: {what} must be a JSON object {{...}}, got {_show(d)}")
    return d


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only target model (Llama-3.x, Qwen3 or Qwen3.5 hybrid MoE), as read from ``config.json``.

    The dataclass is hashable, so it can be a static argument of ``jax.jit``.

    Qwen3.5 hybrid MoE fields (zero / empty for the dense families):

    * ``layer_types``: ``"full_attention"`` (gated attention with a KV cache) or ``"linear_attention"`` (Gated
      DeltaNet with a conv + recurrent state) per layer; empty means every layer is full attention.
    * ``linear_num_key_heads``, ``linear_num_value_heads``, ``linear_key_head_dim``, ``linear_value_head_dim``,
      ``linear_conv_kernel_dim``: the Gated DeltaNet shapes.
    * ``num_experts``, ``num_experts_per_tok`` (top-k), ``shared_expert_intermediate_size``; ``intermediate_size``
      holds the per-expert ``moe_intermediate_size``.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.architecture, str) or self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.architecture!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        _check_positive_ints(self, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not _is_real(self.rms_norm_eps) or not math.isfinite(self.rms_norm_eps) or not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be > 0 (a finite number), got {_show(self.rms_norm_eps)}")
        check_bool(self.tie_word_embeddings, "tie_word_embeddings")
        if self.dtype is not None and not isinstance(self.dtype, str):
            raise ConfigError(f"dtype must be a dtype name such as 'bfloat16' or None, got {_show(self.dtype)}")
        check_int(self.bos_token_id, "bos_token_id", min=0, none_ok=True)
        if not isinstance(self.eos_token_ids, tuple):
            raise ConfigError(f"eos_token_ids must be a tuple of token ids, got {_show(self.eos_token_ids)}")
        for e in self.eos_token_ids:
            check_int(e, "eos_token_ids entry", min=0)
        check_eos_ids(self.eos_token_ids, self.vocab_size, "eos_token_ids")
        if not isinstance(self.rope, RopeConfig):
            raise ConfigError(f"rope must be a RopeConfig, got {_show(self.rope)}")
        if not isinstance(self.layer_types, tuple) or not all(isinstance(t, str) for t in self.layer_types):
            raise ConfigError(f"layer_types must be a tuple of layer type names, got {_show(self.layer_types)}")
        for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok",
                     "shared_expert_intermediate_size"):
            check_int(getattr(self, name), name, min=0)
        self.rope.rotary_dim(self.head_dim)
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        allowed = {FULL_ATTENTION, LINEAR_ATTENTION} if self.is_hybrid else {FULL_ATTENTION}
        bad = sorted(set(self.layer_types) - allowed)
        if bad:
            raise UnsupportedModelError(f"layer types {bad} are not supported for {self.architecture}")
        if self.is_hybrid:
            _check_positive_ints(self, ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                        "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts",
                                        "num_experts_per_tok", "shared_expert_intermediate_size"))
            if not self.full_attention_layers:
                raise ConfigError(f"{self.architecture}: at least one full_attention layer is required")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ConfigError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                                  f"linear_num_key_heads ({self.linear_num_key_heads})")
            if self.num_experts_per_tok > self.num_experts:
                raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                                  f"({self.num_experts})")

    @property
    def model_type(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture][0]

    @property
    def family(self) -> str:
        """Model family: ``"llama"`` (Llama-3.x, Qwen3) or ``"qwen3_5_moe"`` (hybrid MoE); picks the model code."""
        return "qwen3_5_moe" if self.architecture in QWEN35_ARCHITECTURES else "llama"

    @property
    def is_hybrid(self) -> bool:
        """Qwen3.5: Gated DeltaNet and gated-attention layers, MoE MLPs."""
        return self.architecture in QWEN35_ARCHITECTURES

    @property
    def weight_prefix(self) -> str:
        """Key prefix of the decoder's tensors in a Hugging Face checkpoint."""
        return "model.language_model." if self.architecture == "Qwen3_5MoeForConditionalGeneration" else "model."

    @property
    def qk_norm(self) -> bool:
        """Qwen3 applies a per-head RMSNorm to q and k before RoPE."""
        return SUPPORTED_ARCHITECTURES[self.architecture][1]

    @property
    def num_query_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else FULL_ATTENTION

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        """Indices of the layers with softmax attention over the whole context (and a KV cache)."""
        return tuple(i for i in range(self.num_hidden_layers) if self.layer_type(i) == FULL_ATTENTION)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        """Indices of the Gated DeltaNet layers (conv + recurrent state instead of a KV cache)."""
        return tuple(i for i in range(self.num_hidden_layers) if self.layer_type(i) == LINEAR_ATTENTION)

    @property
    def last_full_attention_layer(self) -> int:
        """The last layer whose attention covers the whole context (DiffSpec's default scoring layer)."""
        return self.full_attention_layers[-1]

    @property
    def moe_intermediate_size(self) -> int:
        """Per-expert intermediate size of the MoE family (stored in ``intermediate_size``)."""
        return self.intermediate_size if self.is_hybrid else 0

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def num_parameters(self) -> int:
        h, i, v, d = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        if self.is_hybrid:
            hq, hkv = self.num_attention_heads, self.num_key_value_heads
            attn = h * d * (hq * 3 + hkv * 2) + 2 * d
            kd, vd, hv = self.linear_key_dim, self.linear_value_dim, self.linear_num_value_heads
            conv = 2 * kd + vd
            gdn = h * conv + conv * self.linear_conv_kernel_dim + 2 * h * vd + 2 * h * hv + 2 * hv + \
                self.linear_value_head_dim
            moe = h * self.num_experts + self.num_experts * 3 * h * i + 3 * h * self.shared_expert_intermediate_size + h
            layers = sum((attn if self.layer_type(n) == FULL_ATTENTION else gdn) + moe + 2 * h
                         for n in range(self.num_hidden_layers))
            return v * h * (1 if self.tie_word_embeddings else 2) + h + layers
        attn = h * d * (self.num_attention_heads * 2 + self.num_key_value_heads * 2)
        per_layer = attn + 3 * h * i + 2 * h + (2 * d if self.qk_norm else 0)
        return v * h * (1 if self.tie_word_embeddings else 2) + h + self.num_hidden_layers * per_layer

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Parse a Hugging Face config dict (either dialect); refuse unsupported features by name."""
        d = _check_dict(d, source)
        archs = d.get("architectures") or []
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise ConfigError(f"{source}: architectures must be a list of class names such as "
                              f"[\"LlamaForCausalLM\"], got {_show(archs)}")
        if archs:
            arch = archs[0]
        else:
            by_type = {mt: a for a, (mt, _) in SUPPORTED_ARCHITECTURES.items()}
            arch = by_type.get(d.get("model_type", ""), f"<model_type {d.get('model_type')!r}>")
        if "text_config" in d and "hidden_size" not in d and arch != "Qwen3_5MoeForConditionalGeneration":
            raise UnsupportedModelError(
                f"{source}: multimodal wrapper configs (text_config) are not supported for this architecture"
            )
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{source}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        top = d
        if arch == "Qwen3_5MoeForConditionalGeneration":  # the text path of the multimodal wrapper
            if not isinstance(d.get("text_config"), dict):
                raise ConfigError(f"{source}: {arch} needs a text_config (a JSON object)")
            d = d["text_config"]
        for cfg in (top, d):
            if cfg.get("quantization_config"):
                method = cfg["quantization_config"].get("quant_method", "unknown") if isinstance(
                    cfg["quantization_config"], dict) else "unknown"
                raise UnsupportedModelError(f"{source}: quantized checkpoints are not supported (quant_method "
                                            f"{method!r})")
        if any(d.get(k) for k in ("kv_lora_rank", "q_lora_rank")):
            raise UnsupportedModelError(f"{source}: multi-head latent attention (MLA) is not supported")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        for key in ("attention_bias", "mlp_bias"):
            if d.get(key):
                raise UnsupportedModelError(f"{source}: {key}=true is not supported")
        if d.get("use_sliding_window"):
            raise UnsupportedModelError(f"{source}: sliding-window attention is not supported")
        hybrid = arch in QWEN35_ARCHITECTURES
        layer_types = d.get("layer_types")
        if layer_types is not None and (not isinstance(layer_types, list)
                                        or not all(isinstance(t, str) for t in layer_types)):
            raise ConfigError(f"{source}: layer_types must be a list of layer type names, got {_show(layer_types)}")
        allowed = {FULL_ATTENTION, LINEAR_ATTENTION} if hybrid else {FULL_ATTENTION}
        if layer_types and any(t not in allowed for t in layer_types):
            raise UnsupportedModelError(
                f"{source}: layer types {sorted(set(layer_types) - allowed)} are not supported"
            )
        if d.get("pretraining_tp", 1) not in (1, None):
            raise UnsupportedModelError(f"{source}: pretraining_tp={d['pretraining_tp']} is not supported")

        hidden = _req_int(d, "hidden_size", source)
        heads = _req_int(d, "num_attention_heads", source)
        if heads <= 0:
            raise ConfigError(f"{source}: num_attention_heads must be a positive integer, got {heads}")
        max_pos = _opt_int(d, "max_position_embeddings", source, 32768 if hybrid else 8192)
        eos_ids = _token_ids(d.get("eos_token_id", top.get("eos_token_id")), "eos_token_id", source)
        vocab = _req_int(d, "vocab_size", source)
        check_eos_ids(eos_ids, vocab, f"{source}: eos_token_id")
        bos = d.get("bos_token_id", top.get("bos_token_id"))
        common = dict(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            num_hidden_layers=_req_int(d, "num_hidden_layers", source),
            num_attention_heads=heads,
            max_position_embeddings=max_pos,
            dtype=d.get("dtype") or d.get("torch_dtype") or top.get("dtype") or top.get("torch_dtype"),
            bos_token_id=None if bos is None else _integer(bos, "bos_token_id", source),
            eos_token_ids=eos_ids,
        )
        if hybrid:
            return cls(**common, **_qwen35_fields(d, top, source, max_pos))
        return cls(
            **common,
            intermediate_size=_req_int(d, "intermediate_size", source),
            num_key_value_heads=_opt_int(d, "num_key_value_heads", source, heads),
            head_dim=_opt_int(d, "head_dim", source, hidden // heads),
            rms_norm_eps=_opt_number(d, "rms_norm_eps", source, 1e-6 if arch == "Qwen3ForCausalLM" else 1e-5),
            tie_word_embeddings=_opt_bool(d, "tie_word_embeddings", source, False),
            rope=parse_rope(d, max_pos, default_theta=None, source=source),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read ``path/config.json`` (or ``path`` itself when it is the file)."""
        path = Path(path)
        file = path if path.is_file() else path / "config.json"
        if not file.exists():
            raise CheckpointError(f"no config.json found at {file}")
        return cls.from_dict(read_json_object(file), source=str(file))

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers-v5 ``config.json`` dict that :meth:`from_dict` (and transformers) read back."""
        if self.is_hybrid:
            return self._qwen35_hf_dict()
        d: dict[str, Any] = {"architectures": [self.architecture], "model_type": self.model_type,
                             "intermediate_size": self.intermediate_size, **self._hf_common(),
                             "rope_parameters": self.rope.to_hf()}
        if self.model_type == "llama":
            d["mlp_bias"] = False
        return d

    def _hf_common(self) -> dict[str, Any]:
        """The config.json fields every family writes the same way (token ids and dtype only when set)."""
        d: dict[str, Any] = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
        }
        if self.dtype:
            d["dtype"] = self.dtype
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            d["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        return d

    def _qwen35_hf_dict(self) -> dict[str, Any]:
        text: dict[str, Any] = {
            "model_type": "qwen3_5_moe_text",
            **self._hf_common(),
            "rope_parameters": {**self.rope.to_hf(), "partial_rotary_factor": self.rope.partial_rotary_factor},
            "layer_types": list(self.layer_types) or [FULL_ATTENTION] * self.num_hidden_layers,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "moe_intermediate_size": self.intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
        }
        if self.architecture == "Qwen3_5MoeForCausalLM":
            return {"architectures": [self.architecture], **text}
        out: dict[str, Any] = {"architectures": [self.architecture], "model_type": "qwen3_5_moe", "text_config": text,
                               "tie_word_embeddings": self.tie_word_embeddings}
        if self.dtype:
            out["dtype"] = self.dtype
        return out

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def _qwen35_fields(d: dict[str, Any], top: dict[str, Any], source: str, max_pos: int) -> dict[str, Any]:
    """The Qwen3.5-MoE specific fields of a (text) config dict. Missing keys take the defaults of transformers'
    ``Qwen3_5MoeTextConfig``, as transformers itself would (so parity holds for any file it reads)."""
    if d.get("attn_output_gate") is False:
        raise UnsupportedModelError(f"{source}: attn_output_gate=false is not supported (Qwen3.5 gates attention)")
    if d.get("mlp_only_layers"):
        raise UnsupportedModelError(f"{source}: mlp_only_layers (dense MLP layers) are not supported")
    if d.get("decoder_sparse_step", 1) not in (1, None):
        raise UnsupportedModelError(f"{source}: decoder_sparse_step={d['decoder_sparse_step']} is not supported")
    n = _req_int(d, "num_hidden_layers", source)
    layer_types = d.get("layer_types")
    if not layer_types:
        interval = _opt_int(d, "full_attention_interval", source, 4)
        if interval < 1:
            raise ConfigError(f"{source}: full_attention_interval must be a positive integer, got {interval}")
        layer_types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(n)]
    tie = top.get("tie_word_embeddings", d.get("tie_word_embeddings", False))
    tie = _opt_bool({"tie_word_embeddings": tie}, "tie_word_embeddings", source, False)
    return dict(
        intermediate_size=_opt_int(d, "moe_intermediate_size", source, 512),
        num_key_value_heads=_opt_int(d, "num_key_value_heads", source, 2),
        head_dim=_opt_int(d, "head_dim", source, 256),
        rms_norm_eps=_opt_number(d, "rms_norm_eps", source, 1e-6),
        tie_word_embeddings=tie,
        rope=parse_rope(d, max_pos, default_theta=None, default_partial=0.25, source=source),
        layer_types=tuple(str(t) for t in layer_types),
        linear_num_key_heads=_opt_int(d, "linear_num_key_heads", source, 16),
        linear_num_value_heads=_opt_int(d, "linear_num_value_heads", source, 32),
        linear_key_head_dim=_opt_int(d, "linear_key_head_dim", source, 128),
        linear_value_head_dim=_opt_int(d, "linear_value_head_dim", source, 128),
        linear_conv_kernel_dim=_opt_int(d, "linear_conv_kernel_dim", source, 4),
        num_experts=_opt_int(d, "num_experts", source, 256),
        num_experts_per_tok=_opt_int(d, "num_experts_per_tok", source, 8),
        shared_expert_intermediate_size=_opt_int(d, "shared_expert_intermediate_size", source, 512),
    )


# ---------------------------------------------------------------------------------------------------- draft
AUX_CONVENTIONS = ("auto", "hf", "output")


@dataclass(frozen=True)
class DraftConfig:
    """A one-layer EAGLE-3 draft, as read from its ``config.json``.

    Attributes:
        vocab_size: the **target** vocabulary (token inputs and d2t outputs live there).
        draft_vocab_size: size of the draft's output head (``lm_head``); equals ``vocab_size`` when absent.
        target_hidden_size: width of each target aux state (``fc`` input = ``len(aux) * target_hidden_size``).
        rope: the draft's own RoPE (EAGLE-3 training configs carry no ``rope_theta``: default 10000).
        aux_layer_ids: aux layers as HF ``hidden_states`` indices (index i = input of target layer i), or
            ``None`` for the target's default ``(2, L // 2, L - 3)``.
        norm_before_residual: the residual is ``hidden_norm(g)`` instead of ``g`` (vLLM "speculators" drafts).
    """

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    rope: RopeConfig = field(default_factory=RopeConfig)
    aux_layer_ids: tuple[int, ...] | None = None
    norm_before_residual: bool = False

    def __post_init__(self) -> None:
        _check_positive_ints(self, ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                    "intermediate_size", "vocab_size", "draft_vocab_size", "target_hidden_size",
                                    "max_position_embeddings"), "draft ")
        if not _is_real(self.rms_norm_eps) or not math.isfinite(self.rms_norm_eps) or not self.rms_norm_eps > 0:
            raise ConfigError(f"draft rms_norm_eps must be > 0 (a finite number), got {_show(self.rms_norm_eps)}")
        if not isinstance(self.rope, RopeConfig):
            raise ConfigError(f"draft rope must be a RopeConfig, got {_show(self.rope)}")
        if self.aux_layer_ids is not None:
            if not isinstance(self.aux_layer_ids, tuple) or not self.aux_layer_ids:
                raise ConfigError(f"draft aux_layer_ids must be a non-empty tuple of layer indices or None, got "
                                  f"{_show(self.aux_layer_ids)}")
            for i in self.aux_layer_ids:
                check_int(i, "draft aux_layer_ids entry", min=0)
        check_bool(self.norm_before_residual, "draft norm_before_residual")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"draft num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_key_value_heads})")
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(f"draft_vocab_size ({self.draft_vocab_size}) exceeds vocab_size ({self.vocab_size})")
        self.rope.rotary_dim(self.head_dim)

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "config.json", aux_convention: str = "auto"
                  ) -> DraftConfig:
        """Parse an EAGLE-3 draft config (EAGLE, SpecForge and vLLM spellings).

        Args:
            aux_convention: how explicit aux ids are read: ``"hf"`` (HF ``hidden_states`` indices, the EAGLE and
                vLLM convention), ``"output"`` (output-of-layer ids, SpecForge: +1), or ``"auto"`` (SGLang's rule:
                a first id of 1 means output-of-layer ids).
        """
        if not isinstance(aux_convention, str) or aux_convention not in AUX_CONVENTIONS:
            raise ConfigError(f"aux_convention must be one of {AUX_CONVENTIONS}, got {aux_convention!r}")
        d = _check_dict(d, source, "a draft config.json")
        if "transformer_layer_config" in d:
            raise UnsupportedModelError(f"{source}: the vLLM 'speculators' nested draft format is not supported; "
                                        f"flatten transformer_layer_config into the top level")
        layers = d.get("num_hidden_layers", 1)
        if layers != 1:
            raise UnsupportedModelError(f"{source}: an EAGLE-3 draft has exactly one layer, this one has {layers}")
        eagle = d.get("eagle_config") or {}
        if not isinstance(eagle, dict):
            raise ConfigError(f"{source}: eagle_config must be a JSON object, got {_show(eagle)}")
        if eagle.get("use_aux_hidden_state") is False:
            raise UnsupportedModelError(f"{source}: use_aux_hidden_state=false (EAGLE-1 style draft) is not supported")
        for key in ("fc_norm", "norm_before_fc"):
            if d.get(key) or eagle.get(key):
                raise UnsupportedModelError(f"{source}: {key} drafts (RMSNorm on aux states before fc) are not "
                                            f"supported")
        if d.get("norm_output") is False:
            raise UnsupportedModelError(f"{source}: norm_output=false is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"{source}: draft hidden_act {d['hidden_act']!r} is not supported")
        hidden = _req_int(d, "hidden_size", source)
        heads = _req_int(d, "num_attention_heads", source)
        if heads <= 0:
            raise ConfigError(f"{source}: num_attention_heads must be a positive integer, got {heads}")
        vocab = _req_int(d, "vocab_size", source)
        ids = d.get("eagle_aux_hidden_state_layer_ids", eagle.get("eagle_aux_hidden_state_layer_ids"))
        aux: tuple[int, ...] | None = None
        if ids is not None:
            if not isinstance(ids, list):
                raise ConfigError(f"{source}: eagle_aux_hidden_state_layer_ids must be a list of layer indices, got "
                                  f"{_show(ids)}")
            aux = tuple(_integer(i, "eagle_aux_hidden_state_layer_ids", source) for i in ids)
            if aux_convention == "output" or (aux_convention == "auto" and aux and aux[0] == 1):
                aux = tuple(i + 1 for i in aux)
        max_pos = _opt_int(d, "max_position_embeddings", source, 2048)
        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=_opt_int(d, "num_key_value_heads", source, heads),
            head_dim=_opt_int(d, "head_dim", source, hidden // heads),
            intermediate_size=_req_int(d, "intermediate_size", source),
            vocab_size=vocab,
            draft_vocab_size=_opt_int(d, "draft_vocab_size", source, vocab),
            target_hidden_size=_opt_int(d, "target_hidden_size", source, hidden),
            rms_norm_eps=_opt_number(d, "rms_norm_eps", source, 1e-5),
            max_position_embeddings=max_pos,
            rope=parse_rope(d, max_pos, source=source),
            aux_layer_ids=aux,
            norm_before_residual=_opt_bool(d, "norm_before_residual", source, False),
        )

    def resolve_aux_layers(self, target: ModelConfig) -> tuple[int, ...]:
        """Aux layers as HF indices for ``target``, validated to lie in ``0 .. L-1``."""
        n = target.num_hidden_layers
        ids = self.aux_layer_ids if self.aux_layer_ids is not None else (2, n // 2, n - 3)
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise ConfigError(
                f"aux layer ids {list(ids)} (HF hidden_states indices) are out of range for a target with {n} "
                f"layers: valid ids are 0..{n - 1} (index {n} is the post-final-norm output, never an aux state)")
        return tuple(ids)

    def to_hf_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": self.hidden_size, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size, "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
            "tie_word_embeddings": False, "rope_parameters": self.rope.to_hf(),
        }
        if self.target_hidden_size != self.hidden_size:
            d["target_hidden_size"] = self.target_hidden_size
        if self.aux_layer_ids is not None:
            d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)}
        if self.norm_before_residual:
            d["norm_before_residual"] = True
        return d


# ------------------------------------------------------------------------------------------ decoding configs
#: temperatures below this are greedy decoding: :class:`SamplingConfig` stores them as 0
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen from the target distribution.

    Attributes:
        temperature: 0 (default) = greedy; > 0 samples from ``softmax(logits / temperature)``. Temperatures below
            ``GREEDY_TEMPERATURE`` = 1e-5 are greedy: they are stored as 0 (so such configs compare equal to the
            greedy one) and decoding takes the argmax. Sampling at such a temperature picks the argmax anyway
            unless two logits lie within about 1e-4 of each other, and below about 1e-37 ``logits / temperature``
            overflows float32, which made the sampler return token 0.
        top_k: keep the k most likely tokens (0 = off).
        top_p: keep the smallest set of tokens whose probability reaches ``top_p`` (1.0 = off).

    Every field is checked for type and range: a string such as ``top_p="0.9"``, a bool, NaN or infinity is a
    :class:`~diffspec_jax.errors.ConfigError`.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        temperature = check_real(self.temperature, "temperature", min=0.0,
                                 hint=f" (0 = greedy; below {GREEDY_TEMPERATURE:g} counts as greedy)")
        top_k = check_int(self.top_k, "top_k", min=0, hint=" (0 = off)")
        top_p = check_real(self.top_p, "top_p", min=0.0, max=1.0, min_open=True, hint=" (1 = off)")
        object.__setattr__(self, "temperature", 0.0 if temperature < GREEDY_TEMPERATURE else temperature)
        object.__setattr__(self, "top_k", top_k)
        object.__setattr__(self, "top_p", top_p)

    @property
    def greedy(self) -> bool:
        """Greedy decoding (temperature 0, which includes every temperature below ``GREEDY_TEMPERATURE``)."""
        return self.temperature == 0.0


# ------------------------------------------------------------------------------------ speculative decoding
# SpecConfig is built from parts, one per feature: what the draft attends to (``context``: Full, Recent or
# DiffSpec) and how drafts are verified (``verification``: Chain or Tree). Each part checks its own fields where it
# is built; SpecConfig checks the rules that join parts (they all involve K). The seed plugin's flat
# ``speculative_config`` names (``draft_context_policy``, ``diffspec_*``) are read by SpecConfig.from_flat, and
# error messages name every field by that flat key (FLAT_KEYS), which is also what the CLIs' flags map to.

DRAFT_CONTEXT_POLICIES = ("full", "recent", "diffspec")  # (Full.policy, Recent.policy, DiffSpec.policy)
DIFFSPEC_SCORERS = ("attention", "salience")
DRAFT_SAMPLING = ("argmax", "sample")
VERIFICATION_MODES = ("auto", "linear", "tree")
#: kernel implementations of the hot paths (:mod:`pallas_kernels.dispatch`): ``"auto"`` = Pallas on GPUs and the
#: pure-JAX references elsewhere; ``"pallas"`` on a CPU interprets the kernels (slow, for tests)
KERNEL_CHOICES = ("auto", "reference", "pallas")
#: the environment variable that gives :attr:`SpecConfig.kernels` its default, read when a SpecConfig is built
KERNELS_ENV = "DIFFSPEC_KERNELS"
#: how the target's K/V cache is stored (``generate(kv_cache_dtype=...)``, ``EngineConfig.kv_cache_dtype``,
#: ``--kv-cache-dtype``): ``"auto"`` = the model's dtype; ``"fp8"`` = ``float8_e4m3fn`` rows with a float32 scale per
#: (token, KV head) (:mod:`diffspec_jax.kv_quant`): about 1.9x the tokens in the same memory
KV_CACHE_DTYPES = ("auto", "fp8")


def default_kernels(environ: Mapping[str, str] | None = None) -> str:
    """The default of :attr:`SpecConfig.kernels`: ``$DIFFSPEC_KERNELS`` (``reference`` / ``pallas`` / ``auto``) when
    set, else ``"auto"``. Read once per SpecConfig, when it is built (never while a program is traced)."""
    env = os.environ if environ is None else environ
    choice = (env.get(KERNELS_ENV) or "").strip().lower()
    if not choice:
        return "auto"
    if choice not in KERNEL_CHOICES:
        raise ConfigError(f"{KERNELS_ENV} must be one of {KERNEL_CHOICES}, got {choice!r}")
    return choice


def _positive_int(value: Any, name: str) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _choice(choices: tuple[str, ...]) -> Callable[[Any, str], None]:
    def check(value: Any, name: str) -> None:
        if not isinstance(value, str) or value not in choices:
            shown = repr(value) if isinstance(value, str) else _show(value)
            raise ConfigError(f"{name} must be one of {choices}, got {shown}")
    return check


def check_kv_cache_dtype(value: Any, name: str = "kv_cache_dtype") -> str:
    """``value`` if it is one of :data:`KV_CACHE_DTYPES`, else a :class:`ConfigError` naming them."""
    _choice(KV_CACHE_DTYPES)(value, name)
    return value


def _mass_gain(value: Any, name: str) -> None:
    if not (_is_real(value) and 0 <= value <= 1):
        raise ConfigError(f"{name} must be in [0, 1] (a probability mass gain), got {_show(value)}")


def _weight(value: Any, name: str) -> None:
    if not (_is_real(value) and math.isfinite(value) and value >= 0):
        raise ConfigError(f"{name} must be a finite number >= 0, got {_show(value)}")


def _layer_or_none(value: Any, name: str) -> None:
    if value is not None and (not _is_int(value) or value < 0):
        raise ConfigError(f"{name} must be a layer index >= 0 or None, got {_show(value)}")


def _branching(value: Any, name: str) -> None:
    try:
        check_branching(value)
    except ConfigError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def _positive_or_none(value: Any, name: str) -> None:
    if value is not None:
        _positive_int(value, name)


#: every flat (plugin) key -> the check of its value; the one list of what a valid field is
FIELD_CHECKS: dict[str, Callable[[Any, str], None]] = {
    "num_speculative_tokens": _positive_int,
    "draft_context_policy": _choice(DRAFT_CONTEXT_POLICIES),
    "draft_sampling": _choice(DRAFT_SAMPLING),
    "diffspec_chunk_size": _positive_int,
    "diffspec_token_budget": _positive_int,
    "diffspec_retrieval_interval": _positive_or_none,
    "diffspec_keep_sink_chunk": check_bool,
    "diffspec_retrieve_after_prefill": check_bool,
    "diffspec_adaptive_profile": check_bool,
    "diffspec_long_context_threshold": _positive_int,
    "diffspec_long_context_depth": _positive_int,
    "diffspec_verification_mode": _choice(VERIFICATION_MODES),
    "diffspec_max_tree_nodes": _positive_int,
    "diffspec_tree_topk": _positive_int,
    "diffspec_tree_threshold": _mass_gain,
    "diffspec_tree_branching": _branching,
    "diffspec_scorer": _choice(DIFFSPEC_SCORERS),
    "diffspec_redundancy_weight": _weight,
    "diffspec_scoring_layer": _layer_or_none,
    "draft_tensor_parallel_size": _positive_or_none,
    "kernels": _choice(KERNEL_CHOICES),
    "deterministic": check_bool,
    "ngram_min_n": _positive_int,
    "ngram_max_n": _positive_int,
    "ngram_first": check_bool,
}
#: the flat keys :meth:`SpecConfig.from_flat` accepts
FLAT_KEYS = tuple(FIELD_CHECKS)


@dataclass(frozen=True)
class _Part:
    """A frozen part of :class:`SpecConfig`; ``FLAT`` maps each field to its flat key (its check and its name in
    messages)."""

    FLAT: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        for name, key in self.FLAT.items():
            FIELD_CHECKS[key](getattr(self, name), key)

    @classmethod
    def from_flat(cls, d: Mapping[str, Any]) -> _Part:
        """This part from the flat keys of ``d`` (absent keys take the part's defaults)."""
        return cls(**{name: d[key] for name, key in cls.FLAT.items() if key in d})


# --- what the draft attends to (draft_context_policy)
@dataclass(frozen=True)
class _Context(_Part):
    """A draft-context policy (``draft_context_policy``: :class:`Full`, :class:`Recent` or :class:`DiffSpec`).

    Each policy answers for itself what the engine needs of it, so no other module tests its name or type:
    :attr:`working_cache` (the draft reads a fixed-capacity working cache: an EAGLE-3 draft keeps a store of
    entries beside it, self-drafting a working set; else the draft attends to its whole cache), :attr:`retrieves`
    (DiffSpec's chunk scoring and selection run), :attr:`sink` (chunk 0 is always kept), :meth:`history_slots` (the
    capacity rule: the longest history the working cache holds), :meth:`with_sink` and :meth:`check_target`."""

    #: the ``draft_context_policy`` value that selects it
    policy: ClassVar[str] = ""
    #: the draft reads a fixed-capacity working cache (else: its whole cache, at absolute positions)
    working_cache: ClassVar[bool] = False
    #: chunks are scored and selected (DiffSpec's retrieval) for the working cache's anchors
    retrieves: ClassVar[bool] = False
    #: chunk summaries are kept (DiffSpec's salience scorer or redundancy discount)
    needs_summaries: ClassVar[bool] = False

    @property
    def sink(self) -> bool:
        """Chunk 0 is always kept in the working cache."""
        return False

    def history_slots(self, k: int) -> int:
        """The longest history (positions besides the root and K chain entries) the working cache holds (0: no
        working cache)."""
        return 0

    def with_sink(self) -> _Context:
        """This policy with chunk 0 always kept, where it has such a setting (self-drafting's working set always
        holds it)."""
        return self

    def with_default_interval(self, self_draft: bool) -> _Context:
        """This policy with its drafter-dependent defaults filled in (DiffSpec: the retrieval interval)."""
        return self

    def check_target(self, target: ModelConfig) -> None:
        """Check what the policy reads of ``target`` (DiffSpec: its scoring layer); raises ConfigError."""


@dataclass(frozen=True)
class Full(_Context):
    """The draft attends to its whole store (plain EAGLE-3); ``draft_context_policy="full"``."""

    policy: ClassVar[str] = "full"


@dataclass(frozen=True)
class _WorkingCache(_Context):
    """A fixed-capacity working cache of ``token_budget`` positions (B) filled in chunks of ``chunk_size`` (C).

    Attributes:
        token_budget: B, working-cache capacity per sequence [2048] (``diffspec_token_budget``); a multiple of C,
            and the history budget ``Hb = floor((B - K - 1) / C) * C`` must hold at least one chunk (two with
            DiffSpec's sink chunk).
        chunk_size: C, tokens per chunk [64] (``diffspec_chunk_size``).
    """

    token_budget: int = 2048
    chunk_size: int = 64
    FLAT: ClassVar[dict[str, str]] = {"token_budget": "diffspec_token_budget", "chunk_size": "diffspec_chunk_size"}
    working_cache: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.token_budget % self.chunk_size:
            raise ConfigError(f"diffspec_token_budget ({self.token_budget}) must be a multiple of diffspec_chunk_size "
                              f"({self.chunk_size})")

    def history_budget(self, k: int) -> int:
        """Hb = floor((B - K - 1) / C) * C: history tokens that fit beside the root and K chain entries."""
        c = self.chunk_size
        return max(0, (self.token_budget - k - 1) // c * c)


@dataclass(frozen=True)
class Recent(_WorkingCache):
    """A sliding window: the draft attends to the last ``B - K - 1`` positions (``draft_context_policy="recent"``;
    fields of :class:`_WorkingCache`)."""

    policy: ClassVar[str] = "recent"

    def history_slots(self, k: int) -> int:
        """``B - K - 1``: every position of the working cache besides the root and the chain."""
        return self.token_budget - k - 1


#: DiffSpec's retrieval interval when none is given and the target drafts for itself: every cycle. Its working set
#: then follows the chain through the context; at 4 it lags up to three cycles behind (docs/self_drafting.md,
#: "Measurements": every cycle accepted more on all three prompt sets measured)
SELF_DRAFT_INTERVAL = 1
#: ... and for a draft model (an EAGLE-3 draft), whose store is rebuilt per retrieval: every 4 cycles
MODEL_DRAFT_INTERVAL = 4


@dataclass(frozen=True)
class DiffSpec(_WorkingCache):
    """Target-guided chunks + a rolling recent window in the working cache (``draft_context_policy="diffspec"``).

    Attributes (besides ``token_budget`` and ``chunk_size``; flat keys ``diffspec_<name>`` unless noted):
        retrieval_interval: N, verification cycles between retrievals [None: the drafter's default, 1 when the
            target drafts for itself and 4 for a draft model (:meth:`with_default_interval`)].
        keep_sink_chunk: always keep chunk 0 [False].
        retrieve_after_prefill: retrieve once right after prefill [True].
        adaptive: adapt the retrieval interval per sequence (double up to 32 on stable selections) [False]
            (``diffspec_adaptive_profile``).
        scorer: ``"attention"`` (exact target attention probabilities) or ``"salience"`` (chunk key summaries
            scored against the draft's query, no target query needed) [``"attention"``].
        redundancy_weight: discount a chunk by its similarity to chunks already selected [0.0].
        scoring_layer: target layer whose attention scores chunks [None = last full-attention layer].
    """

    retrieval_interval: int | None = None
    keep_sink_chunk: bool = False
    retrieve_after_prefill: bool = True
    adaptive: bool = False
    scorer: str = "attention"
    redundancy_weight: float = 0.0
    scoring_layer: int | None = None
    policy: ClassVar[str] = "diffspec"
    retrieves: ClassVar[bool] = True
    FLAT: ClassVar[dict[str, str]] = {
        **_WorkingCache.FLAT, "retrieval_interval": "diffspec_retrieval_interval",
        "keep_sink_chunk": "diffspec_keep_sink_chunk", "retrieve_after_prefill": "diffspec_retrieve_after_prefill",
        "adaptive": "diffspec_adaptive_profile", "scorer": "diffspec_scorer",
        "redundancy_weight": "diffspec_redundancy_weight", "scoring_layer": "diffspec_scoring_layer"}

    @property
    def needs_summaries(self) -> bool:
        """Chunk key summaries are kept (the salience scorer, or a redundancy discount)."""
        return self.scorer == "salience" or self.redundancy_weight > 0

    @property
    def sink(self) -> bool:
        return self.keep_sink_chunk

    def history_slots(self, k: int) -> int:
        """Hb: whole chunks only (anchors are chunks)."""
        return self.history_budget(k)

    def with_sink(self) -> DiffSpec:
        return dataclasses.replace(self, keep_sink_chunk=True)

    def with_default_interval(self, self_draft: bool) -> DiffSpec:
        """This policy with ``retrieval_interval`` set when it was left at None: :data:`SELF_DRAFT_INTERVAL` for
        self-drafting, :data:`MODEL_DRAFT_INTERVAL` for a draft model."""
        if self.retrieval_interval is not None:
            return self
        return dataclasses.replace(self, retrieval_interval=SELF_DRAFT_INTERVAL if self_draft
                                   else MODEL_DRAFT_INTERVAL)

    def check_target(self, target: ModelConfig) -> None:
        self.layer_for(target)

    def layer_for(self, target: ModelConfig) -> int:
        """The scoring layer for ``target`` (default: its last full-attention layer), checked against it."""
        layer = target.last_full_attention_layer if self.scoring_layer is None else self.scoring_layer
        if layer >= target.num_hidden_layers:
            raise ConfigError(f"diffspec_scoring_layer {layer} is out of range for a target with "
                              f"{target.num_hidden_layers} layers")
        if target.layer_type(layer) != FULL_ATTENTION:
            raise ConfigError(f"diffspec_scoring_layer {layer} is a {target.layer_type(layer)} layer; chunk scores "
                              f"need softmax attention over the whole context: use a full_attention layer "
                              f"{list(target.full_attention_layers)} (default: the last one)")
        return int(layer)


CONTEXTS: dict[str, type[_Context]] = {cls.policy: cls for cls in (Full, Recent, DiffSpec)}


# --- how drafts are verified (diffspec_verification_mode)
@dataclass(frozen=True)
class Chain(_Part):
    """Chain drafting: K tokens per cycle, verified in one block (``diffspec_verification_mode="auto"`` / ``"linear"``).

    Attributes:
        adaptive: adapt the chain depth per sequence [False] (``diffspec_adaptive_profile``): +1 after 4
            well-accepted cycles, -1 after 3 poor ones, never below ``long_context_depth`` from
            ``long_context_threshold`` on.
        long_context_threshold: committed length from which the adaptive depth starts at (and never goes below)
            ``long_context_depth`` [49152] (``diffspec_long_context_threshold``).
        long_context_depth: that depth [2]; ``1 <= it <= K`` when ``adaptive`` (``diffspec_long_context_depth``).
    """

    adaptive: bool = False
    long_context_threshold: int = 49152
    long_context_depth: int = 2
    mode: ClassVar[str] = "linear"
    FLAT: ClassVar[dict[str, str]] = {"adaptive": "diffspec_adaptive_profile",
                                      "long_context_threshold": "diffspec_long_context_threshold",
                                      "long_context_depth": "diffspec_long_context_depth"}


#: most tree nodes a verify block holds besides its root
MAX_TREE_NODES = 255


@dataclass(frozen=True)
class Tree(_Part):
    """Tree drafting with tree verification (``diffspec_verification_mode="tree"``). Trees work with every draft
    context and with sampling (drafts by argmax); the target family must support them (not Qwen3.5's hybrid
    layers).

    Attributes (flat keys ``diffspec_max_tree_nodes``, ``diffspec_tree_<name>``):
        max_nodes: tree nodes verified per cycle besides the root (the static verify block is ``max_nodes + 1``
            tokens; tree depth = K) [50]; ``K <= it <= 255``, and at most the :meth:`pool_size` candidates a tree
            can draft (refused, not clamped: with K = 1 and the default top-k of 8, at most 8).
        topk: frontier width and children per node (EAGLE's ``top_k``) [8]; <= max_nodes.
        threshold: stop expanding deeper levels once a level adds less than this draft probability mass to the
            best-``budget`` node set [0.0 = always expand to depth K].
        branching: children per node at each depth: ``"hazard"`` (learned from where verification stops), or the
            static ``"full"``, ``"chain"``, ``"shallow"``, ``"deep"``, ``"uniform<N>"`` [``"hazard"``]; see
            :mod:`diffspec_jax.adaptive`.
        adaptive: grow the node budget per sequence from ``round4(max_nodes / 1.5)`` to ``max_nodes`` with
            observed pressure, never shrinking [False] (``diffspec_adaptive_profile``).
    """

    max_nodes: int = 50
    topk: int = 8
    threshold: float = 0.0
    branching: str = "hazard"
    adaptive: bool = False
    mode: ClassVar[str] = "tree"
    FLAT: ClassVar[dict[str, str]] = {"max_nodes": "diffspec_max_tree_nodes", "topk": "diffspec_tree_topk",
                                      "threshold": "diffspec_tree_threshold", "branching": "diffspec_tree_branching",
                                      "adaptive": "diffspec_adaptive_profile"}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_nodes > MAX_TREE_NODES:
            raise ConfigError(f"diffspec_max_tree_nodes must be in [num_speculative_tokens, {MAX_TREE_NODES}] in tree "
                              f"mode, got {self.max_nodes}")
        if self.topk > self.max_nodes:
            raise ConfigError(f"diffspec_tree_topk ({self.topk}) must be <= diffspec_max_tree_nodes "
                              f"({self.max_nodes})")

    def pool_size(self, k: int) -> int:
        """Candidates a tree of depth ``k`` can hold: ``topk`` at depth 1, then ``topk`` children of each of the
        ``topk`` frontier nodes per further level (``topk + (k - 1) * topk^2``)."""
        return self.topk + (k - 1) * self.topk * self.topk

    @property
    def host_shaped(self) -> bool:
        """The branching caps or the node budget change between cycles (host controllers decide them)."""
        return self.branching == "hazard" or self.adaptive


# --- prompt lookup (``draft="ngram"``, or first in front of a draft with ``first``)
#: the longest n-gram prompt lookup matches (each size is one pass over the token history per cycle)
MAX_NGRAM = 32


@dataclass(frozen=True)
class NGram(_Part):
    """Prompt-lookup drafting (``generate(target, "ngram", ...)``, ``--draft ngram``): the K tokens that followed
    the most recent earlier occurrence of the sequence's last n tokens, for the largest n in ``min_n..max_n`` that
    has one (:mod:`diffspec_jax.engine.ngram`). K is :attr:`SpecConfig.num_speculative_tokens`.

    Attributes (flat keys ``ngram_<name>``):
        min_n: the shortest suffix matched [1]: 1 proposes after any earlier occurrence of the last token, so a
            copy is picked up from its first token on (a wrong proposal costs a verification that would run anyway).
        max_n: the longest suffix matched [3]: longer matches are preferred, as the likelier continuations; at most
            :data:`MAX_NGRAM`.
        first: with a draft (an EAGLE-3 draft or ``"self"``): propose the prompt-lookup continuation on the rows
            where an n-gram matches and the draft's own proposal on the others [False]; the draft still runs every
            cycle (its state must follow the sequence). Raise ``min_n`` with it, so that weak one-token matches
            leave the rows to the draft.
    """

    min_n: int = 1
    max_n: int = 3
    first: bool = False
    FLAT: ClassVar[dict[str, str]] = {"min_n": "ngram_min_n", "max_n": "ngram_max_n", "first": "ngram_first"}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_n > self.max_n:
            raise ConfigError(f"ngram_min_n ({self.min_n}) must be <= ngram_max_n ({self.max_n})")
        if self.max_n > MAX_NGRAM:
            raise ConfigError(f"ngram_max_n must be <= {MAX_NGRAM} (each n-gram size is one pass over the token "
                              f"history per cycle), got {self.max_n}")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings, by feature.

    Attributes (defaults in brackets; the seed plugin's flat keys, read by :meth:`from_flat`, in parentheses):
        num_speculative_tokens: K, the chain depth drafted per cycle (a tree's depth) [4].
        context: what the draft attends to [:class:`Full`]: :class:`Full` (its whole store, plain EAGLE-3),
            :class:`Recent` (the last ``B - K - 1`` positions) or :class:`DiffSpec` (target-guided chunks + a
            rolling recent window in a fixed-capacity working cache) (``draft_context_policy`` and its fields).
        verification: :class:`Chain` or :class:`Tree` [``Chain()``] (``diffspec_verification_mode`` and its
            fields).
        draft_sampling: how the draft proposes when sampling [``"argmax"``]: ``"argmax"`` (one-hot q, as EAGLE-3
            and vLLM) or ``"sample"`` (drawn from the draft's processed distribution; verification uses that q;
            chains only). Greedy decoding always drafts by argmax.
        draft_tensor_parallel_size: with a mesh, 1 = replicated draft, or the target's tp [None = the target's].
        ngram: prompt lookup's settings [:class:`NGram`] (``ngram_*``): used by ``draft="ngram"``, and with
            ``NGram(first=True)`` in front of a draft.
        kernels: the hot paths' implementation, ``"auto"`` (Pallas on GPUs, the pure-JAX references elsewhere),
            ``"reference"`` or ``"pallas"`` [``$DIFFSPEC_KERNELS``, else ``"auto"``; :func:`default_kernels`].
        deterministic: bit-exact speculation [False]: greedy output identical to the bit to target-only decoding
            run with the same setting, on GPUs too. The target's attention runs its deterministic form (tiles
            and splits at fixed absolute positions, splits merged in order:
            :mod:`pallas_kernels.cache_attention`), target-only decoding runs each step as a block of K + 1
            rows with one real row, so its matrix products have the verify step's shapes, and every program is
            compiled without autotuning (:data:`~diffspec_jax.engine.compile.DETERMINISTIC_COMPILER_OPTIONS`),
            so a product's kernel does not depend on the run or the row count. Chains at a fixed depth
            only (a ConfigError with a tree or adaptive depth). Costs: docs/benchmarks.md, "Bit-exact speculation".

    The properties :attr:`tree`, :attr:`uses_working_cache`, :attr:`history_budget` and :attr:`max_chunks` are
    facts derived from the parts.
    """

    num_speculative_tokens: int = 4
    context: Full | Recent | DiffSpec = Full()
    verification: Chain | Tree = Chain()
    draft_sampling: str = "argmax"
    draft_tensor_parallel_size: int | None = None
    kernels: str = field(default_factory=default_kernels)
    deterministic: bool = False
    ngram: NGram = NGram()

    def __post_init__(self) -> None:
        for key in ("num_speculative_tokens", "draft_sampling", "draft_tensor_parallel_size", "kernels",
                    "deterministic"):
            FIELD_CHECKS[key](getattr(self, key), key)
        if not isinstance(self.context, _Context):
            raise ConfigError(f"context must be Full(), Recent(...) or DiffSpec(...), got {_show(self.context)}")
        if not isinstance(self.verification, (Chain, Tree)):
            raise ConfigError(f"verification must be Chain(...) or Tree(...), got {_show(self.verification)}")
        if not isinstance(self.ngram, NGram):
            raise ConfigError(f"ngram must be NGram(...), got {_show(self.ngram)}")
        k, v = self.num_speculative_tokens, self.verification
        if isinstance(v, Chain) and v.adaptive and v.long_context_depth > k:
            raise ConfigError(f"diffspec_long_context_depth ({v.long_context_depth}) must be <= "
                              f"num_speculative_tokens ({k})")
        if isinstance(v, Tree):
            n, pool = v.max_nodes, v.pool_size(k)
            if n < k:
                raise ConfigError(f"diffspec_max_tree_nodes must be in [num_speculative_tokens ({k}), "
                                  f"{MAX_TREE_NODES}] in tree mode, got {n}")
            if n > pool:
                raise ConfigError(
                    f"diffspec_max_tree_nodes ({n}) exceeds the {pool} candidates a tree of depth "
                    f"num_speculative_tokens={k} and diffspec_tree_topk={v.topk} can draft (topk + (K - 1) * topk^2); "
                    f"lower diffspec_max_tree_nodes to <= {pool}, or raise num_speculative_tokens or "
                    f"diffspec_tree_topk")
            if self.draft_sampling != "argmax":
                raise ConfigError("tree drafting expands each node's top-k children deterministically; "
                                  "draft_sampling='sample' applies to chain mode only")
        if self.deterministic and (isinstance(v, Tree) or v.adaptive):
            raise ConfigError("deterministic covers chains at a fixed depth: a tree block, or a chain whose depth "
                              "adapts, verifies rows in blocks of other shapes than target-only decoding; use "
                              "diffspec_verification_mode 'linear' without diffspec_adaptive_profile")
        if self.uses_working_cache:
            self.check_history_budget(sink=self.context.sink)

    def check_history_budget(self, sink: bool) -> None:
        """Refuse a working cache whose history budget holds less than one chunk (two with a ``sink`` chunk)."""
        c, b, k = self.context.chunk_size, self.context.token_budget, self.num_speculative_tokens
        need = 2 * c if sink else c
        if self.history_budget < need:
            raise ConfigError(
                f"diffspec_token_budget {b} is too small for num_speculative_tokens {k} and chunk size {c}: the "
                f"history budget floor((B - K - 1) / C) * C = {self.history_budget} must be >= {need}")

    @classmethod
    def from_flat(cls, d: Mapping[str, Any]) -> SpecConfig:
        """A SpecConfig from the seed plugin's flat ``speculative_config`` keys (:data:`FLAT_KEYS`:
        ``num_speculative_tokens``, ``draft_context_policy``, ``draft_sampling``, ``diffspec_*``,
        ``draft_tensor_parallel_size``, ``kernels`` and ``ngram_*``). Absent keys take the defaults; every given value is
        checked, also those the chosen policy and verification mode do not use; ``diffspec_adaptive_profile``
        switches on every adaptive part (retrieval interval, chain depth, tree node budget); the verification
        modes ``"auto"`` and ``"linear"`` are both :class:`Chain`. An unknown key is a ConfigError."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"a flat speculative config must be a dict, got {_show(d)}")
        unknown = sorted(str(key) for key in d if key not in FIELD_CHECKS)
        if unknown:
            raise ConfigError(f"unknown speculative config key(s) {unknown}; known keys: {', '.join(FLAT_KEYS)}")
        for key, value in d.items():
            FIELD_CHECKS[key](value, key)
        context = CONTEXTS[d.get("draft_context_policy", Full.policy)].from_flat(d)
        verification = (Tree if d.get("diffspec_verification_mode") == Tree.mode else Chain).from_flat(d)
        top = {key: d[key] for key in ("num_speculative_tokens", "draft_sampling", "draft_tensor_parallel_size",
                                       "kernels", "deterministic") if key in d}
        return cls(context=context, verification=verification, ngram=NGram.from_flat(d), **top)

    def replace(self, **changes: Any) -> SpecConfig:
        return dataclasses.replace(self, **changes)

    def with_default_interval(self, self_draft: bool) -> SpecConfig:
        """This config with the drafter-dependent defaults of its draft context filled in (``self_draft``: the
        target drafts for itself); the engine, the server and the torch bridge run only such configs."""
        return self.replace(context=self.context.with_default_interval(self_draft))

    @property
    def tree(self) -> bool:
        """Tree drafting and verification (``verification`` is a :class:`Tree`)."""
        return isinstance(self.verification, Tree)

    @property
    def uses_working_cache(self) -> bool:
        """The draft reads a fixed-capacity working cache (:class:`Recent` and :class:`DiffSpec`)."""
        return self.context.working_cache

    @property
    def history_budget(self) -> int:
        """Hb = floor((B - K - 1) / C) * C of the working cache (0 with :class:`Full`)."""
        return self.context.history_budget(self.num_speculative_tokens) if self.uses_working_cache else 0

    @property
    def max_chunks(self) -> int:
        """Nmax = Hb / C chunk slots of the working cache (0 with :class:`Full`)."""
        return self.history_budget // self.context.chunk_size if self.uses_working_cache else 0
