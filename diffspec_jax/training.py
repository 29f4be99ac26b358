"""Training utilities (optax + Orbax) and causal-LM training of a Llama target (used to build the demo pair).

* :class:`OptimConfig` / :func:`make_optimizer`: AdamW with linear warm-up and cosine decay, global-norm clipping.
* :class:`TokenStream`: random fixed-length windows of a token stream (host NumPy, seeded per step, so a resumed
  run sees the same batches).
* :func:`train_loop`: a jitted update step (float32 master params, bfloat16 compute by default), periodic
  logging and Orbax checkpoints of the whole training state, resumed automatically from the newest one.
* :func:`train_target`: next-token training of a Llama / Qwen3 target from scratch.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import struct
from tqdm.auto import tqdm

from diffspec_jax.cache import create_cache
from diffspec_jax.config import ModelConfig
from diffspec_jax.errors import ConfigError
from diffspec_jax.models import family
from diffspec_jax.validation import check_int, check_real


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with warm-up + cosine decay (defaults for small models)."""

    lr: float = 3e-3
    warmup_steps: int = 50
    total_steps: int = 1000
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0

    def __post_init__(self) -> None:
        check_real(self.lr, "optimiser lr", min=0.0, min_open=True)
        check_int(self.warmup_steps, "optimiser warmup_steps", min=0)
        check_int(self.total_steps, "optimiser total_steps", min=1)
        check_real(self.min_lr_ratio, "optimiser min_lr_ratio", min=0.0)
        check_real(self.weight_decay, "optimiser weight_decay", min=0.0)
        check_real(self.b1, "optimiser b1", min=0.0, max=1.0, max_open=True)
        check_real(self.b2, "optimiser b2", min=0.0, max=1.0, max_open=True)
        check_real(self.clip_norm, "optimiser clip_norm", min=0.0, min_open=True)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=max(1, cfg.warmup_steps),
        decay_steps=max(cfg.total_steps, cfg.warmup_steps + 1), end_value=cfg.lr * cfg.min_lr_ratio)
    decay_mask = lambda params: jax.tree_util.tree_map(lambda x: x.ndim >= 2, params)  # noqa: E731  no decay on norms
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                       optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask))


class TokenStream:
    """Random windows of ``length`` tokens from a 1-D int32 stream (documents joined by an EOS separator).

    Args:
        documents: int token arrays, one per document.
        eos_id: the separator put after every document.
        recall_fraction: the fraction of windows (0 to 1, default 0: plain windows) that get one **recall span**:
            a passage of the window copied to a later place in the same window (overwriting what was there), at
            any distance the window allows, so a model trained on them learns to continue a passage it has seen
            earlier in its context (quoting a document, re-emitting a file to edit it: the case target-guided
            retrieval serves). Natural code repeats little verbatim from far back.
        recall_span: (shortest, longest) copied passage in tokens, capped at a quarter of the window.
        recall_distance: the shortest distance from the passage's start to its copy's start, as a share of the
            window (0 to 0.75, default 0: any distance, so mostly short ones). Long-context recall (a file re-emitted
            12-16K tokens after it was read) needs long distances, which uniform placement rarely draws.
        recall_noise: the share of the passage's tokens first replaced by tokens drawn at random from the stream
            (its unigram distribution; default 0: verbatim). A model that has memorised its training text predicts
            a verbatim repeat from memory and learns no copying from it; replaced tokens are predictable only by
            copying.
        recall_random: the share of recall spans (0 to 1, default 0) whose whole passage is first replaced by token
            ids drawn uniformly from ``[1, vocab_size)``, as a copy probe's random passages are: text no memory or
            language prior predicts, so the only way to predict its copy is to find the passage and read it (the
            induction a real LLM does on identifiers, hashes and numbers it has seen once).
        vocab_size: the tokenizer's vocabulary (required when ``recall_random`` > 0).
        recall_uniform: draw each recall span's distance uniformly over what the window allows (from
            ``recall_distance`` up), then place it (default False: the source, then the copy, uniform, which makes
            short distances common and the longest rare). A target meant to copy from 14K tokens back in a 16K window
            sees such distances about ten times as often with it.
        recall_mismatch: the share of the **copy's** tokens replaced after copying, by tokens drawn at random from
            the stream (default 0: the copy equals its source). Past each replaced token the copy goes on following
            its source, so a model trained on them keeps copying after a token that does not match, as a free-running
            copy must after the model's own first wrong guess (verbatim copies teach it to give the copy up there).
        recall_spans: recall spans per window that gets them (default 1). More spans put more copied tokens in
            each step; a span whose source or copy would overlap an earlier span's is drawn again (up to 8 tries,
            then left out), so every copy still matches its source.
    """

    def __init__(self, documents: list[np.ndarray], eos_id: int, recall_fraction: float = 0.0,
                 recall_span: tuple[int, int] = (128, 1024), recall_noise: float = 0.0,
                 recall_distance: float = 0.0, recall_random: float = 0.0, vocab_size: int | None = None,
                 recall_uniform: bool = False, recall_mismatch: float = 0.0, recall_spans: int = 1):
        for name, value in (("recall_fraction", recall_fraction), ("recall_distance", recall_distance),
                            ("recall_noise", recall_noise), ("recall_random", recall_random),
                            ("recall_mismatch", recall_mismatch)):
            check_real(value, name)
        if (not isinstance(recall_span, (tuple, list)) or len(recall_span) != 2
                or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in recall_span)):
            raise ConfigError(f"recall_span must be (shortest, longest) in tokens, got {recall_span!r}")
        check_int(eos_id, "eos_id", min=0)
        if not 0.0 <= recall_fraction <= 1.0:
            raise ConfigError(f"recall_fraction must be in [0, 1], got {recall_fraction}")
        if not 0.0 <= recall_distance <= 0.75:
            raise ConfigError(f"recall_distance must be in [0, 0.75] (a share of the window), got {recall_distance}")
        if not 0.0 <= recall_noise <= 1.0:
            raise ConfigError(f"recall_noise must be in [0, 1], got {recall_noise}")
        if not 0.0 <= recall_random <= 1.0:
            raise ConfigError(f"recall_random must be in [0, 1], got {recall_random}")
        if not 0.0 <= recall_mismatch < 1.0:
            raise ConfigError(f"recall_mismatch must be in [0, 1) (a share of the copy's tokens), got "
                              f"{recall_mismatch}")
        check_int(vocab_size, "vocab_size", min=2, none_ok=True)
        check_int(recall_spans, "recall_spans", min=1)
        if recall_random > 0 and vocab_size is None:
            raise ConfigError("recall_random > 0 draws token ids from the vocabulary: give vocab_size")
        if not 1 <= recall_span[0] <= recall_span[1]:
            raise ConfigError(f"recall_span must be (shortest, longest) with 1 <= shortest <= longest, got "
                              f"{recall_span}")
        parts = []
        for d in documents:
            parts.extend([np.asarray(d, np.int32), np.array([eos_id], np.int32)])
        self.tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        self.recall_fraction = float(recall_fraction)
        self.recall_span = (int(recall_span[0]), int(recall_span[1]))
        self.recall_noise = float(recall_noise)
        self.recall_distance = float(recall_distance)
        self.recall_random = float(recall_random)
        self.vocab_size = vocab_size
        self.recall_uniform = bool(recall_uniform)
        self.recall_mismatch = float(recall_mismatch)
        self.recall_spans = int(recall_spans)

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, step: int, batch: int, length: int, seed: int = 0) -> np.ndarray:
        """``[batch, length]`` windows, a deterministic function of (seed, step) (recall spans included)."""
        if len(self.tokens) < length + 1:
            raise ConfigError(f"the token stream ({len(self.tokens)} tokens) is shorter than a window ({length})")
        rng = np.random.default_rng([seed, step])
        starts = rng.integers(0, len(self.tokens) - length, batch)
        out = np.stack([self.tokens[s:s + length] for s in starts])
        if self.recall_fraction > 0:
            for row in out:
                if rng.random() < self.recall_fraction:
                    taken: list[tuple[int, int]] = []  # [start, end) of every source and copy placed so far
                    for _ in range(self.recall_spans):
                        span = self._free_span(rng, length, taken)
                        if span is not None:
                            src, dst, n = span
                            self._copy(rng, row, src, dst, n)
                            taken += [(src, src + n), (dst, dst + n)]
        return out

    def _free_span(self, rng: np.random.Generator, length: int,
                   taken: list[tuple[int, int]]) -> tuple[int, int, int] | None:
        """A recall span (:func:`recall_span_of`) whose source and copy overlap nothing in ``taken``; None after 8
        tries (one draw when ``taken`` is empty, so a single span per window draws as it always did)."""
        for _ in range(8 if taken else 1):
            span = recall_span_of(rng, length, self.recall_span, self.recall_distance, self.recall_uniform)
            if span is None:
                return None
            src, dst, n = span
            if all(e <= a or b <= s for a, b in ((src, src + n), (dst, dst + n)) for s, e in taken):
                return span
        return None

    def _copy(self, rng: np.random.Generator, row: np.ndarray, src: int, dst: int, n: int) -> None:
        """Copy ``row[src:src + n]`` to ``row[dst:dst + n]`` in place, with this stream's random passages, noise
        and mismatches."""
        if self.recall_random > 0 and rng.random() < self.recall_random:
            row[src:src + n] = rng.integers(1, self.vocab_size, n)
        noisy = src + np.flatnonzero(rng.random(n) < self.recall_noise)
        row[noisy] = self.tokens[rng.integers(0, len(self.tokens), len(noisy))]
        row[dst:dst + n] = row[src:src + n]
        if self.recall_mismatch > 0:  # (no draw otherwise: earlier builds' batches stay as they were)
            miss = dst + np.flatnonzero(rng.random(n) < self.recall_mismatch)
            row[miss] = self.tokens[rng.integers(0, len(self.tokens), len(miss))]


def recall_span_of(rng: np.random.Generator, length: int, span: tuple[int, int], min_distance: float = 0.0,
                   uniform_distance: bool = False) -> tuple[int, int, int] | None:
    """(source, destination, tokens) of one recall span in a window of ``length`` tokens: the passage
    ``[source, source + tokens)`` is copied to ``[destination, destination + tokens)``, entirely after it and at
    least ``ceil(min_distance * length)`` tokens after its start (``min_distance`` <= 0.75); the source, then the
    destination, are uniform over what the window allows, or with ``uniform_distance`` the distance is, then the
    source. None when the window is too short for the shortest span."""
    longest = min(span[1], length // 4)
    if longest < span[0]:
        return None
    n = int(rng.integers(span[0], longest + 1))
    gap = max(n, math.ceil(min_distance * length))
    if uniform_distance:
        distance = int(rng.integers(gap, length - n + 1))
        src = int(rng.integers(0, length - n - distance + 1))
        return src, src + distance, n
    src = int(rng.integers(0, length - n - gap + 1))
    dst = int(rng.integers(src + gap, length - n + 1))
    return src, dst, n


@dataclass(frozen=True)
class LoopWindows:
    """Windows of ``stream`` beside a few **loop rows**, for training a target out of greedy loops (the DITTO
    objective of Xu et al., "Learning to Break the Loop", NeurIPS 2022, in our own form).

    A small model that copies well also repeats itself when decoding greedily: once a line recurs, copying it again
    looks likelier each time. Each loop row is a plain window of ``loop_len + 1`` tokens (the model reads
    ``loop_len``, like the ``seq_len + 1`` of :func:`train_target`'s windows) whose tail, from a random place
    in its second half, repeats the ``period`` tokens before that place over and over (``period`` drawn from
    ``loop_span``; a greedy loop's period is often 1-6 tokens, so the default starts at 1). :func:`loop_loss` then
    asks the model to give each repeated token ``decay`` times the probability it gave the same token one period
    earlier, so every further repetition is less likely than the one before. Far-back copies (recall spans) are
    not loops: their source is thousands of tokens away, not one period.

    ``batch`` returns ``{"tokens": [batch, length], "loop": [rows, loop_len + 1], "period": [rows, loop_len + 1]}``
    (``period[r, t]`` = the period where token t repeats token t - period, else 0), a deterministic function of
    (seed, step) like :meth:`TokenStream.batch`.
    """

    stream: TokenStream
    rows: int = 4
    loop_len: int = 1024
    loop_span: tuple[int, int] = (1, 64)
    decay: float = 0.5
    weight: float = 1.0

    def __post_init__(self) -> None:
        check_int(self.rows, "loop rows", min=1)
        check_int(self.loop_len, "loop_len", min=4)
        if (not isinstance(self.loop_span, (tuple, list)) or len(self.loop_span) != 2
                or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in self.loop_span)
                or not 1 <= self.loop_span[0] <= self.loop_span[1] or 4 * self.loop_span[1] > self.loop_len):
            raise ConfigError(f"loop_span must be (shortest, longest) periods with 1 <= shortest <= longest <= "
                              f"loop_len / 4 = {self.loop_len // 4}, got {self.loop_span!r}")
        check_real(self.decay, "loop decay", min=0.0, max=1.0)
        check_real(self.weight, "loop weight", min=0.0)

    def batch(self, step: int, batch: int, length: int, seed: int = 0) -> dict[str, np.ndarray]:
        return {"tokens": self.stream.batch(step, batch, length, seed), **self.rows_at(step, seed)}

    def rows_at(self, step: int, seed: int = 0) -> dict[str, np.ndarray]:
        """This step's loop rows alone: ``{"loop", "period"}`` as in :meth:`batch`."""
        size = self.loop_len + 1  # the model reads loop_len tokens and predicts the next of each
        loop = self.stream.batch(step, self.rows, size, seed=seed + 7919)  # other windows than tokens'
        period = np.zeros_like(loop)
        rng = np.random.default_rng([seed, step, 1])
        for row, per in zip(loop, period):
            n = int(rng.integers(self.loop_span[0], self.loop_span[1] + 1))
            start = int(rng.integers(max(n, size // 2), size - 2 * n + 1))
            tail = np.resize(row[start - n:start], size - start)  # the period before, tiled
            row[start:] = tail
            per[start:] = n
        return {"loop": loop, "period": period}


def loop_loss(logp, tokens, period, decay: float):
    """The loop penalty of :class:`LoopWindows`: mean over repeated tokens of ``-log(1 - |p_t - decay * p_{t-n}|)``.

    Args:
        logp: float ``[R, T - 1, V]`` log-probabilities the model gives each next token of ``tokens``.
        tokens, period: int ``[R, T]`` (period n > 0 where token t repeats token t - n).
    Returns:
        the scalar penalty (0 when no token repeats); ``p_{t-n}``, the earlier probability, is held fixed.
    """
    p = jnp.exp(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0])  # [R, T - 1]: p(token t + 1)
    n = period[:, 1:]
    t = jnp.arange(p.shape[1])[None, :]
    earlier = jax.lax.stop_gradient(jnp.take_along_axis(p, jnp.maximum(t - n, 0), axis=1))
    mask = (n > 0) & (t - n >= 0)
    term = -jnp.log(jnp.clip(1.0 - jnp.abs(p - decay * earlier), 1e-6, 1.0))
    return jnp.sum(jnp.where(mask, term, 0.0)) / jnp.maximum(jnp.sum(mask), 1)



@dataclass(frozen=True)
class GreedyUnlikelihood:
    """Sequence-level unlikelihood on the model's **own greedy writing**, against greedy loops (after Welleck et
    al., "Neural Text Generation with Unlikelihood Training", ICLR 2020, in our own form).

    Each training step draws ``rows`` windows of ``context`` tokens from ``stream`` as prompts; the model being
    trained continues each greedily for ``new_tokens`` tokens (inside the jitted step, from its current weights,
    no gradient through the choice); every generated token that completes an ``ngram``-gram already generated
    earlier in the same continuation is a negative, and :func:`greedy_unlikelihood_loss` adds
    ``-log(1 - p(token))`` for it. Unlike :class:`LoopWindows`, whose loops are constructed, these are the loops the
    model really falls into, of whatever period. Repeats of the prompt are not negatives (copying earlier context
    is what the recall spans teach).

    Cost per step: a prefill of ``rows x context`` tokens and ``new_tokens`` single-token decode steps (with a
    K/V cache), then one forward pass over ``rows x (context + new_tokens)`` for the penalty's gradient.
    """

    stream: TokenStream
    rows: int = 4
    context: int = 256
    new_tokens: int = 64
    ngram: int = 4
    weight: float = 1.0

    def __post_init__(self) -> None:
        check_int(self.rows, "unlikelihood rows", min=1)
        check_int(self.context, "unlikelihood context", min=1)
        check_int(self.new_tokens, "unlikelihood new_tokens", min=2)
        check_int(self.ngram, "unlikelihood ngram", min=1, max=self.new_tokens - 1,
                  hint=" (an n-gram must fit twice in the continuation)")
        check_real(self.weight, "unlikelihood weight", min=0.0)

    def rows_at(self, step: int, seed: int = 0) -> dict[str, np.ndarray]:
        """This step's prompts: ``{"prompts": int32 [rows, context]}`` (other windows than the LM batch's)."""
        return {"prompts": self.stream.batch(step, self.rows, self.context, seed=seed + 104729)}


def repeated_ngrams(tokens, n: int):
    """bool ``[R, N]``: token i of each row completes an ``n``-gram (tokens ``i - n + 1 .. i``) that also ends at
    some earlier j < i of the same row (``tokens``: int ``[R, N]``)."""
    N = tokens.shape[1]
    same = tokens[:, :, None] == tokens[:, None, :]  # [R, i, j]
    run = same
    for k in range(1, n):  # token i - k equals token j - k, for every k < n
        run = run & jnp.pad(same, ((0, 0), (k, 0), (k, 0)))[:, :N, :N]
    i = jnp.arange(N)[:, None]
    j = jnp.arange(N)[None, :]
    return jnp.any(run & (j < i) & (j >= n - 1), axis=2)


def greedy_continuation(config: ModelConfig, params, prompts, new_tokens: int, *, compute_dtype=jnp.bfloat16):
    """int ``[R, new_tokens]`` greedy continuations of ``prompts [R, C]`` with a K/V cache: one prefill step over the
    prompts, then one single-token step per generated token (the engine's own :func:`step`), so a long prompt
    costs one forward pass rather than one per token. No gradient."""
    R, C = prompts.shape
    p = cast_floats(jax.lax.stop_gradient(params), compute_dtype)
    step = family(config).step
    cache = create_cache(config, R, C + new_tokens, compute_dtype)
    out, cache = step(config, p, cache, prompts.astype(jnp.int32), jnp.zeros((R,), jnp.int32),
                      jnp.full((R, 1), C - 1, jnp.int32), first_chunk=True)
    first = jnp.argmax(out.logits[:, 0], axis=-1).astype(jnp.int32)
    zero_row = jnp.zeros((R, 1), jnp.int32)

    def body(i, carry):
        cache, tok, gen = carry
        gen = jax.lax.dynamic_update_index_in_dim(gen, tok, i, axis=1)
        out, cache = step(config, p, cache, tok[:, None], jnp.full((R,), C + i, jnp.int32), zero_row)
        return cache, jnp.argmax(out.logits[:, 0], axis=-1).astype(jnp.int32), gen

    gen = jnp.zeros((R, new_tokens), jnp.int32)
    _, last, gen = jax.lax.fori_loop(0, new_tokens - 1, body, (cache, first, gen))
    return jax.lax.dynamic_update_index_in_dim(gen, last, new_tokens - 1, axis=1).astype(prompts.dtype)


def greedy_unlikelihood_loss(logp, generated, n: int):
    """-log(1 - p) mean over the generated tokens that repeat an ``n``-gram of their own continuation.

    Args:
        logp: float ``[R, N, V]``: the log-probabilities the model gives each generated token's position.
        generated: int ``[R, N]`` greedy tokens.
    Returns:
        (penalty, share of generated tokens that repeat an n-gram) as scalars.
    """
    rep = repeated_ngrams(generated, n)
    p = jnp.exp(jnp.take_along_axis(logp, generated[..., None], axis=-1)[..., 0])
    term = -jnp.log(jnp.clip(1.0 - p, 1e-6, 1.0))
    return jnp.sum(jnp.where(rep, term, 0.0)) / jnp.maximum(jnp.sum(rep), 1), jnp.mean(rep)


@struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any


def _manager(path: Path, keep: int = 2):
    return ocp.CheckpointManager(path.absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=keep))


def checkpoint_steps(ckpt_dir: str | Path) -> list[int]:
    """The steps of the Orbax checkpoints in ``ckpt_dir``, ascending (``[]`` when it does not exist or holds none);
    reads only.

    Raises:
        ConfigError: ``ckpt_dir`` is not a directory, or holds an entry named like a step (``1``, ``200``) that is no
            Orbax checkpoint: Orbax would fail to restore it, or delete it as an old step.
    """
    d = Path(ckpt_dir)
    if not d.exists():
        return []
    if not d.is_dir():
        raise ConfigError(f"checkpoint directory {d} exists and is not a directory; choose another one")
    steps = []
    for p in d.iterdir():
        if not p.name.isdigit():
            continue
        if not ((p / "_CHECKPOINT_METADATA").is_file() and (p / "default" / "_METADATA").is_file()):
            raise ConfigError(f"checkpoint directory {d} holds {p.name}{'/' if p.is_dir() else ''}, named like a "
                              f"training step but not an Orbax checkpoint of one; choose a new or empty checkpoint "
                              f"directory (training would write among these files and delete old steps)")
        steps.append(int(p.name))
    return sorted(steps)


def check_resume(ckpt_dir: str | Path | None, shapes: Any, steps: int, *, hint: str = "") -> int | None:
    """The step that :func:`train_loop` resumes from (``None``: it starts afresh), checked before anything is
    written: every step-named entry is an Orbax checkpoint, the newest one holds parameters of exactly ``shapes``
    (the trained params as a pytree of shape tuples) and lies at or before ``steps``; reads only.

    Raises:
        ConfigError: naming the first problem (``hint`` is appended to a parameter mismatch).
    """
    found = checkpoint_steps(ckpt_dir) if ckpt_dir is not None else []
    if not found:
        return None
    latest = found[-1]
    where = Path(ckpt_dir) / str(latest)
    if latest > steps:
        raise ConfigError(f"the newest checkpoint in {ckpt_dir} is at step {latest}, past the {steps} steps asked "
                          f"for: ask for at least {latest} steps to continue that run, or choose another checkpoint "
                          f"directory")
    try:
        tree = ocp.StandardCheckpointer().metadata((where / "default").absolute()).item_metadata.tree["params"]
        held = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in
                jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]}
    except Exception as exc:  # orbax raises many types for damaged metadata
        raise ConfigError(f"cannot read the checkpoint {where} ({type(exc).__name__}: {exc}); it is damaged or not a "
                          f"training checkpoint: choose another checkpoint directory") from None
    want = {jax.tree_util.keystr(k): tuple(v) for k, v in
            jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))[0]}
    diffs = [f"{k}: {held.get(k, 'absent')} there, {want.get(k, 'absent')} here" for k in sorted(set(held) | set(want))
             if held.get(k) != want.get(k)]
    if diffs:
        shown = "; ".join(diffs[:4]) + ("; ..." if len(diffs) > 4 else "")
        raise ConfigError(f"the checkpoint {where} holds parameters of another shape than this run's ({shown}){hint}; "
                          f"choose another checkpoint directory, or the settings of the run that wrote it")
    return latest


def train_loop(loss_fn: Callable, params: Any, stream: TokenStream, *, steps: int, batch: int, length: int,
               optim: OptimConfig, frozen: Any = None, ckpt_dir: str | Path | None = None, ckpt_every: int = 200,
               log_every: int = 20, seed: int = 0, eval_fn: Callable | None = None, eval_every: int = 0,
               progress: bool = True) -> tuple[Any, list[dict]]:
    """Minimise ``loss_fn(params, frozen, tokens [batch, length]) -> (loss, metrics dict)`` with AdamW (``tokens``:
    whatever ``stream.batch`` returns, an array or a pytree of arrays such as :class:`LoopWindows`' dict).

    ``frozen`` (e.g. a frozen target's params) is passed to the jitted step as an argument, never captured.

    Resumes from the newest Orbax checkpoint in ``ckpt_dir`` when there is one (the data order is a function
    of the step, so a resumed run continues exactly; :func:`check_resume` first). Returns the final params and the
    logged history.

    Raises:
        ConfigError: ``ckpt_dir`` holds something else than checkpoints of these params, or steps past ``steps``.
    """
    tx = make_optimizer(optim)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
    mgr = None
    if ckpt_dir is not None:
        latest = check_resume(ckpt_dir, jax.tree_util.tree_map(lambda x: tuple(x.shape), params), steps)
        mgr = _manager(Path(ckpt_dir))
        if latest is not None:
            abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
            state = mgr.restore(latest, args=ocp.args.StandardRestore(abstract))

    @jax.jit
    def update(state: TrainState, frozen, tokens):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, frozen, tokens)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), {
            "loss": loss, "grad_norm": optax.global_norm(grads), **metrics}

    history: list[dict] = []
    start = int(state.step)
    bar = None
    if progress:
        bar = tqdm(total=steps, initial=start, unit="step", leave=False)
    t0 = time.perf_counter()
    for step in range(start, steps):
        state, metrics = update(state, frozen, jax.tree_util.tree_map(jnp.asarray,
                                                                     stream.batch(step, batch, length, seed)))
        if bar is not None:
            bar.update(1)
        last = step + 1 == steps
        if (step + 1) % log_every == 0 or last or step == start:
            row = {"step": step + 1, "time_s": time.perf_counter() - t0,
                   **{k: float(v) for k, v in metrics.items()}}
            if eval_fn is not None and eval_every and ((step + 1) % eval_every == 0 or last):
                row.update(eval_fn(state.params))
            history.append(row)
            if bar is not None:
                bar.set_postfix(loss=f"{row['loss']:.3f}")
        if mgr is not None and ((step + 1) % ckpt_every == 0 or last):
            mgr.save(step + 1, args=ocp.args.StandardSave(state))
    if mgr is not None:
        mgr.wait_until_finished()
        mgr.close()
    if bar is not None:
        bar.close()
    return state.params, history


def cast_floats(tree: Any, dtype) -> Any:
    """Floating leaves cast to ``dtype`` (integer leaves such as d2t untouched)."""
    return jax.tree_util.tree_map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def next_logp(config: ModelConfig, params, tokens, *, attention: str = "dense", compute_dtype=jnp.bfloat16):
    """float32 log-probabilities ``[B, T - 1, V]`` of each next token of ``tokens [B, T]`` (float32 master params
    cast to ``compute_dtype``)."""
    logits = family(config).forward(config, cast_floats(params, compute_dtype), tokens[:, :-1], attention=attention)
    return jax.nn.log_softmax(logits, axis=-1)  # (the LM head accumulates logits in float32)


def lm_loss(config: ModelConfig, params, tokens, *, attention: str = "dense", compute_dtype=jnp.bfloat16,
            loops: LoopWindows | None = None, unlikelihood: GreedyUnlikelihood | None = None):
    """Mean next-token cross-entropy of ``tokens [B, T]``.

    With ``loops`` or ``unlikelihood``, ``tokens`` is an :class:`Objectives` batch (``{"tokens": [B, T], ...}``)
    and ``loops.weight`` x :func:`loop_loss` of its loop rows, ``unlikelihood.weight`` x
    :func:`greedy_unlikelihood_loss` of the model's greedy continuations of its prompts, are added.
    """
    batch = tokens
    tokens = batch["tokens"] if isinstance(batch, dict) else batch
    logp = next_logp(config, params, tokens, attention=attention, compute_dtype=compute_dtype)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    loss = jnp.mean(nll)
    metrics = {"perplexity": jnp.exp(loss)}
    if loops is not None:
        penalty = loop_loss(next_logp(config, params, batch["loop"], attention=attention,
                                      compute_dtype=compute_dtype), batch["loop"], batch["period"], loops.decay)
        loss, metrics = loss + loops.weight * penalty, {**metrics, "loop_loss": penalty}
    if unlikelihood is not None:
        prompts = batch["prompts"]
        gen = greedy_continuation(config, params, prompts, unlikelihood.new_tokens, compute_dtype=compute_dtype)
        seq = jnp.concatenate([prompts, gen], axis=1)
        logits = family(config).forward(config, cast_floats(params, compute_dtype), seq, attention="dense")
        logp_gen = jax.nn.log_softmax(logits[:, prompts.shape[1] - 1:-1], axis=-1)  # predicts each generated token
        penalty, share = greedy_unlikelihood_loss(logp_gen, gen, unlikelihood.ngram)
        loss = loss + unlikelihood.weight * penalty
        metrics = {**metrics, "unlikelihood_loss": penalty, "greedy_repeat_share": share}
    return loss, metrics


class Objectives:
    """The batches :func:`train_target` trains on: ``stream``'s windows as ``{"tokens": ...}`` plus each extra
    objective's rows for the step (:meth:`LoopWindows.rows_at`, :meth:`GreedyUnlikelihood.rows_at`), all a
    deterministic function of (seed, step)."""

    def __init__(self, stream: TokenStream, *extras):
        self.stream, self.extras = stream, [e for e in extras if e is not None]

    def batch(self, step: int, batch: int, length: int, seed: int = 0) -> dict[str, np.ndarray] | np.ndarray:
        tokens = self.stream.batch(step, batch, length, seed)
        if not self.extras:
            return tokens
        out = {"tokens": tokens}
        for extra in self.extras:
            out.update(extra.rows_at(step, seed))
        return out


def train_target(config: ModelConfig, stream: TokenStream, *, steps: int, batch: int, seq_len: int,
                 optim: OptimConfig | None = None, ckpt_dir: str | Path | None = None, seed: int = 0,
                 attention: str = "dense", compute_dtype=jnp.bfloat16, init_scale: float | None = None,
                 eval_stream: TokenStream | None = None, eval_every: int = 0, log_every: int = 20,
                 progress: bool = True, params: dict | None = None, loops: LoopWindows | None = None,
                 unlikelihood: GreedyUnlikelihood | None = None) -> tuple[dict, list[dict]]:
    """Train a Llama-architecture target on ``stream`` windows of ``seq_len + 1`` tokens, from scratch or from
    ``params`` (float32, e.g. an earlier phase on shorter windows); with ``loops`` (a :class:`LoopWindows` over
    ``stream``), its loop rows are trained out of repeating themselves beside them; with ``unlikelihood`` (a
    :class:`GreedyUnlikelihood` over ``stream``), so is its own greedy writing.

    Returns float32 params (export with :func:`checkpoints_tools.hf.save_hf`) and the training history.
    """
    if family(config).name != "llama":
        raise ConfigError(f"train_target trains Llama / Qwen3 targets from scratch, not {config.architecture}")
    optim = optim or OptimConfig(total_steps=steps)
    if params is None:
        scale = init_scale if init_scale is not None else 1.0 / math.sqrt(config.hidden_size)
        params = family(config).init_params(config, seed=seed, dtype=jnp.float32, scale=scale)
        params = jax.tree_util.tree_map(
            lambda p: jnp.ones_like(p) if p.ndim == 1 else p, params)  # norm weights start at 1 for training
    for name, extra in (("loops", loops), ("unlikelihood", unlikelihood)):
        if extra is not None and extra.stream is not stream:
            raise ConfigError(f"{name} must draw its windows from the stream being trained on")
    loss_fn = lambda p, _, toks: lm_loss(config, p, toks, attention=attention, compute_dtype=compute_dtype,  # noqa
                                         loops=loops, unlikelihood=unlikelihood)
    eval_loss_fn = lambda p, toks: lm_loss(config, p, toks, attention=attention,  # noqa: E731
                                           compute_dtype=compute_dtype)[0]

    eval_fn = None
    if eval_stream is not None and eval_every:
        held = jnp.asarray(eval_stream.batch(0, batch, seq_len + 1, seed=seed + 1))
        eval_loss = jax.jit(lambda p: eval_loss_fn(p, held))
        eval_fn = lambda p: {"eval_loss": float(eval_loss(p))}  # noqa: E731
    return train_loop(loss_fn, params, Objectives(stream, loops, unlikelihood), steps=steps, batch=batch,
                      length=seq_len + 1, optim=optim, ckpt_dir=ckpt_dir, seed=seed, eval_fn=eval_fn,
                      eval_every=eval_every, log_every=log_every, progress=progress)
