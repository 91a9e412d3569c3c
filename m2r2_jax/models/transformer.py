"""The base decoder (the *slow* residual stream) as pure functions over explicit pytrees.

    forward(cfg, params, tokens, positions, cache) -> (logits, cache[, aux])

Parameter tree (layers stacked on a leading axis of size n_layers):

    {"embed": {"embedding": [V, d]},
     "layers": DecoderLayer params with a leading [L] axis (or, after `unstack_layers`, a tuple
               of L per-layer trees, for unrolled layer loops),
     "final_norm": {"scale": [d]},
     "lm_head": {"kernel": [d, V]}}        # absent with tied embeddings

(V is padded up to a multiple of the mesh axes that shard it when a sharding plan places the
parameters; logits are still [..., cfg.vocab_size]: see `vocab_rows` and `head`.)

KV cache: {"k": [L, B, KV, S, hd], "v": [L, B, KV, S, hd]}. The cache is position-addressed: a
forward writes the K/V of token (b, t) at slot positions[b, t] of every layer it runs and attends
causally by absolute position, so rolling back is just decoding from an earlier position again
(stale slots are overwritten before any query can see them). Positions >= S are dropped, which
lets finished sequences of a batch idle without touching the cache.

Sliding-window layers (all layers with `cfg.sliding_window`, or those `cfg.layer_types` marks, as
Gemma 3 interleaves them with global layers) keep the same full-length cache; their attention
mask limits each query to the window (`layers.layer_window`, looked up by the layer index, which is
traced inside the `lax.scan` over stacked layers). Rolling back works alike for every layer; the
memory is that of full attention.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from m2r2_jax.models.config import ModelConfig
from m2r2_jax.models.layers import (DecoderLayer, Embedder, attend, attention_mask, attention_options, dtype_of,
                                    heads_major, layer_window, norm_module, rms_norm)
from m2r2_jax.sharding.plan import constrain

Params = dict
Cache = dict

# Logical axes of activations and the cache (see m2r2_jax/sharding/rules.py); `constrain` is the
# identity unless a sharding plan is in scope.
HIDDEN_AXES = ("batch", "length", "act_embed")
LOGITS_AXES = ("batch", "length", "act_vocab")
# The cache is [layers, batch, kv_heads, length, head_dim]: heads before positions, so one layer's
# keys and values are already in the order attention contracts them in. Positions before heads
# made every decoding step transpose each layer's whole cache, a cost that grows with its length.
CACHE_AXES = ("layers", "cache_batch", "cache_heads", "cache_length", "head_dim")


class ForwardAux(NamedTuple):
    hidden: Optional[jax.Array]  # [L+1, B, T, d]: h_0 (embeddings) .. h_L (before the final norm)
    router_logits: Optional[jax.Array]  # [L, B, T, E] for MoE models


# --------------------------------------------------------------------------------------------
# Parameters and cache
# --------------------------------------------------------------------------------------------
def init_params(cfg: ModelConfig, rng: jax.Array) -> Params:
    """Random base parameters (std 0.02 normal; norms at one). Compiled as one program: run op by
    op, the many small initialisers would each compile on their own."""
    cfg.validate()
    return _init_params(cfg, rng)


@partial(jax.jit, static_argnums=0)
def _init_params(cfg: ModelConfig, rng: jax.Array) -> Params:
    pd = dtype_of(cfg.param_dtype)
    r_embed, r_layers, r_head = jax.random.split(rng, 3)
    tokens = jnp.zeros((1, 2), jnp.int32)
    positions = jnp.arange(2)[None]
    x = jnp.zeros((1, 2, cfg.d_model), dtype_of(cfg.dtype))
    embed = Embedder(cfg.vocab_size, cfg.d_model, pd).init(r_embed, tokens)["params"]
    layer_rngs = jax.random.split(r_layers, cfg.n_layers)
    layers = jax.vmap(lambda r: DecoderLayer(cfg).init(r, x, positions)["params"])(layer_rngs)
    params = {
        "embed": embed,
        "layers": layers,
        "final_norm": norm_module(cfg).init(r_head, x)["params"],
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = {"kernel": 0.02 * jax.random.normal(r_head, (cfg.d_model, cfg.vocab_size), pd)}
    return params


def init_cache(cfg: ModelConfig, batch: int, max_len: Optional[int] = None, dtype: Any = None) -> Cache:
    """Zero-filled KV cache for `batch` sequences of up to `max_len` positions."""
    s = max_len or cfg.max_seq_len
    shape = (cfg.n_layers, batch, cfg.n_kv_heads, s, cfg.head_dim)
    dt = dtype or dtype_of(cfg.dtype)
    return {"k": constrain(jnp.zeros(shape, dt), CACHE_AXES), "v": constrain(jnp.zeros(shape, dt), CACHE_AXES)}


def layer_params(params: Params, layer) -> Params:
    """Parameters of layer `layer` (0-based; static or traced), sliced from the stacked tree
    (host numpy leaves too: indexing them with a traced layer needs a jax array). With unstacked
    layers (`unstack_layers`) `layer` must be a Python int."""
    if is_unstacked(params):
        if not isinstance(layer, int):
            raise TypeError("unstacked layers are indexed by Python ints only (the loop over them is unrolled)")
        return params["layers"][layer]
    return jax.tree.map(lambda a: jnp.asarray(a)[layer], params["layers"])


def is_unstacked(params: Params) -> bool:
    """True when params["layers"] is a tuple of per-layer trees (`unstack_layers`)."""
    return isinstance(params["layers"], (tuple, list))


def unstack_layers(params: Params) -> Params:
    """The same parameters with "layers" as a tuple of per-layer trees, one array per weight and
    layer: every layer loop over them is then unrolled with static indices (`run_layers`).

    Why: on CPU the one-token step of the `lax.scan` over the stacked weights costs 30-40% more
    than the unrolled loop over separate arrays (docs/RESULTS.md, "The layer loop"); unrolling
    over static slices of the stack is slower than either, because XLA copies every slice. The
    price is a program that grows with the depth (compile time)."""
    if is_unstacked(params):
        return params
    n = jax.tree.leaves(params["layers"])[0].shape[0]
    return {**params, "layers": tuple(jax.tree.map(lambda a: a[i], params["layers"]) for i in range(n))}


def cache_length(cache: Cache) -> int:
    """Positions the cache holds (static)."""
    return cache["k"].shape[3]


def layer_kv(cache: Cache, layer):
    """Keys and values of `layer` (static or traced), each [B, KV, S, hd]."""
    return cache["k"][layer], cache["v"][layer]


def cache_write(cache: Cache, layer, positions: jax.Array, k: jax.Array, v: jax.Array) -> Cache:
    """Write k/v [B, T, KV, hd] at slots `positions` [B, T] of `layer` (static or traced); a slot
    >= the cache length is dropped (finished sequences write there)."""
    b = jnp.arange(k.shape[0])[:, None, None]
    h = jnp.arange(k.shape[2])[None, :, None]
    p = positions[:, None, :]
    new_k = cache["k"].at[layer, b, h, p].set(heads_major(k).astype(cache["k"].dtype), mode="drop")
    new_v = cache["v"].at[layer, b, h, p].set(heads_major(v).astype(cache["v"].dtype), mode="drop")
    return {"k": constrain(new_k, CACHE_AXES), "v": constrain(new_v, CACHE_AXES)}


# --------------------------------------------------------------------------------------------
# Pieces shared by the slow stream, the fast stream and the exit heads
# --------------------------------------------------------------------------------------------
def vocab_rows(cfg: ModelConfig, params: Params) -> int:
    """Rows of the embedding table: cfg.vocab_size, or more when a sharding plan padded the
    vocabulary to a multiple of the mesh axes that shard it (`sharding.params`: vocabulary-parallel
    embedding and head). Padded rows are never looked up (token ids are < vocab_size) and `head`
    drops their logits, so nothing downstream ever sees a padded token id."""
    n = params["embed"]["embedding"].shape[0]
    return n if n > cfg.vocab_size else cfg.vocab_size


def embed(cfg: ModelConfig, params: Params, tokens: jax.Array) -> jax.Array:
    pd = dtype_of(cfg.param_dtype)
    x = Embedder(vocab_rows(cfg, params), cfg.d_model, pd).apply({"params": params["embed"]}, tokens, method="encode")
    if cfg.scale_embeddings:  # Gemma: times sqrt(d_model), rounded to and multiplied in the embedding dtype
        x = x * jnp.asarray(np.float32(math.sqrt(cfg.d_model))).astype(x.dtype)
    return constrain(x.astype(dtype_of(cfg.dtype)), HIDDEN_AXES)


# Logit given to the tokens a vocabulary subset leaves out: finite, so softmax gives them exactly 0
# and p * log p stays 0 (with -inf it is NaN), far below any logit a head computes.
MASKED_LOGIT = -1e30


def head_kernel_columns(cfg: ModelConfig, params: Params, ids) -> jax.Array:
    """[d, n] LM-head columns of the token ids `ids` (the embedding rows with tied embeddings):
    a head over that vocabulary subset, gathered once (see `head`'s `vocab`)."""
    ids = jnp.asarray(ids, jnp.int32)
    if cfg.tie_embeddings:
        return jnp.take(params["embed"]["embedding"], ids, axis=0).T
    return jnp.take(params["lm_head"]["kernel"], ids, axis=1)


def head(cfg: ModelConfig, params: Params, h: jax.Array, norm_scale: Optional[jax.Array] = None,
         vocab: Optional[dict] = None, compact: bool = False) -> jax.Array:
    """Final norm + LM head (the exit head). `norm_scale` optionally multiplies the frozen norm
    weight (learned per-exit scales of the M2R2 exit heads). Logits in float32.

    `vocab` {"ids": [n], "kernel": [d, n] (`head_kernel_columns`)}: compute the logits of those n
    tokens only and give every other token MASKED_LOGIT (still [..., V]), so sampling, argmax and
    softmax see a distribution over the subset. For drafters: the matmul over V is most of a
    shallow draft step when V is large, and a draft outside the subset is simply never proposed.
    `compact` (with `vocab`): return the subset's [..., n] logits themselves, in `vocab["ids"]`
    order (distillation scores the draft head this way without V-wide arrays)."""
    scale = params["final_norm"]["scale"]
    if norm_scale is not None and cfg.norm_unit_offset:
        # zero-centred weight w: the norm multiplies by (1 + w), and the exit scale multiplies that
        hn = _scaled_unit_offset_norm(h, scale, norm_scale, cfg.rms_eps)
    else:
        if norm_scale is not None:
            scale = scale * norm_scale
        hn = norm_module(cfg).apply({"params": {"scale": scale}}, h)
    if vocab is not None:
        sub = _softcap(cfg, (hn @ vocab["kernel"].astype(hn.dtype)).astype(jnp.float32))
        if compact:
            return sub
        full = jnp.full(sub.shape[:-1] + (cfg.vocab_size,), MASKED_LOGIT, jnp.float32)
        return constrain(full.at[..., vocab["ids"]].set(sub), LOGITS_AXES)
    if cfg.tie_embeddings:
        pd = dtype_of(cfg.param_dtype)
        logits = Embedder(vocab_rows(cfg, params), cfg.d_model, pd).apply({"params": params["embed"]}, hn,
                                                                          method="decode")
    else:
        logits = hn @ params["lm_head"]["kernel"].astype(hn.dtype)
    logits = constrain(_softcap(cfg, logits.astype(jnp.float32)), LOGITS_AXES)
    if logits.shape[-1] != cfg.vocab_size:
        # A vocabulary padded for a sharding plan: the matmul above ran vocabulary-parallel over the
        # padded width; the padded tokens' logits are dropped here, before any softmax, argmax,
        # sampling or loss, so they can never win and every caller sees [..., vocab_size].
        logits = constrain(logits[..., :cfg.vocab_size], LOGITS_AXES)
    return logits


def _scaled_unit_offset_norm(h: jax.Array, w: jax.Array, norm_scale: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm with weight (1 + w) * norm_scale (the exit heads' learned scale), in float32."""
    h32 = h.astype(jnp.float32)
    y = h32 * jax.lax.rsqrt(jnp.mean(h32 * h32, axis=-1, keepdims=True) + eps)
    return (y * ((1.0 + w.astype(jnp.float32)) * norm_scale.astype(jnp.float32))).astype(h.dtype)


def _softcap(cfg: ModelConfig, logits: jax.Array) -> jax.Array:
    """Final logit soft-capping (Gemma): cap * tanh(logits / cap); the identity without a cap."""
    cap = cfg.final_logit_softcap
    return logits if cap is None else jnp.tanh(logits / cap) * cap


def layer_router_logits(cfg: ModelConfig, params: Params, layer, x: jax.Array) -> jax.Array:
    """MoE layer `layer`'s router on states x [..., d] that stand for that layer's input: its MLP
    pre-norm, then the router, as the layer itself computes them. float32 [..., E]: the experts the
    layer would pick for x. Used to guess routing from states other than the slow stream's own."""
    if not cfg.is_moe:
        raise ValueError(f"{cfg.family} has no MoE router (n_experts=0)")
    lp = layer_params(params, layer)
    xn = rms_norm(x, lp["mlp_norm"]["scale"], cfg.rms_eps, cfg.norm_unit_offset)
    return (xn @ lp["mlp"]["router"]["kernel"].astype(xn.dtype)).astype(jnp.float32)


def layer_forward(
    cfg: ModelConfig,
    lp: Params,
    x: jax.Array,
    positions: jax.Array,
    cache: Optional[Cache] = None,
    layer=None,
):
    """One slow-stream layer. With a cache, writes this layer's K/V and attends over the cache;
    without, attends over the T given positions. Returns (x_out, cache, router_logits)."""
    mod = DecoderLayer(cfg)
    v = {"params": lp}
    xn = mod.apply(v, x, method="norm_attn")
    q, k, vv = mod.apply(v, xn, positions, layer=layer, method="qkv")
    window = layer_window(cfg, layer)
    if cache is None:
        mask = attention_mask(positions, positions, window)
        a = attend(q, heads_major(k), heads_major(vv), mask, **attention_options(cfg))
    else:
        cache = cache_write(cache, layer, positions, k, vv)
        s = cache_length(cache)
        k_pos = jnp.broadcast_to(jnp.arange(s)[None], (x.shape[0], s))
        mask = attention_mask(positions, k_pos, window)
        a = attend(q, *layer_kv(cache, layer), mask, **attention_options(cfg))
    u = mod.apply(v, a, method="attn_out")
    if cfg.post_norms:
        u = mod.apply(v, u, method="post_attn")
    x = x + u
    _, out, router_logits = mod.apply(v, mod.apply(v, x, method="norm_mlp"), method="mlp_block")
    if cfg.post_norms:
        out = mod.apply(v, out, method="post_mlp")
    return x + out, cache, router_logits


def run_layers(
    cfg: ModelConfig,
    params: Params,
    x: jax.Array,
    positions: jax.Array,
    cache: Optional[Cache] = None,
    start: int = 0,
    stop: Optional[int] = None,
    collect: bool = False,
):
    """Run slow layers [start, stop) with `lax.scan` over the stacked weights (the cache is carried
    and updated in place). Returns (x, cache, hidden [n, B, T, d] or None, router_logits or None)
    where hidden[i] is the output of layer start + i."""
    stop = cfg.n_layers if stop is None else stop
    if stop <= start:
        return x, cache, None, None
    if is_unstacked(params):
        return _run_layers_unrolled(cfg, params, x, positions, cache, start, stop, collect)

    def body(carry, idx):
        h, c = carry
        # Index the whole stack inside the loop. Scanning over a sub-range (a[start:stop]) makes
        # XLA copy those layers' weights out of the stack on every call: per draft step for the
        # branch layers, per verification for the layers after them.
        h, c, rl = layer_forward(cfg, layer_params(params, idx), h, positions, c, idx)
        h = constrain(h, HIDDEN_AXES)
        ys = (h if collect else None, rl if (collect and cfg.is_moe) else None)
        return (h, c), ys

    (x, cache), (hidden, router_logits) = jax.lax.scan(body, (x, cache), jnp.arange(start, stop))
    return x, cache, hidden, router_logits


def _run_layers_unrolled(cfg: ModelConfig, params: Params, x, positions, cache, start: int, stop: int, collect: bool):
    """`run_layers` over unstacked layers: a Python loop, each layer's weights its own arrays."""
    hidden, router_logits = [], []
    for idx in range(start, stop):
        x, cache, rl = layer_forward(cfg, layer_params(params, idx), x, positions, cache, idx)
        x = constrain(x, HIDDEN_AXES)
        hidden.append(x)
        router_logits.append(rl)
    if not collect:
        return x, cache, None, None
    return x, cache, jnp.stack(hidden), (jnp.stack(router_logits) if cfg.is_moe else None)


def forward(
    cfg: ModelConfig,
    params: Params,
    tokens: jax.Array,
    positions: Optional[jax.Array] = None,
    cache: Optional[Cache] = None,
    *,
    return_aux: bool = False,
):
    """Base-model forward. tokens, positions: int32 [B, T]. Returns (logits [B, T, V] float32,
    cache) or, with `return_aux`, (logits, cache, ForwardAux) holding every layer's hidden state
    and (MoE) router logits."""
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1])[None], tokens.shape)
    x0 = embed(cfg, params, tokens)
    x, cache, hidden, router_logits = run_layers(cfg, params, x0, positions, cache, collect=return_aux)
    logits = head(cfg, params, x)
    if not return_aux:
        return logits, cache
    return logits, cache, ForwardAux(jnp.concatenate([x0[None], hidden], axis=0), router_logits)


def count_params(tree) -> int:
    return int(sum(a.size for a in jax.tree.leaves(tree)))
