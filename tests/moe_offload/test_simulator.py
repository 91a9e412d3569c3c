"""The trace-replay simulator against analytic bounds, on synthetic traces."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from m2r2_jax.errors import ConfigError
from m2r2_jax.moe_offload.platforms import CostModel, get_platform, get_shape, platform_costs
from m2r2_jax.moe_offload.policies import SlotTable
from m2r2_jax.moe_offload.report import LADDER, ceiling, simulate_ladder
from m2r2_jax.moe_offload.simulator import check_bounds, next_use_table, simulate, token_schedule
from m2r2_jax.moe_offload.trace import RoutingTrace, next_gate_issue

COSTS = CostModel(attn_s=1.0, moe_s=2.0, fast_attn_s=1.5, fast_mlp_s=0.5, expert_bytes=1000,
                  link_latency_s=0.5, link_bytes_per_s=1000.0)  # transfer 1.5 s


def synthetic_trace(rng, n_tokens, L, E, k, noise=0.3, b=1, r=2, p=None):
    """Random routing (expert popularity `p`, uniform if None); the oracle ranks it exactly, the
    other predictors are right with probability 1 - noise."""
    true = np.stack([np.stack([rng.choice(E, k, replace=False, p=p) for _ in range(L)]) for _ in range(n_tokens)])

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
       pred=st.sampled_from(["none", "oracle", "next_gate", "m2r2"]),
       policy=st.sampled_from(["lru", "predictive", "lfu", "predictive_lfu"]),
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


def _one_wrong_guess_trace(tokens=1):
    """One layer, 8 experts, top-2: the slow stream demands {0, 1}; the guess [4, 5] is issued at
    the op just before the demand, so its first transfer is on the link when the misses arrive."""
    true = np.array([[[0, 1]]] * tokens)
    guess = np.array([[[4, 5, 0, 1, 2, 3, 6, 7]]] * tokens)
    return RoutingTrace(1, 8, 2, true, {"bad": guess}, {"bad": [("moe", 0)]}, {}).validate()


def test_a_chunked_link_lets_a_miss_preempt_a_prefetch_at_a_chunk_boundary():
    # transfer 1 s, attention 1 s. Whole experts: the prefetch of 4 started at t=1 holds the link
    # until 2, then the misses 0, 1 take [2, 3], [3, 4]: stall 3 s. Four chunks: 4 yields after its
    # first chunk [1, 1.25], the misses take [1.25, 3.25] and the prefetches finish afterwards.
    tr = _one_wrong_guess_trace()
    costs = CostModel(1.0, 1.0, 0.0, 0.0, 1000, 0.0, 1000.0)
    on_demand = simulate(tr, "none", costs, capacity=4)
    whole = simulate(tr, "bad", costs, capacity=4, link_chunks=1)
    chunked = simulate(tr, "bad", costs, capacity=4, link_chunks=4)
    assert on_demand.stall_s == pytest.approx(2.0)
    assert whole.stall_s == pytest.approx(3.0)
    assert chunked.stall_s == pytest.approx(2.25)
    assert whole.bytes_moved == chunked.bytes_moved == 4 * 1000  # preempted, not dropped
    assert chunked.link_busy_s == pytest.approx(4.0) and check_bounds(chunked, costs)
    assert simulate(tr, "bad", costs, capacity=4) == whole  # whole experts are the default


def test_a_preempted_prefetch_whose_slot_is_reused_stops_with_the_chunks_it_moved():
    # Two slots: the misses evict both prefetched experts. 4 had moved one of four chunks, 5 none.
    tr = _one_wrong_guess_trace()
    costs = CostModel(1.0, 1.0, 0.0, 0.0, 1000, 0.0, 1000.0)
    chunked = simulate(tr, "bad", costs, capacity=2, link_chunks=4)
    assert chunked.bytes_moved == 2250 and chunked.transfers == 3 and chunked.cancelled == 1
    assert chunked.stall_s == pytest.approx(2.25) and chunked.link_busy_s == pytest.approx(2.25)
    whole = simulate(tr, "bad", costs, capacity=2)
    assert whole.bytes_moved == 3000 and whole.transfers == 3 and whole.cancelled == 1


def test_chunks_pay_the_link_latency_each_and_change_nothing_without_prefetch():
    tr = synthetic_trace(np.random.default_rng(7), 6, 3, 8, 2)
    free = CostModel(1.0, 2.0, 1.5, 2.0, 1000, 0.0, 1000.0)
    for policy in ("lru", "lfu"):
        a = simulate(tr, "none", free, 4, policy)
        b = simulate(tr, "none", free, 4, policy, link_chunks=5)
        assert b.total_s == pytest.approx(a.total_s) and b.transfers == a.transfers
        assert b.bytes_moved == a.bytes_moved
    lat = CostModel(1.0, 2.0, 1.5, 2.0, 1000, 0.2, 1000.0)  # an expert: 0.2 + 1.0 s in one piece
    one = simulate(tr, "none", lat, 4)
    five = simulate(tr, "none", lat, 4, link_chunks=5)  # 5 x (0.2 + 0.2) s
    assert one.stall_s == pytest.approx(one.demand_misses * 1.2)
    assert five.stall_s == pytest.approx(five.demand_misses * 2.0)
    with pytest.raises(ConfigError, match="chunks"):
        simulate(tr, "none", lat, 4, link_chunks=0)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), cap=st.integers(2, 6), bw=st.sampled_from([100.0, 1000.0, 1e5]),
       pred=st.sampled_from(["oracle", "next_gate", "m2r2"]),
       policy=st.sampled_from(["lru", "predictive", "lfu", "predictive_lfu", "belady"]),
       chunks=st.sampled_from([2, 3, 8]))
def test_chunked_link_bounds_hold_and_misses_never_wait_longer(seed, cap, bw, pred, policy, chunks):
    tr = synthetic_trace(np.random.default_rng(seed), 6, 5, 8, 2)
    costs = CostModel(1.0, 2.0, 1.5, 2.0, 1000, 0.0, bw)
    r = simulate(tr, pred, costs, capacity=cap, policy=policy, link_chunks=chunks)
    assert check_bounds(r, costs)
    assert r.total_s >= r.compute_s + r.stall_s - 1e-9
    assert r.demand_hits + r.demand_misses == 6 * 5 * 2
    assert r.bytes_moved <= r.transfers * costs.expert_bytes
    assert r.link_busy_s == pytest.approx(r.bytes_moved / costs.link_bytes_per_s,
                                                abs=1.0 / costs.link_bytes_per_s)  # bytes are whole


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


def test_lfu_evicts_the_least_demanded_expert():
    for policy in ("lfu", "predictive_lfu"):
        t = SlotTable(3, policy)
        for s, e in enumerate([5, 6, 7]):
            t.install(s, e)
        t.count_uses([5, 5, 6, 7, 7])  # 5 and 7 twice, 6 once
        assert t.victim() == 1
        t.count_uses([6, 6])
        assert t.victim() == 0  # 5: tied with 7 on demands, and used less recently
        t.touch(0)
        assert t.victim() == 2
        t.install(2, 9)  # 7 leaves; its count stays for when it comes back
        assert t.uses[7] == 2 and t.victim() == 2  # 9 has never been demanded
    p = SlotTable(3, "predictive_lfu")
    for s, e in enumerate([5, 6, 7]):
        p.install(s, e)
    p.count_uses([5, 6, 6, 7, 7])
    p.set_prediction([5])
    assert p.victim() == 1  # 5 is the least demanded but predicted: the next least demanded goes
    assert SlotTable(3, "lfu").victim(protect=[1]) == 0  # free slots first


def test_frequency_policies_admit_a_prefetch_only_over_a_victim_demanded_no_more_often():
    for policy in ("lfu", "predictive_lfu"):
        t = SlotTable(2, policy)
        t.install(0, 5)
        t.install(1, 6)
        t.count_uses([5, 5, 6])
        assert t.victim() == 1  # a demand always gets a slot
        assert t.victim(incoming=7) is None  # never demanded: 6 (once) stays
        t.count_uses([7])
        assert t.victim(incoming=7) == 1  # a tie admits
        t.count_uses([7, 7])
        assert t.victim(incoming=7) == 1  # the least demanded is still the victim
    for policy in ("lru", "predictive"):
        t = SlotTable(1, policy)
        t.install(0, 5)
        t.count_uses([5, 5])
        assert t.victim(incoming=7) == 0  # recency policies admit every prefetch


def test_lfu_keeps_the_popular_expert_that_lru_cycles_out():
    # One layer, one expert per token, two slots: 0 is demanded every other token, between 1, 2, 3...
    # LRU evicts 0 whenever two others came since; LFU keeps the expert demanded most.
    seq = [0, 1, 0, 2, 3, 0, 4, 5, 0, 6, 7, 0]
    true = np.array([[[e]] for e in seq])
    tr = RoutingTrace(1, 8, 1, true, {}, {}, {}).validate()
    lru = simulate(tr, "none", COSTS, capacity=2, policy="lru")
    lfu = simulate(tr, "none", COSTS, capacity=2, policy="lfu")
    assert lru.demand_hits == 1  # only 0 right after 1
    assert lfu.demand_hits == 4 and lfu.transfers == len(seq) - 4
    assert check_bounds(lfu, COSTS)


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


# --------------------------------------------------------------------------------------------
# Belady (MIN) eviction: the ceiling of every cache policy
# --------------------------------------------------------------------------------------------
def skewed_trace(rng, n_tokens, L, E, k):
    """Routing with reuse, like a trained router: a few popular experts per layer (Zipf-like)."""
    weights = 1.0 / np.arange(1, E + 1) ** rng.uniform(0.3, 1.5)
    return synthetic_trace(rng, n_tokens, L, E, k, p=weights / weights.sum())


def test_belady_on_a_hand_worked_sequence():
    # One layer, one expert per token, two slots, demands 0 1 2 0 1 2 0 1 2. LRU always evicts
    # the expert needed next: 9 misses. Belady keeps the one needed sooner:
    #   0 m, 1 m, 2 m (evict 1: next 4 > 3), 0 hit, 1 m (evict 0: 6 > 5), 2 hit,
    #   0 m (evict 2: 8 > 7), 1 hit, 2 m  -> 6 misses, 3 hits.
    true = np.array([[[e]] for e in [0, 1, 2] * 3])
    tr = RoutingTrace(1, 3, 1, true, {}, {}, {}).validate()
    lru = simulate(tr, "none", COSTS, capacity=2, policy="lru")
    bel = simulate(tr, "none", COSTS, capacity=2, policy="belady")
    assert (lru.demand_misses, lru.demand_hits) == (9, 0)
    assert (bel.demand_misses, bel.demand_hits) == (6, 3)
    # no prefetch, so nothing overlaps: every miss adds one transfer to the compute
    assert bel.total_s == pytest.approx(9 * (COSTS.attn_s + COSTS.moe_s) + 6 * COSTS.transfer_s)
    nu = next_use_table(tr)
    assert list(nu[:, 0, 0]) == [0, 3, 3, 3, 6, 6, 6, np.inf, np.inf]


def test_belady_victim_choice():
    t = SlotTable(3, "belady")
    for s, e in enumerate([5, 6, 7]):
        t.install(s, e)
    with pytest.raises(ConfigError, match="simulator"):
        t.victim()
    nu = {5: 4.0, 6: np.inf, 7: 9.0, 8: 2.0, 9: np.inf}
    t.set_next_use(nu)
    assert t.victim() == 1  # 6 is never needed again
    assert t.victim(protect=[6]) == 2
    assert t.victim(protect=[6], incoming=8) == 2  # 8 is needed before 7: worth the swap
    assert t.victim(incoming=9) is None  # a prefetch never needed cannot beat keeping anything
    nu[6] = 9.0
    t.touch(2)
    assert t.victim() == 1  # equal next uses: the least recently used goes


def test_belady_never_loads_more_than_any_policy():
    # Seeded property check on 50 random traces: Belady's demand paging loads no more experts than
    # on-demand LRU or any prefetching rung (prefetches are loads too), at every capacity.
    rng = np.random.default_rng(7)
    costs = CostModel(1.0, 2.0, 1.5, 2.0, 1000, 0.2, 400.0)
    strictly_fewer = 0
    for case in range(50):
        E, k = (8, 2) if case % 2 else (6, 1)
        tr = skewed_trace(rng, 12, 3, E, k)
        cap = int(rng.integers(k, E))
        bel = simulate(tr, "none", costs, cap, "belady")
        lru = simulate(tr, "none", costs, cap, "lru")
        assert bel.demand_misses <= lru.demand_misses
        assert bel.transfers == bel.demand_misses
        strictly_fewer += bel.demand_misses < lru.demand_misses
        for pred in ("oracle", "next_gate", "m2r2"):
            for policy in ("lru", "predictive", "lfu", "predictive_lfu", "belady"):
                assert simulate(tr, pred, costs, cap, policy).transfers >= bel.transfers
    assert strictly_fewer >= 25  # the property is not vacuous: Belady usually wins outright


@pytest.mark.parametrize("bw", [100.0, 1000.0, 1e5])  # link-bound, balanced, compute-bound
def test_oracle_belady_is_the_top_rung(bw):
    # Within the token, perfect guesses issued first and Belady eviction leave nothing to gain. (A
    # guess issued a token earlier can, rarely, win on timing, e.g. a wrong next-gate guess that is
    # the next token's expert on a one-layer trace; never on loads, hence the bound below.)
    costs = CostModel(1.0, 2.0, 1.5, 2.0, 1000, 0.2, bw)
    rng = np.random.default_rng(int(bw))
    for _ in range(10):
        tr = skewed_trace(rng, 10, 4, 8, 2)
        lad = simulate_ladder(tr, costs, capacity=4)
        top = lad["oracle_belady"]["speedup_vs_on_demand_lru"]
        for rung in LADDER[:-1]:
            assert top >= lad[rung]["speedup_vs_on_demand_lru"] - 1e-9, rung
        assert lad["all_resident"]["speedup_vs_on_demand_lru"] >= top - 1e-9
        bound = ceiling(lad, costs, tr.n_layers)
        # no rung at this capacity beats max(compute, Belady loads x transfer)
        assert all(lad[r]["total_s"] >= bound["bound_s"] - 1e-9 for r in LADDER[:-1])
        assert bound["bound_speedup_vs_on_demand_lru"] >= top - 1e-9
        assert bound["loads_ratio_bound"] >= bound["bound_speedup_vs_on_demand_lru"] - 1e-9


def test_engine_rejects_belady():
    import jax
    from conftest import tiny_config

    from m2r2_jax.models import transformer as T
    from m2r2_jax.moe_offload.engine import OffloadEngine

    cfg = tiny_config("mixtral")
    params = T.init_params(cfg, jax.random.key(0))
    with pytest.raises(ConfigError, match="simulator-only") as e:
        OffloadEngine(cfg, params, policy="belady")
    assert "\n" not in str(e.value) and "lru, predictive" in str(e.value)


def test_expert_load_spans_even_to_collapsed():
    """Busiest expert's share x E: a layer whose tokens all pick experts {0, 1} is collapsed (E / k);
    one alternating between {0, 1} and {2, 3} is even (1)."""
    from m2r2_jax.moe_offload.metrics import expert_load

    true = np.array([[[0, 1], [0, 1]], [[0, 1], [2, 3]], [[1, 0], [0, 1]], [[0, 1], [3, 2]]])  # [N=4, L=2, k=2]
    load = expert_load(RoutingTrace(2, 4, 2, true, {}, {}, {}).validate())
    assert load["busiest_expert_load_per_layer"] == [2.0, 1.0]
    assert load["busiest_expert_load"] == 1.5 and load["collapsed"] == 2.0 and load["even"] == 1.0
    assert not load["skewed"]  # 8 assignments per layer: too few to tell
    many = np.tile(true, (5, 1, 1))  # 40 assignments per layer = 10 per expert
    assert expert_load(RoutingTrace(2, 4, 2, many, {}, {}, {}).validate())["skewed"]
    even = np.tile(true[:, 1:], (5, 2, 1))  # both layers alternate {0, 1} / {2, 3}
    assert not expert_load(RoutingTrace(2, 4, 2, even, {}, {}, {}).validate())["skewed"]
