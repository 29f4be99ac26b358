"""DiffSpec references against dense NumPy: chunk scoring, selection, history, gather-RoPE-write, draft attention,
and the host-side cadence controller."""

import jax.numpy as jnp
import numpy as np
import pytest

from diffspec_jax import DiffSpec, Full, SpecConfig
from diffspec_jax.config import DraftConfig, RopeConfig
from diffspec_jax.retrieval_control import RetrievalControl
from diffspec_jax.errors import ConfigError
from diffspec_jax.retrieval import chunk_scores_reference, salience_scores, select_chunks, update_chunk_sums
from diffspec_jax.working_cache import (
    DraftCache, draft_attention, gather_rope_write, history_indices, write_slots,
)


# --------------------------------------------------------------------------------------------- scoring
def np_chunk_scores(q, k, root, chunk):
    """Dense softmax over 0..r per head, mean per valid token of each chunk, mean over heads (float64)."""
    b, hq, d = q.shape
    s_len, hkv = k.shape[1], k.shape[2]
    nc = -(-s_len // chunk)
    out = np.zeros((b, nc))
    for bi in range(b):
        r = root[bi]
        for h in range(hq):
            logit = k[bi, : r + 1, h // (hq // hkv)] @ q[bi, h] / np.sqrt(d)
            p = np.exp(logit - logit.max())
            p /= p.sum()
            for c in range(nc):
                lo, hi = c * chunk, min((c + 1) * chunk, r + 1)
                if hi > lo:
                    out[bi, c] += p[lo:hi].mean() / hq
    return out


@pytest.mark.parametrize("external_lse", [True, False])
def test_scores_match_dense_softmax_reference(external_lse):
    rng = np.random.default_rng(0)
    b, hq, hkv, d, s_len, chunk = 3, 4, 2, 8, 11, 4  # GQA, partial last chunk (11 = 4 + 4 + 3)
    q = rng.standard_normal((b, hq, d))
    k = rng.standard_normal((b, s_len, hkv, d))
    k[:, 9:] = 1e3  # stale rows past every root must contribute nothing
    root = np.array([10 - 2, 5, 0])  # ragged: row 2 has a single valid token
    ref = np_chunk_scores(q, k, root, chunk)
    lse = None
    if external_lse:
        logits = np.einsum("bkgd,bskd->bkgs", q.reshape(b, hkv, 2, d), k) / np.sqrt(d)
        logits = np.where(np.arange(s_len)[None, None, None, :] <= root[:, None, None, None], logits, -np.inf)
        m = logits.max(-1, keepdims=True)
        lse = jnp.asarray((m[..., 0] + np.log(np.exp(logits - m).sum(-1))).reshape(b, hq), jnp.float32)
    ours = chunk_scores_reference(jnp.asarray(q, jnp.float32), lse, jnp.asarray(k.swapaxes(1, 2), jnp.float32),
                                  jnp.asarray(root), chunk)  # the target cache's [B, Hkv, S, D] layout
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-6, rtol=1e-4)
    assert np.asarray(ours)[2, 1:].max() == 0  # chunks past the root score 0
    np.testing.assert_allclose(np.asarray(ours).sum(-1) * 0, 0)


# ------------------------------------------------------------------------------------------- selection
def np_select(scores, root, chunk, max_chunks, keep_sink):
    newest = root // chunk
    forced = [0] if keep_sink and newest > 0 else []
    cands = [c for c in range(newest) if c not in forced]
    cands.sort(key=lambda c: (-scores[c], c))
    picked = forced + cands[: max_chunks - 1 - len(forced)]
    return sorted(picked)


def test_selection_golden_vector():
    """docs/method.md section 3.1: scores [.1, .9, .8, .7, .01], 18 tokens, C 4, Hb 12 -> chunks [1, 2, 4]."""
    scores = jnp.asarray([[0.1, 0.9, 0.8, 0.7, 0.01]])
    anchors = np.asarray(select_chunks(scores, jnp.asarray([17]), 4, 3, keep_sink=False))
    assert list(anchors[0]) == [1, 2]  # + the newest chunk 4 (tokens 16-17)
    sink = np.asarray(select_chunks(scores, jnp.asarray([17]), 4, 3, keep_sink=True))
    assert list(sink[0]) == [0, 1]


@pytest.mark.parametrize("keep_sink", [False, True])
def test_selection_matches_numpy_on_random_scores_with_ties(keep_sink):
    rng = np.random.default_rng(1)
    b, nc, chunk, max_chunks = 64, 24, 8, 6
    scores = rng.integers(0, 5, (b, nc)).astype(np.float32)  # many ties
    root = rng.integers(0, nc * chunk, b)
    ours = np.asarray(select_chunks(jnp.asarray(scores), jnp.asarray(root), chunk, max_chunks, keep_sink))
    for i in range(b):
        expected = np_select(scores[i], root[i], chunk, max_chunks, keep_sink)
        got = [int(a) for a in ours[i] if a >= 0]
        assert got == expected, (i, root[i])
        assert all(a < root[i] // chunk for a in got)  # anchors are complete chunks older than the newest


def test_all_chunks_fit_selects_every_complete_chunk():
    anchors = np.asarray(select_chunks(jnp.zeros((1, 8)), jnp.asarray([21]), 8, 5, False))
    assert [int(a) for a in anchors[0] if a >= 0] == [0, 1]  # chunks 0, 1 + newest 2


def test_fewer_chunks_than_slots_keeps_the_output_width():
    """A cache shorter than the budget has fewer chunks than anchor slots: the output is still [B, Nmax - 1]."""
    anchors = np.asarray(select_chunks(jnp.asarray([[0.3, 0.2, 0.1]]), jnp.asarray([20]), 8, 31, False))
    assert anchors.shape == (1, 30) and list(anchors[0, :2]) == [0, 1] and (anchors[0, 2:] == -1).all()


def test_redundancy_penalty_skips_a_near_duplicate_chunk():
    scores = jnp.asarray([[0.5, 0.9, 0.85, 0.3, 0.0, 0.0]])
    feats = np.eye(6, 4)[:, :4].astype(np.float32)
    feats[2] = feats[1]  # chunk 2 duplicates chunk 1
    feats[5] = [0, 0, 0, 1]
    summaries = jnp.asarray(feats)[None]
    plain = np.asarray(select_chunks(scores, jnp.asarray([47]), 8, 3, False))
    penal = np.asarray(select_chunks(scores, jnp.asarray([47]), 8, 3, False, 1.0, summaries))
    assert list(plain[0]) == [1, 2] and list(penal[0]) == [0, 1]


# --------------------------------------------------------------------------------------------- history
def test_history_golden_vector():
    """docs/method.md section 3.2: C 2, Hb 4, anchor chunk 0: r = 5 -> [0, 1, 3, 4]; r = 9 -> [0, 1, 7, 8]."""
    idx, n, w = history_indices(jnp.asarray([[0], [0]]), jnp.asarray([5, 9]), 2, 4)
    assert np.asarray(idx).tolist() == [[0, 1, 3, 4], [0, 1, 7, 8]]
    assert list(np.asarray(n)) == [4, 4] and list(np.asarray(w)) == [2, 2]


def test_history_never_cuts_or_duplicates_anchors_and_excludes_the_root():
    rng = np.random.default_rng(2)
    chunk, slots = 4, 20
    for _ in range(200):
        root = int(rng.integers(0, 120))
        newest = root // chunk
        anchors = sorted(rng.choice(max(newest, 1), min(newest, int(rng.integers(0, 5))), replace=False).tolist())
        pad = anchors + [-1] * (4 - len(anchors))
        idx, n, w = history_indices(jnp.asarray([pad]), jnp.asarray([root]), chunk, slots)
        idx = [int(i) for i in np.asarray(idx)[0] if i >= 0]
        anchor_tok = [c * chunk + j for c in anchors for j in range(chunk)]
        window = [p for p in range(root - 1, -1, -1) if p not in anchor_tok][: slots - len(anchor_tok)]
        assert idx == sorted(anchor_tok + window)
        assert root not in idx and len(idx) == len(set(idx)) == int(n[0])


def test_no_anchors_is_a_sliding_window():
    idx, n, _ = history_indices(None, jnp.asarray([3, 50]), 8, 16)
    idx = np.asarray(idx)
    assert idx[0].tolist() == [0, 1, 2] + [-1] * 13 and idx[1].tolist() == list(range(34, 50))
    assert list(np.asarray(n)) == [3, 16]


# ------------------------------------------------------------------------- gather-RoPE-write, draft attention
def small_draft_config(interleaved=False, partial=1.0):
    return DraftConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       intermediate_size=64, vocab_size=100, draft_vocab_size=100, target_hidden_size=32,
                       rope=RopeConfig(theta=10000.0, interleaved=interleaved, partial_rotary_factor=partial))


def random_store(cfg, batch, rng):
    """A draft cache (C = 4, B = 24, K = 3: Hb = 20) whose canonical store holds random keys and values."""
    spec = SpecConfig(num_speculative_tokens=3, context=DiffSpec(chunk_size=4, token_budget=24))
    cache = DraftCache.create(cfg, spec, batch, 64, jnp.float32)
    return cache.replace(store_k=jnp.asarray(rng.standard_normal(cache.store_k.shape), jnp.float32),
                         store_v=jnp.asarray(rng.standard_normal(cache.store_v.shape), jnp.float32))


@pytest.mark.parametrize("interleaved, partial", [(False, 1.0), (True, 1.0), (False, 0.5)])
def test_gather_rope_write_equals_rotating_the_gathered_rows(interleaved, partial):
    from diffspec_jax.models.eagle3 import rope

    cfg = small_draft_config(interleaved, partial)
    cache = random_store(cfg, 2, np.random.default_rng(3))
    cache = cache.replace(work_k=jnp.full(cache.work_k.shape, jnp.nan), work_v=jnp.full(cache.work_v.shape, jnp.nan))
    idx = np.full((2, 16), -1, np.int32)
    idx[0, :10] = [0, 1, 2, 3, 20, 21, 22, 23, 40, 41]
    idx[1, :16] = np.arange(30, 46)
    out = gather_rope_write(cfg, cache, jnp.asarray(idx))
    for b in range(2):
        valid = idx[b] >= 0
        rows = jnp.asarray(np.asarray(cache.store_k)[b, idx[b][valid]])[None]
        expected = np.asarray(rope(cfg, rows, jnp.arange(int(valid.sum()))[None]))[0]
        np.testing.assert_allclose(np.asarray(out.work_k)[b, : valid.sum()], expected, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(out.work_v)[b, : valid.sum()],
                                      np.asarray(cache.store_v)[b, idx[b][valid]])
        assert np.all(np.asarray(out.work_k)[b, valid.sum():16] == 0)  # padding rows are zeroed
        assert np.isnan(np.asarray(out.work_k)[b, 16:]).all()  # slots past the history are left alone


def test_draft_attention_over_working_cache_equals_dense_attention_on_selected_tokens():
    from diffspec_jax.models.eagle3 import rope
    from diffspec_jax.models.layers import attention_dense, causal_mask

    cfg = small_draft_config()
    rng = np.random.default_rng(4)
    cache = random_store(cfg, 1, rng)
    cache = cache.replace(work_k=jnp.asarray(rng.standard_normal(cache.work_k.shape), jnp.float32))
    selected = [4, 5, 6, 7, 30, 31, 33, 34]
    idx = jnp.asarray([selected + [-1] * 8])
    cache = gather_rope_write(cfg, cache, idx)
    n = len(selected)
    kq = jnp.asarray(rng.standard_normal((1, 2, 2, 16)), jnp.float32)  # root + one chain entry
    vq = jnp.asarray(rng.standard_normal((1, 2, 2, 16)), jnp.float32)
    local = jnp.asarray([[n, n + 1]])
    cache = write_slots(cache, rope(cfg, kq, local), vq, local)
    q = jnp.asarray(rng.standard_normal((1, 2, 4, 16)), jnp.float32)
    out = draft_attention(cfg, cache, rope(cfg, q, local), local)
    # dense reference: the selected rows and the two new entries, rotated at 0..n+1, nothing else
    keys = jnp.concatenate([cache.store_k[:, jnp.asarray(selected)], kq], axis=1)
    vals = jnp.concatenate([cache.store_v[:, jnp.asarray(selected)], vq], axis=1)
    pos = jnp.arange(n + 2)[None]
    ref, _ = attention_dense(rope(cfg, q, local), rope(cfg, keys, pos), vals, causal_mask(local, n + 2), 0.25)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)


def test_salience_scores_and_chunk_sums():
    rng = np.random.default_rng(5)
    k = rng.standard_normal((1, 10, 2, 8)).astype(np.float32)
    sums = update_chunk_sums(jnp.zeros((1, 3, 2, 8)), jnp.asarray(k), jnp.arange(10)[None],
                             jnp.asarray([[True] * 9 + [False]]), 4)
    np.testing.assert_allclose(np.asarray(sums)[0, 2], k[0, 8], atol=1e-6)  # position 9 not committed
    np.testing.assert_allclose(np.asarray(sums)[0, 0], k[0, :4].sum(0), atol=1e-5)
    q = rng.standard_normal((1, 4, 8)).astype(np.float32)
    s = np.asarray(salience_scores(jnp.asarray(q), sums, jnp.asarray([8]), 4))
    mean1 = k[0, 4:8].mean(0)
    expected = np.mean([q[0, h] @ mean1[h // 2] for h in range(4)]) / np.sqrt(8)
    np.testing.assert_allclose(s[0, 1], expected, rtol=1e-5)
    assert np.isfinite(s[0, 2])  # chunk 2 holds the root (position 8)


# ----------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("kw, needle", [
    (dict(diffspec_token_budget=100, diffspec_chunk_size=64), "must be a multiple of diffspec_chunk_size"),
    (dict(diffspec_token_budget=64, diffspec_chunk_size=64, num_speculative_tokens=3), "too small"),
    (dict(diffspec_token_budget=128, diffspec_chunk_size=64, num_speculative_tokens=3,
          diffspec_keep_sink_chunk=True), "must be >= 128"),
    (dict(diffspec_scorer="max"), "diffspec_scorer must be one of"),
    (dict(diffspec_retrieval_interval=0), "diffspec_retrieval_interval must be a positive integer"),
    (dict(diffspec_redundancy_weight=-1.0), "diffspec_redundancy_weight must be a finite number >= 0"),
])
def test_invalid_combinations(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        SpecConfig.from_flat(dict(draft_context_policy="diffspec", **kw))


def test_defaults_follow_the_reference_table():
    s = SpecConfig.from_flat(dict(draft_context_policy="diffspec", num_speculative_tokens=3))
    assert (s.context.chunk_size, s.context.token_budget, s.context.retrieval_interval) == (64, 2048, None)
    # the interval left at None takes the drafter's default; one given is kept
    assert s.with_default_interval(self_draft=False).context.retrieval_interval == 4
    assert s.with_default_interval(self_draft=True).context.retrieval_interval == 1
    given = SpecConfig.from_flat(dict(draft_context_policy="diffspec", diffspec_retrieval_interval=3))
    assert given.with_default_interval(self_draft=True) == given
    assert SpecConfig().with_default_interval(self_draft=True) == SpecConfig()  # no DiffSpec context: unchanged
    assert (s.history_budget, s.max_chunks) == (1984, 31)
    assert SpecConfig.from_flat(dict(draft_context_policy="diffspec", num_speculative_tokens=5,
                                     diffspec_chunk_size=32)).history_budget == 2016
    assert SpecConfig().context == Full() and not SpecConfig().verification.adaptive


# ---------------------------------------------------------------------------------- adaptive interval
def test_adaptive_interval_doubles_on_stable_selections_and_resets_on_change():
    spec = SpecConfig.from_flat(dict(draft_context_policy="diffspec", diffspec_chunk_size=4, diffspec_token_budget=64,
                                     num_speculative_tokens=3, diffspec_retrieval_interval=8, diffspec_adaptive_profile=True))
    ctl = RetrievalControl(spec, 1)
    root = 400  # newest chunk 100
    same = np.array([[1, 2, 3] + [-1] * 11])  # [ranks, A]

    def period(accept):
        for _ in range(8):
            ctl.observe(0, accept, 10, 5)

    ctl.record(0, same, root, 1.0, after_prefill=True)
    period(3.0)
    ctl.record(0, same, root, 1.0, after_prefill=False)  # first decode retrieval: no earlier period to compare
    assert ctl.c[0].interval == 8
    period(3.0)
    ctl.record(0, same, root, 1.0, after_prefill=False)  # stable set, acceptance holds
    assert ctl.c[0].interval == 16 and ctl.c[0].last_jaccard == 1.0
    period(3.0)
    ctl.record(0, np.array([[7, 8, 9] + [-1] * 11]), root, 1.0, after_prefill=False)  # changed set
    assert ctl.c[0].interval == 8 and ctl.c[0].last_jaccard == pytest.approx(1 / 7)
    period(3.0)
    ctl.record(0, np.array([[7, 8, 9] + [-1] * 11]), root, 1.0, after_prefill=False)
    assert ctl.c[0].interval == 16
    period(1.0)  # acceptance dropped below 0.9x the period before
    ctl.record(0, np.array([[7, 8, 9] + [-1] * 11]), root, 1.0, after_prefill=False)
    assert ctl.c[0].interval == 8
    for _ in range(10):
        period(3.0)
        ctl.record(0, np.array([[7, 8, 9] + [-1] * 11]), root, 1.0, after_prefill=False)
    assert ctl.c[0].interval == 32  # capped
