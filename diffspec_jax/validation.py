"""Shared checks at the library's and the command-line tools' boundaries.

* scalar checks (:func:`check_int`, :func:`check_real`, :func:`check_bool`) that refuse the wrong type as well
  as the wrong range (``True`` is not an integer, ``"0.9"`` is not a number, NaN is not in any range), raising a
  named error whose message says what to pass instead;
* :func:`read_json_object` / :func:`read_text`: files read as UTF-8, a named error for anything unreadable;
* :func:`check_generate_args`: the arguments of :func:`diffspec_jax.generate` besides prompts and configs;
* :class:`ArgumentParser` (usage errors on one line, exit status 2; every option's default in ``--help``; named
  after the ``diffspec`` command that runs it) and :func:`report_error` (one line on stderr, the exit status of
  :func:`diffspec_jax.errors.exit_code`), used by every command-line tool;
* :func:`quiet_library_notices`: what every command calls first, so that libraries' import-time advice (transformers'
  "PyTorch was not found") stays off its output.

NumPy only (no JAX import), like :mod:`diffspec_jax.config`.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import numbers
import os
import sys
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from diffspec_jax.errors import ConfigError, DiffspecError, InputError, exit_code


def _is_int(value: Any) -> bool:
    return isinstance(value, (numbers.Integral, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_real(value: Any) -> bool:
    return isinstance(value, (numbers.Real, np.floating, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(value: Any, name: str, *, min: int | None = None, max: int | None = None, none_ok: bool = False,
              error: type[DiffspecError] = ConfigError, hint: str = "") -> int | None:
    """``value`` as an ``int`` if it is an integer (not a bool) in ``[min, max]``; ``None`` passes with
    ``none_ok``. Raises ``error`` naming ``name``, the range and the value."""
    if value is None and none_ok:
        return None
    if not _is_int(value):
        raise error(f"{name} must be an integer{_range(min, max)}{' or None' if none_ok else ''}, got "
                    f"{_show(value)}{hint}")
    if (min is not None and value < min) or (max is not None and value > max):
        raise error(f"{name} must be an integer{_range(min, max)}, got {int(value)}{hint}")
    return int(value)



#: the page sizes a paged K/V cache takes (tokens per page): powers of two in this range
PAGE_SIZES = (16, 256)


def check_page_size(value: Any, name: str = "page_size") -> int:
    """``value`` as an ``int`` if it is a power of two in :data:`PAGE_SIZES`' range, else a ConfigError naming
    ``name``."""
    lo, hi = PAGE_SIZES
    check_int(value, name, min=lo, max=hi)
    if value & (value - 1):
        raise ConfigError(f"{name} must be a power of two from {lo} to {hi}, got {value}")
    return int(value)

def check_real(value: Any, name: str, *, min: float | None = None, max: float | None = None,
               min_open: bool = False, max_open: bool = False, none_ok: bool = False,
               error: type[DiffspecError] = ConfigError, hint: str = "") -> float | None:
    """``value`` as a finite ``float`` (ints accepted, bools and strings not) in the given range (``min_open`` /
    ``max_open`` exclude the bounds)."""
    if value is None and none_ok:
        return None
    lo = "" if min is None else f"{'>' if min_open else '>='} {min}"
    hi = "" if max is None else f"{'<' if max_open else '<='} {max}"
    bounds = f" {lo}{' and ' if lo and hi else ''}{hi}" if lo or hi else ""
    if not _is_real(value) or not math.isfinite(float(value)):
        raise error(f"{name} must be a finite number{bounds}, got {_show(value)}{hint}")
    v = float(value)
    if min is not None and (v < min or (min_open and v == min)):
        raise error(f"{name} must be a finite number{bounds}, got {value!r}{hint}")
    if max is not None and (v > max or (max_open and v == max)):
        raise error(f"{name} must be a finite number{bounds}, got {value!r}{hint}")
    return v


def check_bool(value: Any, name: str, *, error: type[DiffspecError] = ConfigError) -> bool:
    """``value`` if it is a bool (``True`` / ``False``; 0 / 1 and strings are refused)."""
    if not isinstance(value, (bool, np.bool_)):
        raise error(f"{name} must be True or False, got {_show(value)}")
    return bool(value)


def check_choice(value: Any, name: str, choices: Sequence[str], *, error: type[DiffspecError] = ConfigError) -> str:
    """``value`` if it is one of the strings ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise error(f"{name} must be one of {', '.join(map(repr, choices))}, got {_show(value)}")
    return value


def _range(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f" in [{lo}, {hi}]"
    if lo is not None:
        return f" >= {lo}"
    if hi is not None:
        return f" <= {hi}"
    return ""


def _show(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"{text} ({type(value).__name__})"


# ------------------------------------------------------------------------------------------------------ files
def read_text(path: str | Path, what: str = "file", *, error: type[DiffspecError] = InputError,
              max_bytes: int | None = None, raise_hint: str = "") -> str:
    """The UTF-8 text of ``path``; ``error`` (naming ``what``) when it is missing, a directory, unreadable or not
    UTF-8, or holds more than ``max_bytes`` bytes (at most ``max_bytes + 1`` are read, so an endless file such as
    ``/dev/zero`` fails at once; ``raise_hint`` says how to raise the limit)."""
    path = Path(path)
    if not path.exists():
        raise error(f"{what} {path} does not exist")
    if path.is_dir():
        raise error(f"{what} {path} is a directory, not a file")
    try:
        with open(path, "rb") as f:
            return decode_text(read_at_most(f, max_bytes, f"{what} {path}", error, raise_hint), f"{what} {path}",
                               error)
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from None


def read_at_most(stream, max_bytes: int | None, what: str, error: type[DiffspecError] = InputError,
                 raise_hint: str = "") -> bytes:
    """All bytes of a binary ``stream``, or ``error`` once it holds more than ``max_bytes`` (``None``: no limit)."""
    if max_bytes is None:
        return stream.read()
    data = stream.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise error(f"{what} holds more than {max_bytes} bytes, the limit{raise_hint}")
    return data


def decode_text(data: bytes, what: str, error: type[DiffspecError] = InputError) -> str:
    """``data`` as UTF-8 text, or ``error`` naming ``what`` and the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what} is not UTF-8 text (byte {exc.start} is {data[exc.start]:#04x}); convert it to UTF-8 "
                    f"first") from None


def read_json_object(path: str | Path, what: str = "config.json", *,
                     error: type[DiffspecError] = ConfigError) -> dict[str, Any]:
    """The JSON object (dict) in ``path``; ``error`` when the file is unreadable, not UTF-8, not JSON, or holds
    another JSON value (a list, a number, ...)."""
    text = read_text(path, what, error=error)
    if not text.strip():
        raise error(f"{path}: {what} is empty (it must hold a JSON object {{...}})")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: {what} must hold a JSON object {{...}}, got a JSON {_json_kind(data)}")
    return data


def _json_kind(data: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}.get(
        type(data), type(data).__name__)


# ------------------------------------------------------------------------------------------------- generate()
class GenerateArgs(NamedTuple):
    """The normalised arguments returned by :func:`check_generate_args`."""

    seed: int
    stop_token_ids: tuple[int, ...] | None
    max_cache_len: int | None
    prefill_chunk: int


#: seeds are 64-bit signed integers (what ``jax.random.PRNGKey`` accepts)
SEED_RANGE = (-(2 ** 63), 2 ** 63 - 1)


def check_generate_args(vocab_size: int, *, seed: Any = 0, stop_token_ids: Any = None, max_cache_len: Any = None,
                        prefill_chunk: Any = None, on_tokens: Any = None, progress: Any = False,
                        proposer: Any = None, mesh: Any = None) -> GenerateArgs:
    """Check the arguments of :func:`diffspec_jax.generate` other than prompts, ``max_new_tokens`` and the
    configs (which ``generate`` checks itself) and return them normalised.

    Args:
        vocab_size: the target's vocabulary (stop ids must lie in ``[0, vocab_size)``).
    Returns:
        :class:`GenerateArgs`: ``seed`` an ``int``; ``stop_token_ids`` ``None`` (the target's EOS ids) or a tuple
        of ``int``; ``max_cache_len`` ``None`` or an ``int``; ``prefill_chunk`` ``None`` (the backend's default,
        :func:`diffspec_jax.target.default_prefill_chunk`) or an ``int``.
    Raises:
        InputError: naming the argument, what was given and what to pass instead.
    """
    seed = check_int(seed, "seed", min=SEED_RANGE[0], max=SEED_RANGE[1], error=InputError,
                     hint="; pass an integer such as seed=0")
    if stop_token_ids is not None:
        if isinstance(stop_token_ids, (str, bytes)):
            raise InputError(f"stop_token_ids must be a sequence of integer token ids, got the string "
                             f"{stop_token_ids!r}; pass e.g. stop_token_ids=(2,) (or () to never stop early)")
        if _is_int(stop_token_ids):
            raise InputError(f"stop_token_ids must be a sequence of integer token ids, got the single integer "
                             f"{int(stop_token_ids)}; pass stop_token_ids=({int(stop_token_ids)},)")
        if isinstance(stop_token_ids, (dict, set, frozenset)) or not hasattr(stop_token_ids, "__iter__"):
            raise InputError(f"stop_token_ids must be a list or tuple of integer token ids (or None for the "
                             f"target's EOS ids), got {_show(stop_token_ids)}")
        ids = []
        for i, t in enumerate(stop_token_ids):
            ids.append(check_int(t, f"stop_token_ids[{i}]", min=0, max=vocab_size - 1, error=InputError,
                                 hint=f" (a token id of the target's vocabulary of {vocab_size})"))
        stop_token_ids = tuple(ids)
    max_cache_len = check_int(max_cache_len, "max_cache_len", min=1, none_ok=True, error=InputError,
                              hint="; pass None to size the cache from the prompts")
    prefill_chunk = check_int(prefill_chunk, "prefill_chunk", min=1, none_ok=True, error=InputError,
                              hint="; it is the most prompt tokens per sequence processed per prefill step (None: "
                                   "the backend's default, 512 on CPUs, up to 128K tokens per chunk on GPUs)")
    if on_tokens is not None and not callable(on_tokens):
        raise InputError(f"on_tokens must be a function on_tokens(sequence_index, new_ids) or None, got "
                         f"{_show(on_tokens)}")
    check_bool(progress, "progress", error=InputError)
    if proposer is not None and not callable(proposer):
        raise InputError(f"proposer must be a draft function (see engine.draft_propose) or None, got "
                         f"{_show(proposer)}")
    if mesh is not None:
        from jax.sharding import Mesh

        if not isinstance(mesh, Mesh):
            raise InputError(f"mesh must be a jax.sharding.Mesh from diffspec_jax.make_mesh or None, got "
                             f"{_show(mesh)}")
    return GenerateArgs(seed=seed, stop_token_ids=stop_token_ids, max_cache_len=max_cache_len,
                        prefill_chunk=prefill_chunk)


def check_stop_strings(stop: Any, name: str = "stop") -> tuple[str, ...]:
    """Stop strings as a tuple of non-empty ``str`` (``None`` -> ``()``; one string -> a 1-tuple)."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if isinstance(stop, (bytes, dict, set, frozenset)) or not hasattr(stop, "__iter__"):
        raise InputError(f"{name} must be a string or a list of strings (text that ends generation), got "
                         f"{_show(stop)}")
    out = tuple(stop)
    for i, s in enumerate(out):
        if not isinstance(s, str):
            raise InputError(f"{name}[{i}] must be a string, got {_show(s)}")
        if not s:
            raise InputError(f"{name}[{i}] is an empty string; an empty stop string would match before any text "
                             f"(leave it out)")
    return out


def check_text_args(stop: Any, tokenizer: Any, on_text: Any, skip_special_tokens: Any) -> tuple[str, ...]:
    """Check :func:`diffspec_jax.generate`'s text arguments; returns the stop strings (:func:`check_stop_strings`).

    Raises:
        InputError: stop strings or ``on_text`` without a ``tokenizer``, a tokenizer without ``decode``, an
            ``on_text`` that is not callable, a non-bool ``skip_special_tokens``.
    """
    stops = check_stop_strings(stop)
    check_bool(skip_special_tokens, "skip_special_tokens", error=InputError)
    if tokenizer is None:
        if stops:
            raise InputError("stop strings are matched on the decoded text: pass the target's tokenizer too "
                             "(generate(..., stop=[...], tokenizer=AutoTokenizer.from_pretrained(TARGET_DIR)))")
        if on_text is not None:
            raise InputError("on_text streams decoded text: pass the target's tokenizer too (tokenizer=...)")
    elif not callable(getattr(tokenizer, "decode", None)):
        raise InputError(f"tokenizer must have a decode(ids, skip_special_tokens=...) method (a transformers "
                         f"tokenizer), got {_show(tokenizer)}")
    if on_text is not None and not callable(on_text):
        raise InputError(f"on_text must be a function on_text(sequence_index, new_text) or None, got "
                         f"{_show(on_text)}")
    return stops


# ------------------------------------------------------------------------------------------------------- CLIs
def one_line(text: str) -> str:
    """``text`` with its lines joined (an error message printed by a CLI is one line)."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def quiet_library_notices() -> None:
    """Keep libraries' import-time advice off a command's output; every command-line tool calls this first, before
    anything imports transformers. transformers prints "PyTorch was not found. Models won't be available ..." on
    import wherever torch is absent (this package needs only its tokenizers); its ``warning_advice`` messages stay
    quiet while ``TRANSFORMERS_NO_ADVISORY_WARNINGS`` is set. A value the user set (even empty) is left alone, and
    real warnings and errors still print."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def program_name(default: str, argv0: str | None = None) -> str:
    """The name a tool's usage and ``--help`` show: ``default`` (``python -m diffspec_jax.generate``), unless the
    process runs under a ``diffspec`` command: ``diffspec generate`` (the :mod:`diffspec_jax.cli` dispatcher sets
    ``sys.argv[0]`` to that) or a console script such as ``diffspec-serve``."""
    name = os.path.basename(sys.argv[0] if argv0 is None else argv0)
    return name if name.startswith("diffspec") and not name.endswith(".py") else default


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every option's default: ``(default: X)`` after its help, unless the help already says
    (it mentions "default"), the option is a flag (off unless given) or its default is ``None`` (the help says
    what that means)."""

    @staticmethod
    def _states_default(action: argparse.Action) -> bool:
        d = action.default
        return not (d is None or d is False or d is argparse.SUPPRESS or not action.option_strings
                    or "default" in (action.help or "").lower())

    def _get_help_string(self, action: argparse.Action) -> str:
        return super()._get_help_string(action) if self._states_default(action) else action.help or ""

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and self._states_default(action):  # argparse prints nothing after an option without help
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors are one line on stderr (exit status 2), whose ``--help``
    shows every option's default (:class:`HelpFormatter`) and whose name is :func:`program_name`'s (the
    ``description``, often a module docstring's first line, names it so too, without its reST markup)."""

    def __init__(self, *, prog: str | None = None, description: str | None = None, formatter_class=HelpFormatter,
                 **kwargs):
        name = program_name(prog) if prog else None
        if description and prog:
            description = description.replace(prog, name).replace("``", "")
        super().__init__(prog=name, description=description, formatter_class=formatter_class, **kwargs)

    def error(self, message: str):  # noqa: D102  (argparse's hook)
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see --help)\n")


def report_error(exc: BaseException, prog: str | None = None) -> int:
    """Print ``exc`` as one line on stderr and return the exit status for it (2 = usage error, 1 = other)."""
    if isinstance(exc, OSError) and not isinstance(exc, DiffspecError):
        where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        message = f"{exc.strerror or exc}{where}"
    else:
        message = str(exc)
    notes = [str(n) for n in getattr(exc, "__notes__", ())]
    if notes:
        message += " (" + "; ".join(notes) + ")"
    print(f"{prog + ': ' if prog else ''}error: {one_line(message)}", file=sys.stderr)
    return exit_code(exc)


def run_main(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None,
             prog: str | None = None) -> int:
    """Run a tool's ``main``: its deliberate errors and OS errors become one line on stderr and an exit status."""
    try:
        return int(main(argv) or 0)
    except (DiffspecError, OSError) as exc:
        return report_error(exc, prog)
