"""Tree drafting and verification: ancestry masks, node selection, the tree-masked target step, greedy and
stochastic tree acceptance (chi-square, with a broken control), and the engine's tree and adaptive-depth modes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_prompts
from test_verification import chi_square_pvalue
from diffspec_jax import SamplingConfig, SpecConfig, forward, generate
from diffspec_jax.errors import ConfigError, InputError
from diffspec_jax.tree import Tree, ancestry_mask, merge_attention, select_nodes, validate_parents
from diffspec_jax.utils import CompileCounter
from diffspec_jax.verification import tree_greedy_accept, tree_rejection_accept


def make_tree(parents, tokens, valid=None) -> Tree:
    """A batch-1 :class:`Tree` from row lists (row 0 = root)."""
    parents = np.asarray(parents, np.int32)
    depth = np.zeros(len(parents), np.int32)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1 if parents[i] >= 0 else 0
    valid = np.ones(len(parents), bool) if valid is None else np.asarray(valid)
    return Tree(tokens=jnp.asarray([tokens], jnp.int32), parents=jnp.asarray([parents]),
                depth=jnp.asarray([depth]), valid=jnp.asarray([valid]))


def random_tree(rng, rows: int, max_depth: int, vocab: int = 50):
    """Random parents (each before its child, depth <= max_depth), distinct sibling tokens, a few padding rows."""
    parents, depth, tokens = [-1], [0], [int(rng.integers(vocab))]
    for i in range(1, rows):
        choices = [j for j in range(i) if depth[j] < max_depth]
        p = int(rng.choice(choices))
        used = {tokens[j] for j in range(1, i) if parents[j] == p}
        tok = int(rng.choice([t for t in range(vocab) if t not in used]))
        parents.append(p), depth.append(depth[p] + 1), tokens.append(tok)
    valid = np.ones(rows, bool)
    pad = rng.integers(0, 3)
    valid[rows - pad:] = False  # padding rows are leaves at the end, so closure holds
    parents = np.where(valid, parents, -1)
    return parents, tokens, valid


def ancestry_reference(parents, valid) -> np.ndarray:
    t = len(parents)
    out = np.eye(t, dtype=bool)
    for i in range(t):
        if not valid[i]:
            continue
        j = parents[i]
        while j >= 0:
            out[i, j] = True
            j = parents[j]
    return out


def test_ancestry_mask_golden_and_forward_parent_rejected():
    tr = make_tree([-1, 0, 0, 1, 2], [9, 10, 11, 12, 13])
    expect = np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]], bool)
    np.testing.assert_array_equal(np.asarray(ancestry_mask(tr.parents, tr.valid, 2))[0], expect)
    validate_parents([-1, 0, 0, 1, 2])
    with pytest.raises(InputError, match="row 2 has parent 3"):
        validate_parents([-1, 0, 3, 1])
    with pytest.raises(InputError, match="row 0 must be the root"):
        validate_parents([0, 0])


def test_ancestry_mask_matches_numpy_on_random_trees():
    rng = np.random.default_rng(0)
    for _ in range(6):
        parents, tokens, valid = random_tree(rng, 17, 4)
        tr = make_tree(parents, tokens, valid)
        got = np.asarray(ancestry_mask(tr.parents, tr.valid, 4))[0]
        np.testing.assert_array_equal(got, ancestry_reference(parents, valid))


def test_greedy_tree_walk_golden():
    """docs/method.md section 14: nodes with tokens [10..14] and parents [-1, 0, 0, 1, 2] (here rows 1..5 under a
    root row 0), target argmax [10, 11, 12, 99, 98, 97] -> accepted nodes [0, 1], emitted [10, 11, 12]."""
    tr = make_tree([-1, 0, 1, 1, 2, 3], [7, 10, 11, 12, 13, 14])
    logits = jax.nn.one_hot(jnp.asarray([[10, 11, 12, 99, 98, 97]]), 128) * 5.0
    m, path, emitted = tree_greedy_accept(logits, tr, max_depth=3)
    assert int(m[0]) == 2
    assert np.asarray(path)[0, :3].tolist() == [0, 1, 2]
    assert np.asarray(emitted)[0, :3].tolist() == [10, 11, 12]


def greedy_walk_reference(argmax, parents, tokens, valid, max_depth):
    cur, path = 0, [0]
    for _ in range(max_depth):
        kids = [i for i in range(len(parents)) if valid[i] and parents[i] == cur and tokens[i] == argmax[cur]]
        if not kids:
            break
        cur = kids[0]
        path.append(cur)
    return len(path) - 1, [argmax[p] for p in path]


def test_greedy_tree_walk_matches_numpy_reference():
    rng = np.random.default_rng(1)
    for _ in range(8):
        parents, tokens, valid = random_tree(rng, 15, 4, vocab=6)  # small vocab: the target often matches
        argmax = rng.integers(0, 6, len(parents))
        tr = make_tree(parents, tokens, valid)
        m, _, emitted = tree_greedy_accept(jax.nn.one_hot(jnp.asarray([argmax]), 6), tr, max_depth=4)
        m_ref, emit_ref = greedy_walk_reference(argmax, parents, tokens, valid, 4)
        assert int(m[0]) == m_ref and np.asarray(emitted)[0, : m_ref + 1].tolist() == emit_ref


def test_lse_merge_equals_concatenated_softmax():
    from diffspec_jax.models.layers import attention_dense

    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((2, 3, 4, 8)), jnp.float32)
    ka, va = (jnp.asarray(rng.standard_normal((2, 11, 2, 8)), jnp.float32) for _ in range(2))
    kb, vb = (jnp.asarray(rng.standard_normal((2, 5, 2, 8)), jnp.float32) for _ in range(2))
    ma = jnp.asarray(rng.random((2, 3, 11)) < 0.7).at[:, :, 0].set(True)
    mb = jnp.asarray(rng.random((2, 3, 5)) < 0.5).at[:, :, 0].set(True)
    oa, la = attention_dense(q, ka, va, ma, 0.35)
    ob, lb = attention_dense(q, kb, vb, mb, 0.35)
    whole, _ = attention_dense(q, jnp.concatenate([ka, kb], 1), jnp.concatenate([va, vb], 1),
                               jnp.concatenate([ma, mb], 2), 0.35)
    np.testing.assert_allclose(np.asarray(merge_attention(oa, la, ob, lb)), np.asarray(whole), atol=1e-5)


def test_select_nodes_keeps_the_best_budget_ancestry_closed():
    """A random EAGLE-like pool (children score below their parent); the tree holds the ``budget`` best entries
    (ties toward lower pool index), ordered by pool index, parents mapped to rows, and is ancestry-closed."""
    rng = np.random.default_rng(3)
    for trial in range(5):
        parent, score, depth = [], [], []
        for i in range(40):
            p = -1 if i < 4 else int(rng.integers(0, i))
            base = 0.0 if p < 0 else score[p]
            parent.append(p), depth.append(1 if p < 0 else depth[p] + 1)
            score.append(base + float(np.round(np.log(rng.random()), 1)))  # rounding makes ties
        score = np.array(score, np.float32)
        score[rng.integers(0, 40, 3)] = -np.inf  # not candidates (their subtrees must go too)
        for j in range(40):
            if parent[j] >= 0 and not np.isfinite(score[parent[j]]):
                score[j] = -np.inf
        tokens = rng.integers(0, 1000, 40).astype(np.int32)
        budget = [12, 7][trial % 2]
        tr = select_nodes(jnp.asarray([score]), jnp.asarray([parent], jnp.int32), jnp.asarray([tokens]),
                          jnp.asarray([depth], jnp.int32), jnp.asarray([budget], jnp.int32), 12,
                          jnp.asarray([5], jnp.int32), max_depth=40)
        order = sorted(range(40), key=lambda i: (-score[i], i))
        kept = sorted(i for i in order[:budget] if np.isfinite(score[i]))
        valid = np.asarray(tr.valid)[0]
        assert valid.sum() - 1 == len(kept)
        rows = {pool: r + 1 for r, pool in enumerate(kept)}
        assert np.asarray(tr.tokens)[0, 1:len(kept) + 1].tolist() == tokens[kept].tolist()
        assert np.asarray(tr.parents)[0, 1:len(kept) + 1].tolist() == [rows.get(parent[i], 0) if parent[i] >= 0
                                                                        else 0 for i in kept]
        assert all(parent[i] < 0 or parent[i] in rows for i in kept)  # closed
        assert int(tr.tokens[0, 0]) == 5


@pytest.fixture(scope="module")
def llama(targets):
    return targets["llama"]


def test_tree_target_step_equals_each_paths_forward_and_moved_rows_continue(llama):
    """Every tree row's logits equal a full forward over prompt + that row's root-to-node path; after moving one
    accepted path's KV rows into place, a decode step equals the full forward of the committed sequence."""
    from diffspec_jax.cache import create_cache, move_rows
    from diffspec_jax.models import family

    cfg, fam = llama.config, family(llama.config)
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, 256, 21).tolist()
    parents, tokens, valid = random_tree(rng, 10, 3, vocab=256)
    valid[:] = True
    parents = np.array([-1] + list(np.maximum(parents[1:], 0)))
    tr = make_tree(parents, tokens)
    cache = create_cache(cfg, 1, 64, jnp.float32)
    _, cache = fam.step(cfg, llama.params, cache, jnp.asarray([prompt[:-1]]), jnp.asarray([0]),
                        jnp.zeros((1, 1), jnp.int32))
    tr = tr.replace(tokens=tr.tokens.at[0, 0].set(prompt[-1]))
    start = jnp.asarray([len(prompt) - 1])
    rows = jnp.arange(10, dtype=jnp.int32)[None]
    out, cache = fam.step(cfg, llama.params, cache, tr.tokens, start, rows,
                          tree=(tr.depth, ancestry_mask(tr.parents, tr.valid, 3)))
    toks = np.asarray(tr.tokens)[0]

    def path_of(i):
        p = []
        while i > 0:
            p.append(i)
            i = parents[i]
        return p[::-1]

    seqs = [prompt + [int(toks[j]) for j in path_of(i)] for i in range(10)]
    width = max(map(len, seqs))  # right padding leaves earlier positions' logits unchanged (causal)
    ref = np.asarray(forward(llama, np.asarray([s + [0] * (width - len(s)) for s in seqs])))
    for i, s in enumerate(seqs):
        np.testing.assert_allclose(np.asarray(out.logits)[0, i], ref[i, len(s) - 1], rtol=2e-4, atol=2e-4)
    deepest = max(range(10), key=lambda i: len(path_of(i)))
    path = [0] + path_of(deepest)
    cache = move_rows(cache, start, jnp.asarray([path + [0] * (4 - len(path))], jnp.int32))
    nxt = int(rng.integers(256))
    committed = len(prompt) + len(path) - 1
    step_out, _ = fam.step(cfg, llama.params, cache, jnp.asarray([[nxt]]), jnp.asarray([committed]),
                           jnp.zeros((1, 1), jnp.int32))
    seq = prompt + [int(toks[j]) for j in path[1:]] + [nxt]
    ref = np.asarray(forward(llama, np.asarray([seq])))[0, -1]
    np.testing.assert_allclose(np.asarray(step_out.logits)[0, 0], ref, rtol=2e-4, atol=2e-4)


# ---------------------------------------------------------------------------------------- stochastic trees
N = 24_000
V = 40


@pytest.fixture(scope="module")
def tree_case():
    """Root with 3 children (two holding the target's likeliest tokens), one grandchild; rows' distributions
    are fresh random softmaxes, skewed so drafts are accepted often and rejected often."""
    rng = np.random.default_rng(6)
    logits = rng.standard_normal((5, V)) * 1.5
    tokens = [0, int(np.argmax(logits[0])), int(np.argsort(logits[0])[-2]), int(np.argsort(logits[0])[-7]), 0]
    tokens[4] = int(np.argmax(logits[1]))
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return make_tree([-1, 0, 0, 0, 1], tokens), logp.astype(np.float32)


def sample_tree(tr, logp, seed):
    """N independent verifications of the same tree (every batch row draws its own uniforms)."""
    batch = jax.tree_util.tree_map(lambda x: jnp.repeat(x, N, 0), tr)
    lp = jnp.broadcast_to(jnp.asarray(logp), (N,) + logp.shape)
    m, _, emitted = jax.jit(tree_rejection_accept, static_argnums=(3, 4))(jax.random.PRNGKey(seed), lp, batch, 2, 3)
    return np.asarray(m), np.asarray(emitted)


def test_tree_rejection_keeps_the_target_distribution(tree_case):
    tr, logp = tree_case
    m, emitted = sample_tree(tr, logp, seed=1)
    p = np.exp(logp.astype(np.float64))
    first = np.bincount(emitted[:, 0], minlength=V)
    assert chi_square_pvalue(first, p[0] / p[0].sum()) > 1e-3
    child = int(tr.tokens[0, 1])  # given the first token is node 1's, the second follows node 1's row
    second = np.bincount(emitted[emitted[:, 0] == child, 1], minlength=V)
    assert second.sum() > 2000 and chi_square_pvalue(second, p[1] / p[1].sum()) > 1e-3
    assert (m >= 1).mean() > 0.2 and (m == 0).mean() > 0.05  # both branches of the walk were exercised
    assert (m == 2).any()


def test_tree_verifier_fed_the_wrong_rows_is_detected(tree_case):
    """Control: a verifier reading a child's distribution from the wrong row (rows 1 and 2 swapped, an indexing
    bug) keeps the first token's law but not the second's, and the test notices."""
    tr, logp = tree_case
    _, emitted = sample_tree(tr, logp[[0, 2, 1, 3, 4]], seed=1)
    p = np.exp(logp.astype(np.float64))
    second = np.bincount(emitted[emitted[:, 0] == int(tr.tokens[0, 1]), 1], minlength=V)
    assert chi_square_pvalue(second, p[1] / p[1].sum()) < 1e-3


# ------------------------------------------------------------------------------------------------ engine
PROMPTS = random_prompts(12, (37, 70))
NEW = 24
TREE = dict(num_speculative_tokens=3, diffspec_verification_mode="tree", diffspec_max_tree_nodes=12,
            diffspec_tree_topk=3)
SMALL = dict(diffspec_chunk_size=8, diffspec_token_budget=40)


@pytest.fixture(scope="module")
def baseline(llama):
    return generate(llama, None, PROMPTS, max_new_tokens=NEW, stop_token_ids=()).tokens


@pytest.mark.parametrize("policy", ["full", "diffspec"])
def test_greedy_tree_output_equals_target_only(policy, llama, drafts, baseline):
    """(DiffSpec runs on the paged cache: tree blocks written and their accepted paths moved through the page
    table.)"""
    spec = SpecConfig.from_flat(dict(draft_context_policy=policy, **TREE, **(SMALL if policy == "diffspec" else {})))
    paged = dict(page_size=32) if policy == "diffspec" else {}
    res = generate(llama, drafts["llama"], PROMPTS, max_new_tokens=NEW, spec=spec, stop_token_ids=(), **paged)
    assert res.tokens == baseline
    s = res.stats
    assert s.verification_mode == "tree" and s.mean_tree_size == 12
    assert sum(s.accepted_depth_histogram) == s.sequence_cycles and s.drafted_tokens == 12 * s.sequence_cycles
    snap = s.drafting["per_sequence"][0]["branching"]
    assert snap["policy"] == "hazard" and len(snap["caps"]) == 3
    if policy == "diffspec":
        assert s.retrieval["aggregate"]["retrievals"] >= len(PROMPTS)
    with CompileCounter() as c:  # later calls reuse every compilation (caps and budgets are inputs)
        again = generate(llama, drafts["llama"], PROMPTS, max_new_tokens=NEW, spec=spec, stop_token_ids=(), **paged)
    assert c.count == 0 and again.tokens == baseline


def test_tree_sampling_is_seeded_and_adaptive_budget_grows(llama, drafts):
    spec = SpecConfig.from_flat(dict(**TREE, diffspec_adaptive_profile=True, diffspec_tree_branching="shallow"))
    sampling = SamplingConfig(temperature=0.8, top_k=50)
    runs = [generate(llama, drafts["llama"], PROMPTS, max_new_tokens=40, spec=spec, sampling=sampling, seed=s,
                     stop_token_ids=()) for s in (3, 3, 4)]
    assert runs[0].tokens == runs[1].tokens and runs[0].tokens != runs[2].tokens
    budget = runs[0].stats.drafting["per_sequence"][0]["node_budget"]
    assert budget["base"] == 8 and budget["budget"] > budget["base"]  # round4(12 / 1.5) = 8, then it grows
    assert runs[0].stats.drafting["per_sequence"][0]["branching"]["caps"] == [3, 3, 1]


def test_adaptive_chain_depth_is_lossless_and_per_sequence(llama, drafts, baseline):
    """Above the long-context threshold the depth starts at (and stays >= ) the long-context depth; the random
    draft is rarely accepted, so no sequence deepens; a batch runs at its largest depth without recompiling."""
    spec = SpecConfig.from_flat(dict(num_speculative_tokens=4, diffspec_adaptive_profile=True, diffspec_long_context_threshold=50,
                                     diffspec_long_context_depth=2))
    res = generate(llama, drafts["llama"], PROMPTS, max_new_tokens=NEW, spec=spec, stop_token_ids=())
    assert res.tokens == baseline
    per = res.stats.drafting["per_sequence"]
    assert [p["floor"] for p in per] == [2, 2]  # 37 + new tokens crosses 50: the floor drops to 2 for both
    assert all(2 <= p["depth"] <= 4 for p in per)
    assert res.stats.drafted_tokens < 4 * res.stats.sequence_cycles  # shallower chains were drafted


def test_tree_mode_errors(llama, drafts):
    with pytest.raises(ConfigError, match="diffspec_max_tree_nodes must be in"):
        SpecConfig.from_flat(dict(num_speculative_tokens=4, diffspec_verification_mode="tree", diffspec_max_tree_nodes=3,
                                  diffspec_tree_topk=2))
    with pytest.raises(ConfigError, match="diffspec_tree_topk"):
        SpecConfig.from_flat(dict(diffspec_verification_mode="tree", diffspec_max_tree_nodes=8, diffspec_tree_topk=9))
    with pytest.raises(ConfigError, match="draft_sampling='sample' applies to chain mode only"):
        SpecConfig.from_flat(dict(diffspec_verification_mode="tree", draft_sampling="sample"))
    with pytest.raises(ConfigError, match="diffspec_verification_mode must be one of"):
        SpecConfig.from_flat(dict(diffspec_verification_mode="dag"))
    with pytest.raises(ConfigError, match="diffspec_tree_branching"):
        SpecConfig.from_flat(dict(diffspec_tree_branching="wide"))
    with pytest.raises(ConfigError, match="diffspec_long_context_depth"):
        SpecConfig.from_flat(dict(num_speculative_tokens=2, diffspec_long_context_depth=3, diffspec_adaptive_profile=True))
    SpecConfig(num_speculative_tokens=1)  # the long-context depth (2) only matters to the adaptive chain depth
    with pytest.raises(ConfigError, match="custom proposer"):
        generate(llama, None, PROMPTS, max_new_tokens=4, spec=SpecConfig.from_flat(TREE), proposer=lambda *a: None)
    with pytest.raises(InputError, match="max_tree_nodes"):
        generate(llama, drafts["llama"], PROMPTS, max_new_tokens=4, spec=SpecConfig.from_flat(TREE), max_cache_len=82)
