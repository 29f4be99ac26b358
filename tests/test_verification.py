"""Chain verification: greedy acceptance, and rejection sampling that keeps the target distribution
(chi-square over >= 20,000 samples, with a deliberately broken verifier to show the test can fail)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffspec_jax import SamplingConfig
from diffspec_jax.sampling import processed_logprobs
from diffspec_jax.verification import greedy_accept, rejection_accept

N = 24_000
K = 3


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square goodness of fit; bins with expected count < 5 are pooled."""
    import torch

    expected = probs * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float(np.sum((obs[keep] - exp[keep]) ** 2 / exp[keep]))
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_greedy_accept_longest_prefix_plus_bonus():
    logits = np.full((2, 4, 10), -5.0, np.float32)
    for b, row in enumerate([[3, 1, 4, 1], [2, 7, 1, 8]]):
        logits[b, np.arange(4), row] = 5.0
    m, emitted = greedy_accept(jnp.asarray(logits), jnp.asarray([[3, 1, 9], [2, 7, 1]]))
    assert list(np.asarray(m)) == [2, 3]
    assert list(np.asarray(emitted[0, :3])) == [3, 1, 4]  # 2 accepted + the target's correction
    assert list(np.asarray(emitted[1])) == [2, 7, 1, 8]  # all accepted + bonus


@pytest.fixture(scope="module")
def target_rows(targets):
    """Processed target distributions of K + 1 consecutive positions of a fixed context (tiny Llama)."""
    from diffspec_jax import forward

    ctx = np.random.default_rng(9).integers(0, 256, (1, 20))
    logits = forward(targets["llama"], ctx)[0, -(K + 1):]
    sampling = SamplingConfig(temperature=0.9, top_k=60, top_p=0.95)
    return np.asarray(processed_logprobs(logits, sampling))  # [K+1, V]


def draft_distributions(kind: str, target_logp: np.ndarray) -> np.ndarray:
    v = target_logp.shape[-1]
    rng = np.random.default_rng(3)
    if kind == "random":
        logits = rng.standard_normal((K, v)) * 1.5
    else:  # skewed: piles mass on tokens the target considers unlikely, and on one token the target likes
        logits = -2.0 * target_logp[:K].clip(-30, 0) + rng.standard_normal((K, v)) * 0.1
        logits[:, int(np.argmax(target_logp[0]))] += 4.0
    q = np.exp(logits - logits.max(-1, keepdims=True))
    return (q / q.sum(-1, keepdims=True)).astype(np.float32)


def first_tokens(target_logp, q, seed: int, q_verifier=None) -> np.ndarray:
    """First emitted token of N independent verifications of drafts drawn from ``q``.

    ``q_verifier`` (default ``q``) is the distribution the verifier is told the drafts came from.
    """
    key_d, key_v = jax.random.split(jax.random.PRNGKey(seed))
    drafts = jax.random.categorical(key_d, jnp.log(jnp.asarray(q))[None].repeat(N, 0), axis=-1).astype(jnp.int32)
    logp = jnp.broadcast_to(jnp.asarray(target_logp), (N,) + target_logp.shape)
    qv = q if q_verifier is None else q_verifier
    _, emitted = jax.jit(rejection_accept)(key_v, logp, drafts, jnp.broadcast_to(jnp.asarray(qv), (N,) + q.shape))
    return np.asarray(emitted[:, 0])


@pytest.mark.parametrize("kind", ["random", "skewed"])
def test_rejection_sampling_keeps_the_target_distribution(kind, target_rows):
    q = draft_distributions(kind, target_rows)
    tokens = first_tokens(target_rows, q, seed=1)
    counts = np.bincount(tokens, minlength=target_rows.shape[-1])
    p = np.exp(target_rows[0].astype(np.float64))
    assert counts[p == 0].sum() == 0  # never a token outside top-k / top-p
    assert chi_square_pvalue(counts, p / p.sum()) > 1e-3


def test_broken_verifier_is_detected(target_rows):
    """A verifier told the wrong q (drafts sampled at temperature 0.5, q taken at temperature 1, a classic
    processing mismatch) no longer keeps the target distribution, and the test notices."""
    q = draft_distributions("random", target_rows)
    sharp = q ** 2 / np.sum(q ** 2, axis=-1, keepdims=True)  # the same logits at temperature 0.5
    tokens = first_tokens(target_rows, sharp, seed=1, q_verifier=q)
    counts = np.bincount(tokens, minlength=target_rows.shape[-1])
    p = np.exp(target_rows[0].astype(np.float64))
    assert chi_square_pvalue(counts, p / p.sum()) < 1e-3


def test_argmax_drafts_with_one_hot_q_keep_the_distribution(target_rows):
    """EAGLE-3 drafts by argmax: q is one-hot, accept with p(d), residual = p without d."""
    drafts = jnp.broadcast_to(jnp.argsort(-target_rows[:K], axis=-1)[:, 1], (N, K)).astype(jnp.int32)
    logp = jnp.broadcast_to(jnp.asarray(target_rows), (N,) + target_rows.shape)
    _, emitted = jax.jit(rejection_accept)(jax.random.PRNGKey(5), logp, drafts, None)
    counts = np.bincount(np.asarray(emitted[:, 0]), minlength=target_rows.shape[-1])
    p = np.exp(target_rows[0].astype(np.float64))
    assert chi_square_pvalue(counts, p / p.sum()) > 1e-3


def test_top_k_top_p_processing():
    logits = jnp.asarray([[0.0, 1.0, 2.0, 3.0, 4.0]])
    lp = np.asarray(processed_logprobs(logits, SamplingConfig(temperature=1.0, top_k=3)))
    assert np.isneginf(lp[0, :2]).all() and np.isfinite(lp[0, 2:]).all()
    p = np.exp(np.asarray(processed_logprobs(logits, SamplingConfig(temperature=1.0, top_p=0.7))))
    # softmax([0..4]) = [.012 .032 .086 .234 .636]: the top two reach 0.87 >= 0.7, the top one alone does not
    assert np.count_nonzero(p) == 2 and np.isclose(p.sum(), 1.0)
