"""The speculative engine: lossless greedy output, the multi-token accept path, no recompilation, bad input."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_prompts, recording_proposer
from diffspec_jax import SamplingConfig, SpecConfig, generate
from diffspec_jax.errors import ConfigError, InputError, OutOfMemoryError
from diffspec_jax.utils import CompileCounter

LENGTHS = (23, 61, 40)
NEW = 64


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(5, LENGTHS)


@pytest.fixture(scope="module")
def baselines(targets, prompts):
    return {arch: generate(targets[arch], None, prompts, max_new_tokens=NEW, stop_token_ids=()).tokens
            for arch in ("llama", "qwen3")}


@pytest.mark.parametrize("arch, k", [("llama", 1), ("llama", 3), ("llama", 5), ("qwen3", 3)])
def test_greedy_speculative_output_equals_target_only(arch, k, targets, drafts, prompts, baselines):
    """llama: draft vocab 128 < 256; qwen3: equal vocabularies."""
    res = generate(targets[arch], drafts[arch], prompts, max_new_tokens=NEW,
                   spec=SpecConfig(num_speculative_tokens=k), stop_token_ids=())
    assert res.tokens == baselines[arch]
    assert all(len(t) == NEW for t in res.tokens)
    s = res.stats
    assert s.num_speculative_tokens == k and len(s.acceptance_per_position) == k
    assert s.drafted_tokens == k * s.sequence_cycles
    assert s.new_tokens == NEW * len(LENGTHS)


@pytest.mark.parametrize("behind, policy, page_size", [(None, "recent", None), ("eagle", "full", None),
                                                      ("self", "recent", 16)])
def test_greedy_prompt_lookup_output_equals_target_only(behind, policy, page_size, targets, drafts, prompts, baselines):
    """Prompt lookup alone (``draft="ngram"``, the policy ignored) and in front of an EAGLE-3 draft or self-drafting
    (``NGram(first=True)``: rows without a 2-gram match take the draft's tokens), dense and paged: the target's
    tokens, and it drafts."""
    draft = {None: "ngram", "eagle": drafts["llama"], "self": "self"}[behind]
    spec = SpecConfig.from_flat(dict(num_speculative_tokens=3, ngram_min_n=2 if behind else 1, ngram_first=bool(behind),
                                     draft_context_policy=policy, diffspec_chunk_size=8, diffspec_token_budget=40))
    res = generate(targets["llama"], draft, prompts, max_new_tokens=NEW, spec=spec, stop_token_ids=(),
                   page_size=page_size)
    assert res.tokens == baselines["llama"]
    s = res.stats
    assert s.drafted_tokens == 3 * s.sequence_cycles and s.draft_context_policy == (policy if behind else None)
    assert s.mean_acceptance_length > 1.2  # the random tiny target repeats itself: prompt lookup finds it


def oracle(reference, accept_upto, plan, dparams, state, active, key):
    """Proposes the target's own greedy continuation: the first accept_upto[seq] drafts right, the rest wrong."""
    k = plan.spec.num_speculative_tokens
    ref = jnp.asarray(reference)
    pos = state.length[:, None] + 1 + jnp.arange(k)[None, :]
    right = jnp.take_along_axis(ref[state.seq_id], pos, axis=1)
    wrong = (right + 1) % plan.target.vocab_size
    ok = jnp.arange(k)[None, :] < jnp.asarray(accept_upto)[state.seq_id][:, None]
    zero = jnp.zeros_like(state.length)
    return jnp.where(ok, right, wrong), None, state.draft_cache, state.retrieval, zero, zero


@pytest.mark.parametrize("accept_upto", [(4, 4, 4), (4, 1, 2)])
def test_multi_token_accept_path(accept_upto, targets, prompts, baselines):
    """A draft proposing the target's greedy tokens gets all K accepted (acceptance length K + 1); one that is
    right for only j positions gets exactly j per cycle, per sequence, and the output still equals the baseline."""
    k = 4
    long = generate(targets["llama"], None, prompts, max_new_tokens=NEW + k + 2, stop_token_ids=()).tokens
    width = max(LENGTHS) + NEW + k + 4
    reference = np.zeros((len(prompts), width), np.int32)
    for b, (p, t) in enumerate(zip(prompts, long)):
        reference[b, : len(p) + len(t)] = p + t
    proposer = functools.partial(oracle, reference, accept_upto)
    res = generate(targets["llama"], None, prompts, max_new_tokens=NEW, spec=SpecConfig(num_speculative_tokens=k),
                   stop_token_ids=(), proposer=proposer)
    assert res.tokens == baselines["llama"]
    s = res.stats
    if accept_upto == (4, 4, 4):
        assert s.mean_acceptance_length == k + 1
        assert s.acceptance_per_position == [s.sequence_cycles] * k
        assert s.cycles == -(-(NEW - 1) // (k + 1))
    else:
        cycles = [-(-(NEW - 1) // (j + 1)) for j in accept_upto]  # per sequence
        assert s.sequence_cycles == sum(cycles)
        assert s.accepted_tokens == sum(j * c for j, c in zip(accept_upto, cycles))
    per_seq = [1 + j for j in accept_upto]  # every cycle of sequence i accepts accept_upto[i]
    assert s.acceptance_length_per_sequence == per_seq


def test_sampling_is_reproducible_and_respects_top_k(targets, drafts, prompts):
    sampling = SamplingConfig(temperature=0.8, top_k=5)
    spec = SpecConfig(num_speculative_tokens=3, draft_sampling="sample")
    a = generate(targets["llama"], drafts["llama"], prompts, max_new_tokens=24, spec=spec, sampling=sampling, seed=3)
    b = generate(targets["llama"], drafts["llama"], prompts, max_new_tokens=24, spec=spec, sampling=sampling, seed=3)
    c = generate(targets["llama"], drafts["llama"], prompts, max_new_tokens=24, spec=spec, sampling=sampling, seed=4)
    assert a.tokens == b.tokens and a.tokens != c.tokens
    logs = {"argmax": [], "sample": []}
    for mode, log in logs.items():  # the draft_sampling key changes what the draft proposes
        generate(targets["llama"], drafts["llama"], prompts, max_new_tokens=8, sampling=sampling, seed=3,
                 spec=SpecConfig(num_speculative_tokens=3, draft_sampling=mode),
                 proposer=functools.partial(recording_proposer, log))
    assert any(not np.array_equal(x, y) for x, y in zip(logs["argmax"], logs["sample"]))


def test_stop_tokens_and_exact_max_new_tokens(targets, drafts, prompts, baselines):
    base = baselines["llama"]
    stop = base[1][10]  # the 11th token of prompt 1's continuation
    res = generate(targets["llama"], drafts["llama"], prompts, max_new_tokens=NEW, stop_token_ids=[stop])
    for b, toks in enumerate(res.tokens):
        cut = base[b].index(stop) + 1 if stop in base[b] else NEW
        assert toks == base[b][:cut]
    short = generate(targets["llama"], drafts["llama"], prompts, max_new_tokens=7, stop_token_ids=())
    assert [len(t) for t in short.tokens] == [7, 7, 7] and short.tokens == [t[:7] for t in base]
    one = generate(targets["llama"], drafts["llama"], prompts, max_new_tokens=1, stop_token_ids=())
    assert one.tokens == [t[:1] for t in base] and one.stats.cycles == 0


def test_cycles_do_not_recompile(targets, drafts, prompts):
    kw = dict(spec=SpecConfig(num_speculative_tokens=3), stop_token_ids=(), max_cache_len=256)
    generate(targets["llama"], drafts["llama"], prompts, max_new_tokens=8, **kw)  # compiles everything once
    with CompileCounter() as counter:
        res = generate(targets["llama"], drafts["llama"], prompts, max_new_tokens=60, **kw)
    assert res.stats.cycles > 20
    assert counter.count == 0


def test_memory_is_checked_up_front(targets, prompts, baselines, monkeypatch):
    """A batch the device cannot hold is refused before anything is compiled or allocated, with what it needs and
    what the device has (the device's statistics are faked: CPUs report none); one that fits runs unchanged and
    reports the memory model's figures and the device's peak."""
    from diffspec_jax.engine import memory

    model, kw = targets["llama"], dict(max_new_tokens=NEW, stop_token_ids=())
    full = {"bytes_limit": 1 << 20, "bytes_in_use": (1 << 20) - 1000, "peak_bytes_in_use": 1 << 20}
    monkeypatch.setattr(memory, "device_memory", lambda device=None: full)
    with CompileCounter() as counter, pytest.raises(OutOfMemoryError, match=r"needs .* \(target K/V .*1000 bytes "
                                                                            r"free\. Pass fewer prompts \(batch 3\)"):
        generate(model, None, prompts, **kw)
    assert counter.count == 0
    roomy = {"bytes_limit": 1 << 40, "bytes_in_use": 1 << 20, "peak_bytes_in_use": 12345}
    monkeypatch.setattr(memory, "device_memory", lambda device=None: roomy)
    res = generate(model, None, prompts, **kw)
    assert res.tokens == baselines["llama"]
    m, c = res.stats.memory, model.config
    assert m["kv_bytes"] == c.num_hidden_layers * 2 * 3 * c.num_key_value_heads * res.stats.cache_capacity * \
        c.head_dim * 4
    assert (m["bytes_limit"], m["free_bytes"], m["draft_bytes"]) == (1 << 40, (1 << 40) - (1 << 20), 0)
    assert m["prefill_width"] == 64 and m["prefill_chunks"] == 1  # the longest prompt (61) in one chunk
    assert res.stats.peak_bytes_in_use == 12345


@pytest.mark.parametrize("call, error, needle", [
    (dict(max_cache_len=64), InputError, "exceed the cache capacity max_cache_len=64"),
    (dict(max_new_tokens=2000), InputError, "exceeds the target's context window"),
    (dict(prompts=[[1, 2], []]), InputError, "prompt 1 is empty"),
    (dict(prompts=[[1, 2, 999]]), InputError, r"must lie in \[0, 256\)"),
    (dict(prompts=[]), InputError, "non-empty list"),
    (dict(prompts=["hello"]), InputError, "prompt 0 is text"),
    (dict(max_new_tokens=0), InputError, "max_new_tokens must be an integer >= 1"),
])
def test_bad_requests(targets, drafts, prompts, call, error, needle):
    kw = dict(prompts=prompts, max_new_tokens=16) | call
    with pytest.raises(error, match=needle):
        generate(targets["llama"], drafts["llama"], kw.pop("prompts"), **kw)


def test_bad_settings():
    with pytest.raises(ConfigError, match="num_speculative_tokens must be a positive integer, got 0"):
        SpecConfig(num_speculative_tokens=0)
    with pytest.raises(ConfigError, match="temperature must be a finite number >= 0"):
        SamplingConfig(temperature=-0.5)
    with pytest.raises(ConfigError, match=r"top_p must be (in \(0, 1\]|a finite number > 0)"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ConfigError, match="draft_context_policy must be one of"):
        SpecConfig.from_flat(dict(draft_context_policy="window"))
