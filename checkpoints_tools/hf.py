"""Hugging Face safetensors checkpoints <-> params pytrees.

Reads ``model.safetensors`` or a sharded ``model.safetensors.index.json`` (its ``weight_map`` names the shard
of every tensor), checks every tensor's shape against the config, converts PyTorch ``[out, in]`` linears to
JAX ``[in, out]`` with explicit head axes, and writes the inverse: which tensor feeds which leaf, and how, is
each model's parameter table (:mod:`diffspec_jax.models.params`; tables in :mod:`diffspec_jax.models.llama`,
:mod:`diffspec_jax.models.qwen35` and :mod:`diffspec_jax.models.eagle3`). Tensors are read one at a time, so peak host memory
is about one tensor above the params themselves.

Qwen3.5-MoE checkpoints: the decoder sits under ``model.language_model.`` (``Qwen3_5MoeForConditionalGeneration``;
``model.visual.*`` and ``mtp.*`` are ignored) or ``model.`` (``Qwen3_5MoeForCausalLM``), detected from the keys;
experts are read in either on-disk layout: fused ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows first) and
``mlp.experts.down_proj`` ``[E, H, I]`` without a ``.weight`` suffix, or per expert
``mlp.experts.{j}.{gate,up,down}_proj.weight`` (:class:`FusedExpertsView` presents the latter as the former).
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from diffspec_jax.config import ModelConfig
from diffspec_jax.errors import CheckpointError, IntegrityError, PathNotFoundError
from diffspec_jax.models import eagle3, family, llama
from diffspec_jax.models import params as tables

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: tensors some checkpoints carry that no forward pass needs
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}
#: bytes per element of the safetensors dtypes
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}
#: a safetensors header larger than this is not read by the header checks (the safetensors library refuses it)
MAX_HEADER_BYTES = 100 << 20


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


def unreadable(file: Path, exc: OSError, what: str = "safetensors file") -> CheckpointError:
    """The error for a file that cannot be opened, naming the real cause (permissions, a directory, ...)."""
    if isinstance(exc, IsADirectoryError) or file.is_dir():
        cause = "it is a directory, not a file (move it away and put the file there)"
    elif isinstance(exc, PermissionError):
        cause = "permission denied (make it readable for this user, e.g. chmod a+r)"
    elif isinstance(exc, FileNotFoundError):
        cause = "it does not exist (an incomplete download or copy?)"
    else:
        cause = f"{exc.strerror or exc} (a damaged file system or an incomplete copy?)"
    return CheckpointError(f"cannot read {what} {file}: {cause}")


def _raw_header(file: Path) -> dict:
    """The JSON header of a safetensors file (``{}`` when it cannot be parsed: the safetensors library then says
    why). Raises :class:`CheckpointError` (:func:`unreadable`) when the file cannot be opened."""
    try:
        with open(file, "rb") as f:
            head = f.read(8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            if not 0 < size <= MAX_HEADER_BYTES:
                return {}
            header = json.loads(f.read(size).decode("utf-8"))
    except OSError as exc:
        raise unreadable(file, exc) from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    if isinstance(header, dict):
        header["__data_bytes__"] = file.stat().st_size - 8 - size
        return header
    return {}


def header_problems(file: Path) -> list[IntegrityError]:
    """Damage a safetensors header shows without any digest (a file that cannot be opened raises
    :class:`CheckpointError` instead):

    * a tensor whose byte length (``data_offsets``) does not fit its shape and dtype;
    * tensors whose data overlap, leave gaps or lie past the end of the file;
    * F16 and BF16 tensors in one file (a checkpoint is saved in one half-precision format: a damaged dtype);
    * tensors of one dtype stored out of the name order the safetensors writers use, where only two to four
      tensors of equal size are out of place (their ``data_offsets`` were swapped). Files written in another
      order throughout (other writers) are not judged.

    Value damage (a flipped sign or mantissa bit) leaves the header intact: only a manifest's digest finds it.
    """
    header = _raw_header(file)
    data_bytes = header.pop("__data_bytes__", None)
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    try:
        spans = {k: (int(v["data_offsets"][0]), int(v["data_offsets"][1])) for k, v in tensors.items()}
        dtypes = {k: str(v["dtype"]) for k, v in tensors.items()}
        shapes = {k: [int(n) for n in v["shape"]] for k, v in tensors.items()}
    except (KeyError, TypeError, ValueError, IndexError):
        return []  # a malformed header: the safetensors library names it
    problems = []
    for name in sorted(tensors):
        begin, end = spans[name]
        if dtypes[name] in DTYPE_BYTES and end - begin != math.prod(shapes[name]) * DTYPE_BYTES[dtypes[name]]:
            problems.append(IntegrityError(
                f"{file}: tensor {name!r} is {dtypes[name]} {shapes[name]} "
                f"({math.prod(shapes[name]) * DTYPE_BYTES[dtypes[name]]} bytes) but its data_offsets {[begin, end]} "
                f"span {end - begin} bytes; the header is damaged"))
    needed = max((end for _, end in spans.values()), default=0)
    if data_bytes is not None and needed > data_bytes:
        problems.append(IntegrityError(f"{file}: its header describes {needed} bytes of tensor data, the file holds "
                                       f"{data_bytes}: the file is damaged or incomplete (an interrupted download or "
                                       f"copy?); re-download or re-create it"))
        return problems
    at = 0
    for name in sorted(tensors, key=lambda k: spans[k]):
        begin, end = spans[name]
        if begin != at or end < begin:
            where = "overlapping the tensor before it" if begin < at or end < begin else f"leaving a gap at byte {at}"
            problems.append(IntegrityError(f"{file}: tensor {name!r} has data_offsets {[begin, end]}, {where}; the "
                                           f"header is damaged"))
        at = max(at, end)
    if data_bytes is not None and tensors and at < data_bytes:
        problems.append(IntegrityError(f"{file}: {data_bytes - at} bytes follow the last tensor's data; the file was "
                                       f"extended or its header is damaged"))
    half = {d: sorted(k for k in tensors if dtypes[k] == d) for d in ("F16", "BF16")}
    if all(half.values()):
        few, many = sorted(half, key=lambda d: (len(half[d]), d))
        problems.append(IntegrityError(
            f"{file}: tensors {half[few][:3]}{' ...' if len(half[few]) > 3 else ''} are {few} while "
            f"{len(half[many])} others are {many}; a checkpoint is saved in one half-precision format, so the "
            f"header's dtype is damaged"))
    groups: dict[str, list[str]] = {}
    for name in sorted(tensors, key=lambda k: spans[k]):
        groups.setdefault(dtypes[name], []).append(name)
    for names in groups.values():
        moved = [a for a, b in zip(names, sorted(names)) if a != b]
        if 2 <= len(moved) <= min(4, len(names) // 2) and len({spans[k][1] - spans[k][0] for k in moved}) == 1:
            problems.append(IntegrityError(
                f"{file}: the data of tensors {sorted(moved)} is out of the name order in which this file stores "
                f"every other tensor: their data_offsets look swapped; the header is damaged"))
    return problems


class WeightReader:
    """Lazy access to the tensors of a safetensors checkpoint directory (single file or sharded).

    Use as a context manager; ``keys()``, ``shape(name)``, ``dtype(name)`` read headers only, ``get(name)``
    loads one tensor as a NumPy array. Every read error of the safetensors library is a :class:`CheckpointError`
    naming the file (and tensor), and a sharded index that names a tensor its shard does not hold is refused when
    the reader opens. Each file's header is checked when it is opened (:func:`header_problems`; an
    :class:`IntegrityError`) unless ``check_headers=False`` (``inspect``, which reports them itself).
    """

    def __init__(self, path: str | Path, *, single_file: str = SINGLE_FILE, index_file: str = INDEX_FILE,
                 check_headers: bool = True):
        self.path = check_dir(path)
        self.check_headers = check_headers
        index = self.path / index_file
        single = self.path / single_file
        self._handles: dict[Path, Any] = {}
        if index.exists():
            self._file_of = self._read_index(index)
            for f in sorted(set(self._file_of.values())):
                if f.is_dir():
                    raise CheckpointError(f"{index} names shard {f.name}, which is a directory in {self.path}, not "
                                          f"a file")
                if not f.exists():
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
            problems = header_problems(file) if self.check_headers else []
            if problems:
                if len(problems) > 1:
                    problems[0].add_note(f"{len(problems) - 1} more header problem(s) in {file.name}")
                raise problems[0]
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

    def _read(self, name: str, what: str):
        """``handle.get_slice(name)`` or ``handle.get_tensor(name)`` of the file holding ``name``, every error a
        :class:`CheckpointError`."""
        if name not in self._file_of:
            raise CheckpointError(f"tensor {name!r} is missing from {self.path}")
        file = self._file_of[name]
        try:
            return getattr(self._handle(file), what)(name)
        except CheckpointError:
            raise
        except Exception as exc:
            raise _damaged(file, exc, name) from exc

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._read(name, "get_slice").get_shape())

    def dtype(self, name: str) -> str:
        return self._read(name, "get_slice").get_dtype()

    def get(self, name: str) -> np.ndarray:
        return self._read(name, "get_tensor")


# ------------------------------------------------------------------------------------------- tables <-> disk
def table_problems(reader: WeightReader, table: tables.Table, *,
                   ignore: Callable[[str], bool] = lambda k: False) -> list[CheckpointError]:
    """Every disagreement between the checkpoint's tensors and the parameter ``table`` (headers only): missing and
    unexpected tensors, non-float dtypes, shapes other than the config implies (one error per tensor)."""
    wanted = tables.hf_tensors(table)
    present = set(reader.keys())
    problems = []
    missing = [k for k in wanted if k not in present]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        problems.append(CheckpointError(f"{reader.path}: missing tensors {missing[:5]}{more}"))
    unexpected = [k for k in present - set(wanted) if not k.endswith(IGNORED_SUFFIXES) and not ignore(k)]
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        problems.append(CheckpointError(
            f"{reader.path}: unexpected tensors {sorted(unexpected)[:5]}{more}; the checkpoint does not match "
            f"its config.json (wrong architecture, biases or quantized weights?)"))
    for key, rows in wanted.items():
        if key not in present:
            continue
        try:
            disk_dtype, shape = reader.dtype(key), reader.shape(key)
        except CheckpointError as exc:
            problems.append(exc)
            continue
        expected = tables.hf_shape(rows)
        if disk_dtype not in FLOAT_DTYPES:
            problems.append(CheckpointError(f"{reader.path}: tensor {key!r} has dtype {disk_dtype}; quantized or "
                                            f"integer weights are not supported"))
        elif shape != expected:
            problems.append(CheckpointError(f"{reader.path}: tensor {key!r} has shape {list(shape)}, but config.json "
                                            f"implies {list(expected)}"))
    return problems


def read_tensors(reader: WeightReader, table: tables.Table, dtype, *,
                 ignore: Callable[[str], bool] = lambda k: False) -> dict:
    """Load every tensor the parameter ``table`` names (:mod:`diffspec_jax.models.params`), checking presence,
    float dtype and shape; refuse unknown tensors.

    Args:
        ignore: predicate for present tensors that are deliberately unused.
    Returns:
        the params pytree (``jnp`` arrays of ``dtype``).
    """
    problems = table_problems(reader, table, ignore=ignore)
    if problems:
        raise problems[0]
    params: dict = {}
    for key, rows in tables.hf_tensors(table).items():
        for row, arr in zip(rows, tables.from_hf(rows, reader.get(key))):
            tables.set_leaf(params, row.path, jnp.asarray(arr, dtype=dtype))
    return params


def load_hf_params(path: str | Path, config: ModelConfig, dtype=jnp.bfloat16) -> dict:
    """Params pytree of a Llama / Qwen3 / Qwen3.5-MoE HF checkpoint directory, shapes checked against ``config``."""
    with WeightReader(path) as reader:
        source, table, ignore = target_layout(reader, config)
        return read_tensors(source, table, dtype, ignore=ignore)


def target_layout(reader: WeightReader, config: ModelConfig) -> tuple[Any, tables.Table, Callable[[str], bool]]:
    """``(source, table, ignore)`` for :func:`read_tensors` / :func:`table_problems` of a target checkpoint:
    Qwen3.5-MoE checkpoints are read through a :class:`FusedExpertsView` under their detected key prefix, and
    their vision tower and MTP head ignored; a tied ``lm_head.weight`` is ignored."""
    tied = config.tie_word_embeddings
    if not config.is_hybrid:
        return reader, family(config).table(config), lambda k: tied and k == "lm_head.weight"
    prefix = config.weight_prefix
    for candidate in (prefix, "model.language_model.", "model."):  # a text-only model may carry wrapper keys
        if f"{candidate}embed_tokens.weight" in reader:
            prefix = candidate
            break
    return (FusedExpertsView(reader, prefix), family(config).table(config, prefix=prefix),
            lambda k: k.startswith(QWEN35_IGNORED_PREFIXES) or (tied and k == "lm_head.weight"))


def export_tensors(params: dict, table: tables.Table, dtype=None) -> dict[str, np.ndarray]:
    """The inverse of :func:`read_tensors`: HF key -> NumPy array in the disk layout."""
    def leaf(p):
        arr = np.asarray(jax.device_get(tables.get_leaf(params, p.path)))
        return arr.astype(dtype) if dtype is not None else arr

    return {key: np.ascontiguousarray(tables.to_hf(rows, [leaf(r) for r in rows]))
            for key, rows in tables.hf_tensors(table).items()}


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
        tensors = export_tensors(params, family(config).table(config), np_dtype)
        if expert_layout == "per_expert":
            tensors = split_experts(tensors)
        elif expert_layout != "fused":
            raise ValueError(f"expert_layout must be 'fused' or 'per_expert', got {expert_layout!r}")
    else:
        tensors = export_tensors(llama.split_projections(config, params), family(config).table(config), np_dtype)
    write_safetensors(path, tensors, max_shard_bytes=max_shard_bytes)
    cfg = config.to_hf_dict()
    if dtype:
        cfg["dtype"] = dtype
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return path


# --------------------------------------------------------------------------------------------- Qwen3.5-MoE
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


# ------------------------------------------------------------------------------------------- EAGLE-3 drafts
def save_eagle3(path: str | Path, config, params: dict, *, num_aux: int = 3, dtype: str | None = None,
                own_embedding: bool = False) -> Path:
    """Write a draft in the SpecForge/vLLM layout: ``config.json`` + ``model.safetensors`` with ``d2t``/``t2d``
    (both omitted when the vocabularies are equal, as EAGLE does)."""
    path = Path(path)
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16, None: None}[dtype]
    tensors = export_tensors(params, eagle3.param_table(config, num_aux, own_embedding=own_embedding), np_dtype)
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
