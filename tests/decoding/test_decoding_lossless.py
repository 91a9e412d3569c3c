"""Speculative decoding is lossless: at temperature 0, m2r2_spec, distance_spec and two_model give
exactly the tokens of plain greedy decoding, and leave the KV cache that plain decoding of the same
tokens leaves. Shapes are fixed (batch 4, prompt width 6, 8 new tokens) so every hypothesis
example reuses one compiled program per configuration."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decoding_helpers import BATCH, MAX_NEW, WIDTH, drafter_options, model, reference_cache, run
from m2r2_jax.decoding import api

EOS = 7

DRAFT_VOCAB = tuple(i for i in range(61) if i % 3)  # the tiny models' vocabulary is 61 tokens
CASES = {
    "m2r2_strided_dense": dict(family="llama", method="m2r2_spec", gamma=3),
    "m2r2_consecutive_moe_dynamic": dict(family="mixtral", method="m2r2_spec", gamma=2, draft_length="dynamic"),
    "distance_dense_dynamic": dict(family="llama", method="distance_spec", gamma=2, exit_layer=2,
                                   draft_length="dynamic"),
    "two_model_dense": dict(family="llama", method="two_model", gamma=3),
    # drafts from 40 of the 61 tokens: ar's next token is often outside, so drafts get rejected
    "m2r2_strided_dense_draft_vocab": dict(family="llama", method="m2r2_spec", gamma=3, draft_vocab=DRAFT_VOCAB),
    "distance_moe_draft_vocab_dynamic": dict(family="mixtral", method="distance_spec", gamma=3, exit_layer=2,
                                             draft_length="dynamic", draft_vocab=DRAFT_VOCAB),
}


def engine(case: str, variant: str, temperature: float = 0.0):
    c = dict(CASES[case])
    family, method = c.pop("family"), c.pop("method")
    cfg, params = model(family)
    assert c.get("draft_vocab") is None or max(c["draft_vocab"]) < cfg.vocab_size
    kw = {**drafter_options(method, family, variant), **c}  # a case's own exit layer wins
    return cfg, params, api.build_engine(method, cfg, params, max_new_tokens=MAX_NEW, eos_ids=EOS,
                                         temperature=temperature, **kw)


def ar_engine(family: str, temperature: float = 0.0):
    cfg, params = model(family)
    return api.build_engine("ar", cfg, params, max_new_tokens=MAX_NEW, eos_ids=EOS, temperature=temperature)


def assert_cache_matches_plain_decoding(cfg, params, prompts, results, state, max_new=MAX_NEW):
    ref = reference_cache(cfg, params, prompts, results, max_new)
    for i, (p, r) in enumerate(zip(prompts, results)):
        n = len(p) + len(r.tokens) - 1  # every committed token but the last one is in the cache
        for name in ("k", "v"):
            np.testing.assert_allclose(np.asarray(state.cache[name][:, i, :, :n]), np.asarray(ref[name][:, i, :, :n]),
                                       atol=2e-5, rtol=2e-5, err_msg=f"{name} cache of row {i}")


@st.composite
def prompt_batches(draw, vocab: int):
    n = draw(st.integers(1, BATCH))
    return [draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=WIDTH)) for _ in range(n)]


VARIANTS = {"m2r2_spec": ["fresh", "random"], "two_model": ["exact", "noisy", "far"], "distance_spec": ["-"]}

# Every method x family x draft length x layer loop, enumerated: no cell depends on a seed.
# The self-drafting methods score a reduced draft vocabulary in half of their cells (one family per
# draft length), so each method, layer loop and draft length meets both heads. A few cells decode
# LONG_NEW tokens instead of MAX_NEW, long enough for several rejections and rollbacks per row.
GRID = [(m, f, d, loop) for m in ("m2r2_spec", "distance_spec", "two_model") for f in ("llama", "mixtral")
        for d in ("fixed", "dynamic") for loop in ("scan", "unrolled")]
LONG_NEW = 32
LONG = {("m2r2_spec", "llama", "fixed", "scan"), ("distance_spec", "mixtral", "dynamic", "unrolled"),
        ("two_model", "llama", "dynamic", "scan"), ("m2r2_spec", "mixtral", "dynamic", "unrolled")}


def uses_draft_vocab(method: str, family: str, draft_length: str) -> bool:
    return method != "two_model" and (family == "mixtral") == (draft_length == "fixed")


def grid_engine(method: str, family: str, draft_length: str, layer_loop: str, variant: str):
    cfg, params = model(family)
    kw = dict(max_new_tokens=LONG_NEW if (method, family, draft_length, layer_loop) in LONG else MAX_NEW,
              eos_ids=EOS, gamma=3, draft_length=draft_length, layer_loop=layer_loop)
    if uses_draft_vocab(method, family, draft_length):
        kw["draft_vocab"] = DRAFT_VOCAB
    return cfg, params, api.build_engine(method, cfg, params, **kw, **drafter_options(method, family, variant))


@functools.lru_cache(maxsize=None)
def grid_ar_engine(family: str, max_new: int):
    cfg, params = model(family)
    return api.build_engine("ar", cfg, params, max_new_tokens=max_new, eos_ids=EOS)


@pytest.mark.parametrize("method,family,draft_length,layer_loop", GRID, ids=["-".join(c) for c in GRID])
@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_greedy_speculation_is_identical_to_ar_and_leaves_the_plain_cache(method, family, draft_length,
                                                                           layer_loop, data):
    """Per cell: the drafter's variant (exact / noisy / far draft model, fresh / random adapters),
    the prompts and the router threshold are drawn; tokens equal ar's, every round commits
    between 1 and gamma + 1 tokens, and the KV cache equals plain decoding's."""
    variant = data.draw(st.sampled_from(VARIANTS[method]), label="variant")
    cfg, params, eng = grid_engine(method, family, draft_length, layer_loop, variant)
    prompts = data.draw(prompt_batches(cfg.vocab_size), label="prompts")
    tau = data.draw(st.sampled_from([0.05, 0.5, 0.95]), label="tau")
    spec_res, spec_state = run(eng, prompts, tau=tau)
    ar_res, _ = run(grid_ar_engine(family, eng.spec.max_new), prompts)
    for s, a in zip(spec_res, ar_res):
        assert s.tokens == a.tokens
        assert len(s.accepted) == s.rounds
        assert all(1 <= x <= eng.spec.gamma + 1 for x in s.accepted)
        assert sum(s.accepted) >= len(s.tokens) - 1
    assert_cache_matches_plain_decoding(cfg, params, prompts, spec_res, spec_state, eng.spec.max_new)


PROMPTS = [[1, 2, 3], [4, 5], [9, 10, 11, 12, 13, 14], [6]]


def test_draft_equal_to_target_accepts_every_draft():
    _, _, eng = engine("two_model_dense", "exact")
    res, _ = run(eng, PROMPTS)
    g = eng.spec.gamma
    for r in res:
        assert r.accepted and all(a == g + 1 for a in r.accepted), r.accepted


def test_noisy_draft_exercises_partial_acceptance_and_bonus():
    _, _, eng = engine("two_model_dense", "noisy")
    res, _ = run(eng, PROMPTS)
    acc = [a for r in res for a in r.accepted]
    g = eng.spec.gamma
    assert any(a == g + 1 for a in acc), acc  # bonus token after a fully accepted draft
    assert any(1 < a < g + 1 for a in acc), acc  # rollback after a partial acceptance
    assert 1.0 < np.mean(acc) < g + 1


def test_m2r2_fresh_params_accept_drafts_and_count_costs():
    cfg, _, eng = engine("m2r2_strided_dense", "fresh")
    res, _ = run(eng, PROMPTS)
    assert max(a for r in res for a in r.accepted) > 1
    for r in res:
        g, shared = eng.spec.gamma, eng.spec.drafter.shared_layers
        assert shared == 1  # the branch layer: the verifier starts from the drafts' h_b
        assert r.target_layers == pytest.approx(r.rounds * (cfg.n_layers * (g + 1) - shared * g))
        assert r.draft_layers > 0


def test_dynamic_length_tau_one_proposes_nothing():
    """With tau = 1 the router never vouches for a draft: every round verifies zero drafts and
    commits exactly the target's own token, i.e. the engine degrades to plain decoding."""
    _, _, eng = engine("m2r2_consecutive_moe_dynamic", "random")
    res, _ = run(eng, PROMPTS, tau=1.0)
    ar_res, _ = run(ar_engine("mixtral"), PROMPTS)
    for r, a in zip(res, ar_res):
        assert r.tokens == a.tokens
        assert all(x == 1 for x in r.accepted)


def test_sampled_outputs_depend_only_on_seed_and_line_number():
    _, _, eng = engine("two_model_dense", "noisy", temperature=1.0)
    p = [3, 1, 4]
    alone, _ = run(eng, [p])
    together, _ = run(eng, [p, [2, 7, 1, 8], p, [5]])
    assert together[0].tokens == alone[0].tokens
    # the same prompt on another line gets its own random stream
    assert together[2].tokens != together[0].tokens
    again, _ = run(eng, [p], seed=1)
    assert again[0].tokens != alone[0].tokens


def test_lossless_through_the_few_rows_head(few_rows_head_everywhere):
    # The tied head's few-rows CPU form on the tiny table too: batch 1 and gamma 3, so the
    # verification scores 4 positions through it while ar's steps take the dot.
    traced = few_rows_head_everywhere
    cfg, params = model("llama", tie_embeddings=True)
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(1, cfg.vocab_size, size=n)) for n in (2, 5, 6, 3)]
    outs = {}
    for method, kw in (("ar", {}), ("distance_spec", dict(exit_layer=2, gamma=3))):
        eng = api.build_engine(method, cfg, params, max_new_tokens=12, eos_ids=EOS, temperature=0.0, **kw)
        outs[method] = [r.tokens for r in api.run_engine(eng, prompts, batch_size=1, width=WIDTH, fixed_batch=True)]
    assert any(int(np.prod(s[:-1])) == 4 for s in traced), traced  # the verification's 4 positions
    assert outs["distance_spec"] == outs["ar"]
    assert sum(len(t) for t in outs["ar"]) >= 4 * 6
