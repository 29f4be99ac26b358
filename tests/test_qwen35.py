"""Qwen3.5 hybrid MoE targets (Gated DeltaNet + gated attention + MoE): parity with transformers on tiny random
checkpoints in both key layouts (causal LM / multimodal wrapper) and both expert layouts (fused / per expert),
state rollback after partial acceptance, lossless greedy speculative decoding at TP1 and TP4."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import check_cached_steps, random_prompts, rel_err, rewrite_safetensors
from diffspec_jax import DiffSpec, ModelConfig, SpecConfig, forward, generate, load_draft, load_target, make_mesh
from diffspec_jax import target as tgt
from diffspec_jax.errors import ConfigError, UnsupportedModelError

TOL = 1e-4
KINDS = {"causal": "Qwen3_5MoeForCausalLM", "wrapper": "Qwen3_5MoeForConditionalGeneration"}
LENGTHS = (37, 150, 96)  # ragged prompts
SEQ = np.random.default_rng(77).integers(0, 256, size=(len(LENGTHS), 176))
CAPACITY = 200


@pytest.fixture(scope="module")
def q35_dirs(tmp_path_factory):
    """{(kind, layout): dir}: transformers-built tiny checkpoints; the two layouts of a kind hold the same weights.
    The wrapper checkpoints also carry a depth-1 vision tower and (injected) MTP tensors, both to be ignored."""
    from checkpoints_tools.make_tiny import make_tiny

    root = tmp_path_factory.mktemp("qwen35")
    dirs = {}
    for seed, (kind, arch) in enumerate(KINDS.items(), 31):
        for layout in ("per_expert", "fused"):
            d = make_tiny(root / f"{kind}_{layout}", "qwen3_5_moe", backend="transformers", seed=seed,
                          expert_layout=layout, architecture=arch)
            if kind == "wrapper":
                rewrite_safetensors(d, lambda t: t.update({
                    "mtp.fc.weight": np.ones((64, 128), np.float32),
                    "mtp.layers.0.mlp.experts.0.gate_proj.weight": np.ones((32, 64), np.float32)}))
            dirs[kind, layout] = d
    return dirs


@pytest.fixture(scope="module")
def q35_targets(q35_dirs):
    return {key: load_target(d, dtype="float32") for key, d in q35_dirs.items()}


@pytest.fixture(scope="module")
def q35_reference(q35_dirs):
    """transformers' logits of SEQ, computed from the per-expert checkpoints (save_pretrained's own layout)."""
    import torch
    import transformers

    torch.set_num_threads(2)
    out = {}
    for kind, arch in KINDS.items():
        model = getattr(transformers, arch).from_pretrained(q35_dirs[kind, "per_expert"], dtype=torch.float32,
                                                            attn_implementation="eager").eval()
        with torch.no_grad():
            out[kind] = model(torch.as_tensor(SEQ)).logits.float().numpy()
    return out


def test_config_of_both_key_layouts(q35_dirs, q35_targets):
    raw = json.loads((q35_dirs["wrapper", "fused"] / "config.json").read_text())
    assert "text_config" in raw and "hidden_size" not in raw  # the multimodal wrapper dialect
    for kind, arch in KINDS.items():
        cfg = q35_targets[kind, "fused"].config
        assert cfg.architecture == arch and cfg.is_hybrid and cfg.family == "qwen3_5_moe"
        assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
        assert cfg.full_attention_layers == (3,) and cfg.last_full_attention_layer == 3
        assert cfg.rope.rotary_dim(cfg.head_dim) == 8 and cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
        assert ModelConfig.from_dict(cfg.to_hf_dict()) == cfg
        n = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(q35_targets[kind, "fused"].params))
        assert cfg.num_parameters == n
    assert q35_targets["causal", "fused"].params["layers"][0]["we_gate"].shape == (8, 64, 32)


def test_layer_types_default_and_refusals():
    base = {"architectures": ["Qwen3_5MoeForCausalLM"], "vocab_size": 100, "hidden_size": 32,
            "num_hidden_layers": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
            "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 8,
            "linear_value_head_dim": 8, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
            "num_experts": 4, "num_experts_per_tok": 2, "rope_parameters": {"rope_type": "default",
                                                                         "rope_theta": 1e7, "mrope_section": [1, 1, 0],
                                                                         "mrope_interleaved": True}}
    cfg = ModelConfig.from_dict(base)
    assert cfg.full_attention_layers == (3, 7)  # full_attention_interval 4 by default
    assert cfg.rope.partial_rotary_factor == 0.25 and cfg.rope.theta == 1e7  # Qwen3.5's partial RoPE default
    assert DiffSpec().layer_for(cfg) == 7
    with pytest.raises(ConfigError, match="diffspec_scoring_layer 5 is a linear_attention layer"):
        DiffSpec(scoring_layer=5).layer_for(cfg)
    with pytest.raises(UnsupportedModelError, match="attn_output_gate=false"):
        ModelConfig.from_dict({**base, "attn_output_gate": False})
    with pytest.raises(UnsupportedModelError, match=r"layer types \['sliding_attention'\]"):
        ModelConfig.from_dict({**base, "layer_types": ["sliding_attention"] * 8})
    with pytest.raises(UnsupportedModelError, match="not supported"):  # dense families keep refusing DeltaNet
        ModelConfig.from_dict({**base, "architectures": ["Qwen3ForCausalLM"], "intermediate_size": 64,
                               "layer_types": ["linear_attention"] * 8})


def test_tree_verification_hook_and_cache_kinds(q35_targets, targets):
    from diffspec_jax.cache import HybridCache, KVCache
    from diffspec_jax.models import ensure_tree_supported, family

    cfg = q35_targets["causal", "fused"].config
    assert family(cfg).supports_tree is False and family(targets["llama"].config).supports_tree
    with pytest.raises(UnsupportedModelError, match="tree verification is not supported for Qwen3_5MoeForCausalLM"):
        ensure_tree_supported(cfg)
    ensure_tree_supported(targets["llama"].config)
    with pytest.raises(ValueError, match="hybrid model"):
        KVCache.create(cfg, 1, 16)
    cache = tgt.create_cache(q35_targets["causal", "fused"], 2, 16)
    assert isinstance(cache, HybridCache) and len(cache.k) == 1 and len(cache.ssm) == 3
    assert cache.layer_keys(3) is cache.k[0] and cache.ssm[0].dtype == jnp.float32


@pytest.mark.parametrize("kind", list(KINDS))
def test_both_expert_layouts_load_the_same_params(kind, q35_dirs, q35_targets):
    """Fused (official) and per-expert (save_pretrained) files give identical params; transformers reads the fused
    file to the same logits, so our reading of the fused layout (gate rows first, [E, H, I] down) is its own."""
    import torch
    import transformers

    a, b = q35_targets[kind, "fused"].params, q35_targets[kind, "per_expert"].params
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))
    from safetensors import safe_open

    with safe_open(str(q35_dirs[kind, "fused"] / "model.safetensors"), "np") as f:
        keys = set(f.keys())
    prefix = "model.language_model." if kind == "wrapper" else "model."
    assert f"{prefix}layers.0.mlp.experts.gate_up_proj" in keys and not any(".experts.0." in k for k in keys
                                                                              if k.startswith(prefix))
    if kind == "causal":
        model = transformers.AutoModelForCausalLM.from_pretrained(q35_dirs[kind, "fused"], dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
        ref = transformers.AutoModelForCausalLM.from_pretrained(q35_dirs[kind, "per_expert"], dtype=torch.float32,
                                                                attn_implementation="eager").eval()
        ids = torch.as_tensor(SEQ[:1, :40])
        with torch.no_grad():
            assert torch.equal(model(ids).logits, ref(ids).logits)


@pytest.mark.parametrize("kind, layout", [("causal", "fused"), ("wrapper", "per_expert")])
def test_forward_matches_transformers(kind, layout, q35_targets, q35_reference):
    """T = 176 > 64: chunked DeltaNet form and tiled attention."""
    ours = np.asarray(forward(q35_targets[kind, layout], SEQ))
    assert ours.shape == q35_reference[kind].shape
    assert rel_err(ours, q35_reference[kind]) <= TOL


def _prefill(model, seqs, lengths, chunk):
    cache = tgt.create_cache(model, len(lengths), CAPACITY, jnp.float32)
    return tgt.prefill(model, cache, [list(s[:n]) for s, n in zip(seqs, lengths)], chunk=chunk)


@pytest.mark.parametrize("kind, layout", [("causal", "per_expert"), ("wrapper", "fused")])
def test_chunked_prefill_then_cached_steps_match_transformers(kind, layout, q35_targets, q35_reference):
    """Ragged prompts in 128-token chunks (chunked DeltaNet form, padding kept out of the states), then T = 1 and
    T = 5 steps (token-by-token recurrence from the cached conv + recurrent states)."""
    model, ref = q35_targets[kind, layout], q35_reference[kind]
    logits, cache = _prefill(model, SEQ, LENGTHS, 128)
    for b, n in enumerate(LENGTHS):
        assert rel_err(logits[b], ref[b, n - 1]) <= TOL
    check_cached_steps(model, cache, SEQ, LENGTHS, ref, TOL)


def test_rollback_after_partial_acceptance_equals_a_fresh_run(q35_targets, q35_reference):
    """Verify 5 tokens with per-position snapshots, accept m = 0, 2, 4 of the 4 drafts: the rolled-back states
    equal those of a fresh prefill over the prompt + the m + 1 committed tokens, and so do the next logits.
    Keeping the states after all 5 tokens (KV truncation only) would not (checked, so the test can fail)."""
    model = q35_targets["causal", "fused"]
    _, cache = _prefill(model, SEQ, LENGTHS, 64)  # 64-token chunks: the recurrent prefill path
    start = np.array(LENGTHS)
    block = np.stack([SEQ[b, n:n + 5] for b, n in enumerate(LENGTHS)])
    rows = np.broadcast_to(np.arange(5, dtype=np.int32), block.shape)
    out, cache = tgt.step_fn(model.config, model.params, cache, jnp.asarray(block), jnp.asarray(start, jnp.int32),
                             jnp.asarray(rows), snapshots=True)
    for b, n in enumerate(LENGTHS):  # the verify rows are the target's logits at those positions
        assert rel_err(out.logits[b], q35_reference["causal"][b, n:n + 5]) <= TOL
    m = np.array([0, 2, 4])
    stale = cache
    rolled = tgt.commit(model, cache, out, m + 1)
    _, fresh = _prefill(model, SEQ, start + m + 1, 64)
    stale_diff = []
    for name in ("conv_q", "conv_k", "conv_v", "ssm"):
        for ours, ref, old in zip(getattr(rolled, name), getattr(fresh, name), getattr(stale, name)):
            np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-5 * float(np.abs(ref).max()))
            stale_diff.append([float(np.abs(old[b] - ref[b]).max()) for b in range(3)])
    stale_diff = np.max(stale_diff, axis=0)  # per sequence: 3, 1 and 0 rejected tokens absorbed without rollback
    assert stale_diff[0] > 1e-2 and stale_diff[1] > 1e-2 and stale_diff[2] < 1e-4
    nxt = np.array([[SEQ[b, n + k + 1]] for b, (n, k) in enumerate(zip(LENGTHS, m))])
    a, _ = tgt.decode(model, rolled, nxt, start + m + 1)
    b_, _ = tgt.decode(model, fresh, nxt, start + m + 1)
    np.testing.assert_allclose(a, b_, rtol=0, atol=1e-4)
    for b, (n, k) in enumerate(zip(LENGTHS, m)):
        assert rel_err(a[b, 0], q35_reference["causal"][b, n + k + 1]) <= TOL


def test_tp4_forward_equals_tp1(q35_targets):
    """Heads over 4 shards: 2 KV heads and 2 DeltaNet key heads are repeated, 4 value heads split; experts are
    tensor-parallel (8 of each expert's 32 intermediate columns per shard)."""
    model = q35_targets["wrapper", "fused"]
    ids = SEQ[:2, :48]
    assert rel_err(forward(model, ids, mesh=make_mesh(4)), forward(model, ids)) <= 1e-5


PROMPTS = random_prompts(12, (90, 57, 133))
NEW = 24
SPEC = dict(num_speculative_tokens=3, diffspec_chunk_size=8, diffspec_token_budget=40)


@pytest.fixture(scope="module")
def q35_draft(tmp_path_factory, q35_targets):
    from checkpoints_tools.make_tiny import make_tiny_draft

    model = q35_targets["causal", "fused"]
    d = make_tiny_draft(tmp_path_factory.mktemp("q35_draft") / "d", model.config, draft_vocab_size=128, seed=41,
                        aux_layer_ids=(0, 2, 3))
    return load_draft(d, model)


@pytest.fixture(scope="module")
def q35_baseline(q35_targets):
    return generate(q35_targets["causal", "fused"], None, PROMPTS, max_new_tokens=NEW + 8, stop_token_ids=()).tokens


def _oracle(reference, accept_upto, plan, dparams, state, active, key):
    """Proposes the target's own greedy continuation, right for the first accept_upto[seq] drafts only."""
    k = plan.spec.num_speculative_tokens
    pos = state.length[:, None] + 1 + jnp.arange(k)[None, :]
    right = jnp.take_along_axis(jnp.asarray(reference)[state.seq_id], pos, axis=1)
    ok = jnp.arange(k)[None, :] < jnp.asarray(accept_upto)[state.seq_id][:, None]
    zero = jnp.zeros_like(state.length)
    return jnp.where(ok, right, (right + 1) % plan.target.vocab_size), None, state.draft_cache, state.retrieval, \
        zero, zero


def test_partial_acceptance_through_the_engine_is_lossless(q35_targets, q35_baseline):
    """Every cycle accepts exactly 2, 1 and 0 of 3 drafts (one per sequence): the rollback runs each cycle."""
    width = max(len(p) for p in PROMPTS) + NEW + 16
    reference = np.zeros((len(PROMPTS), width), np.int32)
    for b, (p, t) in enumerate(zip(PROMPTS, q35_baseline)):
        reference[b, : len(p) + len(t)] = p + t
    res = generate(q35_targets["causal", "fused"], None, PROMPTS, max_new_tokens=NEW, stop_token_ids=(),
                   spec=SpecConfig(num_speculative_tokens=3),
                   proposer=functools.partial(_oracle, reference, (2, 1, 0)))
    assert res.tokens == [t[:NEW] for t in q35_baseline]
    assert res.stats.accepted_tokens == sum(j * -(-(NEW - 1) // (j + 1)) for j in (2, 1, 0))


@pytest.mark.parametrize("tp", [1, 4])
def test_greedy_speculative_output_equals_target_only(tp, q35_targets, q35_draft, q35_baseline):
    """A random EAGLE-3 draft with DiffSpec retrieval (scored at the last full-attention layer, 3). TP4 runs on the
    paged cache (its attention layers' K/V in pages, the DeltaNet states per sequence)."""
    spec = SpecConfig.from_flat(dict(draft_context_policy="diffspec", **SPEC))
    res = generate(q35_targets["causal", "fused"], q35_draft, PROMPTS, max_new_tokens=NEW, spec=spec,
                   stop_token_ids=(), mesh=make_mesh(tp) if tp > 1 else None, page_size=16 if tp > 1 else None)
    assert res.tokens == [t[:NEW] for t in q35_baseline]
    agg = res.stats.retrieval["aggregate"]
    assert agg["retrievals"] >= len(PROMPTS) and agg["ranks_agree"]


def test_tp_errors_name_the_dimension(tmp_path):
    from checkpoints_tools.make_tiny import make_tiny

    model = load_target(make_tiny(tmp_path / "odd", "qwen3_5_moe", seed=3, linear_num_value_heads=6,
                                  linear_num_key_heads=3), dtype="float32")
    with pytest.raises(ConfigError, match=r"linear_num_value_heads \(6\) is not divisible by tp=4"):
        forward(model, [[1, 2, 3]], mesh=make_mesh(4))


def test_numpy_backend_round_trip_per_expert_layout(tmp_path):
    """save_hf writes either expert layout; both load back to the params written."""
    from checkpoints_tools.hf import save_hf
    from checkpoints_tools.make_tiny import tiny_config
    from diffspec_jax.models import qwen35

    cfg = tiny_config("qwen3_5_moe", architecture="Qwen3_5MoeForConditionalGeneration", tie_word_embeddings=True)
    params = qwen35.init_params(cfg, seed=5)
    for layout in ("per_expert", "fused"):
        save_hf(tmp_path / layout, cfg, params, expert_layout=layout)
        back = load_target(tmp_path / layout, dtype="float32")
        assert back.config == cfg and "lm_head" not in back.params
        for x, y in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(back.params)):
            np.testing.assert_array_equal(x, y)


def test_server_slots_reuse_clears_recurrent_state(q35_targets, q35_draft, q35_baseline):
    """The server's slot engine (issue 24) on a hybrid target: three prompts through two slots, so a slot is
    reused; its DeltaNet conv and recurrent states start from zero again (greedy output = target-only)."""
    import time

    from diffspec_jax.serving.scheduler import EngineConfig, Request, SamplingParams, SlotEngine

    model = q35_targets["causal", "fused"]
    engine = SlotEngine(model, q35_draft, SpecConfig(num_speculative_tokens=3),
                        EngineConfig(max_num_seqs=2, max_model_len=max(map(len, PROMPTS)) + NEW, prefill_chunk=32))
    engine.start()
    try:
        reqs = [Request(p, SamplingParams(max_tokens=NEW, ignore_eos=True), lambda ev: None) for p in PROMPTS]
        for r in reqs:
            engine.submit(r)
        deadline = time.monotonic() + 120
        while not all(r.finished for r in reqs) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [r.tokens for r in reqs] == [t[:NEW] for t in q35_baseline]
    finally:
        engine.stop()


def test_fp8_cache_speculation_equals_target_only(q35_targets, q35_draft):
    """The 8-bit K/V cache on the hybrid target (its attention layers' K/V in fp8 pages, the DeltaNet states as
    they are): greedy speculation with DiffSpec retrieval returns target-only decoding on the same fp8 cache."""
    model = q35_targets["causal", "fused"]
    spec = SpecConfig.from_flat(dict(draft_context_policy="diffspec", **SPEC))
    kw = dict(max_new_tokens=12, stop_token_ids=(), kv_cache_dtype="fp8")
    alone = generate(model, None, PROMPTS[:2], **kw).tokens
    assert generate(model, q35_draft, PROMPTS[:2], spec=spec, page_size=16, **kw).tokens == alone
