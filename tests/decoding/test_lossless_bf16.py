"""Lossless greedy decoding in bfloat16, the dtype real models run in on accelerators.

The model's compute dtype (activations and KV cache) is bfloat16 for the target and for the
drafter alike; every speculative method must then give exactly the tokens of bfloat16 plain
decoding. That holds because a verification pass computes each of its positions with the same
operations, in the same dtype, as a one-token step. What it does not rule out: XLA may block a
matmul over gamma + 1 rows differently from one over a single row, so a next-token argmax tied
within bfloat16 rounding could come out differently. The test models' heads are sharpened
(decoding_helpers.sharpen) so their argmaxes are not near ties; a tie on a real model would show as
a divergence here only if it happened on these prompts."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decoding_helpers import BATCH, WIDTH, drafter_options, model, run
from m2r2_jax.decoding import api

MAX_NEW = 16


def bf16(cfg):
    return dataclasses.replace(cfg, dtype="bfloat16")


@functools.lru_cache(maxsize=None)
def engines(method: str, family: str):
    cfg, params = model(family)
    kw = drafter_options(method, family, "random" if method == "m2r2_spec" else "noisy")
    if method == "two_model":  # the draft model computes in bfloat16 too
        dcfg, dparams = kw["draft"]
        kw["draft"] = (bf16(dcfg), dparams)
    return (api.build_engine(method, bf16(cfg), params, max_new_tokens=MAX_NEW, gamma=3, **kw),
            api.build_engine("ar", bf16(cfg), params, max_new_tokens=MAX_NEW))


@pytest.mark.parametrize("method", ["m2r2_spec", "distance_spec", "two_model"])
@pytest.mark.parametrize("family", ["llama", "mixtral"])
@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_bf16_speculation_is_identical_to_bf16_ar(method, family, data):
    eng, ar = engines(method, family)
    vocab = eng.spec.cfg.vocab_size
    n = data.draw(st.integers(1, BATCH), label="rows")
    prompts = [data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=WIDTH)) for _ in range(n)]
    got, state = run(eng, prompts)
    want, _ = run(ar, prompts)
    assert state.cache["k"].dtype == jnp.bfloat16  # the engine really decodes in bfloat16
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert all(1 <= a <= eng.spec.gamma + 1 for r in got for a in r.accepted)


def test_bf16_decoding_differs_from_float32_somewhere():
    """The bfloat16 runs above are not float32 runs in disguise: on the same prompts plain decoding
    in the two dtypes parts ways (on these prompts and models it does, in both families)."""
    rng = np.random.default_rng(0)
    for family in ("llama", "mixtral"):
        cfg, params = model(family)
        prompts = [list(rng.integers(0, cfg.vocab_size, size=k)) for k in (3, 1, 6, 4)]
        _, ar16 = engines("distance_spec", family)
        ar32 = api.build_engine("ar", cfg, params, max_new_tokens=MAX_NEW)
        assert [r.tokens for r in run(ar16, prompts)[0]] != [r.tokens for r in run(ar32, prompts)[0]], family
