"""The weight-streaming bound: bytes read per decoding step counted from the parameter tree (the
embedding table read as one row unless the head is tied to it), and a measured copy bandwidth."""

import dataclasses

import jax
import numpy as np

from m2r2_jax.bench.roofline import ar_roofline, copy_bandwidth, weight_bytes_per_token
from m2r2_jax.models.transformer import init_params

from conftest import tiny_config


def _bytes(tree):
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


def test_weight_bytes_count_one_embedding_row_unless_tied():
    cfg = tiny_config()
    params = init_params(cfg, jax.random.key(0))
    emb = params["embed"]["embedding"]
    assert "lm_head" in params
    assert weight_bytes_per_token(cfg, params) == _bytes(params) - emb.size * 4 + cfg.d_model * 4
    tied = dataclasses.replace(cfg, tie_embeddings=True)
    tparams = init_params(tied, jax.random.key(0))
    assert "lm_head" not in tparams and weight_bytes_per_token(tied, tparams) == _bytes(tparams)


def test_copy_bandwidth_and_the_bound():
    bw = copy_bandwidth(nbytes=8 << 20, repeats=3, threads=2)
    assert bw["threads"] == 2 and bw["buffer_bytes"] == 8 << 20
    assert 0 < bw["spread"][0] <= bw["bytes_per_s"] <= bw["spread"][1]
    cfg = tiny_config()
    params = init_params(cfg, jax.random.key(0))
    roof = ar_roofline(cfg, params, ar_tokens_per_s=100.0)
    assert np.isclose(roof["bound_tokens_per_s"], roof["copy_bandwidth"]["bytes_per_s"] / roof["weight_bytes_per_token"])
    assert np.isclose(roof["fraction_of_bound"], 100.0 / roof["bound_tokens_per_s"])
