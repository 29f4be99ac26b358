"""The EAGLE-3 draft handle: loading a SpecForge / vLLM-layout checkpoint and checking it against its target.

Public entry point (re-exported by :mod:`diffspec_jax`): :func:`load_draft`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from checkpoints_tools import hf
from diffspec_jax.config import DraftConfig
from diffspec_jax.errors import CheckpointError, ConfigError
from diffspec_jax.models import eagle3
from diffspec_jax.models import params as tables
from diffspec_jax.outdir import verify_manifest
from diffspec_jax.target import TargetModel, check_finite, resolve_dtype
from diffspec_jax.validation import check_bool, check_int, read_json_object


@dataclass(frozen=True, eq=False)
class DraftModel:
    """A loaded draft bound to its target.

    Attributes:
        config: the draft's :class:`DraftConfig`.
        params: pytree of :mod:`diffspec_jax.models.eagle3` (``embed`` shared with the target unless own).
        aux_layers: the target layers feeding ``fc``, as HF ``hidden_states`` indices (low, mid, high).
        own_embedding: the checkpoint carries ``embed_tokens.weight``.
    """

    config: DraftConfig
    params: eagle3.Params
    aux_layers: tuple[int, ...]
    own_embedding: bool = False
    path: str | None = None

    def __repr__(self) -> str:
        c = self.config
        return (f"DraftModel(hidden={c.hidden_size}, vocab={c.vocab_size}, draft_vocab={c.draft_vocab_size}, "
                f"aux_layers={self.aux_layers}, path={self.path!r})")


def validate_against_target(config: DraftConfig, target: TargetModel, num_aux: int) -> tuple[int, ...]:
    """Refuse a draft that cannot serve ``target``; return its aux layers as HF indices."""
    tc = target.config
    if config.vocab_size != tc.vocab_size:
        raise ConfigError(f"vocabulary mismatch: the draft's vocab_size is {config.vocab_size}, the target's is "
                          f"{tc.vocab_size}; a draft must be trained for this target's tokenizer")
    if config.target_hidden_size != tc.hidden_size:
        raise ConfigError(f"the draft's fc expects aux states of width {config.target_hidden_size}, the target's "
                          f"hidden size is {tc.hidden_size}")
    aux = config.resolve_aux_layers(tc)
    if len(aux) != num_aux:
        raise ConfigError(f"the draft's fc takes {num_aux} aux states, its config names {len(aux)} aux layers {aux}")
    return aux


def load_draft(path: str | Path, target: TargetModel, *, dtype: Any = None, aux_convention: str = "auto",
               aux_layer_ids: tuple[int, ...] | None = None, verify: bool = True) -> DraftModel:
    """Load an EAGLE-3 draft (SpecForge / vLLM layout) for ``target``.

    Args:
        path: directory with ``config.json`` and ``model.safetensors`` (keys ``fc``, ``midlayer.*`` or
            ``layers.0.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``, optional ``embed_tokens``).
        dtype: parameter dtype (default: the target's).
        aux_convention: how the config's explicit aux ids are read (``"auto"``, ``"hf"``, ``"output"``; see
            :meth:`DraftConfig.from_dict`).
        aux_layer_ids: override the aux layers (HF ``hidden_states`` indices).
        verify: check the manifest digests (when the directory has a ``diffspec_manifest.json``) and that every
            floating tensor is finite (see :func:`diffspec_jax.load_target`); ``False`` skips both.
    Raises:
        ConfigError: vocabulary mismatch, aux ids out of range, fc width not matching the target hidden size, an
            invalid ``config.json``.
        UnsupportedModelError: more than one draft layer, EAGLE-1 style or other unsupported draft variants.
        CheckpointError: missing / inconsistent files or tensors (``IntegrityError``: damaged contents).
    """
    path = hf.check_dir(path)
    if not isinstance(target, TargetModel):
        raise ConfigError(f"load_draft needs the TargetModel the draft serves (from load_target), got "
                          f"{type(target).__name__}")
    verify = check_bool(verify, "verify")
    if verify:  # every file but config.json first (see load_target)
        verify_manifest(path, skip=("config.json",))
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"no config.json found at {cfg_file}")
    config = DraftConfig.from_dict(read_json_object(cfg_file, "a draft config.json"), source=str(cfg_file),
                                   aux_convention=aux_convention)
    if aux_layer_ids is not None:
        if isinstance(aux_layer_ids, (str, bytes)) or not hasattr(aux_layer_ids, "__iter__"):
            raise ConfigError(f"aux_layer_ids must be a sequence of layer indices, got {aux_layer_ids!r}")
        ids = tuple(check_int(i, "aux_layer_ids entry", min=0) for i in aux_layer_ids)
        config = DraftConfig(**{**config.__dict__, "aux_layer_ids": ids})
    dtype = resolve_dtype(dtype) if dtype is not None else target.dtype
    with hf.WeightReader(path) as reader:
        layout = draft_layout(reader, config, path)
        if layout.layer_problems:
            raise layout.layer_problems[0]
        aux = validate_against_target(config, target, layout.num_aux)
        if layout.tensor_problems:
            raise layout.tensor_problems[0]
        table, own = layout.table, layout.own_embedding
        params = hf.read_tensors(reader, table, dtype, ignore=lambda k: k in DRAFT_TABLES)
        params["d2t"] = jnp.asarray(layout.d2t, jnp.int32)
    if verify:  # config.json's digest once the files are known to fit it, then the values
        verify_manifest(path, only=("config.json",))
        check_finite(params, str(path), tables.hf_names(table), skip=("d2t",))
    if not own:
        if config.hidden_size != target.config.hidden_size:
            raise CheckpointError(f"{path}: the draft's hidden size ({config.hidden_size}) differs from the target's "
                                  f"({target.config.hidden_size}), so it needs its own embed_tokens.weight")
        params["embed"] = target.params["embed"].astype(dtype)
    return DraftModel(config=config, params=params, aux_layers=aux, own_embedding=own, path=str(path))


#: the draft's integer vocabulary tables (no parameters of the table)
DRAFT_TABLES = ("d2t", "t2d")


@dataclass
class DraftLayout:
    """What a draft checkpoint holds, checked without its target (:func:`draft_layout`).

    ``layer_problems`` (no draft layer, more than one, no ``fc.weight``, an ``fc`` width that is not a multiple of
    ``target_hidden_size``) leave ``num_aux`` / ``table`` ``None``; ``tensor_problems`` are the tensors that do not
    fit the config and a missing or invalid ``d2t`` / ``t2d``."""

    layer_problems: list
    tensor_problems: list
    num_aux: int | None = None
    own_embedding: bool = False
    table: Any = None
    d2t: np.ndarray | None = None


def draft_layout(reader, config: DraftConfig, path: Path) -> DraftLayout:
    """Check a draft's tensors against its config (headers, and the ``d2t`` / ``t2d`` tables) and collect every
    problem: :func:`load_draft` raises the first, ``inspect`` reports all of them."""
    keys = set(reader.keys())
    layer: list = []
    if any(k.startswith(("layers.1.", "midlayers.1.")) for k in keys):
        layer.append(CheckpointError(f"{path}: the checkpoint holds more than one draft layer; EAGLE-3 drafts have "
                                     f"one"))
    prefix = next((p for p in eagle3.LAYER_PREFIXES if f"{p}self_attn.q_proj.weight" in keys), None)
    if prefix is None:
        layer.append(CheckpointError(f"{path}: no draft layer found (expected midlayer.* or layers.0.* tensors)"))
    num_aux = None
    if "fc.weight" not in keys:
        layer.append(CheckpointError(f"{path}: missing tensor 'fc.weight' (EAGLE-3 drafts project target aux "
                                     f"states)"))
    else:
        shape = reader.shape("fc.weight")
        if len(shape) != 2 or shape[1] % config.target_hidden_size:
            width = f"input width {shape[1]}" if len(shape) == 2 else f"shape {list(shape)}"
            layer.append(ConfigError(f"{path}: fc.weight has {width}, not a multiple of the aux state width "
                                     f"{config.target_hidden_size}"))
        else:
            num_aux = shape[1] // config.target_hidden_size
    out = DraftLayout(layer, [], num_aux=num_aux, own_embedding="embed_tokens.weight" in keys)
    if prefix is not None and num_aux is not None:
        out.table = eagle3.param_table(config, num_aux, layer_prefix=prefix, own_embedding=out.own_embedding)
        out.tensor_problems += hf.table_problems(reader, out.table, ignore=lambda k: k in DRAFT_TABLES)
    try:
        out.d2t = _read_d2t(reader, config, path)
    except CheckpointError as exc:
        out.tensor_problems.append(exc)
    return out


def _read_d2t(reader, config: DraftConfig, path: Path) -> np.ndarray:
    vd, v = config.draft_vocab_size, config.vocab_size
    if "d2t" not in reader:
        if vd != v:
            raise CheckpointError(f"{path}: draft_vocab_size {vd} < vocab_size {v} but the d2t table is missing")
        return np.zeros(vd, np.int64)
    raw = np.asarray(reader.get("d2t"))
    if not np.issubdtype(raw.dtype, np.integer) and not (
            np.issubdtype(raw.dtype, np.floating) and np.all(np.isfinite(raw)) and np.all(raw == np.round(raw))):
        raise CheckpointError(f"{path}: d2t (dtype {raw.dtype}) must hold integer offsets; the table is damaged")
    d2t = raw.astype(np.int64)
    if d2t.shape != (vd,):
        raise CheckpointError(f"{path}: d2t has shape {list(d2t.shape)}, expected [{vd}] (draft_vocab_size)")
    target_ids = d2t + np.arange(vd)
    if d2t.min() < 0 or np.any(np.diff(target_ids) <= 0) or target_ids[-1] >= v:
        raise CheckpointError(f"{path}: d2t is not a valid offset table (target ids must be increasing and < {v})")
    if "t2d" in reader:
        t2d = np.asarray(reader.get("t2d")).astype(bool)
        if t2d.shape != (v,) or not np.array_equal(np.nonzero(t2d)[0], target_ids):
            raise CheckpointError(f"{path}: t2d and d2t disagree (nonzero(t2d) must equal d2t + arange)")
    return d2t
