"""Dynamic compute: token-level early exit (lossy by design; quality is measured elsewhere).

Two runners, each one decoding round = one token per sequence, inside the generic loop:

- `M2R2Exit` ("m2r2_exit"): slow layers 0..b-1, then fast steps until the router fires
  (sigmoid(exit_logit) >= tau) at step i -- the token comes from the exit head at step i -- or until
  step K; a token that never fires finishes in the slow stream (layers b..N-1 from h_b). With a
  router that reads the state only (`router_features="state"`) the exit head runs only in a step
  where a token leaves; with one that can give up (`router_give_up`) a token also stops its fast
  steps at the first step where the router expects no later step to be safe (probability < tau).
  `confirm`: a released token leaves only if the step's exit head is confident too (max
  probability >= tau), else it goes on to the next step.
- `DistanceExit` ("distance_exit"): slow layers with the exit head after each one and a decider:
  "confidence" (max softmax probability >= tau) or "saturation" (cosine of consecutive states >=
  tau); the token leaves at the first layer that fires (the last layer always does).

An exited token has no K/V at the layers it skipped. Options:

- "propagate" (CALM-style state copying): layer l's k/v projections applied to the exit state fill
  every skipped layer l (for M2R2: the layers >= b its fast pass did not visit; visited layers keep
  the fast stream's own K/V).
- "deferred" (exact): the token's slow computation is resumed later. Each sequence keeps a window of
  up to W deferred positions with their hidden state and the next layer they need; whenever the
  current token runs slow layer l, every deferred position waiting for layer l runs it too, in the
  same batched layer call. Positions further back are always at least as far along, so every slow
  query sees exact K/V at its layer. When the window is full, the current token still emits its
  early-exit token but keeps running to the last layer, which completes (flushes) the window.

Costs (`target_layers` / `draft_layers` of the state): slow layers run, including deferred work, and
M2R2 fast steps in layer-equivalents. The k/v projections of "propagate" are not counted as layers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from m2r2_jax.decoding.loop import GenState, commit, pending_positions, round_keys
from m2r2_jax.decoding.sampling import Sampling, select
from m2r2_jax.models.config import ModelConfig
from m2r2_jax.models.layers import DecoderLayer
from m2r2_jax.models.transformer import (cache_length, cache_write, embed, head, is_unstacked, layer_forward,
                                         layer_params)


# --------------------------------------------------------------------------------------------
# Deferred window and slow-layer runs
# --------------------------------------------------------------------------------------------
def init_window(cfg: ModelConfig, batch: int, width: int, cache_len: int) -> dict:
    """pos [B, W] (cache_len = empty slot), prog [B, W] next layer needed, h [B, W, d] its input."""
    return {
        "pos": jnp.full((batch, width), cache_len, jnp.int32),
        "prog": jnp.full((batch, width), cfg.n_layers, jnp.int32),
        "h": jnp.zeros((batch, width, cfg.d_model), jnp.dtype(cfg.dtype)),
    }


def _layer_step(cfg: ModelConfig, base, l, x, pos, running, cache, win):
    """Slow layer l for the current tokens x [B, 1, d] of running rows (+ deferred positions waiting
    for layer l). Returns (x_new, cache, win, layers_run [B])."""
    s = cache_length(cache)
    lp = layer_params(base, l)
    cur_pos = jnp.where(running, pos, s)[:, None]
    if win is None:
        out, cache, _ = layer_forward(cfg, lp, x, cur_pos, cache, l)
        return out, cache, win, running.astype(jnp.float32)
    w = win["pos"].shape[1]
    part = (win["pos"] < s) & (win["prog"] == l) & running[:, None]
    xs = jnp.concatenate([win["h"], x], axis=1)
    ps = jnp.concatenate([jnp.where(part, win["pos"], s), cur_pos], axis=1)
    out, cache, _ = layer_forward(cfg, lp, xs, ps, cache, l)
    win = {
        "pos": win["pos"],
        "prog": jnp.where(part, l + 1, win["prog"]),
        "h": jnp.where(part[..., None], out[:, :w], win["h"]),
    }
    cost = running.astype(jnp.float32) + jnp.sum(part, axis=1).astype(jnp.float32)
    return out[:, w:], cache, win, cost


def _loop(lo: int, hi: int, carry, step, active, unrolled: bool):
    """carry = step(i, carry) for i in [lo, hi), stopping once no row is active(carry).

    Stacked layers: a `lax.while_loop` over a traced i (each layer's weights a dynamic slice of
    the stack). Unstacked layers (`transformer.unstack_layers`): a Python loop with static i, each
    iteration behind a `lax.cond` on the same test, so the layers a batch skips are not run and
    the ones it runs read their own arrays, as the unrolled ar step does (on CPU the slices of the
    stack cost 30-40% of a step; docs/RESULTS.md, "The layer loop")."""
    if unrolled:
        for i in range(lo, hi):
            carry = jax.lax.cond(jnp.any(active(carry)), functools.partial(step, i), lambda c: c, carry)
        return carry

    def cond(c):
        return (c[0] < hi) & jnp.any(active(c[1]))

    def body(c):
        return c[0] + 1, step(c[0], c[1])

    return jax.lax.while_loop(cond, body, (jnp.asarray(lo, jnp.int32), carry))[1]


def _slow_range(cfg: ModelConfig, base, lo: int, hi: int, x, pos, running, cache, win):
    """Slow layers [lo, hi) for running rows (others keep their state). Returns (x, cache, win, cost)."""

    def step(l, c):
        x, cache, win, cost = c
        x_new, cache, win, dc = _layer_step(cfg, base, l, x, pos, running, cache, win)
        return jnp.where(running[:, None, None], x_new, x), cache, win, cost + dc

    init = (x, cache, win, jnp.zeros(running.shape, jnp.float32))
    return _loop(lo, hi, init, step, lambda c: running, is_unstacked(base))


def _insert(win, cache_len: int, n_layers: int, pos, need, state, prog):
    """Release completed slots, then put row b's (pos, state, prog) in its first free slot when
    need[b]. A free slot always exists: a full window forces a flush in the same round."""
    free = (win["pos"] >= cache_len) | (win["prog"] >= n_layers)
    pos_w = jnp.where(free, cache_len, win["pos"])
    slot = jnp.argmax(free, axis=1)
    onehot = jax.nn.one_hot(slot, free.shape[1], dtype=bool) & need[:, None] & jnp.any(free, axis=1)[:, None]
    return {
        "pos": jnp.where(onehot, pos[:, None], pos_w),
        "prog": jnp.where(onehot, prog[:, None], jnp.where(free, n_layers, win["prog"])),
        "h": jnp.where(onehot[..., None], state[:, None, :].astype(win["h"].dtype), win["h"]),
    }


def _window_full(win, cache_len: int, n_layers: int):
    free = (win["pos"] >= cache_len) | (win["prog"] >= n_layers)
    return ~jnp.any(free, axis=1)


def _propagate(cfg: ModelConfig, base, cache, state, pos, fill_fn, lo: int, any_skipped):
    """Write layer l's k/v projections of `state` [B, 1, d] at pos for layers l in [lo, N) where
    fill_fn(l) [B] is True (CALM-style copying of the exit state into skipped layers). Skipped
    entirely in a round where no token exited (`any_skipped` False): the projections of every
    layer would cost a good part of a forward pass for nothing."""
    s = cache_length(cache)
    mod = DecoderLayer(cfg)

    def body(l, cache):
        v = {"params": layer_params(base, l)}
        xn = mod.apply(v, state, method="norm_attn")
        _, k, vv = mod.apply(v, xn, pos[:, None], layer=l, method="qkv")
        wp = jnp.where(fill_fn(l), pos, s)[:, None]
        return cache_write(cache, l, wp, k, vv)

    if is_unstacked(base):
        def fill_all(cache):
            for l in range(lo, cfg.n_layers):
                cache = body(l, cache)
            return cache
    else:
        def fill_all(cache):
            return jax.lax.fori_loop(lo, cfg.n_layers, body, cache)

    return jax.lax.cond(any_skipped, fill_all, lambda c: c, cache)


# --------------------------------------------------------------------------------------------
# Runners
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DistanceExit:
    cfg: ModelConfig
    decider: str = "confidence"  # confidence | saturation
    kv_missing: str = "propagate"  # propagate | deferred
    window: int = 8

    def init_extra(self, batch: int, cache_len: int):
        return init_window(self.cfg, batch, self.window, cache_len) if self.kv_missing == "deferred" else ()

    def _fires(self, logits, x_new, x_old, tau):
        if self.decider == "confidence":
            return jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1) >= tau
        a, b = x_new[:, 0].astype(jnp.float32), x_old[:, 0].astype(jnp.float32)
        cos = jnp.sum(a * b, -1) / (jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(b, axis=-1) + 1e-9)
        return cos >= tau

    def round(self, sampling: Sampling, max_new: int, eos_ids: tuple[int, ...], params, tau, st: GenState) -> GenState:
        cfg, base = self.cfg, params["base"]
        n, s = cfg.n_layers, cache_length(st.cache)
        pos = pending_positions(st)
        deferred = self.kv_missing == "deferred"
        win = st.extra if deferred else None
        forced = (~st.done & _window_full(win, s, n)) if deferred else jnp.zeros_like(st.done)
        x0 = embed(cfg, base, st.pending[:, None])
        b, v = x0.shape[0], cfg.vocab_size

        def running_of(exited):
            return ~st.done & (~exited | forced)

        def step(l, c):
            x, exited = c["x"], c["exited"]
            running = running_of(exited)
            x_new, cache, win_, dc = _layer_step(cfg, base, l, x, pos, running, c["cache"], c["win"])

            def exit_logits():
                return head(cfg, base, x_new, params.get("exit_norm_scale"))[:, 0]

            if self.decider == "confidence":  # the decider reads the head's distribution itself
                logits = exit_logits()
                fires = self._fires(logits, x_new, x, tau)
            else:  # the head only where a token leaves: a layer where none does pays no head
                fires = self._fires(None, x_new, x, tau)
            newly = running & ~exited & (fires | (l == n - 1))
            if self.decider != "confidence":
                logits = jax.lax.cond(jnp.any(newly), exit_logits, lambda: c["logits"])
            return {
                "x": jnp.where(running[:, None, None], x_new, x),
                "cache": cache,
                "win": win_,
                "exited": exited | newly,
                "exit_layer": jnp.where(newly, l, c["exit_layer"]),
                "logits": jnp.where(newly[:, None], logits, c["logits"]),
                "h_exit": jnp.where(newly[:, None, None], x_new, c["h_exit"]),
                "cost": c["cost"] + dc,
            }

        c = _loop(0, n, {
            "x": x0, "cache": st.cache, "win": win, "exited": st.done,
            "exit_layer": jnp.full((b,), n - 1, jnp.int32), "logits": jnp.zeros((b, v), jnp.float32),
            "h_exit": x0, "cost": jnp.zeros((b,), jnp.float32),
        }, step, lambda c: running_of(c["exited"]), is_unstacked(base))
        cache, exit_layer = c["cache"], c["exit_layer"]
        skipped = ~st.done & (exit_layer < n - 1)
        if deferred:
            extra = _insert(c["win"], s, n, pos, skipped & ~forced, c["h_exit"][:, 0], exit_layer + 1)
        else:
            cache = _propagate(cfg, base, cache, c["h_exit"], pos, lambda l: skipped & (l > exit_layer), 1,
                               jnp.any(skipped))
            extra = st.extra
        tok = select(round_keys(st.keys, st.it + 1), c["logits"], sampling)
        st = st._replace(cache=cache, extra=extra, target_layers=st.target_layers + c["cost"],
                         early_exits=st.early_exits + skipped.astype(jnp.int32))
        one = jnp.ones_like(tok)
        return commit(st, tok[:, None], one, one, max_new=max_new, eos_ids=eos_ids)


@dataclasses.dataclass(frozen=True)
class M2R2Exit:
    cfg: ModelConfig
    mcfg: Any  # m2r2.config.M2R2Config
    kv_missing: str = "propagate"
    window: int = 8
    # a token the router releases leaves only if the step's exit head is also confident (max
    # probability >= tau); otherwise it goes on. The router proposes, the head (computed only
    # where the router proposes, with a state router) confirms: precision for fewer exits.
    confirm: bool = False

    def init_extra(self, batch: int, cache_len: int):
        return init_window(self.cfg, batch, self.window, cache_len) if self.kv_missing == "deferred" else ()

    def step_cost(self) -> float:
        from m2r2_jax.m2r2.fast_stream import draft_cost_layers

        k = self.mcfg.steps(self.cfg)
        return (draft_cost_layers(self.cfg, self.mcfg) - self.mcfg.branch_layer) / k

    def round(self, sampling: Sampling, max_new: int, eos_ids: tuple[int, ...], params, tau, st: GenState) -> GenState:
        from m2r2_jax.m2r2.fast_stream import exit_head_logits, fast_step, init_traj, router_later, visited_layers
        from m2r2_jax.m2r2.router import step_scalars

        cfg, mcfg, base, m2 = self.cfg, self.mcfg, params["base"], params["m2r2"]
        n, s, bl, k = cfg.n_layers, cache_length(st.cache), mcfg.branch_layer, mcfg.steps(cfg)
        pos = pending_positions(st)
        deferred = self.kv_missing == "deferred"
        win = st.extra if deferred else None
        forced = (~st.done & _window_full(win, s, n)) if deferred else jnp.zeros_like(st.done)
        live = ~st.done
        x0 = embed(cfg, base, st.pending[:, None])
        b, v = x0.shape[0], cfg.vocab_size

        # shared slow layers 0..b-1 (exact; deferred positions waiting there join)
        h_b, cache, win, cost = _slow_range(cfg, base, 0, bl, x0, pos, live, st.cache, win)

        # fast steps until the router fires (or gives up)
        def step(i, c):
            run = ~c["stopped"]
            wp = jnp.where(run, pos, s)[:, None]
            # a "logits" router's step brings its exit-head logits: the router reads them, an exiting
            # token is drawn from them (one vocabulary-wide head per step, not two); a "state"
            # router's does not, and the head runs only in a step where some token leaves
            g, cache, traj, el, logits = fast_step(cfg, mcfg, base, m2, i, c["g"], wp, c["cache"], c["traj"])
            proposed = run & (jax.nn.sigmoid(el[:, 0].astype(jnp.float32)) >= tau)
            give_up = jnp.zeros_like(run)
            if mcfg.router_give_up:  # neither here nor later: finish in the slow stream from now
                later = router_later(cfg, mcfg, m2, traj["z"], i, step_scalars(mcfg.router_features, logits, g, c["g"]))
                give_up = run & (jax.nn.sigmoid(later[:, 0].astype(jnp.float32)) < tau)
            if logits is None:
                logits = jax.lax.cond(jnp.any(proposed), lambda: exit_head_logits(cfg, mcfg, base, m2, i, g)[:, 0],
                                      lambda: c["logits"])
            else:
                logits = logits[:, 0]
            newly = proposed
            if self.confirm:
                newly = proposed & (jnp.max(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), axis=-1) >= tau)
            stops = newly | give_up
            return {
                "g": jnp.where(run[:, None, None], g, c["g"]), "cache": cache, "traj": traj,
                "stopped": c["stopped"] | stops, "by_router": c["by_router"] | newly,
                "exit_step": jnp.where(newly, i, c["exit_step"]),
                "logits": jnp.where(newly[:, None], logits, c["logits"]),
                "steps": c["steps"] + run.astype(jnp.float32),
            }

        c = _loop(0, k, {
            "g": h_b, "cache": cache, "traj": init_traj(cfg, mcfg, b, 1),
            "stopped": st.done, "by_router": jnp.zeros_like(st.done), "exit_step": jnp.full((b,), k - 1, jnp.int32),
            "logits": jnp.zeros((b, v), jnp.float32), "steps": jnp.zeros((b,), jnp.float32),
        }, step, lambda c: ~c["stopped"], is_unstacked(base))
        exited = live & c["by_router"]

        # tokens the router never released finish in the slow stream; a full window forces the
        # slow path too (to flush it) while the token keeps its early-exit emission
        slow = live & (~exited | forced)
        h_n, cache, win, slow_cost = _slow_range(cfg, base, bl, n, h_b, pos, slow, c["cache"], win)
        final = head(cfg, base, h_n)[:, 0]
        logits = jnp.where(exited[:, None], c["logits"], final)

        skipped = exited & ~forced
        if deferred:
            extra = _insert(win, s, n, pos, skipped, h_b[:, 0], jnp.full((b,), bl, jnp.int32))
        else:
            vis = jnp.asarray(visited_layers(cfg, mcfg))
            exit_step = c["exit_step"]

            def fill(l):
                seen = jnp.any((vis[None, :] == l) & (jnp.arange(k)[None, :] <= exit_step[:, None]), axis=1)
                return skipped & ~seen

            cache = _propagate(cfg, base, cache, c["g"], pos, fill, bl, jnp.any(skipped))
            extra = st.extra
        tok = select(round_keys(st.keys, st.it + 1), logits, sampling)
        st = st._replace(cache=cache, extra=extra,
                         target_layers=st.target_layers + cost + slow_cost,
                         draft_layers=st.draft_layers + c["steps"] * self.step_cost(),
                         early_exits=st.early_exits + exited.astype(jnp.int32))
        one = jnp.ones_like(tok)
        return commit(st, tok[:, None], one, one, max_new=max_new, eos_ids=eos_ids)


def exit_round(runner, sampling: Sampling, max_new: int, eos_ids: tuple[int, ...], params, tau,
               st: GenState) -> GenState:
    return runner.round(sampling, max_new, eos_ids, params, tau, st)
