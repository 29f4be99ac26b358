"""Drafters as objects: the protocol a drafter implements to run inside the device loop, the registry of drafters
named by a string ``draft`` argument, and the one reading of a ``draft`` argument (:func:`split_draft`).

A :class:`Drafter` keeps its own per-row state in :attr:`~diffspec_jax.engine.state.DecodeState.drafter` (a pytree
of batch-first arrays that compaction and the server's slots move with the row) and is consulted at three points:

* after the prefill and the first token (:func:`~diffspec_jax.engine.prefill._start_decode`): :meth:`prepare`;
* each chain cycle (:func:`~diffspec_jax.engine.verify._spec_cycle`): :meth:`propose` K tokens, verified like any
  draft's (greedy: the target's tokens; sampling: rejection sampling against the q it returns);
* after the acceptance (:func:`~diffspec_jax.engine.verify._accept`): :meth:`update` with the emitted tokens.

A drafter may abstain on some rows (``found`` False): with a draft model behind it (``NGram(first=True)``) the
draft's proposal stands there. The EAGLE-3 draft and self-drafting are not (yet) written this way: ``Plan.draft``
and ``Plan.self_draft`` select them.

Adding a drafter is one module with a class of these methods plus one line in :data:`DRAFTERS`.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax

from diffspec_jax.config import ModelConfig, SpecConfig
from diffspec_jax.engine.ngram import NGRAM, NGramDrafter
from diffspec_jax.engine.self_draft import SELF, is_self, self_draft_spec
from diffspec_jax.errors import ConfigError


class Drafter(Protocol):
    """A drafter that runs on the device inside the decode loop. Instances are hashable (they sit in the
    :class:`~diffspec_jax.engine.state.Plan`, a ``jit`` static argument) and keep no state of their own; settings
    are read from ``plan.spec``."""

    #: the ``draft`` string that selects it (``generate(target, name)``, ``--draft name``)
    name: str

    def spec_for(self, spec: SpecConfig, target: ModelConfig, *, alone: bool) -> SpecConfig:
        """The :class:`SpecConfig` the run uses (``alone``: no draft model behind it); raises ConfigError for what
        the drafter does not support."""

    def init(self, plan, batch: int) -> Any:
        """Its zeroed per-row state for ``batch`` rows (batch-first arrays)."""

    def specs(self, plan, dp) -> Any:
        """PartitionSpecs of that state (batch over ``dp``)."""

    def prepare(self, plan, dstate, context: jax.Array, lengths: jax.Array, first: jax.Array) -> Any:
        """Its state after the prefill: ``context`` int32 ``[B, capacity]`` each prompt (zero padded), ``lengths``
        int32 ``[B]`` the prompt lengths, ``first`` int32 ``[B]`` the first token (at position ``lengths``)."""

    def propose(self, plan, state, depth: int) -> tuple[jax.Array, jax.Array | None, jax.Array]:
        """``(drafts int32 [B, depth], q float32 [B, depth, V] or None (one-hot), found bool [B])`` from the
        :class:`~diffspec_jax.engine.state.DecodeState` ``state``; ``found`` False: the row's proposal is a
        placeholder (a draft behind the drafter replaces it)."""

    def update(self, plan, dstate, length: jax.Array, active: jax.Array, emitted: jax.Array, m: jax.Array) -> Any:
        """Its state after a cycle: each active row emitted ``emitted[:, :m + 1]`` at positions ``length + 1 ..``
        (``length``: the committed length before the cycle)."""


#: drafters by name (the ``draft`` strings besides ``"self"``)
DRAFTERS: dict[str, Drafter] = {NGRAM: NGramDrafter()}


class DraftChoice(NamedTuple):
    """What a ``draft`` argument asks for: a loaded draft (``model``), self-drafting, or a registered
    :class:`Drafter`."""

    model: Any
    self_draft: bool
    drafter: Drafter | None


def split_draft(draft) -> DraftChoice:
    """The :class:`DraftChoice` of a ``draft`` argument: a loaded draft, :data:`SELF`, a name in :data:`DRAFTERS`
    or ``None``.

    Raises:
        ConfigError: any other string."""
    if isinstance(draft, str):
        if is_self(draft):
            return DraftChoice(None, True, None)
        if draft in DRAFTERS:
            return DraftChoice(None, False, DRAFTERS[draft])
        names = ", ".join(repr(n) for n in DRAFTERS)
        raise ConfigError(f"draft must be a loaded draft (load_draft), {SELF!r} (the target drafts for itself), "
                          f"{names} or None, got {draft!r}")
    return DraftChoice(draft, False, None)


def draft_spec(choice: DraftChoice, spec: SpecConfig, target: ModelConfig) -> tuple[SpecConfig, Drafter | None]:
    """``(the SpecConfig the run uses, its Drafter or None)``: self-drafting's adjustments
    (:func:`~diffspec_jax.engine.self_draft.self_draft_spec`), and prompt lookup alone or, with
    ``spec.ngram.first`` and a draft, in front of it.

    Raises:
        ConfigError: what the chosen drafters do not support; ``ngram_first`` with ``draft="ngram"``."""
    if choice.self_draft:
        spec = self_draft_spec(spec, target)
    drafter = choice.drafter
    behind = choice.model is not None or choice.self_draft
    if spec.ngram.first:
        if drafter is not None:
            raise ConfigError(f"ngram_first puts prompt lookup in front of a draft (an EAGLE-3 draft or {SELF!r}); "
                              f"draft={drafter.name!r} has none behind it: drop ngram_first")
        if behind:
            drafter = DRAFTERS[NGRAM]
    if drafter is not None:
        spec = drafter.spec_for(spec, target, alone=not behind)
    return spec, drafter
