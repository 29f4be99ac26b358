"""Token selection from logits: temperature, top-k and top-p processing, greedy choice and sampling.

The processed distribution (``logits / T``, then top-k, then top-p on the renormalised top-k set, then softmax)
is the *same* function for the target-only baseline and for speculative verification, so both sample from one
distribution.

Temperatures below :data:`~diffspec_jax.config.GREEDY_TEMPERATURE` (1e-5) are greedy: :class:`SamplingConfig` stores
them as 0, so :func:`choose` takes the argmax instead of dividing the logits by a temperature that can overflow
them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

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
        sorted_x = jnp.sort(x, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_x, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
        # the most likely token is always kept (a top_p such as 1e-300 is 0 in float32 and would keep none)
        keep = (before < sampling.top_p).at[..., 0].set(True)
        threshold = jnp.min(jnp.where(keep, sorted_x, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < threshold, _MASKED, x)
    return jax.nn.log_softmax(x, axis=-1)


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
