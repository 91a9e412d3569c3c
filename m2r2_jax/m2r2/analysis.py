"""Alignment of the slow and fast streams with the model's final output, against compute.

For held-out token batches:
- slow point l (l = 1..N): exit head on h_l; compute = l layers;
- fast point i (i = 1..K): exit head on g_i; compute = b + (i/K) * (draft cost - b) layers
  (the shared layers plus i fast steps with their adapters).
Metrics per point: top-1 agreement with argmax p_slow and cosine of the (unit-RMS) state with h_N.
The paper's central claim: at equal compute the fast curve lies above the slow one.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from m2r2_jax.m2r2 import fast_stream as F
from m2r2_jax.m2r2.config import M2R2Config
from m2r2_jax.models import transformer as T
from m2r2_jax.models.config import ModelConfig


def _cos(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.sum(a * b, -1) / (jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(b, axis=-1) + 1e-6)


@partial(jax.jit, static_argnums=(0, 1))
def _batch_stats(base, mcfg, base_params, m2r2_params, tokens):
    tf = F.train_forward(base, mcfg, base_params, m2r2_params, tokens)
    top = jnp.argmax(tf.slow_logits, -1)
    final = tf.slow_hidden[-1]

    def slow_point(h):
        lg = T.head(base, base_params, h)
        return jnp.sum(jnp.argmax(lg, -1) == top), jnp.sum(_cos(h, final))

    def fast_point(args):
        i, g = args
        lg = F.exit_head_logits(base, mcfg, base_params, m2r2_params, i, g)
        return jnp.sum(jnp.argmax(lg, -1) == top), jnp.sum(_cos(g, final))

    slow = jax.lax.map(slow_point, tf.slow_hidden[1:])
    fast = jax.lax.map(fast_point, (jnp.arange(mcfg.steps(base)), tf.states))
    return slow, fast


def alignment(base: ModelConfig, mcfg: M2R2Config, base_params, m2r2_params, batches) -> dict:
    """batches: iterable of int32 [B, T] token arrays. Returns the JSON-ready alignment record."""
    slow_hits = fast_hits = slow_cos = fast_cos = 0.0
    count = 0
    for tokens in batches:
        (sh, sc), (fh, fc) = jax.device_get(_batch_stats(base, mcfg, base_params, m2r2_params, jnp.asarray(tokens)))
        slow_hits, slow_cos = slow_hits + sh, slow_cos + sc
        fast_hits, fast_cos = fast_hits + fh, fast_cos + fc
        count += int(np.prod(tokens.shape))
    if count == 0:
        raise ValueError("alignment needs at least one non-empty batch")
    k = mcfg.steps(base)
    b = mcfg.branch_layer
    draft = F.draft_cost_layers(base, mcfg)
    fast_cost = [b + (i + 1) / k * (draft - b) for i in range(k)]
    return {
        "slow_agreement": (np.asarray(slow_hits) / count).tolist(),
        "fast_agreement": (np.asarray(fast_hits) / count).tolist(),
        "slow_cosine": (np.asarray(slow_cos) / count).tolist(),
        "fast_cosine": (np.asarray(fast_cos) / count).tolist(),
        "slow_cost": [float(l) for l in range(1, base.n_layers + 1)],
        "fast_cost": [float(c) for c in fast_cost],
        "visited_layers": [j + 1 for j in F.visited_layers(base, mcfg)],
        "branch_layer": b,
        "tokens": count,
    }


def slow_agreement_at(record: dict, cost: float) -> float:
    """Slow-stream agreement at a given compute, linearly interpolated between layers (0 layers:
    agreement 0)."""
    xs = [0.0] + record["slow_cost"]
    ys = [0.0] + record["slow_agreement"]
    return float(np.interp(cost, xs, ys))


def fast_beats_slow(record: dict) -> list[bool]:
    """Per fast step: is the fast agreement above the slow agreement at equal compute?"""
    return [fa > slow_agreement_at(record, c) for fa, c in zip(record["fast_agreement"], record["fast_cost"])]


def plot_alignment(record: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "agreement", "top-1 agreement with final output"), (axes[1], "cosine", "cosine with final state")):
        ax.plot(record["slow_cost"], record[f"slow_{key}"], "o-", label="slow stream (distance)")
        ax.plot(record["fast_cost"], record[f"fast_{key}"], "s-", label=f"fast stream (velocity, b={record['branch_layer']})")
        ax.set_xlabel("compute (layer equivalents)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("M2R2 early residual alignment")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
