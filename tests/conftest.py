"""Test setup: 8 fake CPU devices for sharding tests, float32 matmuls, small shared fixtures."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# Tests compile many small programs, often the same ones in different tests, in both xdist workers
# and in CLI subprocesses (which inherit these variables): a persistent compilation cache shared
# by the run saves most of that time.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/m2r2_jax_test_cache")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from m2r2_jax.models.config import ModelConfig  # noqa: E402


def tiny_config(family: str = "llama", **kw) -> ModelConfig:
    """A small model of any family for unit tests."""
    base = dict(family=family, vocab_size=61, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8,
                d_ff=48, max_seq_len=64)
    if family in ("mixtral", "qwen2_moe", "olmoe"):
        base.update(n_experts=4, n_experts_per_tok=2, moe_d_ff=24, norm_topk_prob=(family == "mixtral"))
    if family == "qwen2_moe":
        base.update(shared_expert_d_ff=40, qkv_bias=True)
    if family == "qwen2":
        base.update(qkv_bias=True)
    if family == "olmoe":
        base.update(qk_norm=True)
    base.update(kw)
    return ModelConfig(**base).validate()


@pytest.fixture
def tiny_dense():
    return tiny_config("llama")


@pytest.fixture
def tiny_moe():
    return tiny_config("mixtral")
