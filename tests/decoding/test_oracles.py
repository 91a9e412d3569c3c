"""Independent answers the engines must reproduce, computed without the decoding machinery:

- ar's greedy tokens equal argmax decoding by full, cache-free forward passes over the growing
  sequence, for every family, and past the window of a sliding-window model;
- the fast stream with the consecutive schedule, rate 1 and fresh parameters (zero adapters, unit
  rates and exit norm) is the base model itself: its logits equal the base's for every family;
- every verb's fresh M2R2 default is one and the same config."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config

from m2r2_jax.decoding import api
from m2r2_jax.m2r2 import fast_stream as F
from m2r2_jax.m2r2 import loading
from m2r2_jax.m2r2.config import M2R2Config, default_m2r2_config
from m2r2_jax.models import transformer as T
from m2r2_jax.models.config import FAMILIES


def _sharp(cfg, seed=0):
    """Random weights with the LM head scaled up, so float noise between two correct evaluation
    orders cannot flip an argmax (the oracle and the engine sum in different orders)."""
    params = T.init_params(cfg, jax.random.key(seed))
    key = "lm_head" if "lm_head" in params else "embed"
    leaf = "kernel" if key == "lm_head" else "embedding"
    params[key][leaf] = params[key][leaf] * 8.0
    return params


def argmax_oracle(cfg, params, prompt, n_new):
    """Greedy decoding by one full forward pass per token, no KV cache."""
    seq = list(prompt)
    for _ in range(n_new):
        logits, _ = T.forward(cfg, params, jnp.asarray([seq]))
        seq.append(int(jnp.argmax(logits[0, -1])))
    return seq[len(prompt):]


@pytest.mark.parametrize("family", FAMILIES)
def test_ar_equals_cache_free_argmax(family):
    cfg = tiny_config(family)
    params = _sharp(cfg)
    prompts = [[3, 17, 5, 29, 8], [40, 2]]
    got = api.generate("ar", cfg, params, prompts, max_new_tokens=12)
    for p, r in zip(prompts, got):
        assert r.tokens == argmax_oracle(cfg, params, p, 12), family


def test_ar_equals_cache_free_argmax_past_a_sliding_window():
    cfg = tiny_config("mistral", sliding_window=6)
    params = _sharp(cfg, seed=3)
    prompt = [5, 9, 14, 2, 33, 21, 7, 11]  # already longer than the window
    [r] = api.generate("ar", cfg, params, [prompt], max_new_tokens=16)
    assert r.tokens == argmax_oracle(cfg, params, prompt, 16)
    # the window is real: without it the model decodes differently on this prompt
    wide = dataclasses.replace(cfg, sliding_window=0)
    assert argmax_oracle(wide, params, prompt, 16) != r.tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_fresh_consecutive_rate_one_fast_stream_is_the_base(family):
    cfg = tiny_config(family, n_layers=5)
    params = T.init_params(cfg, jax.random.key(0))
    mcfg = M2R2Config(branch_layer=1, rate=1, schedule="consecutive", lora_rank=4).validate(cfg)
    mp = F.init_m2r2_params(cfg, mcfg, jax.random.key(1))
    toks = jax.random.randint(jax.random.key(2), (2, 9), 0, cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
    want, _ = T.forward(cfg, params, toks)
    out = F.fast_forward(cfg, mcfg, params, mp, toks, pos, T.init_cache(cfg, 2, 16), collect=True)
    np.testing.assert_allclose(out.logits, want, atol=2e-5, rtol=1e-5)
    # in train mode too (context from the slow pass)
    tf = F.train_forward(cfg, mcfg, params, mp, toks)
    np.testing.assert_allclose(tf.states[-1], tf.slow_hidden[-1], atol=2e-5, rtol=1e-5)
    # and trained-looking adapters do change it (the comparison can fail)
    mp["adapters"] = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(jax.random.key(3), a.shape), mp["adapters"])
    moved = F.fast_forward(cfg, mcfg, params, mp, toks, pos, T.init_cache(cfg, 2, 16)).logits
    assert float(jnp.max(jnp.abs(moved - want))) > 1e-3


def test_one_fresh_m2r2_default_for_every_verb():
    assert api.default_m2r2_config is default_m2r2_config is loading.default_m2r2_config
    assert [default_m2r2_config(tiny_config(n_layers=n)).branch_layer for n in (2, 4, 16, 30)] == [1, 1, 2, 3]
    cfg = tiny_config(n_layers=16)
    params = T.init_params(cfg, jax.random.key(0))
    spec = api.build_engine("m2r2_spec", cfg, params, max_new_tokens=4).spec
    assert spec.drafter.mcfg == default_m2r2_config(cfg)
