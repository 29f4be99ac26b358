"""Exception types raised for bad input.

Every error the library raises on purpose derives from :class:`DiffspecError`, a ``ValueError``, so
callers can catch one type. The message always names the offending file, key or value, and says what to do.

Each class carries the exit status the command-line tools return for it (:func:`exit_code`): 2 for usage
errors (a bad argument or setting: :class:`ConfigError`, :class:`InputError` and its :class:`OutOfMemoryError`, a
path that does not exist), 1 for everything else (a damaged or inconsistent checkpoint, a failed integrity check).
"""

from __future__ import annotations


class DiffspecError(ValueError):
    """Base class of every deliberate diffspec-jax error."""

    #: the exit status of a command-line tool that stops on this error
    exit_code = 1


class ConfigError(DiffspecError):
    """An invalid configuration value (model ``config.json``, ``SpecConfig``, ``SamplingConfig``, a CLI option)."""

    exit_code = 2


class UnsupportedModelError(ConfigError):
    """A checkpoint uses a feature this library does not implement (architecture, RoPE type, MLA, ...)."""


class CheckpointError(DiffspecError):
    """A checkpoint directory is missing, incomplete or inconsistent with its config."""


class PathNotFoundError(CheckpointError):
    """A checkpoint path given by the user does not exist or is not a directory (a usage error)."""

    exit_code = 2


class IntegrityError(CheckpointError):
    """A checkpoint's contents are damaged: a SHA-256 digest that differs from its manifest, a damaged manifest,
    or weights holding NaN / infinite (or absurdly large) values."""


class InputError(DiffspecError):
    """Bad request input: empty prompt, prompt longer than the cache, token id out of range, ..."""

    exit_code = 2


class OutOfMemoryError(InputError):
    """A request the device cannot hold: ``generate()`` checks before allocating that the batch's K/V cache, its
    other state and its prefill temporaries fit in the device's free memory, and says what each needs, what the
    device has and what to change (fewer prompts, a smaller ``max_new_tokens``, a smaller ``prefill_chunk``)."""


class OutputDirError(ConfigError):
    """An output directory that would lose or damage files: not empty (and not written by a diffspec tool),
    equal to or inside an input, or an input inside it."""


def exit_code(exc: BaseException) -> int:
    """The exit status a command-line tool returns for ``exc``: 2 = usage error, 1 = anything else."""
    return int(getattr(exc, "exit_code", 1)) if isinstance(exc, DiffspecError) else 1
