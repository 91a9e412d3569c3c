"""Speculative decoding: one generic round with a pluggable drafter.

A round, from the pending token t at position n (the last committed token, K/V not yet cached):

1. *draft* up to G tokens d_0..d_{G-1} at positions n+1..n+G with the drafter (step 0 feeds t,
   step i feeds d_{i-1}); with a dynamic draft length a sequence stops proposing at the first
   draft whose confidence is below tau (that draft is not proposed);
2. *verify*: one base-model forward over [t, d_0..d_{G-1}] at positions n..n+G writes exact K/V
   for all layers and gives the target distributions p_0..p_G. A self-drafter runs the base's
   first `shared_layers` layers exactly for every token it feeds (t, d_0..d_{G-2}) and hands their
   output to the verifier, which then runs those layers for d_{G-1} alone and the rest over all
   G+1 positions: the same function, with the shared layers' work done once per token instead of
   twice (their K/V is already in the cache);
3. *accept*: exact match at temperature 0, rejection sampling otherwise (`sampling.py`);
4. *commit* the accepted drafts plus one token from the target (correction or bonus). Rolling back
   needs no copy: the cache is position-addressed, so the rejected drafts' slots are simply
   overwritten by the next round before any query can see them.

Drafters (frozen, hashable: they are static arguments of the jitted loop):

- `M2R2Drafter`: the fast residual stream (`m2r2.fast_stream.fast_forward`); it shares the base
  cache (layers < b exact, visited layers provisional until the verify pass overwrites them), and
  its router's exit logit is the confidence for dynamic draft length. Shared layers: the b
  branch layers.
- `DistanceDrafter`: LayerSkip-style self-speculation: the first E base layers + the exit head
  (final norm + LM head, optional learned exit-norm scale); writes exact K/V for those E layers.
  Shared layers: those E.
- `TwoModelDrafter`: a separate small model with its own cache. Its first step re-feeds the token
  before t as well, so its cache is complete even after a round that accepted every draft.

Confidence for dynamic draft length: sigmoid(router exit logit) for M2R2, the draft's max softmax
probability (temperature 1) for the others.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from m2r2_jax.decoding.loop import GenState, chunked_prefill, commit, pending_positions, round_keys, write_positions
from m2r2_jax.decoding.sampling import Sampling, greedy_accept, probs_from_logits, rejection_accept, sample_from_probs
from m2r2_jax.models.config import ModelConfig
from m2r2_jax.models.layers import dtype_of
from m2r2_jax.models.transformer import cache_length, embed, forward, head, init_cache, run_layers


class Draft(NamedTuple):
    drafts: jax.Array  # [B, G] proposed tokens
    q: Optional[jax.Array]  # [B, G, V] draft distributions (None when greedy)
    draft_len: jax.Array  # [B] drafts proposed (dynamic length stops at the first unconfident one)
    steps: jax.Array  # [B] draft steps each sequence needed
    cache: dict
    dstate: Any
    hidden: Optional[jax.Array]  # [B, G, d] output of the first `shared_layers` base layers for
    #                              the G tokens fed (t, d_0..d_{G-2}); None for drafters sharing none


def _max_prob(logits: jax.Array) -> jax.Array:
    return jnp.max(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), axis=-1)


class _SelfDrafter:
    """Drafters that run (part of) the base model itself: no state of their own, the base's
    vocabulary, nothing to prefill beyond the shared cache. Subclasses are dataclasses with a
    `cfg: ModelConfig` field, a `reuse_shared: bool` one (off: the verifier recomputes the
    shared layers, for side-by-side measurements) and `draft_vocab: int` (> 0: the draft head
    scores only that many tokens, params["draft_head"] from `decoding.draft_vocab`; the others
    get no probability, so they are never drafted). `step` returns (logits [B, V], confidence
    [B], cache, dstate, hidden [B, 1, d]: the output of the first `shared_layers` layers)."""

    peel_first = False

    def _vocab(self, params) -> Optional[dict]:
        if not self.draft_vocab:
            return None
        if "draft_head" not in params:
            raise ValueError(f"the drafter scores a {self.draft_vocab}-token draft vocabulary but the "
                             "parameters carry no draft_head (build the engine with draft_vocab=...)")
        return params["draft_head"]

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def shared_layers(self) -> int:
        """Leading base layers whose exact output `step` returns for the verifier (0: none)."""
        return self._prefix_layers() if self.reuse_shared else 0

    def init_state(self, batch: int, cache_len: int):
        return ()

    def prefill(self, params, dstate, prompts, lengths):
        return dstate


@dataclasses.dataclass(frozen=True)
class DistanceDrafter(_SelfDrafter):
    """Draft with base layers [0, n_layers) and the exit head. params["exit_norm_scale"], when
    present, multiplies the final-norm weight (a learned per-exit scale)."""

    cfg: ModelConfig
    n_layers: int
    reuse_shared: bool = True
    draft_vocab: int = 0

    def _prefix_layers(self) -> int:
        return self.n_layers

    def step(self, params, cache, dstate, tokens, positions):
        """tokens, positions [B, 1] -> (logits [B, V], confidence [B], cache, dstate, hidden)."""
        base = params["base"]
        x = embed(self.cfg, base, tokens)
        x, cache, _, _ = run_layers(self.cfg, base, x, positions, cache, 0, self.n_layers)
        logits = head(self.cfg, base, x, params.get("exit_norm_scale"), vocab=self._vocab(params))[:, -1]
        return logits, _max_prob(logits), cache, dstate, x

    def cost_per_token(self) -> float:
        return float(self.n_layers)


@dataclasses.dataclass(frozen=True)
class M2R2Drafter(_SelfDrafter):
    """Draft with the M2R2 fast stream (params["m2r2"] is the M2R2 parameter tree)."""

    cfg: ModelConfig
    mcfg: Any  # m2r2.config.M2R2Config
    reuse_shared: bool = True
    draft_vocab: int = 0

    def _prefix_layers(self) -> int:
        return self.mcfg.branch_layer

    def step(self, params, cache, dstate, tokens, positions):
        from m2r2_jax.m2r2.fast_stream import fast_forward

        out = fast_forward(self.cfg, self.mcfg, params["base"], params["m2r2"], tokens, positions, cache,
                           vocab=self._vocab(params))
        logits = out.logits[:, -1]
        confidence = jax.nn.sigmoid(out.exit_logits[-1, :, -1].astype(jnp.float32))
        return logits, confidence, out.cache, dstate, out.branch_state

    def cost_per_token(self) -> float:
        from m2r2_jax.m2r2.fast_stream import draft_cost_layers

        return float(draft_cost_layers(self.cfg, self.mcfg))


@dataclasses.dataclass(frozen=True)
class TwoModelDrafter:
    """A separate draft model (same vocabulary) with its own KV cache; params["draft"]."""

    draft_cfg: ModelConfig
    peel_first = True
    shared_layers = 0  # its own model: nothing of the base's computed

    @property
    def vocab_size(self) -> int:
        return self.draft_cfg.vocab_size

    def init_state(self, batch: int, cache_len: int):
        return init_cache(self.draft_cfg, batch, cache_len)

    def prefill(self, params, dstate, prompts, lengths):
        return chunked_prefill(self.draft_cfg, params["draft"], prompts, lengths, dstate)[0]

    def step(self, params, cache, dstate, tokens, positions):
        logits, dstate = forward(self.draft_cfg, params["draft"], tokens, positions, dstate)
        logits = logits[:, -1]
        return logits, _max_prob(logits), cache, dstate, None

    def first_step(self, params, cache, dstate, prev, pending, positions):
        # prev sits at positions - 1; re-feeding it fills the draft cache's one possible gap (the
        # last draft of a fully accepted round was never fed). Finished rows stay dropped.
        s = cache_length(dstate)
        prev_pos = jnp.where(positions >= s, s, positions - 1)
        toks = jnp.stack([prev, pending], axis=1)
        return self.step(params, cache, dstate, toks, jnp.stack([prev_pos, positions], axis=1))

    def cost_per_token(self) -> float:
        return float(self.draft_cfg.n_layers)


def draft(drafter, sampling: Sampling, gamma: int, dynamic: bool, params, st: GenState, tau, keys) -> Draft:
    """Run up to `gamma` draft steps (see `Draft` for what comes back)."""
    b = st.pending.shape[0]
    pos0 = pending_positions(st)
    greedy = sampling.greedy
    v = drafter.vocab_size

    def choose(i, logits):
        k = jax.vmap(lambda kk: jax.random.fold_in(kk, i))(keys)
        q = None if greedy else probs_from_logits(logits, sampling)
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32) if greedy else sample_from_probs(k, q)
        return tok, q

    drafts = jnp.zeros((b, gamma), jnp.int32)
    qs = None if greedy else jnp.zeros((b, gamma, v), jnp.float32)
    # The shared layers' output per fed token. Steps a dynamic-length loop skips leave zeros: their
    # positions lie past every sequence's draft_len, so no committed token is verified from them.
    hidden = None
    if drafter.shared_layers:
        hidden = jnp.zeros((b, gamma, drafter.cfg.d_model), dtype_of(drafter.cfg.dtype))
    alive = jnp.ones((b,), bool)
    draft_len = steps = jnp.zeros((b,), jnp.int32)
    cache, dstate, start = st.cache, st.dstate, 0
    if drafter.peel_first:
        # a drafter whose first step differs in shape (two_model re-feeds the previous token)
        wpos = write_positions(st, pos0)
        logits, conf, cache, dstate, _ = drafter.first_step(params, cache, dstate, st.prev, st.pending, wpos)
        tok, q = choose(0, logits)
        alive = (conf >= tau) if dynamic else alive
        drafts = drafts.at[:, 0].set(tok)
        qs = None if greedy else qs.at[:, 0].set(q)
        draft_len, steps, start = alive.astype(jnp.int32), jnp.ones((b,), jnp.int32), 1

    def cond(c):
        i, alive = c[0], c[1]
        return (i < gamma) & jnp.any(alive & ~st.done)

    def body(c):
        i, alive, drafts, qs, hidden, draft_len, steps, cache, dstate = c
        # step 0 feeds the pending token, step i > 0 the previous draft
        prev_tok = jax.lax.dynamic_index_in_dim(drafts, jnp.maximum(i - 1, 0), axis=1, keepdims=False)
        prev_tok = jnp.where(i == 0, st.pending, prev_tok)
        pos = write_positions(st, pos0 + i)
        logits, conf, cache, dstate, h = drafter.step(params, cache, dstate, prev_tok[:, None], pos[:, None])
        tok, q = choose(i, logits)
        steps = steps + alive.astype(jnp.int32)
        alive = alive & (conf >= tau) if dynamic else alive
        drafts = jax.lax.dynamic_update_index_in_dim(drafts, tok, i, axis=1)
        if qs is not None:
            qs = jax.lax.dynamic_update_index_in_dim(qs, q, i, axis=1)
        if hidden is not None:
            hidden = jax.lax.dynamic_update_slice_in_dim(hidden, h.astype(hidden.dtype), i, axis=1)
        draft_len = draft_len + alive.astype(jnp.int32)
        return i + 1, alive, drafts, qs, hidden, draft_len, steps, cache, dstate

    init = (jnp.asarray(start, jnp.int32), alive, drafts, qs, hidden, draft_len, steps, cache, dstate)
    _, _, drafts, qs, hidden, draft_len, steps, cache, dstate = jax.lax.while_loop(cond, body, init)
    return Draft(drafts, qs, draft_len, steps, cache, dstate, hidden)


def verify(cfg: ModelConfig, params, st: GenState, cache, drafts: jax.Array, hidden: Optional[jax.Array] = None,
           shared_layers: int = 0):
    """The slow pass: base model over [pending, drafts] at their positions; writes exact K/V for all
    layers. With `hidden` (the drafter's output of base layers [0, shared_layers) for the pending
    token and drafts[:, :-1], whose K/V for those layers it already wrote), only the last draft
    runs those layers here. Returns (logits [B, G+1, V], cache)."""
    g = drafts.shape[1]
    pos = write_positions(st, pending_positions(st)[:, None] + jnp.arange(g + 1)[None])
    if hidden is None or shared_layers == 0:
        toks = jnp.concatenate([st.pending[:, None], drafts], axis=1)
        return forward(cfg, params["base"], toks, pos, cache)
    base = params["base"]
    last = embed(cfg, base, drafts[:, -1:])
    last, cache, _, _ = run_layers(cfg, base, last, pos[:, -1:], cache, 0, shared_layers)
    x = jnp.concatenate([hidden.astype(last.dtype), last], axis=1)
    x, cache, _, _ = run_layers(cfg, base, x, pos, cache, shared_layers)
    return head(cfg, base, x), cache


def verify_layers(cfg: ModelConfig, gamma: int, shared_layers: int) -> int:
    """Base-model layer evaluations of one verification pass (token x layer)."""
    return cfg.n_layers * (gamma + 1) - shared_layers * gamma


def spec_round(
    cfg: ModelConfig,
    drafter,
    sampling: Sampling,
    gamma: int,
    dynamic: bool,
    max_new: int,
    eos_ids: tuple[int, ...],
    accept_fn: Optional[Callable],
    params,
    tau,
    st: GenState,
) -> GenState:
    """One draft / verify / accept / commit round for every sequence of the batch."""
    rk = round_keys(st.keys, st.it + 1)
    k_draft, k_accept = jnp.moveaxis(jax.vmap(lambda k: jax.random.split(k, 2))(rk), 1, 0)
    drafts, qs, draft_len, steps, cache, dstate, hidden = draft(drafter, sampling, gamma, dynamic, params, st, tau,
                                                                k_draft)
    logits, cache = verify(cfg, params, st, cache, drafts, hidden, drafter.shared_layers)
    if sampling.greedy:
        n_acc, nxt = greedy_accept(logits, drafts, draft_len)
    else:
        p = probs_from_logits(logits, sampling)
        n_acc, nxt = (accept_fn or rejection_accept)(k_accept, p, qs, drafts, draft_len)
    rows = jnp.arange(drafts.shape[0])
    cand = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1).at[rows, n_acc].set(nxt)
    active = (~st.done).astype(jnp.float32)
    st = st._replace(
        cache=cache,
        dstate=dstate,
        target_layers=st.target_layers + active * verify_layers(cfg, gamma, drafter.shared_layers),
        draft_layers=st.draft_layers + active * drafter.cost_per_token() * steps,
    )
    return commit(st, cand, n_acc + 1, n_acc + 1, max_new=max_new, eos_ids=eos_ids)
