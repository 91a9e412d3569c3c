"""State and bookkeeping shared by every decoding method.

One generation batch is a `GenState` pytree carried through a `lax.while_loop`; each iteration is
one *round* of a method (one token for plain and early-exit decoding, draft + verify for the
speculative methods). Conventions:

- Prompts are right-padded to a common width; `lengths[b]` is sequence b's prompt length.
- The cache is position-addressed (see `models.transformer`). After every round, the cache holds
  exact K/V for every committed token except the last one, `pending`, which sits at position
  `lengths + n_gen - 1` and is fed by the next round.
- Writes for finished (or padding) sequences go to position `S` (the cache length), which the cache
  drops, so a finished sequence idles without touching its cache.
- Randomness: sequence b owns key `keys[b]`; round r (0 = the prefill's first token) uses
  `fold_in(keys[b], r)`, so a sequence's samples do not depend on the rest of its batch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from m2r2_jax.decoding.sampling import Sampling, select
from m2r2_jax.models.config import ModelConfig
from m2r2_jax.models.layers import dtype_of
from m2r2_jax.models.transformer import cache_length, embed, head, init_cache, run_layers

# Prompt positions one prefill step runs. The prefill loops over chunks of this many positions, only
# as many as the longest prompt of the batch needs, so a program compiled for a wide prompt array
# (a cache-length bucket, `api.prompt_width`) costs a short prompt no more than its own chunks.
PREFILL_CHUNK = 32


class GenState(NamedTuple):
    cache: dict  # the base model's KV cache [L, B, KV, S, hd]
    dstate: Any  # a drafter's own state (two_model: the draft model's cache), else ()
    out: jax.Array  # [B, M + C] generated tokens (C = most tokens one round can commit)
    n_gen: jax.Array  # [B] tokens generated so far
    prev: jax.Array  # [B] the committed token before `pending`
    pending: jax.Array  # [B] last committed token; its K/V is not in the cache yet
    lengths: jax.Array  # [B] prompt lengths
    done: jax.Array  # [B] bool
    keys: jax.Array  # [B] per-sequence keys
    it: jax.Array  # () rounds run
    accepted: jax.Array  # [B, M] per-round committed counts (accepted drafts + 1)
    n_rounds: jax.Array  # [B] rounds this sequence took part in
    target_layers: jax.Array  # [B] float32: base-model layer evaluations (token x layer)
    draft_layers: jax.Array  # [B] float32: drafter / fast-stream layer-equivalents
    early_exits: jax.Array  # [B] tokens an early-exit method emitted before the last layer
    extra: Any  # method-specific carry (early exit: deferred window), else ()


def round_keys(keys: jax.Array, r) -> jax.Array:
    return jax.vmap(lambda k: jax.random.fold_in(k, r))(keys)


def pending_positions(st: GenState) -> jax.Array:
    return st.lengths + st.n_gen - 1


def write_positions(st: GenState, positions: jax.Array) -> jax.Array:
    """Positions [B, ...] with finished sequences moved to the dropped slot S."""
    s = cache_length(st.cache)
    done = st.done.reshape(st.done.shape + (1,) * (positions.ndim - 1))
    return jnp.where(done, s, positions)


def is_stop(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    """Bool array shaped like `tokens`: which tokens are any of the stop ids. `eos_ids` is a static
    tuple, so this unrolls to one compare per id (a handful at most); empty: nothing stops."""
    hit = jnp.zeros(tokens.shape, bool)
    for e in eos_ids:
        hit = hit | (tokens == e)
    return hit


def chunked_prefill(cfg: ModelConfig, params, prompts: jax.Array, lengths: jax.Array, cache: dict,
                    chunk: int = PREFILL_CHUNK):
    """Write the K/V of right-padded prompts [B, W] into `cache`, `chunk` positions per step.

    A `lax.while_loop` runs ceil(max(lengths) / chunk) steps (at most ceil(W / chunk)), so the
    compiled program does not depend on how long the prompts are, only on W, and padding past the
    longest prompt costs nothing. Each step attends over the cache like a decoding step does (the
    cache is position-addressed; a chunk's queries see the earlier chunks' keys), which gives the
    same K/V as one forward over the whole prompt. Returns (cache, h_last [B, d]): the last layer's
    output at each prompt's last position, before the final norm (the head runs on it once instead
    of on every prompt position)."""
    b, width = prompts.shape
    chunk = max(1, min(int(chunk), width))
    n_max = -(-width // chunk)
    prompts = jnp.pad(prompts, ((0, 0), (0, n_max * chunk - width)))
    sentinel = cache_length(cache)
    n_chunks = jnp.minimum((jnp.max(lengths) + chunk - 1) // chunk, n_max)
    h_last = jnp.zeros((b, cfg.d_model), dtype_of(cfg.dtype))

    def step(carry):
        i, cache, h_last = carry
        start = i * chunk
        toks = jax.lax.dynamic_slice_in_dim(prompts, start, chunk, axis=1)
        pos = start + jnp.arange(chunk)[None]
        pos = jnp.where(pos < lengths[:, None], pos, sentinel)
        x, cache, _, _ = run_layers(cfg, params, embed(cfg, params, toks), pos, cache)
        at = lengths - 1 - start  # the prompt's last position inside this chunk, if it is there
        h = jnp.take_along_axis(x, jnp.clip(at, 0, chunk - 1)[:, None, None], axis=1)[:, 0]
        h_last = jnp.where(((at >= 0) & (at < chunk))[:, None], h, h_last)
        return i + 1, cache, h_last

    _, cache, h_last = jax.lax.while_loop(lambda c: c[0] < n_chunks, step, (jnp.int32(0), cache, h_last))
    return cache, h_last


def prefill(
    cfg: ModelConfig,
    params,
    prompts: jax.Array,
    lengths: jax.Array,
    keys: jax.Array,
    valid: jax.Array,
    sampling: Sampling,
    *,
    max_new: int,
    commit_width: int,
    cache_len: int,
    eos_ids: tuple[int, ...],
    dstate: Any = (),
    extra: Any = (),
) -> GenState:
    """Run the prompts through the base model (`chunked_prefill`), draw the first new token, build
    the state."""
    b, width = prompts.shape
    cache, h_last = chunked_prefill(cfg, params, prompts, lengths, init_cache(cfg, b, cache_len))
    last = head(cfg, params, h_last[:, None])[:, 0]
    first = select(round_keys(keys, 0), last, sampling)
    prev = jnp.take_along_axis(prompts, (lengths - 1)[:, None], axis=1)[:, 0]
    out = jnp.zeros((b, max_new + commit_width), jnp.int32).at[:, 0].set(first)
    done = (~valid) | is_stop(first, eos_ids) | (max_new <= 1)
    return GenState(
        cache=cache,
        dstate=dstate,
        out=out,
        n_gen=jnp.ones((b,), jnp.int32),
        prev=prev.astype(jnp.int32),
        pending=first,
        lengths=lengths.astype(jnp.int32),
        done=done,
        keys=keys,
        it=jnp.zeros((), jnp.int32),
        accepted=jnp.zeros((b, max_new), jnp.int32),
        n_rounds=jnp.zeros((b,), jnp.int32),
        target_layers=jnp.zeros((b,), jnp.float32),
        draft_layers=jnp.zeros((b,), jnp.float32),
        early_exits=jnp.zeros((b,), jnp.int32),
        extra=extra,
    )


def commit(st: GenState, new_tokens: jax.Array, count: jax.Array, accepted: jax.Array, *, max_new: int,
           eos_ids: tuple[int, ...]) -> GenState:
    """Append new_tokens[b, :count[b]] to every running sequence, stopping after the first token
    that is any of `eos_ids` (kept in the output) and at max_new.

    `accepted` [B] is what the round reports (accepted drafts + 1) before any truncation."""
    c = new_tokens.shape[1]
    active = ~st.done
    idx = jnp.arange(c)[None]
    is_eos = is_stop(new_tokens, eos_ids) & (idx < count[:, None])
    hit_eos = jnp.any(is_eos, axis=1)
    count = jnp.where(hit_eos, jnp.argmax(is_eos, axis=1) + 1, count)
    count = jnp.minimum(count, max_new - st.n_gen)
    count = jnp.where(active, count, 0).astype(jnp.int32)
    out = jax.vmap(lambda o, t, n: jax.lax.dynamic_update_slice(o, t, (n,)))(st.out, new_tokens, st.n_gen)
    out = jnp.where(active[:, None], out, st.out)
    take = lambda i: jnp.take_along_axis(new_tokens, jnp.clip(i, 0, c - 1)[:, None], axis=1)[:, 0]  # noqa: E731
    last = take(count - 1)
    before_last = jnp.where(count >= 2, take(count - 2), st.pending)
    n_gen = st.n_gen + count
    rows = jnp.arange(st.out.shape[0])
    acc = st.accepted.at[rows, jnp.where(active, st.n_rounds, st.accepted.shape[1])].set(accepted, mode="drop")
    return st._replace(
        out=out,
        n_gen=n_gen,
        prev=jnp.where(count > 0, before_last, st.prev),
        pending=jnp.where(count > 0, last, st.pending),
        done=st.done | (active & (hit_eos | (n_gen >= max_new))),
        accepted=acc,
        n_rounds=st.n_rounds + active.astype(jnp.int32),
    )


def run_rounds(round_fn, st: GenState, max_rounds: int) -> GenState:
    """Iterate `round_fn` under `lax.while_loop` until every sequence is done."""

    def cond(s):
        return jnp.any(~s.done) & (s.it < max_rounds)

    def body(s):
        s = round_fn(s)
        return s._replace(it=s.it + 1)

    return jax.lax.while_loop(cond, body, st)
