"""The unrolled layer loop (`build_engine(..., layer_loop="unrolled")`, `transformer.unstack_layers`)
computes what the scan over the stacked layers computes: the same logits, caches, hidden states,
fast-stream states and, end to end, the same greedy tokens as plain decoding (the speculative
methods' unrolled engines: the lossless grid in test_decoding_lossless.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decoding_helpers import MAX_NEW, WIDTH, model, random_m2r2, run
from m2r2_jax.decoding import api
from m2r2_jax.errors import ConfigError
from m2r2_jax.m2r2.config import M2R2Config
from m2r2_jax.m2r2.fast_stream import fast_forward
from m2r2_jax.models import transformer as T

EOS = 7
MCFG = {"llama": M2R2Config(branch_layer=1, rate=2, lora_rank=4, router_dim=8, router_hidden=8),
        "mixtral": M2R2Config(branch_layer=1, rate=1, schedule="consecutive", lora_rank=4, router_dim=8,
                              router_hidden=8)}


def _tokens(cfg, seed, shape):
    return jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, size=shape), jnp.int32)


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_forward_and_fast_pass_match_the_scan(family):
    cfg, params = model(family)
    flat = T.unstack_layers(params)
    assert T.is_unstacked(flat) and not T.is_unstacked(params) and len(flat["layers"]) == cfg.n_layers
    assert T.unstack_layers(flat) is flat
    toks = _tokens(cfg, 0, (2, 5))
    # prefill, then a 3-token pass at later positions against the filled cache (a verification)
    out = {}
    for name, p in (("scan", params), ("unrolled", flat)):
        logits, cache, aux = T.forward(cfg, p, toks, None, T.init_cache(cfg, 2, 16), return_aux=True)
        pos = jnp.broadcast_to(jnp.arange(5, 8)[None], (2, 3))
        logits2, cache2 = T.forward(cfg, p, toks[:, :3], pos, cache)
        x, _, hidden, _ = T.run_layers(cfg, p, T.embed(cfg, p, toks[:, :2]), pos[:, :2], cache2, 1, 3, collect=True)
        mcfg = MCFG[family]
        m2 = random_m2r2(cfg, mcfg, 3, adapter_scale=0.05)
        fo = fast_forward(cfg, mcfg, p, m2, toks[:, 3:4], pos[:, :1] + 3, cache2, collect=True)
        out[name] = (logits, cache, aux.hidden, aux.router_logits, logits2, cache2, x, hidden,
                     fo.logits, fo.cache, fo.exit_logits, fo.states, fo.moe_router_logits)
    for a, b in zip(jax.tree.leaves(out["scan"]), jax.tree.leaves(out["unrolled"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5)
    assert (out["scan"][3] is None) == (family == "llama")  # router logits only for the MoE base


def test_unstacked_layers_refuse_a_traced_index():
    cfg, params = model("llama")
    flat = T.unstack_layers(params)
    assert T.layer_params(flat, 2) is flat["layers"][2]
    with pytest.raises(TypeError, match="Python ints"):
        jax.jit(lambda i: T.layer_params(flat, i)["attn_norm"]["scale"])(1)


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_unrolled_ar_decodes_the_scan_ar_tokens(family):
    """Plain decoding both ways; every speculative method's unrolled engine is checked against the
    scan's ar in the lossless grid (test_decoding_lossless.py)."""
    cfg, params = model(family)
    kw = dict(max_new_tokens=MAX_NEW, eos_ids=EOS)
    rng = np.random.default_rng(5)
    prompts = [list(rng.integers(0, cfg.vocab_size, size=n)) for n in (1, 3, WIDTH, 2)]
    got, _ = run(api.build_engine("ar", cfg, params, layer_loop="unrolled", **kw), prompts)
    want, _ = run(api.build_engine("ar", cfg, params, **kw), prompts)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert sum(len(r.tokens) for r in want) > len(prompts)  # decoded past the first token


def test_layer_loop_is_validated():
    cfg, params = model("llama")
    with pytest.raises(ConfigError, match="layer_loop='unrolled_twice' is invalid"):
        api.build_engine("ar", cfg, params, max_new_tokens=4, layer_loop="unrolled_twice")
    with pytest.raises(ConfigError, match="not ar with a plan"):
        api.resolve_layer_loop("unrolled", "ar", plan=object())


def test_auto_layer_loop_picks_unrolled_where_it_serves_on_cpu():
    for m in api.METHODS:
        assert api.resolve_layer_loop("auto", m) == "unrolled" == api.resolve_layer_loop("auto", m, backend="cpu")
        assert api.resolve_layer_loop("auto", m, plan=object()) == "scan"  # sharded: the scan
        for backend in ("gpu", "tpu"):
            assert api.resolve_layer_loop("auto", m, backend=backend) == "scan"
        assert api.resolve_layer_loop("scan", m) == "scan"
    cfg, params = model("llama")
    assert T.is_unstacked(api.build_engine("ar", cfg, params, max_new_tokens=4, layer_loop="auto").params["base"])
    assert T.is_unstacked(api.build_engine("m2r2_exit", cfg, params, max_new_tokens=4,
                                           layer_loop="auto").params["base"])
