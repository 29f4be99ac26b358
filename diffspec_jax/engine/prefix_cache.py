"""A prefix cache for the library: K/V pages kept between :func:`~diffspec_jax.engine.driver.generate` calls, so a
script that asks several questions about one long document prefills the document once.

``generate(..., prefix_cache=PrefixCache(num_pages))`` runs on the paged cache (:mod:`diffspec_jax.cache`) over
the pool this object keeps on the device. Each prompt reuses the longest run of full pages an earlier call computed
for the same tokens (:class:`~diffspec_jax.paging.PageManager`: hash chain, least-recently-used eviction) and is
prefilled from there; when the call ends, every full page of each sequence (prompt and generated tokens) is left
in the cache. The server's slot engine does the same per request (:mod:`diffspec_jax.serving.scheduler`).

What is reused must be all of a sequence's state at those positions: the target's K/V and, with a ``recent`` or
``diffspec`` draft, its store (whose entry at p reads the token at p + 1, hence the manager's ``lookahead``). A
hybrid target (its recurrent states), the draft's ``full`` policy (its working cache per sequence) and the
salience scorer (chunk summaries per sequence) are refused. The pool is tied to one model pair and dtype: a call
with another starts an empty one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from diffspec_jax.errors import ConfigError, InputError
from diffspec_jax.paging import OutOfPages, PageManager, PageStats
from diffspec_jax.validation import check_int, check_page_size


@dataclass
class _Run:
    """One generate() call's use of the cache: each prompt's pages and the positions it reuses."""

    ids: list
    table: np.ndarray  # int32 [B, max_pages]
    starts: np.ndarray  # int32 [B]: cached tokens per prompt


class PrefixCache:
    """K/V pages of earlier :func:`generate` calls (see the module docstring).

    Args:
        num_pages: pages in the pool; a call's batch must fit it (each prompt: its tokens + ``max_new_tokens`` +
            the verify block, in whole pages, beside what the call reuses).
        page_size: tokens per page, a power of two from 16 to 256 [64].
    """

    def __init__(self, num_pages: int, page_size: int = 64):
        check_int(num_pages, "num_pages", min=1)
        check_page_size(page_size)
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        self._key = None
        self._manager: PageManager | None = None
        self.pools: tuple = ()  # the device pools after the last call (DecodeState's shared leaves)
        self._calls = 0
        self._open: list = []  # the running call's sequences (left over: that call failed)

    @property
    def stats(self) -> PageStats | None:
        """The pool's pages and the prefix counters (tokens queried / served from cache), ``None`` before a call."""
        return None if self._manager is None else self._manager.stats

    def _bind(self, key: str, lookahead: int) -> PageManager:
        if self._key != key or self._open:  # another model pair, dtype or layout, or a call that failed: start empty
            self._open = []
            self._key, self.pools = key, ()
            self._manager = PageManager(self.num_pages, self.page_size, namespace=key, lookahead=lookahead)
        return self._manager

    def admit(self, plan, prompts: list, reserve: int, target_dtype) -> _Run:
        """Pages for each prompt of a call (reusing cached ones) and its page table; all or nothing."""
        if not plan.prefix_reusable:
            raise ConfigError("a prefix cache reuses pages, but this run keeps per-sequence state outside them (a "
                              "hybrid target's recurrent states, the draft's 'full' policy or the salience scorer's "
                              "chunk summaries): run it without prefix_cache")
        manager = self._bind(plan.prefix_namespace(target_dtype), plan.page_lookahead)
        self._calls += 1
        ids = [(self._calls, b) for b in range(len(prompts))]
        table = np.full((len(prompts), plan.capacity // self.page_size), self.num_pages, np.int32)
        starts = np.zeros(len(prompts), np.int32)
        try:
            for b, p in enumerate(prompts):
                adm = manager.admit(ids[b], np.asarray(p, np.int32), reserve=reserve)
                table[b, :len(adm.pages)] = adm.pages
                starts[b] = adm.cached_tokens
        except OutOfPages as exc:
            for i in ids:
                if i in manager:
                    manager.free(i)
            manager.check()
            raise InputError(f"the prefix cache's pool ({self.num_pages} pages of {self.page_size} tokens) cannot "
                             f"hold this batch: {exc}; give it more pages or pass fewer prompts") from None
        self._open = ids
        return _Run(ids, table, starts)

    def release(self, run: _Run, sequences: list, computed: list, pools: tuple) -> None:
        """A call ended: ``sequences[b]`` (prompt + generated ids) has final K/V below ``computed[b]``; its full
        pages stay cached, every page is released, and the device pools are kept for the next call."""
        manager = self._manager
        for i, seq, done in zip(run.ids, sequences, computed):
            held = len(manager.page_table(i)) * self.page_size
            manager.commit(i, np.asarray(seq, np.int32), min(held, max(int(done), manager.writable_from(i))))
            manager.free(i)
        self.pools, self._open = pools, []
