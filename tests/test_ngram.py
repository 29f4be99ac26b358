"""Prompt lookup (``generate(target, "ngram", ...)``): the on-device n-gram search against a plain-Python reference,
the token history the server's slots keep through prefix-cache hits and preemption, and the CLI's ``--draft ngram``.
Its losslessness is checked beside every drafter's: greedy equality in test_engine.py, sampling in
test_self_draft.py."""

import json

import jax
import numpy as np
import pytest

from conftest import random_prompts
from diffspec_jax import NGram, SpecConfig, generate
from diffspec_jax.engine.ngram import ngram_propose, write_emitted
from diffspec_jax.errors import ConfigError


def reference(seq: list[int], min_n: int, max_n: int, k: int) -> tuple[list[int], bool]:
    """Plain Python: for n from max_n down to min_n, the latest earlier occurrence of the last n tokens; its
    continuation is copied token by token from the sequence extended by the copy itself (a match overlapping the end
    repeats with its period). No match: the last token k times."""
    last = len(seq) - 1
    for n in range(max_n, min_n - 1, -1):
        if n > last:
            continue
        suffix = seq[last - n + 1:]
        for end in range(last - 1, n - 2, -1):
            if seq[end - n + 1:end + 1] == suffix:
                out = list(seq)
                for j in range(k):
                    out.append(out[end + 1 + j])
                return out[last + 1:], True
    return [seq[-1]] * k, False


def test_search_matches_the_reference_on_random_sequences():
    """Fresh random rows of several lengths over small vocabularies (many matches, of every size, overlapping the
    end) and a large one (often none), with garbage past each row's end; and hand-made rows for each rule."""
    rng = np.random.default_rng()  # fresh inputs every run: a failure prints its rows
    width, k = 48, 5
    for min_n, max_n in ((1, 3), (2, 4), (3, 3), (1, 1)):
        rows, lengths = [], []
        for vocab in (2, 3, 5, 50, 10 ** 6):
            for _ in range(6):
                n = int(rng.integers(1, width + 1))
                row = rng.integers(0, vocab, width)
                rows.append(row)
                lengths.append(n - 1)  # the newest token's position
        hist, length = np.stack(rows).astype(np.int32), np.array(lengths, np.int32)
        drafts, found = jax.jit(ngram_propose, static_argnums=(2, 3, 4))(hist, length, min_n, max_n, k)
        drafts, found = np.asarray(drafts), np.asarray(found)
        for b in range(len(rows)):
            want, hit = reference([int(x) for x in hist[b, :length[b] + 1]], min_n, max_n, k)
            assert (drafts[b].tolist(), bool(found[b])) == (want, hit), (hist[b, :length[b] + 1].tolist(), min_n,
                                                                        max_n)
        assert found.any() and not found.all()
    # each rule once, by hand (k = 5; n 1..3)
    cases = [([7, 8, 9, 1, 2, 3, 7, 8, 9, 4, 5, 6, 7, 8, 9], [4, 5, 6, 7, 8], True),  # latest of two 3-gram matches
             ([1, 2, 3, 9, 2, 3, 8, 5, 3], [8, 5, 3, 8, 5], True),   # 3-gram: none; 2-gram: none; 1-gram: the latest
             ([4, 1, 2, 3, 5, 9, 2, 3], [5, 9, 2, 3, 5], True),      # the longest matching size wins (2 over 1)
             ([6, 6, 6], [6, 6, 6, 6, 6], True),                    # a run: period 1
             ([1, 2, 1, 2, 1], [2, 1, 2, 1, 2], True),              # period 2, copied past the end
             ([3, 1, 4, 5], [5] * 5, False), ([5], [5] * 5, False)]  # no match; one token
    hist = np.zeros((len(cases), 20), np.int32) - 7
    for b, (seq, _, _) in enumerate(cases):
        hist[b, :len(seq)] = seq
    drafts, found = ngram_propose(hist, np.array([len(c[0]) - 1 for c in cases], np.int32), 1, 3, 5)
    assert np.asarray(drafts).tolist() == [c[1] for c in cases]
    assert np.asarray(found).tolist() == [c[2] for c in cases]


def test_history_takes_the_emitted_tokens_of_active_rows():
    write = jax.jit(write_emitted)
    hist = np.arange(24, dtype=np.int32).reshape(2, 12) + 100
    emitted = np.array([[1, 2, 3], [4, 5, 6]], np.int32)
    got = np.asarray(write(hist, np.array([3, 10]), np.array([True, True]), emitted, np.array([2, 1])))
    want = hist.copy()
    want[0, 4:7] = [1, 2, 3]
    want[1, 11] = 4  # the second token would fall past the buffer: dropped
    np.testing.assert_array_equal(got, want)
    idle = np.asarray(write(hist, np.array([3, 4]), np.array([False, True]), emitted, np.array([2, 0])))
    assert (idle[0] == hist[0]).all() and idle[1, 5] == 4 and (idle[1, 6:] == hist[1, 6:]).all()


def test_settings_are_checked():
    assert NGram() == NGram(min_n=1, max_n=3, first=False)
    assert SpecConfig.from_flat(dict(ngram_min_n=2, ngram_max_n=5, ngram_first=True)).ngram == NGram(2, 5, True)
    for kw, match in ((dict(min_n=0), "ngram_min_n must be a positive integer"),
                      (dict(min_n=4), r"ngram_min_n \(4\) must be <= ngram_max_n \(3\)"),
                      (dict(max_n=33), "ngram_max_n must be <= 32"), (dict(first=1), "ngram_first must be True or")):
        with pytest.raises(ConfigError, match=match):
            NGram(**kw)
    with pytest.raises(ConfigError, match="ngram must be NGram"):
        SpecConfig(ngram=(1, 3))  # type: ignore[arg-type]


def test_ngram_refuses_what_it_does_not_support(targets, drafts):
    t, prompts = targets["llama"], [[1, 2, 3]]
    tree = SpecConfig.from_flat(dict(diffspec_verification_mode="tree", num_speculative_tokens=3))
    with pytest.raises(ConfigError, match="prompt lookup proposes chains"):
        generate(t, "ngram", prompts, max_new_tokens=4, spec=tree)
    with pytest.raises(ConfigError, match="prompt lookup proposes chains"):
        generate(t, drafts["llama"], prompts, max_new_tokens=4, spec=tree.replace(ngram=NGram(first=True)))
    with pytest.raises(ConfigError, match="draft='ngram' has none behind it"):
        generate(t, "ngram", prompts, max_new_tokens=4, spec=SpecConfig(ngram=NGram(first=True)))
    with pytest.raises(ConfigError, match="custom proposer"):
        generate(t, "ngram", prompts, max_new_tokens=4, proposer=lambda *a: None)
    with pytest.raises(ConfigError, match="'ngram' or None, got 'ngrams'"):
        generate(t, "ngrams", prompts, max_new_tokens=4)


# ------------------------------------------------------------------------------------------- the server's slots
def _run(engine, reqs, timeout=240.0):
    import time

    for r in reqs:
        engine.submit(r)
    deadline = time.monotonic() + timeout
    while not (all(r.finished for r in reqs) and engine._idle()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert all(r.finished for r in reqs)


def test_server_slots_keep_the_token_history_through_prefix_hits_and_preemption(targets):
    """``draft="ngram"`` in the slot engine (paged, prefix caching, a pool too small for its load): a shared
    document served from cached pages to later requests that preempt each other. Every output equals the target
    alone; a request never preempted accepts exactly as many drafts as generate() alone (its proposals read the
    same sequence, the cached prefix included); and once idle, the token history of each slot holds the prompt
    and output of the last request it served."""
    from diffspec_jax.serving.scheduler import EngineConfig, Request, SamplingParams, SlotEngine

    target = targets["llama"]
    page, chunk, max_len = 16, 32, 192
    spec = SpecConfig(num_speculative_tokens=3)
    eng = SlotEngine(target, "ngram", spec, EngineConfig(max_num_seqs=3, max_model_len=max_len, prefill_chunk=chunk,
                                                         block_size=page, num_kv_blocks=-(-max_len // page) + 4,
                                                         block_cycles=4))  # (pages reserved 2 blocks ahead)
    assert eng.policy == "ngram" and eng.prefix_caching
    eng.start()
    try:
        doc = random_prompts(31, [70])[0]
        first = Request(doc + [5, 6], SamplingParams(max_tokens=24, ignore_eos=True), lambda e: None)
        _run(eng, [first])
        reqs = [Request(doc + doc[3 * i:3 * i + 9], SamplingParams(max_tokens=40 + 25 * i, ignore_eos=True),
                        lambda e: None) for i in range(3)]
        _run(eng, reqs)
        assert all(r.cached_tokens == 64 for r in reqs) and sum(r.preemptions for r in reqs) > 0
        assert eng.metrics()["compiles_after_warmup"] == 0
        hist = np.asarray(eng._state.drafter)
        every = [first] + reqs
        last = {s: max((r for r in every if r.slot == s), key=lambda r: r.admitted_seq) for s in {r.slot for r in every}}
        assert any(r.preemptions for r in last.values())  # a slot whose last request was preempted and readmitted
    finally:
        eng.stop()
    kw = dict(prefill_chunk=chunk, stop_token_ids=(), max_cache_len=256)  # one capacity: one compilation
    longest = max(r.params.max_tokens for r in every)
    base = generate(target, None, [r.prompt_ids for r in every], max_new_tokens=longest, **kw).tokens
    for r, want in zip(every, base):
        alone = generate(target, "ngram", [r.prompt_ids], max_new_tokens=r.params.max_tokens, spec=spec, **kw)
        assert r.finish_reason == "length" and r.tokens == alone.tokens[0] == want[:r.params.max_tokens]
        if not r.preemptions:
            assert r.accepted == alone.stats.accepted_tokens
    for s, r in last.items():
        ctx = r.prompt_ids + r.tokens
        assert hist[s, :len(ctx)].tolist() == ctx


# ------------------------------------------------------------------------------------------------------ the CLI
@pytest.mark.parametrize("argv, words", [
    (["--ngram-min-n", "2"], "--ngram-min-n shapes prompt lookup, which runs with --draft ngram or --ngram-first"),
    (["--draft", "ngram", "--policy", "recent", "--token-budget", "256"],
     "--draft ngram reads the whole sequence, so --policy, --token-budget would have no effect"),
    (["--draft", "ngram", "--no-draft"], "--no-draft decodes with the target alone"),
    (["--draft", "ngram", "--ngram-min-n", "4"], "ngram_min_n (4) must be <= ngram_max_n (3)"),
])
def test_cli_refuses_what_prompt_lookup_would_ignore(tiny_dirs, argv, words, capsys):
    import importlib

    cli = importlib.import_module("diffspec_jax.generate")
    code = cli.main(["--target", str(tiny_dirs["llama"]), "--prompt-ids", "1,2,3"] + argv)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and words in err


def test_cli_draft_ngram(tiny_dirs, targets, capsys):
    """``--draft ngram`` prints the target-only tokens and reports its acceptance."""
    import importlib

    cli = importlib.import_module("diffspec_jax.generate")
    prompt = random_prompts(31, [70])[0] + [5, 6]
    want = generate(targets["llama"], None, [prompt], max_new_tokens=24, stop_token_ids=()).tokens[0]
    code = cli.main(["--target", str(tiny_dirs["llama"]), "--draft", "ngram", "--prompt-ids", ",".join(map(str, prompt)),
                     "-k", "3", "--ngram-max-n", "2", "--max-new-tokens", "24", "--ignore-eos", "--dtype", "float32",
                     "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert code == 0 and rep["draft"] == "ngram" and rep["ids"] == want
    s = rep["stats"]
    assert s["draft_context_policy"] is None and s["drafted_tokens"] == 3 * s["sequence_cycles"]
