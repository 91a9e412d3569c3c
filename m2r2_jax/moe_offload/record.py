"""Record a routing trace from real greedy decoding of a MoE base model.

One jitted step per decoded token runs, on the same KV cache,
  * the M2R2 fast pass (`fast_forward(..., collect=True)`; its provisional cache is dropped, as
    the slow pass would overwrite it), and
  * the slow forward with its hidden states and router logits (the true routing),
and returns every predictor's router logits for every layer (see `predictors.py`). The host keeps
the rankings; the slow stream's greedy token is fed back. Batch 1, one prompt at a time.

Teacher forcing (`forced`): the tokens of a given continuation are fed instead of the greedy ones,
so the trace follows real text. A briefly trained model's greedy output soon repeats one token,
and routing that never changes makes every cache look perfect.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from m2r2_jax.errors import ConfigError, DataError
from m2r2_jax.m2r2 import fast_stream as F
from m2r2_jax.models import transformer as T
from m2r2_jax.moe_offload.predictors import (cross_router_logits, fast_steps_needed, m2r2_state_plan, ranking,
                                             router_probs)
from m2r2_jax.moe_offload.trace import RoutingTrace, next_gate_issue


def _step_outputs(base_cfg, mcfg, base_params, m2r2_params, tokens, positions, cache):
    fo = F.fast_forward(base_cfg, mcfg, base_params, m2r2_params, tokens, positions, cache, collect=True)
    logits, cache, aux = T.forward(base_cfg, base_params, tokens, positions, cache, return_aux=True)
    hidden = aux.hidden[:, :, -1]  # [L+1, B, d] states of the last position
    fast_states = fo.states[:, :, -1]  # [K, B, d]
    g0 = aux.hidden[mcfg.branch_layer][:, -1]  # g_0 = h_b exactly (shared layers)
    states = jnp.concatenate([g0[None], fast_states], axis=0)  # [K+1, B, d]
    return dict(
        next_token=jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32),
        true=aux.router_logits[:, :, -1],  # [L, B, E]
        slow_cross=cross_router_logits(base_cfg, base_params, hidden),  # [L, L+1, B, E]
        fast_cross=cross_router_logits(base_cfg, base_params, states),  # [L, K+1, B, E]
        fast_own=fo.moe_router_logits[:, :, -1],  # [K, B, E]
    ), cache


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(6,))
def _trace_step(base_cfg, mcfg, base_params, m2r2_params, tokens, positions, cache):
    return _step_outputs(base_cfg, mcfg, base_params, m2r2_params, tokens, positions, cache)


@functools.partial(jax.jit, static_argnums=(0,))
def _prefill(base_cfg, base_params, tokens, cache):
    logits, cache = T.forward(base_cfg, base_params, tokens, None, cache)
    return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache


def record_trace(base_cfg, base_params, mcfg, m2r2_params, prompts: Sequence[Sequence[int]],
                 max_new_tokens: int, lookaheads: Sequence[int] = (1, 2, 3, 4),
                 forced: Optional[Sequence[Sequence[int]]] = None,
                 m2r2_sources=None) -> tuple[RoutingTrace, list]:
    """Greedy-decode every prompt for `max_new_tokens` and record the routing trace of every
    decoded token (the prompt's own tokens are prefill, not traced). Returns (trace, generated).
    With `forced` (one continuation of >= max_new_tokens tokens per prompt) the continuation's
    tokens are fed instead of the greedy ones and returned as `generated`. `m2r2_sources`: the m2r2
    predictor's source per layer (`predictors.m2r2_state_plan`; default: its built-in choice)."""
    if not base_cfg.is_moe:
        raise ConfigError(f"moe offload needs a MoE base model; family {base_cfg.family!r} has n_experts=0")
    mcfg.validate(base_cfg)
    if max_new_tokens <= 0:
        raise ConfigError(f"max_new_tokens={max_new_tokens} is invalid: expected a positive integer")
    L, E, k = base_cfg.n_layers, base_cfg.n_experts, base_cfg.n_experts_per_tok
    visited = F.visited_layers(base_cfg, mcfg)
    b = mcfg.branch_layer
    plan, m2r2_issue = m2r2_state_plan(L, b, visited, m2r2_sources)
    lookaheads = sorted(set(int(a) for a in lookaheads) | {1})
    rows = {"true": [], "m2r2": [], "fast_routes": [], **{f"next_gate@{a}": [] for a in lookaheads}}
    probs = {name: [] for name in rows if name not in ("true", "fast_routes")}
    if forced is not None and len(forced) != len(prompts):
        raise DataError(f"teacher forcing needs one continuation per prompt: {len(forced)} for {len(prompts)} prompts")
    generated = []
    for i, p in enumerate(prompts):
        p = [int(t) for t in p]
        cont = None if forced is None else [int(t) for t in forced[i]][:max_new_tokens]
        if cont is not None and len(cont) < max_new_tokens:
            raise DataError(f"prompt {i + 1}: its continuation has {len(cont)} tokens; teacher forcing needs "
                            f"max_new_tokens={max_new_tokens}")
        if cont is not None and (min(cont) < 0 or max(cont) >= base_cfg.vocab_size):
            raise DataError(f"prompt {i + 1}: a continuation token is outside the vocabulary [0, {base_cfg.vocab_size})")
        if not p:
            raise DataError("a prompt has no tokens")
        if len(p) + max_new_tokens > base_cfg.max_seq_len:
            raise DataError(f"prompt of {len(p)} tokens + {max_new_tokens} new tokens exceeds max_seq_len={base_cfg.max_seq_len}")
        if min(p) < 0 or max(p) >= base_cfg.vocab_size:
            raise DataError(f"a prompt token is outside the vocabulary [0, {base_cfg.vocab_size})")
        cache = T.init_cache(base_cfg, 1, len(p) + max_new_tokens)
        tok, cache = _prefill(base_cfg, base_params, jnp.asarray([p], jnp.int32), cache)
        out = []
        for t in range(max_new_tokens):
            if cont is not None:
                tok = jnp.asarray([cont[t]], jnp.int32)
            out.append(int(tok[0]))
            pos = jnp.full((1, 1), len(p) + t, jnp.int32)
            o, cache = _trace_step(base_cfg, mcfg, base_params, m2r2_params, tok[:, None], pos, cache)
            o = jax.device_get(o)
            true = ranking(o["true"][:, 0])[:, :k]  # [L, k]
            rows["true"].append(true)
            for a in lookaheads:
                lg = np.full((L, E), -np.inf)
                for l in range(a - 1, L):
                    lg[l] = o["slow_cross"][l, l - a + 1, 0]
                _add_guess(rows[f"next_gate@{a}"], probs[f"next_gate@{a}"], lg)
            lg = np.empty((L, E))
            for l, (kind, s) in enumerate(plan):
                if kind == "fast":
                    lg[l] = o["fast_own"][s, 0]
                elif kind == "state":
                    lg[l] = o["fast_cross"][l, s, 0]
                else:
                    lg[l] = o["slow_cross"][l, l, 0]
            _add_guess(rows["m2r2"], probs["m2r2"], lg)
            rows["fast_routes"].append(ranking(o["fast_own"][:, 0])[:, :k])
            tok = jnp.asarray(o["next_token"])
        generated.append(out)
    true = np.stack(rows["true"])
    oracle = ranking_from_true(true, E)
    rankings = {"oracle": oracle, "m2r2": np.stack(rows["m2r2"])}
    trace_probs = {"oracle": oracle_probs(true, E), "m2r2": np.stack(probs["m2r2"])}
    issue = {"oracle": [("attn", 0)] * L, "m2r2": m2r2_issue}
    for a in lookaheads:
        name = "next_gate" if a == 1 else f"next_gate@{a}"
        rankings[name] = np.stack(rows[f"next_gate@{a}"])
        trace_probs[name] = np.stack(probs[f"next_gate@{a}"])
        issue[name] = next_gate_issue(L, a)
    trace = RoutingTrace(
        n_layers=L, n_experts=E, top_k=k, true=true, rankings=rankings, issue=issue,
        uses_fast={"m2r2": True}, fast_steps={"m2r2": fast_steps_needed(plan)}, branch_layer=b, visited=tuple(visited), moe_fast_mlp=mcfg.moe_fast_mlp,
        fast_routes=np.stack(rows["fast_routes"]), probs=trace_probs,
        notes={"m2r2_layers_before_branch": "next_gate (the fast stream branches at layer b)",
               "m2r2_sources": [list(src) for src in plan],
               "hidden_index": "h_m is the input of 0-based layer m (h_0 = embeddings)"},
    )
    return trace.validate(), generated


def _add_guess(rank_rows: list, prob_rows: list, logits: np.ndarray) -> None:
    """Append one token's [L, E] ranking and router probabilities from a predictor's logits
    (rows of -inf: no guess at that layer -> ranking -1, probabilities 0)."""
    guessed = np.isfinite(logits).all(axis=-1)
    safe = np.where(guessed[:, None], logits, 0.0)
    rank_rows.append(np.where(guessed[:, None], ranking(safe), -1))
    prob_rows.append(np.where(guessed[:, None], router_probs(safe), 0.0).astype(np.float32))


def oracle_probs(true: np.ndarray, n_experts: int) -> np.ndarray:
    """The oracle is certain: probability 1 for each truly routed expert, 0 for the rest."""
    out = np.zeros(true.shape[:2] + (n_experts,), np.float32)
    np.put_along_axis(out, np.asarray(true, np.int64), 1.0, axis=-1)
    return out


def ranking_from_true(true: np.ndarray, n_experts: int) -> np.ndarray:
    """Oracle ranking: the true top-k first (in router order), then the rest by index."""
    n, L, k = true.shape
    out = np.empty((n, L, n_experts), np.int64)
    for i in range(n):
        for l in range(L):
            head = list(true[i, l])
            out[i, l] = head + [e for e in range(n_experts) if e not in head]
    return out


def generate_reference(base_cfg, base_params, prompt: Sequence[int], max_new_tokens: int,
                       cache_len: Optional[int] = None) -> list:
    """Plain greedy decoding with `transformer.forward` (the all-resident model)."""
    cache = T.init_cache(base_cfg, 1, cache_len or len(prompt) + max_new_tokens)
    tok, cache = _prefill(base_cfg, base_params, jnp.asarray([list(prompt)], jnp.int32), cache)
    out = []
    for t in range(max_new_tokens):
        out.append(int(tok[0]))
        pos = jnp.full((1, 1), len(prompt) + t, jnp.int32)
        tok, cache = _ref_step(base_cfg, base_params, tok[:, None], pos, cache)
    return out


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(4,))
def _ref_step(base_cfg, base_params, tokens, positions, cache):
    logits, cache = T.forward(base_cfg, base_params, tokens, positions, cache)
    return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache
