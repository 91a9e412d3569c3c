"""The trace-replay simulator against analytic bounds, on synthetic traces."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from m2r2_jax.errors import ConfigError
from m2r2_jax.moe_offload.platforms import CostModel, get_platform, get_shape, platform_costs
from m2r2_jax.moe_offload.policies import SlotTable
from m2r2_jax.moe_offload.simulator import check_bounds, simulate, token_schedule
from m2r2_jax.moe_offload.trace import RoutingTrace, next_gate_issue

COSTS = CostModel(attn_s=1.0, moe_s=2.0, fast_attn_s=1.5, fast_mlp_s=0.5, expert_bytes=1000,
                  link_latency_s=0.5, link_bytes_per_s=1000.0)  # transfer 1.5 s


def synthetic_trace(rng, n_tokens, L, E, k, noise=0.3, b=1, r=2):
    true = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(L)]) for _ in range(n_tokens)])

    def ranking(t, accurate):
        perm = rng.permutation(E)
        if accurate:
            head = list(t)
            perm = np.array(head + [e for e in perm if e not in head])
        return perm

    oracle = np.stack([[ranking(true[n, l], True) for l in range(L)] for n in range(n_tokens)])
    noisy = np.stack([[ranking(true[n, l], rng.random() > noise) for l in range(L)] for n in range(n_tokens)])
    visited = tuple(min(b + r * (i + 1), L) - 1 for i in range(-(-(L - b) // r)))
    fast_routes = noisy[:, list(visited), :k]
    ng = noisy.copy()
    return RoutingTrace(
        n_layers=L, n_experts=E, top_k=k, true=true,
        rankings={"oracle": oracle, "next_gate": ng, "m2r2": noisy},
        issue={"oracle": [("attn", 0)] * L, "next_gate": next_gate_issue(L, 1),
               "m2r2": [("attn", b)] * L},
        uses_fast={"m2r2": True}, branch_layer=b, visited=visited, moe_fast_mlp="experts",
        fast_routes=fast_routes,
    ).validate()


def test_schedule_places_fast_pass_before_branch_layer():
    tr = synthetic_trace(np.random.default_rng(0), 2, 4, 4, 2, b=1, r=2)
    ops = token_schedule(tr, "m2r2")
    assert ops[:2] == [("attn", 0), ("moe", 0)]
    assert ops[2:6] == [("fast_attn", 0), ("fast_mlp", 0), ("fast_attn", 1), ("fast_mlp", 1)]
    assert token_schedule(tr, "next_gate") == [(kind, l) for l in range(4) for kind in ("attn", "moe")]
    assert list(tr.lead("next_gate")) == [1, 1, 1, 1]
    assert list(tr.lead("oracle")) == [1, 2, 3, 4]
    assert list(tr.lead("m2r2")) == [0, 1, 2, 3]


def test_all_resident_costs_compute_only():
    tr = synthetic_trace(np.random.default_rng(1), 5, 3, 8, 2)
    r = simulate(tr, "none", COSTS, capacity=2, all_resident=True)
    assert r.total_s == pytest.approx(5 * 3 * (COSTS.attn_s + COSTS.moe_s))
    assert r.transfers == 0 and r.stall_s == 0 and r.hit_rate == 1.0


def test_all_miss_is_compute_plus_serial_transfers():
    # Consecutive tokens use disjoint expert pairs at every layer and the cache holds one pair:
    # every demand misses and nothing overlaps.
    L, E, k, n = 3, 4, 2, 6
    true = np.array([[[0, 1] if t % 2 == 0 else [2, 3] for _ in range(L)] for t in range(n)])
    tr = RoutingTrace(L, E, k, true, {}, {}, {}).validate()
    r = simulate(tr, "none", COSTS, capacity=2)
    assert r.demand_misses == n * L * k and r.demand_hits == 0
    assert r.total_s == pytest.approx(n * L * (COSTS.attn_s + COSTS.moe_s) + n * L * k * COSTS.transfer_s)
    assert r.stall_s == pytest.approx(n * L * k * COSTS.transfer_s)


def test_oracle_with_free_link_never_stalls_and_lru_reuse_hits():
    tr = synthetic_trace(np.random.default_rng(2), 8, 4, 8, 2)
    fast_link = CostModel(1.0, 2.0, 1.0, 1.0, 1000, 0.0, 1e12)
    r = simulate(tr, "oracle", fast_link, capacity=4, policy="predictive")
    assert r.stall_s == pytest.approx(0.0, abs=1e-6) and r.demand_misses == 0
    # A token that repeats the previous token's experts hits in an on-demand LRU cache.
    same = np.repeat(tr.true[:1], 4, axis=0)
    tr2 = RoutingTrace(4, 8, 2, same, {}, {}, {}).validate()
    r2 = simulate(tr2, "none", COSTS, capacity=2)
    assert r2.demand_misses == 4 * 2 and r2.demand_hits == 3 * 4 * 2


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), cap=st.integers(2, 6), bw=st.sampled_from([100.0, 1000.0, 1e5]),
       pred=st.sampled_from(["none", "oracle", "next_gate", "m2r2"]), policy=st.sampled_from(["lru", "predictive"]),
       priority=st.booleans())
def test_overlap_bounds_hold_for_random_traces(seed, cap, bw, pred, policy, priority):
    tr = synthetic_trace(np.random.default_rng(seed), 6, 5, 8, 2)
    costs = CostModel(1.0, 2.0, 1.5, 2.0, 1000, 0.2, bw)
    r = simulate(tr, pred, costs, capacity=cap, policy=policy, demand_priority=priority)
    assert check_bounds(r, costs)
    assert r.total_s >= r.compute_s + r.stall_s - 1e-9  # stalls are on the critical path
    assert r.demand_hits + r.demand_misses == 6 * 5 * 2


def test_prediction_helps_on_a_balanced_link():
    tr = synthetic_trace(np.random.default_rng(3), 30, 6, 8, 2, noise=0.1)
    costs = CostModel(1.0, 1.0, 1.0, 1.0, 1000, 0.0, 1000.0)  # rho = 0.5
    base = simulate(tr, "none", costs, 4, "lru")
    oracle = simulate(tr, "oracle", costs, 4, "predictive")
    assert oracle.total_s < base.total_s
    assert oracle.demand_misses < base.demand_misses


def test_misses_overtake_queued_wrong_prefetches():
    # One layer, 8 experts; the guess is always wrong and issued just before the demand, so
    # first-come-first-served makes every miss wait behind two useless prefetches.
    L, E, k, n = 1, 8, 2, 4
    true = np.array([[[0, 1]] if t % 2 == 0 else [[2, 3]] for t in range(n)])
    wrong = np.array([[[4, 5, 0, 1, 2, 3, 6, 7]] if t % 2 == 0 else [[6, 7, 0, 1, 2, 3, 4, 5]] for t in range(n)])
    tr = RoutingTrace(L, E, k, true, {"bad": wrong}, {"bad": [("moe", 0)]}, {}).validate()
    costs = CostModel(1.0, 1.0, 0.0, 0.0, 1000, 0.0, 1000.0)  # transfer 1 s
    fifo = simulate(tr, "bad", costs, capacity=4, policy="lru", demand_priority=False)
    prio = simulate(tr, "bad", costs, capacity=4, policy="lru", demand_priority=True)
    assert prio.total_s < fifo.total_s
    # with priority a miss waits at most for the one prefetch already on the link
    assert prio.stall_s <= n * (k + 1) * 1.0 + 1e-9
    assert fifo.stall_s > prio.stall_s


def test_bad_capacity_and_predictor_are_one_line_errors():
    tr = synthetic_trace(np.random.default_rng(4), 2, 2, 4, 2)
    with pytest.raises(ConfigError, match="capacity"):
        simulate(tr, "none", COSTS, capacity=1)
    with pytest.raises(ConfigError, match="predictor"):
        simulate(tr, "psychic", COSTS, capacity=2)
    with pytest.raises(ConfigError, match="policy"):
        SlotTable(2, "fifo")


def test_policies_choose_victims():
    t = SlotTable(3, "lru")
    for s, e in enumerate([5, 6, 7]):
        t.install(s, e)
    t.touch(0)
    assert t.victim() == 1
    assert t.victim(protect=[6]) == 2
    p = SlotTable(3, "predictive")
    for s, e in enumerate([5, 6, 7]):
        p.install(s, e)
    p.set_prediction([5, 6])
    assert p.victim() == 2  # the only unpredicted expert, even though 5 is older
    assert p.victim(protect=[5, 6, 7]) is None


def test_platform_costs_follow_the_stated_model():
    shape = get_shape("mixtral-8x7b")
    assert shape.expert_bytes == 3 * 4096 * 14336 * 2
    c = platform_costs(shape, get_platform("pcie_gen4"))
    assert c.transfer_s == pytest.approx(10e-6 + shape.expert_bytes / 25e9)
    assert c.rho > 10  # PCIe with Mixtral experts is link-bound
    c2 = platform_costs(shape, get_platform("nvlink_c2c"))
    assert c2.rho < c.rho
    assert platform_costs(shape, get_platform("pcie_gen4"), moe_fast_mlp="none").fast_mlp_s == 0.0
    with pytest.raises(ConfigError):
        get_platform("carrier_pigeon")
