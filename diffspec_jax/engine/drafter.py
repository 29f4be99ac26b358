"""The registry of drafters (:data:`DRAFTERS`) and the one reading of a ``draft`` argument: :func:`split_draft`
(which drafter it names) and :func:`draft_spec` (the drafter a run uses, and its :class:`SpecConfig`).

The protocol a drafter implements is :class:`~diffspec_jax.engine.drafting.Drafter`. Adding a drafter is one module
with a subclass of it plus one line here in :data:`DRAFTERS` (or, from outside the package, one assignment to it:
``DRAFTERS[MyDrafter.name] = MyDrafter()``); ``generate(target, name, ...)``, ``--draft name`` and the server then
select it by name.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from diffspec_jax.config import ModelConfig, SpecConfig
from diffspec_jax.engine.drafting import Drafter, InFront
from diffspec_jax.engine.ngram import NGRAM, NGramDrafter
from diffspec_jax.engine.propose import Eagle3Drafter
from diffspec_jax.engine.self_draft import SELF, SelfDrafter
from diffspec_jax.errors import ConfigError

#: drafters by name: ``"self"`` and ``"ngram"`` are selected by their name as the ``draft`` argument, ``"eagle3"``
#: by passing a loaded draft
DRAFTERS: dict[str, Drafter] = {
    Eagle3Drafter.name: Eagle3Drafter(),
    SELF: SelfDrafter(),
    NGRAM: NGramDrafter(),
}


class DraftChoice(NamedTuple):
    """What a ``draft`` argument asks for: a loaded draft (``model``, drafted by the ``eagle3`` drafter) or a
    registered :class:`Drafter` by name."""

    model: Any
    drafter: Drafter | None

    @property
    def self_draft(self) -> bool:
        """Self-drafting (``draft="self"``)."""
        return self.drafter is not None and self.drafter.name == SELF


def named_drafts() -> tuple[str, ...]:
    """The names a ``draft`` argument may give (the registered drafters that need no loaded draft)."""
    return tuple(name for name, d in DRAFTERS.items() if not d.needs_draft)


def split_draft(draft) -> DraftChoice:
    """The :class:`DraftChoice` of a ``draft`` argument: a loaded draft, a name in :func:`named_drafts` or
    ``None``.

    Raises:
        ConfigError: any other string."""
    if isinstance(draft, str):
        if draft in DRAFTERS and not DRAFTERS[draft].needs_draft:
            return DraftChoice(None, DRAFTERS[draft])
        names = ", ".join(repr(n) for n in named_drafts() if n != SELF)
        raise ConfigError(f"draft must be a loaded draft (load_draft), {SELF!r} (the target drafts for itself), "
                          f"{names} or None, got {draft!r}")
    return DraftChoice(draft, None)


def draft_spec(choice: DraftChoice, spec: SpecConfig, target: ModelConfig, proposer: Callable | None = None
               ) -> tuple[SpecConfig, Drafter | None]:
    """``(the SpecConfig the run uses, its Drafter or None for target-only decoding)``: the loaded draft's
    (:class:`~diffspec_jax.engine.propose.Eagle3Drafter`, or a custom ``proposer`` in its place) or the named one,
    and with ``spec.ngram.first`` prompt lookup in front of a model draft
    (:class:`~diffspec_jax.engine.drafting.InFront`); each drafter adjusts the spec (:meth:`Drafter.spec_for`).

    Raises:
        ConfigError: what the chosen drafters do not support; ``ngram_first`` with a drafter that is no model
        draft (``ngram_first`` without any drafter is ignored)."""
    spec = spec.with_default_interval(choice.self_draft)
    drafter = choice.drafter
    if choice.model is not None or proposer is not None:
        drafter = Eagle3Drafter(proposer)
    if spec.ngram.first and drafter is not None:  # (target-only decoding ignores it)
        if not drafter.model:
            raise ConfigError(f"ngram_first puts prompt lookup in front of a draft (an EAGLE-3 draft or {SELF!r}); "
                              f"draft={drafter.name!r} has none behind it: drop ngram_first")
        drafter = InFront(DRAFTERS[NGRAM], drafter)
    if drafter is None:
        return spec, None
    return drafter.spec_for(spec, target, alone=True), drafter
