"""Prompt-lookup drafting (``generate(target, "ngram", ...)``, ``--draft ngram``): no draft model, the sequence
itself proposes.

Each cycle, per row, the last n tokens of the sequence (prompt + generated, up to ``last_token`` at position
``length``) are looked up in the sequence before them, for n from ``max_n`` down to ``min_n``
(:class:`~diffspec_jax.config.NGram`); the most recent earlier occurrence of the longest suffix that has one
proposes the K tokens that followed it. A match that ends ``d < K`` positions before the end proposes past the
known tokens by copying forward with period ``d`` (the tokens it proposes are themselves followed), so a run of
one repeated token proposes K more. A row with no match proposes ``last_token`` K times; verification keeps it
lossless like any other proposal (drafts are deterministic: one-hot q).

The search (:func:`ngram_propose`) is vectorised over the row's token history, int32 ``[B, capacity]`` kept in
:attr:`~diffspec_jax.engine.state.DecodeState.drafter`: ``max_n`` comparisons of the history, shifted, with the
suffix, static shapes, inside the device loop. The history is written whole after the prefill (the prompt, from
the host: a prefix cache's reused pages hold no tokens) and the first token (:meth:`NGramDrafter.prepare`), then
with each cycle's emitted tokens (:meth:`NGramDrafter.update`).

With ``NGram(first=True)`` and a draft (EAGLE-3 or self), prompt lookup proposes on the rows where it matches and
the draft on the others (:class:`~diffspec_jax.engine.drafting.InFront`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from diffspec_jax.config import ModelConfig, SpecConfig
from diffspec_jax.engine.drafting import Drafter, Proposal, zero_rows
from diffspec_jax.errors import ConfigError

#: the ``draft`` argument of :func:`diffspec_jax.generate` (and ``--draft``) that selects prompt-lookup drafting
NGRAM = "ngram"


def ngram_propose(history: jax.Array, length: jax.Array, min_n: int, max_n: int, k: int):
    """The prompt-lookup proposal of every row.

    Args:
        history: int32 ``[B, T]``, row b's tokens at positions ``0..length[b]`` (later entries are ignored).
        length: int32 ``[B]``, the position of each row's newest token (``T > length >= 0``).
        min_n, max_n, k: static n-gram sizes and proposal length.
    Returns:
        ``(drafts int32 [B, k], found bool [B])``: for the largest n with a match, the tokens after the match that
        ends latest before ``length`` (copied forward past ``length``); ``found`` False: no suffix matched, and
        every draft is ``history[b, length[b]]``.
    """
    b, t = history.shape
    end = jnp.arange(t, dtype=jnp.int32)[None, :]           # e: the last position of a candidate occurrence
    last = length[:, None]
    match = jnp.ones((b, t), bool)
    best = jnp.full((b,), -1, jnp.int32)
    for i in range(max_n):                                     # match[e] = history[e - j] == suffix[j], j <= i
        shifted = history if i == 0 else jnp.pad(history, ((0, 0), (i, 0)), constant_values=-1)[:, :t]
        suffix = jnp.take_along_axis(history, jnp.clip(last - i, 0, t - 1), axis=1)
        match = match & (shifted == suffix)
        n = i + 1
        if n >= min_n:                                         # longer n overwrite: the longest match wins
            ok = match & (end >= n - 1) & (end < last)
            at = jnp.max(jnp.where(ok, end, -1), axis=1)
            best = jnp.where(at >= 0, at, best)
    found = best >= 0
    period = jnp.where(found, length - best, 1)[:, None]
    j = jnp.arange(k, dtype=jnp.int32)[None, :]
    idx = jnp.where(found[:, None], best[:, None] + 1 + j % period, last)
    return jnp.take_along_axis(history, idx, axis=1), found


def write_emitted(history: jax.Array, length: jax.Array, active: jax.Array, emitted: jax.Array, m: jax.Array):
    """``history`` with each active row's ``m + 1`` emitted tokens (``emitted [B, >= m+1]``) at positions
    ``length + 1 ..`` (``length``: the committed length before the cycle, where its ``last_token`` stands)."""
    b, t = history.shape
    j = jnp.arange(emitted.shape[1], dtype=jnp.int32)[None, :]
    cols = jnp.where(active[:, None] & (j <= m[:, None]), length[:, None] + 1 + j, t)  # past the end: dropped
    return history.at[jnp.arange(b)[:, None], cols].set(emitted, mode="drop")


@dataclass(frozen=True)
class NGramDrafter(Drafter):
    """Prompt lookup as a :class:`~diffspec_jax.engine.drafting.Drafter` (settings in ``plan.spec.ngram``); its
    state is the token history, int32 ``[B, capacity]``."""

    name: ClassVar[str] = NGRAM
    needs_context: ClassVar[bool] = True

    def spec_for(self, spec: SpecConfig, target: ModelConfig, *, alone: bool) -> SpecConfig:
        """Chains only (a ConfigError for a tree); alone, the draft-context settings are reset."""
        if spec.tree:
            raise ConfigError("prompt lookup proposes chains: diffspec_verification_mode='tree' needs an EAGLE-3 "
                              "draft without ngram_first")
        return super().spec_for(spec, target, alone=alone)

    def init(self, plan, batch: int):
        return jnp.zeros((batch, plan.capacity), jnp.int32)

    def specs(self, plan, dp):
        return P(dp, None)

    def prepare(self, plan, history, context, lengths, first):
        """The history after the prefill: each prompt (``context``, zero padded), the first token at ``lengths``."""
        b = history.shape[0]
        return context.astype(jnp.int32).at[jnp.arange(b), lengths].set(first, mode="drop")

    def propose(self, plan, tparams, dparams, state, active, key, depth: int) -> Proposal:
        """One-hot q; ``found`` False on the rows where no n-gram matched."""
        cfg = plan.spec.ngram
        drafts, found = ngram_propose(state.drafter, state.length, cfg.min_n, cfg.max_n, depth)
        zero = zero_rows(state)
        return Proposal(drafts, None, state, zero, zero, found)

    def update(self, plan, history, length, active, emitted, m):
        return write_emitted(history, length, active, emitted, m)
