"""IncrementalDetokenizer against the tokenizer's own decode: a real byte-level BPE tokenizer (the demo pair's,
through transformers), multi-byte text streamed one token at a time, random id streams (hypothesis).

Fast and without JAX.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffspec_jax.detokenize import REPLACEMENT, IncrementalDetokenizer
from diffspec_jax.errors import InputError

MULTIBYTE = ("def 函数(x):\n    return \"日本語テキスト 🎉\"  # héllo wörld ✓ 👩‍👩‍👧 ∑ ok\n"
             "print('世界', '😀😃', 'ça va?')\n")


@pytest.fixture(scope="module")
def tok():
    """The demo pair's byte-level BPE tokenizer (4096 ids, <|endoftext|> = 0 and <|pad|> = 1 special)."""
    from transformers import AutoTokenizer

    from diffspec_jax import demo

    return AutoTokenizer.from_pretrained(demo.target_dir())


def stream(tok, ids, sizes, skip=True):
    """Push ``ids`` in pieces of ``sizes`` (cycled), then flush; returns (pieces, detokenizer)."""
    d = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces, i, j = [], 0, 0
    while i < len(ids):
        n = sizes[j % len(sizes)]
        pieces.append(d.push(ids[i:i + n]))
        i, j = i + n, j + 1
    pieces.append(d.flush())
    return pieces, d


def test_multibyte_text_one_token_at_a_time(tok):
    ids = tok(MULTIBYTE)["input_ids"]
    singles = [tok.decode([i]) for i in ids]
    assert sum(REPLACEMENT in s for s in singles) > 20  # the characters really are split over byte tokens
    pieces, d = stream(tok, ids, [1])
    assert "".join(pieces).encode() == tok.decode(ids, skip_special_tokens=True).encode() == MULTIBYTE.encode()
    assert d.text == MULTIBYTE
    assert not any(REPLACEMENT in p for p in pieces)  # never a partial character
    # a piece is final: the text so far is always a prefix of the whole
    acc = ""
    for p in pieces:
        acc += p
        assert MULTIBYTE.startswith(acc)


def test_each_token_is_emitted_as_soon_as_its_character_is_complete(tok):
    ids = tok("a世b")["input_ids"]
    d = IncrementalDetokenizer(tok)
    got = [d.push([i]) for i in ids]
    # 世 is three byte tokens: two pushes hold back, the third emits the whole character
    assert "".join(got) == "a世b" and "世" in got and got.count("") >= 2


def test_special_tokens_skipped_or_kept(tok):
    ids = tok("x = 1")["input_ids"] + [0] + tok(" 世界")["input_ids"] + [0]
    for skip in (True, False):
        pieces, d = stream(tok, ids, [1, 2], skip=skip)
        assert d.text == tok.decode(ids, skip_special_tokens=skip)
    assert "<|endoftext|>" in d.text and "<|endoftext|>" not in stream(tok, ids, [1])[1].text


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.sampled_from(list("ab \n(){}=_x1") + list("世界日本語ñé✓") + ["🎉", "😀", "👩"]),
                    max_size=40),
       sizes=st.lists(st.integers(1, 5), min_size=1, max_size=6))
def test_valid_text_streams_exactly_with_no_partial_characters(tok, text, sizes):
    ids = tok(text)["input_ids"]
    pieces, d = stream(tok, ids, sizes)
    assert "".join(pieces) == text == d.text
    assert not any(REPLACEMENT in p for p in pieces)


#: ids that make hard streams: byte tokens of multi-byte characters, the two special tokens, anything else
HARD_IDS = st.one_of(st.sampled_from([0, 1]), st.integers(0, 4095),
                     st.sampled_from([104, 118, 129, 162, 165, 174, 222, 233, 236, 238, 245, 246, 255]))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(HARD_IDS, max_size=30), sizes=st.lists(st.integers(1, 6), min_size=1, max_size=5),
       skip=st.booleans())
def test_random_id_streams_concatenate_to_the_final_decode(tok, ids, sizes, skip):
    """Any ids (invalid UTF-8 included, which decodes to U+FFFD in the final text too): the pieces add up to the
    tokenizer's decode, and tokens_for gives the fewest leading ids holding a prefix of the text."""
    pieces, d = stream(tok, ids, sizes, skip)
    full = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(pieces) == full == d.text
    for chars in {0, len(full) // 3, len(full) // 2, len(full)}:
        n = d.tokens_for(chars)
        assert tok.decode(ids[:n], skip_special_tokens=skip)[:chars] == full[:chars]
        if n:
            assert tok.decode(ids[:n - 1], skip_special_tokens=skip)[:chars] != full[:chars]


def test_tokens_for_counts_the_straddling_token(tok):
    ids = tok("hello world")["input_ids"]
    _, d = stream(tok, ids, [len(ids)])
    per = [tok.decode(ids[:n]) for n in range(len(ids) + 1)]
    for chars in range(len(d.text) + 1):
        n = d.tokens_for(chars)
        assert per[n].startswith(d.text[:chars]) and (n == 0 or not per[n - 1].startswith(d.text[:chars]))


def test_bad_use_is_a_named_error(tok):
    with pytest.raises(InputError, match="decode"):
        IncrementalDetokenizer(object())
    with pytest.raises(InputError, match="skip_special_tokens"):
        IncrementalDetokenizer(tok, skip_special_tokens="yes")
    d = IncrementalDetokenizer(tok)
    with pytest.raises(InputError, match="token id"):
        d.push([-3])
    d.push([73])
    with pytest.raises(InputError, match="chars"):
        d.tokens_for(5)
    d.flush()
    with pytest.raises(InputError, match="flushed"):
        d.push([73])
