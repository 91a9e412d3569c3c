"""Minimal sampling from a base model: prefill the prompt, then one jitted `lax.scan` over new
tokens with the model's KV cache (greedy at temperature 0). The full decoding engine lives in
`m2r2_jax.decoding`; this is the quick look at a model that pre-training needs."""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from m2r2_jax.errors import ConfigError, DataError
from m2r2_jax.models.config import ModelConfig
from m2r2_jax.models.transformer import forward, init_cache


def _pick(logits: jax.Array, temperature: jax.Array, key: jax.Array) -> jax.Array:
    greedy = jnp.argmax(logits, axis=-1)
    sampled = jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6), axis=-1)
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _generate(cfg: ModelConfig, params, prompt: jax.Array, n_new: int, temperature: jax.Array, key: jax.Array):
    p = prompt.shape[1]
    cache = init_cache(cfg, 1, p + n_new)
    logits, cache = forward(cfg, params, prompt, jnp.arange(p, dtype=jnp.int32)[None], cache)
    key, sub = jax.random.split(key)
    first = _pick(logits[:, -1], temperature, sub)

    def body(carry, i):
        tok, cache, key = carry
        key, sub = jax.random.split(key)
        logits, cache = forward(cfg, params, tok[:, None], jnp.full((1, 1), p + i, jnp.int32), cache)
        nxt = _pick(logits[:, -1], temperature, sub)
        return (nxt, cache, key), tok

    (last, _, _), toks = jax.lax.scan(body, (first, cache, key), jnp.arange(n_new - 1, dtype=jnp.int32))
    return jnp.concatenate([toks[:, 0], last])


def sample_tokens(cfg: ModelConfig, params, prompt_ids: Sequence[int], max_new_tokens: int,
                  temperature: float = 0.0, seed: int = 0, eos_id: Optional[int] = None) -> list[int]:
    """New token ids after `prompt_ids` (cut after the first EOS when `eos_id` is given)."""
    if not prompt_ids:
        raise DataError("the prompt encodes to no tokens")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens} is invalid: expected an integer >= 1")
    if temperature < 0 or not np.isfinite(temperature):
        raise ConfigError(f"temperature={temperature} is invalid: expected a finite number >= 0")
    total = len(prompt_ids) + max_new_tokens
    if total > cfg.max_seq_len:
        raise ConfigError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) = {total} "
                          f"exceeds the model's max_seq_len={cfg.max_seq_len}")
    prompt = jnp.asarray([list(prompt_ids)], jnp.int32)
    out = np.asarray(_generate(cfg, params, prompt, max_new_tokens, jnp.float32(temperature), jax.random.key(seed)))
    ids = out.tolist()
    if eos_id is not None and eos_id in ids:
        ids = ids[: ids.index(eos_id) + 1]
    return ids
