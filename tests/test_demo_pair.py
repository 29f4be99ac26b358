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


#: the demo prompt's windows decoded by the lossless tests, the tokens each decodes, and the chain configuration
WINDOWS, NEW_TOKENS = ((0, 900), (5000, 5600)), 48
CHAIN = SpecConfig.from_flat(dict(draft_context_policy="diffspec", diffspec_token_budget=512))


@pytest.fixture(scope="module")
def decoded(tokenizer):
    """``decoded(dtype)``: the pair loaded in ``dtype``, its prompts, and their target-only and chain DiffSpec
    results (each computed once: the float32 ones serve the chain and the tree test)."""
    done = {}

    def get(dtype):
        if dtype not in done:
            target = load_target(demo.target_dir(), dtype=dtype)
            draft = load_draft(demo.draft_dir(), target)
            ids = tokenizer(demo.prompt_text())["input_ids"]
            prompts = [ids[a:b] for a, b in WINDOWS]
            base = generate(target, None, prompts, max_new_tokens=NEW_TOKENS, stop_token_ids=())
            chain = generate(target, draft, prompts, max_new_tokens=NEW_TOKENS, spec=CHAIN, stop_token_ids=())
            done[dtype] = target, draft, prompts, base, chain
        return done[dtype]

    return get


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_speculative_equals_target_only_on_the_pair(dtype, decoded):
    """Prompts longer than the 512-token working cache: retrieval runs, and the output is target-only's."""
    _, _, _, base, res = decoded(dtype)
    assert res.tokens == base.tokens
    assert res.stats.mean_acceptance_length > 1.3
    assert res.stats.retrieval["aggregate"]["retrievals"] >= 2


def test_tree_mode_on_the_pair_is_lossless_and_accepts_deeper(decoded):
    """Trees on a trained pair: deep accepted paths (so the KV moves of non-consecutive rows are exercised), output
    identical to target-only, and at least the chain's acceptance length on the same prompts."""
    target, draft, prompts, base, chain = decoded("float32")
    tree = generate(target, draft, prompts, max_new_tokens=NEW_TOKENS, stop_token_ids=(),
                    spec=SpecConfig.from_flat(dict(draft_context_policy="diffspec", diffspec_token_budget=512,
                                                   diffspec_verification_mode="tree", diffspec_max_tree_nodes=16,
                                                   diffspec_tree_topk=4)))
    assert tree.tokens == base.tokens
    hist = tree.stats.accepted_depth_histogram
    assert sum(hist[2:]) > 0 and tree.stats.mean_acceptance_length >= chain.stats.mean_acceptance_length


@pytest.fixture(scope="module")
def held_out(tokenizer):
    from diffspec_jax.corpus import build_corpus, encode_documents

    docs = encode_documents(tokenizer, [d for d in build_corpus().held_out if d.name != "argparse"])
    return docs, {d.name: d.ids.tolist() for d in docs}


def test_held_out_window_prompts(tokenizer, held_out):
    from diffspec_jax.corpus import held_out_prompts

    docs, ids = held_out
    prompts = held_out_prompts(docs, 4096, 5, seed=3, new_tokens=100)
    assert len({p.doc for p in prompts}) >= 3  # spread over the documents long enough
    for p in prompts:
        assert len(p.ids) == 4096 and p.ids == ids[p.doc][p.start:p.start + 4096]
        assert p.start + 4096 + 100 <= len(ids[p.doc]) and p.source is None
        assert p.reference == ids[p.doc][p.start + 4096:p.start + 4196]
    again = held_out_prompts(docs, 4096, 5, seed=3, new_tokens=100)
    assert [p.ids for p in again] == [p.ids for p in prompts]
    assert [p.start for p in held_out_prompts(docs, 4096, 5, seed=4)] != [p.start for p in prompts]


def test_held_out_recall_prompts_reemit_a_file_from_far_back(tokenizer, held_out):
    from diffspec_jax.corpus import copied_fraction, held_out_prompts

    docs, ids = held_out
    ctx, reemit = 4096, 48
    prompts = held_out_prompts(docs, ctx, 4, seed=5, workload="recall", new_tokens=32, reemit=reemit)
    for p in prompts:
        doc = ids[p.doc]
        off = p.source - p.start
        assert len(p.ids) == ctx and p.distance == ctx - off and p.distance >= 3 * ctx // 4
        assert p.ids[:ctx - reemit] == doc[p.start:p.start + ctx - reemit]
        assert p.ids[-reemit:] == doc[p.source:p.source + reemit] == p.ids[off:off + reemit]
        assert tokenizer.decode(p.ids[-reemit:]).lstrip("\n").startswith("# file: ")
        assert p.reference == doc[p.source + reemit:p.source + reemit + 32]
    refs = [p.reference for p in prompts]
    assert copied_fraction(refs, prompts) == 1.0
    wrong_first = [[(r[0] + 1) % 4096] + r[1:] for r in refs]
    assert copied_fraction(wrong_first, prompts) == 0.0
    half = [r[:16] + [(r[16] + 1) % 4096] + r[17:] for r in refs]
    assert copied_fraction(half, prompts) == 0.5


def test_held_out_prompts_errors(tokenizer, held_out):
    from diffspec_jax.corpus import held_out_prompts
    from diffspec_jax.errors import ConfigError

    docs, _ = held_out
    with pytest.raises(ConfigError, match="unknown workload"):
        held_out_prompts(docs, 1024, 1, 0, workload="summaries")
    with pytest.raises(ConfigError, match="long enough"):
        held_out_prompts(docs, 10_000_000, 1, 0)
    with pytest.raises(ConfigError, match="reemit"):
        held_out_prompts(docs, 1024, 1, 0, workload="recall", reemit=512)


def test_model_card_lists_workloads():
    from diffspec_jax.demo.build import model_card_markdown

    card = json.loads((demo.PAIR / "model_card.json").read_text())
    card["acceptance"] = [
        {"workload": "recall", "context": 16384, "policy": "target-only", "decode_tokens_per_s": 1000.0,
         "copied_fraction": 0.25},
        {"workload": "recall", "context": 16384, "policy": "diffspec", "mean_acceptance_length": 2.5,
         "decode_tokens_per_s": 1500.0, "speedup_vs_target": 1.5}]
    card["data"]["extra_packages"] = {"numpy": "2.0.1"}
    text = model_card_markdown(card)
    assert "the sources of numpy 2.0.1 (one document per directory)" in text
    assert "| recall | 16384 | target-only (copies 25%) | - | 1000 | 1.00 |" in text
    assert "| recall | 16384 | diffspec | 2.50 | 1500 | 1.50 |" in text


def test_model_card_describes_curriculum_recall_spans_dedup_and_continued_training():
    from diffspec_jax.demo.build import model_card_markdown

    card = json.loads((demo.PAIR / "model_card.json").read_text())
    card["target"].update(recall_fraction=0.0, curriculum=[], init_target=None, steps=600, batch=4, seq_len=16384)
    md = model_card_markdown(card)
    assert "Recall spans" not in md and "continued from" not in md and "Near-duplicate" not in md
    assert "KV heads, trained 600 steps x 4 sequences of 16384 tokens (AdamW" in md
    card["target"].update(recall_fraction=1.0, recall_span=[64, 1024], recall_noise=0.0,
                          curriculum=[{"seq_len": 512, "batch": 32, "steps": 10000}])
    md = model_card_markdown(card)
    assert "trained 10000 steps x 32 sequences of 512 tokens, then 600 steps x 4 sequences of 16384 tokens" in md
    assert ("Recall spans: 100% of the training windows copy a passage of 64-1024 tokens (0% of its tokens "
            "replaced first)") in md
    assert "of the window after it" not in md
    card["target"]["recall_distance"] = 0.5
    assert "to a later place in the same window, at least 50% of the window after it." in model_card_markdown(card)
    card["target"]["recall_mismatch"] = 0.05
    assert ("at least 50% of the window after it; 5% of each copy's tokens are replaced after copying (the copy "
            "resumes after each).") in model_card_markdown(card)
    card["target"]["recall_spans"] = 4
    assert "Recall spans: 100% of the training windows copy 4 passages of 64-1024 tokens" in model_card_markdown(card)
    card["data"]["dedup"] = {"threshold": 0.3, "min_chars": 16, "dropped_files": 2967, "dropped_chars": 41744482}
    assert ("Near-duplicate files left out of training: 2967 files (41744482 characters) of which more than 30% of "
            "the lines of 16+ characters occurred in earlier training files.") in model_card_markdown(card)
    card["target"]["init_target"] = {"path": "b5/target", "sha256": {},
                                     "trained_by": {"command": "python -m diffspec_jax.demo.build --out b5 --x",
                                                    "steps": 15300, "init_target": None}}
    md = model_card_markdown(card)
    assert "KV heads, continued from `b5/target` (15300 earlier steps), trained 10000 steps" in md
    rebuild = md[md.index("## Rebuild"):].splitlines()
    assert rebuild[3] == "python -m diffspec_jax.demo.build --out b5 --x"
    assert rebuild[4] == card["commands"]["build"]
    card["target"].update(steps=0, curriculum=[], final=None)  # --target-steps 0: a new draft for b5's target
    assert ("KV heads, kept as it is from `b5/target` (15300 earlier steps); this build did not train it. Stored in "
            "bfloat16.") in model_card_markdown(card)
