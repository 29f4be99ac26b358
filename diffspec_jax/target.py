"""The target model handle: loading, the jitted full forward, chunked prefill and cached steps.

Public entry points (re-exported by :mod:`diffspec_jax`):

* :func:`load_target` -- a Hugging Face (safetensors, sharded or not) or Orbax directory -> :class:`TargetModel`;
* :func:`forward` -- int32 ``[B, T]`` -> float32 logits ``[B, T, V]`` (jit-compiled, full sequence, no cache).

Engine-facing helpers: :func:`step_fn` (the jitted cached step, cache donated), :func:`prefill` (chunked
prefill of ragged prompts) and :func:`plan_prefill`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from checkpoints_tools import hf, orbax_io
from diffspec_jax import cache as caches
from diffspec_jax import sharding, stopping
from diffspec_jax.cache import HybridCache, KVCache
from diffspec_jax.config import ModelConfig, check_eos_ids, check_kv_cache_dtype
from diffspec_jax.errors import ConfigError, InputError, IntegrityError
from diffspec_jax.models import attention, family, llama
from diffspec_jax.models import params as tables
from diffspec_jax.outdir import verify_manifest
from diffspec_jax.validation import check_bool

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}
#: the ``prefill_chunk`` default of :func:`prefill` and ``generate()``: ``None`` = :func:`default_prefill_chunk`
DEFAULT_PREFILL_CHUNK = None
#: prefill chunk width with the reference attention (CPUs): its tiled loop is cheap at any chunk size, and small
#: chunks keep compiled programs few and small
REFERENCE_PREFILL_CHUNK = 512
#: with flash attention (GPUs) one prefill chunk holds up to this many tokens (batch x width): a 128K prompt at
#: batch 1 is one pass, 32K x 8 is two 16K-wide chunks. Activations of a chunk take about 100 KiB per token for
#: Llama-3.1-8B shapes (12.5 GiB at this size); ``generate()`` narrows the chunks further until they fit beside
#: the cache (:func:`diffspec_jax.engine.memory.memory_chunk_cap`)
FLASH_PREFILL_TOKENS = 131072


def resolve_dtype(dtype: Any) -> Any:
    """``"bfloat16"`` / ``"float32"`` / ``"float16"`` (or the jnp dtype) -> jnp dtype; anything else is refused."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ConfigError(f"dtype {dtype!r} is not supported (choose one of {', '.join(DTYPES)})")
        return DTYPES[dtype]
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES.values()]:
        raise ConfigError(f"dtype {dtype} is not supported (choose one of {', '.join(DTYPES)})")
    return jnp.dtype(dtype).type


@dataclass(frozen=True, eq=False)
class TargetModel:
    """A loaded target: its config and params pytree (layout in :mod:`diffspec_jax.models.llama`, or
    :mod:`diffspec_jax.models.qwen35` for the Qwen3.5 hybrid MoE family)."""

    config: ModelConfig
    params: llama.Params
    path: str | None = None

    @property
    def dtype(self):
        return self.params["embed"].dtype

    def __repr__(self) -> str:
        c = self.config
        return (f"TargetModel({c.architecture}, layers={c.num_hidden_layers}, hidden={c.hidden_size}, "
                f"vocab={c.vocab_size}, dtype={self.dtype}, path={self.path!r})")


def abstract_params(config: ModelConfig, dtype) -> llama.Params:
    """Pytree of ``jax.ShapeDtypeStruct`` matching the family's ``param_shapes``."""
    dtype = resolve_dtype(dtype)
    return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s, dtype), family(config).param_shapes(config),
                                  is_leaf=tables.is_shape)


def load_target(path: str | Path, dtype: Any = "bfloat16", *, fuse_projections: bool = True,
                verify: bool = True) -> TargetModel:
    """Load a target from a Hugging Face directory or an Orbax checkpoint written by ``checkpoints_tools``.

    ``config.eos_token_ids`` holds ``config.json``'s EOS ids and those ``generation_config.json`` adds
    (:func:`diffspec_jax.stopping.eos_token_ids`).

    Supported: ``LlamaForCausalLM``, ``Qwen3ForCausalLM`` and the Qwen3.5 hybrid MoE family
    (``Qwen3_5MoeForCausalLM`` keys ``model.*``; ``Qwen3_5MoeForConditionalGeneration`` keys
    ``model.language_model.*``, its vision tower and MTP head ignored; fused or per-expert expert tensors).

    Args:
        path: directory with ``config.json`` and ``model.safetensors`` / ``model.safetensors.index.json``, or an
            Orbax checkpoint directory.
        dtype: parameter dtype, ``"bfloat16"`` (default) or ``"float32"``.
        fuse_projections: serve Llama / Qwen3 layers with fused q/k/v and gate/up weights
            (:func:`diffspec_jax.models.llama.fuse_projections`, faster decode; default). ``False`` keeps the
            checkpoint layout (what ``checkpoints_tools convert`` stores).
        verify: check the checkpoint's integrity (default): the SHA-256 digests of its ``diffspec_manifest.json``
            when it has one (:mod:`diffspec_jax.outdir`; written by ``convert``, ``train_draft`` and the demo
            build; digests of files unchanged since an earlier load are reused, :func:`diffspec_jax.outdir.
            file_digest`), and that every floating tensor is finite and of magnitude <= ``MAX_ABS_WEIGHT`` (one
            fused reduction on the device, :func:`check_finite`). ``False`` skips both. The safetensors headers
            are checked either way (:func:`checkpoints_tools.hf.header_problems`).
    Raises:
        PathNotFoundError: ``path`` does not exist or is not a directory.
        CheckpointError: missing / unreadable files or tensors, or shapes that do not match ``config.json``.
        IntegrityError: a digest that differs from the manifest, a damaged safetensors header, or a tensor with
            NaN / inf / absurd values.
        ConfigError: an invalid ``config.json`` (no ``rope_theta``, an EOS id outside the vocabulary, ...).
        UnsupportedModelError: architecture, RoPE type or feature not supported.
    """
    path = hf.check_dir(path)
    dtype = resolve_dtype(dtype)
    fuse_projections = check_bool(fuse_projections, "fuse_projections")
    verify = check_bool(verify, "verify")
    if verify:  # the digests of every file but config.json first: damage is reported as such, not as what it breaks
        verify_manifest(path, skip=("config.json",))
    config = ModelConfig.from_pretrained(path)
    # every EOS id: generation_config.json names more than config.json for instruct checkpoints (end of turn)
    more_eos = stopping.generation_eos_ids(path)
    check_eos_ids(more_eos, config.vocab_size, f"{path / stopping.GENERATION_CONFIG}: eos_token_id")
    config = dataclasses.replace(config, eos_token_ids=stopping.merge_eos_ids(config.eos_token_ids, more_eos))
    # config.json's digest once the files are known to fit it (so an edited config is reported as a mismatch),
    # before Orbax restores any data
    check = (lambda: verify_manifest(path, only=("config.json",))) if verify else None
    if orbax_io.is_orbax_dir(path):
        params = orbax_io.load_orbax(path, abstract_params(config, dtype), before_restore=check)
    else:
        params = hf.load_hf_params(path, config, dtype)
        if check is not None:
            check()
    if verify:  # both formats hold the checkpoint layout, so leaves are named by their HF tensors
        check_finite(params, str(path), tables.hf_names(family(config).table(config)))
    if fuse_projections and config.family == "llama":
        params = llama.fuse_layers_in_place(params)
    return TargetModel(config=config, params=params, path=str(path))


# ------------------------------------------------------------------------------------------ integrity checks
#: a weight of larger magnitude is treated as damage. Trained Llama / Qwen weights, norm gains included, stay
#: below about 1e2. Flipping a clear exponent bit of a float32 / bfloat16 weight multiplies it by 2^(bit value):
#: the highest bit (2^128) is caught for any weight above 1e-34, bit 32 for weights above 2.3e-6, bit 16 above 0.15
MAX_ABS_WEIGHT = 1e4


@jax.jit
def _peak_magnitudes(leaves: list) -> jax.Array:
    """float32 ``[len(leaves)]``: max |x| of every leaf, ``inf`` when a leaf holds a NaN or an inf (NaN is mapped
    to inf first: a max reduction need not propagate NaN), one fused computation."""
    return jnp.stack([jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), jnp.inf), initial=0).astype(jnp.float32)
                      for x in leaves])


def _leaf_name(keypath) -> tuple:
    out = []
    for k in keypath:
        out.append(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
    return tuple(out)


def check_finite(params: Any, where: str, names: dict[tuple, str] | None = None, *,
                 skip: tuple[str, ...] = ()) -> None:
    """Refuse params with a floating leaf that holds NaN / inf or a value of magnitude > ``MAX_ABS_WEIGHT``.

    One jitted reduction over all floating leaves (max |x| per leaf, one small vector back to the host).

    Args:
        where: the checkpoint, for the message.
        names: leaf path tuple -> the tensor's name on disk (default: the params path).
        skip: top-level keys left out (e.g. a draft's embedding shared with its target).
    Raises:
        IntegrityError: naming the first bad tensor (and how many are bad).
    """
    flat = [(kp, x) for kp, x in jax.tree_util.tree_flatten_with_path(params)[0]
            if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
            and not (skip and _leaf_name(kp)[:1] and _leaf_name(kp)[0] in skip)]
    if not flat:
        return
    peaks = np.asarray(_peak_magnitudes([x for _, x in flat]))
    bad = np.flatnonzero(~(np.isfinite(peaks) & (peaks <= MAX_ABS_WEIGHT)))
    if not bad.size:
        return

    def label(i: int) -> str:
        kp = flat[i][0]
        leaf = _leaf_name(kp)
        on_disk = (names or {}).get(leaf)
        return f"{on_disk!r} (params{jax.tree_util.keystr(kp)})" if on_disk else f"params{jax.tree_util.keystr(kp)}"

    first = int(bad[0])
    what = ("holds NaN or infinite values" if not np.isfinite(peaks[first]) else
            f"holds a value of magnitude {peaks[first]:.3g} > {MAX_ABS_WEIGHT:g} (a flipped exponent bit?)")
    more = f" ({len(bad)} tensors are bad, also {', '.join(label(int(i)) for i in bad[1:3])})" if len(bad) > 1 else ""
    raise IntegrityError(f"{where}: tensor {label(first)} {what}{more}; the checkpoint is damaged: re-download or "
                         f"re-create it (or load with verify=False to skip this check)")


def check_token_ids(token_ids: Any, vocab_size: int, what: str = "token_ids") -> np.ndarray:
    """Validate integer token ids in ``[0, vocab_size)``; returns them as int32."""
    arr = np.asarray(token_ids)
    if arr.size == 0:
        raise InputError(f"{what} is empty")
    if not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"{what} must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        raise InputError(f"{what} must lie in [0, {vocab_size}) (the vocabulary), got values in [{lo}, {hi}]")
    return arr.astype(np.int32)


@functools.partial(jax.jit, static_argnums=0)
def _forward_jit(config: ModelConfig, params, tokens):
    return family(config).forward(config, params, tokens)


@functools.lru_cache(maxsize=16)
def _forward_tp(config: ModelConfig, mesh, spec_key):
    specs = jax.tree_util.tree_unflatten(*spec_key)
    fn = functools.partial(family(config).forward, config, axis_name=sharding.TP)
    return sharding.jit_sharded(fn, mesh, (specs, P()), P())


def forward(model: TargetModel, token_ids: Any, *, mesh=None) -> jax.Array:
    """Full-sequence logits without a cache (the reference path).

    Args:
        token_ids: int ``[B, T]`` (a ``[T]`` vector is treated as batch 1).
        mesh: optional ``("dp", "tp")`` mesh: run tensor-parallel over its ``tp`` axis.
    Returns:
        float32 ``[B, T, V]`` (identical on every shard under tensor parallelism).
    """
    ids = check_token_ids(token_ids, model.config.vocab_size)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2:
        raise InputError(f"token_ids must be [batch, tokens], got shape {ids.shape}")
    if mesh is None:
        return _forward_jit(model.config, model.params, jnp.asarray(ids))
    params = sharding.prepare(model, mesh, sharding.mesh_size(mesh, sharding.TP))
    leaves, treedef = jax.tree_util.tree_flatten(params)
    key = (treedef, tuple(x.sharding.spec for x in leaves))
    return _forward_tp(model.config, mesh, key)(params, jnp.asarray(ids))


def _step(config: ModelConfig, params, cache, tokens, start, rows, *, aux_layers: tuple[int, ...] = (),
          score_layer: int | None = None, axis_name: str | None = None, num_valid=None, snapshots: bool = False,
          first_chunk: bool = False):
    """The family's cached step (see :mod:`diffspec_jax.models`)."""
    return family(config).step(config, params, cache, tokens, start, rows, aux_layers=aux_layers,
                               score_layer=score_layer, axis_name=axis_name, num_valid=num_valid,
                               snapshots=snapshots, first_chunk=first_chunk)


#: the cached step, jitted once per (config, shapes, aux layers, scoring layer); the cache is donated.
#: ``num_valid`` (int32 ``[B]``, optional) = tokens per sequence that are real (hybrid models keep padding out of
#: their recurrent state); ``snapshots`` keeps per-position states for :func:`commit`; ``first_chunk`` (static)
#: promises every ``start`` is 0.
step_fn = jax.jit(_step, static_argnames=("config", "aux_layers", "score_layer", "axis_name", "snapshots",
                                         "first_chunk"),
                  donate_argnames=("cache",))


def commit(model: TargetModel, cache, out, keep) -> Any:
    """After a ``snapshots=True`` step: the cache holding the state after ``keep[b]`` of its tokens (rollback of
    rejected drafts for hybrid targets; the cache itself for attention-only targets)."""
    return family(model.config).commit(model.config, cache, out, jnp.asarray(keep, jnp.int32))


def create_cache(model: TargetModel, batch: int, capacity: int, dtype=None, *, kv_cache_dtype: str = "auto"
                 ) -> KVCache | HybridCache:
    """An empty cache of the right kind for ``model`` (:class:`KVCache` or :class:`HybridCache`); ``kv_cache_dtype``
    ``"fp8"``: its K/V rows in 8 bits (:mod:`diffspec_jax.kv_quant`)."""
    return caches.create_cache(model.config, batch, capacity, model.dtype if dtype is None else dtype,
                               kv_cache_dtype=check_kv_cache_dtype(kv_cache_dtype))


def default_prefill_chunk(batch: int) -> int:
    """Prefill chunk width for ``batch`` sequences: :data:`FLASH_PREFILL_TOKENS` / batch where prefill runs on
    flash attention (GPUs with the fast kernels), else :data:`REFERENCE_PREFILL_CHUNK`."""
    if jax.default_backend() == "gpu" and attention.fast_path():
        return max(REFERENCE_PREFILL_CHUNK, FLASH_PREFILL_TOKENS // max(1, int(batch)) // 1024 * 1024)
    return REFERENCE_PREFILL_CHUNK


def bucket(n: int, lo: int = 16, hi: int = REFERENCE_PREFILL_CHUNK) -> int:
    """A chunk width >= n, clipped to [lo, hi], from a coarse grid that bounds the number of compiled shapes:
    powers of two up to 512, then four steps per octave (512, 640, 768, 896, 1024, 1280, ...: at most 25% and
    typically about 12% of padding)."""
    n = int(n)
    if n <= 512:
        width = 1 << max(0, n - 1).bit_length()
    else:
        step = (1 << (n - 1).bit_length()) // 8  # a quarter of the largest power of two below n
        width = -(-n // step) * step
    return int(min(hi, max(lo, width)))


def plan_prefill(lengths: Sequence[int], chunk: int | None = DEFAULT_PREFILL_CHUNK) -> tuple[int, int]:
    """Chunk width and number of chunks that cover the longest prompt (``chunk=None``: the backend's default,
    :func:`default_prefill_chunk`)."""
    chunk = default_prefill_chunk(len(lengths)) if chunk is None else int(chunk)
    width = bucket(max(lengths), hi=chunk)
    return width, -(-max(lengths) // width)


def pad_prompts(prompts: Sequence[Sequence[int]], width: int, pad_id: int = 0) -> np.ndarray:
    """Right-pad prompts to ``[B, width]`` int32 (padding rows are written beyond each prompt and never read)."""
    out = np.full((len(prompts), width), pad_id, np.int32)
    for b, p in enumerate(prompts):
        out[b, : len(p)] = p
    return out


def prefill(model: TargetModel, cache: KVCache | HybridCache, prompts: Sequence[Sequence[int]], *,
            chunk: int | None = DEFAULT_PREFILL_CHUNK) -> tuple[jax.Array, KVCache | HybridCache]:
    """Chunked prefill of ragged prompts into a fresh cache.

    Args:
        prompts: ``B`` non-empty token-id lists (lengths may differ; ``B`` must equal ``cache.batch``).
        chunk: maximum chunk width (default: :func:`default_prefill_chunk`); a long prompt is processed ``chunk``
            tokens at a time, and no ``[T, T]`` score matrix is ever built (flash or tiled attention).
    Returns:
        ``(logits [B, V] of each prompt's last token, updated cache)``.
    """
    lengths = [len(p) for p in prompts]
    if len(prompts) != cache.batch:
        raise InputError(f"{len(prompts)} prompts for a cache of batch {cache.batch}")
    if min(lengths) == 0:
        raise InputError("a prompt is empty; every prompt needs at least one token")
    if max(lengths) > cache.capacity:
        raise InputError(f"a prompt of {max(lengths)} tokens does not fit the cache capacity of {cache.capacity}")
    for p in prompts:
        check_token_ids(p, model.config.vocab_size, "prompt")
    width, n_chunks = plan_prefill(lengths, chunk)
    tokens = pad_prompts(prompts, width * n_chunks)
    last = np.asarray(lengths) - 1
    logits = None
    for c in range(n_chunks):
        start = np.full(len(prompts), c * width, np.int32)
        rows = np.clip(last - c * width, 0, width - 1).astype(np.int32)[:, None]
        valid = np.clip(np.asarray(lengths) - c * width, 0, width).astype(np.int32)
        out, cache = step_fn(model.config, model.params, cache, jnp.asarray(tokens[:, c * width:(c + 1) * width]),
                             jnp.asarray(start), jnp.asarray(rows), num_valid=jnp.asarray(valid),
                             first_chunk=c == 0 and attention.fast_path())
        in_chunk = jnp.asarray((last >= c * width) & (last < (c + 1) * width))[:, None]
        logits = out.logits[:, 0] if logits is None else jnp.where(in_chunk, out.logits[:, 0], logits)
    return logits, cache


def decode(model: TargetModel, cache: KVCache | HybridCache, tokens: Any, start: Any
           ) -> tuple[jax.Array, KVCache | HybridCache]:
    """One cached step of ``T`` tokens per sequence; returns float32 logits ``[B, T, V]`` and the cache."""
    tokens = jnp.asarray(tokens, jnp.int32)
    b, t = tokens.shape
    rows = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out, cache = step_fn(model.config, model.params, cache, tokens, jnp.asarray(start, jnp.int32), rows)
    return out.logits, cache
