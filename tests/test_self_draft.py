"""Self-drafting (``generate(target, "self", ...)``): greedy output equals target-only decoding for every policy,
the working set holds exactly the target's rows of the positions its policy names, the self-draft's distributions
equal a full forward under the same attention mask, rejection sampling keeps the target's distribution, and the
CLI's ``--draft self``."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_prompts
from diffspec_jax import SamplingConfig, SpecConfig, engine, forward, generate
from diffspec_jax.engine.self_draft import SelfDrafter, self_draft_spec, self_propose
from diffspec_jax.errors import ConfigError
from diffspec_jax.models import llama
from diffspec_jax.models.layers import attention_dense, embed_lookup, rope_cos_sin
from diffspec_jax.sampling import processed_logprobs
from diffspec_jax.target import pad_prompts

LENGTHS = (97, 150)
NEW = 40
K = 3
SMALL = dict(diffspec_chunk_size=8, diffspec_token_budget=40, num_speculative_tokens=K)  # Hb = 32: 4 chunks
CAPACITY = 256


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(8, LENGTHS)


@pytest.fixture(scope="module")
def baselines(targets, prompts):
    return {arch: generate(targets[arch], None, prompts, max_new_tokens=NEW, stop_token_ids=()).tokens
            for arch in ("llama", "qwen3")}


@pytest.mark.parametrize("arch, policy", [("llama", "recent"), ("llama", "diffspec"), ("qwen3", "diffspec")])
def test_greedy_self_draft_equals_target_only(arch, policy, targets, prompts, baselines):
    """Ragged prompts longer than the 40-token budget: the working set holds 32 of their positions."""
    res = generate(targets[arch], "self", prompts, max_new_tokens=NEW, stop_token_ids=(),
                   spec=SpecConfig.from_flat(dict(draft_context_policy=policy, **SMALL)))
    assert res.tokens == baselines[arch]
    s = res.stats
    assert s.draft_context_policy == policy and s.drafted_tokens == K * s.sequence_cycles
    if policy == "diffspec":
        assert s.retrieval["aggregate"]["retrievals"] >= 1 + len(LENGTHS)
        for seq in s.retrieval["per_sequence"]:
            assert seq["working_len"] == 32 and seq["sink_kept"] and len(seq["anchor_chunks"]) == 3
            # self-drafting's default interval: retrieval every cycle, each one after the prefill's
            assert seq["interval"] == 1 and seq["skipped_not_due"] == 0 and seq["retrievals"] == seq["cycles"] + 1
    else:
        assert s.retrieval is None


def test_self_draft_on_a_tensor_and_data_parallel_mesh_equals_one_device(targets, prompts):
    """TP 2 x DP 2 on four CPU devices: the working set is sharded over KV heads like the target cache, and every
    rank selects, drafts and accepts as one device does."""
    from diffspec_jax import make_mesh

    spec = SpecConfig.from_flat(dict(draft_context_policy="diffspec", **SMALL))
    one = generate(targets["llama"], "self", prompts, max_new_tokens=16, spec=spec, stop_token_ids=())
    res = generate(targets["llama"], "self", prompts, max_new_tokens=16, spec=spec, stop_token_ids=(),
                   mesh=make_mesh(tp=2, dp=2))
    assert res.tokens == one.tokens
    assert res.stats.acceptance_length_per_sequence == one.stats.acceptance_length_per_sequence
    assert res.stats.retrieval["aggregate"]["ranks_agree"]


def test_greedy_self_draft_of_a_hybrid_target_equals_target_only():
    """Qwen3.5 (3 Gated DeltaNet layers + 1 attention layer): the draft steps read the attention layer's working set
    and advance a copy of the DeltaNet states, which verification never sees."""
    from checkpoints_tools.make_tiny import tiny_config
    from diffspec_jax.models import family
    from diffspec_jax.target import TargetModel

    cfg = tiny_config("qwen3_5_moe")
    target = TargetModel(cfg, family(cfg).init_params(cfg, seed=1))
    prompts = random_prompts(9, (70, 45))
    base = generate(target, None, prompts, max_new_tokens=16, stop_token_ids=()).tokens
    res = generate(target, "self", prompts, max_new_tokens=16, stop_token_ids=(),
                   spec=SpecConfig.from_flat(dict(draft_context_policy="diffspec", **SMALL)))
    assert res.tokens == base and res.stats.retrieval["aggregate"]["retrievals"] >= 2


# ------------------------------------------------------------------------------- the working set, step by step
def prefilled(plan, target, prompts):
    """The decode state after the prefill of ``prompts``, the first token and (``diffspec``) the first retrieval."""
    fns = engine.compiled(plan)
    cfg, b = target.config, len(prompts)
    lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    acc = engine.PrefillAcc(logits=jnp.zeros((b, cfg.vocab_size)), aux=jnp.zeros((b, 1)),
                             score_q=jnp.zeros((b, cfg.num_attention_heads, cfg.head_dim)),
                             score_lse=jnp.zeros((b, cfg.num_attention_heads)))
    toks = jnp.asarray(pad_prompts(prompts, CAPACITY + 1))
    state = engine.init_state(plan, b, jnp.float32, jnp.float32, 0)
    state, acc = fns.prefill_chunk(target.params, None, state, acc, toks[:, :CAPACITY], toks[:, 1:],
                                   jnp.zeros(b, jnp.int32), lengths)
    context = jnp.asarray(pad_prompts(prompts, CAPACITY)) if plan.drafter_context else None
    state, first = fns.start_decode(state, acc, lengths, context)
    if plan.diffspec:
        state, _ = fns.retrieve(target.params, None, state, jnp.ones(b, bool))
    return state, np.asarray(first)


@functools.partial(jax.jit, static_argnums=0)
def masked_logits(cfg, params, tokens, mask):
    """Logits ``[T, V]`` of a full forward of ``tokens [T]`` in which query t attends to the keys ``mask[t]``
    marks (the reference: no cache, no working set)."""
    t = tokens.shape[0]
    cos, sin = rope_cos_sin(jnp.arange(t)[None], cfg.rope.inv_freq(cfg.head_dim))
    x = embed_lookup(params["embed"], tokens[None], None)
    for lp in params["layers"]:
        x, _, _ = llama._attention_block(cfg, lp, x, cos, sin,
                                         lambda q, k, v: attention_dense(q, k, v, mask[None], cfg.head_dim ** -0.5),
                                         None)
        x = llama._mlp_block(cfg, lp, x, None)
    return llama._lm_head(cfg, params, x, None)[0]


def expected_history(anchors, length, chunk, slots):
    """NumPy: the anchor chunks' tokens before ``length`` and the most recent other positions, ``slots`` in all."""
    chosen = {int(a) for a in anchors if a >= 0}
    anchor_tok = [t for t in range(length) if t // chunk in chosen]
    rest = [t for t in range(length) if t // chunk not in chosen]
    window = rest[len(rest) - max(0, slots - len(anchor_tok)):]
    return set(anchor_tok) | set(window), len(anchor_tok)


def test_working_set_is_a_gather_of_the_target_rows_and_drafts_match_a_masked_forward(targets, prompts):
    """Six cycles of sampled self-drafting (retrieval every other cycle, so rows are rebuilt and appended): before
    every draft, each history slot holds the target cache's K/V row of its position, exactly, and the positions are
    the sink + selected chunks + the most recent others (NumPy); each draft step's distribution equals a full
    forward whose queries past the committed length see only those positions and the chain."""
    from diffspec_jax import working_set

    target = targets["llama"]
    cfg, params = target.config, target.params
    spec = self_draft_spec(SpecConfig.from_flat(dict(draft_context_policy="diffspec", draft_sampling="sample", **SMALL)), cfg)
    plan = engine.Plan(target=cfg, draft=None, spec=spec, sampling=SamplingConfig(temperature=1.0), aux_layers=(),
                       capacity=CAPACITY, drafter=SelfDrafter())
    state, first = prefilled(plan, target, prompts)
    seqs = [list(p) + [int(f)] for p, f in zip(prompts, first)]
    propose = jax.jit(functools.partial(self_propose, plan))
    fns = engine.compiled(plan)
    active = jnp.ones(len(prompts), bool)
    c, hb, t_max = spec.context.chunk_size, spec.history_budget, CAPACITY
    rebuilt = appended = 0
    for cycle in range(6):
        anchors = np.asarray(working_set.effective_anchors(state.retrieval.anchors, state.length, c,
                                                           spec.max_chunks - 1))
        key = engine.state._split(plan, state.rng, 3)[1]
        built_before = np.asarray(state.draft_cache.built)
        drafts, q, ws, _, n, window, _ = propose(params, state, active, key)
        tk = [np.asarray(x) for x in state.target_cache.k]
        tv = [np.asarray(x) for x in state.target_cache.v]
        pos, n = np.asarray(ws.pos), np.asarray(n)
        for b, seq in enumerate(seqs):
            length = len(seq) - 1
            rebuilt += int(not np.array_equal(built_before[b], anchors[b]))
            appended += int(np.array_equal(built_before[b], anchors[b]))
            want, n_anchor = expected_history(anchors[b], length, c, hb)
            assert n[b] == len(want) == hb and int(ws.n_anchor[b]) == n_anchor and int(window[b]) == hb - n_anchor
            assert set(pos[b, :n[b]].tolist()) == want and (pos[b, n[b]:] == -1).all()
            for layer in range(cfg.num_hidden_layers):
                np.testing.assert_array_equal(np.asarray(ws.k[layer][b, :, :n[b]]), tk[layer][b][:, pos[b, :n[b]]])
                np.testing.assert_array_equal(np.asarray(ws.v[layer][b, :, :n[b]]), tv[layer][b][:, pos[b, :n[b]]])
            visible = np.zeros(t_max, bool)
            visible[sorted(want)] = True
            for j in range(K):
                tokens = seq + [int(d) for d in drafts[b, :j]]
                mask = np.tril(np.ones((t_max, t_max), bool))
                mask[length:, :length] = visible[None, :length]
                padded = np.zeros(t_max, np.int32)
                padded[:len(tokens)] = tokens
                ref = masked_logits(cfg, params, jnp.asarray(padded), jnp.asarray(mask))[length + j]
                np.testing.assert_allclose(np.asarray(q[b, j]), np.asarray(jax.nn.softmax(ref)), atol=2e-6)
        state, emitted, m, *_ = fns.cycle(params, None, state, active)
        for b in range(len(seqs)):
            seqs[b] += [int(x) for x in np.asarray(emitted[b, :int(m[b]) + 1])]
        layer0 = np.asarray(state.target_cache.k[0])  # the chain's own rows: layer 0 K depends on token + position
        for b, seq in enumerate(seqs):
            length = len(seq) - int(m[b]) - 2
            np.testing.assert_allclose(np.asarray(ws.k[0][b, :, n[b]:n[b] + K]), layer0[b][:, length:length + K],
                                       atol=1e-6)
        if cycle % 2:
            state, _ = fns.retrieve(params, None, state, active)
    assert rebuilt >= 2 * len(prompts) and appended >= 2 * len(prompts)


# ------------------------------------------------------------------------------------------ sampling is lossless
N_BATCH, N_CALLS = 4000, 6


@pytest.fixture(scope="module")
def micro():
    """A 2-layer random Llama with sharp attention (weights of std 0.3), so that attending to a 16-token working
    set moves its next-token distribution far from the full context's."""
    from checkpoints_tools.make_tiny import tiny_config
    from diffspec_jax.target import TargetModel

    cfg = tiny_config("llama", num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      hidden_size=32, intermediate_size=64, vocab_size=64)
    return TargetModel(cfg, llama.init_params(cfg, seed=3, scale=0.3))


def sampled_cycles(plan, target, base, **leaves):
    """``N_CALLS`` chain cycles (the engine's program, state donated) of ``N_BATCH`` copies of the batch-1 state
    ``base``, with fresh keys and ``leaves`` set in every copy: the first emitted token and whether a draft was
    accepted, each ``[N_CALLS, N_BATCH]``."""
    copies = jax.jit(lambda st, key: st.take(jnp.zeros(N_BATCH, jnp.int32)).replace(rng=key, **leaves))
    cycle = engine.compiled(plan).cycle
    active = jnp.ones(N_BATCH, bool)
    firsts, accepted = [], []
    for i in range(N_CALLS):
        _, emitted, m, *_ = cycle(target.params, None, copies(base, jax.random.PRNGKey(i)), active)
        firsts.append(np.asarray(emitted[:, 0]))
        accepted.append(np.asarray(m) > 0)
    return np.stack(firsts), np.stack(accepted)


def test_self_draft_sampling_keeps_the_target_distribution(micro):
    """24,000 verification cycles of one context (draft tokens sampled from the self-draft's processed
    distribution, verified with it as q): the first emitted token follows the target's processed distribution
    (chi-square), while the self-draft's distribution is far from it, so a verifier that accepted every draft (or
    used another q) would fail the test."""
    from test_verification import chi_square_pvalue

    prompt = random_prompts(4, [60], vocab=64)[0]
    x = 7  # the last emitted token, fixed for every row (the prefill's own sample varies per row)
    sampling = SamplingConfig(temperature=0.9)  # no truncation: its boundary would move with float rounding
    spec = self_draft_spec(SpecConfig.from_flat(dict(draft_context_policy="recent", draft_sampling="sample", diffspec_chunk_size=8,
                                                     diffspec_token_budget=24, num_speculative_tokens=2)), micro.config)
    plan = engine.Plan(target=micro.config, draft=None, spec=spec, sampling=sampling, aux_layers=(),
                       capacity=CAPACITY, drafter=SelfDrafter())
    base, _ = prefilled(plan, micro, [prompt])
    base = base.replace(last_token=jnp.full((1,), x, jnp.int32))
    q = np.asarray(jax.jit(functools.partial(self_propose, plan))(micro.params, base, jnp.ones(1, bool),
                                                                   jax.random.PRNGKey(0))[1][0, 0], np.float64)
    p = np.exp(np.asarray(processed_logprobs(forward(micro, [prompt + [x]])[0, -1], sampling), np.float64))
    assert 0.5 * np.abs(q - p).sum() > 0.3  # total variation: the working set really changes the distribution
    firsts, _ = sampled_cycles(plan, micro, base)
    counts = np.bincount(firsts.ravel(), minlength=p.shape[0])
    assert chi_square_pvalue(counts, p / p.sum()) > 1e-3
    accept_all = np.bincount(np.random.default_rng(0).choice(p.shape[0], counts.sum(), p=q / q.sum()),
                             minlength=p.shape[0])  # what emitting the drafts unverified would give
    assert chi_square_pvalue(accept_all, p / p.sum()) < 1e-3


@pytest.mark.parametrize("behind", [None, "self"])
def test_prompt_lookup_sampling_keeps_the_target_distribution(micro, behind):
    """Prompt lookup alone and in front of self-drafting (sampled drafts over a 16-token window), 24,000 sampled
    cycles of one context: on half the rows the token history (the drafter's own state, set here) holds one earlier
    occurrence of the last token x, followed by a token d the target finds likely but not certain, so the lookup
    drafts d (one-hot q); on the other half x never occurs before, so the rows take the last token repeated (alone)
    or the self-draft's sampled tokens and q. In each half the first emitted token follows the target's processed
    distribution (chi-square), and on the matching half a draft is accepted as often as p(d) says."""
    from diffspec_jax.engine.drafting import InFront
    from diffspec_jax.engine.ngram import NGramDrafter
    from test_verification import chi_square_pvalue

    prompt = random_prompts(4, [60], vocab=64)[0]
    x = 7
    sampling = SamplingConfig(temperature=0.9)
    flat = dict(num_speculative_tokens=2, ngram_min_n=1, ngram_max_n=1, ngram_first=behind is not None)
    if behind:
        spec = self_draft_spec(SpecConfig.from_flat(dict(draft_context_policy="recent", draft_sampling="sample",
                                                         diffspec_chunk_size=8, diffspec_token_budget=24, **flat)),
                               micro.config)
    else:
        spec = SpecConfig.from_flat(flat)
    plan = engine.Plan(target=micro.config, draft=None, spec=spec, sampling=sampling, aux_layers=(),
                       capacity=CAPACITY, drafter=InFront(NGramDrafter(), SelfDrafter()) if behind else NGramDrafter())
    base, _ = prefilled(plan, micro, [prompt])
    p = np.exp(np.asarray(processed_logprobs(forward(micro, [prompt + [x]])[0, -1], sampling), np.float64))
    p /= p.sum()
    d = int(np.argsort(-p)[1])  # the target's second choice
    assert 0.05 < p[d] < 0.95 and d != x
    hist = np.array(prompt + [x] + [0] * (CAPACITY - len(prompt) - 1), np.int32)
    hist[:len(prompt)][hist[:len(prompt)] == x] = (x + 1) % 64  # no earlier x: no match
    found = np.arange(N_BATCH) % 2 == 0
    rows = np.repeat(hist[None], N_BATCH, axis=0)
    rows[found, 10], rows[found, 11] = x, d  # one earlier x, followed by d
    base = base.replace(last_token=jnp.full((1,), x, jnp.int32))
    mine = (jnp.asarray(rows), None) if behind else jnp.asarray(rows)  # (InFront: the pair of the two states)
    firsts, accepted = sampled_cycles(plan, micro, base, drafter=mine)
    for half in (found, ~found):
        counts = np.bincount(firsts[:, half].ravel(), minlength=p.shape[0])
        assert chi_square_pvalue(counts, p) > 1e-3
    assert abs(accepted[:, found].mean() - p[d]) < 0.025  # the lookup drafted d on the matching rows


# --------------------------------------------------------------------------------------------- errors and the CLI
def test_self_draft_refuses_what_it_does_not_support(targets, prompts):
    t = targets["llama"]
    bad = [("selff", SpecConfig(), "draft must be"),
           ("self", SpecConfig.from_flat(dict(diffspec_verification_mode="tree", num_speculative_tokens=3)), "chains"),
           ("self", SpecConfig.from_flat(dict(draft_context_policy="diffspec", diffspec_scorer="salience")), "salience"),
           ("self", SpecConfig.from_flat(dict(draft_context_policy="diffspec", diffspec_redundancy_weight=0.5)), "salience"),
           ("self", SpecConfig.from_flat(dict(draft_context_policy="recent", diffspec_chunk_size=16, diffspec_token_budget=32,
                                              num_speculative_tokens=3)), "sink chunk")]
    for draft, spec, match in bad:
        with pytest.raises(ConfigError, match=match):
            generate(t, draft, prompts, max_new_tokens=4, spec=spec)
    with pytest.raises(ConfigError, match="custom proposer"):
        generate(t, "self", prompts, max_new_tokens=4, proposer=lambda *a: None)


def test_cli_draft_self(tiny_dirs, prompts, baselines, capsys):
    """``--draft self`` (policy full, the sanity mode) prints the target-only tokens; tree mode is a usage error."""
    import importlib

    cli = importlib.import_module("diffspec_jax.generate")
    ids = ",".join(map(str, prompts[0]))
    code = cli.main(["--target", str(tiny_dirs["llama"]), "--draft", "self", "--prompt-ids", ids, "--policy", "full",
                     "-k", str(K), "--max-new-tokens", str(NEW), "--ignore-eos", "--dtype", "float32", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert code == 0 and rep["draft"] == "self" and rep["ids"] == baselines["llama"][0]
    s = rep["stats"]  # full: the target drafting over its own full cache proposes its own greedy tokens
    assert s["draft_context_policy"] == "full" and s["mean_acceptance_length"] == K + 1
    code = cli.main(["--target", str(tiny_dirs["llama"]), "--draft", "self", "--prompt-ids", ids,
                     "--verification-mode", "tree", "-k", "3", "--max-tree-nodes", "7", "--tree-topk", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.strip().splitlines()[-1].startswith("error: self-drafting")
