"""Token selection and the acceptance rules, on explicit distributions (no model)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from m2r2_jax.decoding.sampling import (Sampling, greedy_accept, probs_from_logits, rejection_accept,
                                        sample_from_probs, top_p_filter)
from m2r2_jax.errors import ConfigError


def test_top_p_keeps_the_smallest_nucleus_and_renormalises():
    p = jnp.array([[0.5, 0.3, 0.15, 0.05]])
    np.testing.assert_allclose(top_p_filter(p, 0.8), [[0.625, 0.375, 0, 0]], rtol=1e-6)
    np.testing.assert_allclose(top_p_filter(p, 0.81), [[0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]], rtol=1e-6)
    np.testing.assert_allclose(top_p_filter(p, 0.1), [[1, 0, 0, 0]])
    np.testing.assert_allclose(top_p_filter(p, 1.0), p)


def test_temperature_zero_is_one_hot_argmax():
    logits = jnp.array([[0.1, 2.0, -1.0]])
    np.testing.assert_array_equal(probs_from_logits(logits, Sampling(0.0)), [[0, 1, 0]])
    np.testing.assert_allclose(probs_from_logits(logits, Sampling(0.5)), jax.nn.softmax(logits / 0.5), rtol=1e-6)


@pytest.mark.parametrize("bad", [Sampling(-0.1), Sampling(1.0, 0.0), Sampling(1.0, 1.5)])
def test_bad_sampling_options_are_rejected(bad):
    with pytest.raises(ConfigError):
        bad.validate()


def test_greedy_accept_prefix_correction_and_bonus():
    v = 5
    target = jnp.array([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3]])  # argmax of rows 0..G
    logits = jax.nn.one_hot(target, v) * 10.0
    drafts = jnp.array([[1, 2], [1, 4], [0, 2], [1, 2]])
    draft_len = jnp.array([2, 2, 2, 1])
    n_acc, nxt = greedy_accept(logits, drafts, draft_len)
    np.testing.assert_array_equal(n_acc, [2, 1, 0, 1])
    np.testing.assert_array_equal(nxt, [3, 2, 1, 2])


def _first_token_distribution(rule, p, q, n, seed=0):
    """Empirical distribution of the first committed token when drafts are drawn from q."""
    b = n
    keys = jax.random.split(jax.random.key(seed), b)
    kd, ka = jax.random.split(jax.random.key(seed + 1))
    pp = jnp.broadcast_to(p, (b,) + p.shape)
    qq = jnp.broadcast_to(q, (b,) + q.shape)
    drafts = jax.random.categorical(kd, jnp.log(qq), axis=-1).astype(jnp.int32)
    n_acc, nxt = jax.jit(rule)(keys, pp, qq, drafts, jnp.full((b,), q.shape[0], jnp.int32))
    first = jnp.where(n_acc > 0, drafts[:, 0], nxt)
    return np.bincount(np.asarray(first), minlength=p.shape[-1])


def _resample_from_p(keys, p, q, drafts, draft_len):
    """A broken rule: on rejection, sample from p instead of norm(max(0, p - q))."""
    n_acc, _ = rejection_accept(keys, p, q, drafts, draft_len)
    p_n = jnp.take_along_axis(p, n_acc[:, None, None], axis=1)[:, 0]
    return n_acc, sample_from_probs(jax.vmap(lambda k: jax.random.fold_in(k, 9))(keys), p_n)


def test_rejection_sampling_reproduces_the_target_distribution_and_the_test_catches_broken_rules():
    p = jnp.array([[0.5, 0.2, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25], [0.1, 0.2, 0.3, 0.4]])
    q = jnp.array([[0.1, 0.1, 0.4, 0.4], [0.7, 0.1, 0.1, 0.1]])
    n = 20_000
    counts = _first_token_distribution(rejection_accept, p, q, n)
    assert stats.chisquare(counts, n * np.asarray(p[0])).pvalue > 1e-4
    broken = _first_token_distribution(_resample_from_p, p, q, n)
    assert stats.chisquare(broken, n * np.asarray(p[0])).pvalue < 1e-8


def test_sample_from_probs_never_draws_zero_probability_tokens():
    probs = jnp.broadcast_to(jnp.array([0.0, 0.5, 0.0, 0.5]), (2000, 4))
    toks = sample_from_probs(jax.random.split(jax.random.key(0), 2000), probs)
    assert set(np.unique(np.asarray(toks))) == {1, 3}


@pytest.mark.parametrize("seed", range(4))
def test_sample_from_probs_draws_from_the_given_distribution(seed):
    # random distributions over 6 tokens, one of them zero and one tiny, one per row
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(6, 0.7))
    p[rng.integers(6)] = 0.0
    p[np.argmax(p)] -= 1e-3
    p[np.argmin(np.where(p > 0, p, 1))] += 1e-3
    p = p / p.sum()
    n = 40_000
    probs = jnp.broadcast_to(jnp.asarray(p, jnp.float32), (n, 6))
    toks = np.asarray(jax.jit(sample_from_probs)(jax.random.split(jax.random.key(seed), n), probs))
    counts = np.bincount(toks, minlength=6)
    assert counts[p == 0].sum() == 0
    live = p > 0
    assert stats.chisquare(counts[live], n * p[live]).pvalue > 1e-4
    # the same check rejects a sampler that is off by a little (mass moved between two tokens)
    off = p.copy()
    i, j = np.argsort(-p)[:2]
    off[i], off[j] = off[i] - 0.02, off[j] + 0.02
    assert stats.chisquare(counts[live], n * off[live]).pvalue < 1e-4


def test_sample_from_probs_edges_of_the_vocabulary_and_unnormalised_rows():
    v = 50_000
    first = jnp.zeros((1, v)).at[0, 0].set(1.0)
    last = jnp.zeros((1, v)).at[0, v - 1].set(3.0)  # not normalised: the row total is used
    keys = jax.random.split(jax.random.key(0), 64)
    for probs, want in ((first, 0), (last, v - 1)):
        toks = jax.vmap(lambda k, p=probs: sample_from_probs(k[None], p)[0])(keys)
        assert set(np.asarray(toks).tolist()) == {want}
