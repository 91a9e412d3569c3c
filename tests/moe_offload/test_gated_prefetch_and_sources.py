"""Confidence-gated prefetch (router probabilities in the trace) and the m2r2 predictor's
calibrated sources (which fast state or router guesses each layer)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from moe_fixtures import NEW, PROMPTS, tiny_moe_setup
from test_simulator import COSTS, synthetic_trace

from m2r2_jax.errors import ConfigError
from m2r2_jax.m2r2 import fast_stream as F
from m2r2_jax.moe_offload.engine import OffloadEngine
from m2r2_jax.moe_offload.predictors import (_source_logits, choose_m2r2_sources, guess_confidence,
                                             m2r2_state_plan, source_candidates)
from m2r2_jax.moe_offload.record import oracle_probs, record_trace
from m2r2_jax.moe_offload.simulator import check_bounds, simulate

CONTINUATIONS = ([4, 8, 15, 16, 23, 42, 1], [2, 7, 1, 8, 2, 8, 1])


def with_probs(trace, rng, sharp=3.0):
    """Give every predictor of a synthetic trace probabilities that agree with its ranking."""
    probs = {}
    for name, r in trace.rankings.items():
        scores = np.sort(rng.gamma(1.0, size=r.shape), axis=-1)[..., ::-1] * sharp
        p = np.empty(r.shape, np.float32)
        np.put_along_axis(p, r, np.exp(scores), axis=-1)
        probs[name] = p / p.sum(-1, keepdims=True)
    probs["oracle"] = oracle_probs(trace.true, trace.n_experts)  # the oracle is certain
    return dataclasses.replace(trace, probs=probs).validate()


# -- the confidence of a guess ---------------------------------------------------------------
def test_guess_confidence_is_the_ratio_to_the_first_expert_left_out():
    probs = np.array([0.1, 0.4, 0.3, 0.2])
    conf = guess_confidence(probs, np.array([1, 2, 3, 0]), top_k=2)
    np.testing.assert_allclose(conf, probs / 0.2)
    # the oracle's probabilities are one-hot: nothing left out competes, so it is certain
    certain = guess_confidence(np.array([0.0, 1.0, 1.0, 0.0]), np.array([1, 2, 0, 3]), top_k=2)
    assert np.isinf(certain[1]) and np.isinf(certain[2])


def test_a_gate_nothing_passes_moves_only_demand_loads():
    """The gate holds back transfers; a guess that is already resident still counts as a use."""
    rng = np.random.default_rng(0)
    trace = with_probs(synthetic_trace(rng, 30, 4, 6, 2), rng)
    shut = simulate(trace, "next_gate", COSTS, 3, "lru", min_confidence=np.inf)
    assert shut.prefetches == 0 and shut.transfers == shut.demand_misses
    # with room for every expert, nothing is ever evicted: the gated run is on-demand loading exactly
    none = simulate(trace, "none", COSTS, 6, "lru")
    shut = simulate(trace, "next_gate", COSTS, 6, "lru", min_confidence=np.inf)
    assert (shut.total_s, shut.transfers) == (none.total_s, none.transfers)
    # the oracle is certain: no gate holds it back
    free = simulate(trace, "oracle", COSTS, 3, "predictive")
    gated = simulate(trace, "oracle", COSTS, 3, "predictive", min_confidence=1e9)
    assert (gated.total_s, gated.prefetches) == (free.total_s, free.prefetches)


@pytest.mark.parametrize("seed", range(6))
def test_gated_and_joined_predictors_keep_the_overlap_bounds(seed):
    rng = np.random.default_rng(seed)
    trace = with_probs(synthetic_trace(rng, 25, 5, 8, 2, noise=0.5), rng)
    for pred in ("next_gate", "m2r2", "m2r2+next_gate"):
        for gate in (0.0, 1.2, 2.0):
            r = simulate(trace, pred, COSTS, 3, "predictive", min_confidence=gate)
            assert check_bounds(r, COSTS)
            assert r.demand_hits + r.demand_misses == trace.n_tokens * trace.n_layers * trace.top_k
    # gating can only drop prefetches that the ungated run would issue at the same point: at the
    # first token (cold caches, identical state) the gated run issues a subset
    first = dataclasses.replace(trace, true=trace.true[:1], rankings={k: v[:1] for k, v in trace.rankings.items()},
                                probs={k: v[:1] for k, v in trace.probs.items()}, fast_routes=trace.fast_routes[:1])
    assert (simulate(first, "next_gate", COSTS, 8, "lru", min_confidence=1.5).prefetches
            <= simulate(first, "next_gate", COSTS, 8, "lru").prefetches)


def test_joined_predictor_issues_both_guesses():
    rng = np.random.default_rng(3)
    trace = synthetic_trace(rng, 20, 4, 6, 2, noise=0.6)
    joined = simulate(trace, "m2r2+next_gate", COSTS, 6, "lru")
    alone = simulate(trace, "m2r2", COSTS, 6, "lru")
    assert joined.prefetches >= alone.prefetches and joined.hit_rate >= alone.hit_rate


def test_gating_without_probabilities_and_unknown_parts_are_one_line_errors():
    rng = np.random.default_rng(1)
    trace = synthetic_trace(rng, 5, 3, 4, 2)
    with pytest.raises(ConfigError, match="router probabilities"):
        simulate(trace, "next_gate", COSTS, 2, min_confidence=1.5)
    with pytest.raises(ConfigError, match="'gate' is not in the trace"):
        simulate(trace, "m2r2+gate", COSTS, 2)


# -- probabilities recorded with the trace ---------------------------------------------------
@pytest.fixture(scope="module")
def moe():
    return tiny_moe_setup()


def test_recorded_probabilities_agree_with_the_rankings(moe):
    cfg, params, mcfg, mp, _ = moe
    trace, _ = record_trace(cfg, params, mcfg, mp, PROMPTS, NEW, lookaheads=(1, 2))
    for name, r in trace.rankings.items():
        if name == "oracle":
            continue
        p = trace.probs[name]
        guessed = r[..., 0] >= 0
        np.testing.assert_allclose(p.sum(-1)[guessed], 1.0, rtol=1e-5)
        assert (p[~guessed] == 0).all()
        ordered = np.take_along_axis(p, np.where(r >= 0, r, 0), axis=-1)[guessed]
        assert (np.diff(ordered, axis=-1) <= 1e-7).all(), name  # ranked best-first = descending probability
    np.testing.assert_array_equal(trace.probs["oracle"].sum(-1), cfg.n_experts_per_tok)


# -- the m2r2 predictor's sources ------------------------------------------------------------
def test_default_sources_are_the_built_in_plan_and_bad_sources_are_rejected(moe):
    cfg, _, mcfg, _, _ = moe
    L, b, visited = cfg.n_layers, mcfg.branch_layer, tuple(F.visited_layers(cfg, mcfg))
    plan, issue = m2r2_state_plan(L, b, visited)
    assert m2r2_state_plan(L, b, visited, plan) == (plan, issue)
    for l, cands in enumerate(source_candidates(L, b, visited)):
        assert plan[l] in cands
    bad = list(plan)
    bad[-1] = ("fast", 0) if visited[0] != L - 1 else ("state", len(visited) + 1)
    with pytest.raises(ConfigError, match=f"source .* for layer {L - 1} is invalid"):
        m2r2_state_plan(L, b, visited, bad)
    with pytest.raises(ConfigError, match="at least one non-empty sequence"):
        choose_m2r2_sources(cfg, moe[1], mcfg, moe[3], [[]])


def test_chosen_sources_recall_best_on_the_calibration_text(moe):
    cfg, params, mcfg, mp, _ = moe
    seqs = [list(p) + list(c) for p, c in zip(PROMPTS, CONTINUATIONS)]
    sources, recall = choose_m2r2_sources(cfg, params, mcfg, mp, seqs)
    default, _ = m2r2_state_plan(cfg.n_layers, mcfg.branch_layer, tuple(F.visited_layers(cfg, mcfg)))
    for l, src in enumerate(sources):
        if l < mcfg.branch_layer:
            assert src == ("next_gate", None) and not recall[l]
            continue
        assert recall[l][src] == max(recall[l].values()) and recall[l][src] >= recall[l][default[l]]
        assert all(0.0 <= r <= 1.0 for r in recall[l].values())


def test_calibration_logits_match_decoding(moe):
    """The whole-sequence pass that chooses the sources sees what the decode-time fast pass sees:
    a teacher-forced trace with one source everywhere ranks the same experts."""
    cfg, params, mcfg, mp, _ = moe
    L, b, visited = cfg.n_layers, mcfg.branch_layer, tuple(F.visited_layers(cfg, mcfg))
    k = cfg.n_experts_per_tok
    p, c = list(PROMPTS[0]), list(CONTINUATIONS[0])[:NEW]
    _, cross_all, _ = _source_logits(cfg, mcfg, params, mp, jnp.asarray([p + c], jnp.int32))
    for s in range(len(visited) + 1):  # fast state s for every layer after the branch
        sources = [("next_gate", None)] * b + [("state", s)] * (L - b)
        trace, _ = record_trace(cfg, params, mcfg, mp, [p], NEW, lookaheads=(1,), forced=[c], m2r2_sources=sources)
        cross = np.asarray(cross_all)[:, s, 0, len(p):len(p) + NEW]  # [L, NEW, E]
        for l in range(b, L):
            want = np.sort(np.argsort(-cross[l], axis=-1, kind="stable")[:, :k], -1)
            got = np.sort(trace.rankings["m2r2"][:, l, :k], -1)
            np.testing.assert_array_equal(want, got, err_msg=f"state {s}, layer {l}")


def test_engine_with_chosen_sources_is_exact(moe):
    cfg, params, mcfg, mp, refs = moe
    L, b, visited = cfg.n_layers, mcfg.branch_layer, tuple(F.visited_layers(cfg, mcfg))
    sources = [("next_gate", None)] * b + [("state", 0)] + [("state", len(visited))] * (L - b - 1)
    eng = OffloadEngine(cfg, params, capacity=2, policy="predictive", predictor="m2r2", mcfg=mcfg,
                        m2r2_params=mp, m2r2_sources=sources)
    out, _ = eng.generate(list(PROMPTS[0]), NEW)
    assert out == list(refs[0]) and eng.stats.prefetches > 0


@pytest.mark.parametrize("predictor", ["next_gate", "m2r2"])
def test_gated_engine_is_exact_and_fetches_less(moe, predictor):
    cfg, params, mcfg, mp, refs = moe
    fetched = {}
    for gate in (0.0, 1.3, np.inf):
        eng = OffloadEngine(cfg, params, capacity=2, policy="predictive", predictor=predictor, mcfg=mcfg,
                            m2r2_params=mp, min_confidence=gate)
        out, _ = eng.generate(list(PROMPTS[0]), NEW)
        assert out == list(refs[0])
        fetched[gate] = eng.stats.prefetches
        assert eng.stats.transfers == eng.stats.prefetches + eng.stats.demand_misses
    assert fetched[np.inf] == 0 and fetched[0.0] > 0


def test_bad_gate_is_a_one_line_error(moe):
    cfg, params, mcfg, mp, _ = moe
    for bad in (-1.0, float("nan")):
        with pytest.raises(ConfigError, match="min_confidence"):
            OffloadEngine(cfg, params, capacity=2, predictor="next_gate", min_confidence=bad)
        with pytest.raises(ConfigError, match="min_confidence"):
            simulate(synthetic_trace(np.random.default_rng(0), 3, 2, 4, 2), "none", COSTS, 2, min_confidence=bad)
