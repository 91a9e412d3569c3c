"""The m2r2 predictor's fast pass runs only the steps its sources need: the plan's issue points,
the trace, the simulator's schedule and cost, the calibrated choice and the real engine agree."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_fixtures import NEW, PROMPTS, tiny_moe_setup
from test_simulator import COSTS, synthetic_trace

from m2r2_jax.errors import ConfigError, DataError
from m2r2_jax.m2r2 import fast_stream as F
from m2r2_jax.models import transformer as T
from m2r2_jax.moe_offload.engine import OffloadEngine, _fast_pass
from m2r2_jax.moe_offload.predictors import (choose_m2r2_sources, fast_steps_needed, m2r2_state_plan,
                                             source_candidates, source_steps, sources_by_fast_steps)
from m2r2_jax.moe_offload.record import record_trace
from m2r2_jax.moe_offload.metrics import mean_recall, recall_per_layer
from m2r2_jax.moe_offload.simulator import simulate, token_schedule
from m2r2_jax.moe_offload.trace import blend_with_oracle, oracle_with_lead


@pytest.fixture(scope="module")
def moe():
    return tiny_moe_setup()


def test_steps_each_source_needs():
    assert source_steps(("next_gate", None)) == 0
    assert source_steps(("state", 0)) == 0  # g_0 = h_b: the slow stream's own state
    assert source_steps(("state", 3)) == 3  # g_3: output of steps 0, 1, 2
    assert source_steps(("fast", 2)) == 3  # read inside step 2
    assert fast_steps_needed([("next_gate", None), ("state", 0)]) == 0
    assert fast_steps_needed([("next_gate", None), ("fast", 0), ("state", 2), ("state", 1)]) == 2


def test_truncated_plan_issues_the_last_state_when_the_pass_ends():
    L, b, visited = 9, 1, (2, 4, 6, 8)
    sources = [("next_gate", None), ("state", 1), ("fast", 0), ("state", 2), ("state", 1), ("state", 2),
               ("state", 1), ("state", 2), ("state", 2)]
    plan, issue = m2r2_state_plan(L, b, visited, sources)
    assert fast_steps_needed(plan) == 2
    assert issue[1] == ("fast_attn", 1)  # g_1 exists before step 1 starts
    assert issue[2] == ("fast_mlp", 0)
    assert issue[3] == ("attn", b)  # g_2 is the last state: issued when the (2-step) pass ends
    full, full_issue = m2r2_state_plan(L, b, visited, sources[:-1] + [("fast", 3)])
    assert fast_steps_needed(full) == 4 and full_issue[3] == ("fast_attn", 2)


def _synthetic(steps, fast_mlp="none"):
    tr = synthetic_trace(np.random.default_rng(1), 12, 7, 6, 2, b=1, r=2)  # 3 fast steps
    tr = dataclasses.replace(tr, moe_fast_mlp=fast_mlp, issue=dict(tr.issue, m2r2=[("attn", 1)] * 7),
                             fast_steps={"m2r2": steps})
    return tr.validate()


def test_schedule_and_compute_charge_only_the_steps_run():
    full = _synthetic(3)
    per_step = COSTS.fast_attn_s + COSTS.fast_mlp_s
    totals = {}
    for steps in range(4):
        tr = _synthetic(steps)
        ops = token_schedule(tr, "m2r2")
        assert [op for op in ops if op[0].startswith("fast")] == [(k, i) for i in range(steps)
                                                                 for k in ("fast_attn", "fast_mlp")]
        assert token_schedule(tr, "next_gate") == token_schedule(full, "next_gate")  # no fast pass there
        res = simulate(tr, "m2r2", COSTS, 6, all_resident=False)
        totals[steps] = res.compute_s
    for steps in range(3):
        assert totals[3] - totals[steps] == pytest.approx(full.n_tokens * (3 - steps) * per_step)
    assert _synthetic(3).fast_steps_of("oracle") == 0


def test_trace_rejects_steps_it_does_not_have():
    with pytest.raises(DataError, match="runs 4 fast steps; the fast stream has 3"):
        _synthetic(4)
    tr = dataclasses.replace(_synthetic(3), issue=dict(_synthetic(3).issue, m2r2=[("fast_attn", 2)] * 7),
                             fast_steps={"m2r2": 2})
    with pytest.raises(DataError, match=r"issues a guess at \('fast_attn', 2\) but runs only 2"):
        tr.validate()


def test_best_sources_per_pass_length():
    L, b, visited = 5, 1, (2, 3, 4)
    rng = np.random.default_rng(0)
    recall = {l: {src: float(rng.random()) for src in cands if src[0] != "next_gate"}
              for l, cands in enumerate(source_candidates(L, b, visited))}
    curve = sources_by_fast_steps(recall, L, b, visited)
    assert len(curve) == len(visited) + 1
    means = [m for _, m in curve]
    assert all(x <= y + 1e-12 for x, y in zip(means, means[1:]))  # more steps never recall less
    for steps, (sources, mean) in enumerate(curve):
        assert fast_steps_needed(sources) <= steps
        assert mean == pytest.approx(np.mean([recall[l][sources[l]] for l in range(b, L)]))
    assert all(recall[l][curve[-1][0][l]] == max(recall[l].values()) for l in range(b, L))


def test_choice_with_a_tolerance_takes_the_shortest_pass(moe):
    cfg, params, mcfg, mp, _ = moe
    seqs = [list(p) * 3 for p in PROMPTS]
    exact, recall = choose_m2r2_sources(cfg, params, mcfg, mp, seqs)
    visited = tuple(F.visited_layers(cfg, mcfg))
    curve = sources_by_fast_steps(recall, cfg.n_layers, mcfg.branch_layer, visited)
    best = curve[-1][1]
    want = min(s for s, (_, m) in enumerate(curve) if m >= best)
    assert fast_steps_needed(exact) == want
    loose, _ = choose_m2r2_sources(cfg, params, mcfg, mp, seqs, recall_tolerance=0.99)
    assert fast_steps_needed(loose) == 0  # any recall is within 0.99: no fast pass at all
    for bad in (-0.1, 1.0):
        with pytest.raises(ConfigError, match="recall_tolerance"):
            choose_m2r2_sources(cfg, params, mcfg, mp, seqs, recall_tolerance=bad)


def test_recorded_trace_runs_the_plan_steps(moe):
    cfg, params, mcfg, mp, _ = moe
    b, L = mcfg.branch_layer, cfg.n_layers
    sources = [("next_gate", None)] * b + [("state", 1)] * (L - b)
    trace, _ = record_trace(cfg, params, mcfg, mp, PROMPTS[:1], NEW, lookaheads=(1,), m2r2_sources=sources)
    assert trace.fast_steps_of("m2r2") == 1 < len(trace.visited)
    assert [op for op in token_schedule(trace, "m2r2") if op[0].startswith("fast")] == [("fast_attn", 0),
                                                                                         ("fast_mlp", 0)]


def test_truncated_fast_pass_is_the_start_of_the_full_one(moe):
    cfg, params, mcfg, mp, _ = moe
    k = mcfg.steps(cfg)
    tokens = jnp.asarray([[5]], jnp.int32)
    pos = jnp.asarray([[3]], jnp.int32)
    full = _fast_pass(cfg, mcfg, params, mp, tokens, pos, T.init_cache(cfg, 1, 8), k)
    for n in range(1, k):
        part = _fast_pass(cfg, mcfg, params, mp, tokens, pos, T.init_cache(cfg, 1, 8), n)
        assert part[0].shape[0] == n and part[1].shape[0] == n
        np.testing.assert_allclose(np.asarray(part[0]), np.asarray(full[0][:n]), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(part[1]), np.asarray(full[1][:n]), rtol=1e-5, atol=1e-5)
    jax.block_until_ready(full)


@pytest.mark.parametrize("state", [0, 1])
def test_engine_with_a_short_fast_pass_is_exact(moe, state):
    cfg, params, mcfg, mp, refs = moe
    b, L = mcfg.branch_layer, cfg.n_layers
    sources = [("next_gate", None)] * b + [("state", state)] * (L - b)
    eng = OffloadEngine(cfg, params, capacity=2, policy="predictive", predictor="m2r2", mcfg=mcfg,
                        m2r2_params=mp, m2r2_sources=sources)
    assert eng.fast_steps == state
    out, _ = eng.generate(list(PROMPTS[1]), NEW)
    assert out == list(refs[1]) and eng.stats.prefetches > 0


def test_blend_with_oracle_moves_recall_and_keeps_lead_and_cost():
    tr = dataclasses.replace(_synthetic(2), probs=None)
    tr.rankings["m2r2"][:, 0] = -1  # a layer the predictor does not guess
    tr = tr.validate()
    layers = list(range(1, tr.n_layers))
    none = blend_with_oracle(tr, "m2r2", 0.0)
    np.testing.assert_array_equal(none.rankings["blend"], tr.rankings["m2r2"])
    full = blend_with_oracle(tr, "m2r2", 1.0)
    assert mean_recall(recall_per_layer(full, "blend"), layers) == 1.0
    assert (full.rankings["blend"][:, 0] == -1).all()  # still no guess there
    half = blend_with_oracle(tr, "m2r2", 0.5, seed=3)
    mid = mean_recall(recall_per_layer(half, "blend"), layers)
    assert mean_recall(recall_per_layer(tr, "m2r2"), layers) <= mid <= 1.0
    assert half.issue["blend"] == tr.issue["m2r2"] and half.fast_steps_of("blend") == 2
    assert token_schedule(half, "blend") == token_schedule(tr, "m2r2")
    with pytest.raises(ValueError, match="share"):
        blend_with_oracle(tr, "m2r2", 1.5)


def test_oracle_with_lead_issues_the_truth_a_layers_ahead():
    tr = _synthetic(2)
    for a in (1, 3, tr.n_layers):
        t = oracle_with_lead(tr, a)
        np.testing.assert_array_equal(t.rankings["oracle_lead"], tr.rankings["oracle"])
        lead = t.lead("oracle_lead")
        assert [int(x) for x in lead] == [min(a, l + 1) for l in range(tr.n_layers)]
        assert t.fast_steps_of("oracle_lead") == 0 and "fast_attn" not in {k for k, _ in token_schedule(t, "oracle_lead")}
    # on a free link even the shortest lead never stalls
    fast = dataclasses.replace(COSTS, link_bytes_per_s=1e12, link_latency_s=0.0)
    assert simulate(oracle_with_lead(tr, 1), "oracle_lead", fast, 6, "predictive_lfu").stall_s == 0
    with pytest.raises(ValueError, match="lead=0"):
        oracle_with_lead(tr, 0)
