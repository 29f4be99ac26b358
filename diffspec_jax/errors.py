"""Exception types raised for bad input.

Every error the library raises on purpose derives from :class:`DiffspecError`, a ``ValueError``, so
callers can catch one type. The message always names the offending file, key or value.
"""

from __future__ import annotations


class DiffspecError(ValueError):
    """Base class of every deliberate diffspec-jax error."""


class ConfigError(DiffspecError):
    """An invalid configuration value (model ``config.json``, ``SpecConfig``, ``SamplingConfig``)."""


class UnsupportedModelError(ConfigError):
    """A checkpoint uses a feature this library does not implement (architecture, RoPE type, MLA, ...)."""


class CheckpointError(DiffspecError):
    """A checkpoint directory is missing, incomplete or inconsistent with its config."""


class InputError(DiffspecError):
    """Bad request input: empty prompt, prompt longer than the cache, token id out of range, ..."""
