"""Test setup: 8 fake CPU devices for sharding tests, float32 matmuls, small shared fixtures."""

import gc
import os
import sys
from pathlib import Path

# `python -m pytest` puts the working directory (the repository root) first on sys.path, where the
# top-level kernels/ folder (installed as m2r2_jax.kernels) would shadow any installed `kernels`
# distribution: transformers >= 5.25 depends on Hugging Face's `kernels` and imports it, so the
# reference models of the interop tests failed to import. The tests use the installed package
# (editable: m2r2_jax and m2r2_jax.kernels resolve without the root on sys.path), so drop it.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]

# The suite's time goes mostly into XLA compiling thousands of small programs, not running them:
# without LLVM's expensive passes and at backend optimisation level 0 the CPU compiles take ~37%
# less CPU time (measured on test_oracles + test_lossless_bf16: 252 -> 159 s). Every comparison in
# the suite is between programs built alike; the fully optimised build's lossless identity is what
# `m2r2 bench` and `make demo` check on every run (report["speculative"][m]["identical_to_ar"]).
FAST_COMPILE = "--xla_llvm_disable_expensive_passes=true --xla_backend_optimization_level=0"
# XLA:CPU's older LLVM IR emitters compile a fusion in about half the time its newer MLIR fusion
# emitters take (the one-core `m2r2 bench` of tests/bench/test_bench_cli.py: 55 -> 30 s, nearly all
# of it compiling). The end-to-end tests whose time is compiling in processes of their own (the
# Colab notebooks' kernels, the documented commands' workers, the one-core bench) add this; each
# compares only programs compiled in one such process, or in processes started with the same flags.
OLD_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def cpu_xla_flags(devices: int, old_emitters: bool = False) -> str:
    """XLA_FLAGS for a test process (this one, CLI subprocesses): `devices` fake CPU devices, fast
    compiles (`old_emitters`: faster still, see OLD_EMITTERS)."""
    flags = f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"
    return f"{flags} {OLD_EMITTERS}" if old_emitters else flags


os.environ.setdefault("XLA_FLAGS", cpu_xla_flags(8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# Tests compile many small programs, often the same ones in different tests, in both xdist workers
# and in CLI subprocesses (which inherit these variables): a persistent compilation cache shared
# by the run saves most of that time.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/m2r2_jax_test_cache")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
# The CLI verbs' default cache (~/.cache/m2r2_jax/xla) is never written by the tests: a subprocess
# without the variable above compiles uncached.
os.environ.setdefault("M2R2_COMPILE_CACHE", "off")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop the compiled programs once a test file is done, if they hold many memory maps.

    Each program XLA compiles for the CPU maps its machine code into the process, and an xdist
    worker lives for the whole run: by 90% of the suite one held ~53,000 maps, near Linux's default
    limit of 65,530 (vm.max_map_count), and workers then died in the compiler (segfault or abort),
    after which xdist's loadfile scheduler waited forever. One file adds at most ~20,000. Clearing
    after every file would throw away programs the next file reuses, so only past a third of the
    limit; a program needed again comes back from the persistent cache.
    """
    yield
    used, limit = _memory_maps()
    if used < limit // 3:
        return
    jax.clear_caches()
    gc.collect()
    used, limit = _memory_maps()
    if used > 0.6 * limit:
        pytest.fail(f"this test process holds {used} memory maps after clearing JAX's caches "
                    f"(limit vm.max_map_count = {limit}): something keeps compiled programs alive")


def _memory_maps() -> tuple[int, int]:
    """(maps this process holds, the kernel's per-process limit); (0, 1) where /proc is absent."""
    try:
        with open("/proc/self/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except OSError:
        return 0, 1

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
    if family == "gemma3":
        # Gemma 3's layer, with a window short enough for the tests' sequences and a local layer
        # pattern (every third layer global) that puts both kinds in 3+ layers; head_dim != d/H
        base.update(head_dim=16, sliding_window=4, rope_theta=1e6, rope_local_theta=1e4, qk_norm=True,
                    qk_norm_per_head=True, norm_unit_offset=True, post_norms=True, mlp_activation="gelu_tanh",
                    scale_embeddings=True, query_pre_attn_scalar=16, tie_embeddings=True)
    base.update(kw)
    if family == "gemma3" and "layer_types" not in kw:
        base["layer_types"] = tuple("full_attention" if (i + 1) % 3 == 0 else "sliding_attention"
                                    for i in range(base["n_layers"]))
    return ModelConfig(**base).validate()


def tiny_pretrain_config(vocab_size: int = 512, tokenizer: str = "", **train) -> str:
    """The text of a pretrain config file small enough to train a few steps in seconds on one CPU
    core (2 layers, d_model 32, the embedded corpus's held-out split); `train` overrides its
    train section, `tokenizer` names a tokenizer file ("" trains one)."""
    t = dict(steps=100000, batch_size=8, warmup_steps=2, checkpoint_every=100000, progress=False)
    t.update(train)
    return f"""
from m2r2_jax.training.config import base_config

def get_config():
    cfg = base_config()
    cfg.model.update(dict(family="llama", vocab_size={vocab_size}, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1,
                          head_dim=16, d_ff=64, max_seq_len=64))
    cfg.train.update({t!r})
    cfg.data.update(dict(source="embedded", split="heldout", seq_len=32, tokenizer={tokenizer!r}))
    return cfg
"""


@pytest.fixture
def tiny_dense():
    return tiny_config("llama")


@pytest.fixture
def tiny_moe():
    return tiny_config("mixtral")


@pytest.fixture
def few_rows_head_everywhere(monkeypatch):
    """The tied head's few-rows CPU form (`models.layers.tied_head_product`) on the tests' tiny
    tables too (normally only tables of 4M+ entries take it). Returns the shapes of the x's traced
    through it, so a test can show it did not pass on the dot alone."""
    from m2r2_jax.models import layers

    traced, inner = [], layers._few_rows_product

    def counted(x, w):
        traced.append(x.shape)
        return inner(x, w)

    monkeypatch.setattr(layers, "FEW_ROWS_MIN_TABLE", 0)
    monkeypatch.setattr(layers, "_few_rows_product", counted)
    return traced
