"""Shared tiny models and runners for the decoding tests (fixed shapes, so compiled programs are
reused across hypothesis examples)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from conftest import tiny_config
from m2r2_jax.decoding import api
from m2r2_jax.m2r2.config import M2R2Config
from m2r2_jax.models.transformer import forward, init_cache, init_params

BATCH = 4  # every test batch is padded to this many rows
WIDTH = 6  # prompts are padded to this many tokens
MAX_NEW = 8


def sharpen(cfg, params, head_scale: float):
    """Random init gives near-uniform next-token distributions; a larger LM head makes greedy
    decisions well separated (so float noise cannot flip an argmax) and the distributions peaky."""
    params = dict(params)
    if cfg.tie_embeddings:
        params["embed"] = {"embedding": params["embed"]["embedding"] * head_scale}
    else:
        params["lm_head"] = {"kernel": params["lm_head"]["kernel"] * head_scale}
    return params


def _leaf_name(path) -> str:
    return str(getattr(path[-1], "key", path[-1]))


def numpy_params(abstract, seed: int, fill=None):
    """Random parameters of the given abstract tree, drawn with numpy: norm scales 1, biases and
    LoRA B 0, weights N(0, 1/fan_in). The real initialisers compile many small programs (10-20 s
    of CPU per config); decoding tests only need valid random weights of the right shapes."""
    rng = np.random.default_rng(seed)

    def one(path, leaf):
        name = _leaf_name(path)
        if fill is not None:
            v = fill(path, leaf)
            if v is not None:
                return jnp.asarray(v, leaf.dtype)
        if name in ("scale",):
            return jnp.ones(leaf.shape, leaf.dtype)
        if name in ("bias", "B"):
            return jnp.zeros(leaf.shape, leaf.dtype)
        fan_in = leaf.shape[-2] if len(leaf.shape) >= 2 else 50
        return jnp.asarray(rng.normal(size=leaf.shape) / np.sqrt(fan_in), leaf.dtype)

    return jax.tree_util.tree_map_with_path(one, abstract)


def random_base(cfg, seed: int):
    return numpy_params(jax.eval_shape(lambda: init_params(cfg, jax.random.key(0))), seed)


def random_m2r2(cfg, mcfg, seed: int, adapter_scale: float = 0.0):
    """An M2R2 tree shaped like `init_m2r2_params`: rates at their initial value (the layers each
    step covers), LoRA B = adapter_scale * noise (0: the fresh-init fast stream), router random."""
    from m2r2_jax.m2r2.fast_stream import init_m2r2_params, layers_covered

    covered = np.asarray(layers_covered(cfg, mcfg), np.float32)[:, None]
    rng = np.random.default_rng(seed + 1)

    def fill(path, leaf):
        keys = [str(getattr(p, "key", p)) for p in path]
        if keys[0] == "rates":
            return np.broadcast_to(covered, leaf.shape)
        if keys[-1] == "B":
            return adapter_scale * rng.normal(size=leaf.shape)
        return None

    abstract = jax.eval_shape(lambda: init_m2r2_params(cfg, mcfg, jax.random.key(0)))
    return numpy_params(abstract, seed, fill)


@functools.lru_cache(maxsize=None)
def model(family: str = "llama", seed: int = 0, head_scale: float = 30.0, **kw):
    cfg = tiny_config(family, **kw)
    # weights ~ N(0, 1/fan_in) instead of 0.02 (so the head is already sharp); head_scale on top
    return cfg, sharpen(cfg, random_base(cfg, seed), head_scale / 10.0)


# the drafters' M2R2 shapes on the tiny models: strided on the dense one, consecutive on the MoE
SMALL_M2R2 = {"llama": M2R2Config(branch_layer=1, rate=2, lora_rank=4, router_dim=8, router_hidden=8),
              "mixtral": M2R2Config(branch_layer=2, rate=1, schedule="consecutive", lora_rank=4, router_dim=8,
                                    router_hidden=8)}


@functools.lru_cache(maxsize=None)
def m2r2_variant(family: str, mcfg: M2R2Config, variant: str):
    """"fresh": the fresh-init structure (LoRA B = 0: the base weights + rate extrapolation);
    otherwise random adapters, so drafts come from a genuinely different fast stream."""
    cfg, _ = model(family)
    return random_m2r2(cfg, mcfg, 7, adapter_scale=0.0 if variant == "fresh" else 0.05)


def drafter_options(method: str, family: str, variant: str) -> dict:
    """`build_engine` options for the drafter of `method` on the tiny `family` model. Variants:
    m2r2_spec "fresh" / "random" adapters; two_model "exact" (the target itself), "noisy" (small
    weight noise: often right) or "far" (large noise); distance_spec drafts from layer 2."""
    if method == "m2r2_spec":
        mcfg = SMALL_M2R2[family]
        return {"m2r2": (mcfg, m2r2_variant(family, mcfg, variant))}
    if method == "two_model":
        return {"draft": model(family) if variant == "exact" else noisy_copy(family, 0.05 if variant == "noisy" else 1.0)}
    if method == "distance_spec":
        return {"exit_layer": 2}
    return {}


@functools.lru_cache(maxsize=None)
def noisy_copy(family: str, scale: float, seed: int = 123):
    """The target model with small Gaussian noise on every weight: a draft that is often right."""
    cfg, params = model(family)
    rng = np.random.default_rng(seed)
    noisy = jax.tree.map(lambda a: a + scale * np.std(a) * rng.normal(size=a.shape).astype(np.float32), params)
    return cfg, noisy


def run(engine, prompts, seed=0, tau=0.5, batch=BATCH, width=WIDTH):
    """Run one padded batch; returns (results, final GenState)."""
    results, states = api.run_engine(engine, prompts, seed=seed, batch_size=batch, tau=tau, width=width,
                                     fixed_batch=True, return_states=True)
    return results, states[0]


@functools.partial(jax.jit, static_argnums=(0, 4))
def _reference_cache(cfg, params, toks, positions, cache_len):
    _, cache = forward(cfg, params, toks, positions, init_cache(cfg, toks.shape[0], cache_len))
    return cache


def reference_cache(cfg, params, prompts, results, max_new: int = MAX_NEW):
    """KV cache of plain decoding of prompt + generated tokens, in one forward pass."""
    n = len(prompts)
    total = cache_len = WIDTH + max_new
    toks = np.zeros((BATCH, total), np.int32)
    pos = np.full((BATCH, total), cache_len, np.int32)
    for i, (p, r) in enumerate(zip(prompts, results)):
        seq = list(p) + list(r.tokens)
        toks[i, : len(seq)] = seq
        pos[i, : len(seq)] = np.arange(len(seq))
    assert n <= BATCH
    return _reference_cache(cfg, params, jnp.asarray(toks), jnp.asarray(pos), cache_len)

