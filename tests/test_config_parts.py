"""SpecConfig by feature: each part validates its own fields where it is built, SpecConfig the rules that join
parts, and the seed plugin's flat keys build the same objects (SpecConfig.from_flat); the runtime Session keeps
programs and prepared params per plan / model."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from diffspec_jax import Chain, DiffSpec, Full, Recent, SamplingConfig, SpecConfig, Tree, make_mesh
from diffspec_jax.config import FLAT_KEYS, default_kernels
from diffspec_jax.engine import Plan, Session
from diffspec_jax.errors import ConfigError


def test_parts_validate_their_own_fields():
    with pytest.raises(ConfigError, match="diffspec_chunk_size must be a positive integer, got 0"):
        DiffSpec(chunk_size=0)
    with pytest.raises(ConfigError, match=r"diffspec_token_budget \(100\) must be a multiple of diffspec_chunk_size"):
        Recent(token_budget=100, chunk_size=64)
    with pytest.raises(ConfigError, match="diffspec_scorer must be one of"):
        DiffSpec(scorer="max")
    with pytest.raises(ConfigError, match="diffspec_keep_sink_chunk must be True or False"):
        DiffSpec(keep_sink_chunk=1)
    with pytest.raises(ConfigError, match=r"diffspec_tree_topk \(9\) must be <= diffspec_max_tree_nodes \(8\)"):
        Tree(max_nodes=8, topk=9)
    with pytest.raises(ConfigError, match="diffspec_max_tree_nodes must be in"):
        Tree(max_nodes=256)
    with pytest.raises(ConfigError, match="diffspec_tree_branching"):
        Tree(branching="wide")
    with pytest.raises(ConfigError, match="diffspec_long_context_depth must be a positive integer"):
        Chain(long_context_depth=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        DiffSpec().chunk_size = 8  # type: ignore[misc]


def test_spec_config_checks_what_joins_parts():
    with pytest.raises(ConfigError, match="context must be Full"):
        SpecConfig(context="diffspec")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="verification must be Chain"):
        SpecConfig(verification=Full())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"diffspec_max_tree_nodes must be in \[num_speculative_tokens \(4\)"):
        SpecConfig(verification=Tree(max_nodes=3, topk=2))
    with pytest.raises(ConfigError, match="applies to chain mode only"):
        SpecConfig(verification=Tree(), draft_sampling="sample")
    with pytest.raises(ConfigError, match=r"diffspec_long_context_depth \(3\) must be <= num_speculative_tokens"):
        SpecConfig(num_speculative_tokens=2, verification=Chain(adaptive=True, long_context_depth=3))
    SpecConfig(num_speculative_tokens=2, verification=Chain(long_context_depth=3))  # only the adaptive depth uses it
    with pytest.raises(ConfigError, match="must be >= 128"):  # two chunks with the sink chunk
        SpecConfig(num_speculative_tokens=3, context=DiffSpec(token_budget=128, keep_sink_chunk=True))
    s = SpecConfig(num_speculative_tokens=3, context=Recent(token_budget=128))
    assert (s.history_budget, s.max_chunks, s.uses_working_cache, s.tree) == (64, 1, True, False)
    assert (SpecConfig().history_budget, SpecConfig().max_chunks, SpecConfig().uses_working_cache) == (0, 0, False)


def test_from_flat_builds_the_parts():
    flat = dict(num_speculative_tokens=3, draft_context_policy="diffspec", diffspec_chunk_size=16,
                diffspec_token_budget=256, diffspec_retrieval_interval=2, diffspec_adaptive_profile=True,
                diffspec_scorer="salience", diffspec_verification_mode="tree", diffspec_max_tree_nodes=20,
                diffspec_tree_topk=4, diffspec_tree_branching="full", kernels="reference")
    spec = SpecConfig.from_flat(flat)
    assert spec == SpecConfig(num_speculative_tokens=3, kernels="reference",
                              context=DiffSpec(chunk_size=16, token_budget=256, retrieval_interval=2, adaptive=True,
                                               scorer="salience"),
                              verification=Tree(max_nodes=20, topk=4, branching="full", adaptive=True))
    assert hash(spec) == hash(SpecConfig.from_flat(dict(flat)))
    # every flat key is accepted; the defaults are the parts' defaults
    assert SpecConfig.from_flat({}) == SpecConfig()
    assert SpecConfig.from_flat({"draft_context_policy": "recent", "diffspec_verification_mode": "linear"}) == \
        SpecConfig(context=Recent(), verification=Chain())
    assert SpecConfig.from_flat({"deterministic": True}) == SpecConfig(deterministic=True)
    with pytest.raises(ConfigError, match="deterministic covers chains at a fixed depth"):
        SpecConfig.from_flat({"deterministic": True, "diffspec_adaptive_profile": True})
    with pytest.raises(ConfigError, match="deterministic"):
        SpecConfig(deterministic="yes")
    assert len(FLAT_KEYS) == 25
    # values the chosen parts do not use are still checked (as the flat class did), then dropped
    with pytest.raises(ConfigError, match="diffspec_retrieval_interval must be a positive integer"):
        SpecConfig.from_flat({"draft_context_policy": "full", "diffspec_retrieval_interval": 0})
    assert SpecConfig.from_flat({"diffspec_max_tree_nodes": 3}).verification == Chain()
    with pytest.raises(ConfigError, match=r"unknown speculative config key\(s\) \['diffspec_chunk'\]"):
        SpecConfig.from_flat({"diffspec_chunk": 64})
    with pytest.raises(ConfigError, match="must be a dict"):
        SpecConfig.from_flat([("num_speculative_tokens", 3)])


def test_kernels_default_comes_from_the_environment_once(monkeypatch):
    monkeypatch.setenv("DIFFSPEC_KERNELS", "pallas")
    spec = SpecConfig()
    monkeypatch.setenv("DIFFSPEC_KERNELS", "reference")
    assert spec.kernels == "pallas" and SpecConfig().kernels == "reference"
    assert default_kernels({}) == "auto" and default_kernels({"DIFFSPEC_KERNELS": " Pallas "}) == "pallas"


def test_session_keeps_programs_and_prepared_params(targets):
    """Programs per plan (the kernel choice is part of the key), prepared params per (model, mesh, tp); a new
    session starts empty."""
    cfg = targets["llama"].config
    plan = Plan(target=cfg, draft=None, spec=SpecConfig(kernels="reference"), sampling=SamplingConfig(),
                aux_layers=(), capacity=128)
    other = dataclasses.replace(plan, spec=SpecConfig(kernels="pallas"))
    assert (plan.kernels, other.kernels) == ("reference", "pallas")
    a, b = Session(), Session()
    assert a.programs(plan) is a.programs(plan) and a.programs(plan) is not a.programs(other)
    assert a.programs(plan) is not b.programs(plan)
    small = Session(max_plans=1)
    first = small.programs(plan)
    small.programs(other)
    assert small.programs(plan) is not first  # the least recently used plan was dropped
    mesh = make_mesh(2)
    p1 = a.prepare(targets["llama"], mesh, 2)
    assert a.prepare(targets["llama"], mesh, 2) is p1 and b.prepare(targets["llama"], mesh, 2) is not p1
    np.testing.assert_array_equal(np.asarray(p1["embed"]), np.asarray(b.prepare(targets["llama"], mesh, 2)["embed"]))
