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

import jax
import jax.numpy as jnp
import numpy as np

from m2r2_jax.errors import ConfigError
from m2r2_jax.models.layers import rms_norm
from m2r2_jax.moe_offload.trace import next_gate_issue

PREDICTORS = ("none", "next_gate", "m2r2", "oracle")


def check_predictor(name: str) -> str:
    if name not in PREDICTORS:
        raise ConfigError(f"predictor {name!r} is invalid: expected one of {', '.join(PREDICTORS)}")
    return name


def cross_router_logits(base_cfg, base_params, hidden: jax.Array) -> jax.Array:
    """[L, M, ..., E]: layer l's router applied to (layer l's MLP pre-norm of) state m.

    hidden: [M, ..., d] candidate states (slow hidden states, fast states)."""
    lay = base_params["layers"]
    scales = lay["mlp_norm"]["scale"]  # [L, d]
    kernels = lay["mlp"]["router"]["kernel"]  # [L, d, E]
    unit = rms_norm(hidden, jnp.ones((hidden.shape[-1],), hidden.dtype), base_cfg.rms_eps)
    normed = unit[None] * scales.reshape((scales.shape[0],) + (1,) * (hidden.ndim - 1) + (-1,)).astype(unit.dtype)
    return jnp.einsum("lm...d,lde->lm...e", normed, kernels.astype(normed.dtype)).astype(jnp.float32)


def ranking(logits: np.ndarray) -> np.ndarray:
    """Experts ranked best-first along the last axis (ties: lower index first, deterministic)."""
    return np.argsort(-np.asarray(logits, np.float64), axis=-1, kind="stable")


def m2r2_state_plan(n_layers: int, branch_layer: int, visited: tuple) -> tuple:
    """For each layer, how the m2r2 predictor guesses it: ("fast", i) = step i's own router,
    ("state", s) = layer's router on fast state s (0 = g_0), ("next_gate", None) before the branch.
    Plus the issue key of each layer."""
    targets = [branch_layer] + [j + 1 for j in visited]  # input index each fast state approximates
    k = len(visited)
    plan, issue = [], []
    ng_issue = next_gate_issue(n_layers, 1)
    for l in range(n_layers):
        if l < branch_layer:
            plan.append(("next_gate", None))
            issue.append(ng_issue[l])
        elif l in visited:
            i = visited.index(l)
            plan.append(("fast", i))
            issue.append(("fast_mlp", i))
        else:
            s = max(i for i, t in enumerate(targets) if t <= l)
            plan.append(("state", s))
            issue.append(("fast_attn", s) if s < k else ("attn", branch_layer))
    return tuple(plan), issue
