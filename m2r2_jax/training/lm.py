"""Next-token language modelling on packed [B, T+1] token batches (base-model pre-training).

MoE models can add the Switch Transformer / Mixtral load-balancing loss (`moe_balance_loss`):
without it a briefly trained router collapses onto a few experts, which makes expert caching
look easier than it is for real MoEs (all of which are trained with such a loss).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from m2r2_jax.models.config import ModelConfig
from m2r2_jax.models.layers import route
from m2r2_jax.models.transformer import forward


def _token_nll(logits, targets):
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    acc = jnp.mean((jnp.argmax(logits, -1) == targets).astype(jnp.float32))
    return jnp.mean(nll), acc


def next_token_loss(cfg: ModelConfig, params, tokens: jax.Array):
    """Mean cross-entropy of tokens[:, 1:] given tokens[:, :-1]; returns (loss, accuracy)."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits, _ = forward(cfg, params, inputs)
    return _token_nll(logits, targets)


def moe_balance_loss(cfg: ModelConfig, router_logits: jax.Array):
    """Load-balancing loss of one batch's routing and routing statistics.

    router_logits: [L, B, T, E] (as `ForwardAux.router_logits`). Per layer the loss is
    E * sum_e f_e * P_e, with f_e the fraction of (token, top-k slot) assignments that go to
    expert e (counted with the model's own top-k, so it is what the experts really receive) and
    P_e the mean router probability of e; averaged over layers. It is 1 when the probabilities are
    uniform and grows to E / k when every token picks the same k experts with certainty. f_e is a
    count and carries no gradient; the router learns through P_e.

    Returns (loss, stats): stats["router_entropy"] is the mean entropy (nats) of a token's
    router distribution, stats["expert_load_max"] the busiest expert's load relative to an even
    split (f_e * E, max over experts, mean over layers: 1 = balanced, E / k = collapsed)."""
    L, E, k = router_logits.shape[0], cfg.n_experts, cfg.n_experts_per_tok
    logits = router_logits.reshape(L, -1, E).astype(jnp.float32)  # [L, N, E]
    probs = jax.nn.softmax(logits, axis=-1)
    _, idx = route(cfg, logits)  # [L, N, k]
    counts = jnp.sum(jax.nn.one_hot(idx, E, dtype=jnp.float32), axis=(1, 2))  # [L, E]
    frac = jax.lax.stop_gradient(counts / (idx.shape[1] * k))
    mean_prob = jnp.mean(probs, axis=1)  # [L, E]
    per_layer = E * jnp.sum(frac * mean_prob, axis=-1)
    entropy = -jnp.sum(probs * jax.nn.log_softmax(logits, axis=-1), axis=-1)
    stats = {"router_entropy": jnp.mean(entropy), "expert_load_max": jnp.mean(jnp.max(frac, axis=-1) * E)}
    return jnp.mean(per_layer), stats


def lm_loss_and_metrics(cfg: ModelConfig, params, tokens: jax.Array, moe_aux_loss_coef: float = 0.0):
    """(loss, metrics): next-token cross-entropy plus, for MoE models, coef x the balance loss.
    MoE models always report `aux_loss` (unscaled), `router_entropy` and `expert_load_max`, so a
    run without the loss shows how unbalanced its routing gets; `lm_loss` is the cross-entropy."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if not cfg.is_moe:
        logits, _ = forward(cfg, params, inputs)
        loss, acc = _token_nll(logits, targets)
        return loss, {"accuracy": acc}
    logits, _, aux = forward(cfg, params, inputs, return_aux=True)
    lm, acc = _token_nll(logits, targets)
    balance, stats = moe_balance_loss(cfg, aux.router_logits)
    loss = lm + moe_aux_loss_coef * balance if moe_aux_loss_coef > 0 else lm
    return loss, {"accuracy": acc, "lm_loss": lm, "aux_loss": balance, **stats}


def lm_loss_fn(cfg: ModelConfig, moe_aux_loss_coef: float = 0.0):
    """A `train()` loss: all parameters trainable, nothing frozen, no randomness.
    `moe_aux_loss_coef` (train.moe_aux_loss_coef) weighs the MoE load-balancing loss."""
    coef = float(moe_aux_loss_coef)

    def loss_fn(trainable, frozen, batch, rng):
        del frozen, rng
        return lm_loss_and_metrics(cfg, trainable, batch, coef)

    return loss_fn


def evaluate(cfg: ModelConfig, params, examples: np.ndarray, batch_size: int, max_batches: int = 0) -> dict:
    """Mean loss / accuracy over packed examples (in order; the last partial batch is dropped)."""
    fn = jax.jit(lambda p, b: next_token_loss(cfg, p, b))
    n = len(examples) // batch_size
    if max_batches:
        n = min(n, max_batches)
    if n == 0:
        return {}
    losses, accs = [], []
    for i in range(n):
        loss, acc = fn(params, jnp.asarray(examples[i * batch_size:(i + 1) * batch_size]))
        losses.append(float(loss))
        accs.append(float(acc))
    return {"loss": float(np.mean(losses)), "accuracy": float(np.mean(accs)), "batches": n}
