"""DiffSpec end to end: lossless working-cache policies, retrieval cadence and counters, target-guided selection,
equivalence with plain EAGLE-3 when everything fits, and no recompilation across retrievals."""

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_prompts, recording_proposer
from diffspec_jax import SpecConfig, generate
from diffspec_jax.utils import CompileCounter

LENGTHS = (97, 150, 71)
NEW = 48
SMALL = dict(diffspec_chunk_size=8, diffspec_token_budget=40, num_speculative_tokens=3)  # Hb = 32, 4 chunks


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(8, LENGTHS)


@pytest.fixture(scope="module")
def baseline(targets, prompts):
    return generate(targets["llama"], None, prompts, max_new_tokens=NEW, stop_token_ids=()).tokens


def check_identity(retrieval_stats):
    for s in retrieval_stats["per_sequence"] + [retrieval_stats["aggregate"]]:
        assert s["cycles"] == (s["retrievals"] - s["retrievals_after_prefill"]) + s["skipped_not_due"] + \
            s["skipped_fits"]


@pytest.mark.parametrize("extra", [
    dict(draft_context_policy="recent"),
    dict(draft_context_policy="diffspec"),
    dict(draft_context_policy="diffspec", diffspec_keep_sink_chunk=True, diffspec_retrieval_interval=2),
    dict(draft_context_policy="diffspec", diffspec_scorer="salience", diffspec_redundancy_weight=0.5,
         diffspec_adaptive_profile=True),
])
def test_working_cache_policies_are_lossless(extra, targets, drafts, prompts, baseline):
    """(The retrieval-cadence case runs on the paged cache: the draft's store in pages too.)"""
    paged = 16 if extra.get("diffspec_retrieval_interval") else None
    res = generate(targets["llama"], drafts["llama"], prompts, max_new_tokens=NEW,
                   spec=SpecConfig.from_flat(dict(**SMALL, **extra)), stop_token_ids=(), page_size=paged)
    assert res.tokens == baseline
    if extra["draft_context_policy"] == "diffspec":
        check_identity(res.stats.retrieval)
        agg = res.stats.retrieval["aggregate"]
        assert agg["retrievals"] >= 1 + len(LENGTHS)
        for s in res.stats.retrieval["per_sequence"]:
            assert s["working_len"] == 32  # n = Hb once the context exceeds it
            assert s["interval"] == extra.get("diffspec_retrieval_interval", 4) or extra.get(
                "diffspec_adaptive_profile")  # a draft model's default interval: 4
            if extra.get("diffspec_keep_sink_chunk"):
                assert s["sink_kept"] and 0 in s["anchor_chunks"]
            assert len(s["anchor_chunks"]) == 3
    else:
        assert res.stats.retrieval is None


@pytest.mark.parametrize("interval", [2, 3])
def test_retrieval_fires_at_the_configured_cadence_in_chain_mode(interval, targets, drafts, prompts):
    spec = SpecConfig.from_flat(dict(draft_context_policy="diffspec", diffspec_retrieval_interval=interval, **SMALL))
    res = generate(targets["llama"], drafts["llama"], prompts, max_new_tokens=NEW, spec=spec, stop_token_ids=())
    check_identity(res.stats.retrieval)
    for s in res.stats.retrieval["per_sequence"]:  # every prompt is longer than Hb: nothing is skipped as fitting
        assert s["retrievals_after_prefill"] == 1 and s["skipped_fits"] == 0
        assert s["retrievals"] - 1 == s["cycles"] // interval
        assert s["interval"] == interval and s["retrieval_ms"] > 0 and len(s["selection_digest"]) == 16


def test_retrieve_after_prefill_switch_and_short_contexts(targets, drafts):
    spec = SpecConfig.from_flat(dict(draft_context_policy="diffspec", diffspec_retrieve_after_prefill=False, **SMALL))
    res = generate(targets["llama"], drafts["llama"], random_prompts(3, [90, 12]), max_new_tokens=16, spec=spec,
                   stop_token_ids=())
    long_, short = res.stats.retrieval["per_sequence"]
    assert long_["retrievals_after_prefill"] == 0 and long_["skipped_prefill"] == 1 and long_["retrievals"] >= 1
    assert short["retrievals"] == 0 and short["skipped_fits"] >= 1  # r <= Hb: the whole context fits
    check_identity(res.stats.retrieval)


def test_diffspec_with_budget_covering_the_context_proposes_what_full_proposes(targets, drafts, prompts):
    """Budget >= context: the working cache holds the whole history at local = absolute positions, so every
    draft token of every cycle equals plain EAGLE-3's."""
    logs = {"full": [], "diffspec": []}
    for policy in logs:
        spec = SpecConfig.from_flat(dict(draft_context_policy=policy, num_speculative_tokens=3, diffspec_chunk_size=16,
                                         diffspec_token_budget=256))
        generate(targets["llama"], drafts["llama"], prompts, max_new_tokens=32, spec=spec, stop_token_ids=(),
                 proposer=functools.partial(recording_proposer, logs[policy]))
    assert len(logs["full"]) == len(logs["diffspec"]) > 5
    for a, b in zip(logs["full"], logs["diffspec"]):
        np.testing.assert_array_equal(a, b)


def test_working_cache_really_restricts_the_draft(targets, drafts, prompts):
    """With a small budget the draft sees a different context, so its proposals differ from plain EAGLE-3's."""
    logs = {"full": [], "diffspec": []}
    for policy in logs:
        spec = SpecConfig.from_flat(dict(draft_context_policy=policy, **SMALL))
        generate(targets["llama"], drafts["llama"], prompts, max_new_tokens=16, spec=spec, stop_token_ids=(),
                 proposer=functools.partial(recording_proposer, logs[policy]))
    assert any(not np.array_equal(a, b) for a, b in zip(logs["full"], logs["diffspec"]))


# ------------------------------------------------------------------------------ selection follows attention
NEEDLE = 5


@pytest.fixture(scope="module")
def needle_pair(tmp_path_factory):
    """A tiny Llama whose layer 0 attends from a token to earlier copies of the same token (q and k read the
    same random projection of the embedding, in head dims whose RoPE frequency is ~0), plus a random draft."""
    from checkpoints_tools.make_tiny import make_tiny_draft, tiny_config
    from diffspec_jax import load_draft
    from diffspec_jax.config import RopeConfig
    from diffspec_jax.models.llama import init_params
    from diffspec_jax.target import TargetModel

    cfg = tiny_config("llama", num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                      rope=RopeConfig(theta=1e6))
    params = init_params(cfg, seed=4)
    rng = np.random.default_rng(6)
    static = np.r_[8:16, 24:32]  # rotate-half pairs (j, j + 16) with inv_freq <= 1e6 ** (-8 / 16) = 1e-3
    proj = rng.standard_normal((cfg.hidden_size, len(static))) / np.sqrt(cfg.hidden_size) * 3.0
    wq = np.zeros((cfg.hidden_size, 2, 32), np.float32)
    wq[:, :, static] = proj[:, None, :]
    layer0 = dict(params["layers"][0], wq=jnp.asarray(wq), wk=jnp.asarray(wq[:, :1]),
                  attn_norm=jnp.ones(cfg.hidden_size))
    params = dict(params, layers=[layer0] + params["layers"][1:])
    target = TargetModel(cfg, params)
    draft = load_draft(make_tiny_draft(tmp_path_factory.mktemp("needle"), cfg, seed=9), target)
    return target, draft


def needle_prompt(chunk_id, length=200, chunk=8, seed=0):
    rng = np.random.default_rng(seed)
    p = [int(t) for t in rng.integers(10, 256, length)]
    p[chunk_id * chunk: chunk_id * chunk + 4] = [NEEDLE] * 4
    p[-1] = NEEDLE
    return p


def test_selection_follows_the_targets_attention(needle_pair):
    target, draft = needle_pair
    spec = SpecConfig.from_flat(dict(draft_context_policy="diffspec", diffspec_chunk_size=8, diffspec_token_budget=24,
                                     num_speculative_tokens=3, diffspec_scoring_layer=0))  # Hb 16: the newest chunk + 1 anchor
    res = generate(target, draft, [needle_prompt(5), needle_prompt(12)], max_new_tokens=2, spec=spec,
                   stop_token_ids=())
    per = res.stats.retrieval["per_sequence"]
    assert per[0]["anchor_chunks"] == [5] and per[1]["anchor_chunks"] == [12]
    # the scoring layer key has an effect: the last layer (random attention) ranks chunks differently
    other = generate(target, draft, [needle_prompt(5), needle_prompt(12)], max_new_tokens=2,
                     spec=spec.replace(context=dataclasses.replace(spec.context, scoring_layer=None)), stop_token_ids=())
    assert [s["anchor_chunks"] for s in other.stats.retrieval["per_sequence"]] != [[5], [12]]
    # so does the scorer: salience ranks chunks by the (random) draft's query against chunk key means
    sal = generate(target, draft, [needle_prompt(5), needle_prompt(12)], max_new_tokens=2,
                   spec=spec.replace(context=dataclasses.replace(spec.context, scorer="salience")), stop_token_ids=())
    assert [s["anchor_chunks"] for s in sal.stats.retrieval["per_sequence"]] != [[5], [12]]


def test_chunk_size_changes_the_selection_granularity(needle_pair):
    target, draft = needle_pair
    spec = SpecConfig.from_flat(dict(draft_context_policy="diffspec", diffspec_chunk_size=16, diffspec_token_budget=48,
                                     num_speculative_tokens=3, diffspec_scoring_layer=0))
    res = generate(target, draft, [needle_prompt(5)], max_new_tokens=2, spec=spec, stop_token_ids=())
    assert res.stats.retrieval["per_sequence"][0]["anchor_chunks"] == [2]  # positions 40-43 lie in 16-chunk 2


def test_no_recompilation_across_retrievals_and_cycles(targets, drafts, prompts):
    spec = SpecConfig.from_flat(dict(draft_context_policy="diffspec", diffspec_retrieval_interval=2, **SMALL))
    kw = dict(spec=spec, stop_token_ids=(), max_cache_len=256)
    generate(targets["llama"], drafts["llama"], prompts, max_new_tokens=8, **kw)
    with CompileCounter() as counter:
        res = generate(targets["llama"], drafts["llama"], prompts, max_new_tokens=NEW, **kw)
    assert res.stats.retrieval["aggregate"]["retrievals"] > 3 * len(LENGTHS)
    assert counter.count == 0
