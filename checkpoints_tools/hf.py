"""Hugging Face safetensors checkpoints <-> params pytrees.

Reads ``model.safetensors`` or a sharded ``model.safetensors.index.json`` (its ``weight_map`` names the shard
of every tensor), checks every tensor's shape against the config, converts PyTorch ``[out, in]`` linears to
JAX ``[in, out]`` with explicit head axes (layout in :mod:`diffspec_jax.models.llama`), and writes the inverse.
Tensors are read one at a time, so peak host memory is about one tensor above the params themselves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from diffspec_jax.config import ModelConfig
from diffspec_jax.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: tensors some checkpoints carry that no forward pass needs
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}


def check_dir(path: str | Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {path} is not a directory")
    return path


class WeightReader:
    """Lazy access to the tensors of a safetensors checkpoint directory (single file or sharded).

    Use as a context manager; ``keys()``, ``shape(name)``, ``dtype(name)`` read headers only, ``get(name)``
    loads one tensor as a NumPy array.
    """

    def __init__(self, path: str | Path, *, single_file: str = SINGLE_FILE, index_file: str = INDEX_FILE):
        self.path = check_dir(path)
        index = self.path / index_file
        single = self.path / single_file
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"{index}: not a safetensors index with a weight_map ({exc})") from exc
            self._file_of = {k: self.path / f for k, f in weight_map.items()}
            for f in sorted(set(self._file_of.values())):
                if not f.exists():
                    raise CheckpointError(f"{index} names shard {f.name}, which does not exist in {self.path}")
        elif single.exists():
            self._file_of = None
            self._single = single
        else:
            bins = sorted(p.name for p in self.path.glob("*.bin"))
            hint = (f"; found PyTorch weights {bins}: convert them once with "
                    f"`python -m checkpoints_tools.convert --bin-to-safetensors {self.path}`") if bins else ""
            raise CheckpointError(f"no {single_file} or {index_file} in {self.path}{hint}")
        self._handles: dict[Path, Any] = {}
        if self._file_of is None:
            self._file_of = {k: single for k in self._handle(single).keys()}

    def _handle(self, file: Path):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="numpy")
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"cannot read safetensors file {file}: {exc}") from exc
        return self._handles[file]

    def __enter__(self) -> WeightReader:
        return self

    def __exit__(self, *exc) -> None:
        self._handles.clear()

    def keys(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def files(self) -> list[Path]:
        return sorted(set(self._file_of.values()))

    def _slice(self, name: str):
        if name not in self._file_of:
            raise CheckpointError(f"tensor {name!r} is missing from {self.path}")
        return self._handle(self._file_of[name]).get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        return self._slice(name).get_dtype()

    def get(self, name: str) -> np.ndarray:
        return self._handle(self._file_of[name]).get_tensor(name)


# ----------------------------------------------------------------------------------------------- mappings
@dataclass(frozen=True)
class TensorMap:
    """How one HF tensor maps onto one params leaf.

    Attributes:
        path: location in the params pytree, e.g. ``("layers", 3, "wq")``.
        hf_shape: shape on disk.
        to_jax, to_hf: NumPy transforms between the disk layout and the params layout.
    """

    path: tuple[Any, ...]
    hf_shape: tuple[int, ...]
    to_jax: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


def copy_map(path, shape) -> TensorMap:
    return TensorMap(path, tuple(shape), lambda a: a, lambda a: a)


def linear_map(path, out_dim: int, in_dim: int, jax_shape: tuple[int, ...] | None = None) -> TensorMap:
    """A PyTorch ``Linear`` weight ``[out, in]`` stored as ``[in, out]``, optionally reshaped (head axes)."""
    jax_shape = jax_shape or (in_dim, out_dim)
    return TensorMap(path, (out_dim, in_dim), lambda a: a.T.reshape(jax_shape),
                     lambda a: a.reshape(in_dim, out_dim).T)


def llama_tensor_maps(config: ModelConfig, prefix: str = "model.") -> dict[str, TensorMap]:
    """HF key -> :class:`TensorMap` for Llama / Qwen3 (``prefix`` is the decoder's key prefix)."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    maps = {f"{prefix}embed_tokens.weight": copy_map(("embed",), (config.vocab_size, h)),
            f"{prefix}norm.weight": copy_map(("final_norm",), (h,))}
    if not config.tie_word_embeddings:
        maps["lm_head.weight"] = linear_map(("lm_head",), config.vocab_size, h)
    for n in range(config.num_hidden_layers):
        p = f"{prefix}layers.{n}."
        maps.update({
            f"{p}input_layernorm.weight": copy_map(("layers", n, "attn_norm"), (h,)),
            f"{p}post_attention_layernorm.weight": copy_map(("layers", n, "mlp_norm"), (h,)),
            f"{p}self_attn.q_proj.weight": linear_map(("layers", n, "wq"), hq * d, h, (h, hq, d)),
            f"{p}self_attn.k_proj.weight": linear_map(("layers", n, "wk"), hkv * d, h, (h, hkv, d)),
            f"{p}self_attn.v_proj.weight": linear_map(("layers", n, "wv"), hkv * d, h, (h, hkv, d)),
            f"{p}self_attn.o_proj.weight": linear_map(("layers", n, "wo"), h, hq * d, (hq, d, h)),
            f"{p}mlp.gate_proj.weight": linear_map(("layers", n, "w_gate"), i, h),
            f"{p}mlp.up_proj.weight": linear_map(("layers", n, "w_up"), i, h),
            f"{p}mlp.down_proj.weight": linear_map(("layers", n, "w_down"), h, i),
        })
        if config.qk_norm:
            maps[f"{p}self_attn.q_norm.weight"] = copy_map(("layers", n, "q_norm"), (d,))
            maps[f"{p}self_attn.k_norm.weight"] = copy_map(("layers", n, "k_norm"), (d,))
    return maps


def _set_path(tree: dict, path: tuple, value) -> None:
    node = tree
    for key, nxt in zip(path[:-1], path[1:]):
        if isinstance(key, int):
            while len(node) <= key:
                node.append({} if not isinstance(nxt, int) else [])
            node = node[key]
        else:
            node = node.setdefault(key, [] if isinstance(nxt, int) else {})
    node[path[-1]] = value


def _get_path(tree, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def read_tensors(reader: WeightReader, maps: dict[str, TensorMap], dtype, *,
                 optional: tuple[str, ...] = (), ignore: Callable[[str], bool] = lambda k: False) -> dict:
    """Load every mapped tensor, checking presence, float dtype and shape; refuse unknown tensors.

    Args:
        optional: HF keys that may be absent (left out of the result).
        ignore: predicate for present tensors that are deliberately unused.
    Returns:
        the params pytree (``jnp`` arrays of ``dtype``).
    """
    present = set(reader.keys())
    missing = [k for k in maps if k not in present and k not in optional]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{reader.path}: missing tensors {missing[:5]}{more}")
    unexpected = [k for k in present - set(maps) if not k.endswith(IGNORED_SUFFIXES) and not ignore(k)]
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise CheckpointError(
            f"{reader.path}: unexpected tensors {sorted(unexpected)[:5]}{more}; the checkpoint does not match "
            f"its config.json (wrong architecture, biases or quantized weights?)")
    params: dict = {}
    for key, m in maps.items():
        if key not in present:
            continue
        disk_dtype = reader.dtype(key)
        if disk_dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{reader.path}: tensor {key!r} has dtype {disk_dtype}; quantized or integer "
                                  f"weights are not supported")
        shape = reader.shape(key)
        if shape != m.hf_shape:
            raise CheckpointError(f"{reader.path}: tensor {key!r} has shape {list(shape)}, but config.json implies "
                                  f"{list(m.hf_shape)}")
        _set_path(params, m.path, jnp.asarray(m.to_jax(reader.get(key)), dtype=dtype))
    return params


def load_hf_params(path: str | Path, config: ModelConfig, dtype=jnp.bfloat16) -> dict:
    """Params pytree of a Llama / Qwen3 HF checkpoint directory, shapes checked against ``config``."""
    with WeightReader(path) as reader:
        tied = config.tie_word_embeddings
        return read_tensors(reader, llama_tensor_maps(config), dtype,
                            ignore=lambda k: tied and k == "lm_head.weight")


def export_tensors(params: dict, maps: dict[str, TensorMap], dtype=None) -> dict[str, np.ndarray]:
    """The inverse of :func:`read_tensors`: HF key -> NumPy array in the disk layout."""
    out = {}
    for key, m in maps.items():
        arr = np.asarray(jax.device_get(_get_path(params, m.path)))
        if dtype is not None:
            arr = arr.astype(dtype)
        out[key] = np.ascontiguousarray(m.to_hf(arr))
    return out


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], *, max_shard_bytes: int | None = None,
                      metadata: dict[str, str] | None = None) -> list[Path]:
    """Write ``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` + index when they exceed
    ``max_shard_bytes``. Returns the files written."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", **(metadata or {})}
    total = sum(a.nbytes for a in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(tensors, str(path / SINGLE_FILE), metadata=metadata)
        return [path / SINGLE_FILE]
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for key, arr in tensors.items():
        if shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = arr
        size += arr.nbytes
    files, weight_map = [], {}
    for n, shard in enumerate(shards, 1):
        name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name), metadata=metadata)
        files.append(path / name)
        weight_map.update({k: name for k in shard})
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return files


def save_hf(path: str | Path, config: ModelConfig, params: dict, *, dtype: str | None = None,
            max_shard_bytes: int | None = None) -> Path:
    """Write a Hugging Face directory (``config.json`` + safetensors) that ``transformers`` loads as is."""
    path = Path(path)
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16, None: None}[dtype]
    write_safetensors(path, export_tensors(params, llama_tensor_maps(config), np_dtype),
                      max_shard_bytes=max_shard_bytes)
    cfg = config.to_hf_dict()
    if dtype:
        cfg["dtype"] = dtype
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return path


def iter_weight_files(path: str | Path) -> Iterator[Path]:
    """Every weight file of a checkpoint directory (safetensors shards, single file, or .bin)."""
    path = check_dir(path)
    yield from sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin"))


# ------------------------------------------------------------------------------------------- EAGLE-3 drafts
DRAFT_LAYER_PREFIXES = ("midlayer.", "layers.0.")


def eagle3_tensor_maps(config, num_aux: int, layer_prefix: str = "midlayer.", own_embedding: bool = False
                       ) -> dict[str, TensorMap]:
    """HF key -> :class:`TensorMap` for a SpecForge / vLLM EAGLE-3 draft (``d2t``/``t2d`` handled separately)."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    p = layer_prefix
    maps = {
        "fc.weight": linear_map(("fc",), h, num_aux * config.target_hidden_size),
        f"{p}hidden_norm.weight": copy_map(("hidden_norm",), (h,)),
        f"{p}input_layernorm.weight": copy_map(("input_norm",), (h,)),
        f"{p}self_attn.q_proj.weight": linear_map(("wq",), hq * d, 2 * h, (2 * h, hq, d)),
        f"{p}self_attn.k_proj.weight": linear_map(("wk",), hkv * d, 2 * h, (2 * h, hkv, d)),
        f"{p}self_attn.v_proj.weight": linear_map(("wv",), hkv * d, 2 * h, (2 * h, hkv, d)),
        f"{p}self_attn.o_proj.weight": linear_map(("wo",), h, hq * d, (hq, d, h)),
        f"{p}post_attention_layernorm.weight": copy_map(("mlp_norm",), (h,)),
        f"{p}mlp.gate_proj.weight": linear_map(("w_gate",), i, h),
        f"{p}mlp.up_proj.weight": linear_map(("w_up",), i, h),
        f"{p}mlp.down_proj.weight": linear_map(("w_down",), h, i),
        "norm.weight": copy_map(("final_norm",), (h,)),
        "lm_head.weight": linear_map(("lm_head",), config.draft_vocab_size, h),
    }
    if own_embedding:
        maps["embed_tokens.weight"] = copy_map(("embed",), (config.vocab_size, h))
    return maps


def save_eagle3(path: str | Path, config, params: dict, *, num_aux: int = 3, dtype: str | None = None,
                own_embedding: bool = False) -> Path:
    """Write a draft in the SpecForge/vLLM layout: ``config.json`` + ``model.safetensors`` with ``d2t``/``t2d``
    (both omitted when the vocabularies are equal, as EAGLE does)."""
    path = Path(path)
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16, None: None}[dtype]
    tensors = export_tensors(params, eagle3_tensor_maps(config, num_aux, own_embedding=own_embedding), np_dtype)
    if config.draft_vocab_size != config.vocab_size:
        d2t = np.asarray(jax.device_get(params["d2t"]), np.int64)
        t2d = np.zeros(config.vocab_size, bool)
        t2d[d2t + np.arange(len(d2t))] = True
        tensors.update(d2t=d2t, t2d=t2d)
    write_safetensors(path, tensors)
    cfg = config.to_hf_dict()
    if dtype:
        cfg["torch_dtype"] = dtype
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return path
