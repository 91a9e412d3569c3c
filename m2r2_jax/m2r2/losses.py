"""Self-distillation loss for the M2R2 parameters (method page, section 7).

    L = sum_i w_i [ T^2 KL(p_slow^T || p_fast_i^T) + lambda_align (1 - cos(Norm g_i, Norm h_{j_i})) ]
        + lambda_router [ BCE(router_i, label_i) + BCE(step_mlp_i, label_i) ]
        (+ lambda_router BCE(later_i, max_{j > i} label_j) for i < K - 1 with m2r2.router_give_up)

label_i = 1[argmax Head(g_i) == argmax p_slow]. The deciders see stop-gradient copies of the fast
states, so their loss never pulls on the adapters; which subtree actually learns is decided by what
the training loop passes as trainable (stage "stream", stage "router", or "joint").
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import optax

from m2r2_jax.errors import ConfigError
from m2r2_jax.m2r2 import fast_stream as F
from m2r2_jax.m2r2.config import M2R2Config
from m2r2_jax.m2r2.router import step_scalars
from m2r2_jax.models import transformer as T
from m2r2_jax.models.config import ModelConfig

STREAM_KEYS = ("adapters", "rates", "exit_norm", "moe_lowrank")
DECIDER_KEYS = ("router", "step_mlp")
STAGES = ("stream", "router", "joint")
ROUTING_LAYERS = ("visited", "predicted")
REMAT_LOGITS_BYTES = 1 << 30  # the fast stream's logits at every step kept for the backward pass up to this


@dataclasses.dataclass(frozen=True)
class LossConfig:
    temperature: float = 1.0
    lambda_align: float = 0.1
    lambda_router: float = 1.0
    step_weights: str = "uniform"  # uniform | increasing
    # MoE bases: KL from the slow stream's routing at each visited layer to the routing the fast
    # stream's own MLP input gets there, so the fast state also predicts which experts load (0: off)
    lambda_routing: float = 0.0
    # which layers that term covers: "visited" (the fast steps' own MLP inputs only) or "predicted"
    # (also every skipped layer after the branch, through its router on the fast state standing for
    # its input, `fast_stream.skipped_layer_states`: the guess the offload predictor makes there)
    routing_layers: str = "predicted"
    # fraction of each sequence's positions the vocabulary-sized terms (KL, decider labels) score,
    # drawn afresh every step: the LM heads and softmaxes over the vocabulary cost far more than
    # the fast stream itself at real vocabularies (49k: ~0.6 of a step), and positions within one
    # sequence carry correlated signal
    kl_fraction: float = 1.0

    def validate(self) -> "LossConfig":
        if not self.temperature > 0:
            raise ConfigError(f"loss.temperature={self.temperature!r} is invalid: expected > 0")
        for name in ("lambda_align", "lambda_router", "lambda_routing"):
            if getattr(self, name) < 0:
                raise ConfigError(f"loss.{name}={getattr(self, name)!r} is invalid: expected >= 0")
        if self.step_weights not in ("uniform", "increasing"):
            raise ConfigError(f"loss.step_weights={self.step_weights!r} is invalid: expected uniform or increasing")
        if not (0.0 < self.kl_fraction <= 1.0):
            raise ConfigError(f"loss.kl_fraction={self.kl_fraction!r} is invalid: expected a fraction in (0, 1]")
        if self.routing_layers not in ROUTING_LAYERS:
            raise ConfigError(f"loss.routing_layers={self.routing_layers!r} is invalid: expected "
                              f"{' or '.join(ROUTING_LAYERS)}")
        return self


def split_params(m2r2_params: dict, stage: str) -> tuple[dict, dict]:
    """(trainable, frozen) subtrees of the M2R2 parameters for a training stage."""
    if stage not in STAGES:
        raise ConfigError(f"distill.stage={stage!r} is invalid: expected one of {', '.join(STAGES)}")
    keys = {"stream": STREAM_KEYS, "router": DECIDER_KEYS, "joint": STREAM_KEYS + DECIDER_KEYS}[stage]
    trainable = {k: v for k, v in m2r2_params.items() if k in keys}
    frozen = {k: v for k, v in m2r2_params.items() if k not in keys}
    return trainable, frozen


def later_labels(labels: jax.Array) -> jax.Array:
    """[K, ...] per-step "exiting here is safe" labels -> [K - 1, ...]: is some step after i safe
    (the give-up output's target)."""
    after = jax.lax.cummax(labels[::-1], axis=0)[::-1]  # after[i] = max over steps >= i
    return after[1:]


def _step_weights(k: int, kind: str) -> jax.Array:
    w = jnp.ones((k,)) if kind == "uniform" else jnp.arange(1, k + 1, dtype=jnp.float32)
    return w / jnp.sum(w)


def _cosine(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.sum(a * b, -1) / (jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(b, axis=-1) + 1e-6)


def kl_positions(lcfg: LossConfig, length: int, rng) -> Optional[jax.Array]:
    """Sorted positions [n] the KL and decider terms score this step: a random `kl_fraction` of
    the sequence (the same for every row), or None for all of them (no rng, or fraction 1)."""
    if rng is None or lcfg.kl_fraction >= 1.0:
        return None
    n = max(1, int(round(length * lcfg.kl_fraction)))
    return jnp.sort(jax.random.permutation(rng, length)[:n])


def distill_loss(base: ModelConfig, mcfg: M2R2Config, lcfg: LossConfig, base_params, m2r2_params, tokens,
                 rng=None, *, deciders: bool = True, teacher: Optional[F.Teacher] = None,
                 vocab: Optional[dict] = None):
    """Returns (loss, metrics). metrics hold per-step agreement/KL/alignment as [K] arrays.

    The fast stream runs over every position (its attention needs them all) and the alignment
    term covers them all; the vocabulary-sized work (both LM heads, the softmaxes, the KL, the
    deciders' labels) is done at `kl_positions` only: with `loss.kl_fraction` 0.25 and a 49k
    vocabulary that is most of a step's cost. `deciders=False` (the stream stage, whose trainable
    parameters the decider terms never reach) leaves those terms and their inputs out.

    `teacher`: the frozen base's outputs for `tokens` computed beforehand (`fast_stream.Teacher`,
    e.g. once for a whole data set: `distill`'s `teacher_cache`); the loss is the same as when
    they are computed here. Routing distillation (MoE bases) needs every layer's routing and
    always runs the base here.

    `vocab` {"ids", "kernel"} (`models.transformer.head_kernel_columns`): the draft vocabulary the
    drafter will score (`m2r2 draft-vocab`). Both heads then score only those tokens: the KL is
    between the two distributions renormalised over the subset, which is the draft head's own
    distribution, and the agreement metrics compare argmaxes within the subset (they exceed
    gamma-1 acceptance by at most the share of positions whose full-vocabulary argmax falls
    outside it). At Gemma 3's 262,144 tokens and an 8,192-token subset the heads' work drops
    32x. Deciders learn from full-vocabulary logits (m2r2_exit's), so they cannot be on here."""
    if vocab is not None and deciders:
        raise ConfigError("a draft vocabulary trains the fast stream only: the deciders (router, step MLP) "
                          "learn from full-vocabulary logits, in their own stage")
    k = mcfg.steps(base)
    base_params = jax.lax.stop_gradient(base_params)  # frozen: no gradient path into the base
    tf = None
    if lcfg.lambda_routing > 0 and base.is_moe:
        if teacher is not None:
            raise ConfigError("a precomputed teacher does not hold the routing that loss.lambda_routing distils")
        tf = F.train_forward(base, mcfg, base_params, m2r2_params, tokens, slow_logits=False)
        teacher = F.Teacher(tf.g0, tf.slow_hidden[jnp.asarray(F.visited_layers(base, mcfg)) + 1], tf.slow_hidden[-1],
                            None, None)
        fast_states = tf.states
    else:
        teacher = F.teacher_outputs(base, mcfg, base_params, tokens) if teacher is None else teacher
        fast_states = F.fast_train_states(base, mcfg, base_params, m2r2_params, teacher)
    idx = kl_positions(lcfg, tokens.shape[1], rng)

    def pick(x):  # [..., T, d] -> [..., n, d]
        return x if idx is None else jnp.take(x, idx, axis=-2)

    temp = lcfg.temperature
    compact = vocab is not None
    slow_logits = jax.lax.stop_gradient(T.head(base, base_params, pick(teacher.final), vocab=vocab, compact=compact))
    logp_slow = jax.nn.log_softmax(slow_logits / temp, axis=-1)
    p_slow = jnp.exp(logp_slow)
    top_slow = jnp.argmax(slow_logits, axis=-1)
    align = jnp.mean(1.0 - _cosine(F.normalize(base, fast_states), F.normalize(base, teacher.targets)), axis=(1, 2))
    states = pick(fast_states)
    prevs = jnp.concatenate([pick(teacher.g0)[None], states[:-1]], axis=0)

    def per_step(args):
        i, g, gp = args
        lg = F.exit_head_logits(base, mcfg, base_params, m2r2_params, i, g, vocab=vocab, compact=compact)
        kl = jnp.mean(jnp.sum(p_slow * (logp_slow - jax.nn.log_softmax(lg / temp, axis=-1)), -1)) * temp**2
        label = (jnp.argmax(lg, -1) == top_slow).astype(jnp.float32)
        scalars = jax.lax.stop_gradient(step_scalars(mcfg.router_features, lg, g, gp)) if deciders else None
        return kl, label, scalars

    # Rematerialised when large: the backward pass then recomputes one step's [B, n, V] logits
    # instead of keeping all K of them (at a 128k vocabulary they dominate the step's memory);
    # when they fit, keeping them saves a third of the heads' work.
    n_vocab = base.vocab_size if vocab is None else vocab["ids"].shape[0]
    if k * states.shape[1] * states.shape[2] * n_vocab * 4 > REMAT_LOGITS_BYTES:
        per_step = jax.checkpoint(per_step)
    kl, labels, scalars = jax.lax.map(per_step, (jnp.arange(k), states, prevs))
    w = _step_weights(k, lcfg.step_weights)
    loss = jnp.sum(w * (kl + lcfg.lambda_align * align))
    routing_kl = skipped_kl = None
    if tf is not None and tf.moe_router_logits is not None:
        routing_kl = _routing_kl(tf.slow_router_logits[jnp.asarray(F.visited_layers(base, mcfg))], tf.moe_router_logits)
        loss = loss + lcfg.lambda_routing * jnp.sum(w * routing_kl)
        pairs = F.skipped_layer_states(base, mcfg) if lcfg.routing_layers == "predicted" else ()
        if pairs:
            skipped_kl = _skipped_routing_kl(base, base_params, tf, pairs)
            loss = loss + lcfg.lambda_routing * jnp.mean(skipped_kl)
    labels = jax.lax.stop_gradient(labels)
    metrics = {
        "kl": jnp.sum(w * kl),
        "align": jnp.sum(w * align),
        "agreement_last": jnp.mean(labels[-1]),
        "agreement_per_step": jnp.mean(labels, axis=(1, 2)),
    }
    if deciders:  # on stop-gradient states: their loss never pulls on the adapters
        states_sg = jax.lax.stop_gradient(states)
        z = jax.vmap(lambda i, g: F.router_project(base, mcfg, m2r2_params, i, g))(jnp.arange(k), states_sg)
        router_logits = jax.vmap(lambda i, s: F.router_score(base, mcfg, m2r2_params, z, i, s))(jnp.arange(k), scalars)
        mlp_logits = jax.vmap(lambda i, g: F.step_mlp_logit(base, mcfg, m2r2_params, i, g))(jnp.arange(k), states_sg)
        bce_router = jnp.mean(optax.sigmoid_binary_cross_entropy(router_logits, labels))
        bce_mlp = jnp.mean(optax.sigmoid_binary_cross_entropy(mlp_logits, labels))
        loss = loss + lcfg.lambda_router * (bce_router + bce_mlp)
        metrics.update(router_bce=bce_router, step_mlp_bce=bce_mlp,
                       router_acc=jnp.mean(((router_logits > 0) == (labels > 0.5)).astype(jnp.float32)))
        if mcfg.router_give_up and k > 1:  # the last step has no later one: nothing to predict there
            later = later_labels(labels)
            later_logits = jax.vmap(lambda i, s: F.router_later(base, mcfg, m2r2_params, z, i, s))(
                jnp.arange(k - 1), scalars[:-1])
            bce_later = jnp.mean(optax.sigmoid_binary_cross_entropy(later_logits, later))
            loss = loss + lcfg.lambda_router * bce_later
            metrics.update(later_bce=bce_later,
                           later_acc=jnp.mean(((later_logits > 0) == (later > 0.5)).astype(jnp.float32)))
    if routing_kl is not None:
        metrics["routing_kl"] = jnp.sum(w * routing_kl)
    if skipped_kl is not None:
        metrics["routing_kl_skipped"] = jnp.mean(skipped_kl)
    return loss, metrics


def _skipped_routing_kl(base: ModelConfig, base_params, tf, pairs) -> jax.Array:
    """[P] KL(slow routing || layer l's router on fast state g_s) for each (l, s) in `pairs`
    (s >= 1). A skipped layer has no fast step of its own: the offload predictor guesses its experts
    from the state standing for its input, and nothing else in the loss makes that state carry the
    directions this layer's router reads (alignment is a cosine over all of d)."""
    slow = jnp.stack([tf.slow_router_logits[l] for l, _ in pairs])
    fast = jnp.stack([T.layer_router_logits(base, base_params, l, tf.states[s - 1]) for l, s in pairs])
    return _routing_kl(slow, fast)


def _routing_kl(slow_logits, fast_logits) -> jax.Array:
    """[K] mean KL(slow routing || fast routing) over tokens, per layer ([K, B, T, E] each)."""
    logp_slow = jax.nn.log_softmax(slow_logits.astype(jnp.float32), axis=-1)
    logp_fast = jax.nn.log_softmax(fast_logits.astype(jnp.float32), axis=-1)
    return jnp.mean(jnp.sum(jnp.exp(logp_slow) * (logp_slow - logp_fast), -1), axis=(1, 2))
