"""The drafter protocol: what a drafter implements to run inside the device loop (:class:`Drafter`, a base class
whose defaults are those of a drafter with no model and no state), what it proposes (:class:`Proposal`), and the
combination of two drafters (:class:`InFront`: prompt lookup in front of a model draft, ``NGram(first=True)``).

A drafter is a frozen, hashable object (it sits in the :class:`~diffspec_jax.engine.state.Plan`, a ``jit`` static
argument) that keeps no state of its own; settings are read from ``plan.spec``. Its per-row state lives in the
:class:`~diffspec_jax.engine.state.DecodeState`: :attr:`~diffspec_jax.engine.state.DecodeState.drafter` (its own
batch-first pytree, :meth:`Drafter.init`) and, for the model drafters, ``draft_cache`` (the cache the draft-context
policy reads: :meth:`Drafter.init_cache`). It is consulted at these points of a sequence's path:

* each prefill chunk (:func:`~diffspec_jax.engine.prefill._prefill_chunk`): :meth:`Drafter.prefill` (EAGLE-3
  stores the chunk's draft entries);
* after the prefill and the first token (:func:`~diffspec_jax.engine.prefill._start_decode`):
  :meth:`Drafter.prepare`;
* each chain cycle (:func:`~diffspec_jax.engine.verify._spec_cycle`): :meth:`Drafter.propose` K tokens, verified
  like any draft's (greedy: the target's tokens; sampling: rejection sampling against the q it returns);
* after the acceptance (:func:`~diffspec_jax.engine.verify._accept`): :meth:`Drafter.update` with the emitted tokens
  (a model draft's own K/V of the accepted tokens are written by its next :meth:`Drafter.propose`, from the
  verified entries the state keeps pending);
* a server slot's reset (:func:`~diffspec_jax.engine.slots.slot_reset`): :meth:`Drafter.reset_row`;
* DiffSpec's retrieval with the salience scorer (:func:`~diffspec_jax.engine.retrieve._select_anchors`):
  :meth:`Drafter.root_query`.

The registry of drafters by name is :data:`diffspec_jax.engine.drafter.DRAFTERS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from diffspec_jax.config import Full, ModelConfig, SpecConfig
from diffspec_jax.errors import ConfigError


class Proposal(NamedTuple):
    """What a drafter proposes in one chain cycle.

    Attributes:
        drafts: int32 ``[B, depth]``.
        q: float32 ``[B, depth, V]``, the distribution each draft was drawn from, or ``None`` (deterministic drafts:
            one-hot q).
        state: the :class:`~diffspec_jax.engine.state.DecodeState` after drafting (a model draft's cache and
            retrieval state, a self-draft's target cache).
        n: int32 ``[B]`` the history length the draft read, ``window``: int32 ``[B]`` its rolling-window tokens
            (zeros without a working cache).
        found: bool ``[B]`` the rows with a proposal of the drafter's own (``None``: every row); on the others the
            drafts are placeholders that a drafter behind it replaces (:class:`InFront`).
    """

    drafts: jax.Array
    q: jax.Array | None
    state: Any
    n: jax.Array
    window: jax.Array
    found: jax.Array | None = None


@dataclass(frozen=True)
class Drafter:
    """A drafter that runs on the device inside the decode loop (subclass it and override what it needs: a
    drafter without a model or state implements :meth:`propose` alone)."""

    #: the ``draft`` string that selects it (``generate(target, name)``, ``--draft name``)
    name: ClassVar[str] = ""
    #: a model drafts (EAGLE-3, or the target itself): it reads the draft-context policy (``spec.context``) and a
    #: token-level drafter may stand in front of it (``NGram(first=True)``)
    model: ClassVar[bool] = False
    #: :meth:`prepare` reads each prompt's tokens (``context``), which the host then sends after the prefill
    needs_context: ClassVar[bool] = False
    #: it is selected by passing a loaded draft, not its name
    needs_draft: ClassVar[bool] = False

    def spec_for(self, spec: SpecConfig, target: ModelConfig, *, alone: bool) -> SpecConfig:
        """The :class:`SpecConfig` the run uses (``alone``: no drafter behind it); raises ConfigError for what the
        drafter does not support. Default: chains only; alone, the draft-context settings (which no model reads)
        are reset and drafts are deterministic (plans that differ only there share programs)."""
        if spec.tree:
            raise ConfigError(f"draft={self.name!r} proposes chains: diffspec_verification_mode='tree' needs an "
                              f"EAGLE-3 draft")
        return spec.replace(context=Full(), draft_sampling="argmax") if alone else spec

    def label(self, spec: SpecConfig) -> str:
        """The drafting policy as metrics name it (the server's ``policy``)."""
        return self.name

    def init(self, plan, batch: int) -> Any:
        """Its zeroed per-row state for ``batch`` rows (batch-first arrays; ``None``: none)."""
        return None

    def specs(self, plan, dp) -> Any:
        """PartitionSpecs of that state (batch over ``dp``)."""
        return None

    def init_cache(self, plan, batch: int, target_dtype, draft_dtype, pool_rows: int | None) -> Any:
        """``DecodeState.draft_cache``: the cache its draft-context policy reads (``None``: none). ``pool_rows``:
        rows of a paged state's shared pools (``None``: not paged)."""
        return None

    def cache_specs(self, plan, dp, tp) -> Any:
        """PartitionSpecs of :meth:`init_cache`'s cache."""
        return None

    def prefill(self, plan, dparams, state, out, next_tokens: jax.Array, start: jax.Array, last: jax.Array):
        """The state after a prefill chunk whose target output is ``out`` (``next_tokens`` int32 ``[B, W]``: the
        chunk's tokens shifted by one; ``start`` int32 ``[B]`` its first position; ``last`` int32 ``[B]`` each
        prompt's last position)."""
        return state

    def prepare(self, plan, dstate, context: jax.Array | None, lengths: jax.Array, first: jax.Array) -> Any:
        """Its state after the prefill: ``context`` int32 ``[B, capacity]`` each prompt, zero padded (``None``
        unless :attr:`needs_context`), ``lengths`` int32 ``[B]`` the prompt lengths, ``first`` int32 ``[B]`` the
        first token (at position ``lengths``)."""
        return dstate

    def propose(self, plan, tparams, dparams, state, active: jax.Array, key: jax.Array, depth: int) -> Proposal:
        """A chain of ``depth`` drafts for every row of ``state`` (``active`` bool ``[B]``: the rows decoding;
        ``key``: this cycle's drafting key)."""
        raise NotImplementedError

    def update(self, plan, dstate, length: jax.Array, active: jax.Array, emitted: jax.Array, m: jax.Array) -> Any:
        """Its state after a cycle: each active row emitted ``emitted[:, :m + 1]`` at positions ``length + 1 ..``
        (``length``: the committed length before the cycle)."""
        return dstate

    def reset_row(self, plan, state, row):
        """The state with row ``row`` (a server slot) cleared for a new request."""
        return state

    def root_query(self, plan, dparams, state) -> jax.Array:
        """The draft's query of the upcoming root entry, float32 ``[B, H, D]``, which DiffSpec's salience scorer
        scores chunk summaries with (:func:`~diffspec_jax.engine.retrieve._select_anchors`); only a draft model
        with keys of its own has one (an EAGLE-3 draft: configurations that need it are refused otherwise)."""
        raise NotImplementedError(f"draft={self.name!r} has no draft query for the salience scorer")


def zero_rows(state) -> jax.Array:
    """int32 ``[B]`` zeros (a proposal's ``n`` and ``window`` without a working cache)."""
    return jnp.zeros_like(state.length)


@dataclass(frozen=True)
class InFront(Drafter):
    """``front``'s proposal on the rows where it finds one, ``behind``'s (a model draft, which runs every cycle:
    its state must follow the sequence) on the others. The state is the pair of theirs."""

    front: Drafter = None
    behind: Drafter = None
    model: ClassVar[bool] = True

    @property
    def needs_context(self) -> bool:
        return self.front.needs_context or self.behind.needs_context

    def spec_for(self, spec, target, *, alone):
        return self.front.spec_for(self.behind.spec_for(spec, target, alone=alone), target, alone=False)

    def label(self, spec):
        return f"{self.front.label(spec)}+{self.behind.label(spec)}"

    def init(self, plan, batch):
        return self.front.init(plan, batch), self.behind.init(plan, batch)

    def specs(self, plan, dp):
        return self.front.specs(plan, dp), self.behind.specs(plan, dp)

    def init_cache(self, plan, batch, target_dtype, draft_dtype, pool_rows):
        return self.behind.init_cache(plan, batch, target_dtype, draft_dtype, pool_rows)

    def cache_specs(self, plan, dp, tp):
        return self.behind.cache_specs(plan, dp, tp)

    def prefill(self, plan, dparams, state, out, next_tokens, start, last):
        return self.behind.prefill(plan, dparams, state, out, next_tokens, start, last)

    def prepare(self, plan, dstate, context, lengths, first):
        return (self.front.prepare(plan, dstate[0], context, lengths, first),
                self.behind.prepare(plan, dstate[1], context, lengths, first))

    def propose(self, plan, tparams, dparams, state, active, key, depth):
        mine, theirs = state.drafter
        f = self.front.propose(plan, tparams, dparams, state.replace(drafter=mine), active, key, depth)
        b = self.behind.propose(plan, tparams, dparams, f.state.replace(drafter=theirs), active, key, depth)
        found = jnp.ones_like(state.length, bool) if f.found is None else f.found
        drafts = jnp.where(found[:, None], f.drafts, b.drafts)
        q = None
        if f.q is not None or b.q is not None:  # a one-hot q where one of the two drafts deterministically
            one_hot = lambda p: jax.nn.one_hot(p.drafts, plan.target.vocab_size, dtype=jnp.float32)  # noqa: E731
            q = jnp.where(found[:, None, None], one_hot(f) if f.q is None else f.q,
                          one_hot(b) if b.q is None else b.q)
        state = b.state.replace(drafter=(f.state.drafter, b.state.drafter))
        return Proposal(drafts, q, state, b.n, b.window)

    def update(self, plan, dstate, length, active, emitted, m):
        return (self.front.update(plan, dstate[0], length, active, emitted, m),
                self.behind.update(plan, dstate[1], length, active, emitted, m))

    def reset_row(self, plan, state, row):
        return self.behind.reset_row(plan, state, row)

    def root_query(self, plan, dparams, state):
        return self.behind.root_query(plan, dparams, state)
