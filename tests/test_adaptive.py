"""Adaptive controllers: hazard branching caps, static policies and node budget (host side), and the adaptive chain
depth (decided on the device, :func:`diffspec_jax.engine.loop.depth_observe`, checked here against a float
reference written from docs/method.md section 8)."""

import functools
import itertools
import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffspec_jax.adaptive import (
    BRANCHING_POLICIES,
    DEPTH_BAD_COUNT,
    DEPTH_BAD_FRAC,
    DEPTH_GOOD_COUNT,
    DEPTH_GOOD_FRAC,
    HazardProfile,
    NodeBudget,
    check_branching,
    make_caps_controller,
    static_caps,
)
from diffspec_jax.config import SpecConfig
from diffspec_jax.engine.loop import depth_observe, start_depth
from diffspec_jax.errors import ConfigError

# ---------------------------------------------------------------------------------------------------------------
# independent re-computations (plain loops, written from docs/method.md sections 8 and 9, not from the module)


def ref_hazard_caps(stops, max_depth, width):
    """Profile and caps after booking ``stops``, recomputed with Python lists."""
    profile = [1.0 / max_depth] * max_depth
    window = []
    for s in stops:
        window.append(min(s, max_depth - 1))
        window = window[-50:]
        hist = [window.count(d) / len(window) for d in range(max_depth)]
        profile = [0.2 * h + 0.8 * p for h, p in zip(hist, profile)]
    if len(stops) < 5 or len(window) < 3 or max(profile) < 1.5 / max_depth:
        return profile, [width] * max_depth
    weights = [1.0 + d / (max_depth - 1) for d in range(max_depth)] if max_depth > 1 else [1.0]
    utility = [p * w for p, w in zip(profile, weights)]
    peaks = sorted(range(max_depth), key=lambda d: (-utility[d], d))[:2]
    caps = [1] * max_depth
    for p in peaks:
        for q in (p - 1, p + 1):
            if 0 <= q < max_depth and q not in peaks:
                caps[q] = max(1, width // 2)
    for p in peaks:
        caps[p] = width
    caps[0] = width
    return profile, caps


def ref_budgets(accepts, max_nodes, max_depth, warmup=10):
    """Budget after each observation (round_to 4), recomputed with Python floats."""
    def r4(x):
        return int(np.floor(x / 4 + 0.5)) * 4

    base = min(max_nodes, max(1, r4(max_nodes / 1.5)))
    top = max(base, max_nodes // 4 * 4)
    budget, out = base, []
    for step in range(1, len(accepts) + 1):
        if step > warmup:
            last = accepts[max(0, step - 10):step]
            late = min(max((step - warmup) / 10, 0.0), 1.0)
            gap = min(max((max_depth - sum(last) / len(last)) / max_depth, 0.0), 1.0)
            h = len(last) // 2
            rise = (sum(last[h:]) / len(last[h:]) - sum(last[:h]) / h) if h else 0.0
            trend = min(max(0.5 - rise / max_depth, 0.0), 1.0)
            pressure = min(max(0.7 * late + 0.2 * gap + 0.1 * trend, 0.0), 1.0)
            cand = min(max(r4(base + (max_nodes - base) * pressure), base), top)
            budget = max(budget, cand)
        out.append(budget)
    return out


# ---------------------------------------------------------------------------------------------------------------
# hazard profile


def test_hazard_warmup_full_width_before_five_updates():
    h = HazardProfile(6, 8)
    assert h.caps().tolist() == [8] * 6
    for _ in range(4):
        h.record(3)
        assert h.caps().tolist() == [8] * 6
    h.record(3)
    # profile[3] = 1 - (5/6) 0.8^5 ~ 0.727; the rest tie at (1/6) 0.8^5, so utility picks the deepest: depth 5
    assert h.caps().tolist() == [8, 1, 4, 8, 4, 8]
    assert h.caps().dtype == np.int32


def test_hazard_flat_profile_keeps_full_width():
    h = HazardProfile(6, 8)
    for i in range(200):
        h.record(i % 6)
        # the first few windows are lopsided toward depth 0 (one entry is 100 %); from ten stops on it is flat
        if i >= 10:
            assert h.profile.max() < 1.5 / 6
            assert h.caps().tolist() == [8] * 6


def test_hazard_peaks_golden():
    h = HazardProfile(6, 8)
    stops = [3, 4] * 30
    for s in stops:
        h.record(s)
    # profile -> ~0.5 at depths 3 and 4; utility 0.5*1.6 < 0.5*1.8: peaks {4, 3} full, neighbours 2 and 5 half,
    # depth 1 chain-like, depth 0 always full
    assert h.caps().tolist() == [8, 1, 4, 8, 8, 4]
    profile, caps = ref_hazard_caps(stops, 6, 8)
    assert h.caps().tolist() == caps
    np.testing.assert_allclose(h.profile, profile, rtol=1e-12)


def test_hazard_full_depth_accept_stored_at_last_depth():
    a, b = HazardProfile(6, 8), HazardProfile(6, 8)
    for i in range(10):
        a.record(6 + i % 3)  # full-depth accepts (and beyond)
        b.record(5)
    np.testing.assert_array_equal(a.profile, b.profile)
    # mass at depth 5; the rest tie, deeper weighs more: peaks 5 and 4, neighbour 3 at half width
    assert a.caps().tolist() == [8, 1, 1, 4, 8, 8]


def test_hazard_window_capped_and_profile_normalised():
    h = HazardProfile(7, 5)
    rng = np.random.default_rng(0)
    for s in rng.integers(0, 8, 120):
        h.record(int(s))
        assert abs(h.profile.sum() - 1.0) < 1e-12
    snap = h.snapshot()
    assert snap["window_len"] == 50 and snap["updates"] == 120
    assert json.loads(json.dumps(snap)) == snap
    assert snap["caps"] == h.caps().tolist() and len(snap["profile"]) == 7


@pytest.mark.parametrize("seed", range(6))
def test_hazard_matches_reference_on_random_streams(seed):
    rng = np.random.default_rng(seed)
    max_depth, width = int(rng.integers(1, 11)), int(rng.integers(1, 17))
    centre = rng.integers(0, max_depth + 1)
    stops = np.clip(rng.normal(centre, rng.uniform(0.3, 3.0), 80).round(), 0, max_depth + 2).astype(int).tolist()
    h = HazardProfile(max_depth, width)
    for n, s in enumerate(stops, 1):
        h.record(s)
        profile, caps = ref_hazard_caps(stops[:n], max_depth, width)
        got = h.caps()
        assert got.tolist() == caps
        np.testing.assert_allclose(h.profile, profile, rtol=1e-9, atol=1e-15)
        assert got[0] == width and set(got.tolist()) <= {1, max(1, width // 2), width}


# ---------------------------------------------------------------------------------------------------------------
# static policies and the factory


@pytest.mark.parametrize("policy, expected", [
    ("full", [8, 8, 8, 8, 8]),
    ("chain", [1, 1, 1, 1, 1]),
    ("uniform2", [2, 2, 2, 2, 2]),
    ("uniform1", [1, 1, 1, 1, 1]),
    ("uniform20", [8, 8, 8, 8, 8]),
    ("shallow", [8, 8, 4, 1, 1]),
    ("deep", [8, 4, 4, 4, 4]),
])
def test_static_caps(policy, expected):
    caps = static_caps(policy, 5, 8)
    assert caps.dtype == np.int32 and caps.tolist() == expected


def test_static_caps_small_shapes():
    assert static_caps("shallow", 2, 8).tolist() == [8, 8]
    assert static_caps("shallow", 4, 1).tolist() == [1, 1, 1, 1]
    assert static_caps("deep", 3, 1).tolist() == [1, 1, 1]
    assert static_caps("deep", 1, 6).tolist() == [6]
    with pytest.raises(ConfigError, match="adaptive"):
        static_caps("hazard", 5, 8)


def test_check_branching():
    for p in BRANCHING_POLICIES + ("uniform1", "uniform16"):
        assert check_branching(p) == p
    for bad in ("uniform0", "uniform", "uniformx", "uniform-1", "Hazard", "", " full", "tree", None, 3):
        with pytest.raises(ConfigError, match=r"hazard, full, chain, shallow, deep or uniform<N>"):
            check_branching(bad)


def test_make_caps_controller():
    assert isinstance(make_caps_controller("hazard", 5, 8), HazardProfile)
    c = make_caps_controller("chain", 5, 8)
    for s in (0, 3, 5, 9):
        c.record(s)
    assert c.caps().tolist() == [1] * 5
    snap = c.snapshot()
    assert snap == {"policy": "chain", "updates": 4, "caps": [1] * 5}
    assert json.loads(json.dumps(snap)) == snap
    with pytest.raises(ConfigError):
        c.record(-1)
    with pytest.raises(ConfigError):
        make_caps_controller("wide", 5, 8)


# ---------------------------------------------------------------------------------------------------------------
# node budget


@pytest.mark.parametrize("max_nodes, base", [(48, 32), (50, 32), (16, 12), (32, 20), (4, 4), (5, 4), (3, 3), (2, 1)])
def test_node_budget_base(max_nodes, base):
    nb = NodeBudget(max_nodes, 6)
    assert nb.base == base and nb.budget == base


def test_node_budget_golden_low_accepts():
    nb = NodeBudget(48, 6)
    got = [nb.observe(0) for _ in range(22)]
    # warm-up holds 32; then pressure = 0.7 late + 0.2 (gap 1) + 0.05 (flat trend), e.g. step 11: 0.32 ->
    # 32 + 16 * 0.32 = 37.1 -> 36
    assert got == [32] * 10 + [36, 40, 40, 40, 40, 44, 44, 44, 48, 48, 48, 48]
    snap = nb.snapshot()
    assert snap["budget"] == 48 and snap["steps"] == 22 and json.loads(json.dumps(snap)) == snap


def test_node_budget_top_is_a_multiple_of_four():
    nb = NodeBudget(50, 10)
    for _ in range(40):
        nb.observe(0)
    assert nb.budget == 48


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("max_nodes", [16, 32, 48, 50])
def test_node_budget_properties(seed, max_nodes):
    rng = np.random.default_rng(seed)
    max_depth = int(rng.integers(3, 11))
    accepts = rng.integers(0, max_depth + 1, 120).tolist()
    nb = NodeBudget(max_nodes, max_depth)
    got = [nb.observe(a) for a in accepts]
    assert got[:10] == [nb.base] * 10
    assert all(b2 >= b1 for b1, b2 in itertools.pairwise(got))
    assert all(b % 4 == 0 and nb.base <= b <= max_nodes for b in got)
    assert got == ref_budgets(accepts, max_nodes, max_depth)


def test_node_budget_grows_after_warmup_when_accepts_are_low():
    rng = np.random.default_rng(7)
    nb = NodeBudget(48, 8)
    for _ in range(10):
        nb.observe(int(rng.integers(0, 2)))
    assert nb.budget == nb.base
    for _ in range(5):
        nb.observe(int(rng.integers(0, 2)))
    assert nb.budget > nb.base


# ---------------------------------------------------------------------------------------------------------------
# adaptive chain depth


class FloatDepth:
    """Reference: docs/method.md section 8 as floats, one sequence (a cycle's accepted share ``(emitted - 1) / depth``
    against the decimal thresholds)."""

    def __init__(self, k: int, threshold: int = 49152, lcd: int = 2):
        self.k, self.threshold, self.lcd = k, threshold, lcd

    def start(self, length: int) -> int:
        self.floor = self.lcd if length >= self.threshold else self.k
        self.depth, self.good, self.bad = self.floor, 0, 0
        return self.depth

    def observe(self, emitted: int, length: int) -> int:
        self.floor = self.lcd if length >= self.threshold else self.k
        frac = max(0, emitted - 1) / self.depth
        good, bad = frac >= DEPTH_GOOD_FRAC, frac <= DEPTH_BAD_FRAC
        self.good, self.bad = (self.good + 1, 0) if good else (0, self.bad + 1) if bad else (0, 0)
        if self.good >= DEPTH_GOOD_COUNT and self.depth < self.k:
            self.depth, self.good = self.depth + 1, 0
        if self.bad >= DEPTH_BAD_COUNT and self.depth > self.floor:
            self.depth, self.bad = self.depth - 1, 0
        self.depth = max(self.depth, self.floor)
        return self.depth


@functools.lru_cache(maxsize=None)
def _device_depth(k: int, threshold: int, lcd: int):
    spec = SpecConfig.from_flat(dict(num_speculative_tokens=k, diffspec_adaptive_profile=True,
                                     diffspec_long_context_threshold=threshold, diffspec_long_context_depth=lcd))
    plan = SimpleNamespace(spec=spec, k=k)
    return plan, jax.jit(lambda dc, active, m, length: depth_observe(plan, dc, active, m, length))


class DeviceDepth:
    """The device's adaptive depth (:func:`start_depth`, :func:`depth_observe`) for one sequence, called like the
    reference."""

    def __init__(self, k: int, threshold: int = 49152, lcd: int = 2):
        self.plan, self._observe = _device_depth(k, threshold, lcd)

    def start(self, length: int) -> int:
        self.dc = start_depth(self.plan, np.array([length], np.int32))
        return self.depth

    def observe(self, emitted: int, length: int) -> int:
        self.dc = self._observe(self.dc, jnp.ones(1, bool), jnp.array([emitted - 1], jnp.int32),
                                jnp.array([length], jnp.int32))
        return self.depth

    @property
    def depth(self) -> int:
        return int(self.dc.depth[0])

    @property
    def floor(self) -> int:
        return int(self.dc.floor[0])


@pytest.mark.parametrize("make", [DeviceDepth, FloatDepth])
def test_adaptive_depth_vector(make):
    ad = make(5)
    assert ad.start(32768) == 5
    assert ad.start(65536) == 2
    got = [ad.observe(3, 65536 + 3 * (i + 1)) for i in range(4)]
    assert got == [2, 2, 2, 3]
    got = [ad.observe(1, 65548 + i + 1) for i in range(3)]
    assert got == [3, 3, 2] and ad.depth == 2


def test_adaptive_depth_short_context_stays_at_k():
    ad = DeviceDepth(5)
    assert ad.start(100) == 5
    for e in [1] * 10 + [6] * 10 + [1] * 5:
        assert ad.observe(e, 200) == 5


def test_adaptive_depth_middle_share_resets_counts():
    ad = DeviceDepth(5)
    ad.start(60000)
    assert [ad.observe(3, 60000) for _ in range(3)] == [2, 2, 2]
    assert ad.observe(2, 60000) == 2  # frac 0.5: neither good nor bad, counts reset
    assert [ad.observe(3, 60000) for _ in range(4)] == [2, 2, 2, 3]


def test_adaptive_depth_threshold_crossing_lowers_floor():
    ad = DeviceDepth(5)
    assert ad.start(49000) == 5 and ad.floor == 5
    assert ad.observe(6, 49100) == 5 and ad.floor == 5
    assert ad.observe(6, 49152) == 5 and ad.floor == 2  # crossing alone does not drop the depth
    assert [ad.observe(1, 49200 + i) for i in range(12)] == [5, 5, 4, 4, 4, 3, 3, 3, 2, 2, 2, 2]


@pytest.mark.parametrize("seed", range(3))
def test_device_depth_decides_what_the_reference_decides(seed):
    """Random streams over a batch (rows idle at times, good and bad stretches, lengths crossing the threshold):
    the device's depth and floor equal the float reference's after every cycle, and depths move both ways."""
    plan, observe = _device_depth(5, 120, 2)
    rng = np.random.default_rng(seed)
    b = 6
    length = rng.integers(40, 160, b)
    host = [FloatDepth(5, 120, 2) for _ in range(b)]
    for h, n in zip(host, length):
        h.start(int(n))
    dc = start_depth(plan, length.astype(np.int32))
    assert np.asarray(dc.depth).tolist() == [h.depth for h in host]
    seen = set()
    share = rng.random(b)
    for _ in range(300):
        active = rng.random(b) < 0.9
        share = np.where(rng.random(b) < 0.1, rng.random(b), share)  # good and bad stretches
        depth = np.asarray(dc.depth)
        m = np.minimum(depth, rng.binomial(depth, share))
        length = length + np.where(active, m + 1, 0)
        dc = observe(dc, jnp.asarray(active), jnp.asarray(m, jnp.int32), jnp.asarray(length, jnp.int32))
        for i in np.nonzero(active)[0]:
            host[i].observe(int(m[i]) + 1, int(length[i]))
        assert np.asarray(dc.depth).tolist() == [h.depth for h in host]
        assert np.asarray(dc.floor).tolist() == [h.floor for h in host]
        seen.update((i, h.depth) for i, h in enumerate(host))
    assert len({d for _, d in seen}) >= 3  # depths moved both ways


def test_invalid_arguments_raise_config_error():
    bad_calls = [
        lambda: NodeBudget(0, 5),
        lambda: NodeBudget(8, 0),
        lambda: NodeBudget(8, 5, warmup=-1),
        lambda: NodeBudget(8, 5, round_to=0),
        lambda: NodeBudget(8, 5).observe(-1),
        lambda: HazardProfile(0, 4),
        lambda: HazardProfile(4, 0),
        lambda: HazardProfile(4, 4).record(-1),
        lambda: HazardProfile(4, 4).record(1.0),
        lambda: static_caps("full", 0, 4),
        lambda: static_caps("full", 4, 0),
    ]
    for call in bad_calls:
        with pytest.raises(ConfigError):
            call()
