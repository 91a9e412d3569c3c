"""The real offload engine decodes exactly what the all-resident model decodes."""

import jax
import numpy as np
import pytest
from conftest import tiny_config
from moe_fixtures import NEW, PROMPTS, tiny_moe_setup

from m2r2_jax.errors import ConfigError, DataError
from m2r2_jax.models import transformer as T
from m2r2_jax.moe_offload.engine import ExpertStore, OffloadEngine, memory_kinds

PROMPT = list(PROMPTS[0])


@pytest.fixture(scope="module")
def moe():
    cfg, params, _, _, refs = tiny_moe_setup()
    return cfg, params, list(refs[0])


def reference_logits(cfg, params, tokens):
    """Logits of the plain model at every decoded position (one full forward)."""
    logits, _ = T.forward(cfg, params, np.asarray([tokens]))
    return np.asarray(logits[0])


def test_experts_live_in_pinned_host_memory(moe):
    cfg, params, _ = moe
    assert "pinned_host" in memory_kinds()
    store = ExpertStore(cfg, params)
    g, u, d = store.experts[1][2]
    assert g.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(d), np.asarray(params["layers"]["mlp"]["experts_down"][1, 2]))
    assert store.expert_bytes == 3 * cfg.d_model * cfg.moe_d_ff * 4


@pytest.mark.parametrize("predictor,capacity,policy", [
    ("none", 2, "lru"), ("next_gate", 2, "predictive"), ("next_gate", 3, "lru"),
    ("oracle", 3, "predictive"), ("none", 6, "lru"), ("none", 2, "lfu"), ("next_gate", 2, "predictive_lfu"),
])
def test_engine_tokens_equal_all_resident_model(moe, predictor, capacity, policy):
    cfg, params, ref = moe
    routes = None
    if predictor == "oracle":
        first = OffloadEngine(cfg, params, capacity=capacity)
        first.generate(PROMPT, NEW)
        routes = first.routes
    eng = OffloadEngine(cfg, params, capacity=capacity, policy=policy, predictor=predictor)
    out, logits = eng.generate(PROMPT, NEW, oracle_routes=routes)
    assert out == ref
    want = reference_logits(cfg, params, PROMPT + out)[len(PROMPT) - 1 : len(PROMPT) - 1 + NEW]
    np.testing.assert_allclose(logits, want, atol=2e-4, rtol=2e-4)
    s = eng.stats
    assert s.demand_hits + s.demand_misses == (NEW - 1) * cfg.n_layers * cfg.n_experts_per_tok
    assert s.bytes_moved == s.transfers * eng.store.expert_bytes
    if predictor == "oracle":
        assert s.demand_misses == 0  # the oracle prefetched every routed expert
    if capacity == cfg.n_experts and predictor == "none":
        assert s.transfers <= cfg.n_layers * cfg.n_experts  # each expert loaded at most once


def test_all_resident_engine_never_transfers_while_decoding(moe):
    cfg, params, ref = moe
    eng = OffloadEngine(cfg, params, capacity=cfg.n_experts)
    eng.preload_all()
    out, _ = eng.generate(PROMPT, NEW)
    assert out == ref
    assert eng.stats.transfers == 0 and eng.stats.hit_rate == 1.0
    with pytest.raises(ConfigError, match="preloading"):
        OffloadEngine(cfg, params, capacity=2).preload_all()


def test_engine_with_m2r2_predictor_is_exact(moe):
    cfg, params, ref = moe
    _, _, mcfg, mp, _ = tiny_moe_setup()
    eng = OffloadEngine(cfg, params, capacity=2, policy="predictive", predictor="m2r2", mcfg=mcfg, m2r2_params=mp)
    out, _ = eng.generate(PROMPT, NEW)
    assert out == ref
    assert eng.stats.prefetches > 0


@pytest.mark.parametrize("policy,admitted", [("lru", True), ("predictive", True), ("lfu", False),
                                             ("predictive_lfu", False)])
def test_engine_prefetch_never_evicts_a_more_demanded_expert_under_frequency_policies(moe, policy, admitted):
    cfg, params, _ = moe
    eng = OffloadEngine(cfg, params, capacity=2, policy=policy)
    eng.prefetch(0, [4])  # a free slot: always admitted
    assert eng.tables[0].slot_of(4) is not None and eng.stats.prefetches == 1
    eng._demand(0, [0, 1])  # 0 and 1 demanded once each; 4 is evicted (demands always load)
    eng.prefetch(0, [3])  # never demanded: the frequency policies refuse to evict 0 or 1 for it
    assert (eng.tables[0].slot_of(3) is not None) == admitted
    assert eng.stats.prefetches == 1 + admitted and eng.stats.transfers == 3 + admitted


def test_engine_rejects_bad_input(moe):
    cfg, params, _ = moe
    with pytest.raises(ConfigError, match="capacity"):
        OffloadEngine(cfg, params, capacity=1)
    with pytest.raises(ConfigError, match="predictor"):
        OffloadEngine(cfg, params, predictor="crystal_ball")
    with pytest.raises(ConfigError, match="M2R2"):
        OffloadEngine(cfg, params, predictor="m2r2")
    with pytest.raises(ConfigError, match="MoE"):
        dense = tiny_config("llama")
        OffloadEngine(dense, T.init_params(dense, jax.random.key(0)))
    eng = OffloadEngine(cfg, params)
    with pytest.raises(DataError, match="vocabulary|token ids"):
        eng.generate([cfg.vocab_size + 3], 2)
    with pytest.raises(DataError, match="max_seq_len"):
        eng.generate(PROMPT, cfg.max_seq_len)


def test_engine_with_shared_expert_family_is_exact():
    # Qwen2-MoE: a sigmoid-gated shared expert next to the routed ones (and qkv biases).
    from m2r2_jax.moe_offload.record import generate_reference

    cfg = tiny_config("qwen2_moe", n_layers=2)
    params = T.init_params(cfg, jax.random.key(3))
    ref = generate_reference(cfg, params, PROMPT[:3], 3)
    out, _ = OffloadEngine(cfg, params, capacity=2).generate(PROMPT[:3], 3)
    assert out == ref
