"""Host-side controllers: DiffSpec's retrieval counters per sequence (:class:`_RetrievalControl`, which replays the
device loop's cadence decisions and checks them) and the draft's shape per sequence (:class:`_ShapeControl`: tree
mode's branching caps and node budget, the adaptive chain depth's report)."""

from __future__ import annotations

from typing import Any

import numpy as np

from diffspec_jax import adaptive
from diffspec_jax.engine.state import Plan
from diffspec_jax.retrieval_control import RetrievalControl


class _RetrievalControl(RetrievalControl):
    """The engine's view: one counter set per prompt, reported as ``{"aggregate", "per_sequence"}``."""

    def status(self, real: int | None = None) -> dict[str, Any]:
        idx = list(range(len(self.c) if real is None else real))
        return {"aggregate": self.aggregate(idx), "per_sequence": [self.c[i].report() for i in idx]}

    def device_cadence(self, seqs: np.ndarray, num_chunks: int) -> dict[str, np.ndarray]:
        """The counters of sequences ``seqs`` as :class:`Cadence` arrays (the device loop's starting point)."""
        cs = [self.c[s] for s in seqs]
        col = lambda f: np.array([int(f(c)) for c in cs], np.int32)  # noqa: E731
        selected = np.zeros((len(cs), num_chunks), bool)
        for r, c in enumerate(cs):
            selected[r, list(c._selected or ())] = True
        return dict(since=col(lambda c: c._since), interval=col(lambda c: c.interval),
                    accept_sum=col(lambda c: c._accept_sum), accept_n=col(lambda c: c._accept_n),
                    prev_sum=col(lambda c: c._prev_sum), prev_n=col(lambda c: c._prev_n), selected=selected)


class _ShapeControl:
    """Host side of the draft's shape per sequence (:mod:`diffspec_jax.adaptive`).

    Tree mode: the branching caps and node budget are kept here (their statistics are floats the device does not
    mirror); they are a block's inputs (:meth:`block_inputs`) and learn from each block's per-cycle record
    (:meth:`observe`). Adaptive chain depth: decided on the device (:class:`DepthControl`); the host controllers
    replay the record, check that they would have chosen the same depths, and give the report.
    """

    def __init__(self, plan: Plan, lengths: np.ndarray):
        spec, n = plan.spec, len(lengths)
        self.spec = spec
        self.tree = plan.tree_mode
        self.k, self.nodes = plan.k, spec.verification.max_nodes if self.tree else 0
        self.adaptive = plan.speculative and spec.verification.adaptive
        self.caps: list = [None] * n
        self.budget: list = [None] * n
        self.depth: list = [None] * n
        for i, length in enumerate(lengths):
            self.reset(i, int(length))

    def reset(self, seq: int, length: int) -> None:
        """Fresh controllers for sequence ``seq`` starting at prompt ``length`` (a server slot taking a new
        request)."""
        spec = self.spec
        if self.tree:
            self.caps[seq] = adaptive.make_caps_controller(spec.verification.branching, self.k,
                                                           spec.verification.topk)
            self.budget[seq] = adaptive.NodeBudget(spec.verification.max_nodes, self.k) if self.adaptive else None
        elif self.adaptive:
            self.depth[seq] = adaptive.AdaptiveDepth(self.k, spec.verification.long_context_threshold,
                                                     spec.verification.long_context_depth)
            self.depth[seq].start(int(length))

    def device_depth(self, seqs: np.ndarray) -> dict[str, np.ndarray] | None:
        """The adaptive depths of sequences ``seqs`` as :class:`DepthControl` arrays (``None``: not adaptive)."""
        if self.tree or not self.adaptive:
            return None
        zero = np.zeros(len(seqs), np.int32)
        return dict(depth=np.array([self.depth[s].depth for s in seqs], np.int32),
                    floor=np.array([self.depth[s].floor for s in seqs], np.int32), good=zero, bad=zero.copy())

    def block_inputs(self, seqs: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Tree mode: the caps int32 ``[B, K]`` and node budgets int32 ``[B]`` of rows ``seqs`` for the next block."""
        if not self.tree:
            return None, None
        caps = np.stack([self.caps[s].caps() for s in seqs]).astype(np.int32)
        budget = np.array([self.nodes if self.budget[s] is None else self.budget[s].budget for s in seqs], np.int32)
        return caps, budget

    def observe(self, seq: int, m: int, length: int, depth: int | None) -> None:
        """Book sequence ``seq``'s verification: ``m`` accepted drafts, committed ``length``, drafted at ``depth``
        (adaptive chain depth: what the device chose, checked against the host controller)."""
        if self.tree:
            self.caps[seq].record(m)
            if self.budget[seq] is not None:
                self.budget[seq].observe(m)
        elif self.adaptive:
            d = self.depth[seq]
            if depth != d.depth:
                raise RuntimeError(f"the device drafted sequence {seq} at depth {depth}, its host controller says "
                                   f"{d.depth}: the on-device adaptive depth diverged (a bug)")
            d.observe(m + 1, length)

    def report(self, real: int) -> dict[str, Any] | None:
        if self.tree:
            return {"per_sequence": [{"branching": self.caps[i].snapshot(),
                                      "node_budget": self.budget[i].snapshot() if self.budget[i] else None}
                                     for i in range(real)]}
        if self.adaptive:
            return {"per_sequence": [{"depth": d.depth, "floor": d.floor} for d in self.depth[:real]]}
        return None
