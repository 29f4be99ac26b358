"""Host-side per-sequence controllers for tree drafting (no JAX), and the adaptive chain depth's constants.

The tree controllers run on the host between device blocks, one instance per sequence (or request slot), so every
tensor-parallel rank acts on the same decision:

* :class:`HazardProfile` -- hazard-guided branching caps for tree mode (docs/method.md section 9);
* :func:`static_caps` / :func:`make_caps_controller` -- the static branching alternatives and a common factory;
* :class:`NodeBudget` -- the tree node budget that grows with observed pressure and never shrinks (section 9).

The adaptive chain depth with its long-context floor (section 8) is decided on the device, by its one definition,
:func:`diffspec_jax.engine.loop.depth_observe`, with the ``DEPTH_*`` constants below.

Frozen constants (docs/method.md section 10, "Fixed constants"):

* hazard profile: window of the last ``HAZARD_WINDOW`` (50) stops, EWMA weight ``HAZARD_ALPHA`` (0.2) on the new
  histogram, ``HAZARD_PEAKS`` (2) full-width peaks, warm-up until ``HAZARD_WARMUP_UPDATES`` (5) updates and
  ``HAZARD_WARMUP_ENTRIES`` (3) window entries, flat when ``max(profile) < HAZARD_FLATNESS (1.5) / max_depth``,
  utility weights ``linspace(*HAZARD_DEPTH_WEIGHTS, max_depth)`` = 1 .. 2 (deeper stops count more);
* node budget: base ``max_nodes / BUDGET_BASE_DIVISOR`` (1.5), pressure window ``BUDGET_WINDOW`` (10) and weights
  ``BUDGET_WEIGHTS`` = (late 0.7, gap 0.2, trend 0.1), trend offset ``BUDGET_TREND_OFFSET`` (0.5);
* adaptive depth: a cycle is good at accepted share >= ``DEPTH_GOOD_FRAC`` (0.8), bad at <= ``DEPTH_BAD_FRAC``
  (0.35); ``DEPTH_GOOD_COUNT`` (4) good cycles in a row deepen by one, ``DEPTH_BAD_COUNT`` (3) bad ones shorten.
"""

from __future__ import annotations

import math
import operator
import re
from collections import deque
from typing import Any, Protocol

import numpy as np

from diffspec_jax.errors import ConfigError

HAZARD_WINDOW = 50
HAZARD_ALPHA = 0.2
HAZARD_PEAKS = 2
HAZARD_WARMUP_UPDATES = 5
HAZARD_WARMUP_ENTRIES = 3
HAZARD_FLATNESS = 1.5
HAZARD_DEPTH_WEIGHTS = (1.0, 2.0)

BUDGET_BASE_DIVISOR = 1.5
BUDGET_WINDOW = 10
BUDGET_WEIGHTS = (0.7, 0.2, 0.1)
BUDGET_TREND_OFFSET = 0.5

DEPTH_GOOD_FRAC = 0.8
DEPTH_BAD_FRAC = 0.35
DEPTH_GOOD_COUNT = 4
DEPTH_BAD_COUNT = 3

#: named branching policies; ``uniform<N>`` (N a positive integer) is accepted as well
BRANCHING_POLICIES = ("hazard", "full", "chain", "shallow", "deep")

_UNIFORM = re.compile(r"uniform([0-9]+)")


def _int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as a Python int (numpy integers accepted; bools and floats rejected) within the bounds."""
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    try:
        out = operator.index(value)
    except TypeError:
        raise ConfigError(f"{name} must be an integer, got {value!r}") from None
    if minimum is not None and out < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {out}")
    if maximum is not None and out > maximum:
        raise ConfigError(f"{name} must be <= {maximum}, got {out}")
    return out


def _round_multiple(x: float, m: int) -> int:
    """``x`` rounded to the nearest multiple of ``m`` (halves round up)."""
    return math.floor(x / m + 0.5) * m


def check_branching(policy: str) -> str:
    """Validate a branching policy name and return it; raises :class:`ConfigError` naming the allowed values."""
    if isinstance(policy, str):
        if policy in BRANCHING_POLICIES:
            return policy
        match = _UNIFORM.fullmatch(policy)
        if match and int(match.group(1)) >= 1:
            return policy
    raise ConfigError(f"branching policy must be one of {', '.join(BRANCHING_POLICIES)} or uniform<N> "
                      f"(N a positive integer, e.g. uniform2), got {policy!r}")


def static_caps(policy: str, max_depth: int, width: int) -> np.ndarray:
    """Per-depth child caps ``int32 [max_depth]`` of a static branching policy (every policy but ``hazard``).

    ``full``: ``width`` everywhere; ``chain``: 1 everywhere (the tree degenerates to a chain); ``uniformN``:
    ``min(N, width)`` everywhere; ``shallow``: ``width`` at depths 0 and 1, ``max(1, width // 2)`` at depth 2 and 1
    deeper; ``deep``: ``width`` at depth 0 and ``max(1, width // 2)`` at every deeper depth.
    """
    if check_branching(policy) == "hazard":
        raise ConfigError("static_caps: 'hazard' is adaptive; use HazardProfile or make_caps_controller")
    max_depth = _int("max_depth", max_depth, 1)
    width = _int("width", width, 1)
    half = max(1, width // 2)
    caps = np.ones(max_depth, np.int32)
    if policy == "full":
        caps[:] = width
    elif policy == "shallow":
        caps[:2] = width
        caps[2:3] = half
    elif policy == "deep":
        caps[:] = half
        caps[0] = width
    elif policy != "chain":  # uniformN
        caps[:] = min(int(policy[len("uniform"):]), width)
    return caps


class CapsController(Protocol):
    """What the tree drafter needs from a branching policy: one instance per sequence."""

    def record(self, stop_depth: int) -> None: ...

    def caps(self) -> np.ndarray: ...

    def snapshot(self) -> dict[str, Any]: ...


class HazardProfile:
    """Hazard-guided branching allocator (docs/method.md section 9): spend width where verification tends to stop.

    ``record`` books each verification's stop depth (accepted length); ``caps`` turns the smoothed stop profile
    into per-depth child caps: full width at the two most useful depths (and at the root), half width next to
    them, a chain elsewhere.
    """

    def __init__(self, max_depth: int, width: int):
        self.max_depth = _int("max_depth", max_depth, 1)
        self.width = _int("width", width, 1)
        self._profile = np.full(self.max_depth, 1.0 / self.max_depth)
        self._window: deque[int] = deque(maxlen=HAZARD_WINDOW)
        self.updates = 0

    @property
    def profile(self) -> np.ndarray:
        """The smoothed stop-depth distribution ``float64 [max_depth]`` (a copy; sums to 1)."""
        return self._profile.copy()

    def record(self, stop_depth: int) -> None:
        """Book one verification's accepted length ``0..max_depth``; a full-depth accept counts as ``max_depth - 1``."""
        d = min(_int("stop_depth", stop_depth, 0), self.max_depth - 1)
        self._window.append(d)
        hist = np.bincount(np.asarray(self._window, np.int64), minlength=self.max_depth) / len(self._window)
        self._profile = HAZARD_ALPHA * hist + (1.0 - HAZARD_ALPHA) * self._profile
        self.updates += 1

    def caps(self) -> np.ndarray:
        """Children kept per frontier node at each tree depth, ``int32 [max_depth]`` (depth 0 = the root's)."""
        caps = np.full(self.max_depth, self.width, np.int32)
        if self.updates < HAZARD_WARMUP_UPDATES or len(self._window) < HAZARD_WARMUP_ENTRIES:
            return caps
        if self._profile.max() < HAZARD_FLATNESS / self.max_depth:
            return caps
        utility = self._profile * np.linspace(*HAZARD_DEPTH_WEIGHTS, self.max_depth)
        peaks = np.argsort(-utility, kind="stable")[:HAZARD_PEAKS]  # ties: lower depth first
        caps[:] = 1
        for p in peaks:
            for q in (p - 1, p + 1):
                if 0 <= q < self.max_depth and q not in peaks:
                    caps[q] = max(1, self.width // 2)
        caps[peaks] = self.width
        caps[0] = self.width
        return caps

    def snapshot(self) -> dict[str, Any]:
        """JSON-serialisable state: policy, profile, window length, update count and the current caps."""
        return {"policy": "hazard", "profile": [float(x) for x in self._profile], "window_len": len(self._window),
                "updates": self.updates, "caps": [int(c) for c in self.caps()]}


class _StaticCaps:
    """A static branching policy behind the :class:`CapsController` interface; ``record`` only counts."""

    def __init__(self, policy: str, max_depth: int, width: int):
        self.policy = policy
        self._caps = static_caps(policy, max_depth, width)
        self.updates = 0

    def record(self, stop_depth: int) -> None:
        _int("stop_depth", stop_depth, 0)
        self.updates += 1

    def caps(self) -> np.ndarray:
        return self._caps.copy()

    def snapshot(self) -> dict[str, Any]:
        return {"policy": self.policy, "updates": self.updates, "caps": [int(c) for c in self._caps]}


def make_caps_controller(policy: str, max_depth: int, width: int) -> CapsController:
    """A per-sequence branching controller: :class:`HazardProfile` for ``hazard``, a static one otherwise."""
    if check_branching(policy) == "hazard":
        return HazardProfile(max_depth, width)
    return _StaticCaps(policy, max_depth, width)


class NodeBudget:
    """Tree node budget that grows with observed pressure and never shrinks (docs/method.md section 9).

    It starts at ``base = round(max_nodes / 1.5)`` (a multiple of ``round_to``) and holds it for ``warmup``
    observations. Then pressure = 0.7 * late + 0.2 * gap + 0.1 * trend, each in [0, 1]: ``late`` ramps from 0 to 1
    over the 10 observations after warm-up; ``gap`` is how far the mean of the last 10 accept lengths falls short of
    ``max_depth``; ``trend`` is 0.5 minus the rise of the later half of those 10 over the earlier half (in units of
    ``max_depth``). The candidate ``base + (max_nodes - base) * pressure`` is rounded to a multiple of ``round_to``
    and clamped to ``[base, top]``, where ``top`` is the largest multiple of ``round_to`` <= ``max_nodes`` (so a
    budget of 50 nodes tops out at 48); the budget is the running maximum of the candidates. When ``max_nodes <
    round_to`` the budget never leaves ``base``.
    """

    def __init__(self, max_nodes: int, max_depth: int, warmup: int = 10, round_to: int = 4):
        self.max_nodes = _int("max_nodes", max_nodes, 1)
        self.max_depth = _int("max_depth", max_depth, 1)
        self.warmup = _int("warmup", warmup, 0)
        self.round_to = _int("round_to", round_to, 1)
        self.base = min(self.max_nodes, max(1, _round_multiple(self.max_nodes / BUDGET_BASE_DIVISOR, self.round_to)))
        self.top = max(self.base, (self.max_nodes // self.round_to) * self.round_to)
        self._budget = self.base
        self._recent: deque[int] = deque(maxlen=BUDGET_WINDOW)
        self.steps = 0
        self.pressure = 0.0

    @property
    def budget(self) -> int:
        """The current node budget."""
        return self._budget

    def observe(self, accept_length: int) -> int:
        """Book one verification's accept length (>= 0) and return the (possibly grown) budget."""
        self._recent.append(_int("accept_length", accept_length, 0))
        self.steps += 1
        if self.steps <= self.warmup:
            return self._budget
        recent = np.asarray(self._recent, np.float64)
        late = min(max((self.steps - self.warmup) / BUDGET_WINDOW, 0.0), 1.0)
        gap = min(max((self.max_depth - recent.mean()) / self.max_depth, 0.0), 1.0)
        half = len(recent) // 2
        rise = recent[half:].mean() - recent[:half].mean() if half else 0.0
        trend = min(max(BUDGET_TREND_OFFSET - rise / self.max_depth, 0.0), 1.0)
        w_late, w_gap, w_trend = BUDGET_WEIGHTS
        self.pressure = min(max(w_late * late + w_gap * gap + w_trend * trend, 0.0), 1.0)
        candidate = _round_multiple(self.base + (self.max_nodes - self.base) * self.pressure, self.round_to)
        candidate = min(max(candidate, self.base), self.top)
        self._budget = max(self._budget, candidate)
        return self._budget

    def snapshot(self) -> dict[str, Any]:
        """JSON-serialisable state: budget, base, top, max_nodes, observation count and the last pressure."""
        return {"budget": self._budget, "base": self.base, "top": self.top, "max_nodes": self.max_nodes,
                "steps": self.steps, "pressure": float(self.pressure)}
