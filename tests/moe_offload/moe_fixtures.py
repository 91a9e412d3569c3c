"""One tiny random MoE model, M2R2 config and reference decode shared by this folder's tests
(cached per process so that every test reuses the same compiled shapes)."""

import functools

import jax
from conftest import tiny_config

from m2r2_jax.m2r2 import fast_stream as F
from m2r2_jax.m2r2.config import M2R2Config
from m2r2_jax.models import transformer as T
from m2r2_jax.moe_offload.record import generate_reference

PROMPTS = ([3, 17, 5, 42, 9], [7, 1, 30, 2, 11])  # equal lengths: one compiled prefill / cache shape
NEW = 6


@functools.cache
def tiny_moe_setup():
    cfg = tiny_config("mixtral", n_experts=6)
    params = T.init_params(cfg, jax.random.key(0))
    mcfg = M2R2Config(branch_layer=1, rate=2, lora_rank=4, router_dim=8, router_hidden=8,
                      moe_lowrank_dim=8, moe_fast_mlp="none").validate(cfg)
    mp = F.init_m2r2_params(cfg, mcfg, jax.random.key(1))
    refs = tuple(tuple(generate_reference(cfg, params, p, NEW)) for p in PROMPTS)
    return cfg, params, mcfg, mp, refs
