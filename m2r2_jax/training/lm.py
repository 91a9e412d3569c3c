"""Next-token language modelling on packed [B, T+1] token batches (base-model pre-training)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from m2r2_jax.models.config import ModelConfig
from m2r2_jax.models.transformer import forward


def next_token_loss(cfg: ModelConfig, params, tokens: jax.Array):
    """Mean cross-entropy of tokens[:, 1:] given tokens[:, :-1]; returns (loss, accuracy)."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits, _ = forward(cfg, params, inputs)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    acc = jnp.mean((jnp.argmax(logits, -1) == targets).astype(jnp.float32))
    return jnp.mean(nll), acc


def lm_loss_fn(cfg: ModelConfig):
    """A `train()` loss: all parameters trainable, nothing frozen, no randomness."""

    def loss_fn(trainable, frozen, batch, rng):
        del frozen, rng
        loss, acc = next_token_loss(cfg, trainable, batch)
        return loss, {"accuracy": acc}

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
