"""Speculative sampling draws from the base model's distribution.

A small-vocabulary model (V = 8), one prompt, 4 new tokens: the exact distribution of every
generated position is computed by enumerating all continuations with the base model; thousands of
independent samples (one batch, one random stream per row) are compared with it by a chi-square
test per position. Then V = 16, 6 new tokens, dense and MoE bases, every speculative method, fixed
and dynamic draft lengths: the joint law of the continuations by the probability integral
transform (below). Both tests must reject deliberately broken acceptance rules."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from conftest import tiny_config
from decoding_helpers import random_base, random_m2r2
from m2r2_jax.decoding import api
from m2r2_jax.decoding.sampling import Sampling, probs_from_logits, rejection_accept, sample_from_probs
from m2r2_jax.m2r2.config import M2R2Config
from m2r2_jax.models.transformer import forward

V, M, N = 8, 4, 3000
PROMPT = [1, 2]


def small(seed):
    cfg = tiny_config("llama", vocab_size=V, n_layers=2, d_model=16, n_heads=2, n_kv_heads=1, head_dim=8,
                      d_ff=32, max_seq_len=16)
    return cfg, random_base(cfg, seed)


@functools.lru_cache(maxsize=None)
def target():
    return small(0)


@functools.lru_cache(maxsize=None)
def exact_marginals(sampling: Sampling):
    """[M, V]: the exact probability of each token at each generated position."""
    cfg, params = target()
    prefixes = np.array(list(itertools.product(range(V), repeat=M - 1)), np.int32)
    toks = np.concatenate([np.tile(PROMPT, (len(prefixes), 1)), prefixes], axis=1)
    logits, _ = jax.jit(forward, static_argnums=0)(cfg, params, jnp.asarray(toks))
    probs = np.asarray(probs_from_logits(logits[:, len(PROMPT) - 1:], sampling), np.float64)  # [P, M, V]
    joint = np.ones((V,) * M)
    for t in range(M):
        cond = probs[:, t].reshape((V,) * (M - 1) + (V,))
        # conditional of position t depends on the first t generated tokens only
        cond = cond[(slice(None),) * t + (0,) * (M - 1 - t)] if t < M - 1 else cond
        joint = joint * cond.reshape((V,) * (t + 1) + (1,) * (M - 1 - t))
    return np.stack([joint.sum(axis=tuple(a for a in range(M) if a != t)) for t in range(M)])


def sample_counts(method, sampling: Sampling, accept_fn=None, **kw):
    cfg, params = target()
    eng = api.build_engine(method, cfg, params, max_new_tokens=M, temperature=sampling.temperature,
                           top_p=sampling.top_p, gamma=2, accept_fn=accept_fn, **kw)
    res = api.run_engine(eng, [PROMPT] * N, seed=3, batch_size=N)
    toks = np.array([r.tokens for r in res])
    assert toks.shape == (N, M)
    acc = [a for r in res for a in r.accepted]
    return np.stack([np.bincount(toks[:, t], minlength=V) for t in range(M)]), acc


def min_pvalue(counts, probs):
    """Smallest per-position chi-square p-value (cells with expected count < 5 pooled)."""
    pvals = []
    for c, p in zip(counts, probs):
        exp = N * p
        big = exp >= 5
        obs = np.append(c[big], c[~big].sum())
        e = np.append(exp[big], exp[~big].sum())
        keep = e > 0
        pvals.append(stats.chisquare(obs[keep], e[keep] * obs[keep].sum() / e[keep].sum()).pvalue)
    return min(pvals)


def always_accept(keys, p, q, drafts, draft_len):
    """Broken: accept every draft, then the bonus token from p."""
    p_n = jnp.take_along_axis(p, draft_len[:, None, None], axis=1)[:, 0]
    return draft_len, sample_from_probs(keys, p_n)


def resample_from_p(keys, p, q, drafts, draft_len):
    """Broken: on rejection sample from p instead of norm(max(0, p - q))."""
    n_acc, _ = rejection_accept(keys, p, q, drafts, draft_len)
    p_n = jnp.take_along_axis(p, n_acc[:, None, None], axis=1)[:, 0]
    return n_acc, sample_from_probs(jax.vmap(lambda k: jax.random.fold_in(k, 9))(keys), p_n)


def draft_model():
    return small(5)


def m2r2():
    cfg, _ = target()
    mcfg = M2R2Config(branch_layer=1, rate=2, lora_rank=4, router_dim=8, router_hidden=8)
    return mcfg, random_m2r2(cfg, mcfg, 1, adapter_scale=0.3)


CASES = {
    "m2r2_spec": (Sampling(1.0), dict(m2r2=None)),
    "two_model_top_p": (Sampling(0.8, 0.9), dict(draft=None)),
    # the draft proposes from 5 of the 8 tokens only (q = 0 elsewhere), with top-p on that subset
    "m2r2_spec_draft_vocab_top_p": (Sampling(0.9, 0.95), dict(draft_vocab=(0, 2, 3, 5, 6))),
}


def _kw(case):
    if case.startswith("m2r2"):
        return {"m2r2": m2r2(), **{k: v for k, v in CASES[case][1].items() if k != "m2r2"}}
    return {"draft": draft_model()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_speculative_sampling_matches_the_base_distribution(case):
    method = "m2r2_spec" if case.startswith("m2r2") else "two_model"
    sampling = CASES[case][0]
    counts, acc = sample_counts(method, sampling, **_kw(case))
    # the draft genuinely differs from the target, so both acceptance outcomes occur
    assert 1.2 < np.mean(acc) < 2.8, np.mean(acc)
    pval = min_pvalue(counts, exact_marginals(sampling))
    assert pval > 1e-4


@pytest.mark.parametrize("rule", [always_accept, resample_from_p], ids=["always_accept", "resample_from_p"])
def test_the_statistical_test_rejects_broken_acceptance_rules(rule):
    """Same configuration and test as `two_model_top_p` above, with the acceptance rule broken."""
    sampling = CASES["two_model_top_p"][0]
    counts, _ = sample_counts("two_model", sampling, accept_fn=rule, draft=draft_model())
    pval = min_pvalue(counts, exact_marginals(sampling))
    assert pval < 1e-6


# --------------------------------------------------------------------------------------------
# The joint distribution of longer continuations, by the probability integral transform
# --------------------------------------------------------------------------------------------
# Enumerating every continuation is V^(M-1) forward passes: fine above, not for V = 16 and 6 new
# tokens. Instead each sampled continuation is scored by the base model itself: with F the CDF of
# p(. | prefix) in token-id order, u = F(x - 1) + U * p(x | prefix), U ~ Uniform(0, 1), is uniform
# if and only if x was drawn from p(. | prefix), and the u of successive positions of a sequence are
# then independent (the Rosenblatt transform). So all N x M values are i.i.d. uniform exactly when
# the continuations follow the base model's joint distribution: one Kolmogorov-Smirnov test covers
# the joint law, not only per-position marginals.
JV, JM, JN = 16, 6, 2000
JPROMPT = [3, 1, 4]


@functools.lru_cache(maxsize=None)
def joint_model(family: str, seed: int = 0):
    cfg = tiny_config(family, vocab_size=JV, n_layers=3, d_model=16, n_heads=2, n_kv_heads=1, head_dim=8,
                      d_ff=32, max_seq_len=16)
    return cfg, random_base(cfg, seed)


JOINT_CASES = {
    "distance_spec_moe": ("mixtral", "distance_spec", Sampling(1.0), "fixed"),
    "m2r2_spec_moe_dynamic_top_p": ("mixtral", "m2r2_spec", Sampling(0.8, 0.9), "dynamic"),
    "two_model_dynamic": ("llama", "two_model", Sampling(1.0), "dynamic"),
    "distance_spec_dynamic_draft_vocab_top_p": ("llama", "distance_spec", Sampling(0.9, 0.95), "dynamic"),
}


def joint_engine(case: str, accept_fn=None):
    family, method, sampling, draft_length = JOINT_CASES[case]
    cfg, params = joint_model(family)
    kw = dict(max_new_tokens=JM, temperature=sampling.temperature, top_p=sampling.top_p, gamma=3,
              draft_length=draft_length, accept_fn=accept_fn)
    if method == "distance_spec":
        kw["exit_layer"] = 1
        if "draft_vocab" in case:
            kw["draft_vocab"] = tuple(range(0, JV, 2)) + (5, 7)
    if method == "m2r2_spec":
        mcfg = M2R2Config(branch_layer=1, rate=2, lora_rank=4, router_dim=8, router_hidden=8)
        kw["m2r2"] = (mcfg, random_m2r2(cfg, mcfg, 1, adapter_scale=0.3))
    if method == "two_model":
        kw["draft"] = joint_model(family, seed=5)
    return cfg, params, sampling, api.build_engine(method, cfg, params, **kw)


def joint_pit(case: str, accept_fn=None):
    """(u [JN, JM], accepted tokens per round) for JN sampled continuations of JPROMPT."""
    cfg, params, sampling, eng = joint_engine(case, accept_fn)
    # a low router / confidence threshold: dynamic drafts are long enough to be rejected often
    res = api.run_engine(eng, [JPROMPT] * JN, seed=11, batch_size=JN, tau=0.05)
    gen = np.array([r.tokens for r in res])
    assert gen.shape == (JN, JM)
    toks = np.concatenate([np.tile(JPROMPT, (JN, 1)), gen], axis=1).astype(np.int32)
    logits, _ = jax.jit(forward, static_argnums=0)(cfg, params, jnp.asarray(toks))
    p = np.asarray(probs_from_logits(logits[:, len(JPROMPT) - 1:-1], sampling), np.float64)  # [N, M, V]
    p_x = np.take_along_axis(p, gen[..., None], axis=-1)[..., 0]
    below = np.take_along_axis(np.cumsum(p, axis=-1) - p, gen[..., None], axis=-1)[..., 0]
    assert (p_x > 0).all()  # no drawn token lies outside the nucleus the base model allows
    u = below + np.random.default_rng(0).uniform(size=p_x.shape) * p_x
    return u, [a for r in res for a in r.accepted]


@pytest.mark.parametrize("case", sorted(JOINT_CASES))
def test_speculative_continuations_follow_the_base_joint_distribution(case):
    u, acc = joint_pit(case)
    assert 1.2 < np.mean(acc) < 3.8, np.mean(acc)  # drafts are sometimes accepted, sometimes not
    assert stats.kstest(u.ravel(), "uniform").pvalue > 1e-4
    assert min(stats.kstest(u[:, t], "uniform").pvalue for t in range(JM)) > 1e-4 / JM


@pytest.mark.parametrize("rule", [always_accept, resample_from_p], ids=["always_accept", "resample_from_p"])
def test_the_joint_test_rejects_broken_acceptance_rules(rule):
    """The same test, acceptance rule broken: p ~ 1e-70 (always_accept), ~ 1e-14 (resample_from_p)."""
    u, _ = joint_pit("distance_spec_moe", accept_fn=rule)
    assert stats.kstest(u.ravel(), "uniform").pvalue < 1e-6
