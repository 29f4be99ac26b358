"""generate(prefix_cache=...): questions about one document prefill it once, follow-up turns reuse the previous
turn's pages, and every output equals generate() without the cache (tiny random Llama + EAGLE-3 draft, CPU)."""

import pytest

from conftest import random_prompts
from diffspec_jax import ConfigError, InputError, PrefixCache, SpecConfig, generate

SPEC = SpecConfig.from_flat(dict(diffspec_chunk_size=8, diffspec_token_budget=40, num_speculative_tokens=3,
                                 draft_context_policy="diffspec"))
PAGE, NEW = 16, 24
CAP = dict(max_cache_len=256)  # one capacity for every call: one set of programs


def test_prefix_cache_reuses_documents_and_turns(targets, drafts):
    target, draft = targets["llama"], drafts["llama"]

    def run(prompts, **kw):
        return generate(target, draft, prompts, max_new_tokens=NEW, spec=SPEC, stop_token_ids=(), **CAP, **kw)

    doc, q1, q2, q3 = random_prompts(21, (150, 9, 12, 7))
    cache = PrefixCache(num_pages=80, page_size=PAGE)
    first = run([doc + q1], prefix_cache=cache)
    assert first.stats.cached_tokens == [0]
    asks = [doc + q2, doc + q3]
    again = run(asks, prefix_cache=cache)
    # every full page of the document whose next token is the document's too (the draft's entry reads it)
    assert again.stats.cached_tokens == [(150 - 1) // PAGE * PAGE] * 2
    turn = doc + q1 + first.tokens[0] + q2
    follow = run([turn], prefix_cache=cache)
    done = len(doc + q1) + NEW - 1 - (SPEC.num_speculative_tokens + 1)  # (the draft's pending rows are not kept)
    assert follow.stats.cached_tokens[0] >= done // PAGE * PAGE
    plain = run([doc + q1] + asks + [turn])
    assert first.tokens + again.tokens + follow.tokens == plain.tokens
    st = cache.stats
    assert st.used == 0 and st.prefix_hits == sum(again.stats.cached_tokens) + follow.stats.cached_tokens[0]
    with pytest.raises(InputError, match="cannot hold this batch"):
        run(random_prompts(5, (200,) * 8), prefix_cache=cache)
    assert cache.stats.used == 0
    with pytest.raises(ConfigError, match="full"):
        generate(target, draft, [doc], max_new_tokens=4, spec=SpecConfig(), prefix_cache=cache)
