"""Token selection from logits: temperature, top-k and top-p processing, greedy choice and sampling.

The processed distribution (``logits / T``, then top-k, then top-p on the renormalised top-k set, then softmax)
is the *same* function for the target-only baseline and for speculative verification, so both sample from one
distribution. :class:`SamplingRows` holds the same parameters per batch row (the server's slots, each with its own
request's settings and seed): :func:`processed_logprobs_rows` and :func:`choose_rows` apply them row by row.

Temperatures below :data:`~diffspec_jax.config.GREEDY_TEMPERATURE` (1e-5) are greedy: :class:`SamplingConfig` stores
them as 0, so :func:`choose` takes the argmax instead of dividing the logits by a temperature that can overflow
them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from diffspec_jax.config import SamplingConfig

_MASKED = -jnp.inf


def processed_logprobs(logits: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """Log-probabilities of the processed distribution, float32 ``[..., V]`` (``-inf`` for filtered tokens).

    Greedy configs (temperature 0, which every temperature below ``GREEDY_TEMPERATURE`` becomes) use temperature
    1 here; greedy decisions never call this.
    """
    x = logits.astype(jnp.float32) / (sampling.temperature or 1.0)
    if sampling.top_k and sampling.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, sampling.top_k)[0][..., -1:]
        x = jnp.where(x < kth, _MASKED, x)
    if sampling.top_p < 1.0:
        x = jnp.where(x < _nucleus_threshold(x, sampling.top_p), _MASKED, x)
    return jax.nn.log_softmax(x, axis=-1)


def _nucleus_threshold(x: jax.Array, top_p) -> jax.Array:
    """The smallest logit top-p keeps, ``[..., 1]``: tokens by descending ``x`` until the mass strictly above one
    reaches ``top_p`` (a float, or an array broadcasting against ``[..., 1]``). The most likely token is always
    kept (a top_p such as 1e-300 is 0 in float32 and would keep none)."""
    sorted_x = jnp.sort(x, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_x, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
    keep = (before < top_p).at[..., 0].set(True)
    return jnp.min(jnp.where(keep, sorted_x, jnp.inf), axis=-1, keepdims=True)


def choose(key: jax.Array, logits: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """Greedy argmax (temperature 0 or below ``GREEDY_TEMPERATURE``) or a sample of the processed distribution;
    int32 ``[...]``."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, processed_logprobs(logits, sampling), axis=-1).astype(jnp.int32)


def exponential_race(key: jax.Array, weights: jax.Array) -> jax.Array:
    """Sample ``i`` with probability ``weights[i] / sum(weights)`` as ``argmax(weights / E)``, ``E ~ Exp(1)``.

    Needs no normalisation (the recovered-token draw of rejection sampling). weights ``[..., V]`` >= 0.
    """
    e = jax.random.exponential(key, weights.shape, jnp.float32)
    return jnp.argmax(weights / e, axis=-1).astype(jnp.int32)


# ------------------------------------------------------------------------------------ per-row sampling (serving)
@struct.dataclass
class SamplingRows:
    """Sampling parameters and RNG per batch row (a request slot of the server), beside the static
    :class:`SamplingConfig` of a run: greedy rows (temperature 0) and sampled rows share one batch.

    Attributes:
        temperature: float32 ``[B]`` (0 = greedy; the host stores what :class:`SamplingConfig` normalises);
        top_k: int32 ``[B]`` (0 = off); top_p: float32 ``[B]`` (1 = off);
        key: uint32 ``[B, 2]`` each row's own PRNG key (from its request's seed, :func:`seed_key`).
        replay: int32 ``[B, C]`` a row's tokens by absolute position (``C`` the cache capacity) and
            replay_end: int32 ``[B]``: the row emits ``replay[p]`` at every position ``p < replay_end`` whatever the
            target would choose (0: nothing forced). A preempted request recomputes what it had generated this way,
            through the same verify steps that produced it (:func:`replayed`).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    key: jax.Array
    replay: jax.Array
    replay_end: jax.Array

    @classmethod
    def create(cls, batch: int, capacity: int = 1) -> SamplingRows:
        """``batch`` greedy rows with zero keys and nothing to replay (``capacity``: the replay buffer's width)."""
        return cls(temperature=jnp.zeros((batch,), jnp.float32), top_k=jnp.zeros((batch,), jnp.int32),
                   top_p=jnp.ones((batch,), jnp.float32), key=jnp.zeros((batch, 2), jnp.uint32),
                   replay=jnp.zeros((batch, capacity), jnp.int32), replay_end=jnp.zeros((batch,), jnp.int32))

    @property
    def greedy(self) -> jax.Array:
        """bool ``[B]``: the rows that take the argmax."""
        return self.temperature <= 0.0

    def replayed(self, positions: jax.Array, tokens: jax.Array) -> jax.Array:
        """``tokens`` (int32, ``positions``' shape ``[B, ...]``) with each position below its row's ``replay_end``
        replaced by the replayed token there."""
        b = positions.shape[0]
        flat = positions.reshape(b, -1)
        got = jnp.take_along_axis(self.replay, jnp.clip(flat, 0, self.replay.shape[1] - 1), axis=1)
        forced = flat < self.replay_end[:, None]
        return jnp.where(forced, got, tokens.reshape(b, -1)).reshape(tokens.shape)


def seed_key(seed: int):
    """The raw threefry key ``uint32 [2]`` of a non-negative 64-bit ``seed`` (NumPy, no device work): what
    ``jax.random.PRNGKey(seed)`` gives for such seeds."""
    seed = int(seed)
    if not 0 <= seed < 2 ** 64:
        raise ValueError(f"seed must lie in [0, 2**64), got {seed}")
    return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)


def split_rows(keys: jax.Array, n: int = 2) -> tuple[jax.Array, ...]:
    """Split every row's key: ``keys [B, 2]`` -> ``n`` arrays ``[B, 2]``."""
    parts = jax.vmap(lambda k: jax.random.split(k, n))(keys)
    return tuple(parts[:, i] for i in range(n))


def _per_row(x: jax.Array, ndim: int) -> jax.Array:
    return x.reshape(x.shape[:1] + (1,) * (ndim - 1))


def processed_logprobs_rows(logits: jax.Array, rows: SamplingRows) -> jax.Array:
    """:func:`processed_logprobs` with each row's own temperature, top-k and top-p; ``logits [B, ..., V]``.

    The same function per row as the static one (the k-th largest value is the top-k threshold, top-p runs on the
    renormalised top-k set and always keeps the argmax); greedy rows use temperature 1, as there. The sorts over
    the vocabulary that top-k and top-p need run only when some row asks for them (a batch of plain-temperature
    rows, the server's default, skips them)."""
    nd = logits.ndim
    v = logits.shape[-1]
    temp = jnp.where(rows.temperature > 0, rows.temperature, 1.0)
    x = logits.astype(jnp.float32) / _per_row(temp, nd)
    k = jnp.where((rows.top_k > 0) & (rows.top_k < v), rows.top_k, v)

    def top_k(x):
        desc = -jnp.sort(-x, axis=-1)
        kth = jnp.take_along_axis(desc, jnp.broadcast_to(_per_row(k - 1, nd), x.shape[:-1] + (1,)), axis=-1)
        return jnp.where(x < kth, _MASKED, x)

    def top_p(x):
        threshold = _nucleus_threshold(x, _per_row(rows.top_p, nd))
        return jnp.where(_per_row(rows.top_p < 1.0, nd) & (x < threshold), _MASKED, x)

    x = jax.lax.cond(jnp.any(k < v), top_k, lambda x: x, x)
    x = jax.lax.cond(jnp.any(rows.top_p < 1.0), top_p, lambda x: x, x)
    return jax.nn.log_softmax(x, axis=-1)


def choose_rows(keys: jax.Array, logits: jax.Array, rows: SamplingRows) -> jax.Array:
    """Per row: the argmax (greedy rows) or a sample of the row's processed distribution drawn with its own key;
    ``keys [B, 2]``, ``logits [B, V]`` -> int32 ``[B]``. Batches without a sampled row skip the sampling."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled():
        logp = processed_logprobs_rows(logits, rows)
        tok = jax.vmap(lambda k, lp: jax.random.categorical(k, lp))(keys, logp).astype(jnp.int32)
        return jnp.where(rows.greedy, greedy, tok)

    return jax.lax.cond(jnp.any(~rows.greedy), sampled, lambda: greedy)
