"""The host side of paged K/V memory: a pool of fixed-size pages, a page table per sequence, automatic prefix
caching keyed by a hash chain, and least-recently-used eviction. Pure Python + NumPy (no JAX): the device side
keeps the K/V pool and reads it through the page tables this module hands out.

Terms (``P`` = ``page_size`` tokens per page, page ids ``0 .. num_pages-1``):

* A sequence's **page table** lists its pages in position order: position ``t`` lives in row ``t % P`` of page
  ``table[t // P]``.
* Every page is in exactly one of three states: **referenced** (held by ``ref >= 1`` page tables), **evictable**
  (``ref == 0`` but registered in the prefix cache, its K/V kept for reuse) or **free**.
* **Hash chain.** Full page ``i`` of a token sequence has the key ``h_i = H(h_{i-1} || tokens of page i)`` with
  ``h_{-1} = H(namespace)``; ``H`` is BLAKE2b-256 over the tokens as little-endian int32. The key therefore names
  the whole prefix up to the end of the page (K/V rows depend on every earlier token), and the namespace (model
  identity and dtype) keeps two models from ever sharing a page.
* **Registration** (:meth:`PageManager.commit`): once every row of a full page is final (below ``computed``), the
  page is mapped under its key and may be reused by later requests. A registered page is never written again:
  :meth:`PageManager.writable_from` is the first position the device may still write. Rows a speculative engine
  wrote but did not accept lie at ``>= computed`` and so never reach a registered page.
* **Admission** (:meth:`PageManager.admit`) walks the chain of a new prompt and reuses the longest run of
  registered pages, leaving at least one prompt token to compute (the first sampled token needs its logits).
* **Allocation** takes a free page first, else evicts the least recently used evictable page (dropping its key).
  :meth:`PageManager.free` releases a sequence's pages tail first, so the head of a prefix (without which the rest
  cannot be hit) is the last of them to be evicted.

Everything that fails raises before changing any state (all-or-nothing): :class:`OutOfPages` when the pool cannot
supply the pages, :class:`PagingError` for a call that breaks the protocol (unknown sequence, a commit that moves
backwards, ...).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, Iterator, Sequence

import numpy as np

from diffspec_jax.errors import DiffspecError

#: bytes of one chain key (BLAKE2b digest size)
HASH_BYTES = 32


class PagingError(DiffspecError):
    """A call that breaks the page manager's protocol: an unknown or duplicate sequence id, an empty prompt, a
    commit that moves backwards or covers positions the sequence holds no page for."""


class OutOfPages(DiffspecError):
    """The pool cannot supply the pages a call needs, even after evicting every unreferenced cached page.

    Attributes: ``needed`` (pages the call would allocate), ``free`` and ``evictable`` (pages available to it).
    The manager's state is unchanged; the caller frees or preempts a sequence and retries."""

    def __init__(self, needed: int, free: int, evictable: int, total: int, what: str):
        self.needed, self.free, self.evictable, self.total = needed, free, evictable, total
        super().__init__(f"{what} needs {needed} new KV page(s) but only {free} free + {evictable} evictable cached "
                         f"page(s) of {total} are available; free or preempt a running sequence (or give the pool "
                         f"more pages) and retry")


@dataclass(frozen=True)
class Admission:
    """What :meth:`PageManager.admit` gave a new sequence: its page table (``pages``, position order) and how many
    leading prompt tokens already have their K/V in the reused pages (``cached_tokens``, a multiple of the page
    size, at most ``len(tokens) - 1``; the device prefills positions ``cached_tokens ..`` only)."""

    pages: tuple[int, ...]
    cached_tokens: int


@dataclass(frozen=True)
class PageStats:
    """A snapshot of the pool, in pages (``total == used + evictable + free``) and of the prefix cache's counters,
    in tokens (``prefix_queries``: prompt tokens admitted; ``prefix_hits``: of those, tokens served from cached
    pages). ``registered`` counts pages mapped in the prefix cache (referenced or evictable); ``evictions`` counts
    cached pages reclaimed for new data."""

    total: int
    used: int
    evictable: int
    free: int
    registered: int
    prefix_queries: int
    prefix_hits: int
    evictions: int


@dataclass
class _Seq:
    pages: list[int]
    #: leading full pages whose key is computed (each registered, or a duplicate of a registered page)
    hashed: int
    #: key of page ``hashed - 1`` (the namespace root when ``hashed == 0``)
    last_hash: bytes
    #: the largest ``computed`` committed so far (tokens)
    computed: int = 0
    #: keys of the hashed pages the sequence holds registered (position -> key), for the invariant check
    keys: dict[int, bytes] = field(default_factory=dict)


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> memoryview:
    """Tokens ``[T]`` (ints) as a flat byte view of little-endian int32, ``4 * T`` bytes."""
    try:
        arr = np.ascontiguousarray(tokens, dtype="<i4")
    except (OverflowError, TypeError, ValueError) as exc:
        raise PagingError(f"tokens must be int32 token ids: {exc}") from None
    if arr.ndim != 1:
        raise PagingError(f"tokens must be a 1-D sequence of token ids, got shape {arr.shape}")
    return memoryview(arr).cast("B")


def chain_hashes(data: memoryview, page_size: int, start: int, stop: int, prev: bytes, lookahead: int = 0
                 ) -> Iterator[bytes]:
    """Keys ``h_start .. h_{stop-1}`` of the full pages of ``data`` (tokens as little-endian int32 bytes), given
    ``prev = h_{start-1}``: ``h_i = BLAKE2b-256(h_{i-1} || bytes of page i and of the `lookahead` tokens after
    it)``. Lazy, so a walk stops at a miss."""
    step = 4 * page_size
    for i in range(start, stop):
        digest = hashlib.blake2b(prev, digest_size=HASH_BYTES)
        digest.update(data[i * step:(i + 1) * step + 4 * lookahead])
        prev = digest.digest()
        yield prev


def namespace_root(namespace: str) -> bytes:
    """``h_{-1}``: the key every chain of ``namespace`` (model identity + dtype) starts from."""
    return hashlib.blake2b(b"diffspec-kv-pages-v1\0" + namespace.encode(), digest_size=HASH_BYTES).digest()


class PageManager:
    """Pages of the K/V pool, the page table of every live sequence, and the prefix cache over them.

    ``num_pages`` pages of ``page_size`` tokens each (ids ``0 .. num_pages-1``). ``namespace`` is folded into the
    first key of every hash chain (give it the model identity and dtype). With ``prefix_caching=False`` no page is
    ever registered or reused; the pool and page tables work the same.

    ``lookahead``: tokens after a page that its rows also depend on, folded into its key. An EAGLE-3 draft's store
    entry at position p is projected from the target's features at p and the token at p + 1, so a page of the
    draft's store is only right for a request whose next token after the page matches too (``lookahead=1``); a
    page is then registered once that token is known, and reused only by a prompt that has it.

    Sequence ids are any hashable values chosen by the caller. A sequence's life: :meth:`admit` (prompt pages,
    reusing cached ones), :meth:`grow` (pages for more positions), :meth:`commit` (positions whose K/V are final;
    their full pages become cacheable), :meth:`free` (ends it, or preempts it: a preempted sequence is admitted
    again later with its prompt plus the tokens generated so far).
    """

    def __init__(self, num_pages: int, page_size: int, *, namespace: str = "", prefix_caching: bool = True,
                 lookahead: int = 0):
        if int(num_pages) != num_pages or num_pages < 1:
            raise PagingError(f"num_pages must be a positive integer, got {num_pages!r}")
        if int(page_size) != page_size or page_size < 1:
            raise PagingError(f"page_size must be a positive integer, got {page_size!r}")
        self._num_pages, self._page_size = int(num_pages), int(page_size)
        self._caching = bool(prefix_caching)
        if int(lookahead) != lookahead or lookahead < 0:
            raise PagingError(f"lookahead must be a non-negative number of tokens, got {lookahead!r}")
        self._lookahead = int(lookahead)
        self._root = namespace_root(namespace)
        self._ref = [0] * self._num_pages
        self._free: list[int] = list(range(self._num_pages - 1, -1, -1))  # a stack: page 0 is handed out first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self._page_of: dict[bytes, int] = {}  # key -> registered page
        self._key_of: dict[int, bytes] = {}  # registered page -> key
        self._seqs: dict[Hashable, _Seq] = {}
        self._queries = self._hits = self._evictions = 0

    # --- sizes -------------------------------------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        """Pages in the pool."""
        return self._num_pages

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self._page_size

    @property
    def prefix_caching(self) -> bool:
        """Whether full committed pages are registered and reused."""
        return self._caching

    def pages_for(self, tokens: int) -> int:
        """Pages that hold ``tokens`` positions: ``ceil(tokens / page_size)``."""
        return -(-int(tokens) // self._page_size)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    # --- admission ---------------------------------------------------------------------------------------------

    def _hits_for(self, data: memoryview, n_tokens: int) -> list[int]:
        """The registered pages that hold the longest cached run of full pages of the prompt (``data``, ``n_tokens``
        tokens), capped at ``(n_tokens - 1) // page_size`` pages so one prompt token is left to compute."""
        if not self._caching:
            return []
        hits = []
        stop = min(n_tokens - 1, n_tokens - self._lookahead) // self._page_size
        for key in chain_hashes(data, self._page_size, 0, stop, self._root, self._lookahead):
            page = self._page_of.get(key)
            if page is None:
                break
            hits.append(page)
        return hits

    def cached_prefix(self, tokens: Sequence[int] | np.ndarray) -> int:
        """Tokens of a new request ``tokens`` (``[T]`` ids) that :meth:`admit` would serve from cached pages now
        (a multiple of ``page_size``, at most ``T - 1``). Changes nothing."""
        data = _token_bytes(tokens)
        return len(self._hits_for(data, len(data) // 4)) * self._page_size

    def _available(self, hits: Sequence[int] = ()) -> tuple[int, int]:
        """``(free, evictable)`` pages an allocation may use once the ``hits`` have been taken."""
        taken = sum(1 for p in hits if self._ref[p] == 0)
        return len(self._free), len(self._evictable) - taken

    def _check_room(self, needed: int, hits: Sequence[int], what: str) -> None:
        free, evictable = self._available(hits)
        if needed > free + evictable:
            raise OutOfPages(needed, free, evictable, self._num_pages, what)

    def _prompt(self, tokens, reserve: int, max_cached: int | None = None
                ) -> tuple[memoryview, int, list[int], int]:
        """Checks of a prompt; ``(token bytes, T, hit pages, new pages needed)``."""
        if int(reserve) != reserve or reserve < 0:
            raise PagingError(f"reserve must be a non-negative number of tokens, got {reserve!r}")
        if max_cached is not None and (int(max_cached) != max_cached or max_cached < 0):
            raise PagingError(f"max_cached must be a non-negative number of tokens, got {max_cached!r}")
        data = _token_bytes(tokens)
        n = len(data) // 4
        if n < 1:
            raise PagingError("a sequence needs at least one prompt token")
        hits = self._hits_for(data, n)
        if max_cached is not None:
            hits = hits[:int(max_cached) // self._page_size]
        return data, n, hits, self.pages_for(n + int(reserve)) - len(hits)

    def can_admit(self, tokens: Sequence[int] | np.ndarray, reserve: int = 0) -> bool:
        """Whether :meth:`admit` of ``tokens`` (``[T]`` ids) with room for ``reserve`` more tokens would succeed now
        (free plus evictable pages, counting the cached pages it would reuse)."""
        _, _, hits, needed = self._prompt(tokens, reserve)
        free, evictable = self._available(hits)
        return needed <= free + evictable

    def admit(self, seq_id: Hashable, tokens: Sequence[int] | np.ndarray, reserve: int = 0,
              max_cached: int | None = None) -> Admission:
        """Start sequence ``seq_id`` with prompt ``tokens`` (``[T]`` ids), pages for ``T + reserve`` positions.

        Reuses the longest cached run of full pages matching the prompt's prefix (capped so at least one prompt
        token is left to compute, and at ``max_cached`` tokens when given: whole pages below it), taking a reference
        on each, and allocates fresh pages for the rest. Counts
        ``T`` prefix-cache query tokens and ``cached_tokens`` hit tokens. Raises :class:`OutOfPages` (nothing
        changed) when the pool cannot supply the fresh pages."""
        if seq_id in self._seqs:
            raise PagingError(f"sequence {seq_id!r} is already admitted; free it first")
        _, n, hits, needed = self._prompt(tokens, reserve, max_cached)
        self._check_room(needed, hits, f"admitting sequence {seq_id!r} ({n} prompt + {reserve} reserved tokens)")
        for page in hits:
            self._take(page)
        pages = hits + [self._allocate() for _ in range(needed)]
        last = self._key_of[hits[-1]] if hits else self._root
        cached = len(hits) * self._page_size
        self._seqs[seq_id] = _Seq(pages, len(hits), last, cached, {i: self._key_of[p] for i, p in enumerate(hits)})
        self._queries += n
        self._hits += cached
        return Admission(tuple(pages), cached)

    # --- growth, commit, release -------------------------------------------------------------------------------

    def _seq(self, seq_id: Hashable) -> _Seq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise PagingError(f"unknown sequence {seq_id!r} (never admitted, or already freed)")
        return seq

    def _take(self, page: int) -> None:
        """A reference on a registered page (a cache hit), moving it out of the evictable set if unreferenced."""
        if self._ref[page] == 0:
            del self._evictable[page]
        self._ref[page] += 1

    def _allocate(self) -> int:
        """A page with one reference: a free one, else the least recently used evictable one (its key dropped).
        The caller has checked there is one."""
        if self._free:
            page = self._free.pop()
        else:
            page, _ = self._evictable.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
            self._evictions += 1
        self._ref[page] = 1
        return page

    def grow(self, seq_id: Hashable, length: int) -> tuple[int, ...]:
        """Allocate pages so sequence ``seq_id`` covers ``length`` positions (``pages_for(length)`` pages); returns the
        ids of the new pages (empty when it already does). Raises :class:`OutOfPages` (nothing changed) when the
        pool cannot supply them."""
        seq = self._seq(seq_id)
        needed = self.pages_for(length) - len(seq.pages)
        if needed <= 0:
            return ()
        self._check_room(needed, (), f"growing sequence {seq_id!r} to {length} tokens")
        new = [self._allocate() for _ in range(needed)]
        seq.pages.extend(new)
        return tuple(new)

    def commit(self, seq_id: Hashable, tokens: Sequence[int] | np.ndarray, computed: int) -> None:
        """Record that positions ``< computed`` of sequence ``seq_id`` hold their final K/V; ``tokens`` (``[T]`` ids,
        ``T >= computed``) are the sequence's tokens so far (prompt + generated).

        Every full page entirely below ``computed`` gets its chain key and is registered in the prefix cache,
        unless the key already names another page (then this page stays unregistered and is freed normally).
        Incremental (only the tokens of pages not hashed by earlier commits are read) and idempotent.
        ``computed`` may not be smaller than at the previous commit (or than the admission's ``cached_tokens``), nor
        beyond the positions the sequence holds pages for. The tokens of pages already hashed must not change (not
        checked)."""
        seq = self._seq(seq_id)
        computed = int(computed)
        if computed < seq.computed:
            raise PagingError(f"commit of sequence {seq_id!r} moves backwards: computed={computed} after "
                              f"{seq.computed}; positions once committed stay final (preempt and re-admit instead)")
        if computed > len(seq.pages) * self._page_size:
            raise PagingError(f"commit of sequence {seq_id!r}: computed={computed} but it holds pages for only "
                              f"{len(seq.pages) * self._page_size} positions (grow it first)")
        if len(tokens) < computed:
            raise PagingError(f"commit of sequence {seq_id!r}: computed={computed} but only {len(tokens)} tokens")
        seq.computed = computed
        full = min(computed, len(tokens) - self._lookahead) // self._page_size  # (a page's lookahead known too)
        if full <= seq.hashed:
            return
        if self._caching:  # only the new pages' tokens are read: a decode step's commit costs O(its tokens)
            p = self._page_size
            data = _token_bytes(tokens[seq.hashed * p:full * p + self._lookahead])
            for i, key in enumerate(chain_hashes(data, p, 0, full - seq.hashed, seq.last_hash, self._lookahead),
                                    seq.hashed):
                if key not in self._page_of:
                    self._page_of[key], self._key_of[seq.pages[i]] = seq.pages[i], key
                    seq.keys[i] = key
                seq.last_hash = key
        seq.hashed = full

    def writable_from(self, seq_id: Hashable) -> int:
        """The first position of sequence ``seq_id`` the device may still write: every position below it is in a
        committed full page (``hashed pages * page_size``), possibly shared with other sequences."""
        return self._seq(seq_id).hashed * self._page_size

    def free(self, seq_id: Hashable) -> None:
        """End (or preempt) sequence ``seq_id``: drop its references. A page left unreferenced goes to the evictable
        set if registered (the sequence's head page last, so it is evicted last), to the free list otherwise."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        for page in reversed(seq.pages):
            self._ref[page] -= 1
            if self._ref[page] == 0:
                if page in self._key_of:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    def page_table(self, seq_id: Hashable) -> tuple[int, ...]:
        """Sequence ``seq_id``'s pages in position order (position ``t`` is in page ``[t // page_size]``)."""
        return tuple(self._seq(seq_id).pages)

    # --- accounting --------------------------------------------------------------------------------------------

    @property
    def stats(self) -> PageStats:
        """A snapshot of the pool and of the prefix cache's counters."""
        free, evictable = len(self._free), len(self._evictable)
        return PageStats(total=self._num_pages, used=self._num_pages - free - evictable, evictable=evictable,
                         free=free, registered=len(self._key_of), prefix_queries=self._queries,
                         prefix_hits=self._hits, evictions=self._evictions)

    def check(self) -> None:
        """Assert the invariants (for tests; O(pages + table entries)): every page is in exactly one of referenced /
        evictable / free; each refcount equals the number of page tables holding the page (a table holds a page at
        most once); keys and registered pages map one-to-one; evictable pages are registered, free ones are not;
        each sequence's hashed pages lie below its committed positions, and the keys it recorded still name them."""
        held = [0] * self._num_pages
        for seq in self._seqs.values():
            assert len(set(seq.pages)) == len(seq.pages), f"a page table holds a page twice: {seq.pages}"
            assert seq.hashed * self._page_size <= seq.computed <= len(seq.pages) * self._page_size
            for page in seq.pages:
                held[page] += 1
            for i, key in seq.keys.items():
                assert self._page_of.get(key) == seq.pages[i], "a held registered page lost its key"
        assert held == self._ref, "refcounts differ from the page tables"
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "the free list holds a page twice"
        referenced = {p for p, r in enumerate(self._ref) if r > 0}
        assert not (free & evictable) and not (free & referenced) and not (evictable & referenced)
        assert len(free) + len(evictable) + len(referenced) == self._num_pages, "a page is in no state"
        assert len(self._page_of) == len(self._key_of)
        assert all(self._key_of.get(p) == k for k, p in self._page_of.items()), "keys and pages are not one-to-one"
        assert evictable <= self._key_of.keys(), "an evictable page is not registered"
        assert not (free & self._key_of.keys()), "a free page is still registered"
        assert self._caching or not self._key_of, "a page is registered with prefix caching off"
