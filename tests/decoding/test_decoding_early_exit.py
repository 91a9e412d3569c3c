"""Early exit (m2r2_exit, distance_exit): the compute it reports, the tokens it emits when no
token exits, and the exactness of the "deferred" K/V completion."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from decoding_helpers import MAX_NEW, model, random_m2r2, reference_cache, run
from m2r2_jax.decoding import api
from m2r2_jax.errors import ConfigError
from m2r2_jax.m2r2.config import M2R2Config
from m2r2_jax.m2r2.fast_stream import draft_cost_layers
from m2r2_jax.models.transformer import cache_length

PROMPTS = [[1, 2, 3], [4, 5], [9, 10, 11, 12, 13, 14], [6]]
MCFG = M2R2Config(branch_layer=1, rate=2, lora_rank=4, router_dim=8, router_hidden=8)
STATE_MCFG = dataclasses.replace(MCFG, router_features="state")  # the router reads no head
STATE_TAU = 0.55  # some tokens leave, some do not


@functools.lru_cache(maxsize=None)
def m2r2_params(mcfg=MCFG):
    cfg, _ = model("llama")
    return random_m2r2(cfg, mcfg, 3, adapter_scale=0.2)


def engine(method, kv_missing="propagate", decider="confidence", window=2, layer_loop="scan", mcfg=MCFG):
    cfg, params = model("llama")
    kw = dict(m2r2=(mcfg, m2r2_params(mcfg))) if method == "m2r2_exit" else dict(decider=decider)
    eng = api.build_engine(method, cfg, params, max_new_tokens=MAX_NEW, kv_missing=kv_missing,
                           deferred_window=window, layer_loop=layer_loop, **kw)
    return cfg, params, eng


@pytest.mark.parametrize("mcfg", [MCFG, STATE_MCFG], ids=["logits_router", "state_router"])
def test_m2r2_exit_without_router_firing_is_plain_decoding(mcfg):
    cfg, params, eng = engine("m2r2_exit", mcfg=mcfg)
    res, _ = run(eng, PROMPTS, tau=1.0)
    ar, _ = run(api.build_engine("ar", cfg, params, max_new_tokens=MAX_NEW), PROMPTS)
    k = MCFG.steps(cfg)
    for r, a in zip(res, ar):
        assert r.tokens == a.tokens
        assert r.early_exits == 0
        steps = len(r.tokens) - 1
        assert r.target_layers == pytest.approx(steps * cfg.n_layers)
        assert r.draft_layers == pytest.approx(steps * (draft_cost_layers(cfg, mcfg) - mcfg.branch_layer), rel=1e-5)
        assert k >= 1


def test_distance_exit_at_the_first_layer_costs_one_layer_per_token_and_fills_skipped_kv():
    cfg, params, eng = engine("distance_exit", "propagate")
    res, state = run(eng, PROMPTS, tau=0.0)
    for i, (p, r) in enumerate(zip(PROMPTS, res)):
        assert r.layers_per_token == pytest.approx(1.0)
        assert r.early_exits == len(r.tokens) - 1
        n = len(p) + len(r.tokens) - 1
        # every layer of every generated position got K/V (propagated from the exit state)
        k = np.asarray(state.cache["k"][:, i, :, len(p):n])  # [L, KV, positions, hd]
        assert np.all(np.abs(k).sum(axis=(1, 3)) > 0)


def test_saturation_exit_runs_the_head_only_where_a_token_leaves_and_emits_the_same_tokens():
    """The saturation decider needs no head to decide, so the head runs only where a token leaves
    (`lax.cond`). Reference: the same rule with the head computed after every layer (the
    confidence path of the runner, its decision replaced by saturation's)."""
    import dataclasses

    from m2r2_jax.decoding import early_exit

    class SaturationWithEagerHead(early_exit.DistanceExit):
        def _fires(self, logits, x_new, x_old, tau):
            return early_exit.DistanceExit._fires(dataclasses.replace(self, decider="saturation"), None, x_new,
                                                  x_old, tau)

    cfg, _, lazy = engine("distance_exit", "propagate", "saturation")
    eager = dataclasses.replace(lazy, spec=dataclasses.replace(
        lazy.spec, drafter=SaturationWithEagerHead(cfg, "confidence", "propagate")))
    got, got_state = run(lazy, PROMPTS, tau=0.5)
    want, want_state = run(eager, PROMPTS, tau=0.5)
    assert sum(r.early_exits for r in got) > 0  # tokens did leave early
    for a, b in zip(got, want):
        assert (a.tokens, a.early_exits, a.target_layers) == (b.tokens, b.early_exits, b.target_layers)
    np.testing.assert_array_equal(np.asarray(got_state.cache["k"]), np.asarray(want_state.cache["k"]))


def test_early_exit_on_layers_that_differ_gemma3():
    """Gemma 3's local and global layers rotate K with their own RoPE: the propagated K/V of skipped
    layers use each layer's own (every token leaves after layer 0 at tau 0)."""
    cfg, params = model("gemma3")
    eng = api.build_engine("distance_exit", cfg, params, max_new_tokens=MAX_NEW)
    res, state = run(eng, PROMPTS, tau=0.0)
    for i, (p, r) in enumerate(zip(PROMPTS, res)):
        assert r.layers_per_token == pytest.approx(1.0) and r.early_exits == len(r.tokens) - 1
        k = np.asarray(state.cache["k"][:, i, :, len(p):len(p) + len(r.tokens) - 1])
        assert np.all(np.abs(k).sum(axis=(1, 3)) > 0)
    m2 = api.build_engine("m2r2_exit", cfg, params, max_new_tokens=MAX_NEW,
                          m2r2=(MCFG, random_m2r2(cfg, MCFG, 3, adapter_scale=0.2)))
    ar, _ = run(api.build_engine("ar", cfg, params, max_new_tokens=MAX_NEW), PROMPTS)
    assert [r.tokens for r in run(m2, PROMPTS, tau=1.0)[0]] == [r.tokens for r in ar]


def _complete_positions(state, row, n):
    """Positions < n whose slow computation has finished (not waiting in the deferred window)."""
    s = cache_length(state.cache)
    pos, prog = np.asarray(state.extra["pos"][row]), np.asarray(state.extra["prog"][row])
    waiting = {int(p) for p, g in zip(pos, prog) if p < s and g < state.cache["k"].shape[0]}
    return [t for t in range(n) if t not in waiting], waiting


@pytest.mark.parametrize("method,decider,tau", [("distance_exit", "saturation", 0.5), ("m2r2_exit", "confidence", 0.3)])
def test_deferred_kv_is_exact_once_completed(method, decider, tau):
    cfg, params, eng = engine(method, "deferred", decider)
    res, state = run(eng, PROMPTS, tau=tau)
    ref = reference_cache(cfg, params, PROMPTS, res)
    exited = 0
    for i, (p, r) in enumerate(zip(PROMPTS, res)):
        exited += r.early_exits
        n = len(p) + len(r.tokens) - 1
        done, waiting = _complete_positions(state, i, n)
        assert len(waiting) <= 2
        for name in ("k", "v"):
            np.testing.assert_allclose(np.asarray(state.cache[name][:, i, :, done]), np.asarray(ref[name][:, i, :, done]),
                                       atol=2e-5, rtol=2e-5)
    assert exited > 0  # some tokens really left early, so deferral and flushes were exercised


@pytest.mark.parametrize("method,decider,kv_missing,tau", [
    ("distance_exit", "confidence", "propagate", 0.3), ("distance_exit", "saturation", "deferred", 0.75),
    ("m2r2_exit", "confidence", "propagate", 0.52), ("m2r2_exit", "confidence", "deferred", 0.55),
    ("m2r2_exit", "state", "propagate", STATE_TAU)])
def test_unrolled_early_exit_is_the_while_loop_early_exit(method, decider, kv_missing, tau):
    """layer_loop="unrolled" runs each layer (and fast step) behind its own lax.cond instead of a
    while loop over the stack: the same tokens, exits, compute and K/V cache."""
    mcfg = STATE_MCFG if decider == "state" else MCFG
    got, got_state = run(engine(method, kv_missing, decider, layer_loop="unrolled", mcfg=mcfg)[2], PROMPTS, tau=tau)
    want, want_state = run(engine(method, kv_missing, decider, mcfg=mcfg)[2], PROMPTS, tau=tau)
    assert sum(r.early_exits for r in want) > 0 and sum(len(r.tokens) - 1 - r.early_exits for r in want) > 0
    for a, b in zip(got, want):
        assert (a.tokens, a.early_exits) == (b.tokens, b.early_exits)
        assert (a.target_layers, a.draft_layers) == pytest.approx((b.target_layers, b.draft_layers))
    for name in ("k", "v"):
        np.testing.assert_allclose(np.asarray(got_state.cache[name]), np.asarray(want_state.cache[name]),
                                   atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("layer_loop", ["scan", "unrolled"])
def test_state_router_exits_compute_the_head_only_where_a_token_leaves(layer_loop, monkeypatch):
    """With router_features="state" a fast step computes no head; the exit head runs in a step
    where a token leaves (`lax.cond`). Reference: the same router with the head computed at every
    step (`fast_step` wrapped to return it): the same tokens, exits and caches."""
    from m2r2_jax.m2r2 import fast_stream as F

    lazy = engine("m2r2_exit", mcfg=STATE_MCFG, layer_loop=layer_loop)[2]
    got, got_state = run(lazy, PROMPTS, tau=STATE_TAU)
    real = F.fast_step

    def eager(base, mcfg, base_params, m2r2_params, i, g, positions, cache, traj):
        g_new, cache, traj, el, logits = real(base, mcfg, base_params, m2r2_params, i, g, positions, cache, traj)
        assert logits is None  # the state router's step reads no head
        return g_new, cache, traj, el, F.exit_head_logits(base, mcfg, base_params, m2r2_params, i, g_new)

    monkeypatch.setattr(F, "fast_step", eager)
    want, want_state = run(engine("m2r2_exit", mcfg=STATE_MCFG, layer_loop=layer_loop)[2], PROMPTS, tau=STATE_TAU)
    assert 0 < sum(r.early_exits for r in want) < sum(len(r.tokens) - 1 for r in want)
    for a, b in zip(got, want):
        assert (a.tokens, a.early_exits, a.draft_layers) == (b.tokens, b.early_exits, b.draft_layers)
    np.testing.assert_array_equal(np.asarray(got_state.cache["k"]), np.asarray(want_state.cache["k"]))


GIVE_UP_MCFG = dataclasses.replace(STATE_MCFG, router_give_up=True)


def _with_router_biases(exit_bias: float, later_bias: float):
    """GIVE_UP_MCFG parameters whose router's exit and "later" logits are the given constants."""
    mp = m2r2_params(GIVE_UP_MCFG)
    router = dict(mp["router"])
    for name, bias in (("mlp_out", exit_bias), ("later_out", later_bias)):
        router[name] = {"kernel": np.zeros_like(router[name]["kernel"]), "bias": np.full_like(router[name]["bias"], bias)}
    return {**mp, "router": router}


@pytest.mark.parametrize("layer_loop", ["scan", "unrolled"])
@pytest.mark.parametrize("later_bias,steps_run", [(-30.0, 1), (30.0, None)], ids=["gives_up", "keeps_going"])
def test_a_router_that_gives_up_stops_the_fast_stream_and_decodes_as_ar(layer_loop, later_bias, steps_run):
    """A router that never fires: expecting no later step to be safe, a token stops after its first
    fast step (1 step's cost), otherwise it runs all K; either way it finishes in the slow stream
    and its tokens and K/V cache are plain decoding's."""
    cfg, params = model("llama")
    k = GIVE_UP_MCFG.steps(cfg)
    eng = api.build_engine("m2r2_exit", cfg, params, max_new_tokens=MAX_NEW, layer_loop=layer_loop,
                           m2r2=(GIVE_UP_MCFG, _with_router_biases(-30.0, later_bias)))
    res, state = run(eng, PROMPTS, tau=0.5)
    ar, ar_state = run(api.build_engine("ar", cfg, params, max_new_tokens=MAX_NEW), PROMPTS)
    step_cost = (draft_cost_layers(cfg, GIVE_UP_MCFG) - GIVE_UP_MCFG.branch_layer) / k
    for r, a in zip(res, ar):
        assert r.tokens == a.tokens and r.early_exits == 0
        n = len(r.tokens) - 1
        assert r.target_layers == pytest.approx(n * cfg.n_layers)
        assert r.draft_layers == pytest.approx(n * (steps_run or k) * step_cost, rel=1e-5)
    for name in ("k", "v"):
        np.testing.assert_allclose(np.asarray(state.cache[name]), np.asarray(ar_state.cache[name]), atol=2e-5)


def test_give_up_with_a_trained_shape_router_mixes_exits_and_stops():
    """A random router that can give up: at one tau some tokens exit, some stop early and some
    run every step; the unrolled loop gives the while loop's tokens, exits and compute."""
    cfg, _ = model("llama")
    k = GIVE_UP_MCFG.steps(cfg)
    mp = m2r2_params(GIVE_UP_MCFG)
    router = {**mp["router"], "later_out": {**mp["router"]["later_out"],
                                            "bias": mp["router"]["later_out"]["bias"] + 0.3}}
    mp = {**mp, "router": router}

    def go(layer_loop, mcfg=GIVE_UP_MCFG, m2=mp):
        cfg, params = model("llama")
        eng = api.build_engine("m2r2_exit", cfg, params, max_new_tokens=MAX_NEW, layer_loop=layer_loop,
                               m2r2=(mcfg, m2))
        return run(eng, PROMPTS, tau=STATE_TAU)[0]

    want, got = go("scan"), go("unrolled")
    # the same exit logits without the give-up output: every token that does not exit runs all K steps
    never = go("scan", STATE_MCFG, {**mp, "router": {n: v for n, v in router.items() if n != "later_out"}})
    step_cost = (draft_cost_layers(cfg, GIVE_UP_MCFG) - GIVE_UP_MCFG.branch_layer) / k
    tokens = sum(len(r.tokens) - 1 for r in want)
    steps = sum(r.draft_layers for r in want) / step_cost
    assert sum(r.early_exits for r in want) > 0
    assert tokens < steps < sum(r.draft_layers for r in never) / step_cost
    for a, b in zip(got, want):
        assert (a.tokens, a.early_exits) == (b.tokens, b.early_exits)
        assert (a.target_layers, a.draft_layers) == pytest.approx((b.target_layers, b.draft_layers))


@pytest.mark.parametrize("layer_loop", ["scan", "unrolled"])
def test_confirmed_exits_need_a_confident_exit_head(layer_loop):
    """A router that releases every token at tau 1.0 (logit 30: sigmoid rounds to 1): alone, every
    token leaves at the first fast step; with `exit_confirm` the exit head of this random model is
    never that sure, so no token leaves, every token runs all K steps (the router never gives up
    here) and decoding is plain decoding's."""
    cfg, params = model("llama")
    k = GIVE_UP_MCFG.steps(cfg)
    m2 = (GIVE_UP_MCFG, _with_router_biases(30.0, 30.0))
    ar, _ = run(api.build_engine("ar", cfg, params, max_new_tokens=MAX_NEW), PROMPTS)
    step_cost = (draft_cost_layers(cfg, GIVE_UP_MCFG) - GIVE_UP_MCFG.branch_layer) / k
    for confirm in (False, True):
        eng = api.build_engine("m2r2_exit", cfg, params, max_new_tokens=MAX_NEW, layer_loop=layer_loop, m2r2=m2,
                               exit_confirm=confirm)
        res, _ = run(eng, PROMPTS, tau=1.0)
        for r, a in zip(res, ar):
            n = len(r.tokens) - 1
            if confirm:
                assert r.tokens == a.tokens and r.early_exits == 0
                assert r.draft_layers == pytest.approx(n * k * step_cost, rel=1e-5)
            else:
                assert r.early_exits == n and r.draft_layers == pytest.approx(n * step_cost, rel=1e-5)
    with pytest.raises(ConfigError, match="exit_confirm is for m2r2_exit"):
        api.build_engine("distance_exit", cfg, params, max_new_tokens=MAX_NEW, exit_confirm=True)
