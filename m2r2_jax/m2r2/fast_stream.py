"""The M2R2 fast residual stream.

    g_0 = h_b                                       (slow layers 0..b-1 are shared and exact)
    g_i = g_{i-1} + rho_i * D_{j_i}(g_{i-1})        i = 1..K

`D_j` is base layer j's residual update computed with the frozen weights plus accelerator
adapters; the update is applied per sub-block with its own rate vector through the fused
residual-rate op (`m2r2_jax.kernels.residual_rate_update`):

    x <- x + rho_attn * (attn_out + s * z_o B_o)     (and the next pre-norm, fused)
    x <- x + rho_mlp  * (mlp_out  + s * z_down B_down)

With post-norms (`ModelConfig.post_norms`, Gemma 2/3) a sub-block's residual update is
post_norm(block output): the RMSNorm after the sub-block is part of what the layer adds to the
stream, so D_j keeps it and the rate vector scales the *normalised* update. The adapter terms then
go inside it, on the projection they adapt (post_norm(attn_out + s * z_o B_o)), exactly as an
adapted weight would; added after the norm they would bypass the per-channel gain that sets the
update's scale. The fused op then gets the finished update and no low-rank term:

    x <- x + rho_attn * post_attn_norm(attn_out + s * z_o B_o)
    x <- x + rho_mlp  * post_mlp_norm(mlp_out  + s * z_down B_down)

With zero-centred norm weights (`norm_unit_offset`, Gemma: x * (1 + w) applied in float32) the next
pre-norm is computed by the layer itself rather than fused into the update (the fused op applies a
weight in the Llama convention).

Shared KV cache: the fast stream owns no cache. At step i its query attends to the slow cache of
layer j_i for earlier positions plus its own K/V for the current one:
- *decode* mode writes the fast K/V into the slow cache at (j_i, position) -- provisional entries
  that the slow verification pass overwrites -- and attends causally;
- *train* mode keeps the cache (filled by the slow forward over the same tokens) untouched and
  attends strictly before the current position plus to its own K/V.
Both give the same result for a single new token; neither allocates KV memory of its own.

The M2R2 parameters are their own pytree, stacked over the K steps:

    {"adapters": {target: {"A": [K, in, R], "B": [K, R, out]}},
     "rates": {"attn": [K, d], "mlp": [K, d]},
     "router": ARLARouter params, "step_mlp": StepMLP params,
     "exit_norm": {"scale": [K, d]}                     (optional)
     "moe_lowrank": {"A": [K, d, R], "B": [K, R, d]}}   (MoE bases with moe_fast_mlp="lowrank")
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from m2r2_jax.kernels import residual_rate_update
from m2r2_jax.m2r2.config import M2R2Config
from m2r2_jax.m2r2.router import N_SCALARS, ARLARouter, StepMLP, step_scalars
from m2r2_jax.models import transformer as T
from m2r2_jax.models.config import ModelConfig
from m2r2_jax.models.layers import DecoderLayer, attend, attention_mask, attention_options, layer_window, rms_norm
from m2r2_jax.sharding.plan import active_plan


class FastOutput(NamedTuple):
    logits: jax.Array  # [B, T, V] exit head after the last fast step (float32)
    cache: Optional[dict]
    exit_logits: jax.Array  # [K, B, T] router logits (only the last step unless collected)
    step_logits: Optional[jax.Array] = None  # [K, B, T, V]
    states: Optional[jax.Array] = None  # [K, B, T, d]
    moe_router_logits: Optional[jax.Array] = None  # [K, B, T, E]: layer j_i's router on the fast state
    branch_state: Optional[jax.Array] = None  # [B, T, d] h_b: the exact output of the b shared layers


# --------------------------------------------------------------------------------------------
# Schedule and parameters
# --------------------------------------------------------------------------------------------
def visited_layers(base: ModelConfig, mcfg: M2R2Config) -> tuple:
    """0-based base layer used (weights, KV slot, MoE router) by each fast step."""
    b, k, n = mcfg.branch_layer, mcfg.steps(base), base.n_layers
    if mcfg.schedule == "strided":
        return tuple(min(b + mcfg.rate * (i + 1), n) - 1 for i in range(k))
    return tuple(b + i for i in range(k))


def layers_covered(base: ModelConfig, mcfg: M2R2Config) -> tuple:
    """Slow layers' worth of change each fast step stands for (the rate vectors' initial value)."""
    ends = visited_layers(base, mcfg)
    starts = (mcfg.branch_layer - 1,) + ends[:-1]
    return tuple(max(1, e - s) for s, e in zip(starts, ends))


def state_for_layer(branch_layer: int, visited: tuple, layer: int) -> int:
    """The fast state that stands for layer `layer`'s input (layer >= branch_layer): the last g_s
    whose target is at or before it (g_0 = h_b, g_i ~ the output of visited layer j_i)."""
    targets = (branch_layer,) + tuple(j + 1 for j in visited)
    return max(i for i, t in enumerate(targets) if t <= layer)


def skipped_layer_states(base: ModelConfig, mcfg: M2R2Config) -> tuple:
    """((layer, s), ...) for every layer from the branch on that no fast step visits, with the
    fast state g_s standing for its input (`state_for_layer`). g_0 is the slow stream's own h_b,
    so pairs with s = 0 are left out: no M2R2 parameter shapes them."""
    b, visited = mcfg.branch_layer, visited_layers(base, mcfg)
    pairs = ((l, state_for_layer(b, visited, l)) for l in range(b, base.n_layers) if l not in visited)
    return tuple((l, s) for l, s in pairs if s > 0)


def adapter_shapes(base: ModelConfig, mcfg: M2R2Config) -> dict:
    d, qd, kvd = base.d_model, base.n_heads * base.head_dim, base.n_kv_heads * base.head_dim
    dims = {"q_proj": (d, qd), "k_proj": (d, kvd), "v_proj": (d, kvd), "o_proj": (qd, d),
            "gate_proj": (d, base.d_ff), "up_proj": (d, base.d_ff), "down_proj": (base.d_ff, d)}
    return {t: dims[t] for t in mcfg.targets(base)}


def init_m2r2_params(base: ModelConfig, mcfg: M2R2Config, rng: jax.Array) -> dict:
    """Fresh M2R2 parameters, compiled as one program (op by op, the small initialisers would
    each compile on their own)."""
    mcfg.validate(base)
    return _init_m2r2_params(base, mcfg, rng)


@partial(jax.jit, static_argnums=(0, 1))
def _init_m2r2_params(base: ModelConfig, mcfg: M2R2Config, rng: jax.Array) -> dict:
    k, d, r = mcfg.steps(base), base.d_model, mcfg.lora_rank
    rngs = iter(jax.random.split(rng, 16))
    adapters = {}
    for name, (din, dout) in adapter_shapes(base, mcfg).items():
        # B = 0: a fresh fast stream uses the pure base weights (plus the rate extrapolation).
        adapters[name] = {"A": jax.random.normal(next(rngs), (k, din, r)) / np.sqrt(din),
                          "B": jnp.zeros((k, r, dout))}
    covered = jnp.asarray(layers_covered(base, mcfg), jnp.float32)[:, None]
    params = {
        "adapters": adapters,
        "rates": {"attn": jnp.broadcast_to(covered, (k, d)), "mlp": jnp.broadcast_to(covered, (k, d))},
    }
    g = jnp.zeros((1, 1, d))
    sc = jnp.zeros((1, 1, N_SCALARS[mcfg.router_features]))
    params["router"] = ARLARouter(k, mcfg.router_dim, mcfg.router_hidden, base.rms_eps,
                                  mcfg.router_give_up).init(next(rngs), g, sc)["params"]
    params["step_mlp"] = StepMLP(k, mcfg.router_hidden, base.rms_eps).init(next(rngs), g, 0)["params"]
    if mcfg.exit_norm:
        params["exit_norm"] = {"scale": jnp.ones((k, d))}
    if base.is_moe and mcfg.moe_fast_mlp == "lowrank":
        rm = mcfg.moe_lowrank_dim
        params["moe_lowrank"] = {"A": jax.random.normal(next(rngs), (k, d, rm)) / np.sqrt(d), "B": jnp.zeros((k, rm, d))}
    return params


def _layer_macs(base: ModelConfig) -> tuple:
    """(attention, MLP) matmul weights one token touches in one slow layer (active experts only)."""
    d = base.d_model
    attn = d * (base.n_heads + 2 * base.n_kv_heads) * base.head_dim + base.n_heads * base.head_dim * d
    mlp = (3 * d * base.moe_d_ff * base.n_experts_per_tok + d * base.n_experts) if base.is_moe else 3 * d * base.d_ff
    mlp += 3 * d * base.shared_expert_d_ff
    return attn, mlp


def layer_macs(base: ModelConfig) -> int:
    """Matmul weights one token touches in one slow layer (attention + MLP, active experts)."""
    return sum(_layer_macs(base))


def head_cost_layers(base: ModelConfig, n_vocab: int = 0) -> float:
    """Cost of the LM head over `n_vocab` tokens (0: the whole vocabulary) in slow-layer
    equivalents: d x n weights against one layer's. Large vocabularies make it several layers."""
    return base.d_model * (n_vocab or base.vocab_size) / layer_macs(base)


def draft_cost_layers(base: ModelConfig, mcfg: M2R2Config) -> float:
    """Cost of one fast pass in slow-layer equivalents (matmul FLOPs ~ weights touched):
    b shared layers + K visited layers + adapters (+ the low-rank MoE MLP, minus skipped MLPs).
    The exit head is not included (`head_cost_layers`)."""
    d = base.d_model
    attn, mlp = _layer_macs(base)
    layer = attn + mlp
    per_step = attn + sum(mcfg.lora_rank * (din + dout) for din, dout in adapter_shapes(base, mcfg).values())
    if not base.is_moe or mcfg.moe_fast_mlp == "experts":
        per_step += mlp
    elif mcfg.moe_fast_mlp == "lowrank":
        per_step += 2 * d * mcfg.moe_lowrank_dim + d * base.n_experts
    return mcfg.branch_layer + mcfg.steps(base) * per_step / layer


def _step_params(m2r2_params: dict, i):
    keep = ("adapters", "rates", "moe_lowrank")
    return jax.tree.map(lambda a: a[i], {k: v for k, v in m2r2_params.items() if k in keep})


def _lora(ad: dict, name: str, x: jax.Array):
    """(z = x A, B) of an adapter, or (None, None) when the target is not adapted."""
    if name not in ad:
        return None, None
    return x @ ad[name]["A"].astype(x.dtype), ad[name]["B"]


def _rate_update(g, u, rho, z, b, scale: float, impl: str, norm_weight=None, eps: float = 1e-6):
    """The fused residual-rate update of g [B, T, d]. Under a sharding plan the call is split over
    the batch's devices (`jax.shard_map`): a Pallas kernel is an opaque custom call that XLA's
    partitioner cannot split, so without this every device would gather the whole batch and run the
    kernel on all of it. Rows are independent and each needs its full width (the fused RMSNorm), so
    rows go over the batch axes and d stays whole; the small operands are replicated. (`check_vma`
    is off: a Pallas call's output types carry no varying-axes annotation.)"""
    update = partial(residual_rate_update, scale=scale, eps=eps, implementation=impl)
    plan = active_plan()
    if plan is None or impl == "xla":
        return update(g, u, rho, z, b, norm_weight=norm_weight)
    rows = plan.fitted_sharding(("batch", None, None), g.shape).spec
    whole = jax.sharding.PartitionSpec()

    def local(g, u, rho, z, b, w):
        return update(g, u, rho, z, b, norm_weight=w)

    return jax.shard_map(local, mesh=plan.mesh, in_specs=(rows, rows, whole, rows, whole, whole),
                         out_specs=(rows, rows), check_vma=False)(g, u, rho, z, b, norm_weight)


# --------------------------------------------------------------------------------------------
# One fast step
# --------------------------------------------------------------------------------------------
def _fast_layer(base: ModelConfig, mcfg: M2R2Config, base_params, sp, j, g, positions, cache, train: bool):
    """Apply D_j with adapters and rate vectors to g. Returns (g, cache, moe_router_logits)."""
    lp = T.layer_params(base_params, j)
    mod, v = DecoderLayer(base), {"params": lp}
    ad, scale = sp["adapters"], mcfg.lora_scale
    impl = mcfg.kernel_implementation

    post = base.post_norms  # the adapter term goes inside the post-norm (module docstring)
    fuse_norm = not base.norm_unit_offset

    # attention sub-block
    xn = mod.apply(v, g, method="norm_attn")
    q, k, vv = mod.apply(v, xn, positions, ad, scale, layer=j, method="qkv")
    s = T.cache_length(cache)
    k_pos = jnp.broadcast_to(jnp.arange(s)[None], (g.shape[0], s))
    window, opts = layer_window(base, j), attention_options(base)
    if train:
        mask = attention_mask(positions, k_pos, window, strict=True)
        a = attend(q, *T.layer_kv(cache, j), mask, k, vv, **opts)
    else:
        cache = T.cache_write(cache, j, positions, k, vv)
        mask = attention_mask(positions, k_pos, window)
        a = attend(q, *T.layer_kv(cache, j), mask, **opts)
    if post:
        u = mod.apply(v, mod.apply(v, a, ad, scale, True, method="attn_out"), method="post_attn")
        z = b_o = None
    else:
        u = mod.apply(v, a, ad, scale, False, method="attn_out")
        z, b_o = _lora(ad, "o_proj", a.reshape(*a.shape[:2], -1))
    g, n = _rate_update(g, u, sp["rates"]["attn"], z, b_o, scale, impl,
                        norm_weight=lp["mlp_norm"]["scale"] if fuse_norm else None, eps=base.rms_eps)
    if not fuse_norm:
        n = mod.apply(v, g, method="norm_mlp")

    # MLP sub-block (n is the pre-norm of the new state)
    router_logits = None
    if not base.is_moe and post:
        _, u, _ = mod.apply(v, n, ad, scale, True, method="mlp_block")
        u = mod.apply(v, u, method="post_mlp")
        z = b_d = None
    elif not base.is_moe:
        hidden, u, _ = mod.apply(v, n, ad, scale, False, method="mlp_block")
        z, b_d = _lora(ad, "down_proj", hidden)
    else:
        z = b_d = None
        if mcfg.moe_fast_mlp == "experts":
            _, u, router_logits = mod.apply(v, n, method="mlp_block")
        else:
            router_logits = n @ lp["mlp"]["router"]["kernel"].astype(n.dtype)
            if mcfg.moe_fast_mlp == "lowrank":
                lr = sp["moe_lowrank"]
                u = jax.nn.silu(n @ lr["A"].astype(n.dtype)) @ lr["B"].astype(n.dtype)
            else:
                u = jnp.zeros_like(g)
    g, _ = _rate_update(g, u, sp["rates"]["mlp"], z, b_d, scale, impl)
    return g, cache, router_logits


def exit_head_logits(base: ModelConfig, mcfg: M2R2Config, base_params, m2r2_params, i, g,
                     vocab: Optional[dict] = None, compact: bool = False) -> jax.Array:
    """Frozen final norm + LM head on fast state g_i (with the step's learned norm scale);
    `vocab`: over a token subset only, `compact`: the subset's own logits (`models.transformer.head`)."""
    scale = m2r2_params["exit_norm"]["scale"][i] if "exit_norm" in m2r2_params else None
    return T.head(base, base_params, g, norm_scale=scale, vocab=vocab, compact=compact)


def init_traj(base: ModelConfig, mcfg: M2R2Config, batch: int, length: int) -> dict:
    """Router trajectory buffer: z of every step so far, plus the previous state (velocity)."""
    return {"z": jnp.zeros((mcfg.steps(base), batch, length, mcfg.router_dim), jnp.float32)}


def _router(base, mcfg, m2r2_params):
    mod = ARLARouter(mcfg.steps(base), mcfg.router_dim, mcfg.router_hidden, base.rms_eps, mcfg.router_give_up)
    return mod, {"params": m2r2_params["router"]}


def router_project(base, mcfg, m2r2_params, i, g):
    mod, v = _router(base, mcfg, m2r2_params)
    return mod.apply(v, g, i, method="project")


def router_score(base, mcfg, m2r2_params, traj_z, i, scalars):
    mod, v = _router(base, mcfg, m2r2_params)
    return mod.apply(v, traj_z, i, scalars, method="score")


def router_later(base, mcfg, m2r2_params, traj_z, i, scalars):
    """Logit of "a step after i will be safe" (`mcfg.router_give_up`)."""
    mod, v = _router(base, mcfg, m2r2_params)
    return mod.apply(v, traj_z, i, scalars, method="score_later")


def step_mlp_logit(base, mcfg, m2r2_params, i, g):
    return StepMLP(mcfg.steps(base), mcfg.router_hidden, base.rms_eps).apply({"params": m2r2_params["step_mlp"]}, g, i)


def branch(base: ModelConfig, mcfg: M2R2Config, base_params, tokens, positions, cache):
    """Embedding + the b shared slow layers (exact K/V). Returns (h_b, cache)."""
    x = T.embed(base, base_params, tokens)
    x, cache, _, _ = T.run_layers(base, base_params, x, positions, cache, 0, mcfg.branch_layer)
    return x, cache


def fast_step(base: ModelConfig, mcfg: M2R2Config, base_params, m2r2_params, i, g, positions, cache, traj):
    """Decode-mode fast step i (may be traced: for `lax.while_loop` early exit).
    Returns (g_i, cache, traj, exit_logit [B, T], logits [B, T, V] or None): the router's exit logit
    and the step's exit-head logits, which a "logits" router reads (max probability, entropy) and an
    exiting token is drawn from; returned so that no caller pays for the vocabulary-wide head twice.
    A "state" router reads no head: logits is None, and the caller computes the head where a token
    leaves."""
    # a static step visits a static layer: unstacked layers are indexed by Python ints only
    visited = visited_layers(base, mcfg)
    j = int(visited[i]) if isinstance(i, int) else jnp.asarray(visited)[i]
    g_new, cache, _ = _fast_layer(base, mcfg, base_params, _step_params(m2r2_params, i), j, g, positions, cache, False)
    logits = None
    if mcfg.router_features == "logits":
        logits = exit_head_logits(base, mcfg, base_params, m2r2_params, i, g_new)
    z = traj["z"].at[i].set(router_project(base, mcfg, m2r2_params, i, g_new))
    exit_logit = router_score(base, mcfg, m2r2_params, z, i, step_scalars(mcfg.router_features, logits, g_new, g))
    return g_new, cache, {"z": z}, exit_logit, logits


# --------------------------------------------------------------------------------------------
# Whole fast passes
# --------------------------------------------------------------------------------------------
def _run_steps(base, mcfg, base_params, m2r2_params, g, positions, cache, train: bool, collect_states: bool,
               n_steps: Optional[int] = None):
    """lax.scan over the K fast steps (or the first `n_steps` of them, >= 1). Returns (g_n, cache,
    states or None, z [n,B,T,dim], moe router logits or None, g_{n-1})."""
    n = mcfg.steps(base) if n_steps is None else int(n_steps)
    if T.is_unstacked(base_params):
        return _run_steps_unrolled(base, mcfg, base_params, m2r2_params, g, positions, cache, train, collect_states, n)
    visited = jnp.asarray(visited_layers(base, mcfg)[:n])
    steps = jnp.arange(n)
    sps = _step_params(m2r2_params, slice(0, n))

    def body(carry, xs):
        g, c = carry
        i, j, sp = xs
        g_new, c, rl = _fast_layer(base, mcfg, base_params, sp, j, g, positions, c, train)
        z = router_project(base, mcfg, m2r2_params, i, g_new)
        return (g_new, c), (g_new if collect_states else None, z, rl, g)

    (g, cache), (states, z, rl, prev) = jax.lax.scan(body, (g, cache), (steps, visited, sps))
    return g, cache, states, z, rl, prev[-1]


def _run_steps_unrolled(base, mcfg, base_params, m2r2_params, g, positions, cache, train: bool,
                        collect_states: bool, n: int):
    """`_run_steps` over unstacked base layers (`transformer.unstack_layers`): a Python loop, the
    visited layers as static indices."""
    states, zs, rls = [], [], []
    for i, j in enumerate(visited_layers(base, mcfg)[:n]):  # n >= 1, so prev is always set
        prev = g
        g, cache, rl = _fast_layer(base, mcfg, base_params, _step_params(m2r2_params, i), int(j), g, positions,
                                   cache, train)
        states.append(g)
        zs.append(router_project(base, mcfg, m2r2_params, i, g))
        rls.append(rl)
    rl = jnp.stack(rls) if rls[0] is not None else None
    return g, cache, (jnp.stack(states) if collect_states else None), jnp.stack(zs), rl, prev


def fast_forward(base: ModelConfig, mcfg: M2R2Config, base_params, m2r2_params, tokens, positions, cache,
                 *, collect: bool = False, vocab: Optional[dict] = None) -> FastOutput:
    """Decode-mode fast pass over new tokens (drafting, early exit, expert prediction): shared
    layers write exact K/V, visited layers get provisional fast K/V. `vocab`: the final exit
    head over a token subset (a drafter's reduced vocabulary; its router then sees the logits of
    that subset)."""
    k = mcfg.steps(base)
    g0, cache = branch(base, mcfg, base_params, tokens, positions, cache)
    g, cache, states, z, rl, g_prev = _run_steps(base, mcfg, base_params, m2r2_params, g0, positions, cache, False, collect)
    logits = exit_head_logits(base, mcfg, base_params, m2r2_params, k - 1, g, vocab)
    if not collect:
        last = router_score(base, mcfg, m2r2_params, z, k - 1, step_scalars(mcfg.router_features, logits, g, g_prev))
        exit_logits = jnp.zeros((k,) + last.shape, last.dtype).at[k - 1].set(last)
        return FastOutput(logits, cache, exit_logits, moe_router_logits=rl, branch_state=g0)
    step_logits, exit_logits = _per_step_heads(base, mcfg, base_params, m2r2_params, g0, states, z)
    return FastOutput(logits, cache, exit_logits, step_logits, states, rl, g0)


def fast_prefix(base: ModelConfig, mcfg: M2R2Config, base_params, m2r2_params, tokens, positions, cache,
                n_steps: int):
    """The first `n_steps` (1..K) steps of a decode-mode fast pass, for callers that need only the
    early fast states (expert prediction stops where its last source is). Returns (states g_1..g_n
    [n, B, T, d], MoE router logits [n, B, T, E] or None, cache)."""
    if not 1 <= n_steps <= mcfg.steps(base):
        raise ValueError(f"n_steps={n_steps} is outside 1..{mcfg.steps(base)}")
    g0, cache = branch(base, mcfg, base_params, tokens, positions, cache)
    _, cache, states, _, rl, _ = _run_steps(base, mcfg, base_params, m2r2_params, g0, positions, cache, False, True,
                                            n_steps)
    return states, rl, cache


def _per_step_heads(base, mcfg, base_params, m2r2_params, g0, states, z):
    """Exit-head logits and router logits at every step (analysis and training)."""
    k = mcfg.steps(base)
    prevs = jnp.concatenate([g0[None], states[:-1]], axis=0)

    def one(args):
        i, g, gp = args
        lg = exit_head_logits(base, mcfg, base_params, m2r2_params, i, g)
        return lg, router_score(base, mcfg, m2r2_params, z, i, step_scalars(mcfg.router_features, lg, g, gp))

    return jax.lax.map(one, (jnp.arange(k), states, prevs))


class TrainForward(NamedTuple):
    slow_logits: Optional[jax.Array]  # [B, T, V] (None: not computed)
    slow_hidden: jax.Array  # [L+1, B, T, d]
    states: jax.Array  # [K, B, T, d] fast states g_1..g_K
    g0: jax.Array  # [B, T, d] = h_b
    z: jax.Array  # [K, B, T, dim] router projections
    moe_router_logits: Optional[jax.Array]  # [K, B, T, E]
    slow_router_logits: Optional[jax.Array]  # [L, B, T, E]


def train_forward(base: ModelConfig, mcfg: M2R2Config, base_params, m2r2_params, tokens, positions=None,
                  slow_logits: bool = True) -> TrainForward:
    """Slow stream (frozen, stop-gradient) and fast stream over whole sequences in one pass. The
    slow pass fills a KV cache that the fast steps read (train-mode attention). Without
    `slow_logits` the slow stream's LM head is skipped (`TrainForward.slow_logits` is None): the
    distillation loss applies it to the positions it scores only."""
    positions = _whole_positions(tokens.shape, positions)
    base_params = jax.lax.stop_gradient(base_params)
    x0, layer_out, x, cache, router_logits = _slow_pass(base, base_params, tokens, positions)
    logits = T.head(base, base_params, x) if slow_logits else None
    hidden = jnp.concatenate([x0[None], layer_out], axis=0)
    slow_logits, hidden, cache = jax.lax.stop_gradient((logits, hidden, cache))
    g0 = hidden[mcfg.branch_layer]
    _, _, states, z, rl, _ = _run_steps(base, mcfg, base_params, m2r2_params, g0, positions, cache, True, True)
    return TrainForward(slow_logits, hidden, states, g0, z, rl, router_logits)


def _whole_positions(shape, positions=None) -> jax.Array:
    """Positions 0..T-1 of every row of a [B, T] batch of whole sequences, unless given."""
    b, t = shape[:2]
    return jnp.broadcast_to(jnp.arange(t)[None], (b, t)) if positions is None else positions


def _slow_pass(base: ModelConfig, base_params, tokens, positions):
    """The frozen base over whole sequences: (h_0 [B,T,d], every layer's output [L,B,T,d], h_N,
    the filled KV cache, MoE router logits or None)."""
    b, t = tokens.shape
    x0 = T.embed(base, base_params, tokens)
    x, cache, layer_out, router_logits = T.run_layers(base, base_params, x0, positions, T.init_cache(base, b, t),
                                                      collect=True)
    return x0, layer_out, x, cache, router_logits


class Teacher(NamedTuple):
    """What the frozen slow stream gives the distillation loss for one batch (all stop-gradient):
    enough to run the fast steps and score them without the base's other layers."""

    g0: jax.Array  # [B, T, d] h_b, where the fast stream starts
    targets: jax.Array  # [K, B, T, d] h_{j_i + 1}, the slow state each fast step lines up with
    final: jax.Array  # [B, T, d] h_N before the final norm (the teacher's logits come from it)
    k: jax.Array  # [K, B, KV, T, hd] the slow stream's keys at the visited layers
    v: jax.Array  # [K, B, KV, T, hd] and values


def teacher_outputs(base: ModelConfig, mcfg: M2R2Config, base_params, tokens, positions=None) -> Teacher:
    """One pass of the frozen base over whole sequences, kept to what the fast steps read."""
    positions = _whole_positions(tokens.shape, positions)
    x0, layer_out, x, cache, _ = _slow_pass(base, jax.lax.stop_gradient(base_params), tokens, positions)
    vis = jnp.asarray(visited_layers(base, mcfg))
    hidden_at = lambda i: x0 if i == 0 else layer_out[i - 1]  # noqa: E731  (h_i: after i layers)
    out = Teacher(hidden_at(mcfg.branch_layer), layer_out[vis], x, cache["k"][vis], cache["v"][vis])
    return jax.lax.stop_gradient(out)


def fast_train_states(base: ModelConfig, mcfg: M2R2Config, base_params, m2r2_params, teacher: Teacher,
                      positions=None) -> jax.Array:
    """The fast states g_1..g_K [K, B, T, d] from a `Teacher` (train-mode attention over the slow
    keys and values of each visited layer): the same states `train_forward` gives."""
    b, t = teacher.g0.shape[:2]
    positions = _whole_positions((b, t), positions)
    vis = jnp.asarray(visited_layers(base, mcfg))
    cache = T.init_cache(base, b, t, dtype=teacher.k.dtype)
    cache = {"k": cache["k"].at[vis].set(teacher.k), "v": cache["v"].at[vis].set(teacher.v)}
    _, _, states, _, _, _ = _run_steps(base, mcfg, jax.lax.stop_gradient(base_params), m2r2_params, teacher.g0,
                                       positions, cache, True, True)
    return states


def normalize(base: ModelConfig, x: jax.Array) -> jax.Array:
    """Unit-scale RMSNorm (no weight): the space in which states are compared."""
    return rms_norm(x, jnp.ones((x.shape[-1],), x.dtype), base.rms_eps)
