"""Exit deciders: the M2R2 router (ARLA) and the distance-based baselines behind one interface.

ARLA ("accelerated-residual latent attention"): at fast step i the router sees low-dimensional
projections z_1..z_i of the fast states (z = P Norm(g) + step embedding) and cheap scalars of step
i: with `router_features="logits"` the max softmax probability and normalised entropy of the
step's exit head, and the relative velocity |g_i - g_{i-1}| / |g_{i-1}|; with "state" the velocity
alone. One causal single-head attention of z_i over z_1..z_i, then a small MLP, gives the logit of
"exiting here is safe". Every decider maps step information to a score in [0, 1]; a decider with
threshold tau fires when score >= tau.

Giving up (`give_up=True`): a second output of the same hidden layer, the logit of "some LATER step
will be safe". A token whose router neither fires at step i nor expects a later step to (its
probability below tau too: each later step's own probability of being safe is at most that of any
later step being safe) stops its fast stream there and finishes in the slow stream, so a token that
will not exit pays for the few fast steps it tried, not all K.

Why "state": the head's two scalars need the vocabulary-wide head at every fast step, which on a
model whose head is a fifth of its weights (SmolLM2: 113 of 538 MB) costs more than the step's
layer; reading the state alone, an early exit computes the head only for the tokens that leave.
"""

from __future__ import annotations

import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from m2r2_jax.models.layers import RMSNorm

N_SCALARS = {"logits": 3, "state": 1}  # per router_features
DECIDERS = ("router", "confidence", "saturation", "step_mlp")


def step_scalars(features: str, logits: Optional[jax.Array], g: jax.Array, g_prev: jax.Array) -> jax.Array:
    """The router's scalars of a step, [..., N_SCALARS[features]]: "logits": max probability,
    entropy / log(V) and relative velocity; "state": the velocity only (`logits` unused, may be None)."""
    g32, gp32 = g.astype(jnp.float32), g_prev.astype(jnp.float32)
    vel = jnp.tanh(jnp.linalg.norm(g32 - gp32, axis=-1) / (jnp.linalg.norm(gp32, axis=-1) + 1e-6))
    if features == "state":
        return vel[..., None]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    p = jnp.exp(logp)
    max_p = jnp.max(p, axis=-1)
    entropy = -jnp.sum(p * logp, axis=-1) / math.log(logits.shape[-1])
    return jnp.stack([max_p, entropy, vel], axis=-1)


class ARLARouter(nn.Module):
    n_steps: int
    dim: int = 64
    hidden: int = 64
    eps: float = 1e-6
    give_up: bool = False  # also the "a later step will be safe" logit (`score_later`)

    def setup(self):
        self.norm = RMSNorm(self.eps)
        self.proj = nn.Dense(self.dim, use_bias=False)
        self.step_embed = self.param("step_embed", nn.initializers.normal(0.02), (self.n_steps, self.dim))
        self.wq = nn.Dense(self.dim, use_bias=False)
        self.wk = nn.Dense(self.dim, use_bias=False)
        self.wv = nn.Dense(self.dim, use_bias=False)
        self.mlp_in = nn.Dense(self.hidden)
        self.mlp_out = nn.Dense(1)
        if self.give_up:
            self.later_out = nn.Dense(1)

    def project(self, g: jax.Array, i) -> jax.Array:
        """z_i = P Norm(g_i) + e_i: [..., d] -> [..., dim] (float32)."""
        return self.proj(self.norm(g.astype(jnp.float32))) + self.step_embed[i]

    def score(self, traj: jax.Array, i, scalars: jax.Array) -> jax.Array:
        """Exit logit at step i. traj: [K, ..., dim] (entries after step i are ignored);
        scalars: [..., N_SCALARS[features]]. `i` may be traced."""
        return self.mlp_out(self._hidden(traj, i, scalars))[..., 0]

    def score_later(self, traj: jax.Array, i, scalars: jax.Array) -> jax.Array:
        """Logit of "a step after i will be safe" (same inputs as `score`; needs give_up=True)."""
        return self.later_out(self._hidden(traj, i, scalars))[..., 0]

    def _hidden(self, traj: jax.Array, i, scalars: jax.Array) -> jax.Array:
        zi = traj[i]
        q = self.wq(zi)
        k = self.wk(traj)
        v = self.wv(traj)
        s = jnp.einsum("...d,k...d->k...", q, k) / math.sqrt(self.dim)
        visible = (jnp.arange(traj.shape[0]) <= i).reshape((-1,) + (1,) * (s.ndim - 1))
        s = jnp.where(visible, s, -1e30)
        att = jnp.einsum("k...,k...d->...d", jax.nn.softmax(s, axis=0), v)
        return nn.gelu(self.mlp_in(jnp.concatenate([zi, att, scalars.astype(jnp.float32)], axis=-1)))

    def __call__(self, g: jax.Array, scalars: jax.Array) -> jax.Array:  # init only
        traj = jnp.stack([self.project(g, i) for i in range(self.n_steps)])
        if self.give_up:
            self.score_later(traj, 0, scalars)
        return self.score(traj, 0, scalars)


class StepMLP(nn.Module):
    """Baseline decider: a per-step MLP on Norm(g_i) (+ step embedding) -> exit logit."""

    n_steps: int
    hidden: int = 64
    eps: float = 1e-6

    @nn.compact
    def __call__(self, g: jax.Array, i) -> jax.Array:
        x = RMSNorm(self.eps)(g.astype(jnp.float32))
        x = nn.Dense(self.hidden)(x) + self.param("step_embed", nn.initializers.normal(0.02), (self.n_steps, self.hidden))[i]
        return nn.Dense(1)(nn.gelu(x))[..., 0]


def decider_score(
    kind: str,
    *,
    logits: Optional[jax.Array] = None,
    state: Optional[jax.Array] = None,
    prev_state: Optional[jax.Array] = None,
    router_logit: Optional[jax.Array] = None,
    mlp_logit: Optional[jax.Array] = None,
) -> jax.Array:
    """Score in [0, 1] of one decider at one step; fire when score >= tau.

    router:     sigmoid of the ARLA logit
    confidence: max softmax probability of the exit head (CALM-style)
    saturation: cosine of consecutive states
    step_mlp:   sigmoid of the per-step MLP logit
    """
    if kind == "router":
        return jax.nn.sigmoid(router_logit)
    if kind == "confidence":
        return jnp.max(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), axis=-1)
    if kind == "saturation":
        a, b = state.astype(jnp.float32), prev_state.astype(jnp.float32)
        return jnp.sum(a * b, -1) / (jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(b, axis=-1) + 1e-6)
    if kind == "step_mlp":
        return jax.nn.sigmoid(mlp_logit)
    raise ValueError(f"unknown decider {kind!r}; expected one of {', '.join(DECIDERS)}")
