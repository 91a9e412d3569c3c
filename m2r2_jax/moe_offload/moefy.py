"""MoEfication: a dense SwiGLU model split into a routed MoE of the same weights.

    moe_cfg, moe_params, record = moefy(cfg, params, tokens, n_experts=16, top_k=4)

A SwiGLU MLP is a sum over its d_ff neurons: neuron i adds (silu(g_i) * u_i) * W_down[i, :]. Cut
the neurons into E groups of d_ff / E and each group is an expert (gate/up columns [d, d_ff/E],
down rows [d_ff/E, d]); the experts' outputs summed *unweighted* give the dense MLP back exactly,
so with top_k = E the MoE model is the dense model (`ModelConfig.router_weights = "none"`). With
top_k < E each token runs only the groups a router picks, and the model is as good as
(a) the grouping puts the neurons that fire together in one group, and (b) the router finds the
groups that carry the most of each token's MLP output.

Per layer, on the tokens of the calibration text (the layers run one after another over all of it):

* **Statistics**: the MLP input xn (after its pre-norm) and every neuron's activation h = silu(g) * u.
* **Grouping** (co-activation): each neuron is the vector of its contribution magnitudes
  |h_i| * ||W_down[i]|| over the tokens, scaled to unit length; balanced k-means on those vectors
  (cosine similarity to the group means) puts neurons that fire on the same tokens together. Each
  step assigns neurons to groups exactly balanced, d_ff / E each, by a minimum-cost assignment
  (`scipy.optimize.linear_sum_assignment` against every group mean repeated d_ff / E times).
* **Router**: a linear d_model -> E on xn (the layer's `router` kernel, as every MoE family
  computes it) trained by softmax cross-entropy against each token's share of the MLP output's
  norm per group, ||h_g W_down[g]|| / sum over groups: its ranking of the groups is then that of the
  groups' contributions. Fitted on the statistics tokens minus a held-out share, on which the top-k
  recall of the true top-k groups is measured.
* **Propagation**: `propagate="moe"` (default) feeds the next layer what the MoE layer outputs
  (its router's top-k groups), so each layer is fitted on the inputs the MoE model gives it, errors
  of the earlier layers included; "dense" feeds the dense model's own states (classic MoEfication).

The result is a Mixtral-family checkpoint (no shared expert; routing renormalisation is moot with
unweighted experts) that every MoE path runs unchanged: the slow stream, the offload engine, the
trace-replay simulator and `m2r2 moe-bench`.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from m2r2_jax.errors import ConfigError
from m2r2_jax.models import transformer as T
from m2r2_jax.models.config import ModelConfig
from m2r2_jax.models.layers import DecoderLayer, attend, attention_mask, attention_options, heads_major

PROPAGATE = ("moe", "dense")


# --------------------------------------------------------------------------------------------
# What can be split, and the config of the result
# --------------------------------------------------------------------------------------------
def check_moefy(cfg: ModelConfig, n_experts: int, top_k: int) -> None:
    """ConfigError unless `cfg` is a dense SwiGLU model whose d_ff splits into n_experts groups of
    which top_k run per token."""
    if cfg.is_moe:
        raise ConfigError(f"the base is already an MoE ({cfg.family}, {cfg.n_experts} experts): moefy splits a "
                          "dense model's MLP")
    if cfg.mlp_activation != "silu":
        raise ConfigError(f"the base's MLP is {cfg.mlp_activation}, not SwiGLU (silu): moefy splits SwiGLU MLPs only")
    for name, off in (("post_norms", False), ("norm_unit_offset", False), ("query_pre_attn_scalar", None),
                      ("attn_logit_softcap", None)):
        if getattr(cfg, name) != off:  # MoE models run the Llama-style layer only (ModelConfig.validate)
            raise ConfigError(f"the base has {name}={getattr(cfg, name)!r}: an MoE model cannot (expected {off!r})")
    if not cfg.uniform_layers:
        raise ConfigError("the base's layers attend differently (layer_types): an MoE model's layers must attend alike")
    if isinstance(n_experts, bool) or not isinstance(n_experts, int) or n_experts < 2:
        raise ConfigError(f"--experts={n_experts!r} is invalid: expected an integer >= 2")
    if cfg.d_ff % n_experts:
        raise ConfigError(f"--experts={n_experts} does not divide the base's d_ff={cfg.d_ff}: experts must be "
                          "equal groups of neurons")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= n_experts:
        raise ConfigError(f"--top_k={top_k!r} is invalid: expected 1..--experts={n_experts}")


def moe_config(cfg: ModelConfig, n_experts: int, top_k: int) -> ModelConfig:
    """The MoE model's config: the base's with its MLP as n_experts unweighted experts, top_k per
    token, in the Mixtral family (routed experts only, no shared expert)."""
    check_moefy(cfg, n_experts, top_k)
    return cfg.replace(family="mixtral", d_ff=0, n_experts=n_experts, n_experts_per_tok=top_k,
                       moe_d_ff=cfg.d_ff // n_experts, norm_topk_prob=True, shared_expert_d_ff=0,
                       router_weights="none").validate()


def split_params(cfg: ModelConfig, params, groups: np.ndarray, routers: np.ndarray) -> dict:
    """The MoE parameters: the dense layers' MLPs cut by `groups` [L, E, d_ff/E] (neuron ids) into
    experts, with router kernels `routers` [L, d, E]; everything else is the base's."""
    mlp = params["layers"]["mlp"]
    gate = np.asarray(mlp["gate_proj"]["kernel"])  # [L, d, f]
    up = np.asarray(mlp["up_proj"]["kernel"])
    down = np.asarray(mlp["down_proj"]["kernel"])  # [L, f, d]
    L = gate.shape[0]
    rows = np.arange(L)[:, None, None]
    dt = gate.dtype
    moe_mlp = {
        "router": {"kernel": np.asarray(routers, dt)},
        # [L, E, d, f/E]: column block of each group
        "experts_gate": np.ascontiguousarray(np.transpose(gate[rows, :, groups], (0, 1, 3, 2))),
        "experts_up": np.ascontiguousarray(np.transpose(up[rows, :, groups], (0, 1, 3, 2))),
        "experts_down": np.ascontiguousarray(down[rows, groups]),  # [L, E, f/E, d]
    }
    layers = {k: v for k, v in params["layers"].items() if k != "mlp"}
    layers["mlp"] = moe_mlp
    return {**{k: v for k, v in params.items() if k != "layers"}, "layers": layers}


# --------------------------------------------------------------------------------------------
# One layer at a time over the calibration tokens
# --------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=0)
def _attention_half(cfg: ModelConfig, lp, x):
    """Attention sub-block over whole sequences (no cache), then the MLP pre-norm: (x_mid, xn)."""
    mod, v = DecoderLayer(cfg), {"params": lp}
    positions = jnp.broadcast_to(jnp.arange(x.shape[1])[None], x.shape[:2])
    q, k, vv = mod.apply(v, mod.apply(v, x, method="norm_attn"), positions, method="qkv")
    a = attend(q, heads_major(k), heads_major(vv), attention_mask(positions, positions, cfg.sliding_window),
               **attention_options(cfg))
    x = x + mod.apply(v, a, method="attn_out")
    return x, mod.apply(v, x, method="norm_mlp")


@jax.jit
def _activations(xn, gate, up):
    return jax.nn.silu(xn @ gate) * (xn @ up)


@functools.partial(jax.jit, static_argnums=(5,))
def _mlp_out(h, down, xn, router, neuron_group, top_k: int):
    """The MLP output from activations h [N, f]: all neurons (top_k 0) or those of the router's
    top_k groups (unweighted, as the MoE layer sums them)."""
    if top_k == 0:
        return h @ down
    _, idx = jax.lax.top_k(xn @ router, top_k)  # [N, k]
    chosen = jnp.zeros((h.shape[0], router.shape[1]), h.dtype).at[jnp.arange(h.shape[0])[:, None], idx].set(1.0)
    return (h * chosen[:, neuron_group]) @ down


@jax.jit
def _group_mass(h, down):
    """h [n, E, f/E], down [E, f/E, d] -> [n, E] norms of each group's output."""
    return jnp.linalg.norm(jnp.einsum("neg,egd->ned", h, down), axis=-1)


def group_mass(h: np.ndarray, down: np.ndarray, groups: np.ndarray, rows: int = 2048) -> np.ndarray:
    """[N, E]: the norm of each group's share of the MLP output, ||h_g W_down[g]|| per token
    (`rows` tokens at a time: the per-group outputs are [rows, E, d])."""
    hg, dg = h[:, groups], jnp.asarray(down[groups])  # [N, E, f/E], [E, f/E, d]
    out = [np.asarray(_group_mass(jnp.asarray(hg[lo:lo + rows]), dg)) for lo in range(0, len(hg), rows)]
    return np.concatenate(out)


# --------------------------------------------------------------------------------------------
# Balanced grouping
# --------------------------------------------------------------------------------------------
def balanced_kmeans(features: np.ndarray, n_groups: int, *, iters: int = 12, seed: int = 0) -> np.ndarray:
    """Rows of `features` [n, m] (unit length) cut into n_groups groups of n / n_groups each,
    maximising each row's cosine similarity to its group's mean. Returns [n_groups, n / n_groups]
    row ids, each group sorted. k-means++ seeds, then alternating: exact balanced assignment (a
    linear sum assignment against every mean repeated n / n_groups times) and new means; stops when
    fewer than 1% of the rows move."""
    from scipy.optimize import linear_sum_assignment

    n = features.shape[0]
    size = n // n_groups
    if size * n_groups != n:
        raise ConfigError(f"{n_groups} groups do not divide {n} neurons")
    rng = np.random.default_rng(seed)
    seeds = [int(rng.integers(n))]
    for _ in range(1, n_groups):  # k-means++ on cosine distance
        d = np.clip(1.0 - (features @ features[seeds].T).max(axis=1), 0.0, None)
        seeds.append(int(rng.choice(n, p=d / d.sum())) if d.sum() > 0 else int(rng.integers(n)))
    means = features[seeds]
    assign = None
    for _ in range(max(1, iters)):
        cost = -(features @ means.T)  # [n, G]
        _, col = linear_sum_assignment(np.repeat(cost, size, axis=1))
        new = col // size
        # converged: under 1% of the rows move (the last few swaps change the groups' means little)
        done = assign is not None and np.mean(new != assign) < 0.01
        assign = new
        if done:
            break
        means = np.stack([features[assign == g].mean(axis=0) for g in range(n_groups)])
        means /= np.maximum(np.linalg.norm(means, axis=1, keepdims=True), 1e-12)
    return np.stack([np.sort(np.flatnonzero(assign == g)) for g in range(n_groups)])


def neuron_features(h: np.ndarray, down: np.ndarray) -> np.ndarray:
    """[f, N]: each neuron's contribution magnitudes |h_i| ||W_down[i]|| over the tokens, unit length."""
    a = (np.abs(h) * np.linalg.norm(down, axis=1)[None, :]).T
    return a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)


# --------------------------------------------------------------------------------------------
# Routers
# --------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=(3,))
def _fit_router(x, target, lr, steps: int):
    """Linear router [d, E] from zero by full-batch Adam on softmax cross-entropy against the
    target distribution over groups. Returns (kernel, loss at each step)."""
    import optax

    opt = optax.adam(lr)
    w = jnp.zeros((x.shape[1], target.shape[1]), jnp.float32)

    def loss_fn(w):
        return -jnp.mean(jnp.sum(target * jax.nn.log_softmax(x @ w, axis=-1), axis=-1))

    def step(carry, _):
        w, state = carry
        loss, g = jax.value_and_grad(loss_fn)(w)
        upd, state = opt.update(g, state, w)
        return (optax.apply_updates(w, upd), state), loss

    (w, _), losses = jax.lax.scan(step, (w, opt.init(w)), None, length=steps)
    return w, losses


def fit_router(xn: np.ndarray, mass: np.ndarray, *, steps: int = 300, lr: float = 1e-2):
    """Router kernel [d, E] fitted to the groups' output shares `mass` [N, E] on inputs xn [N, d].
    Returns (kernel, first loss, last loss)."""
    target = mass / np.maximum(mass.sum(axis=1, keepdims=True), 1e-12)
    w, losses = _fit_router(jnp.asarray(xn, jnp.float32), jnp.asarray(target, jnp.float32), lr, int(steps))
    losses = np.asarray(losses)
    return np.asarray(w), float(losses[0]), float(losses[-1])


def topk_recall(logits: np.ndarray, mass: np.ndarray, k: int) -> float:
    """Mean share of the true top-k groups (by output mass) among the router's top-k."""
    pred = np.argsort(-logits, axis=1)[:, :k]
    true = np.argsort(-mass, axis=1)[:, :k]
    return float(np.mean([len(set(p) & set(t)) / k for p, t in zip(pred, true)]))


def captured_mass(logits: np.ndarray, mass: np.ndarray, k: int) -> float:
    """Share of the output mass (summed group norms) in the router's top-k groups."""
    pred = np.argsort(-logits, axis=1)[:, :k]
    return float(np.take_along_axis(mass, pred, axis=1).sum() / max(mass.sum(), 1e-12))


# --------------------------------------------------------------------------------------------
# The whole model
# --------------------------------------------------------------------------------------------
def moefy(cfg: ModelConfig, params, tokens: np.ndarray, *, n_experts: int = 16, top_k: int = 4,
          propagate: str = "moe", router_steps: int = 300, router_lr: float = 1e-2, router_tokens: int = 8192,
          cluster_tokens: int = 4096,
          cluster_iters: int = 12, heldout_fraction: float = 0.25, chunk: int = 8, seed: int = 0,
          progress: Optional[Callable[[str], None]] = None):
    """Split the dense model (cfg, params) into an MoE of `n_experts` experts, `top_k` per token,
    from statistics on `tokens` [n, T] (int32 sequences). Returns (moe_cfg, moe_params, record):
    `record["layers"]` per layer: router top-k recall of the true top-k groups and the output mass
    its choice captures (against the best top-k's), on the held-out share of the tokens' sequences."""
    moe_cfg = moe_config(cfg, n_experts, top_k)
    if propagate not in PROPAGATE:
        raise ConfigError(f"propagate={propagate!r} is invalid: expected one of {', '.join(PROPAGATE)}")
    tokens = np.asarray(tokens, np.int32)
    if tokens.ndim != 2 or tokens.shape[0] < 2:
        raise ConfigError(f"moefy needs at least 2 token sequences [n, T], got shape {tokens.shape}")
    if not 0.0 < heldout_fraction < 1.0:
        raise ConfigError(f"heldout_fraction={heldout_fraction!r} is invalid: expected (0, 1)")
    n_held = min(max(1, int(round(tokens.shape[0] * heldout_fraction))), tokens.shape[0] - 1)
    n_fit = tokens.shape[0] - n_held
    say = progress or (lambda _: None)
    rng = np.random.default_rng(seed)
    t_start = time.perf_counter()
    mlp = params["layers"]["mlp"]
    gate_all, up_all, down_all = (np.asarray(mlp[k]["kernel"], np.float32) for k in ("gate_proj", "up_proj",
                                                                                      "down_proj"))
    L, d, f = cfg.n_layers, cfg.d_model, cfg.d_ff
    x = np.asarray(jax.jit(T.embed, static_argnums=0)(cfg, params, jnp.asarray(tokens)), np.float32)
    groups_all, routers, rows, timing = [], [], [], {"stats_s": 0.0, "cluster_s": 0.0, "router_s": 0.0}
    for l in range(L):
        t0 = time.perf_counter()
        lp = T.layer_params(params, l)
        mids, xns = [], []
        for lo in range(0, x.shape[0], chunk):
            m, n = _attention_half(cfg, lp, jnp.asarray(x[lo:lo + chunk]))
            mids.append(np.asarray(m))
            xns.append(np.asarray(n))
        x_mid = np.concatenate(mids)
        xn = np.concatenate(xns).reshape(-1, d).astype(np.float32)
        gate, up, down = gate_all[l], up_all[l], down_all[l]
        h = np.asarray(_activations(jnp.asarray(xn), jnp.asarray(gate), jnp.asarray(up)))  # [N, f]
        n_fit_tok = n_fit * tokens.shape[1]
        timing["stats_s"] += time.perf_counter() - t0

        t0 = time.perf_counter()
        fit_rows = rng.choice(n_fit_tok, size=min(cluster_tokens, n_fit_tok), replace=False)
        groups = balanced_kmeans(neuron_features(h[fit_rows], down), n_experts, iters=cluster_iters, seed=seed + l)
        timing["cluster_s"] += time.perf_counter() - t0

        t0 = time.perf_counter()
        mass = group_mass(h, down, groups)  # [N, E]
        fit = rng.choice(n_fit_tok, size=min(router_tokens, n_fit_tok), replace=False)
        w, loss0, loss1 = fit_router(xn[fit], mass[fit], steps=router_steps, lr=router_lr)
        held_logits = xn[n_fit_tok:] @ w
        held_mass = mass[n_fit_tok:]
        best = captured_mass(held_mass, held_mass, top_k)  # the true top-k groups
        rows.append({"layer": l, "router_recall": topk_recall(held_logits, held_mass, top_k),
                     "captured_mass": captured_mass(held_logits, held_mass, top_k), "best_captured_mass": best,
                     "router_loss_first": loss0, "router_loss_last": loss1})
        timing["router_s"] += time.perf_counter() - t0
        groups_all.append(groups)
        routers.append(w)

        neuron_group = np.empty(f, np.int32)
        for g, ids in enumerate(groups):
            neuron_group[ids] = g
        out = np.asarray(_mlp_out(jnp.asarray(h), jnp.asarray(down), jnp.asarray(xn), jnp.asarray(w),
                                  jnp.asarray(neuron_group), top_k if propagate == "moe" else 0))
        x = (x_mid + out.reshape(x_mid.shape)).astype(np.float32)
        say(f"layer {l + 1}/{L}: router recall {rows[-1]['router_recall']:.3f}, captured mass "
            f"{rows[-1]['captured_mass']:.3f} (best {best:.3f})")
    groups_all = np.stack(groups_all)
    moe_params = split_params(cfg, params, groups_all, np.stack(routers))
    record = {
        "n_experts": n_experts, "top_k": top_k, "propagate": propagate, "router_steps": router_steps,
        "router_lr": router_lr, "router_tokens": int(min(router_tokens, n_fit * tokens.shape[1])),
        "cluster_tokens": int(min(cluster_tokens, n_fit * tokens.shape[1])),
        "fit_sequences": int(n_fit), "heldout_sequences": int(n_held), "seq_len": int(tokens.shape[1]),
        "layers": rows,
        "router_recall": float(np.mean([r["router_recall"] for r in rows])),
        "captured_mass": float(np.mean([r["captured_mass"] for r in rows])),
        "best_captured_mass": float(np.mean([r["best_captured_mass"] for r in rows])),
        "seconds": {**{k: round(v, 2) for k, v in timing.items()}, "total_s": round(time.perf_counter() - t_start, 2)},
    }
    return moe_cfg, jax.tree.map(jnp.asarray, moe_params), record


# --------------------------------------------------------------------------------------------
# Quality against the dense model
# --------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=0)
def _nll_argmax(cfg, params, tokens):
    logits, _ = T.forward(cfg, params, tokens)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return nll, jnp.argmax(logits[:, :-1], axis=-1)


def compare(cfg: ModelConfig, params, moe_cfg: ModelConfig, moe_params, tokens: np.ndarray, *,
            batch_size: int = 4) -> dict:
    """Perplexity of the dense and the MoE model on token sequences [n, T] (next-token, every
    position), and how often the MoE's greedy (top-1) next token is the dense model's."""
    tokens = np.asarray(tokens, np.int32)
    out = {}
    for name, c, p in (("dense", cfg, params), ("moe", moe_cfg, moe_params)):
        t0 = time.perf_counter()
        nll, top = [], []
        for lo in range(0, tokens.shape[0], batch_size):
            a, b = _nll_argmax(c, p, jnp.asarray(tokens[lo:lo + batch_size]))
            nll.append(np.asarray(a))
            top.append(np.asarray(b))
        out[name] = (np.concatenate(nll), np.concatenate(top), time.perf_counter() - t0)
    ppl = {k: float(np.exp(np.mean(v[0]))) for k, v in out.items()}
    return {"tokens": int(out["dense"][0].size), "perplexity_dense": ppl["dense"], "perplexity_moe": ppl["moe"],
            "perplexity_ratio": ppl["moe"] / ppl["dense"],
            "top1_agreement": float(np.mean(out["dense"][1] == out["moe"][1])),
            "seconds": {k: round(v[2], 2) for k, v in out.items()}}


__all__ = ["moefy", "moe_config", "check_moefy", "split_params", "balanced_kmeans", "fit_router", "compare",
           "topk_recall", "captured_mass", "group_mass", "PROPAGATE"]
