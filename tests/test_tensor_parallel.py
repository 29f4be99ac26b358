"""Tensor (and data) parallelism on the 4-device CPU mesh (XLA_FLAGS set in conftest before JAX is imported)."""

import jax
import numpy as np
import pytest

from conftest import random_prompts, rel_err
from diffspec_jax import SpecConfig, forward, generate, make_mesh
from diffspec_jax.errors import ConfigError


def test_four_virtual_devices():
    assert len(jax.devices()) >= 4


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("tp", [2, 4])  # 2 KV heads: TP2 splits them, TP4 repeats each on two shards
def test_tp_logits_equal_tp1(arch, tp, targets):
    ids = np.random.default_rng(0).integers(0, 256, (2, 48))
    ref = forward(targets[arch], ids)
    ours = forward(targets[arch], ids, mesh=make_mesh(tp))
    assert rel_err(ours, ref) <= 1e-5


def test_vocabulary_not_divisible_by_tp_is_padded(tmp_path):
    from checkpoints_tools.make_tiny import make_tiny
    from diffspec_jax import load_target

    model = load_target(make_tiny(tmp_path / "v250", "qwen3", vocab_size=250, seed=1), dtype="float32")
    ids = np.random.default_rng(1).integers(0, 250, (1, 30))
    ours = forward(model, ids, mesh=make_mesh(4))
    assert ours.shape == (1, 30, 250)
    assert rel_err(ours, forward(model, ids)) <= 1e-5


PROMPTS = random_prompts(11, (90, 57, 133))
SPEC = dict(num_speculative_tokens=3, diffspec_chunk_size=8, diffspec_token_budget=40)


@pytest.fixture(scope="module")
def tp1(targets, drafts):
    out = {}
    for policy in ("full", "diffspec"):
        spec = SpecConfig.from_flat(dict(draft_context_policy=policy, **SPEC))
        out[policy] = generate(targets["llama"], drafts["llama"], PROMPTS, max_new_tokens=32, spec=spec,
                               stop_token_ids=())
    return out


@pytest.mark.parametrize("policy", ["full", "diffspec"])
@pytest.mark.parametrize("draft_tp", [None, 1])  # draft sharded like the target, or replicated
def test_tp4_speculative_generation_is_token_identical_to_tp1(policy, draft_tp, targets, drafts, tp1):
    """(DiffSpec with the sharded draft runs on the paged cache: the pools sharded by KV heads, page tables
    replicated.)"""
    spec = SpecConfig.from_flat(dict(draft_context_policy=policy, draft_tensor_parallel_size=draft_tp, **SPEC))
    paged = policy == "diffspec" and draft_tp is None
    res = generate(targets["llama"], drafts["llama"], PROMPTS, max_new_tokens=32, spec=spec, stop_token_ids=(),
                   mesh=make_mesh(4), page_size=16 if paged else None)
    assert res.tokens == tp1[policy].tokens
    if policy == "diffspec":
        agg = res.stats.retrieval["aggregate"]
        assert agg["ranks_agree"] and agg["retrievals"] >= len(PROMPTS)  # every rank selected the same chunks
        ours = [(s["anchor_chunks"], s["selection_digest"]) for s in res.stats.retrieval["per_sequence"]]
        ref = [(s["anchor_chunks"], s["selection_digest"]) for s in tp1[policy].stats.retrieval["per_sequence"]]
        assert ours == ref


def test_tree_mode_at_tp4_is_token_identical_to_tp1(targets, drafts):
    """Tree drafting + tree verification under shard_map (sharded draft, DiffSpec retrieval) equals TP1."""
    spec = SpecConfig.from_flat(dict(draft_context_policy="diffspec", diffspec_verification_mode="tree", diffspec_max_tree_nodes=8,
                                     diffspec_tree_topk=3, **SPEC))
    ref = generate(targets["llama"], drafts["llama"], PROMPTS, max_new_tokens=20, spec=spec, stop_token_ids=())
    tp4 = generate(targets["llama"], drafts["llama"], PROMPTS, max_new_tokens=20, spec=spec, stop_token_ids=(),
                   mesh=make_mesh(4))
    assert tp4.tokens == ref.tokens
    assert tp4.stats.accepted_depth_histogram == ref.stats.accepted_depth_histogram
    assert tp4.stats.retrieval["aggregate"]["ranks_agree"]


def test_qwen3_with_equal_vocab_draft_at_tp2_and_data_parallel_replicas(targets, drafts):
    spec = SpecConfig.from_flat(dict(draft_context_policy="diffspec", **SPEC))
    ref = generate(targets["qwen3"], drafts["qwen3"], PROMPTS, max_new_tokens=24, spec=spec, stop_token_ids=())
    tp2 = generate(targets["qwen3"], drafts["qwen3"], PROMPTS, max_new_tokens=24, spec=spec, stop_token_ids=(),
                   mesh=make_mesh(2))
    dp2 = generate(targets["qwen3"], drafts["qwen3"], PROMPTS, max_new_tokens=24, spec=spec, stop_token_ids=(),
                   mesh=make_mesh(tp=2, dp=2))  # 3 prompts padded to 4 rows over dp=2
    assert tp2.tokens == ref.tokens and dp2.tokens == ref.tokens
    assert dp2.stats.num_sequences == 3 and dp2.stats.new_tokens == 3 * 24


def test_heads_not_dividing_tp_is_a_clear_error(tmp_path, drafts):
    from checkpoints_tools.make_tiny import make_tiny
    from diffspec_jax import load_target

    model = load_target(make_tiny(tmp_path / "h6", "llama", num_attention_heads=6, num_key_value_heads=2,
                                  hidden_size=96, head_dim=16, seed=2), dtype="float32")
    with pytest.raises(ConfigError, match=r"num_attention_heads \(6\) is not divisible by tp=4"):
        forward(model, [[1, 2, 3]], mesh=make_mesh(4))
    with pytest.raises(ConfigError, match="needs 8 devices"):
        make_mesh(tp=8)
    with pytest.raises(ConfigError, match="draft_tensor_parallel_size must be 1 .* or the target's tp=4, got 2"):
        generate(load_target(make_tiny(tmp_path / "ok", "llama", seed=2), dtype="float32"), drafts["llama"],
                 [[1, 2, 3]], max_new_tokens=2, spec=SpecConfig(draft_tensor_parallel_size=2), mesh=make_mesh(4))
