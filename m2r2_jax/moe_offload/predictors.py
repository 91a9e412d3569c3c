"""Expert predictors behind one interface: a ranking of experts per layer and an issue point.

Every predictor turns what is known at some point of a token's decode into, for each MoE layer l,
the experts ranked by the router logits it computed, and the op before which that guess exists
(the issue key, see `trace.py`). All predictors are evaluated from the same decode step:

  none       no guess: experts are loaded on demand.
  next_gate  layer l's router on the previous layer's output (layer l+1's router on h_l in
             1-based terms), issued right after layer l-1 (for layer 0: on the embeddings);
             `next_gate@a` uses the output of layer l-a (lookahead a layers).
             Index convention here: h_m is the input of 0-based layer m, h_0 the embeddings.
  m2r2       the fast stream: at a visited layer j_i, layer j_i's router on the fast state inside
             step i (`fast_forward(..., collect=True).moe_router_logits`), issued during step i;
             at a layer l >= b the fast stream skips, layer l's router on the fast state whose
             target is l's input (g_0 = h_b, g_i ~ output of layer j_i), issued once that state
             exists. Layers l < b run before the fast stream branches off, so the m2r2 predictor
             uses next-gate there (said in every report).
  oracle     the slow stream's own routing, known at the start of the token: an upper bound.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from m2r2_jax.errors import ConfigError
from m2r2_jax.m2r2.fast_stream import state_for_layer, train_forward, visited_layers
from m2r2_jax.models.transformer import layer_router_logits
from m2r2_jax.moe_offload.trace import next_gate_issue

PREDICTORS = ("none", "next_gate", "m2r2", "oracle")


def check_predictor(name: str) -> str:
    if name not in PREDICTORS:
        raise ConfigError(f"predictor {name!r} is invalid: expected one of {', '.join(PREDICTORS)}")
    return name


def cross_router_logits(base_cfg, base_params, hidden: jax.Array) -> jax.Array:
    """[L, M, ..., E]: layer l's router applied to (layer l's MLP pre-norm of) state m.

    hidden: [M, ..., d] candidate states (slow hidden states, fast states)."""
    return jnp.stack([layer_router_logits(base_cfg, base_params, l, hidden) for l in range(base_cfg.n_layers)])


def ranking(logits: np.ndarray) -> np.ndarray:
    """Experts ranked best-first along the last axis (ties: lower index first, deterministic)."""
    return np.argsort(-np.asarray(logits, np.float64), axis=-1, kind="stable")


def router_probs(logits: np.ndarray) -> np.ndarray:
    """Softmax over the experts (last axis), computed on the host in float64, returned float32."""
    z = np.asarray(logits, np.float64)
    z = np.exp(z - z.max(axis=-1, keepdims=True))
    return (z / z.sum(axis=-1, keepdims=True)).astype(np.float32)


def check_min_confidence(value: float) -> float:
    if not value >= 0:  # also rejects NaN
        raise ConfigError(f"min_confidence={value} is invalid: expected a number >= 0 (0: prefetch every guess)")
    return float(value)


def guess_confidence(probs: np.ndarray, ranked: np.ndarray, top_k: int) -> np.ndarray:
    """[E] how sure a guess is that each expert is among the top-k: its router probability over that
    of the best expert left out of the guess (rank k+1). The raw probability is a poor signal for a
    load-balanced router, whose probabilities sit near 1/E; the margin over the first expert left out
    is what decides membership (measured on the demo's trace: guesses with a ratio >= 1.25 were
    right 92-100% of the time, against 61-77% below 1.1). Certain guesses (the oracle) get inf."""
    runner_up = float(probs[ranked[top_k]]) if top_k < len(ranked) and ranked[top_k] >= 0 else 0.0
    with np.errstate(divide="ignore"):
        return np.where(runner_up > 0, probs / max(runner_up, 1e-30), np.inf)


def m2r2_state_plan(n_layers: int, branch_layer: int, visited: tuple, sources=None) -> tuple:
    """For each layer, how the m2r2 predictor guesses it: ("fast", i) = step i's own router,
    ("state", s) = layer's router on fast state s (0 = g_0 = h_b), ("next_gate", None) before the
    branch. Plus the issue key of each layer.

    Default sources: a visited layer uses its step's own router; a skipped layer uses the last fast
    state whose target is at or before it. `sources` (one per layer, e.g. from
    `choose_m2r2_sources`) replaces that choice; every fast state exists by the end of the fast
    pass, so any source keeps the lead of the fast stream. The pass stops after the last step the
    sources need (`fast_steps_needed`); a state that step produces is issued when the pass ends."""
    if sources is None:
        sources = []
        for l in range(n_layers):
            if l < branch_layer:
                sources.append(("next_gate", None))
            elif l in visited:
                sources.append(("fast", visited.index(l)))
            else:
                sources.append(("state", state_for_layer(branch_layer, visited, l)))
    plan = tuple((str(kind), None if i is None else int(i)) for kind, i in sources)
    check_m2r2_sources(plan, n_layers, branch_layer, visited)
    depth = fast_steps_needed(plan)  # the fast pass stops after the last step a source needs
    ng_issue = next_gate_issue(n_layers, 1)
    issue = []
    for l, (kind, i) in enumerate(plan):
        if kind == "next_gate":
            issue.append(ng_issue[l])
        elif kind == "fast":
            issue.append(("fast_mlp", i))
        else:  # state i exists once step i-1 is done (g_0 before the first step)
            issue.append(("fast_attn", i) if i < depth else ("attn", branch_layer))
    return plan, issue


def source_steps(source) -> int:
    """Fast steps that must run before a source exists: ("fast", i) is read inside step i, so steps
    0..i; ("state", s) is g_s, the output of steps 0..s-1 (g_0 = h_b needs none)."""
    kind, i = source
    return i + 1 if kind == "fast" else i if kind == "state" else 0


def fast_steps_needed(plan) -> int:
    """How many fast steps the m2r2 predictor runs per token for `plan`: up to the last step any of
    its sources needs. Steps after that would only cost compute."""
    return max((source_steps(src) for src in plan), default=0)


def check_m2r2_sources(plan, n_layers: int, branch_layer: int, visited: tuple) -> None:
    if len(plan) != n_layers:
        raise ConfigError(f"m2r2 predictor sources list {len(plan)} layers; the model has {n_layers}")
    for l, (kind, i) in enumerate(plan):
        ok = ((kind == "next_gate" and l < branch_layer)
              or (kind == "fast" and l >= branch_layer and i is not None and 0 <= i < len(visited) and visited[i] == l)
              or (kind == "state" and l >= branch_layer and i is not None and 0 <= i <= len(visited)))
        if not ok:
            raise ConfigError(f"m2r2 predictor source {(kind, i)!r} for layer {l} is invalid: layers before the "
                              f"branch ({branch_layer}) use ('next_gate', None); later layers use ('fast', i) at "
                              f"the layer step i visits (visited: {list(visited)}) or ('state', s), 0 <= s <= {len(visited)}")


def source_candidates(n_layers: int, branch_layer: int, visited: tuple) -> list:
    """Every source each layer could be guessed from (see `m2r2_state_plan`)."""
    out = []
    for l in range(n_layers):
        if l < branch_layer:
            out.append([("next_gate", None)])
            continue
        own = [("fast", visited.index(l))] if l in visited else []
        out.append(own + [("state", s) for s in range(len(visited) + 1)])
    return out


def choose_m2r2_sources(base_cfg, base_params, mcfg, m2r2_params, sequences, recall_tolerance: float = 0.0) -> tuple:
    """Pick, per layer, the source whose top-k guess recalls the most of the true routing on
    `sequences` (token lists, teacher-forced in one pass of `train_forward`, whose fast steps see
    what they see when decoding). Layer l's router often reads a fast state other than the one
    aimed at layer l better (a skipped layer may route like a visited one). Returns (sources,
    {layer: {source: recall}}); ties keep the default source, then the source needing fewer steps.
    The fast pass runs only the steps the chosen sources need (`fast_steps_needed`): the choice is
    the shortest pass whose mean recall after the branch is within `recall_tolerance` of the best
    (0: only steps that add no recall are dropped). Use text apart from any trace being scored, or
    the choice is fitted to it."""

    if not 0.0 <= recall_tolerance < 1.0:
        raise ConfigError(f"recall_tolerance={recall_tolerance} is invalid: expected a number in [0, 1)")
    rows = [list(map(int, s)) for s in sequences if len(s) > 0]
    if not rows:
        raise ConfigError("choosing the m2r2 predictor's sources needs at least one non-empty sequence")
    L, k = base_cfg.n_layers, base_cfg.n_experts_per_tok
    b, visited = mcfg.branch_layer, tuple(visited_layers(base_cfg, mcfg))
    hits = [{} for _ in range(L)]  # per layer: source -> (experts recalled, experts routed)
    for length in sorted({len(r) for r in rows}):  # one compile per distinct length
        batch = jnp.asarray([r for r in rows if len(r) == length], jnp.int32)
        true_l, cross, own = (np.asarray(a) for a in _source_logits(base_cfg, mcfg, base_params, m2r2_params, batch))
        true = _top_k_sets(true_l, k)  # [L, B, T, k]
        for l, cands in enumerate(source_candidates(L, b, visited)):
            for kind, i in cands:
                if kind == "next_gate":
                    continue
                guess = _top_k_sets(own[i] if kind == "fast" else cross[l, i], k)  # [B, T, k]
                got = int((guess[..., :, None] == true[l][..., None, :]).any(-1).sum())
                h, n = hits[l].get((kind, i), (0, 0))
                hits[l][(kind, i)] = (h + got, n + true[l].size)
    recall = {l: {src: h / n for src, (h, n) in hits[l].items()} for l in range(L)}
    by_steps = sources_by_fast_steps(recall, L, b, visited)
    best = by_steps[-1][1]
    sources = next(src for src, mean in by_steps if mean >= best - recall_tolerance - 1e-12)
    return sources, recall


def sources_by_fast_steps(recall: dict, n_layers: int, branch_layer: int, visited: tuple) -> list:
    """[(sources, mean recall after the branch)] for a fast pass of 0, 1, ..., K steps: each layer's
    best source among those that exist after that many steps (`recall`: {layer: {source: recall}},
    as `choose_m2r2_sources` returns it)."""
    default, _ = m2r2_state_plan(n_layers, branch_layer, visited)
    out = []
    for steps in range(len(visited) + 1):
        chosen = []
        for l in range(n_layers):
            table = {src: r for src, r in recall.get(l, {}).items() if source_steps(src) <= steps}
            if not table:  # before the branch (next-gate), or no candidate scored
                chosen.append(default[l] if source_steps(default[l]) <= steps else ("state", 0))
                continue
            chosen.append(max(table, key=lambda src: (table[src], src == default[l], -source_steps(src))))
        after = [recall[l][chosen[l]] for l in range(branch_layer, n_layers) if chosen[l] in recall.get(l, {})]
        out.append((tuple(chosen), float(np.mean(after)) if after else 0.0))
    return out


@functools.partial(jax.jit, static_argnums=(0, 1))
def _source_logits(base_cfg, mcfg, base_params, m2r2_params, tokens):
    """Router logits of every source over whole sequences: (true [L, B, T, E], cross [L, K+1, B, T, E]
    on g_0..g_K, own [K, B, T, E])."""
    tf = train_forward(base_cfg, mcfg, base_params, m2r2_params, tokens)
    states = jnp.concatenate([tf.g0[None], tf.states], axis=0)
    return tf.slow_router_logits, cross_router_logits(base_cfg, base_params, states), tf.moe_router_logits


def _top_k_sets(logits: np.ndarray, k: int) -> np.ndarray:
    """[..., E] logits -> [..., k] experts (same tie rule as `ranking`)."""
    return ranking(logits)[..., :k]
