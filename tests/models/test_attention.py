"""Grouped-query attention over the [layers, batch, kv heads, length, head_dim] KV cache, pinned
against a plain numpy reference."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m2r2_jax.models import transformer as T
from m2r2_jax.models.config import ModelConfig
from m2r2_jax.models.layers import attend, heads_major


def reference_attention(q, k, v, mask, k_self=None, v_self=None):
    """q [B, T, H, hd]; k, v [B, S, KV, hd] (positions first); mask [B, T, S]. Head h reads kv head
    h // (H / KV); with k_self/v_self [B, T, KV, hd] each query also sees its own key/value."""
    b, t, h, hd = q.shape
    kv = k.shape[2]
    out = np.zeros(q.shape, np.float64)
    for bi in range(b):
        for ti in range(t):
            for hi in range(h):
                j = hi // (h // kv)
                keys, vals = k[bi, :, j], v[bi, :, j]
                scores = np.where(mask[bi, ti], keys @ q[bi, ti, hi] / math.sqrt(hd), -np.inf)
                if k_self is not None:
                    keys = np.concatenate([keys, k_self[bi, ti, j][None]])
                    vals = np.concatenate([vals, v_self[bi, ti, j][None]])
                    scores = np.append(scores, k_self[bi, ti, j] @ q[bi, ti, hi] / math.sqrt(hd))
                p = np.exp(scores - scores.max())
                out[bi, ti, hi] = (p / p.sum()) @ vals
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("with_self", [False, True])
def test_attend_matches_reference(seed, with_self):
    rng = np.random.default_rng(seed)
    b, t, s, hd = int(rng.integers(1, 3)), int(rng.integers(1, 5)), int(rng.integers(3, 9)), 4
    kv = int(rng.choice([1, 2]))
    h = kv * int(rng.choice([1, 2, 3]))
    q = rng.normal(size=(b, t, h, hd)).astype(np.float32)
    k, v = (rng.normal(size=(b, s, kv, hd)).astype(np.float32) for _ in range(2))
    mask = rng.random((b, t, s)) < 0.6
    mask[..., 0] = True  # every query sees at least one key
    extra = [rng.normal(size=(b, t, kv, hd)).astype(np.float32) for _ in range(2)] if with_self else [None, None]
    got = attend(jnp.asarray(q), heads_major(jnp.asarray(k)), heads_major(jnp.asarray(v)), jnp.asarray(mask),
                 *(None if e is None else jnp.asarray(e) for e in extra))
    np.testing.assert_allclose(np.asarray(got), reference_attention(q, k, v, mask, *extra), atol=1e-5, rtol=1e-5)


def test_cache_write_places_keys_by_layer_head_and_position():
    cfg = ModelConfig(vocab_size=16, d_model=8, n_layers=3, n_heads=2, n_kv_heads=2, head_dim=4, d_ff=8)
    cache = T.init_cache(cfg, batch=2, max_len=5)
    assert cache["k"].shape == (3, 2, 2, 5, 4) and T.cache_length(cache) == 5
    k = jnp.arange(2 * 2 * 2 * 4, dtype=jnp.float32).reshape(2, 2, 2, 4) + 1  # [B, T, KV, hd]
    pos = jnp.asarray([[1, 3], [4, 5]])  # row 1's second token is past the end: dropped
    out = T.cache_write(cache, 1, pos, k, -k)
    got_k, got_v = (np.asarray(a) for a in T.layer_kv(out, 1))
    for bi, ti in [(0, 0), (0, 1), (1, 0)]:
        np.testing.assert_array_equal(got_k[bi, :, int(pos[bi, ti])], np.asarray(k[bi, ti]))
        np.testing.assert_array_equal(got_v[bi, :, int(pos[bi, ti])], -np.asarray(k[bi, ti]))
    written = np.abs(np.asarray(out["k"])).sum(axis=(2, 4)) > 0  # [L, B, S]
    expected = np.zeros((3, 2, 5), bool)
    expected[1, 0, [1, 3]] = True
    expected[1, 1, 4] = True
    np.testing.assert_array_equal(written, expected)


def test_cached_decoding_equals_one_pass():
    """Token-by-token decoding through the cache gives the logits of one pass over the sequence."""
    cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=24,
                      max_seq_len=16)
    params = T.init_params(cfg, jax.random.key(0))
    forward = jax.jit(T.forward, static_argnums=0)
    toks = jax.random.randint(jax.random.key(1), (2, 6), 0, cfg.vocab_size)
    full, _ = forward(cfg, params, toks)
    cache = T.init_cache(cfg, 2, 8)
    _, cache = forward(cfg, params, toks[:, :3], jnp.broadcast_to(jnp.arange(3), (2, 3)), cache)
    for i in range(3, 6):
        logits, cache = forward(cfg, params, toks[:, i:i + 1], jnp.full((2, 1), i), cache)
        np.testing.assert_allclose(np.asarray(logits[:, 0]), np.asarray(full[:, i]), atol=1e-4, rtol=1e-4)


def test_layer_ranges_run_on_host_numpy_weights_outside_jit():
    """run_layers indexes the weight stack with the scan's traced layer index: weights still in
    host numpy arrays (a freshly read checkpoint) and an eager call work, for every layer range."""
    cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=24,
                      max_seq_len=16)
    params = T.init_params(cfg, jax.random.key(0))
    host = jax.tree.map(np.asarray, params)
    toks = jnp.array([[3, 1, 4, 1]])
    np.testing.assert_allclose(np.asarray(T.forward(cfg, host, toks)[0]), np.asarray(T.forward(cfg, params, toks)[0]),
                               atol=1e-6)
    pos = jnp.arange(4)[None]
    x = T.embed(cfg, params, toks)
    whole, _, _, _ = T.run_layers(cfg, params, x, pos, None, 0, 3)
    first, _, _, _ = T.run_layers(cfg, host, x, pos, None, 0, 1)
    rest, _, _, _ = T.run_layers(cfg, host, first, pos, None, 1, 3)
    np.testing.assert_allclose(np.asarray(rest), np.asarray(whole), atol=1e-5)
