"""`transformer.layer_router_logits`: a MoE layer's router on any state, as the layer computes it."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import tiny_config

from m2r2_jax.models import transformer as T
from m2r2_jax.models.layers import DecoderLayer


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_layer_router_logits_match_the_layer(family):
    cfg = tiny_config(family)
    params = T.init_params(cfg, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 3, cfg.d_model)) * 3.0
    for layer in range(cfg.n_layers):
        lp = T.layer_params(params, layer)
        mod, v = DecoderLayer(cfg), {"params": lp}
        _, _, want = mod.apply(v, mod.apply(v, x, method="norm_mlp"), method="mlp_block")
        got = T.layer_router_logits(cfg, params, layer, x)
        assert got.shape == (2, 3, cfg.n_experts) and got.dtype == np.float32
        np.testing.assert_allclose(np.asarray(got), np.asarray(want).reshape(got.shape), rtol=1e-5, atol=1e-6)
        unstacked = T.layer_router_logits(cfg, T.unstack_layers(params), layer, x)
        np.testing.assert_array_equal(np.asarray(unstacked), np.asarray(got))


def test_layer_router_logits_needs_a_moe_model():
    cfg = tiny_config("llama")
    params = T.init_params(cfg, jax.random.key(0))
    with pytest.raises(ValueError, match="no MoE router"):
        T.layer_router_logits(cfg, params, 0, np.zeros((1, cfg.d_model), np.float32))
