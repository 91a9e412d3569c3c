"""Reduced draft vocabulary: the subset head, the drafts it allows, the file, the cost accounting.
Lossless decoding with it is pinned by the hypothesis cases of test_decoding_lossless.py and the
chi-square case of test_decoding_distribution.py."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decoding_helpers import model, random_m2r2, run
from m2r2_jax.decoding import api
from m2r2_jax.decoding import draft_vocab as DV
from m2r2_jax.decoding.api import default_m2r2_config
from m2r2_jax.errors import ConfigError
from m2r2_jax.m2r2.fast_stream import head_cost_layers
from m2r2_jax.models.transformer import MASKED_LOGIT, head, head_kernel_columns

IDS = np.array([i for i in range(61) if i % 3], np.int32)  # 40 of the tiny models' 61 tokens
PROMPTS = [[1, 2, 3], [4, 5], [9, 10, 11, 12, 13, 14], [6]]


@pytest.mark.parametrize("tied", [False, True])
def test_subset_head_equals_the_full_head_on_its_ids_and_masks_the_rest(tied):
    cfg, params = model("llama", tie_embeddings=tied)
    h = jax.random.normal(jax.random.key(1), (2, 3, cfg.d_model))
    full = head(cfg, params, h)
    vocab = {"ids": jnp.asarray(IDS), "kernel": head_kernel_columns(cfg, params, IDS)}
    sub = head(cfg, params, h, vocab=vocab)
    assert sub.shape == full.shape
    np.testing.assert_allclose(np.asarray(sub[..., IDS]), np.asarray(full[..., IDS]), rtol=1e-5, atol=1e-5)
    rest = np.setdiff1d(np.arange(cfg.vocab_size), IDS)
    assert (np.asarray(sub[..., rest]) == MASKED_LOGIT).all()
    p = jax.nn.softmax(sub, axis=-1)
    assert np.isfinite(np.asarray(jnp.sum(p * jax.nn.log_softmax(sub, axis=-1)))).all()  # entropy stays finite
    assert float(p[..., rest].max()) == 0.0


def _draft(method, temperature):
    cfg, params = model("llama")
    mcfg = default_m2r2_config(cfg)
    m2r2 = (mcfg, random_m2r2(cfg, mcfg, 3, adapter_scale=0.05))
    eng = api.build_engine(method, cfg, params, max_new_tokens=8, gamma=4, m2r2=m2r2, temperature=temperature,
                           draft_vocab=IDS)
    toks, lengths, valid = api.pad_batch(PROMPTS, 4, 6)
    st = api.prefill_batch(eng.spec, eng.params, toks, lengths, api.sequence_keys(0, range(4)), valid)
    return api.draft_round(eng.spec, eng.params, st, jnp.float32(0.5))


@pytest.mark.parametrize("method", ["m2r2_spec", "distance_spec"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafts_come_from_the_subset_and_q_lives_on_it(method, temperature):
    d = _draft(method, temperature)
    assert np.isin(np.asarray(d.drafts), IDS).all()
    if temperature:
        q = np.asarray(d.q)
        rest = np.setdiff1d(np.arange(q.shape[-1]), IDS)
        assert (q[..., rest] == 0).all()
        np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-5)


def _accepted_drafts(result) -> list:
    """The drafted tokens a result's rounds accepted: each round yields its accepted drafts then the
    target's token (the last round's count is taken before the length cut)."""
    assert sum(result.accepted) - result.accepted[-1] < len(result.tokens) - 1 <= sum(result.accepted)
    drafts, at = [], 1
    for a in result.accepted:
        chunk = result.tokens[at:at + a]
        drafts += chunk if len(chunk) < a else chunk[:-1]
        at += a
    return drafts


def test_greedy_with_a_draft_vocabulary_rejects_drafts_and_stays_identical():
    """Tokens outside the subset can only come from the target's correction: greedy output equals
    ar's, and a token the full-vocabulary drafter had accepted is never accepted as a draft once
    the subset leaves it out."""
    cfg, params = model("llama")
    mcfg = default_m2r2_config(cfg)
    m2r2 = (mcfg, random_m2r2(cfg, mcfg, 0, adapter_scale=0.05))
    ar = api.build_engine("ar", cfg, params, max_new_tokens=8)
    full = api.build_engine("m2r2_spec", cfg, params, max_new_tokens=8, gamma=3, m2r2=m2r2)
    ref = [r.tokens for r in run(ar, PROMPTS)[0]]
    res_full = run(full, PROMPTS)[0]
    assert [r.tokens for r in res_full] == ref
    drafted = [t for r in res_full for t in _accepted_drafts(r)]
    assert drafted, "the full drafter should get some drafts accepted"
    left_out = max(set(drafted), key=drafted.count)
    ids = np.array([i for i in range(cfg.vocab_size) if i != left_out], np.int32)
    sub = api.build_engine("m2r2_spec", cfg, params, max_new_tokens=8, gamma=3, m2r2=m2r2, draft_vocab=ids)
    res_sub = run(sub, PROMPTS)[0]
    assert [r.tokens for r in res_sub] == ref
    assert left_out in {t for r in ref for t in r[1:]}  # the target still writes it
    assert all(left_out not in _accepted_drafts(r) for r in res_sub)


def test_vocabulary_from_counts_file_round_trip_and_errors(tmp_path):
    counts = DV.count_tokens([[1, 1, 2, 5], [5, 5, 0]], 8)
    assert counts.tolist() == [1, 2, 1, 0, 0, 3, 0, 0]
    ids = DV.most_frequent(counts, 3)
    assert ids.tolist() == [0, 1, 5]  # 5 (3x), 1 (2x), then the tie 0/2 goes to the lower id
    assert DV.coverage(counts, ids) == pytest.approx(6 / 7)
    rec = DV.save(tmp_path / "v" / "vocab.json", ids, 8, "test", counts)
    assert rec["coverage"] == pytest.approx(6 / 7) and rec["size"] == 3
    assert DV.load(tmp_path / "v" / "vocab.json", 8).tolist() == [0, 1, 5]
    with pytest.raises(ConfigError, match="for a vocabulary of 8 tokens, the model has 16"):
        DV.load(tmp_path / "v" / "vocab.json", 16)
    with pytest.raises(ConfigError, match="does not exist"):
        DV.load(tmp_path / "missing.json", 8)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not readable JSON"):
        DV.load(tmp_path / "bad.json", 8)
    (tmp_path / "noids.json").write_text(json.dumps({"size": 3}))
    with pytest.raises(ConfigError, match='no "ids" list'):
        DV.load(tmp_path / "noids.json", 8)
    with pytest.raises(ConfigError, match="token id 9 is outside"):
        DV.check_ids([1, 9], 8)
    with pytest.raises(ConfigError, match="twice"):
        DV.check_ids([1, 1], 8)
    with pytest.raises(ConfigError, match="non-empty list of integer"):
        DV.check_ids([], 8)
    with pytest.raises(ConfigError, match="size=9 is invalid"):
        DV.most_frequent(counts, 9)
    with pytest.raises(ConfigError, match="token id 8 is outside"):
        DV.count_tokens([[8]], 8)


def test_engine_options_and_cost_accounting():
    cfg, params = model("llama")
    with pytest.raises(ConfigError, match="not two_model"):
        api.build_engine("two_model", cfg, params, max_new_tokens=4, draft=(cfg, params), draft_vocab=IDS)
    with pytest.raises(ConfigError, match="not ar"):
        api.build_engine("ar", cfg, params, max_new_tokens=4, draft_vocab=IDS)
    full = api.build_engine("distance_spec", cfg, params, max_new_tokens=4, exit_layer=2)
    sub = api.build_engine("distance_spec", cfg, params, max_new_tokens=4, exit_layer=2, draft_vocab=IDS)
    # layers 61 x 32 head weights against one layer's: (2 + head(40)) / (4 + head(61))
    layer = 32 * (4 + 2 * 2) * 8 + 4 * 8 * 32 + 3 * 32 * 48
    assert head_cost_layers(cfg) == pytest.approx(32 * 61 / layer)
    assert api.draft_cost_ratio(full.spec) == pytest.approx((2 + 32 * 61 / layer) / (4 + 32 * 61 / layer))
    assert api.draft_cost_ratio(sub.spec) == pytest.approx((2 + 32 * 40 / layer) / (4 + 32 * 61 / layer))
