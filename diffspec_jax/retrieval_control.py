"""DiffSpec's ``retrieval_status`` counters (docs/method.md section 11) and a host-side retrieval cadence (no JAX,
no torch).

:class:`RetrievalBook` keeps the counters per sequence (or request slot), booked from decisions made elsewhere: the
JAX engine decides the cadence on the device (:mod:`diffspec_jax.engine.loop`, its one definition there) and the
host reads each decision from the block's record. :class:`RetrievalControl` decides the cadence with its adaptive
interval (docs/method.md section 4) on the host, one cycle at a time, for the torch bridge, which runs without JAX;
the two agree exactly because every threshold test is exact: the Jaccard overlap and the acceptance period are
ratios of integers compared with decimal constants (:func:`ratio`), and a test drives both with the same streams.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Iterable, Sequence

import numpy as np

from diffspec_jax.config import SpecConfig

ADAPTIVE_MAX_INTERVAL = 32
ADAPTIVE_JACCARD = 0.9
ADAPTIVE_ACCEPT_FACTOR = 0.9


def ratio(x: float) -> tuple[int, int]:
    """A decimal constant as the exact fraction it is written as, ``(numerator, denominator)``: ``0.9 -> (9, 10)``
    (integer tests against it, like the JAX engine's on-device cadence, agree with this module exactly)."""
    f = Fraction(str(x))
    return f.numerator, f.denominator


#: counters that add up over sequences
ADDITIVE = ("cycles", "retrievals", "retrievals_after_prefill", "skipped_prefill", "skipped_not_due", "skipped_fits")


@dataclass
class RetrievalCounters:
    """``retrieval_status`` counters of one sequence (docs/method.md section 11); ``_``-fields are bookkeeping."""

    cycles: int = 0
    retrievals: int = 0
    retrievals_after_prefill: int = 0
    skipped_prefill: int = 0
    skipped_not_due: int = 0
    skipped_fits: int = 0
    interval: int = 0
    last_jaccard: float | None = None
    anchor_chunks: list[int] = field(default_factory=list)
    sink_kept: bool = False
    working_len: int = 0
    window_tokens: int = 0
    retrieval_ms: float = 0.0
    selection_digest: str = ""
    ranks_agree: bool = True
    _since: int = 0
    _ms_total: float = 0.0
    _accept_sum: float = 0.0
    _accept_n: int = 0
    _prev_period: float | None = None
    _prev_sum: float = 0.0
    _prev_n: int = 0
    _selected: tuple[int, ...] | None = None

    def report(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if not k.startswith("_")}


def digest(items: Iterable) -> str:
    """A short stable digest (sha1) of a sequence of chunk ids or digests."""
    return hashlib.sha1(",".join(map(str, items)).encode()).hexdigest()[:16]


class RetrievalBook:
    """The ``retrieval_status`` counters of ``n`` sequences (index = sequence or slot), booked from decisions made
    elsewhere: the JAX engine's device loop (its cadence, read from each block's record) or :class:`RetrievalControl`
    (the torch bridge's cadence)."""

    def __init__(self, spec: SpecConfig, n: int):
        self.spec = spec
        self.c = [self._fresh() for _ in range(n)]

    def _fresh(self) -> RetrievalCounters:
        return RetrievalCounters(interval=self.spec.context.retrieval_interval)

    def reset(self, i: int) -> None:
        """Clear sequence ``i`` (a freed slot)."""
        self.c[i] = self._fresh()

    def skip_prefill(self, i: int) -> None:
        self.c[i].skipped_prefill += 1

    def cycle(self, i: int, due: bool, since: int, interval: int, working_len: int | None = None,
              window: int | None = None) -> None:
        """Book one finished verification cycle of sequence ``i`` as the cadence decided it: retrieving now
        (``due``), else skipped, not due yet (``since < interval``, cycles since the last retrieval) or because
        the context fits the history budget; ``interval`` is the cadence's interval after the cycle, and
        ``working_len`` / ``window`` the draft's history length and rolling-window tokens."""
        c = self.c[i]
        c.cycles += 1
        c.interval = int(interval)
        if not due:
            if since < interval:
                c.skipped_not_due += 1
            else:
                c.skipped_fits += 1
        if working_len is not None:
            c.working_len, c.window_tokens = int(working_len), int(window)

    def retrieved(self, i: int, rank_anchors: np.ndarray, root: int, ms: float, after_prefill: bool) -> None:
        """Book a retrieval of sequence ``i`` at root ``root``; ``rank_anchors`` is ``[ranks, A]`` (every
        tensor-parallel rank's anchors, checked equal) or ``[A]``."""
        c = self.c[i]
        rank_anchors = np.atleast_2d(np.asarray(rank_anchors))
        anchors = rank_anchors[0]
        c.ranks_agree = c.ranks_agree and bool(np.all(rank_anchors == anchors[None]))
        selected = tuple(sorted({int(a) for a in anchors if a >= 0} | {root // self.spec.context.chunk_size}))
        c.retrievals += 1
        c.retrievals_after_prefill += int(after_prefill)
        c._ms_total += ms
        c.retrieval_ms = c._ms_total / c.retrievals
        c.anchor_chunks = [int(a) for a in anchors if a >= 0]
        c.sink_kept = 0 in c.anchor_chunks
        c.selection_digest = digest(selected)
        if c._selected is not None:
            union = set(c._selected) | set(selected)
            c.last_jaccard = len(set(c._selected) & set(selected)) / max(1, len(union))
        c._selected = selected

    def aggregate(self, indices: Sequence[int]) -> dict[str, Any]:
        """Additive counters summed over ``indices``, the mean retrieval time, rank agreement, and a digest of the
        per-sequence digests (in the given order)."""
        cs = [self.c[i] for i in indices]
        agg: dict[str, Any] = {k: sum(getattr(c, k) for c in cs) for k in ADDITIVE}
        agg["retrieval_ms"] = sum(c._ms_total for c in cs) / max(1, agg["retrievals"])
        agg["ranks_agree"] = all(c.ranks_agree for c in cs)
        agg["selection_digest"] = digest(c.selection_digest for c in cs)
        return agg

    def status(self, real: int | None = None) -> dict[str, Any]:
        """``{"aggregate", "per_sequence"}`` over the first ``real`` sequences (all when ``None``)."""
        idx = list(range(len(self.c) if real is None else real))
        return {"aggregate": self.aggregate(idx), "per_sequence": [self.c[i].report() for i in idx]}


class RetrievalControl(RetrievalBook):
    """The retrieval cadence with its adaptive interval decided on the host, one sequence at a time, with the
    counters: the torch bridge's (it runs without JAX, one cycle per call; the JAX engine decides the cadence on
    the device, :mod:`diffspec_jax.engine.loop`, which this agrees with exactly)."""

    def fits(self, root: int) -> bool:
        """The whole context ``0..root-1`` fits the history budget: scoring would change nothing."""
        return root <= self.spec.history_budget

    def observe(self, i: int, emitted: int | None = None, working_len: int | None = None,
                window: int | None = None) -> None:
        """Book a verification's emitted tokens (m + 1, for the adaptive interval) and the last rebuild's sizes."""
        c = self.c[i]
        if emitted is not None:
            c._accept_sum += emitted
            c._accept_n += 1
        if working_len is not None:
            c.working_len, c.window_tokens = int(working_len), int(window)

    def due(self, i: int, root: int) -> bool:
        """Classify one finished verification cycle of sequence ``i``; True when it retrieves now."""
        c = self.c[i]
        c._since += 1
        due = c._since >= c.interval and not self.fits(root)
        self.cycle(i, due, c._since, c.interval)
        return due

    def record(self, i: int, rank_anchors: np.ndarray, root: int, ms: float, after_prefill: bool) -> None:
        """Book a retrieval of sequence ``i`` (:meth:`retrieved`) and adapt its interval."""
        c, spec = self.c[i], self.spec
        self.retrieved(i, rank_anchors, root, ms, after_prefill)
        c._since = 0
        if spec.context.adaptive and not after_prefill:
            period = c._accept_sum / c._accept_n if c._accept_n else None
            stable = c.last_jaccard is not None and c.last_jaccard >= ADAPTIVE_JACCARD
            # period >= 0.9 x the previous period, compared exactly (sums over counts as fractions): a float test
            # could round either way at an exact tie
            num, den = ratio(ADAPTIVE_ACCEPT_FACTOR)
            holds = period is not None and c._prev_period is not None and \
                Fraction(c._accept_sum) * c._prev_n * den >= Fraction(c._prev_sum) * c._accept_n * num
            c.interval = min(2 * c.interval, ADAPTIVE_MAX_INTERVAL) if stable and holds else \
                spec.context.retrieval_interval
            c._prev_period, c._prev_sum, c._prev_n = period, c._accept_sum, c._accept_n
        c._accept_sum, c._accept_n = 0.0, 0
