"""The server's slot engine on the tensor-parallel mesh (issue 41, item 1; 4 virtual CPU devices, set in conftest):
with tp 4 (the draft sharded like the target) and tp 2 with a replicated draft, 8 concurrent greedy requests over
the paged pool with prefix caching return exactly what generate() returns for each alone, as tp 1 does; nothing
compiles after warm-up; every rank holds the same retrieval selections."""

import queue

import jax
import numpy as np
import pytest

from conftest import random_prompts
from diffspec_jax.config import SpecConfig
from diffspec_jax.errors import ConfigError

SPEC = dict(num_speculative_tokens=3, draft_context_policy="diffspec", diffspec_chunk_size=8, diffspec_token_budget=40)
MAX_LEN, PAGE, CHUNK = 160, 16, 64
#: (tensor_parallel_size, draft_tensor_parallel_size)
MESHES = {"tp1": (1, None), "tp4": (4, None), "tp2-draft-tp1": (2, 1)}
#: a document that three requests start with (four full pages of it are reused from the prefix cache)
DOC = random_prompts(41, (70,))[0]
PROMPTS = [DOC + p for p in random_prompts(42, (5, 20, 40))] + random_prompts(43, (9, 33, 61, 90, 120))
NEW = [12, 20, 7, 16, 24, 10, 18, 14]


def _spec(draft_tp=None) -> SpecConfig:
    return SpecConfig.from_flat(dict(SPEC, draft_tensor_parallel_size=draft_tp))


@pytest.fixture(scope="module")
def alone(targets, drafts):
    """generate() alone on each request (one device; one cache capacity, so one set of programs), and on the
    document by itself (the request that fills the prefix cache first)."""
    import diffspec_jax as dj

    return [dj.generate(targets["llama"], drafts["llama"], [p], max_new_tokens=n, spec=_spec(), stop_token_ids=(),
                        max_cache_len=256).tokens[0] for p, n in zip([DOC] + PROMPTS, [8] + NEW)]


def _engine(targets, drafts, tp, draft_tp, **kw):
    from diffspec_jax.serving.scheduler import EngineConfig, SlotEngine

    return SlotEngine(targets["llama"], drafts["llama"], _spec(draft_tp),
                      EngineConfig(max_num_seqs=8, max_model_len=MAX_LEN, block_size=PAGE, prefill_chunk=CHUNK,
                                   tensor_parallel_size=tp, **kw), eos_token_ids=())


def _answers(engine, asks, timeout=120.0):
    """Submit the ``(prompt, max_tokens)`` requests together (greedy) and wait for every one to finish."""
    from diffspec_jax.serving.scheduler import Request, SamplingParams

    finished = queue.Queue()
    reqs = [Request(p, SamplingParams(max_tokens=n, ignore_eos=True),
                    lambda e: finished.put(e.kind) if e.kind in ("finish", "error") else None) for p, n in asks]
    for r in reqs:
        engine.submit(r)
    kinds = [finished.get(timeout=timeout) for _ in reqs]
    assert kinds == ["finish"] * len(reqs)
    return reqs


def _ranks_agree(tree) -> int:
    """Assert that every leaf laid out whole on every device holds the same values on each (each device computed
    its copy itself); returns how many such leaves were compared across more than one device."""
    n = 0
    for x in jax.tree_util.tree_leaves(tree):
        if isinstance(x, jax.Array) and x.sharding.is_fully_replicated and len(x.addressable_shards) > 1:
            first = np.asarray(x.addressable_shards[0].data)
            for s in x.addressable_shards[1:]:
                np.testing.assert_array_equal(np.asarray(s.data), first)
            n += 1
    return n


@pytest.mark.parametrize("mesh", MESHES)
def test_server_engine_on_a_mesh_returns_generate_alone(mesh, targets, drafts, alone):
    """One engine per mesh: a request with the document, then 8 concurrent greedy requests (three of them continue
    the document: its full pages come from the prefix cache). Every answer is generate()'s alone, which tp 1 also
    returns; nothing compiles after warm-up; the ranks' retrieval selections (the per-rank anchors the host reads,
    and every replicated leaf of the state on each device: anchors, chosen chunks, a replicated draft's working
    cache) are identical."""
    tp, draft_tp = MESHES[mesh]
    engine = _engine(targets, drafts, tp, draft_tp)
    assert engine.plan.tp == tp and engine.plan.draft_tp == (draft_tp or tp)
    engine.start()
    try:
        lead = _answers(engine, [(DOC, 8)])[0]
        reqs = _answers(engine, list(zip(PROMPTS, NEW)))
        assert [lead.tokens] + [r.tokens for r in reqs] == alone
        assert [r.cached_tokens for r in reqs[:3]] == [len(DOC) // PAGE * PAGE] * 3
        m = engine.metrics()
        assert m["compiles_after_warmup"] == 0 and m["xla_compiles_after_warmup"] == 0
        assert m["total_retrievals"] > 0 and m.get("total_retrieval_rank_mismatches", 0) == 0
        anchors = engine._state.retrieval.anchors
        assert (np.asarray(anchors) >= 0).sum() > 0  # the selections compared below are real ones
        replicated = _ranks_agree((engine._state, engine._loop))
        if tp > 1:
            assert len(anchors.addressable_shards) == tp and replicated > 10
            if draft_tp == 1:  # the replicated draft's working cache, built from each rank's own selection
                assert engine._state.draft_cache.work_k.sharding.is_fully_replicated
    finally:
        engine.stop()


def test_pool_pages_are_sized_per_device(targets, drafts):
    """A page's bytes on each device: the target's KV heads of that device (2 KV heads: halved at tp 2, and at tp 4
    each repeated once, so still one per device) and the draft's store, whole when replicated."""
    tc, dc = targets["llama"].config, drafts["llama"].config
    it = 4  # float32

    def expected(kv_local, dkv_local):
        return PAGE * 2 * it * (tc.num_hidden_layers * kv_local * tc.head_dim + dkv_local * dc.head_dim)

    from diffspec_jax.sharding import kv_heads_for

    for tp, draft_tp in MESHES.values():
        engine = _engine(targets, drafts, tp, draft_tp)
        dtp = draft_tp or tp
        assert engine.page_bytes == expected(kv_heads_for(tc.num_key_value_heads, tp, "t") // tp,
                                             kv_heads_for(dc.num_key_value_heads, dtp, "d") // dtp)


def test_bad_parallel_settings_are_named_errors(targets, drafts):
    from diffspec_jax.serving.scheduler import EngineConfig

    with pytest.raises(ConfigError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="needs 8 devices, only 4 are visible"):
        _engine(targets, drafts, 8, None)
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\) is not divisible by tp=3"):
        _engine(targets, drafts, 3, None)
    with pytest.raises(ConfigError, match="draft_tensor_parallel_size must be 1 .* tp=4, got 2"):
        _engine(targets, drafts, 4, 2)


@pytest.mark.parametrize("argv, words", [
    (["--tp", "0"], "--tp must be a positive integer"),
    (["--tp", "2", "--draft-tp", "4"], "--draft-tp must be 1 (a replicated draft) or equal to --tp"),
])
def test_serve_cli_refuses_bad_tp_in_one_line(argv, words, capsys):
    from diffspec_jax import serve

    assert serve.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1, err
