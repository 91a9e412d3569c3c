"""Bounded compiling: cache lengths and batch sizes are drawn from a ladder of sizes and the prefill
runs in chunks, so calls with prompts of any length up to a cache bucket share one compiled program,
and neither the padding nor the chunking changes a token."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decoding_helpers import drafter_options, model

from m2r2_jax.decoding import api
from m2r2_jax.decoding.loop import chunked_prefill
from m2r2_jax.models.transformer import forward, head, init_cache


def test_bucket_ladder():
    ladder = [api.bucket(n) for n in range(1, 50)]
    assert sorted(set(ladder)) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    for n, size in zip(range(1, 50), ladder):
        assert n <= size <= max(n, 1.5 * n)  # never more than 1.5x padding
    assert [api.bucket(n, 16) for n in (1, 16, 17, 100, 1000)] == [16, 16, 24, 128, 1024]
    assert api.bucket(100, 16, limit=110) == 110 and api.bucket(100, 16, limit=90) == 100  # never below n


def _calls(cfg, params, method, prompts, **kw):
    return [api.generate(method, cfg, params, [p], max_new_tokens=6, **kw)[0] for p in prompts]


@pytest.mark.parametrize("method", ["ar", "m2r2_spec"])
def test_prompts_of_any_length_share_a_program_and_padding_changes_no_token(method):
    cfg, params = model("llama")
    prompts = [[(3 * i + 7 * k) % cfg.vocab_size for k in range(n)] for i, n in enumerate((3, 19, 45))]
    opts = dict(drafter_options(method, "llama", "random"), gamma=3) if method != "ar" else {}
    before = api.run_batch._cache_size()
    bucketed = _calls(cfg, params, method, prompts, **opts)
    # one cache bucket (the tiny model's whole context) for all three: prompts of 3, 19 and 45
    # tokens run 1, 1 and 2 prefill chunks of the same program
    assert api.run_batch._cache_size() - before == 1
    engine = api.build_engine(method, cfg, params, max_new_tokens=6, **opts)
    for p, got in zip(prompts, bucketed):
        [exact] = api.run_engine(engine, [p], batch_size=1, width=len(p))
        assert got.tokens == exact.tokens and got.accepted == exact.accepted


def test_sampled_tokens_do_not_depend_on_the_padding():
    cfg, params = model("llama")
    prompts = [[5, 9, 2, 11, 4], [8, 1, 3]]
    engine = api.build_engine("ar", cfg, params, max_new_tokens=8, temperature=1.0)
    padded = api.run_engine(engine, prompts, seed=3, batch_size=4, fixed_batch=True)
    for i, p in enumerate(prompts):
        [exact] = api.run_engine(engine, [p], seed=3, batch_size=1, width=len(p), line_numbers=[i])
        assert padded[i].tokens == exact.tokens


def test_batches_round_up_to_the_ladder():
    cfg, params = model("llama")
    engine = api.build_engine("ar", cfg, params, max_new_tokens=4)
    _, states = api.run_engine(engine, [[1, 2]] * 5, batch_size=8, return_states=True)
    assert states[0].lengths.shape == (6,)  # 5 prompts run as a batch of 6, not 5 or 8


def test_prompt_width_fills_a_cache_bucket():
    cfg, params = model("llama")  # context 64
    spec = api.build_engine("m2r2_spec", cfg, params, max_new_tokens=6, gamma=3).spec
    assert api.prompt_width(spec, 3) == api.prompt_width(spec, 50) == 64 + 4 - 6 - 4  # capped at the context
    big = dataclasses.replace(spec, cfg=dataclasses.replace(cfg, max_seq_len=4096))
    assert api.prompt_width(big, 3) == api.prompt_width(big, 240) == api.MIN_CACHE_LEN - 10
    assert api.prompt_width(big, 300) == 384 - 10  # the next bucket: 1.5x at most


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3: sliding-window layers (window 4)
def test_chunked_prefill_equals_one_forward_over_the_prompt(family):
    cfg, params = model(family)
    lengths = np.array([13, 5, 1, 9], np.int32)
    width, cache_len = 13, 24
    toks = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (4, width)), jnp.int32)
    pos = np.arange(width)[None]
    positions = jnp.asarray(np.where(pos < lengths[:, None], pos, cache_len), jnp.int32)
    logits, ref = forward(cfg, params, toks, positions, init_cache(cfg, 4, cache_len))
    ref_last = np.asarray(logits)[np.arange(4), lengths - 1]
    run = jax.jit(chunked_prefill, static_argnums=(0, 5))
    for chunk in (1, 4, 13, 32):
        cache, h_last = run(cfg, params, toks, jnp.asarray(lengths), init_cache(cfg, 4, cache_len), chunk)
        for name in ("k", "v"):
            np.testing.assert_allclose(np.asarray(cache[name]), np.asarray(ref[name]), atol=2e-5, rtol=1e-5)
        got_last = np.asarray(head(cfg, params, h_last[:, None])[:, 0])
        np.testing.assert_allclose(got_last, ref_last, atol=1e-4 * np.abs(ref_last).max(), rtol=0)
