"""The shipped demo pair: size, model card, loading in transformers and in our engine, lossless decoding."""

import json

import numpy as np
import pytest

from conftest import hf_logits, rel_err
from diffspec_jax import SpecConfig, demo, forward, generate, load_draft, load_target


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo.target_dir())


def test_pair_size_and_model_card():
    files = [p for p in demo.PAIR.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 20 * 1024 * 1024
    card = json.loads((demo.PAIR / "model_card.json").read_text())
    assert card["data"]["train_sha256"] and card["data"]["python"]
    assert 5e6 <= card["target"]["parameters"] <= 10e6 and card["target"]["seq_len"] >= 8192
    assert card["draft"]["seq_len"] <= 2048 and card["draft"]["ttt_steps"] >= 3
    table = {(r["context"], r["policy"]) for r in card["acceptance"]}
    assert {(c, p) for c in (2048, 8192, 16384) for p in ("full", "recent", "diffspec")} <= table
    assert "python -m diffspec_jax.demo.build" in card["commands"]["build"]
    assert "| 16384 | diffspec |" in (demo.PAIR / "MODEL_CARD.md").read_text()


def test_demo_prompt_is_long(tokenizer):
    assert len(tokenizer(demo.prompt_text())["input_ids"]) >= 8192


def test_target_runs_in_transformers_and_matches_our_forward(tokenizer):
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(demo.target_dir(), dtype=torch.float32)
    ids = np.asarray([tokenizer(demo.prompt_text()[:2000])["input_ids"][:200]])
    ours = forward(load_target(demo.target_dir(), dtype="float32"), ids)
    assert rel_err(ours, hf_logits(hf, ids)) <= 1e-4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_speculative_equals_target_only_on_the_pair(dtype, tokenizer):
    target = load_target(demo.target_dir(), dtype=dtype)
    draft = load_draft(demo.draft_dir(), target)
    ids = tokenizer(demo.prompt_text())["input_ids"]
    prompts = [ids[:1200], ids[3000:3700]]
    base = generate(target, None, prompts, max_new_tokens=40, stop_token_ids=())
    spec = SpecConfig(draft_context_policy="diffspec", diffspec_token_budget=512)
    res = generate(target, draft, prompts, max_new_tokens=40, spec=spec, stop_token_ids=())
    assert res.tokens == base.tokens
    assert res.stats.mean_acceptance_length > 1.3
    assert res.stats.retrieval["aggregate"]["retrievals"] >= 2


def test_tree_mode_on_the_pair_is_lossless_and_accepts_deeper(tokenizer):
    """Trees on a trained pair: deep accepted paths (so the KV moves of non-consecutive rows are exercised), output
    identical to target-only, and at least the chain's acceptance length on the same prompt."""
    target = load_target(demo.target_dir(), dtype="float32")
    draft = load_draft(demo.draft_dir(), target)
    ids = tokenizer(demo.prompt_text())["input_ids"]
    prompts = [ids[:900], ids[5000:5600]]
    base = generate(target, None, prompts, max_new_tokens=48, stop_token_ids=())
    chain = generate(target, draft, prompts, max_new_tokens=48, stop_token_ids=(),
                     spec=SpecConfig(draft_context_policy="diffspec", diffspec_token_budget=512))
    tree = generate(target, draft, prompts, max_new_tokens=48, stop_token_ids=(),
                    spec=SpecConfig(draft_context_policy="diffspec", diffspec_token_budget=512,
                                    diffspec_verification_mode="tree", diffspec_max_tree_nodes=16,
                                    diffspec_tree_topk=4))
    assert tree.tokens == base.tokens
    hist = tree.stats.accepted_depth_histogram
    assert sum(hist[2:]) > 0 and tree.stats.mean_acceptance_length >= chain.stats.mean_acceptance_length
