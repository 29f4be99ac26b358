"""Incremental detokenization: the text of a growing list of token ids, emitted only once it is final.

:class:`IncrementalDetokenizer` decodes a sliding window of ids (``ids[prefix:]``) and subtracts the window's
already-emitted head (``ids[prefix:read]``), the prefix-offset scheme of transformers' ``TextStreamer``, vLLM and
``tokenizers``' ``DecodeStream``: per push it decodes a window of about two pushes, never the whole sequence, and
the window's head keeps the context a tokenizer needs to decode the first new token right (SentencePiece drops the
leading space of a decode's first token, byte-level BPE splits a character over several tokens). A decoded tail
that ends in U+FFFD (the replacement character ``errors="replace"`` gives incomplete UTF-8 bytes) is held back
until more ids complete it, so a piece never ends in a partial character.

For a tokenizer whose decoding of a prefix of ids is a prefix of the decoding of all of them (byte-level BPE,
SentencePiece, WordPiece: every tokenizer transformers streams with ``TextStreamer``), the concatenation of every
piece :meth:`~IncrementalDetokenizer.push` returns and :meth:`~IncrementalDetokenizer.flush` equals
``tokenizer.decode(all_ids, skip_special_tokens=...)``; where a window disagrees with that rule, the detokenizer
falls back to decoding the whole prefix (correct, slower).
"""

from __future__ import annotations

import bisect
from typing import Any, NamedTuple, Sequence

from diffspec_jax.errors import InputError
from diffspec_jax.validation import check_bool, check_int

#: U+FFFD, what decoding gives for bytes that do not (yet) form a UTF-8 character
REPLACEMENT = "\ufffd"
#: a push tries to emit up to its last id, then up to 1, 2, ... MAX_HELD_IDS ids fewer (a UTF-8 character is at
#: most 4 bytes, so at most 3 ids of an incomplete character follow the last complete one)
MAX_HELD_IDS = 3


class _Mark(NamedTuple):
    """A point where the emitted text was exactly the decoding of ``ids[:read]``: ``chars`` characters of it, and
    the window head ``decode(ids[prefix:read]) == head`` that decodes what follows."""

    read: int
    prefix: int
    chars: int
    head: str


class IncrementalDetokenizer:
    """The text of a stream of token ids, one final piece per :meth:`push`.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=...)`` (a transformers tokenizer).
        skip_special_tokens: leave special tokens (EOS, padding, chat markers) out of the text (default).
    Attributes:
        text: everything emitted so far (the concatenation of the pieces).
    """

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True):
        if not callable(getattr(tokenizer, "decode", None)):
            raise InputError(f"tokenizer must have a decode(ids, skip_special_tokens=...) method (a transformers "
                             f"tokenizer), got {type(tokenizer).__name__}")
        self._tok = tokenizer
        self._skip = check_bool(skip_special_tokens, "skip_special_tokens", error=InputError)
        self._ids: list[int] = []
        self._marks = [_Mark(read=0, prefix=0, chars=0, head="")]
        self._text = ""
        self._flushed = False

    @property
    def text(self) -> str:
        return self._text

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=self._skip)

    def push(self, ids: Sequence[int]) -> str:
        """Append ``ids`` and return the text that became final (``""`` while it is held back)."""
        if self._flushed:
            raise InputError("this IncrementalDetokenizer was flushed; start a new one for more ids")
        self._ids.extend(check_int(i, "token id", min=0, error=InputError) for i in ids)
        last = self._marks[-1].read
        for n in range(len(self._ids), max(last, len(self._ids) - MAX_HELD_IDS - 1), -1):
            piece = self._emit_to(n)
            if piece is not None:
                return piece
        return ""

    def flush(self) -> str:
        """The rest of the text (an incomplete character at the end is decoded as U+FFFD, as ``decode`` does);
        the detokenizer takes no ids after it."""
        if self._flushed:
            return ""
        self._flushed = True
        full = self._decode(self._ids)
        if full.startswith(self._text):
            piece = full[len(self._text):]
        else:  # a tokenizer whose prefix decodings are not prefixes: the window's view (it cannot take text back)
            m = self._marks[-1]
            window = self._decode(self._ids[m.prefix:])
            piece = window[len(m.head):] if window.startswith(m.head) else ""
        self._text += piece
        self._marks.append(_Mark(read=len(self._ids), prefix=len(self._ids), chars=len(self._text), head=""))
        return piece

    def _upto(self, n: int, m: _Mark) -> str:
        """The text of ``ids[:n]`` after mark ``m`` (``n >= m.read``), from the window ``ids[m.prefix:n]``."""
        window = self._decode(self._ids[m.prefix:n])
        if window.startswith(m.head):
            return window[len(m.head):]
        full = self._decode(self._ids[:n])  # fallback: the whole prefix
        return full[m.chars:] if full.startswith(self._text[:m.chars]) else ""

    def _emit_to(self, n: int) -> str | None:
        """Emit the text of ``ids[:n]`` past the last mark if it is final (does not end in U+FFFD); else None."""
        m = self._marks[-1]
        piece = self._upto(n, m)
        if not piece or piece.endswith(REPLACEMENT):
            return None
        self._text += piece
        self._marks.append(_Mark(read=n, prefix=m.read, chars=len(self._text),
                                 head=self._decode(self._ids[m.read:n])))
        return piece

    def tokens_for(self, chars: int) -> int:
        """The fewest leading ids whose decoding holds the first ``chars`` characters of :attr:`text`.

        ``0 <= chars <= len(text)``. A token whose text straddles position ``chars`` is counted (it holds the
        character before the position). Decodes a few windows within one push, never the whole sequence.
        """
        chars = check_int(chars, "chars", min=0, max=len(self._text), error=InputError)
        if chars == 0:
            return 0
        keys = [m.chars for m in self._marks]
        lo = self._marks[bisect.bisect_left(keys, chars) - 1]  # the last mark before the position
        hi = self._marks[bisect.bisect_left(keys, chars)].read  # the first mark at or past it
        want = self._text[lo.chars:chars]
        # the smallest n in (lo.read, hi] whose text reaches the position (monotone in n)
        left, right = lo.read + 1, hi
        while left < right:
            mid = (left + right) // 2
            if self._upto(mid, lo).startswith(want):
                right = mid
            else:
                left = mid + 1
        return right
