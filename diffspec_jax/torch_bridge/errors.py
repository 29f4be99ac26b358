"""Errors of the torch bridge (``ValueError`` subclasses, through :class:`diffspec_jax.errors.DiffspecError`)."""

from __future__ import annotations

from diffspec_jax.errors import DiffspecError, InputError


class BridgeError(DiffspecError):
    """Base class of every deliberate torch-bridge error."""


class SlotError(BridgeError):
    """Request-slot bookkeeping: no free slot, an unknown or duplicate request id."""


class BridgeInputError(BridgeError, InputError):
    """Inconsistent hook input: a wrong shape or dtype, a position beyond the store capacity, a bad device."""
