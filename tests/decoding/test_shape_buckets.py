"""Bounded compiling: prompt widths and batch sizes are drawn from a ladder of sizes, so calls with
prompts of nearby lengths share one compiled program, and the padding changes no token."""

import pytest

from decoding_helpers import drafter_options, model

from m2r2_jax.decoding import api


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
def test_prompts_of_nearby_lengths_share_a_program_and_padding_changes_no_token(method):
    cfg, params = model("llama")
    prompts = [[(3 * i + 7 * k) % cfg.vocab_size for k in range(n)] for i, n in enumerate((17, 19, 24))]
    opts = dict(drafter_options(method, "llama", "random"), gamma=3) if method != "ar" else {}
    before = api.run_batch._cache_size()
    bucketed = _calls(cfg, params, method, prompts, **opts)
    assert api.run_batch._cache_size() - before == 1  # widths 17, 19 and 24 all run at 24
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
