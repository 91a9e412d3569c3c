"""The verification pass reuses a self-drafter's exact output of the base layers it shares (M2R2's b
branch layers, distance_spec's E): the same logits and cache as a verification from the embeddings,
with the shared layers run for the last draft only."""

from __future__ import annotations

import numpy as np
import pytest

from decoding_helpers import BATCH, MAX_NEW, WIDTH, model, random_m2r2, run
from m2r2_jax.decoding import api, speculative
from m2r2_jax.m2r2.config import M2R2Config

PROMPTS = [[1, 2, 3], [4, 5], [9, 10, 11, 12, 13, 14], [6]]
MCFG = M2R2Config(branch_layer=2, rate=1, schedule="consecutive", lora_rank=4, router_dim=8, router_hidden=8)


def engines(method: str, family: str = "llama", gamma: int = 3):
    cfg, params = model(family)
    kw = dict(max_new_tokens=MAX_NEW, gamma=gamma)
    if method == "m2r2_spec":
        kw["m2r2"] = (MCFG, random_m2r2(cfg, MCFG, 3, adapter_scale=0.05))
    else:
        kw["exit_layer"] = 2
    on = api.build_engine(method, cfg, params, **kw)
    off = api.build_engine(method, cfg, params, reuse_shared_layers=False, **kw)
    return cfg, on, off


def drafted_state(engine):
    toks, lengths, valid = api.pad_batch(PROMPTS, BATCH, WIDTH)
    st = api.prefill_batch(engine.spec, engine.params, toks, lengths, api.sequence_keys(0, range(BATCH)), valid)
    return st, api.draft_round(engine.spec, engine.params, st, np.float32(0.5))


@pytest.mark.parametrize("method,family", [("m2r2_spec", "llama"), ("distance_spec", "llama"),
                                           ("m2r2_spec", "mixtral")])
def test_verification_from_the_shared_layers_equals_a_full_one(method, family):
    cfg, on, off = engines(method, family)
    assert on.spec.drafter.shared_layers == 2 and off.spec.drafter.shared_layers == 0
    st, d = drafted_state(on)
    assert d.hidden.shape == (BATCH, on.spec.gamma, cfg.d_model)
    logits_on, cache_on = api.verify_pass(on.spec, on.params, st, d.cache, d.drafts, d.hidden)
    logits_off, cache_off = api.verify_pass(off.spec, off.params, st, d.cache, d.drafts)
    np.testing.assert_allclose(np.asarray(logits_on), np.asarray(logits_off), atol=2e-5, rtol=2e-5)
    for name in ("k", "v"):
        np.testing.assert_allclose(np.asarray(cache_on[name]), np.asarray(cache_off[name]), atol=2e-5, rtol=2e-5)


def test_the_verifier_reads_the_handed_over_states():
    """Change the shared-layer output of one fed token: the logits from that position on change,
    the earlier ones (causal) do not. So the reuse path really starts from the drafter's states."""
    _, on, _ = engines("m2r2_spec")
    st, d = drafted_state(on)
    ref, _ = api.verify_pass(on.spec, on.params, st, d.cache, d.drafts, d.hidden)
    hidden = d.hidden.at[:, 1].multiply(-3.0)
    got, _ = api.verify_pass(on.spec, on.params, st, d.cache, d.drafts, hidden)
    ref, got = np.asarray(ref), np.asarray(got)
    np.testing.assert_allclose(got[:, :1], ref[:, :1], atol=1e-6)
    assert np.all(np.abs(got[:, 1:] - ref[:, 1:]).max(axis=-1) > 1e-3)


@pytest.mark.parametrize("method", ["m2r2_spec", "distance_spec"])
def test_reuse_on_and_off_decode_the_same_tokens_as_ar_and_count_their_layers(method):
    cfg, on, off = engines(method)
    ar = api.build_engine("ar", cfg, on.params["base"], max_new_tokens=MAX_NEW)
    ar_res, _ = run(ar, PROMPTS)
    g = on.spec.gamma
    for eng, shared in ((on, 2), (off, 0)):
        res, _ = run(eng, PROMPTS)
        assert [r.tokens for r in res] == [r.tokens for r in ar_res]
        for r in res:
            assert r.target_layers == pytest.approx(r.rounds * speculative.verify_layers(cfg, g, shared))
    assert speculative.verify_layers(cfg, g, 2) == cfg.n_layers * (g + 1) - 2 * g


def test_two_model_shares_nothing():
    assert speculative.TwoModelDrafter(model("llama")[0]).shared_layers == 0
