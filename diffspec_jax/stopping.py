"""When generation stops: EOS ids, a checkpoint's sampling defaults, stop strings and finish reasons.

* :func:`eos_token_ids`: every EOS id of a model directory (``generation_config.json`` and ``config.json``);
* :func:`generation_defaults`: the sampling settings of ``generation_config.json`` (what ``transformers``'
  ``generate()`` would use), as :class:`~diffspec_jax.config.SamplingConfig` keyword arguments;
* :class:`StopStrings`: stop strings matched on streamed text, holding back a tail that could still begin one;
* :class:`SequenceText`: one sequence's text as it streams (:class:`~diffspec_jax.detokenize.IncrementalDetokenizer`
  then :class:`StopStrings`) and the tokens that text needs;
* finish reasons: :data:`FINISH_STOP` (an EOS / stop token or a stop string ended the sequence) and
  :data:`FINISH_LENGTH` (it reached ``max_new_tokens``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from diffspec_jax.config import ModelConfig, SamplingConfig, _token_ids
from diffspec_jax.detokenize import IncrementalDetokenizer
from diffspec_jax.errors import ConfigError, PathNotFoundError
from diffspec_jax.validation import check_bool, check_int, check_stop_strings, read_json_object

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH)

GENERATION_CONFIG = "generation_config.json"
#: what ``transformers`` samples with when ``generation_config.json`` sets ``do_sample`` but leaves a key out
#: (``GenerationConfig._get_default_generation_params``)
TRANSFORMERS_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}


def _model_dir(model_dir: str | Path) -> Path:
    path = Path(model_dir)
    if not path.is_dir():
        raise PathNotFoundError(f"model directory {path} does not exist or is not a directory")
    return path


def _generation_config(model_dir: Path) -> dict[str, Any] | None:
    file = model_dir / GENERATION_CONFIG
    return read_json_object(file, GENERATION_CONFIG) if file.exists() else None


def generation_eos_ids(model_dir: str | Path) -> tuple[int, ...]:
    """The ``eos_token_id`` of ``model_dir/generation_config.json`` (an int or a list; ``()`` without the file)."""
    path = _model_dir(model_dir)
    gen = _generation_config(path)
    if gen is None:
        return ()
    source = str(path / GENERATION_CONFIG)
    ids = _token_ids(gen.get("eos_token_id"), "eos_token_id", source)
    for e in ids:
        check_int(e, f"{source}: eos_token_id", min=0)
    return ids


def merge_eos_ids(*groups: Sequence[int]) -> tuple[int, ...]:
    """The ids of every group, in order, each once."""
    return tuple(dict.fromkeys(int(i) for g in groups for i in g))


def eos_token_ids(model_dir: str | Path) -> tuple[int, ...]:
    """Every EOS id of a model directory: ``config.json``'s ``eos_token_id`` then those ``generation_config.json``
    adds (instruct checkpoints such as Llama-3.1-Instruct name their end-of-turn tokens only there).

    Raises:
        PathNotFoundError / CheckpointError: no such directory / no ``config.json``.
        ConfigError: either file is not a JSON object, or an id is not a non-negative integer.
    """
    path = _model_dir(model_dir)
    return merge_eos_ids(ModelConfig.from_pretrained(path).eos_token_ids, generation_eos_ids(path))


def generation_defaults(model_dir: str | Path) -> dict[str, Any]:
    """The sampling defaults of ``model_dir/generation_config.json`` as :class:`SamplingConfig` keyword arguments
    (``temperature``, ``top_k``, ``top_p``), read as ``transformers``' ``generate()`` reads them.

    ``do_sample`` false or absent means greedy (``temperature`` 0; the file's temperature is then ignored, as
    transformers ignores it). With ``do_sample`` true a key the file leaves out takes transformers' default
    (:data:`TRANSFORMERS_SAMPLING_DEFAULTS`: temperature 1, top_k 50, top_p 1). ``{}`` when there is no file.

    Raises:
        ConfigError: the file is not a JSON object, or a value is out of range (named with the file).
    """
    path = _model_dir(model_dir)
    gen = _generation_config(path)
    if gen is None:
        return {}
    source = str(path / GENERATION_CONFIG)
    sample = gen.get("do_sample")
    if sample is not None:
        check_bool(sample, f"{source}: do_sample")
    if not sample:
        return {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
    values = {k: gen[k] if gen.get(k) is not None else v for k, v in TRANSFORMERS_SAMPLING_DEFAULTS.items()}
    try:
        cfg = SamplingConfig(**values)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return {"temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p}


class StopStrings:
    """Stop strings matched on text that arrives in pieces.

    :meth:`feed` returns the part of the text seen so far that is safe to emit: it holds back the longest tail
    that could still begin a stop string. Once a stop string occurs, the returned text ends exactly before its
    first occurrence (the earliest start over all stop strings) and everything after it is dropped. The
    concatenation of the returned pieces (and :meth:`flush`) is the whole text cut before the first stop string.

    Args:
        stops: the stop strings (one string is one stop string; ``()`` never stops).
    Raises:
        InputError: a stop string is empty or not a string.
    """

    def __init__(self, stops: Sequence[str] | str):
        self.stops = check_stop_strings(stops)
        self._longest = max((len(s) for s in self.stops), default=0)
        self._held = ""
        self.matched = False

    def feed(self, new_text: str) -> tuple[str, bool]:
        """Append ``new_text``; returns ``(text safe to emit now, whether a stop string has matched)``."""
        if self.matched:
            return "", True
        text = self._held + new_text
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.matched, self._held = True, ""
            return text[:min(hits)], True
        keep = self._tail(text)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep], False

    def _tail(self, text: str) -> int:
        """The length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for k in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def flush(self) -> str:
        """The held-back tail at the end of the text (no stop string can complete any more)."""
        held, self._held = self._held, ""
        return held


class SequenceText:
    """One sequence's text as generation streams its tokens: decoded incrementally, cut before its first stop
    string, and the leading tokens that text needs.

    :meth:`push` and :meth:`finish` return ``(new text, new ids)``: the text that became final and the ids that
    became final with it, the fewest leading ids whose decoding holds :attr:`text` (a token straddling the end
    of the text, part before a stop string and part in it, is kept). Concatenated, the pieces are :attr:`text`
    and the ids are :attr:`tokens`. Without a stop string, :meth:`finish` makes every id pushed final and
    :attr:`text` is ``tokenizer.decode(ids, skip_special_tokens=...)``.
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str] | str = (), *, skip_special_tokens: bool = True):
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self._stops = StopStrings(stops)
        self._ids: list[int] = []
        self._kept = 0
        self.text = ""
        self.finished = False

    @property
    def stopped(self) -> bool:
        """A stop string ended the text."""
        return self._stops.matched

    @property
    def tokens(self) -> list[int]:
        """The final ids so far."""
        return self._ids[:self._kept]

    def push(self, ids: Sequence[int]) -> tuple[str, list[int]]:
        if self.finished or self.stopped:
            return "", []
        ids = [int(i) for i in ids]
        self._ids.extend(ids)
        piece, _ = self._stops.feed(self._detok.push(ids))
        return self._advance(piece, final=False)

    def finish(self) -> tuple[str, list[int]]:
        """The sequence has ended: the rest of its text and ids."""
        if self.finished or self.stopped:
            self.finished = True
            return "", []
        piece, hit = self._stops.feed(self._detok.flush())
        if not hit:
            piece += self._stops.flush()
        self.finished = True
        return self._advance(piece, final=not hit)

    def _advance(self, piece: str, *, final: bool) -> tuple[str, list[int]]:
        self.text += piece
        n = len(self._ids) if final else self._detok.tokens_for(len(self.text))
        new = self._ids[self._kept:n]
        self._kept = max(self._kept, n)
        return piece, new
