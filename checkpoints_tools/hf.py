"""Hugging Face safetensors checkpoints <-> params pytrees.

Reads ``model.safetensors`` or a sharded ``model.safetensors.index.json`` (its ``weight_map`` names the shard
of every tensor), checks every tensor's shape against the config, converts PyTorch ``[out, in]`` linears to
JAX ``[in, out]`` with explicit head axes (layouts in :mod:`diffspec_jax.models.llama` and
:mod:`diffspec_jax.models.qwen35`), and writes the inverse. Tensors are read one at a time, so peak host memory
is about one tensor above the params themselves.

Qwen3.5-MoE checkpoints: the decoder sits under ``model.language_model.`` (``Qwen3_5MoeForConditionalGeneration``;
``model.visual.*`` and ``mtp.*`` are ignored) or ``model.`` (``Qwen3_5MoeForCausalLM``), detected from the keys;
experts are read in either on-disk layout: fused ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows first) and
``mlp.experts.down_proj`` ``[E, H, I]`` without a ``.weight`` suffix, or per expert
``mlp.experts.{j}.{gate,up,down}_proj.weight`` (:class:`FusedExpertsView` presents the latter as the former).
"""

from __future__ import annotations

import json
import re
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
from diffspec_jax.errors import CheckpointError, PathNotFoundError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: tensors some checkpoints carry that no forward pass needs
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}


def check_dir(path: str | Path) -> Path:
    """``path`` as a ``Path``; :class:`PathNotFoundError` when it does not exist or is not a directory."""
    if not isinstance(path, (str, Path)):
        raise PathNotFoundError(f"a checkpoint path must be a str or pathlib.Path, got {type(path).__name__}")
    path = Path(path)
    if not path.exists():
        raise PathNotFoundError(f"checkpoint directory {path} does not exist")
    if not path.is_dir():
        raise PathNotFoundError(f"checkpoint path {path} is not a directory")
    return path


def _damaged(file: Path, exc: BaseException, tensor: str | None = None) -> CheckpointError:
    what = f"tensor {tensor!r} of " if tensor else ""
    return CheckpointError(f"cannot read {what}safetensors file {file}: {exc}; the file is damaged or incomplete "
                           f"(re-download or re-create it)")


class WeightReader:
    """Lazy access to the tensors of a safetensors checkpoint directory (single file or sharded).

    Use as a context manager; ``keys()``, ``shape(name)``, ``dtype(name)`` read headers only, ``get(name)``
    loads one tensor as a NumPy array. Every read error of the safetensors library is a :class:`CheckpointError`
    naming the file (and tensor), and a sharded index that names a tensor its shard does not hold is refused when
    the reader opens.
    """

    def __init__(self, path: str | Path, *, single_file: str = SINGLE_FILE, index_file: str = INDEX_FILE):
        self.path = check_dir(path)
        index = self.path / index_file
        single = self.path / single_file
        self._handles: dict[Path, Any] = {}
        if index.exists():
            self._file_of = self._read_index(index)
            for f in sorted(set(self._file_of.values())):
                if not f.is_file():
                    raise CheckpointError(f"{index} names shard {f.name}, which does not exist in {self.path}")
            self._check_shards(index)
        elif single.exists():
            self._file_of = None
            self._single = single
        else:
            bins = sorted(p.name for p in self.path.glob("*.bin"))
            hint = (f"; found PyTorch weights {bins}: convert them once with "
                    f"`python -m checkpoints_tools.convert --bin-to-safetensors {self.path}`") if bins else ""
            raise CheckpointError(f"no {single_file} or {index_file} in {self.path}{hint}")
        if self._file_of is None:
            self._file_of = {k: single for k in self._keys_of(single)}

    def _read_index(self, index: Path) -> dict[str, Path]:
        try:
            data = json.loads(index.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, OSError) as exc:
            raise CheckpointError(f"{index}: not a readable safetensors index ({exc}); the file is damaged "
                                  f"(re-download it)") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: not a safetensors index (it needs a non-empty \"weight_map\" object "
                                  f"of tensor name -> shard file)")
        out = {}
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or not shard or Path(shard).name != shard:
                raise CheckpointError(f"{index}: tensor {name!r} maps to {shard!r}, not a shard file name in "
                                      f"{self.path}")
            out[name] = self.path / shard
        return out

    def _check_shards(self, index: Path) -> None:
        """Each shard holds the tensors the index names for it (a damaged name in a shard header is caught here,
        not as a raw safetensors error later)."""
        by_file: dict[Path, set[str]] = {}
        for name, f in self._file_of.items():
            by_file.setdefault(f, set()).add(name)
        for f, names in sorted(by_file.items()):
            held = set(self._keys_of(f))
            missing = sorted(names - held)
            if missing:
                extra = sorted(held - set(self._file_of))
                more = f"; the shard holds names the index does not know: {extra[:3]}" if extra else ""
                raise CheckpointError(
                    f"{index} maps tensors {missing[:3]}{' ...' if len(missing) > 3 else ''} to shard {f.name}, "
                    f"which does not contain them{more} (a damaged shard header or index: re-download them)")

    def _handle(self, file: Path):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="numpy")
            except Exception as exc:  # safetensors raises its own error types
                raise _damaged(file, exc) from exc
        return self._handles[file]

    def _keys_of(self, file: Path) -> list[str]:
        try:
            return list(self._handle(file).keys())
        except CheckpointError:
            raise
        except Exception as exc:
            raise _damaged(file, exc) from exc

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
        file = self._file_of[name]
        try:
            return self._handle(file).get_slice(name)
        except CheckpointError:
            raise
        except Exception as exc:
            raise _damaged(file, exc, name) from exc

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        return self._slice(name).get_dtype()

    def get(self, name: str) -> np.ndarray:
        if name not in self._file_of:
            raise CheckpointError(f"tensor {name!r} is missing from {self.path}")
        file = self._file_of[name]
        try:
            return self._handle(file).get_tensor(name)
        except CheckpointError:
            raise
        except Exception as exc:
            raise _damaged(file, exc, name) from exc


# ----------------------------------------------------------------------------------------------- mappings
@dataclass(frozen=True)
class TensorMap:
    """How one HF tensor maps onto one params leaf.

    Attributes:
        path: location in the params pytree, e.g. ``("layers", 3, "wq")`` (a tuple of locations when ``split``: one
            HF tensor feeding several leaves, e.g. Qwen3.5's ``q_proj`` -> query and gate).
        hf_shape: shape on disk.
        to_jax, to_hf: NumPy transforms between the disk layout and the params layout.
    """

    path: tuple[Any, ...]
    hf_shape: tuple[int, ...]
    to_jax: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    split: bool = False  # path is a tuple of leaf paths; to_jax returns (and to_hf takes) one array per leaf


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
        value = m.to_jax(reader.get(key))
        for p, arr in (zip(m.path, value) if m.split else ((m.path, value),)):
            _set_path(params, p, jnp.asarray(arr, dtype=dtype))
    return params


def load_hf_params(path: str | Path, config: ModelConfig, dtype=jnp.bfloat16) -> dict:
    """Params pytree of a Llama / Qwen3 / Qwen3.5-MoE HF checkpoint directory, shapes checked against ``config``."""
    if config.is_hybrid:
        return load_qwen35_params(path, config, dtype)
    with WeightReader(path) as reader:
        tied = config.tie_word_embeddings
        return read_tensors(reader, llama_tensor_maps(config), dtype,
                            ignore=lambda k: tied and k == "lm_head.weight")


def target_tensor_maps(config: ModelConfig) -> dict[str, TensorMap]:
    """The HF key -> :class:`TensorMap` table of a target (any supported family, default key prefix)."""
    return qwen35_tensor_maps(config, config.weight_prefix) if config.is_hybrid else llama_tensor_maps(config)


def hf_names(maps: dict[str, TensorMap]) -> dict[tuple, str]:
    """params leaf path (a tuple such as ``("layers", 3, "wq")``) -> the HF tensor it is read from."""
    out = {}
    for key, m in maps.items():
        for path in (m.path if m.split else (m.path,)):
            out[tuple(path)] = key
    return out


def export_tensors(params: dict, maps: dict[str, TensorMap], dtype=None) -> dict[str, np.ndarray]:
    """The inverse of :func:`read_tensors`: HF key -> NumPy array in the disk layout."""
    out = {}

    def leaf(p):
        arr = np.asarray(jax.device_get(_get_path(params, p)))
        return arr.astype(dtype) if dtype is not None else arr

    for key, m in maps.items():
        arr = tuple(leaf(p) for p in m.path) if m.split else leaf(m.path)
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
            max_shard_bytes: int | None = None, expert_layout: str = "fused") -> Path:
    """Write a Hugging Face directory (``config.json`` + safetensors) that ``transformers`` loads as is.

    ``params`` may be in the checkpoint or the fused serving layout (:func:`diffspec_jax.models.llama.
    fuse_projections`); the files hold the checkpoint layout either way.

    ``expert_layout`` (Qwen3.5-MoE only): ``"fused"`` (``experts.gate_up_proj`` / ``experts.down_proj``, the
    official layout) or ``"per_expert"`` (``experts.{j}.{gate,up,down}_proj.weight``, what ``save_pretrained``
    writes). A ``Qwen3_5MoeForConditionalGeneration`` is written with its text part only (no vision tower).
    """
    path = Path(path)
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16, None: None}[dtype]
    if config.is_hybrid:
        tensors = export_tensors(params, qwen35_tensor_maps(config), np_dtype)
        if expert_layout == "per_expert":
            tensors = split_experts(tensors)
        elif expert_layout != "fused":
            raise ValueError(f"expert_layout must be 'fused' or 'per_expert', got {expert_layout!r}")
    else:
        from diffspec_jax.models.llama import split_projections

        tensors = export_tensors(split_projections(config, params), llama_tensor_maps(config), np_dtype)
    write_safetensors(path, tensors, max_shard_bytes=max_shard_bytes)
    cfg = config.to_hf_dict()
    if dtype:
        cfg["dtype"] = dtype
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return path


# --------------------------------------------------------------------------------------------- Qwen3.5-MoE
def _split_map(paths, hf_shape, to_jax, to_hf) -> TensorMap:
    return TensorMap(tuple(paths), tuple(hf_shape), to_jax, to_hf, split=True)


def qwen35_tensor_maps(config: ModelConfig, prefix: str | None = None) -> dict[str, TensorMap]:
    """HF key -> :class:`TensorMap` for Qwen3.5-MoE in the fused expert layout (layout in
    :mod:`diffspec_jax.models.qwen35`; ``prefix`` defaults to the architecture's decoder prefix)."""
    prefix = config.weight_prefix if prefix is None else prefix
    h, d, v = config.hidden_size, config.head_dim, config.vocab_size
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv, w = config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim
    kd, vd = hk * dk, hv * dv
    e, i, s = config.num_experts, config.intermediate_size, config.shared_expert_intermediate_size
    maps = {f"{prefix}embed_tokens.weight": copy_map(("embed",), (v, h)),
            f"{prefix}norm.weight": copy_map(("final_norm",), (h,))}
    if not config.tie_word_embeddings:
        maps["lm_head.weight"] = linear_map(("lm_head",), v, h)

    def split_channels(a: np.ndarray, lead: int):  # [lead, 2kd + vd] -> q [lead, hk, dk], k, v [lead, hv, dv]
        return (a[:, :kd].reshape(lead, hk, dk), a[:, kd:2 * kd].reshape(lead, hk, dk),
                a[:, 2 * kd:].reshape(lead, hv, dv))

    def join_channels(parts, lead: int):
        return np.concatenate([x.reshape(lead, -1) for x in parts], axis=1)

    for n in range(config.num_hidden_layers):
        p, lay = f"{prefix}layers.{n}.", ("layers", n)
        maps[f"{p}input_layernorm.weight"] = copy_map(lay + ("attn_norm",), (h,))
        maps[f"{p}post_attention_layernorm.weight"] = copy_map(lay + ("mlp_norm",), (h,))
        if config.layer_type(n) == "full_attention":
            a = f"{p}self_attn."
            maps[f"{a}q_proj.weight"] = _split_map(  # per-head interleaved [query | gate] of 2 * head_dim rows
                (lay + ("wq",), lay + ("wg",)), (hq * 2 * d, h),
                lambda x: tuple(np.moveaxis(x.T.reshape(h, hq, 2, d), 2, 0)),
                lambda qg: np.stack(qg, axis=2).reshape(h, hq * 2 * d).T)
            maps.update({
                f"{a}k_proj.weight": linear_map(lay + ("wk",), hkv * d, h, (h, hkv, d)),
                f"{a}v_proj.weight": linear_map(lay + ("wv",), hkv * d, h, (h, hkv, d)),
                f"{a}o_proj.weight": linear_map(lay + ("wo",), h, hq * d, (hq, d, h)),
                f"{a}q_norm.weight": copy_map(lay + ("q_norm",), (d,)),
                f"{a}k_norm.weight": copy_map(lay + ("k_norm",), (d,)),
            })
        else:
            a = f"{p}linear_attn."
            maps[f"{a}in_proj_qkv.weight"] = _split_map(
                (lay + ("lin_wq",), lay + ("lin_wk",), lay + ("lin_wv",)), (2 * kd + vd, h),
                lambda x: split_channels(x.T, h), lambda parts: join_channels(parts, h).T)
            maps[f"{a}conv1d.weight"] = _split_map(  # depthwise [channels, 1, W] -> taps first
                (lay + ("conv_q",), lay + ("conv_k",), lay + ("conv_v",)), (2 * kd + vd, 1, w),
                lambda x: split_channels(x[:, 0, :].T, w), lambda parts: join_channels(parts, w).T[:, None, :])
            maps.update({
                f"{a}in_proj_z.weight": linear_map(lay + ("lin_wz",), vd, h, (h, hv, dv)),
                f"{a}in_proj_b.weight": linear_map(lay + ("lin_wb",), hv, h),
                f"{a}in_proj_a.weight": linear_map(lay + ("lin_wa",), hv, h),
                f"{a}dt_bias": copy_map(lay + ("dt_bias",), (hv,)),
                f"{a}A_log": copy_map(lay + ("A_log",), (hv,)),
                f"{a}norm.weight": copy_map(lay + ("lin_norm",), (dv,)),
                f"{a}out_proj.weight": linear_map(lay + ("lin_wo",), h, vd, (hv, dv, h)),
            })
        m = f"{p}mlp."
        maps[f"{m}experts.gate_up_proj"] = _split_map(
            (lay + ("we_gate",), lay + ("we_up",)), (e, 2 * i, h),
            lambda x: (x[:, :i].transpose(0, 2, 1), x[:, i:].transpose(0, 2, 1)),
            lambda gu: np.concatenate([gu[0].transpose(0, 2, 1), gu[1].transpose(0, 2, 1)], axis=1))
        maps[f"{m}experts.down_proj"] = TensorMap(lay + ("we_down",), (e, h, i), lambda x: x.transpose(0, 2, 1),
                                                  lambda x: x.transpose(0, 2, 1))
        maps.update({
            f"{m}gate.weight": linear_map(lay + ("router",), e, h),
            f"{m}shared_expert.gate_proj.weight": linear_map(lay + ("ws_gate",), s, h),
            f"{m}shared_expert.up_proj.weight": linear_map(lay + ("ws_up",), s, h),
            f"{m}shared_expert.down_proj.weight": linear_map(lay + ("ws_down",), h, s),
            f"{m}shared_expert_gate.weight": linear_map(lay + ("shared_gate",), 1, h),
        })
    return maps


_PER_EXPERT = re.compile(r"^(?P<base>.*\.mlp\.experts\.)(?P<j>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


class FusedExpertsView:
    """A read-only facade over a :class:`WeightReader` that presents per-expert MoE tensors
    (``<base>{j}.{gate,up,down}_proj.weight``) under ``decoder_prefix`` as the fused ``<base>gate_up_proj``
    ``[E, 2I, H]`` (gate rows first) and ``<base>down_proj`` ``[E, H, I]``, stacked when read. Other keys (the
    ``mtp.*`` experts among them) pass through unchanged."""

    def __init__(self, reader: WeightReader, decoder_prefix: str):
        self.reader, self.path = reader, reader.path
        groups: dict[str, dict[str, dict[int, str]]] = {}
        self._hidden: set[str] = set()
        for key in reader.keys():
            m = _PER_EXPERT.match(key)
            if m and key.startswith(decoder_prefix):
                groups.setdefault(m["base"], {}).setdefault(m["proj"], {})[int(m["j"])] = key
                self._hidden.add(key)
        self._fused: dict[str, tuple[list[str], ...]] = {}
        for base, projs in groups.items():
            num = max(max(js) for js in projs.values()) + 1
            names = {}
            for proj in ("gate", "up", "down"):
                missing = [j for j in range(num) if j not in projs.get(proj, {})]
                if missing:
                    raise CheckpointError(f"{self.path}: per-expert tensors {base}{{j}}.{proj}_proj.weight are "
                                          f"missing for experts {missing[:5]}")
                names[proj] = [projs[proj][j] for j in range(num)]
            self._fused[f"{base}gate_up_proj"] = (names["gate"], names["up"])
            self._fused[f"{base}down_proj"] = (names["down"],)

    @property
    def per_expert(self) -> bool:
        """The checkpoint stores (some) experts one by one."""
        return bool(self._fused)

    def keys(self) -> list[str]:
        return [k for k in self.reader.keys() if k not in self._hidden] + list(self._fused)

    def __contains__(self, name: str) -> bool:
        return name in self._fused or (name in self.reader and name not in self._hidden)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._fused:
            return self.reader.shape(name)
        parts = self._fused[name]
        rows = sum(self.reader.shape(p[0])[0] for p in parts)
        return (len(parts[0]), rows) + self.reader.shape(parts[0][0])[1:]

    def dtype(self, name: str) -> str:
        return self.reader.dtype(self._fused[name][0][0] if name in self._fused else name)

    def get(self, name: str) -> np.ndarray:
        if name not in self._fused:
            return self.reader.get(name)
        parts = self._fused[name]  # [E, rows of part 0 | rows of part 1, H]
        return np.stack([np.concatenate([self.reader.get(p[j]) for p in parts], axis=0)
                         for j in range(len(parts[0]))])


def split_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Fused expert tensors -> per-expert ``experts.{j}.{gate,up,down}_proj.weight`` (the inverse of the view)."""
    out = {}
    for key, arr in tensors.items():
        if key.endswith(".mlp.experts.gate_up_proj"):
            base, inter = key[: -len("gate_up_proj")], arr.shape[1] // 2
            for j in range(arr.shape[0]):
                out[f"{base}{j}.gate_proj.weight"] = np.ascontiguousarray(arr[j, :inter])
                out[f"{base}{j}.up_proj.weight"] = np.ascontiguousarray(arr[j, inter:])
        elif key.endswith(".mlp.experts.down_proj"):
            base = key[: -len("down_proj")]
            for j in range(arr.shape[0]):
                out[f"{base}{j}.down_proj.weight"] = np.ascontiguousarray(arr[j])
        else:
            out[key] = arr
    return out


def fuse_experts(tensors: dict[str, np.ndarray], prefix: str = "model.") -> dict[str, np.ndarray]:
    """Per-expert tensors under ``prefix`` -> the fused on-disk layout (``experts.gate_up_proj`` ``[E, 2I, H]``,
    gate rows first, and ``experts.down_proj`` ``[E, H, I]``, no ``.weight`` suffix); other keys unchanged."""
    groups: dict[str, dict[str, dict[int, np.ndarray]]] = {}
    out = {}
    for key, arr in tensors.items():
        m = _PER_EXPERT.match(key)
        if m and key.startswith(prefix):
            groups.setdefault(m["base"], {}).setdefault(m["proj"], {})[int(m["j"])] = arr
        else:
            out[key] = arr
    for base, projs in groups.items():
        n = len(projs["gate"])
        out[f"{base}gate_up_proj"] = np.stack([np.concatenate([projs["gate"][j], projs["up"][j]]) for j in range(n)])
        out[f"{base}down_proj"] = np.stack([projs["down"][j] for j in range(n)])
    return out


QWEN35_IGNORED_PREFIXES = ("model.visual.", "mtp.")


def load_qwen35_params(path: str | Path, config: ModelConfig, dtype=jnp.bfloat16) -> dict:
    """Params of a Qwen3.5-MoE checkpoint (wrapper or causal-LM keys, fused or per-expert experts)."""
    with WeightReader(path) as reader:
        prefix = config.weight_prefix
        for candidate in (prefix, "model.language_model.", "model."):  # a text-only model may carry wrapper keys
            if f"{candidate}embed_tokens.weight" in reader:
                prefix = candidate
                break
        view = FusedExpertsView(reader, prefix)
        tied = config.tie_word_embeddings
        return read_tensors(view, qwen35_tensor_maps(config, prefix), dtype,
                            ignore=lambda k: k.startswith(QWEN35_IGNORED_PREFIXES) or (tied and k == "lm_head.weight"))


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
