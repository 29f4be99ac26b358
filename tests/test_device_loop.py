"""The device-resident decode loop: one host read per block (not per cycle), streaming per block, tree cycles in
blocks, the device's retrieval cadence deciding exactly what the torch bridge's host cadence decides, the host
reading a block's record, capacity buckets, compile time reported apart, and the persistent compilation cache."""

import collections
import math
import os
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_prompts
from diffspec_jax import SamplingConfig, SpecConfig, engine, generate
from diffspec_jax.errors import ConfigError
from diffspec_jax.engine.controllers import ShapeControl
from diffspec_jax.engine.drafter import DRAFTERS
from diffspec_jax.retrieval_control import RetrievalBook, RetrievalControl
from diffspec_jax.utils import CompileCounter

LENGTHS = (23, 61, 40)  # test_engine's prompts and lengths: the programs compiled here are shared with it
NEW = 40


@pytest.fixture(autouse=True)
def _no_persistent_cache(monkeypatch):
    monkeypatch.setenv(engine.COMPILATION_CACHE_ENV, "0")


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(5, LENGTHS)


def _counting_reads(monkeypatch) -> list:
    reads = []
    real = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda x: (reads.append(1), real(x))[1])
    return reads


def test_host_reads_results_once_per_block(targets, drafts, prompts, monkeypatch):
    """Target-only and speculative decoding read the device once per block of cycles (plus the first token), and
    dispatch exactly one block ahead of the one they read; streaming is fed once per block."""
    results = {}
    for name, draft, kw in (("target", None, {}), ("target5", None, dict(block_cycles=5)),
                            ("spec", drafts["llama"], dict(spec=SpecConfig(num_speculative_tokens=3)))):
        reads = _counting_reads(monkeypatch)
        streamed, calls = collections.defaultdict(list), collections.Counter()

        def on_tokens(i, toks):
            streamed[i].extend(toks)
            calls[i] += 1

        res = generate(targets["llama"], draft, prompts, max_new_tokens=NEW, stop_token_ids=(), on_tokens=on_tokens,
                       **kw)
        s = res.stats
        c = kw.get("block_cycles", engine.DEFAULT_BLOCK_CYCLES)
        assert s.block_cycles == c and s.cycles > c and s.cache_capacity == 256
        assert len(reads) == math.ceil(s.cycles / c)  # every block read but the last ran its c cycles
        assert s.blocks == len(reads) + 1  # the one dispatched ahead found every sequence done
        assert s.host_syncs == 1 + len(reads)
        assert [streamed[i] for i in range(len(prompts))] == res.tokens
        assert all(calls[i] <= 1 + len(reads) for i in range(len(prompts)))
        results[name] = res
    assert results["target5"].tokens == results["target"].tokens == results["spec"].tokens
    t, t5 = results["target"].stats, results["target5"].stats
    assert (t5.cycles, t5.sequence_cycles, t5.new_tokens) == (t.cycles, t.sequence_cycles, t.new_tokens)
    assert results["spec"].stats.drafted_tokens == 3 * results["spec"].stats.sequence_cycles


def test_times_exclude_compilation_and_nearby_prompts_compile_nothing(targets):
    kw = dict(max_new_tokens=12, stop_token_ids=(), max_cache_len=512, block_cycles=4)
    first = generate(targets["llama"], None, random_prompts(3, (40, 33)), **kw)  # a fresh plan: compiles
    assert first.stats.compile_s > 0
    with CompileCounter() as counter:  # other lengths, same prefill width and capacity: every program reused
        again = generate(targets["llama"], None, random_prompts(4, (50, 35)), **kw)
    s = again.stats
    assert counter.count == 0 and s.compile_s == 0.0
    assert 0 < s.ttft_s and 0 < s.prefill_s and 0 < s.decode_s and s.decode_tokens_per_s > 0
    assert s.ttft_s <= s.prefill_s + 1.0  # from the call: validation and set-up on top of the prefill's share


def test_tree_cycles_run_in_blocks(targets, drafts):
    """Static branching: many tree cycles per block; hazard branching (the default) changes the tree every cycle
    from the host, so it runs one cycle per block with no block ahead, as before the device loop."""
    prompts = random_prompts(12, (37, 70))  # test_tree's prompts and settings: its programs are shared
    tree = dict(num_speculative_tokens=3, diffspec_verification_mode="tree", diffspec_max_tree_nodes=12,
                diffspec_tree_topk=3)
    base = generate(targets["llama"], None, prompts, max_new_tokens=24, stop_token_ids=()).tokens
    small = dict(num_speculative_tokens=2, diffspec_verification_mode="tree", diffspec_max_tree_nodes=4,
                 diffspec_tree_topk=2, diffspec_tree_branching="full")  # a small tree compiles faster
    full = generate(targets["llama"], drafts["llama"], prompts, max_new_tokens=24, stop_token_ids=(),
                    spec=SpecConfig.from_flat(small))
    assert full.tokens == base
    s = full.stats
    assert s.block_cycles == engine.DEFAULT_BLOCK_CYCLES and s.blocks == math.ceil(s.cycles / s.block_cycles) + 1
    assert s.cycles > s.block_cycles and s.mean_tree_size == 4 and sum(s.accepted_depth_histogram) == s.sequence_cycles
    snap = s.drafting["per_sequence"][0]["branching"]
    assert snap["caps"] == [2, 2] and snap["updates"] > s.block_cycles  # every cycle was replayed
    hazard = generate(targets["llama"], drafts["llama"], prompts, max_new_tokens=24, stop_token_ids=(),
                      spec=SpecConfig.from_flat(dict(draft_context_policy="full", **tree)))
    h = hazard.stats
    assert hazard.tokens == base and h.block_cycles == 1 and h.blocks == h.cycles and h.host_syncs == 1 + h.cycles


# ------------------------------------------------------------------------- on-device controller mirrors
CHUNK = 16
CADENCE_SPEC = SpecConfig.from_flat(dict(draft_context_policy="diffspec", diffspec_chunk_size=CHUNK, diffspec_token_budget=96,
                                         num_speculative_tokens=3, diffspec_retrieval_interval=2, diffspec_adaptive_profile=True))


def _as_cadence(ctl: RetrievalControl, num_chunks: int) -> dict[str, np.ndarray]:
    """The host cadence's state of every sequence as the fields of a :class:`Cadence`."""
    col = lambda f: np.array([int(f(c)) for c in ctl.c], np.int32)  # noqa: E731
    selected = np.zeros((len(ctl.c), num_chunks), bool)
    for r, c in enumerate(ctl.c):
        selected[r, list(c._selected or ())] = True
    return dict(since=col(lambda c: c._since), interval=col(lambda c: c.interval),
                accept_sum=col(lambda c: c._accept_sum), accept_n=col(lambda c: c._accept_n),
                prev_sum=col(lambda c: c._prev_sum), prev_n=col(lambda c: c._prev_n), selected=selected)


@pytest.mark.parametrize("seed", range(3))
def test_device_cadence_decides_what_retrieval_control_decides(seed):
    """Random streams of cycles (rows idle at times, acceptance in steady stretches with drops, selections mostly
    stable with changes): every due decision, interval and counter of the device's cadence (the JAX engine's)
    equals the torch bridge's host cadence (RetrievalControl), and the adaptive interval both doubles and resets
    along the way."""
    spec, b, nc = CADENCE_SPEC, 4, 128
    hb, a = spec.history_budget, spec.max_chunks - 1  # 80, 4
    plan = SimpleNamespace(spec=spec)
    rng = np.random.default_rng(seed)
    ctl = RetrievalControl(spec, b)
    root = rng.integers(60, 200, b)  # grows to at most 200 + 300 x 4 < nc x CHUNK
    stable = [np.sort(rng.choice(int(r) // CHUNK, a, replace=False)) for r in root]
    for i in range(b):  # the retrieval after prefill, for the rows whose context does not fit
        if root[i] > hb:
            ctl.record(i, stable[i], int(root[i]), 1.0, after_prefill=True)
    cad = engine.Cadence(**{k: jnp.asarray(v) for k, v in _as_cadence(ctl, nc).items()})

    @jax.jit
    def step(cad, active, m, root, anchors):
        cad, due = engine.cadence_due(plan, cad, active, m, root)
        return engine.cadence_record(plan, cad, due, jnp.where(due[:, None], anchors, -1), root), due

    intervals = set()
    accept = rng.integers(0, 4, b)
    for _ in range(300):
        active = rng.random(b) < 0.9
        accept = np.where(rng.random(b) < 0.1, rng.integers(0, 4, b), accept)  # steady stretches, sudden changes
        m = np.where(rng.random(b) < 0.8, accept, rng.integers(0, 4, b))
        root = root + np.where(active, m + 1, 0)
        anchors = np.full((b, a), -1, np.int32)
        for i in range(b):
            newest = int(root[i]) // CHUNK
            if rng.random() < 0.15:
                stable[i] = np.sort(rng.choice(newest, min(a, newest), replace=False))
            anchors[i, : len(stable[i])] = stable[i]
        cad, due = step(cad, jnp.asarray(active), jnp.asarray(m, jnp.int32), jnp.asarray(root, jnp.int32),
                        jnp.asarray(anchors))
        for i in np.nonzero(active)[0]:
            ctl.observe(int(i), emitted=int(m[i]) + 1)
            assert ctl.due(int(i), int(root[i])) == bool(due[i])
            if due[i]:
                ctl.record(int(i), anchors[i], int(root[i]), 1.0, after_prefill=False)
        mirror = _as_cadence(ctl, nc)
        for k, v in mirror.items():
            np.testing.assert_array_equal(np.asarray(getattr(cad, k)), v, err_msg=k)
        intervals.update(int(x) for x in mirror["interval"])
    assert {2, 4} <= intervals  # grown and reset


# ------------------------------------------------------------------------------ shapes and compile cache
def test_capacity_buckets():
    cb = engine.capacity_bucket
    needs = (1, 256, 257, 600, 1025, 1300, 2049, 2600, 5000, 65536 + 1024 + 6)
    assert [cb(n) for n in needs] == [256, 256, 512, 768, 1280, 1536, 2560, 3072, 5120, 81920]
    assert cb(3000) == cb(3050) == 3072  # nearby prompt lengths share the capacity, hence the programs
    assert cb(4500, limit=4700) == 4864  # never more than the context window and the verify block can use
    assert cb(4500, limit=4000) == 4608  # ... unless the need itself is more
    for n in range(1, 20000, 97):
        c = cb(n)
        assert c >= n and c % 256 == 0 and c <= max(256, 1.25 * n + 256)


def test_replay_books_what_the_record_says(targets):
    """The host reads a block's record (two rows, three cycles, row 1 idle in the second): committed lengths, the
    retrieval counters (a retrieval, a skip before the interval, a skip because the context fits, the interval and
    anchors as recorded, the call's time split over the rows retrieving together) and the adaptive depth's
    report."""
    spec = SpecConfig.from_flat(dict(draft_context_policy="diffspec", num_speculative_tokens=3,
                                     diffspec_adaptive_profile=True))
    plan = engine.make_plan(targets["llama"], None, spec, SamplingConfig(), 1024, drafter=DRAFTERS[engine.SELF])
    c, b, a = 3, 2, spec.max_chunks - 1
    i32 = lambda *rows: np.array(rows, np.int32)  # noqa: E731
    anchors = np.full((1, c, b, a), -1, np.int32)
    anchors[0, 0, :, :2] = [[1, 2], [0, 3]]
    rec = engine.CycleRecord(live=np.array([[1, 1], [1, 0], [1, 1]], bool), m=i32([2, 0], [3, 0], [1, 2]),
                             n=i32([9, 9], [8, 0], [7, 7]), window=i32([5, 5], [4, 0], [3, 3]),
                             due=np.array([[1, 1], [0, 0], [0, 0]], bool), since=i32([0, 0], [1, 0], [2, 1]),
                             interval=i32([8, 4], [8, 4], [2, 4]), anchors=anchors,
                             depth=i32([3, 3], [2, 3], [2, 2]), floor=i32([3, 3], [2, 3], [2, 2]))
    book, shape = RetrievalBook(spec, 4), ShapeControl(plan, 4)
    for seq in range(4):
        shape.reset(seq, (3, 3))  # the start depth and floor
    host_len, rows = np.array([0, 0, 100, 200], np.int64), np.array([2, 3])  # batch rows 0, 1 are sequences 2, 3
    engine.replay(rec, 3, rows, host_len, shape, book, 10.0)
    assert host_len.tolist() == [0, 0, 100 + 3 + 4 + 2, 200 + 1 + 3]
    s2, s3 = book.c[2], book.c[3]
    assert (s2.cycles, s2.retrievals, s2.skipped_not_due, s2.skipped_fits) == (3, 1, 1, 1)
    assert (s3.cycles, s3.retrievals, s3.skipped_not_due, s3.skipped_fits) == (2, 1, 1, 0)
    assert (s2.interval, s3.interval, s2.working_len, s2.window_tokens) == (2, 4, 7, 3)
    assert s2.anchor_chunks == [1, 2] and s3.anchor_chunks == [0, 3] and s3.sink_kept and not s2.sink_kept
    assert s2.retrieval_ms == s3.retrieval_ms == 5.0  # one call, split over the two rows it served
    assert shape.report(4)["per_sequence"] == [{"depth": 3, "floor": 3}] * 2 + [{"depth": 2, "floor": 2}] * 2


def test_stop_ids_are_padded_to_a_static_size():
    assert engine.stop_ids({7, 3}).tolist() == [3, 7] + [-1] * 6
    assert engine.stop_ids(set()).tolist() == [-1] * 8
    assert engine.stop_ids(set(range(9))).shape == (16,)


def test_block_cycles_must_be_a_positive_integer(targets):
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ConfigError, match="block_cycles must be an integer >= 1"):
            generate(targets["llama"], None, [[1, 2]], max_new_tokens=2, block_cycles=bad)


def test_compilation_cache_setting(monkeypatch):
    setting = engine.compilation_cache_setting
    for off in ("0", "off", "false", "no", " 0 "):
        assert setting({engine.COMPILATION_CACHE_ENV: off}) is None
    assert setting({engine.COMPILATION_CACHE_ENV: "/x/y"}) == "/x/y"
    assert setting({"XDG_CACHE_HOME": "/c"}) == "/c/diffspec_jax/jax_cache"
    monkeypatch.setenv("HOME", "/home/someone")
    assert setting({}) == "/home/someone/.cache/diffspec_jax/jax_cache"


def _user_configured_jax_cache() -> bool:
    return bool(os.environ.get("JAX_COMPILATION_CACHE_DIR")) or engine.compile._jax_cache_config_before().dir is not None


def test_persistent_compilation_cache_is_switched_on_by_generate(targets, tmp_path, monkeypatch):
    if _user_configured_jax_cache():
        pytest.skip("JAX's own cache directory is configured for this run")
    cache = tmp_path / "jax_cache"
    monkeypatch.setenv(engine.COMPILATION_CACHE_ENV, str(cache))
    try:
        res = generate(targets["llama"], None, [[1, 2, 3]], max_new_tokens=4, stop_token_ids=(), block_cycles=3,
                       max_cache_len=768)  # programs of a new shape: compiled, and written to the cache
        assert jax.config.jax_compilation_cache_dir == str(cache)
        assert res.stats.compile_s > 0 and any(cache.iterdir())
    finally:
        monkeypatch.setenv(engine.COMPILATION_CACHE_ENV, "0")
        assert engine.enable_compilation_cache() is None  # switched off again, as a 0 asks
    assert jax.config.jax_compilation_cache_dir is None


def test_a_cache_directory_configured_for_jax_is_left_alone(tmp_path, monkeypatch):
    if _user_configured_jax_cache():
        pytest.skip("JAX's own cache directory is configured for this run")
    from jax.experimental.compilation_cache import compilation_cache as cc

    monkeypatch.setenv(engine.COMPILATION_CACHE_ENV, str(tmp_path / "ours"))
    try:
        for before_first_call in (True, False):  # configured before the first generate() or after ours applied
            engine.compile._jax_cache_config_before.cache_clear()
            if not before_first_call:
                assert engine.enable_compilation_cache() == str(tmp_path / "ours")
            jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
            assert engine.enable_compilation_cache() == str(tmp_path / "mine")
            assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
            jax.config.update("jax_compilation_cache_dir", None)
    finally:
        jax.config.update("jax_compilation_cache_dir", None)
        engine.compile._jax_cache_config_before.cache_clear()
        cc.reset_cache()
        assert not (tmp_path / "mine").exists() and not (tmp_path / "ours").exists()  # nothing was compiled
