"""The torch bridge: every op against its JAX reference on the same random inputs, the runtime (slots, cadence,
counters, rebuild), device selection with a simulated NPU, DLPack exchange, and the JAX-free import."""

import subprocess
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from diffspec_jax import RopeConfig, SpecConfig
from diffspec_jax import torch_bridge as tb
from diffspec_jax.models.layers import apply_rope as jax_apply_rope
from diffspec_jax.models.layers import rope_cos_sin as jax_rope_cos_sin
from diffspec_jax.retrieval import chunk_scores_reference, head_sum_scores as jax_head_sum_scores
from diffspec_jax.retrieval import salience_scores as jax_salience, select_chunks as jax_select
from diffspec_jax.retrieval import update_chunk_sums as jax_update_chunk_sums
from diffspec_jax.working_cache import draft_attention_reference, gather_rope_write_reference
from diffspec_jax.working_cache import history_indices as jax_history

torch.set_num_threads(2)

DTYPES = {"float32": (torch.float32, jnp.float32, 2e-5), "bfloat16": (torch.bfloat16, jnp.bfloat16, 1e-2)}


def heads_first(k) -> jnp.ndarray:
    """The bridge's ``[B, S, Hkv, D]`` keys in the JAX target cache's ``[B, Hkv, S, D]`` layout."""
    return jnp.swapaxes(jnp.asarray(k), 1, 2)


def pair(a: np.ndarray, dtype: str = "float32"):
    """The same values as a torch tensor and a JAX array (rounded to ``dtype`` once, identically)."""
    t = torch.as_tensor(np.asarray(a, np.float32)).to(DTYPES[dtype][0])
    return t, jnp.asarray(t.float().numpy()).astype(DTYPES[dtype][1])


def close(ours: torch.Tensor, ref, dtype: str = "float32") -> None:
    """Norm-relative comparison (``max |a - b| <= tol * max(1, max |b|)``)."""
    a = ours.float().numpy().astype(np.float64)
    b = np.asarray(jnp.asarray(ref).astype(jnp.float32), np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    tol = DTYPES[dtype][2]
    err = np.max(np.abs(a - b)) if a.size else 0.0
    assert err <= tol * max(1.0, float(np.max(np.abs(b))) if b.size else 1.0), err


# ---------------------------------------------------------------------------------------------- import
def test_importing_the_bridge_does_not_import_jax():
    code = ("import diffspec_jax.torch_bridge, sys; assert 'jax' not in sys.modules, 'jax imported'; "
            "import diffspec_jax as dj; assert callable(dj.SpecConfig); assert 'jax' not in sys.modules; "
            "from diffspec_jax import generate, engine; assert generate is engine.generate is dj.generate")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_package_names_stay_available_lazily():
    import diffspec_jax as dj
    from diffspec_jax import SpecConfig as S, generate, load_target, make_mesh  # noqa: F401

    assert callable(generate) and callable(dj.generate) and callable(load_target) and S is SpecConfig
    assert set(dj.__all__) <= set(dir(dj))
    with pytest.raises(AttributeError):
        dj.no_such_name  # noqa: B018


# ------------------------------------------------------------------------------------------------- RoPE
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("interleaved, rotary", [(False, 16), (True, 16), (False, 8), (True, 8)])
def test_rope_matches_jax(dtype, interleaved, rotary):
    rng = np.random.default_rng(0)
    inv_freq = RopeConfig(theta=5e5).inv_freq(rotary)
    pos = rng.integers(0, 3000, (2, 5))
    x_t, x_j = pair(rng.standard_normal((2, 5, 3, 16)), dtype)
    cos_t, sin_t = tb.rope_cos_sin(torch.as_tensor(pos), inv_freq)
    cos_j, sin_j = jax_rope_cos_sin(jnp.asarray(pos), inv_freq)
    close(cos_t, cos_j)
    close(sin_t, sin_j)
    close(tb.apply_rope(x_t, cos_t, sin_t, interleaved=interleaved),
          jax_apply_rope(x_j, cos_j, sin_j, interleaved=interleaved), dtype)
    assert tb.apply_rope(x_t, cos_t, sin_t).dtype == x_t.dtype


# ---------------------------------------------------------------------------------------------- scoring
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("external_lse", [True, False])
def test_contiguous_chunk_scores_match_jax(dtype, external_lse):
    rng = np.random.default_rng(1)
    b, hq, hkv, d, s_len, chunk = 3, 8, 2, 16, 45, 4  # GQA, partial last chunk
    q_t, q_j = pair(rng.standard_normal((b, hq, d)) * 2, dtype)
    k = rng.standard_normal((b, s_len, hkv, d))
    k[:, 40:] = 50.0  # stale rows past every root must contribute nothing
    k_t, k_j = pair(k, dtype)
    root = np.array([39, 17, 0])  # ragged, one row with a single valid token
    lse_t = lse_j = None
    if external_lse:
        ref_logits = np.einsum("bkgd,bskd->bkgs", q_t.float().numpy().reshape(b, hkv, hq // hkv, d),
                               k_t.float().numpy()) / np.sqrt(d)
        ref_logits = np.where(np.arange(s_len) <= root[:, None, None, None], ref_logits, -np.inf)
        m = ref_logits.max(-1, keepdims=True)
        lse = (m[..., 0] + np.log(np.exp(ref_logits - m).sum(-1))).reshape(b, hq)
        lse_t, lse_j = torch.as_tensor(lse, dtype=torch.float32), jnp.asarray(lse, jnp.float32)
    ref = chunk_scores_reference(q_j, lse_j, heads_first(k_j), jnp.asarray(root), chunk)
    for tile in (tb.ops.SCORE_TILE, 7):  # one tile, and many uneven ones
        close(tb.chunk_scores(q_t, lse_t, k_t, torch.as_tensor(root), chunk, tile=tile), ref)
    close(tb.head_sum_scores(q_t, lse_t, k_t, root, chunk),
          jax_head_sum_scores(q_j, lse_j, heads_first(k_j), jnp.asarray(root), chunk))


def paged_layout(rng, k: np.ndarray, root: np.ndarray, block: int, extra_blocks: int = 3):
    """Scatter a contiguous cache ``[B, S, Hkv, D]`` into a shuffled pool; blocks past each root are -1."""
    b, s_len = k.shape[:2]
    max_blocks = s_len // block
    num_blocks = b * max_blocks + extra_blocks
    pool = rng.standard_normal((num_blocks, block) + k.shape[2:]) * 30  # unused blocks: garbage
    table = np.full((b, max_blocks), -1, np.int64)
    ids = rng.permutation(num_blocks)
    for i in range(b):
        for j in range(max_blocks):
            if j <= root[i] // block:
                table[i, j] = ids[i * max_blocks + j]
                pool[table[i, j]] = k[i, j * block:(j + 1) * block]
    return pool, table


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("external_lse", [True, False])
def test_paged_chunk_scores_match_jax_on_the_described_cache(dtype, external_lse):
    rng = np.random.default_rng(2)
    b, hq, hkv, d, block, chunk = 4, 4, 4, 8, 4, 6  # chunk and block grids differ
    s_len = 40
    root = np.array([39, 5, 22, 13])
    k = rng.standard_normal((b, s_len, hkv, d))
    pool, table = paged_layout(rng, k, root, block)
    pool_t, _ = pair(pool, dtype)
    k_t, k_j = pair(k, dtype)
    q_t, q_j = pair(rng.standard_normal((b, hq, d)), dtype)
    lse_t = lse_j = None
    if external_lse:  # the exact LSE over 0..r, as a verify pass would return it
        logits = np.einsum("bkgd,bskd->bkgs", q_t.float().numpy().reshape(b, hkv, 1, d), k_t.float().numpy())
        logits = np.where(np.arange(s_len) <= root[:, None, None, None], logits / np.sqrt(d), -np.inf)
        m = logits.max(-1, keepdims=True)
        lse = (m[..., 0] + np.log(np.exp(logits - m).sum(-1))).reshape(b, hq)
        lse_t, lse_j = torch.as_tensor(lse, dtype=torch.float32), jnp.asarray(lse, jnp.float32)
    ref = chunk_scores_reference(q_j, lse_j, heads_first(k_j), jnp.asarray(root), chunk)
    for tile in (tb.ops.SCORE_TILE, 5):
        close(tb.paged_chunk_scores(q_t, lse_t, pool_t, torch.as_tensor(table), torch.as_tensor(root), chunk,
                                    tile=tile), ref)


def test_paged_scores_refuse_a_missing_block_under_the_root():
    pool = torch.zeros((4, 4, 1, 8))
    table = torch.tensor([[0, -1, 2]])
    with pytest.raises(tb.BridgeInputError, match=r"block_table\[0, 1\] = -1"):
        tb.paged_chunk_scores(torch.zeros((1, 2, 8)), None, pool, table, [6], 4)
    with pytest.raises(tb.BridgeInputError, match="root"):
        tb.paged_chunk_scores(torch.zeros((1, 2, 8)), None, pool, table, [12], 4)
    with pytest.raises(tb.BridgeInputError, match="query heads"):
        tb.chunk_scores(torch.zeros((1, 3, 8)), None, torch.zeros((1, 8, 2, 8)), [3], 4)


def test_salience_scores_and_chunk_sums_match_jax():
    rng = np.random.default_rng(3)
    b, nc, hkv, hq, d, chunk, t = 3, 6, 2, 4, 8, 4, 9
    sums_t, sums_j = pair(rng.standard_normal((b, nc, hkv, d)))
    k_t, k_j = pair(rng.standard_normal((b, t, hkv, d)))
    positions = rng.integers(0, nc * chunk + 6, (b, t))  # some past the last chunk: dropped
    valid = rng.random((b, t)) < 0.7
    close(tb.update_chunk_sums(sums_t, k_t, torch.as_tensor(positions), torch.as_tensor(valid), chunk),
          jax_update_chunk_sums(sums_j, k_j, jnp.asarray(positions), jnp.asarray(valid), chunk))
    q_t, q_j = pair(rng.standard_normal((b, hq, d)))
    root = np.array([23, 9, 0])
    ours = tb.salience_scores(q_t, sums_t, torch.as_tensor(root), chunk)
    ref = np.asarray(jax_salience(q_j, sums_j, jnp.asarray(root), chunk))
    assert np.array_equal(np.isinf(ours.numpy()), np.isinf(ref))
    np.testing.assert_allclose(np.where(np.isinf(ref), 0, ours.numpy()), np.where(np.isinf(ref), 0, ref),
                               atol=1e-5, rtol=1e-5)


# -------------------------------------------------------------------------------------------- selection
@pytest.mark.parametrize("keep_sink", [False, True])
def test_selection_matches_jax_with_ties(keep_sink):
    rng = np.random.default_rng(4)
    b, nc, chunk, max_chunks = 48, 24, 8, 6
    scores = rng.integers(0, 4, (b, nc)).astype(np.float32)  # many ties
    root = rng.integers(0, nc * chunk, b)
    ours = tb.select_chunks(torch.as_tensor(scores), torch.as_tensor(root), chunk, max_chunks, keep_sink)
    ref = jax_select(jnp.asarray(scores), jnp.asarray(root), chunk, max_chunks, keep_sink)
    assert ours.dtype == torch.int32
    np.testing.assert_array_equal(ours.numpy(), np.asarray(ref))


@pytest.mark.parametrize("keep_sink", [False, True])
def test_selection_with_redundancy_penalty_matches_jax(keep_sink):
    rng = np.random.default_rng(5)
    b, nc, chunk, max_chunks = 16, 12, 4, 5
    scores = rng.random((b, nc)).astype(np.float32)
    summaries = rng.standard_normal((b, nc, 2, 3)).astype(np.float32)
    summaries[:, 3] = summaries[:, 2]  # near-duplicates
    root = rng.integers(0, nc * chunk, b)
    ours = tb.select_chunks(torch.as_tensor(scores), torch.as_tensor(root), chunk, max_chunks, keep_sink, 0.7,
                            torch.as_tensor(summaries))
    ref = jax_select(jnp.asarray(scores), jnp.asarray(root), chunk, max_chunks, keep_sink, 0.7,
                     jnp.asarray(summaries))
    np.testing.assert_array_equal(ours.numpy(), np.asarray(ref))


def test_selection_golden_vector():
    """docs/method.md section 3.1: scores [.1, .9, .8, .7, .01], 18 tokens, C 4, Hb 12 -> chunks [1, 2] + newest 4."""
    scores = torch.tensor([[0.1, 0.9, 0.8, 0.7, 0.01]])
    assert tb.select_chunks(scores, [17], 4, 3, keep_sink=False).tolist() == [[1, 2]]
    assert tb.select_chunks(scores, [17], 4, 3, keep_sink=True).tolist() == [[0, 1]]


# ---------------------------------------------------------------------------------------------- history
def test_history_matches_jax_on_random_anchors():
    rng = np.random.default_rng(6)
    chunk, slots, b = 4, 20, 64
    root = rng.integers(0, 120, b)
    anchors = np.full((b, 4), -1, np.int64)
    for i in range(b):
        newest = root[i] // chunk
        picks = sorted(rng.choice(max(newest, 1), min(newest, int(rng.integers(0, 5))), replace=False).tolist())
        anchors[i, : len(picks)] = picks
    ours = tb.history_indices(torch.as_tensor(anchors), torch.as_tensor(root), chunk, slots)
    ref = jax_history(jnp.asarray(anchors, jnp.int32), jnp.asarray(root), chunk, slots)
    for o, r in zip(ours, ref):
        assert o.dtype == torch.int32
        np.testing.assert_array_equal(o.numpy(), np.asarray(r))
    ours = tb.history_indices(None, torch.as_tensor(root), chunk, slots)
    ref = jax_history(None, jnp.asarray(root), chunk, slots)
    for o, r in zip(ours, ref):
        np.testing.assert_array_equal(o.numpy(), np.asarray(r))


def test_history_golden_vector():
    """docs/method.md section 3.2: C 2, Hb 4, anchor chunk 0: r = 5 -> [0, 1, 3, 4]; r = 9 -> [0, 1, 7, 8]."""
    idx, n, w = tb.history_indices(torch.tensor([[0], [0]]), torch.tensor([5, 9]), 2, 4)
    assert idx.tolist() == [[0, 1, 3, 4], [0, 1, 7, 8]] and n.tolist() == [4, 4] and w.tolist() == [2, 2]


# --------------------------------------------------------------------------------- gather-RoPE-write, attention
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("interleaved, rotary", [(False, 16), (True, 16), (False, 8), (True, 4)])
def test_gather_rope_write_matches_jax(dtype, interleaved, rotary):
    rng = np.random.default_rng(7)
    b, s_len, hkv, d, w, n = 3, 50, 2, 16, 24, 14
    sk_t, sk_j = pair(rng.standard_normal((b, s_len, hkv, d)), dtype)
    sv_t, sv_j = pair(rng.standard_normal((b, s_len, hkv, d)), dtype)
    wk_t, wk_j = pair(rng.standard_normal((b, w, hkv, d)), dtype)
    wv_t, wv_j = pair(rng.standard_normal((b, w, hkv, d)), dtype)
    idx = np.full((b, n), -1, np.int64)  # ragged, -1 padded
    idx[0, :10] = [0, 1, 2, 3, 20, 21, 22, 23, 40, 41]
    idx[1] = np.arange(30, 30 + n)
    idx[2, :3] = [7, 8, 49]
    inv_freq = RopeConfig().inv_freq(rotary)
    cos_j, sin_j = jax_rope_cos_sin(jnp.arange(n), inv_freq)
    cos_t, sin_t = tb.rope_cos_sin(torch.arange(n), inv_freq)
    before = wk_t.clone()
    rk, rv = gather_rope_write_reference(sk_j, sv_j, wk_j, wv_j, jnp.asarray(idx, jnp.int32), cos_j, sin_j,
                                         interleaved=interleaved)
    ok, ov = tb.gather_rope_write(sk_t, sv_t, wk_t, wv_t, torch.as_tensor(idx), cos_t, sin_t, interleaved=interleaved)
    assert ok is wk_t and ov is wv_t  # written in place
    close(ok, rk, dtype)
    close(ov, rv, dtype)
    assert torch.equal(ok[:, n:], before[:, n:])  # rows past N untouched
    assert not ok[2, 3:n].any() and not ov[2, 3:n].any()  # -1 rows are zeros


def test_gather_rope_write_reads_store_rows_of_slots():
    rng = np.random.default_rng(8)
    store = torch.as_tensor(rng.standard_normal((5, 12, 1, 4)), dtype=torch.float32)
    work_k, work_v = torch.zeros((2, 6, 1, 4)), torch.zeros((2, 6, 1, 4))
    idx = torch.tensor([[1, 2, -1], [0, 5, 6]])
    cos, sin = tb.rope_cos_sin(torch.arange(3), RopeConfig().inv_freq(4))
    tb.gather_rope_write(store, store, work_k, work_v, idx, cos, sin, store_rows=torch.tensor([4, 1]))
    assert torch.equal(work_v[0, :2], store[4, 1:3]) and torch.equal(work_v[1, :3], store[1, [0, 5, 6]])
    assert torch.equal(work_k[0, 0], store[4, 1])  # local position 0: no rotation


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_draft_attention_matches_jax(dtype):
    rng = np.random.default_rng(9)
    b, t, hq, hkv, d, w = 3, 4, 8, 2, 16, 20
    q_t, q_j = pair(rng.standard_normal((b, t, hq, d)), dtype)
    k_t, k_j = pair(rng.standard_normal((b, w, hkv, d)), dtype)
    v_t, v_j = pair(rng.standard_normal((b, w, hkv, d)), dtype)
    local = np.array([[5, 6, 7, 8], [0, 1, 2, 3], [15, 16, 17, 19]])  # ragged n
    ours = tb.draft_attention(q_t, k_t, v_t, torch.as_tensor(local), scale=d ** -0.5)
    ref = draft_attention_reference(q_j, k_j, v_j, jnp.asarray(local), scale=d ** -0.5)
    assert ours.dtype == q_t.dtype
    close(ours, ref, dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ops_on_cuda_equal_cpu():
    rng = np.random.default_rng(10)
    q = torch.as_tensor(rng.standard_normal((2, 4, 8)), dtype=torch.float32)
    k = torch.as_tensor(rng.standard_normal((2, 40, 2, 8)), dtype=torch.float32)
    root = torch.tensor([39, 11])
    cpu = tb.chunk_scores(q, None, k, root, 4)
    gpu = tb.chunk_scores(q.cuda(), None, k.cuda(), root.cuda(), 4).cpu()
    torch.testing.assert_close(gpu, cpu, atol=1e-5, rtol=1e-4)
    sel = tb.select_chunks(cpu, root, 4, 4, False)
    assert torch.equal(tb.select_chunks(cpu.cuda(), root.cuda(), 4, 4, False).cpu(), sel)
    qa = torch.as_tensor(rng.standard_normal((2, 3, 4, 8)), dtype=torch.bfloat16)
    loc = torch.tensor([[5, 6, 7], [1, 2, 3]])
    out = tb.draft_attention(qa.cuda(), k[:, :10].bfloat16().cuda(), k[:, :10].bfloat16().cuda(), loc.cuda(),
                             scale=8 ** -0.5).cpu()
    torch.testing.assert_close(out.float(), tb.draft_attention(qa, k[:, :10].bfloat16(), k[:, :10].bfloat16(), loc,
                                                               scale=8 ** -0.5).float(), atol=2e-2, rtol=2e-2)


# ------------------------------------------------------------------------------------------------ runtime
def make_runtime(**spec_kw):
    kw = dict(draft_context_policy="diffspec", diffspec_chunk_size=4, diffspec_token_budget=32,
              num_speculative_tokens=3, diffspec_retrieval_interval=3)
    kw.update(spec_kw)
    spec = SpecConfig.from_flat(kw)  # Hb = floor((32 - 4) / 4) * 4 = 28, Nmax = 7
    return tb.DiffspecRuntime(spec, max_slots=3, max_len=96, num_kv_heads=2, head_dim=8,
                              rope=RopeConfig(theta=10000.0), dtype="float32", device="cpu")


def test_slots_are_stable_under_reorder_and_reused_lowest_first():
    rt = make_runtime()
    assert [rt.add_request(r) for r in ("a", "b", "c")] == [0, 1, 2]
    with pytest.raises(tb.SlotError, match="no free draft slot for request 'd': all 3 slots are in use"):
        rt.add_request("d")
    with pytest.raises(tb.SlotError, match="already registered"):
        rt.add_request("a")
    assert rt.cancel("b") == 1 and rt.finish("a") == 0
    with pytest.raises(tb.SlotError, match="unknown request id 'b'"):
        rt.finish("b")
    assert rt.add_request("e") == 0 and rt.add_request("f") == 1  # the lowest free slot first
    assert rt.requests == {"c": 2, "e": 0, "f": 1}
    assert rt.slots(["f", "c", "e"]).tolist() == [1, 2, 0]
    # K/V written in one batch order are read back per request in another
    rng = np.random.default_rng(11)
    k = torch.as_tensor(rng.standard_normal((3, 10, 2, 8)), dtype=torch.float32)
    pos = torch.arange(10).repeat(3, 1)
    rt.on_prefill(["c", "e", "f"], k, k * 2, pos)
    wc = rt.rebuild(["f", "c", "e"], [10, 10, 10])
    assert torch.equal(wc.v[0, :10], k[2] * 2) and torch.equal(wc.v[1, :10], k[0] * 2)
    assert torch.equal(wc.v[2, :10], k[1] * 2) and wc.n.tolist() == [10, 10, 10]
    with pytest.raises(tb.BridgeInputError, match="appears twice"):
        rt.rebuild(["f", "f"], [3, 3])


def test_release_clears_selection_and_counters():
    rt = make_runtime()
    rt.add_request("a")
    store_prompt(rt, ["a"], 60)
    q, keys = scoring_inputs(np.random.default_rng(12), 1)
    assert rt.on_prefill_done(["a"], [59], query=q, keys=keys) == [True]
    assert rt.retrieval_status()["per_request"]["a"]["retrievals"] == 1
    rt.finish("a")
    assert rt.add_request("b") == 0
    st = rt.retrieval_status()
    assert st["per_request"]["b"]["retrievals"] == 0 and st["per_request"]["b"]["anchor_chunks"] == []
    assert st["lifetime"]["retrievals"] == 1 and st["aggregate"]["retrievals"] == 0
    assert rt._anchors[0].tolist() == [-1] * 6


def store_prompt(rt, rids, length, seed=0):
    rng = np.random.default_rng(seed)
    k = torch.as_tensor(rng.standard_normal((len(rids), length, 2, 8)), dtype=torch.float32)
    v = torch.as_tensor(rng.standard_normal((len(rids), length, 2, 8)), dtype=torch.float32)
    rt.on_prefill(rids, k, v, torch.arange(length).repeat(len(rids), 1))
    return k, v


def scoring_inputs(rng, b, s_len=96, hq=4, hkv=2, d=8):
    q = torch.as_tensor(rng.standard_normal((b, hq, d)) * 3, dtype=torch.float32)
    keys = torch.as_tensor(rng.standard_normal((b, s_len, hkv, d)), dtype=torch.float32)
    return q, keys


def test_runtime_cadence_counters_and_selection_match_the_references():
    """Two requests (long and short prompt), 10 cycles: retrieval after prefill, then every 3 cycles per slot;
    the short one fits until its root passes Hb = 28; selections and working caches equal the JAX references."""
    rt = make_runtime()
    rng = np.random.default_rng(13)
    rt.add_request("long"), rt.add_request("short")
    rids = ["short", "long"]  # batch order differs from slot order
    store_prompt(rt, ["long"], 50, seed=1)
    store_prompt(rt, ["short"], 20, seed=2)
    roots = {"long": 49, "short": 19}
    q, keys = scoring_inputs(rng, 2)
    assert rt.on_prefill_done(rids, [roots[r] for r in rids], query=q, keys=keys) == [False, True]
    expected_anchor = np.asarray(jax_select(chunk_scores_reference(jnp.asarray(q.numpy()[1:]), None,
                                                                  heads_first(keys.numpy()[1:]), jnp.asarray([49]), 4),
                                            jnp.asarray([49]), 4, 7, False))
    assert rt._anchors[0].tolist() == expected_anchor[0].tolist()
    history = {"long": [], "short": []}
    for cycle in range(1, 11):
        wc = rt.rebuild(rids, [roots[r] for r in rids])
        for i, r in enumerate(rids):  # the working cache equals the JAX history + gather-RoPE-write
            anchors = jnp.asarray(rt._anchors[rt.slot_of(r)][None].numpy())
            idx, n, _ = jax_history(anchors, jnp.asarray([roots[r]]), 4, 28)
            cos, sin = jax_rope_cos_sin(jnp.arange(28), RopeConfig().inv_freq(8))
            s = rt.slot_of(r)
            ref_k, ref_v = gather_rope_write_reference(
                jnp.asarray(rt.store_k[s:s + 1].numpy()), jnp.asarray(rt.store_v[s:s + 1].numpy()),
                jnp.zeros((1, 32, 2, 8)), jnp.zeros((1, 32, 2, 8)), idx, cos, sin)
            close(wc.k[i:i + 1, :28], ref_k[:, :28])
            close(wc.v[i:i + 1, :28], ref_v[:, :28])
            assert int(wc.n[i]) == int(n[0]) == int(wc.root_slot[i])
        emitted = [int(e) for e in rng.integers(1, 5, 2)]
        new = {r: roots[r] + e for r, e in zip(rids, emitted)}
        k = torch.as_tensor(rng.standard_normal((2, 4, 2, 8)), dtype=torch.float32)
        pos = torch.tensor([[roots[r] + j if j < e else -1 for j in range(4)] for r, e in zip(rids, emitted)])
        q, keys = scoring_inputs(rng, 2)
        due = rt.on_verify(rids, [new[r] for r in rids], query=q, keys=keys, emitted=emitted)
        for i, r in enumerate(rids):
            history[r].append((cycle, new[r], due[i]))
            if due[i]:
                ref = jax_select(chunk_scores_reference(jnp.asarray(q.numpy()[i:i + 1]), None,
                                                        heads_first(keys.numpy()[i:i + 1]), jnp.asarray([new[r]]), 4),
                                 jnp.asarray([new[r]]), 4, 7, False)
                assert rt._anchors[rt.slot_of(r)].tolist() == np.asarray(ref)[0].tolist()
        roots = new
        rt.on_commit(rids, k, k, pos)  # the entries committed by this cycle: the previous root .. the new root - 1
    st = rt.retrieval_status()
    per = st["per_request"]
    # long: retrieved after prefill, then at cycles 3, 6, 9
    assert [c for c, _, d in history["long"] if d] == [3, 6, 9]
    assert per["long"]["retrievals"] == 4 and per["long"]["retrievals_after_prefill"] == 1
    # the rule, restated: due once `interval` cycles passed since the last retrieval, unless r <= Hb (fits)
    for r in rids:
        since, expected = 0, []
        for _, root, _ in history[r]:
            since += 1
            expected.append(since >= 3 and root > 28)
            since = 0 if expected[-1] else since
        assert [d for _, _, d in history[r]] == expected
    fits = [c for c, r, d in history["short"] if not d and c >= 3 and r <= 28]
    assert per["short"]["skipped_fits"] == len(fits) > 0 and per["short"]["retrievals_after_prefill"] == 0
    assert per["short"]["retrievals"] >= 1
    for p in list(per.values()) + [st["aggregate"], st["lifetime"]]:
        assert p["cycles"] == (p["retrievals"] - p["retrievals_after_prefill"]) + p["skipped_not_due"] + \
            p["skipped_fits"]
    assert per["long"]["cycles"] == 10 and per["long"]["interval"] == 3
    assert per["long"]["working_len"] == int(wc.n[1]) and per["long"]["selection_digest"]
    assert per["long"]["anchor_chunks"] == [a for a in rt._anchors[0].tolist() if a >= 0]
    assert st["aggregate"]["retrievals"] == per["long"]["retrievals"] + per["short"]["retrievals"]


def test_runtime_with_paged_keys_selects_like_contiguous():
    rng = np.random.default_rng(14)
    rts = [make_runtime(), make_runtime()]
    roots = np.array([70, 45])
    q, keys = scoring_inputs(rng, 2)
    pool, table = paged_layout(rng, keys.numpy(), roots, 8)
    for rt in rts:
        rt.add_request(0), rt.add_request(1)
        store_prompt(rt, [0, 1], 71)
    rts[0].on_prefill_done([0, 1], roots, query=q, keys=keys)
    rts[1].on_prefill_done([0, 1], roots, query=q,
                           keys=tb.PagedKeys(torch.as_tensor(pool, dtype=torch.float32), torch.as_tensor(table)))
    assert torch.equal(rts[0]._anchors, rts[1]._anchors)
    assert (rts[0]._anchors[:2] >= 0).sum() == 12


def test_runtime_sink_and_no_retrieval_after_prefill():
    rt = make_runtime(diffspec_keep_sink_chunk=True, diffspec_retrieve_after_prefill=False)
    rt.add_request("a")
    store_prompt(rt, ["a"], 60)
    q, keys = scoring_inputs(np.random.default_rng(15), 1)
    assert rt.on_prefill_done(["a"], [59], query=q, keys=keys) == [False]
    wc = rt.rebuild(["a"], [59])
    assert wc.history[0].tolist() == list(range(31, 59)) and int(wc.window[0]) == 28  # a sliding window
    due = [rt.on_verify(["a"], [59 + c], query=q, keys=keys)[0] for c in range(1, 4)]
    assert due == [False, False, True]
    p = rt.retrieval_status()["per_request"]["a"]
    assert p["skipped_prefill"] == 1 and p["sink_kept"] and p["anchor_chunks"][0] == 0
    assert p["cycles"] == 3 == p["retrievals"] + p["skipped_not_due"]


def test_runtime_salience_scorer_and_redundancy_penalty_run():
    rt = make_runtime(diffspec_scorer="salience", diffspec_redundancy_weight=0.5)
    rt.add_request("a")
    k, _ = store_prompt(rt, ["a"], 60)
    sums = torch.zeros((1, 24, 2, 8))
    expected = tb.update_chunk_sums(sums, k, torch.arange(60)[None], torch.ones((1, 60), dtype=torch.bool), 4)
    torch.testing.assert_close(rt._chunk_sum[:1], expected)
    store_prompt(rt, ["a"], 60)  # storing a position again does not count it twice
    torch.testing.assert_close(rt._chunk_sum[:1], expected)
    dq = torch.as_tensor(np.random.default_rng(16).standard_normal((1, 4, 8)), dtype=torch.float32)
    assert rt.on_prefill_done(["a"], [59], draft_query=dq) == [True]
    scores = tb.salience_scores(dq, expected, [59], 4)
    ref = tb.select_chunks(scores, [59], 4, 7, False, 0.5, expected)
    assert rt._anchors[0].tolist() == ref[0].tolist()


def test_runtime_adaptive_interval_doubles_on_stable_selections():
    rt = make_runtime(diffspec_adaptive_profile=True, diffspec_retrieval_interval=2)
    rt.add_request("a")
    store_prompt(rt, ["a"], 90)
    q, keys = scoring_inputs(np.random.default_rng(17), 1)
    rt.on_prefill_done(["a"], [59], query=q, keys=keys)
    due_cycles = []
    for c in range(1, 15):  # the root stays put so that every selection is the same (Jaccard 1)
        if rt.on_verify(["a"], [59], query=q, keys=keys, emitted=[2])[0]:
            due_cycles.append(c)
    assert due_cycles == [2, 4, 8]  # interval 2, 2, then 4 (stable), then 8 from cycle 8
    assert rt.retrieval_status()["per_request"]["a"]["interval"] == 8
    with pytest.raises(tb.BridgeInputError, match="needs emitted"):
        rt.on_verify(["a"], [80], query=q, keys=keys)


def test_runtime_errors_name_the_problem():
    rt = make_runtime()
    rt.add_request("a")
    k = torch.zeros((1, 4, 2, 8))
    with pytest.raises(tb.BridgeInputError, match="beyond the store capacity max_len=96"):
        rt.on_prefill(["a"], k, k, torch.tensor([[94, 95, 96, 97]]))
    with pytest.raises(tb.BridgeInputError, match=r"k must be a tensor \[B, T, Hkv, D\]"):
        rt.on_prefill(["a"], torch.zeros((1, 4, 3, 8)), k, torch.arange(4)[None])
    with pytest.raises(tb.BridgeInputError, match=r"positions must be \[B, T\]"):
        rt.on_prefill(["a"], k, k, torch.arange(5)[None])
    with pytest.raises(tb.SlotError, match="unknown request id 'zz'"):
        rt.on_commit(["zz"], k, k, torch.arange(4)[None])
    rt.on_prefill(["a"], k, k, torch.arange(4)[None])
    with pytest.raises(tb.BridgeInputError, match="stored only up to 3"):
        rt.rebuild(["a"], [40])
    with pytest.raises(tb.BridgeInputError, match="outside the store capacity"):
        rt.rebuild(["a"], [96])
    with pytest.raises(tb.BridgeInputError, match="root must be 1 integers"):
        rt.on_verify(["a"], [3, 4])
    assert rt.on_verify(["a"], [3]) == [False]  # not due: no scoring inputs needed
    store_prompt(rt, ["a"], 60)
    with pytest.raises(tb.BridgeInputError, match="due for retrieval but query"):
        rt.on_prefill_done(["a"], [59])
    with pytest.raises(tb.BridgeInputError, match=r"query must be \[B, Hq, D\]"):
        rt.on_prefill_done(["a"], [59], query=torch.zeros((2, 4, 8)), keys=torch.zeros((1, 96, 2, 8)))
    with pytest.raises(tb.BridgeError, match="implements draft_context_policy='diffspec'"):
        tb.DiffspecRuntime(SpecConfig(), max_slots=1, max_len=8, num_kv_heads=1, head_dim=8, device="cpu")
    assert issubclass(tb.BridgeInputError, ValueError) and issubclass(tb.SlotError, ValueError)


def test_rotate_matches_the_working_cache_rope():
    rt = make_runtime()
    x = torch.as_tensor(np.random.default_rng(18).standard_normal((2, 3, 2, 8)), dtype=torch.float32)
    pos = torch.tensor([[4, 5, 6], [0, 1, 2]])
    cos, sin = jax_rope_cos_sin(jnp.asarray(pos.numpy()), RopeConfig().inv_freq(8))
    close(rt.rotate(x, pos), jax_apply_rope(jnp.asarray(x.numpy()), cos, sin))


# ------------------------------------------------------------------------------------------- devices
def fake_npu(monkeypatch, available=True, count=1):
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: available,
                                                            device_count=lambda: count), raising=False)


def test_device_selection_prefers_a_present_npu(monkeypatch):
    fake_npu(monkeypatch)
    assert tb.npu_available() and tb.device_type() == "npu"
    fake_npu(monkeypatch, available=True, count=0)
    assert tb.device_type() == ("cuda" if torch.cuda.is_available() else "cpu")
    fake_npu(monkeypatch, available=False)
    assert not tb.npu_available()
    with pytest.raises(tb.BridgeError, match="torch_npu is not importable or reports no Ascend device"):
        tb.select_device("npu")


def test_device_selection_without_torch_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu -> ImportError
    assert not tb.npu_available()
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert tb.device_type() == expected and tb.select_device().type == expected
    assert tb.select_device("cpu") == torch.device("cpu")
    with pytest.raises(tb.BridgeError, match="not supported"):
        tb.select_device("tpu")


def test_select_device_returns_an_npu_device_when_torch_npu_registers_it():
    """In a subprocess (the backend rename is process-wide): a fake torch_npu that registers 'npu' as torch_npu
    does; select_device() must give npu:0."""
    code = ("import sys, types, torch\n"
            "torch.utils.rename_privateuse1_backend('npu')\n"
            "sys.modules['torch_npu'] = types.ModuleType('torch_npu')\n"
            "torch.npu = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 2)\n"
            "from diffspec_jax.torch_bridge import select_device\n"
            "assert select_device() == torch.device('npu', 0), select_device()\n"
            "assert select_device('npu:1') == torch.device('npu', 1)\n"
            "assert 'jax' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_resolve_dtype():
    assert tb.resolve_dtype("bf16") is torch.bfloat16 and tb.resolve_dtype("float16") is torch.float16
    assert tb.resolve_dtype(torch.float32) is torch.float32 and tb.resolve_dtype("torch.bfloat16") is torch.bfloat16
    with pytest.raises(tb.BridgeInputError, match="not supported"):
        tb.resolve_dtype("int8")


# ------------------------------------------------------------------------------------------------ DLPack
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dlpack_round_trip_on_cpu_shares_memory(dtype):
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(dtype)
    a = tb.to_jax(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr() and a.shape == (3, 4)
    t[0, 0] = 42  # an in-place write is visible on the JAX side: no copy was made
    assert float(a[0, 0]) == 42
    back = tb.from_jax(a)
    assert back.data_ptr() == t.data_ptr() and back.dtype == dtype
    j = jnp.arange(6, dtype=jnp.float32)
    tj = tb.from_jax(j)
    assert tj.data_ptr() == j.unsafe_buffer_pointer() and tj.tolist() == list(range(6))
    with pytest.raises(tb.BridgeInputError, match="requires grad"):
        tb.to_jax(torch.zeros(2, requires_grad=True))
