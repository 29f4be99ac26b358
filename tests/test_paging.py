"""The host-side page manager (diffspec_jax/paging.py): page tables, the prefix cache's hash chain, LRU eviction,
all-or-nothing failures; and a stateful property test that simulates the device's writes (including rejected
draft rows) and checks that every cache hit serves pages holding exactly the request's prefix. NumPy only, fast."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from diffspec_jax.errors import DiffspecError
from diffspec_jax.paging import OutOfPages, PageManager, PagingError, chain_hashes, namespace_root


def committed(m: PageManager, seq_id, tokens, computed=None, reserve=0):
    """Admit ``tokens``, commit ``computed`` (default all) of them; returns the admission."""
    adm = m.admit(seq_id, tokens, reserve=reserve)
    m.commit(seq_id, tokens, len(tokens) if computed is None else computed)
    return adm


def snapshot(m: PageManager) -> tuple:
    """Everything a failed call must leave unchanged (private fields included: the LRU order, the free list)."""
    seqs = sorted(m._seqs, key=repr)
    return (m.stats, [(s, m.page_table(s), m.writable_from(s), m._seqs[s].computed) for s in seqs],
            list(m._free), list(m._evictable), dict(m._page_of))


def test_only_full_committed_pages_are_hit():
    m = PageManager(16, 4)
    doc = list(range(10))
    committed(m, "a", doc)  # pages [0:4], [4:8] full; [8:10] partial
    assert m.stats.registered == 2 and m.writable_from("a") == 8
    assert m.cached_prefix(doc + [50, 51, 52]) == 8
    assert m.cached_prefix(doc[:6] + [99] * 7) == 4  # the second page differs
    assert m.cached_prefix([99] + doc[1:] + [1]) == 0  # the chain breaks at the first page
    adm = m.admit("b", doc + [50, 51, 52])
    assert adm.cached_tokens == 8 and adm.pages[:2] == m.page_table("a")[:2]
    assert len(adm.pages) == m.pages_for(13) and set(adm.pages[2:]).isdisjoint(m.page_table("a"))
    assert m.writable_from("b") == 8
    assert (m.stats.prefix_queries, m.stats.prefix_hits) == (10 + 13, 8)
    m.check()


def test_at_least_one_prompt_token_is_left_to_compute():
    m = PageManager(16, 4)
    committed(m, "a", list(range(8)))  # two full pages
    assert m.cached_prefix(list(range(8))) == 4  # all 8 cached, but the last token's logits are needed
    assert m.cached_prefix(list(range(9))) == 8
    assert m.admit("b", list(range(8))).cached_tokens == 4
    assert m.cached_prefix([0]) == 0


def test_namespaces_never_share_keys():
    data = memoryview(np.arange(8, dtype="<i4")).cast("B")
    keys = {ns: list(chain_hashes(data, 4, 0, 2, namespace_root(ns))) for ns in ("llama-bf16", "llama-f32", "")}
    flat = [k for ks in keys.values() for k in ks]
    assert len(set(flat)) == len(flat)
    a, b = PageManager(8, 4, namespace="llama-bf16"), PageManager(8, 4, namespace="llama-f32")
    committed(a, 0, list(range(9)))
    committed(b, 0, list(range(9)))
    assert a._page_of.keys().isdisjoint(b._page_of.keys()) and len(a._page_of) == 2


def test_eviction_is_lru_tail_first_and_evicted_pages_are_not_hit():
    m = PageManager(4, 2)
    committed(m, "a", [1, 2, 3, 4, 5])  # pages 0, 1 registered, page 2 partial
    m.free("a")
    assert (m.stats.evictable, m.stats.free) == (2, 2)
    assert m.cached_prefix([1, 2, 3, 4, 9]) == 4
    m.admit("b", [7] * 5)  # 3 pages: 2 free, then evicts a's tail page (freed before its head)
    assert m.stats.evictions == 1 and m.cached_prefix([1, 2, 3, 4, 9]) == 2
    m.grow("b", 8)  # evicts the head too
    assert m.stats.evictions == 2 and m.cached_prefix([1, 2, 3, 4, 9]) == 0
    assert m.stats.registered == 0
    m.check()


def test_a_hit_refreshes_recency():
    m = PageManager(4, 2)
    committed(m, "x", [1, 1, 0])
    committed(m, "y", [2, 2, 0])
    m.free("x")
    m.free("y")  # x's page is now the least recently used cached page
    assert m.admit("x2", [1, 1, 5]).cached_tokens == 2  # takes x's page back (ref 1) and one free page
    m.free("x2")  # now y's page is the least recently used
    m.admit("z", [3] * 5)  # 3 pages: the 2 free ones, then evicts y's
    assert m.stats.evictions == 1
    assert m.cached_prefix([1, 1, 9]) == 2 and m.cached_prefix([2, 2, 9]) == 0
    m.check()


def test_out_of_pages_changes_nothing():
    m = PageManager(5, 2)
    committed(m, "a", [1, 2, 3, 4, 5])
    m.free("a")  # 2 evictable, 3 free
    m.admit("b", [9, 9])  # 1 page
    before = snapshot(m)
    prompt = [1, 2, 3, 4, 5, 6, 7]  # hits 2 cached pages, needs 2 more; reserve 3 makes it 3 more
    assert m.can_admit(prompt) and not m.can_admit(prompt, reserve=3)
    with pytest.raises(OutOfPages) as err:
        m.admit("c", prompt, reserve=3)
    assert (err.value.needed, err.value.free, err.value.evictable) == (3, 2, 0)
    assert isinstance(err.value, DiffspecError) and "3 new KV page(s)" in str(err.value)
    assert snapshot(m) == before
    with pytest.raises(OutOfPages):
        m.grow("b", 2 * 5 + 1)
    assert snapshot(m) == before
    assert m.admit("c", prompt).cached_tokens == 4
    m.check()


def test_follow_up_turn_hits_every_committed_full_page():
    """A speculative engine leaves the last sampled token's K/V unwritten (computed = len - 1) and writes draft rows
    beyond it that may be rejected; the next turn (prompt + answer + new message) hits every full page below."""
    rng = np.random.default_rng(0)
    m = PageManager(64, 4)
    tokens = list(rng.integers(0, 1000, 10))
    m.admit("turn1", tokens, reserve=4)
    m.commit("turn1", tokens, len(tokens))  # prefill
    tokens.append(7)  # the first sampled token
    for accepted in (3, 1, 4, 2):  # speculative cycles: accept some drafts plus the bonus token
        m.grow("turn1", len(tokens) + 5)  # room for the verify block (K + 1 rows)
        tokens += list(rng.integers(0, 1000, accepted))
        m.commit("turn1", tokens, len(tokens) - 1)
    computed = len(tokens) - 1
    assert m.writable_from("turn1") == computed // 4 * 4
    m.free("turn1")
    follow_up = tokens + list(rng.integers(0, 1000, 6))
    assert m.admit("turn2", follow_up).cached_tokens == computed // 4 * 4 == 20
    m.check()


def test_same_content_committed_twice_registers_one_page():
    m = PageManager(16, 4)
    prompt = list(range(12))
    m.admit("a", prompt)
    m.admit("b", prompt)  # nothing registered yet: both miss
    m.commit("a", prompt, 12)
    m.commit("b", prompt, 12)
    m.commit("b", prompt, 12)  # idempotent
    assert m.stats.registered == 3 and m.stats.used == 6
    assert m.cached_prefix(prompt + [1]) == 12
    m.free("a")
    m.free("b")  # a's pages stay cached, b's duplicates go free
    assert (m.stats.evictable, m.stats.free) == (3, 13)
    m.check()


def test_protocol_errors():
    m = PageManager(8, 4)
    m.admit("a", list(range(6)))
    m.commit("a", list(range(6)), 5)
    with pytest.raises(PagingError, match="moves backwards"):
        m.commit("a", list(range(6)), 4)
    with pytest.raises(PagingError, match="grow it first"):
        m.commit("a", list(range(10)), 9)
    with pytest.raises(PagingError, match="already admitted"):
        m.admit("a", [1])
    with pytest.raises(PagingError, match="unknown sequence"):
        m.free("zz")
    with pytest.raises(PagingError, match="at least one"):
        m.admit("b", [])
    with pytest.raises(PagingError, match="int32"):
        m.admit("b", [2 ** 40])
    with pytest.raises(PagingError):
        PageManager(0, 4)
    committed(m, "c", list(range(9)))
    assert m.admit("d", list(range(9))).cached_tokens == 8
    with pytest.raises(PagingError, match="moves backwards"):  # below the cached prefix
        m.commit("d", list(range(9)), 4)
    m.check()


def test_prefix_caching_off_registers_nothing():
    m = PageManager(8, 2, prefix_caching=False)
    committed(m, "a", [1, 2, 3, 4, 5])
    assert m.writable_from("a") == 4 and m.stats.registered == 0
    m.free("a")
    assert m.admit("b", [1, 2, 3, 4, 5]).cached_tokens == 0 and m.stats.free == 5
    assert (m.stats.prefix_queries, m.stats.prefix_hits) == (10, 0)
    m.check()


def test_128k_sequence_is_cheap():
    """Admit + commit + a full re-hit of a 128K-token sequence, 64-token pages: a few ms each (1 s = something
    quadratic)."""
    tokens = np.random.default_rng(0).integers(0, 128_000, 131_072).astype(np.int32)
    m = PageManager(4096, 64, namespace="llama-3.1-8b/bf16")
    start = time.perf_counter()
    committed(m, "a", tokens, computed=len(tokens) - 1)
    assert m.admit("b", tokens).cached_tokens == len(tokens) - 64
    assert time.perf_counter() - start < 1.0


# --- the stateful property test --------------------------------------------------------------------------------

GARBAGE = "garbage"  # the label of a row the device wrote for a draft token that was then rejected
DOCUMENTS = ([0, 1, 0, 1, 1, 0, 1, 0, 0, 1], [1, 1, 0, 0, 2, 2, 1])  # shared prefixes, so that requests hit


class PagingMachine(RuleBasedStateMachine):
    """Random admit / grow / speculative step / commit / free (cancel) schedules on a tiny pool.

    The device is simulated: ``rows[page][r]`` is the label of what row ``r`` of a page holds, the tuple of tokens
    its K/V depend on (the prefix up to and including its position), ``GARBAGE`` for a rejected draft row, None if
    never written. Every write is checked against ``writable_from`` and every cache hit against the labels."""

    @initialize(page_size=st.integers(1, 4), pool_tokens=st.integers(8, 40),
                caching=st.sampled_from([True, True, True, False]))
    def setup(self, page_size, pool_tokens, caching):
        num_pages = max(2, pool_tokens // page_size)
        self.m = PageManager(num_pages, page_size, namespace="tiny", prefix_caching=caching)
        self.ps = page_size
        self.rows: dict[int, list] = {p: [None] * page_size for p in range(num_pages)}
        self.live: dict[int, dict] = {}  # seq id -> {"tokens": [...], "computed": int}
        self.history: list[list[int]] = list(DOCUMENTS)
        self.next_id = 0

    def write(self, seq_id, lo, hi, tokens=None):
        """The device writes positions ``[lo, hi)`` of a sequence: real K/V of ``tokens`` or GARBAGE."""
        assert lo >= self.m.writable_from(seq_id), "the device would write a committed (cacheable) page"
        table = self.m.page_table(seq_id)
        for pos in range(lo, hi):
            label = GARBAGE if tokens is None else tuple(tokens[:pos + 1])
            self.rows[table[pos // self.ps]][pos % self.ps] = label

    def _admit(self, tokens, reserve, prefill):
        expected, fits, before = self.m.cached_prefix(tokens), self.m.can_admit(tokens, reserve), snapshot(self.m)
        seq_id, self.next_id = self.next_id, self.next_id + 1
        try:
            adm = self.m.admit(seq_id, tokens, reserve)
        except OutOfPages:
            assert not fits and snapshot(self.m) == before
            return
        assert fits and adm.cached_tokens == expected and adm.pages == self.m.page_table(seq_id)
        assert adm.cached_tokens % self.ps == 0 and adm.cached_tokens <= len(tokens) - 1
        assert self.m.prefix_caching or adm.cached_tokens == 0
        assert len(adm.pages) == self.m.pages_for(len(tokens) + reserve)
        for pos in range(adm.cached_tokens):  # no stale page is ever served
            assert self.rows[adm.pages[pos // self.ps]][pos % self.ps] == tuple(tokens[:pos + 1])
        self.live[seq_id] = {"tokens": list(tokens), "computed": adm.cached_tokens}
        if prefill:  # the whole prompt's K/V written at once (else later, by steps: a chunked prefill)
            self.write(seq_id, adm.cached_tokens, len(tokens), tokens)
            self.m.commit(seq_id, tokens, len(tokens))
            self.live[seq_id]["computed"] = len(tokens)

    @precondition(lambda self: len(self.live) < 3)  # the pool turns over instead of staying full
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), min_size=0, max_size=3), reserve=st.integers(0, 2),
          earlier=st.booleans(), prefill=st.booleans())
    def admit(self, data, extra, reserve, earlier, prefill):
        """A new request: a cut of a shared document, or of an earlier sequence's tokens (a follow-up turn, a
        preempted sequence coming back), plus new tokens."""
        base = data.draw(st.sampled_from(self.history if earlier else DOCUMENTS))
        tokens = base[:len(base) - data.draw(st.integers(0, len(base)))] + extra  # mostly long cuts
        if tokens:
            self._admit(tokens, reserve, prefill)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), min_size=0, max_size=3), lag=st.integers(0, 1),
          drafts=st.integers(0, 3))
    def step(self, data, new, lag, drafts):
        """One device step: append accepted tokens, write their rows (and ``drafts`` rejected rows beyond), then
        commit with ``computed = len - lag`` (lag 1: the last sampled token's K/V is not written yet)."""
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        seq = self.live[seq_id]
        tokens = seq["tokens"] + new
        computed = max(seq["computed"], len(tokens) - lag)
        before = snapshot(self.m)
        try:
            self.m.grow(seq_id, computed + drafts)
        except OutOfPages:
            assert snapshot(self.m) == before
            return
        self.write(seq_id, seq["computed"], computed, tokens)
        self.write(seq_id, computed, computed + drafts)  # rejected drafts: overwritten by the next step
        self.m.commit(seq_id, tokens, computed)
        assert self.m.writable_from(seq_id) == computed // self.ps * self.ps
        seq["tokens"], seq["computed"] = tokens, computed

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def commit_again_or_backwards(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        seq = self.live[seq_id]
        before = snapshot(self.m)
        self.m.commit(seq_id, seq["tokens"], seq["computed"])  # idempotent
        assert snapshot(self.m) == before
        if seq["computed"] > 0:
            with pytest.raises(PagingError):
                self.m.commit(seq_id, seq["tokens"], seq["computed"] - 1)
            assert snapshot(self.m) == before

    @precondition(lambda self: self.live)
    @rule(data=st.data(), extra=st.integers(0, 6))
    def grow(self, data, extra):
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        old = self.m.page_table(seq_id)
        before, length = snapshot(self.m), (len(old) - 1) * self.ps + extra
        try:
            new = self.m.grow(seq_id, length)
        except OutOfPages:
            assert snapshot(self.m) == before
            return
        assert self.m.page_table(seq_id) == old + new
        assert len(old + new) == max(len(old), self.m.pages_for(length))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        """Finish, cancel or preempt a sequence (the same call); its committed tokens may come back later."""
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        seq = self.live.pop(seq_id)
        self.m.free(seq_id)
        self.history.append(seq["tokens"])

    @invariant()
    def consistent(self):
        if not hasattr(self, "m"):
            return
        self.m.check()
        for page, key in self.m._key_of.items():  # a registered page holds the prefix its key names, every row
            prefix = self.rows[page][-1]
            assert isinstance(prefix, tuple) and len(prefix) % self.ps == 0, f"page {page} holds {prefix}"
            start = len(prefix) - self.ps
            assert self.rows[page] == [prefix[:start + r + 1] for r in range(self.ps)]
            data = memoryview(np.asarray(prefix, dtype="<i4")).cast("B")
            assert key == list(chain_hashes(data, self.ps, 0, len(prefix) // self.ps, namespace_root("tiny")))[-1]

    def teardown(self):
        if not hasattr(self, "m"):
            return
        for seq_id in list(self.live):
            self.m.free(seq_id)
        self.m.check()
        stats = self.m.stats
        assert stats.used == 0 and stats.free + stats.evictable == stats.total
        assert self.m.prefix_caching or stats.evictable == 0


PagingMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None, database=None,
                                           suppress_health_check=[HealthCheck.too_slow])
TestPaging = PagingMachine.TestCase


def test_lookahead_folds_the_next_token_into_a_page():
    """With ``lookahead=1`` (an EAGLE-3 draft's store: the entry at p depends on the token at p + 1) a page is
    registered once the token after it is known, and reused only by a prompt whose token after it matches."""
    pm = PageManager(8, 4, lookahead=1)
    a = list(range(1, 10))  # 9 tokens: pages [1..4], [5..8], and token 9 after the second
    pm.admit("a", a)
    pm.commit("a", a, 8)
    assert pm.cached_prefix(a[:8] + [99, 5]) == 4  # the token after page 1 differs: page 0 only
    assert pm.cached_prefix(a + [5]) == 8
    pm.free("a")
    b = [11, 12, 13, 14, 15, 16, 17, 18]
    pm.admit("b", b)
    pm.commit("b", b, 8)  # the token after its second page is unknown: that page is not registered
    assert pm.cached_prefix(b + [19, 20]) == 4
    pm.free("b")
    pm.check()
