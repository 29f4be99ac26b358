"""diffspec_jax.stopping: EOS ids and sampling defaults from a model directory, stop strings on streamed text,
one sequence's text and tokens (SequenceText). Fast; JAX only for the load_target check."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffspec_jax import stopping
from diffspec_jax.errors import ConfigError, InputError, PathNotFoundError
from diffspec_jax.stopping import SequenceText, StopStrings


@pytest.fixture()
def model_dir(tmp_path):
    """A directory with a tiny Llama config.json (eos_token_id 2)."""
    from checkpoints_tools.make_tiny import tiny_config

    (tmp_path / "config.json").write_text(json.dumps(tiny_config("llama").to_hf_dict()))
    return tmp_path


def write_gen(path, **fields):
    (path / "generation_config.json").write_text(json.dumps(fields))


# ------------------------------------------------------------------------------------------------ EOS ids
@pytest.mark.parametrize("gen, want", [
    (None, (2,)), ({"eos_token_id": 7}, (2, 7)), ({"eos_token_id": [9, 2, 8]}, (2, 9, 8)),
    ({"eos_token_id": None, "bos_token_id": 1}, (2,)), ({"eos_token_id": 2.0}, (2,)),
])
def test_eos_ids_unite_config_and_generation_config(model_dir, gen, want):
    if gen is not None:
        write_gen(model_dir, **gen)
    assert stopping.eos_token_ids(model_dir) == want


def test_eos_ids_bad_files_are_named(model_dir, tmp_path_factory):
    write_gen(model_dir, eos_token_id="</s>")
    with pytest.raises(ConfigError, match="generation_config.json: eos_token_id must be an integer"):
        stopping.eos_token_ids(model_dir)
    write_gen(model_dir, eos_token_id=[-1])
    with pytest.raises(ConfigError, match="generation_config.json: eos_token_id"):
        stopping.eos_token_ids(model_dir)
    (model_dir / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        stopping.eos_token_ids(model_dir)
    with pytest.raises(PathNotFoundError):
        stopping.eos_token_ids(model_dir / "missing")


def test_load_target_stops_at_generation_config_eos(tmp_path):
    from checkpoints_tools.make_tiny import make_tiny
    from diffspec_jax import load_target

    d = make_tiny(tmp_path / "t", "llama", seed=0)
    write_gen(d, eos_token_id=[5, 2, 6])
    assert load_target(d, dtype="float32", verify=False).config.eos_token_ids == (2, 5, 6)


# ------------------------------------------------------------------------------------- sampling defaults
@pytest.mark.parametrize("gen, want", [
    (None, {}),
    ({"do_sample": False, "temperature": 0.6, "top_p": 0.9}, {"temperature": 0.0, "top_k": 0, "top_p": 1.0}),
    ({"temperature": 0.6}, {"temperature": 0.0, "top_k": 0, "top_p": 1.0}),  # do_sample absent: greedy
    ({"do_sample": True, "temperature": 0.6, "top_p": 0.9}, {"temperature": 0.6, "top_k": 50, "top_p": 0.9}),
    ({"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.95},
     {"temperature": 0.7, "top_k": 20, "top_p": 0.95}),
    ({"do_sample": True}, {"temperature": 1.0, "top_k": 50, "top_p": 1.0}),
])
def test_generation_defaults_read_like_transformers(model_dir, gen, want):
    if gen is not None:
        write_gen(model_dir, **gen)
    got = stopping.generation_defaults(model_dir)
    assert got == want
    if gen is not None:  # transformers' own reading of the file agrees on what it sets
        from transformers import GenerationConfig

        g = GenerationConfig.from_pretrained(model_dir)
        assert bool(g.do_sample) == (got["temperature"] > 0)
        for key in ("temperature", "top_k", "top_p"):
            if got["temperature"] > 0 and getattr(g, key) is not None:
                assert getattr(g, key) == pytest.approx(got[key])


def test_generation_defaults_bad_values_are_named(model_dir):
    write_gen(model_dir, do_sample=True, top_p=0.0)
    with pytest.raises(ConfigError, match="generation_config.json: top_p"):
        stopping.generation_defaults(model_dir)
    write_gen(model_dir, do_sample="yes")
    with pytest.raises(ConfigError, match="do_sample must be True or False"):
        stopping.generation_defaults(model_dir)


# -------------------------------------------------------------------------------------------- stop strings
def reference_cut(text: str, stops, pieces=None) -> tuple[str, bool]:
    """The text cut before the earliest occurrence of any stop string, by brute force. Fed in ``pieces`` (as
    generation streams it), the text ends at the first piece that completes a stop string: nothing after it is ever
    generated, so a longer stop string that would have begun earlier but ends later never completes; the cut is at
    the earliest occurrence within the text up to that piece."""
    ends = [len(text)]
    if pieces is not None:
        ends = [sum(map(len, pieces[:i + 1])) for i in range(len(pieces))]
    for end in ends:
        seen = text[:end]
        starts = [i for i in range(len(seen)) if any(seen.startswith(s, i) for s in stops)]
        if starts:
            return seen[:starts[0]], True
    return text, False


def pieces_of(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc\n", max_size=30), stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4),
                                                                   max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=8))
def test_stop_strings_cut_exactly_and_hold_back_only_possible_starts(text, stops, cuts):
    s = StopStrings(stops)
    out, seen, matched = "", "", False
    for piece in pieces_of(text, cuts):
        emitted, matched = s.feed(piece)
        seen += piece
        out += emitted
        if matched:
            break
        # held back: exactly the longest tail of the text so far that could still begin a stop string
        assert seen.startswith(out)
        assert not any(stop.startswith(seen[i:]) for stop in stops for i in range(len(out)))
        held = seen[len(out):]
        assert not held or any(stop.startswith(held) and stop != held for stop in stops)
    if not matched:
        out += s.flush()
    want, hit = reference_cut(text, stops, pieces_of(text, cuts))
    assert (out, matched) == (want, hit)


def test_stop_strings_after_a_match_and_validation():
    s = StopStrings(["</answer>", "\n\n"])
    assert s.feed("The answer is 4</ans") == ("The answer is 4", False)
    assert s.feed("wer> and more") == ("", True)
    assert s.feed("anything") == ("", True) and s.flush() == ""
    assert StopStrings("END").stops == ("END",)  # one string is one stop string
    assert StopStrings(()).feed("abc") == ("abc", False)
    with pytest.raises(InputError, match="empty string"):
        StopStrings(["ok", ""])
    with pytest.raises(InputError, match=r"stop\[0\] must be a string"):
        StopStrings([3])
    with pytest.raises(InputError, match="string or a list of strings"):
        StopStrings(5)


# ---------------------------------------------------------------------------------------------- SequenceText
@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from diffspec_jax import demo

    return AutoTokenizer.from_pretrained(demo.target_dir())


TEXT = "x = '世界'  # 🎉 done\nprint(x)  # ça ✓ fin\n"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(start=st.integers(0, len(TEXT) - 1), length=st.integers(1, 4), size=st.integers(1, 4))
def test_sequence_text_cuts_text_and_tokens(tok, start, length, size):
    ids = tok(TEXT)["input_ids"]
    stop = TEXT[start:start + length]
    seq = SequenceText(tok, [stop])
    texts, toks = [], []
    for i in range(0, len(ids), size):
        piece, new = seq.push(ids[i:i + size])
        texts.append(piece)
        toks.extend(new)
    piece, new = seq.finish()
    texts.append(piece)
    toks.extend(new)
    want = TEXT[:TEXT.find(stop)]
    assert seq.stopped and seq.text == "".join(texts) == want
    assert toks == seq.tokens
    n = len(seq.tokens)  # the fewest leading ids holding the text
    assert seq.tokens == ids[:n] and tok.decode(ids[:n]).startswith(want)
    assert n == 0 or not tok.decode(ids[:n - 1]).startswith(want)


def test_sequence_text_without_a_match_keeps_every_token(tok):
    ids = tok(TEXT)["input_ids"] + [0]  # EOS at the end: kept in the tokens, skipped in the text
    seq = SequenceText(tok, ["never"])
    got = [seq.push([i]) for i in ids] + [seq.finish()]
    assert "".join(p for p, _ in got) == TEXT == seq.text and not seq.stopped
    assert [i for _, new in got for i in new] == ids == seq.tokens
