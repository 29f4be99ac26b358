"""Frozen, validated configuration dataclasses.

:class:`ModelConfig` is parsed from a Hugging Face ``config.json`` in either dialect:

* transformers v5: ``rope_parameters = {rope_theta, rope_type, factor, ...}`` and ``dtype``;
* transformers v4 (most Hub checkpoints): top-level ``rope_theta`` + ``rope_scaling`` (key ``rope_type``, or
  ``type`` in very old files) and ``torch_dtype``.

Supported targets: ``LlamaForCausalLM`` (Llama-3.x) and ``Qwen3ForCausalLM``; RoPE types ``default`` and
``llama3``. Anything else (another architecture, RoPE type, multi-head latent attention, quantized weights,
attention biases, sliding windows) is refused with an :class:`~diffspec_jax.errors.UnsupportedModelError`
that names it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from diffspec_jax.errors import ConfigError, UnsupportedModelError

#: architecture name -> (model_type, has per-head q/k norm)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "LlamaForCausalLM": ("llama", False),
    "Qwen3ForCausalLM": ("qwen3", True),
}
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
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope type {self.rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if not self.theta > 0:
            raise ConfigError(f"rope_theta must be > 0, got {self.theta}")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
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


def parse_rope(d: dict[str, Any], max_position_embeddings: int, *, default_theta: float = 10000.0) -> RopeConfig:
    """Build a :class:`RopeConfig` from a config dict in either the v5 or the v4 dialect."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        # v5 models with several attention types nest one dict per layer type.
        if set(params) != {"full_attention"}:
            raise UnsupportedModelError(f"per-layer-type rope_parameters {sorted(params)} are not supported")
        params = params["full_attention"]
    if not isinstance(params, dict) or not params:
        params = dict(d.get("rope_scaling") or {})
        if "rope_theta" in d and d["rope_theta"] is not None:
            params.setdefault("rope_theta", d["rope_theta"])
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    theta = params.get("rope_theta", d.get("rope_theta"))
    theta = default_theta if theta is None else float(theta)
    partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) or 1.0
    kwargs: dict[str, Any] = dict(theta=theta, rope_type=rope_type, partial_rotary_factor=float(partial))
    if rope_type == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            if key not in params:
                raise ConfigError(f"llama3 rope parameters lack {key!r}")
            kwargs[key] = float(params[key])
        kwargs["original_max_position_embeddings"] = int(
            params.get("original_max_position_embeddings") or max_position_embeddings
        )
    return RopeConfig(**kwargs)


def _require(d: dict[str, Any], key: str, where: str) -> Any:
    if d.get(key) is None:
        raise ConfigError(f"{where}: required key {key!r} is missing")
    return d[key]


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only target model (Llama-3.x or Qwen3), as read from ``config.json``.

    The dataclass is hashable, so it can be a static argument of ``jax.jit``.
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

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.architecture!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        self.rope.rotary_dim(self.head_dim)

    @property
    def model_type(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture][0]

    @property
    def qk_norm(self) -> bool:
        """Qwen3 applies a per-head RMSNorm to q and k before RoPE."""
        return SUPPORTED_ARCHITECTURES[self.architecture][1]

    @property
    def num_query_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def last_full_attention_layer(self) -> int:
        """The layer whose attention covers the whole context (DiffSpec's default scoring layer)."""
        return self.num_hidden_layers - 1

    @property
    def num_parameters(self) -> int:
        h, i, v, d = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        attn = h * d * (self.num_attention_heads * 2 + self.num_key_value_heads * 2)
        per_layer = attn + 3 * h * i + 2 * h + (2 * d if self.qk_norm else 0)
        return v * h * (1 if self.tie_word_embeddings else 2) + h + self.num_hidden_layers * per_layer

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Parse a Hugging Face config dict (either dialect); refuse unsupported features by name."""
        if "text_config" in d and "hidden_size" not in d:
            raise UnsupportedModelError(
                f"{source}: multimodal wrapper configs (text_config) are not supported for this architecture"
            )
        archs = d.get("architectures") or []
        if archs:
            arch = archs[0]
        else:
            by_type = {mt: a for a, (mt, _) in SUPPORTED_ARCHITECTURES.items()}
            arch = by_type.get(d.get("model_type", ""), f"<model_type {d.get('model_type')!r}>")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{source}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        if d.get("quantization_config"):
            method = d["quantization_config"].get("quant_method", "unknown") if isinstance(
                d["quantization_config"], dict) else "unknown"
            raise UnsupportedModelError(f"{source}: quantized checkpoints are not supported (quant_method {method!r})")
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
        layer_types = d.get("layer_types")
        if layer_types and any(t != "full_attention" for t in layer_types):
            raise UnsupportedModelError(
                f"{source}: layer types {sorted(set(layer_types) - {'full_attention'})} are not supported"
            )
        if d.get("pretraining_tp", 1) not in (1, None):
            raise UnsupportedModelError(f"{source}: pretraining_tp={d['pretraining_tp']} is not supported")

        hidden = int(_require(d, "hidden_size", source))
        heads = int(_require(d, "num_attention_heads", source))
        max_pos = int(d.get("max_position_embeddings") or 8192)
        head_dim = d.get("head_dim") or (hidden // heads)
        eos = d.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
        return cls(
            architecture=arch,
            vocab_size=int(_require(d, "vocab_size", source)),
            hidden_size=hidden,
            intermediate_size=int(_require(d, "intermediate_size", source)),
            num_hidden_layers=int(_require(d, "num_hidden_layers", source)),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6 if arch == "Qwen3ForCausalLM" else 1e-5)),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            rope=parse_rope(d, max_pos),
            dtype=d.get("dtype") or d.get("torch_dtype"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read ``path/config.json`` (or ``path`` itself when it is the file)."""
        path = Path(path)
        file = path if path.is_file() else path / "config.json"
        if not file.exists():
            from diffspec_jax.errors import CheckpointError

            raise CheckpointError(f"no config.json found at {file}")
        try:
            data = json.loads(file.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{file}: not valid JSON ({exc})") from exc
        return cls.from_dict(data, source=str(file))

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers-v5 ``config.json`` dict that :meth:`from_dict` (and transformers) read back."""
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_parameters": self.rope.to_hf(),
            "attention_bias": False,
        }
        if self.model_type == "llama":
            d["mlp_bias"] = False
        if self.dtype:
            d["dtype"] = self.dtype
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            d["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        return d

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)
