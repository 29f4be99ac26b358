"""Drafters as plug-ins: a toy drafter defined here, registered by one line, passes the lossless checks every
drafter passes (greedy equality with target-only decoding; a sampling chi-square); the draft-context policy's name
and type are tested in config.py alone."""

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
import pytest

import diffspec_jax
from conftest import random_prompts
from diffspec_jax import SamplingConfig, SpecConfig, engine, forward, generate
from diffspec_jax.config import DRAFT_CONTEXT_POLICIES
from diffspec_jax.engine.drafter import DRAFTERS
from diffspec_jax.engine.drafting import Drafter, Proposal, zero_rows
from diffspec_jax.errors import ConfigError
from diffspec_jax.sampling import processed_logprobs
from test_self_draft import CAPACITY, micro, prefilled, sampled_cycles  # noqa: F401 (micro: a fixture)


# ------------------------------------------------------------------------------------------- the toy drafter
@dataclass(frozen=True)
class RepeatLast(Drafter):
    """Proposes the newest token ``depth`` times (no model, no state of its own: the protocol's defaults)."""

    name: ClassVar[str] = "repeat-last"

    def propose(self, plan, tparams, dparams, state, active, key, depth):
        drafts = jnp.broadcast_to(state.last_token[:, None], (state.length.shape[0], depth))
        return Proposal(drafts, None, state, zero_rows(state), zero_rows(state))


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(DRAFTERS, RepeatLast.name, RepeatLast())  # registered for this test only
    return RepeatLast.name


def test_toy_drafter_greedy_output_equals_target_only(toy, targets):
    """Selected by its name like ``"ngram"``: the target's own tokens, K drafted per cycle, some accepted (the random
    tiny target repeats itself), under both cycle programs (fixed and adaptive depth)."""
    prompts = random_prompts(11, (30, 52))
    base = generate(targets["llama"], None, prompts, max_new_tokens=40, stop_token_ids=()).tokens
    for flat in (dict(num_speculative_tokens=3), dict(num_speculative_tokens=3, diffspec_adaptive_profile=True,
                                                      diffspec_long_context_threshold=1, diffspec_long_context_depth=2)):
        res = generate(targets["llama"], toy, prompts, max_new_tokens=40, stop_token_ids=(),
                       spec=SpecConfig.from_flat(flat))
        assert res.tokens == base
        s = res.stats
        assert s.num_speculative_tokens == 3 and s.drafted_tokens >= 2 * s.sequence_cycles > 0
        assert s.accepted_tokens > 0 and s.draft_context_policy is None
    with pytest.raises(ConfigError, match="'repeat-last' proposes chains"):
        generate(targets["llama"], toy, prompts, max_new_tokens=4,
                 spec=SpecConfig.from_flat(dict(diffspec_verification_mode="tree", num_speculative_tokens=3)))


def test_toy_drafter_sampling_keeps_the_target_distribution(micro):  # noqa: F811
    """24,000 sampled cycles of one context whose last token x the target repeats with probability p(x) far from 0
    and 1: the first emitted token follows the target's processed distribution (chi-square), and the first draft
    (x) is accepted as often as p(x) says, so the cycle verified the toy's proposal."""
    from test_verification import chi_square_pvalue

    prompt = random_prompts(4, [60], vocab=64)[0]
    sampling = SamplingConfig(temperature=0.9)
    logits = forward(micro, [prompt + [x] for x in range(64)])[:, -1]  # every candidate x at once
    probs = np.exp(np.asarray(processed_logprobs(logits, sampling), np.float64))
    x = int(np.argmin(np.abs(probs[np.arange(64), np.arange(64)] - 0.5)))  # p(x | ..., x) nearest 1/2
    p = probs[x] / probs[x].sum()
    assert 0.1 < p[x] < 0.9
    plan = engine.Plan(target=micro.config, draft=None, spec=SpecConfig(num_speculative_tokens=2), sampling=sampling,
                       aux_layers=(), capacity=CAPACITY, drafter=RepeatLast())
    base, _ = prefilled(plan, micro, [prompt])
    base = base.replace(last_token=jnp.full((1,), x, jnp.int32))
    firsts, accepted = sampled_cycles(plan, micro, base)
    counts = np.bincount(firsts.ravel(), minlength=p.shape[0])
    assert chi_square_pvalue(counts, p) > 1e-3
    assert abs(np.mean(accepted) - p[x]) < 0.02


def test_registering_in_a_test_does_not_leak():
    """The fixture's registration is undone (tests in any order see the built-in drafters only)."""
    assert RepeatLast.name not in DRAFTERS
    assert set(DRAFTERS) >= {"eagle3", "self", "ngram"}
    with pytest.raises(ConfigError, match="got 'repeat-last'"):
        generate(None, RepeatLast.name, [[1]], max_new_tokens=1)


# --------------------------------------------------------------------------- the draft-context policy object
CONTEXT_TYPES = {"Full", "Recent", "DiffSpec", "_WorkingCache", "_Context", "DraftCache", "WorkingSet"}


def _policy_tests(tree: ast.AST) -> list[str]:
    """Where a module tests the draft-context policy by name (a comparison of a policy name with something read
    from a ``context`` or ``policy``; a literal list of the names) or by type (``isinstance`` against a policy or
    a draft-cache class)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            named = any(isinstance(p, ast.Constant) and p.value in DRAFT_CONTEXT_POLICIES for p in parts)
            read = any(isinstance(a, ast.Attribute) and a.attr in ("context", "policy")
                       for p in parts for a in ast.walk(p))
            if named and read:
                found.append(f"line {node.lineno}: compares a policy name")
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            if {getattr(e, "value", None) for e in node.elts} >= set(DRAFT_CONTEXT_POLICIES):
                found.append(f"line {node.lineno}: lists the policy names")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
            types = {getattr(n, "id", getattr(n, "attr", None)) for n in ast.walk(node.args[1])}
            if types & CONTEXT_TYPES:
                found.append(f"line {node.lineno}: isinstance against {sorted(types & CONTEXT_TYPES)}")
    return found


def test_the_policy_is_tested_by_name_or_type_in_config_only():
    """Every other library module asks the policy object (``spec.context.working_cache``, ``.retrieves``,
    ``.history_slots(k)`` ...) or the drafter; the check itself finds a planted test."""
    root = Path(diffspec_jax.__file__).parent
    where = {str(path.relative_to(root)): hits for path in sorted(root.rglob("*.py"))
             if (hits := _policy_tests(ast.parse(path.read_text())))}
    assert set(where) == {"config.py"}, where
    planted = "if spec.context.policy == 'recent' or isinstance(state.draft_cache, WorkingSet):\n    pass\n"
    assert len(_policy_tests(ast.parse(planted))) == 2
