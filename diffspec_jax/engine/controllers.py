"""The draft's shape per sequence on the host (:class:`ShapeControl`): tree mode's branching caps and node budget,
which are a block's inputs and learn from each block's per-cycle record, and the adaptive chain depth's report
(the depth itself is decided on the device, :class:`~diffspec_jax.engine.loop.DepthControl`, and read from the
record)."""

from __future__ import annotations

from typing import Any

import numpy as np

from diffspec_jax import adaptive
from diffspec_jax.engine.state import Plan


class ShapeControl:
    """Host side of the draft's shape per sequence (:mod:`diffspec_jax.adaptive`).

    Tree mode: the branching caps and node budget are kept here (their statistics are floats the device does not
    keep); they are a block's inputs (:meth:`block_inputs`) and learn from each block's per-cycle record
    (:meth:`observe`). Adaptive chain depth: the device decides it; the host keeps the last ``(depth, floor)`` the
    record showed for the report.
    """

    def __init__(self, plan: Plan, n: int):
        spec = plan.spec
        self.spec = spec
        self.tree = plan.tree_mode
        self.k, self.nodes = plan.k, spec.verification.max_nodes if self.tree else 0
        self.adaptive = plan.speculative and spec.verification.adaptive
        self.caps: list = [None] * n
        self.budget: list = [None] * n
        self.depth: list[tuple[int, int] | None] = [None] * n
        for i in range(n):
            self.reset(i)

    def reset(self, seq: int, depth: tuple[int, int] | None = None) -> None:
        """Fresh controllers for sequence ``seq`` (a server slot taking a new request); ``depth``: the adaptive
        chain depth and floor it starts at (:func:`~diffspec_jax.engine.loop.start_depth`)."""
        spec = self.spec
        if self.tree:
            self.caps[seq] = adaptive.make_caps_controller(spec.verification.branching, self.k,
                                                           spec.verification.topk)
            self.budget[seq] = adaptive.NodeBudget(spec.verification.max_nodes, self.k) if self.adaptive else None
        self.depth[seq] = depth

    def block_inputs(self, seqs: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Tree mode: the caps int32 ``[B, K]`` and node budgets int32 ``[B]`` of rows ``seqs`` for the next block."""
        if not self.tree:
            return None, None
        caps = np.stack([self.caps[s].caps() for s in seqs]).astype(np.int32)
        budget = np.array([self.nodes if self.budget[s] is None else self.budget[s].budget for s in seqs], np.int32)
        return caps, budget

    def observe(self, seq: int, m: int, depth: tuple[int, int] | None = None) -> None:
        """Book sequence ``seq``'s verification: ``m`` accepted drafts; ``depth``: the adaptive chain depth and
        floor after it, as the device decided them."""
        if self.tree:
            self.caps[seq].record(m)
            if self.budget[seq] is not None:
                self.budget[seq].observe(m)
        elif depth is not None:
            self.depth[seq] = depth

    def report(self, real: int) -> dict[str, Any] | None:
        if self.tree:
            return {"per_sequence": [{"branching": self.caps[i].snapshot(),
                                      "node_budget": self.budget[i].snapshot() if self.budget[i] else None}
                                     for i in range(real)]}
        if self.adaptive:
            return {"per_sequence": [{"depth": d[0], "floor": d[1]} for d in self.depth[:real]]}
        return None
