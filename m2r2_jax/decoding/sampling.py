"""Token selection and speculative acceptance.

Everything works on *transformed* distributions: `probs_from_logits` applies the temperature and the
top-p cut once, and both the target (p) and the draft (q) distributions of a speculative round go
through the same transform. That is what makes rejection sampling reproduce the distribution the
plain sampler draws from. Temperature 0 is greedy: the "distribution" is the one-hot argmax, and the
acceptance rule reduces to exact match (`greedy_accept`, no randomness at all).

Randomness is per sequence: every function takes a batch of keys [B], one per sequence, so a
sequence's samples depend on its own key only, never on the batch it was grouped with.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from m2r2_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How tokens are chosen. temperature 0 = greedy; top_p in (0, 1] keeps the smallest set of
    most likely tokens whose mass reaches top_p (ties at the cut are kept)."""

    temperature: float = 0.0
    top_p: float = 1.0

    def validate(self) -> "Sampling":
        if not (0.0 <= self.temperature < float("inf")):
            raise ConfigError(f"temperature={self.temperature!r} is invalid: expected a finite number >= 0")
        if not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p={self.top_p!r} is invalid: expected a value in (0, 1]")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def top_p_filter(probs: jax.Array, top_p: float) -> jax.Array:
    """Zero out the tail beyond nucleus mass `top_p` and renormalise. probs: [..., V]."""
    if top_p >= 1.0:
        return probs
    sorted_p = jnp.flip(jnp.sort(probs, axis=-1), axis=-1)
    mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
    kept = mass_before < top_p  # the most likely token is always kept
    threshold = jnp.min(jnp.where(kept, sorted_p, jnp.inf), axis=-1, keepdims=True)
    probs = jnp.where(probs >= threshold, probs, 0.0)
    return probs / jnp.sum(probs, axis=-1, keepdims=True)


def probs_from_logits(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """The distribution tokens are drawn from, float32 [..., V]. Greedy gives the one-hot argmax."""
    logits = logits.astype(jnp.float32)
    if sampling.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    probs = jax.nn.softmax(logits / sampling.temperature, axis=-1)
    return top_p_filter(probs, sampling.top_p)


def sample_from_probs(keys: jax.Array, probs: jax.Array) -> jax.Array:
    """One token per sequence. keys: [B] typed keys; probs: [B, V] (zeros are never drawn).

    Inverse-CDF sampling: one uniform draw per sequence against the running sum of `probs`. It
    draws from the same distribution as Gumbel-max (`jax.random.categorical`) but needs one random
    number instead of V; on a CPU that is ~10 us instead of ~90 us per token at V = 2048, a cost
    every sampled decoding step pays (a speculative round pays it once per draft).
    The chosen token is the first one with a positive probability whose running sum reaches
    u * total, u in (0, 1]; the target never exceeds the largest running sum over positive
    probabilities, so such a token always exists, whatever the rounding of the sum."""
    probs = probs.astype(jnp.float32)
    u = 1.0 - jax.vmap(lambda k: jax.random.uniform(k, ()))(keys)  # (0, 1]
    positive = probs > 0
    cdf = jnp.cumsum(probs, axis=-1)
    total = jnp.max(jnp.where(positive, cdf, 0.0), axis=-1)
    hit = positive & (cdf >= (u * total)[:, None])
    return jnp.argmax(hit, axis=-1).astype(jnp.int32)


def select(keys: jax.Array, logits: jax.Array, sampling: Sampling) -> jax.Array:
    """Next token per sequence from logits [B, V]: argmax when greedy, else a sample."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return sample_from_probs(keys, probs_from_logits(logits, sampling))


def _leading_true(ok: jax.Array) -> jax.Array:
    """Number of leading True values along the last axis."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def greedy_accept(target_logits: jax.Array, drafts: jax.Array, draft_len: jax.Array):
    """Exact-match acceptance at temperature 0.

    target_logits: [B, G+1, V] (the verify pass: row i predicts the token after draft i);
    drafts: [B, G]; draft_len: [B] (drafts beyond it do not count).
    Returns (n_accepted [B], next_token [B]): the target's own token after the accepted prefix
    (the correction on a mismatch, the bonus token when every draft matched)."""
    g = drafts.shape[1]
    target = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, G+1]
    ok = (drafts == target[:, :g]) & (jnp.arange(g)[None] < draft_len[:, None])
    n_acc = _leading_true(ok)
    nxt = jnp.take_along_axis(target, n_acc[:, None], axis=1)[:, 0]
    return n_acc, nxt


def rejection_accept(keys: jax.Array, p: jax.Array, q: jax.Array, drafts: jax.Array, draft_len: jax.Array):
    """Speculative rejection sampling (lossless for any draft distribution q).

    keys: [B]; p: [B, G+1, V] target probs after the sampling transform; q: [B, G, V] the draft
    probs the drafts were sampled from (same transform); drafts: [B, G]; draft_len: [B].
    Draft i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the
    next token is drawn from norm(max(0, p_i - q_i)); when all draft_len drafts are accepted it is
    the bonus token drawn from p_{draft_len}. Returns (n_accepted [B], next_token [B])."""
    g = drafts.shape[1]
    k_u, k_next = jnp.moveaxis(jax.vmap(lambda k: jax.random.split(k, 2))(keys), 1, 0)
    u = jax.vmap(lambda k: jax.random.uniform(k, (g,)))(k_u)
    p_d = jnp.take_along_axis(p[:, :g], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    # u < p/q written without the division; q_d > 0 because d was drawn from q.
    ok = (u * q_d < p_d) & (jnp.arange(g)[None] < draft_len[:, None])
    n_acc = _leading_true(ok)
    p_n = jnp.take_along_axis(p, n_acc[:, None, None], axis=1)[:, 0]
    q_n = jnp.take_along_axis(q, jnp.minimum(n_acc, g - 1)[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_n - q_n, 0.0)
    rejected = n_acc < draft_len
    # A rejection has probability 0 when p == q, so an all-zero residual only arises from
    # rounding; p itself is then the correct distribution.
    usable = jnp.sum(residual, axis=-1, keepdims=True) > 0
    dist = jnp.where(rejected[:, None] & usable, residual, p_n)
    dist = dist / jnp.sum(dist, axis=-1, keepdims=True)
    return n_acc, sample_from_probs(k_next, dist)
