"""Building blocks of the decoder as functional Flax (Linen) modules.

Modules are used functionally: `Module(cfg).apply({"params": p}, ...)` with parameter pytrees
passed in explicitly. Every projection accepts an optional low-rank adapter `(A, B)` so that the
M2R2 fast stream can add accelerator adapters around the frozen base weights without a second copy
of this code (the slow stream never passes adapters).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from m2r2_jax.models.config import ModelConfig, RopeScaling

Array = jax.Array
Adapters = Optional[Mapping[str, Mapping[str, Array]]]
NEG_INF = -1e30

_INIT = nn.initializers.normal(stddev=0.02)


def dtype_of(name: str):
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]


def rms_norm(x: Array, scale: Array, eps: float, unit_offset: bool = False) -> Array:
    """RMSNorm computed in float32, cast back before the scale (the Llama convention). With
    `unit_offset` (Gemma) the weight is zero-centred: x * (1 + scale), applied in float32 before the
    cast."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if unit_offset:
        return (y * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
    return scale.astype(x.dtype) * y.astype(x.dtype)


def lora_term(x: Array, lora: Optional[Mapping[str, Array]], scale: float) -> Optional[Array]:
    if lora is None:
        return None
    z = x @ lora["A"].astype(x.dtype)
    return scale * (z @ lora["B"].astype(x.dtype))


class RMSNorm(nn.Module):
    eps: float = 1e-6
    unit_offset: bool = False  # zero-centred weight (Gemma): initialised at 0, i.e. the identity scale

    @nn.compact
    def __call__(self, x: Array) -> Array:
        init = nn.initializers.zeros if self.unit_offset else nn.initializers.ones
        scale = self.param("scale", init, (x.shape[-1],), jnp.float32)
        return rms_norm(x, scale, self.eps, self.unit_offset)


def norm_module(cfg: ModelConfig) -> RMSNorm:
    """The model's RMSNorm (its epsilon and weight convention)."""
    return RMSNorm(cfg.rms_eps, cfg.norm_unit_offset)


class Linear(nn.Module):
    """`y = x W (+ b) (+ s * (x A) B)`; kernel stored [in, out]."""

    features: int
    use_bias: bool = False
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array, lora: Optional[Mapping[str, Array]] = None, lora_scale: float = 1.0) -> Array:
        kernel = self.param("kernel", _INIT, (x.shape[-1], self.features), self.param_dtype)
        y = x @ kernel.astype(x.dtype)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype).astype(x.dtype)
        extra = lora_term(x, lora, lora_scale)
        return y if extra is None else y + extra


# --------------------------------------------------------------------------------------------
# Rotary position embedding
# --------------------------------------------------------------------------------------------
def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> jnp.ndarray:
    """Inverse frequencies of the global rotary embedding (rope_theta, rope_scaling) or, `local`,
    of the sliding layers' own (rope_local_theta, no scaling)."""
    if local:
        return _inv_freq(cfg.rotary_dim, cfg.rope_local_theta, RopeScaling())
    return _inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)


def _inv_freq(dim: int, theta: float, rs: RopeScaling) -> jnp.ndarray:
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    if rs.rope_type == "linear":
        inv_freq = inv_freq / rs.factor
    elif rs.rope_type == "llama3":
        old_len = rs.original_max_position_embeddings
        low_wavelen = old_len / rs.low_freq_factor
        high_wavelen = old_len / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = jnp.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = jnp.where(medium, smoothed, scaled)
    return inv_freq


def _is_static_index(layer) -> bool:
    return isinstance(layer, (int, np.integer)) and not isinstance(layer, bool)


def layer_inv_freq(cfg: ModelConfig, layer) -> jnp.ndarray:
    """Inverse frequencies of layer `layer` (a Python int or a traced index, e.g. inside the
    `lax.scan` over stacked layers). Models whose layers all share one rotary embedding ignore
    `layer` (it may be None); the others (Gemma 3: local vs global layers) need it."""
    local = tuple(cfg.local_rope(i) for i in range(cfg.n_layers))
    if not any(local):
        return rope_inv_freq(cfg)
    if layer is None:
        raise ValueError(f"{cfg.family}: layers differ in their rotary embedding: pass the layer index (layer=)")
    if _is_static_index(layer):
        return rope_inv_freq(cfg, local[int(layer)])
    return jnp.where(jnp.asarray(local)[layer], rope_inv_freq(cfg, True), rope_inv_freq(cfg))


# The window of a full-attention layer when windows are looked up per layer with a traced index:
# larger than any position distance.
NO_WINDOW = 2**31 - 1


def layer_window(cfg: ModelConfig, layer):
    """Attention window of layer `layer` (static or traced): a Python int or None when every layer
    has the same one (then `layer` is ignored and may be None), else that layer's window (an int32
    scalar when `layer` is traced, NO_WINDOW for a full-attention layer)."""
    windows = cfg.layer_windows
    if len(set(windows)) == 1:
        return windows[0]
    if layer is None:
        raise ValueError(f"{cfg.family}: layers differ in their attention window: pass the layer index")
    if _is_static_index(layer):
        return windows[int(layer)]
    return jnp.asarray([NO_WINDOW if w is None else w for w in windows], jnp.int32)[layer]


def apply_rope(x: Array, positions: Array, cfg: ModelConfig, inv_freq: Optional[Array] = None) -> Array:
    """x: [B, T, H, hd]; positions: [B, T]. Half-split (rotate_half) convention, partial rotary.
    `inv_freq`: the layer's (`layer_inv_freq`); default the global rotary embedding."""
    rot = cfg.rotary_dim
    inv_freq = rope_inv_freq(cfg) if inv_freq is None else inv_freq
    freqs = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, rot/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, rot]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = jnp.split(x_rot.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    out = (x_rot.astype(jnp.float32) * cos + rotated * sin).astype(x.dtype)
    return jnp.concatenate([out, x_pass], axis=-1) if x_pass.shape[-1] else out


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------
def attention_mask(q_pos: Array, k_pos: Array, sliding_window, strict: bool = False) -> Array:
    """[B, Tq, S] boolean: key visible to query (causal by absolute position, optional window: an
    int, None or a traced int32 scalar, see `layer_window`)."""
    diff = q_pos[:, :, None] - k_pos[:, None, :]
    mask = diff > 0 if strict else diff >= 0
    if sliding_window is not None:
        mask &= diff < sliding_window
    return mask


def heads_major(x: Array) -> Array:
    """[B, S, KV, hd] (as the projections produce keys and values) -> [B, KV, S, hd] (as the cache
    holds them and `attend` takes them)."""
    return jnp.swapaxes(x, 1, 2)


def attention_options(cfg: ModelConfig) -> dict:
    """`attend`'s keyword arguments for the model: query scale and logit soft-cap."""
    scale = None if cfg.query_pre_attn_scalar is None else float(cfg.query_pre_attn_scalar) ** -0.5
    return {"scale": scale, "softcap": cfg.attn_logit_softcap}


def attend(
    q: Array,
    k: Array,
    v: Array,
    mask: Array,
    k_self: Optional[Array] = None,
    v_self: Optional[Array] = None,
    *,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
) -> Array:
    """Grouped-query attention.

    q: [B, T, H, hd]; k, v: [B, KV, S, hd] (heads before positions, the cache's order: see
    `heads_major`); mask: [B, T, S].
    With `k_self`/`v_self` ([B, T, KV, hd]) every query also attends to its own key/value (the
    M2R2 fast stream during training: context from the slow stream's cache, plus its own K/V).
    `scale` multiplies the queries (default head_dim**-0.5); `softcap` maps the scores to
    softcap * tanh(scores / softcap) before the mask (Gemma's attention logit soft-capping).
    Softmax in float32. Returns [B, T, H, hd].
    """
    b, t, h, hd = q.shape
    kv = k.shape[1]
    g = h // kv
    # Queries as [B, KV, T*G, hd] (t major, g minor): scores and output are then plain batched
    # matmuls over (batch, kv head) against the cache's [B, KV, S, hd] without transposing it.
    qg = q.reshape(b, t, kv, g, hd).astype(jnp.float32) * ((1.0 / math.sqrt(hd)) if scale is None else scale)
    qg = jnp.transpose(qg, (0, 2, 1, 3, 4)).reshape(b, kv, t * g, hd)
    scores = jnp.einsum("bkqd,bksd->bkqs", qg, k.astype(jnp.float32))
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    scores = jnp.where(jnp.repeat(mask, g, axis=1)[:, None], scores, NEG_INF)
    if k_self is not None:
        ks = jnp.repeat(heads_major(k_self).astype(jnp.float32), g, axis=2)  # [B, KV, T*G, hd]
        s_self = jnp.sum(qg * ks, axis=-1, keepdims=True)
        if softcap is not None:
            s_self = jnp.tanh(s_self / softcap) * softcap
        scores = jnp.concatenate([scores, s_self], axis=-1)
    probs = jax.nn.softmax(scores, axis=-1)
    if k_self is not None:
        probs, p_self = probs[..., :-1], probs[..., -1:]
    out = jnp.einsum("bkqs,bksd->bkqd", probs, v.astype(jnp.float32))
    if k_self is not None:
        out = out + p_self * jnp.repeat(heads_major(v_self).astype(jnp.float32), g, axis=2)
    out = jnp.transpose(out.reshape(b, kv, t, g, hd), (0, 2, 1, 3, 4))
    return out.reshape(b, t, h, hd).astype(q.dtype)


class Attention(nn.Module):
    """Projections of one attention sub-block. The attention itself (`attend`) and the KV cache
    are handled by the caller so that slow and fast streams can share one cache."""

    cfg: ModelConfig

    def setup(self):
        c = self.cfg
        pd = dtype_of(c.param_dtype)
        self.q_proj = Linear(c.n_heads * c.head_dim, c.qkv_bias, pd)
        self.k_proj = Linear(c.n_kv_heads * c.head_dim, c.qkv_bias, pd)
        self.v_proj = Linear(c.n_kv_heads * c.head_dim, c.qkv_bias, pd)
        self.o_proj = Linear(c.d_model, False, pd)
        if c.qk_norm:
            self.q_norm = norm_module(c)
            self.k_norm = norm_module(c)

    def qkv(self, x: Array, positions: Array, adapters: Adapters = None, lora_scale: float = 1.0, layer=None):
        """Rotated q [B, T, H, hd], k and v [B, T, KV, hd]. `layer` (static or traced) picks the
        layer's rotary embedding where layers differ (`layer_inv_freq`)."""
        c = self.cfg
        ad = adapters or {}
        b, t, _ = x.shape
        q = self.q_proj(x, ad.get("q_proj"), lora_scale)
        k = self.k_proj(x, ad.get("k_proj"), lora_scale)
        v = self.v_proj(x, ad.get("v_proj"), lora_scale)
        if c.qk_norm and not c.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(b, t, c.n_heads, c.head_dim)
        k = k.reshape(b, t, c.n_kv_heads, c.head_dim)
        if c.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = layer_inv_freq(c, layer)
        q = apply_rope(q, positions, c, inv_freq)
        k = apply_rope(k, positions, c, inv_freq)
        v = v.reshape(b, t, c.n_kv_heads, c.head_dim)
        return q, k, v

    def out(self, a: Array, adapters: Adapters = None, lora_scale: float = 1.0, with_lora: bool = True) -> Array:
        """a: [B, T, H, hd] -> [B, T, d]. `with_lora=False` leaves the o_proj adapter term to the
        caller (the fused residual-rate update adds it)."""
        b, t = a.shape[:2]
        flat = a.reshape(b, t, -1)
        lora = (adapters or {}).get("o_proj") if with_lora else None
        return self.o_proj(flat, lora, lora_scale)

    def __call__(self, x, positions, layer=0):  # used by init only
        q, k, v = self.qkv(x, positions, layer=layer)
        mask = attention_mask(positions, positions, layer_window(self.cfg, layer))
        return self.out(attend(q, heads_major(k), heads_major(v), mask, **attention_options(self.cfg)))


# --------------------------------------------------------------------------------------------
# MLPs
# --------------------------------------------------------------------------------------------
class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), or GeGLU with `activation="gelu_tanh"` (tanh-approximated
    GELU, Gemma). Returns (hidden before down_proj, output)."""

    d_ff: int
    d_model: int
    param_dtype: Any = jnp.float32
    activation: str = "silu"

    def setup(self):
        self.gate_proj = Linear(self.d_ff, False, self.param_dtype)
        self.up_proj = Linear(self.d_ff, False, self.param_dtype)
        self.down_proj = Linear(self.d_model, False, self.param_dtype)

    def __call__(self, x: Array, adapters: Adapters = None, lora_scale: float = 1.0, with_lora: bool = True):
        ad = adapters or {}
        act = jax.nn.silu if self.activation == "silu" else partial(jax.nn.gelu, approximate=True)
        hidden = act(self.gate_proj(x, ad.get("gate_proj"), lora_scale)) * self.up_proj(
            x, ad.get("up_proj"), lora_scale
        )
        out = self.down_proj(hidden, ad.get("down_proj") if with_lora else None, lora_scale)
        return hidden, out


def route(cfg: ModelConfig, router_logits: Array) -> tuple[Array, Array]:
    """Top-k routing with the family's normalisation. Returns (weights [.., k], indices [.., k]).
    With `cfg.router_weights == "none"` every selected expert weighs 1 (a plain sum): every MoE path
    (the layer, the offload engine, the fast stream's experts) combines experts with these weights,
    so the switch lives here alone."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, idx = jax.lax.top_k(probs, cfg.n_experts_per_tok)
    if cfg.router_weights == "none":
        return jnp.ones_like(weights), idx
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, idx


def experts_forward(
    x: Array, gate: Array, up: Array, down: Array, weights: Array, idx: Array, n_experts: int
) -> Array:
    """Weighted sum of the selected experts' SwiGLU outputs. x: [N, d]; gate/up: [E, d, f];
    down: [E, f, d]; weights/idx: [N, k]. Exact either way; the branch is on static shapes:
    gathering k experts per token wins when there are few tokens (decoding), a dense pass over all
    experts when there are many (training, prefill)."""
    n, k = idx.shape
    dt = x.dtype
    if n * k <= n_experts:
        g, u, dn = gate[idx].astype(dt), up[idx].astype(dt), down[idx].astype(dt)  # [N, k, d, f]
        h = jax.nn.silu(jnp.einsum("nd,nkdf->nkf", x, g)) * jnp.einsum("nd,nkdf->nkf", x, u)
        y = jnp.einsum("nkf,nkfd->nkd", h, dn)
        return jnp.einsum("nkd,nk->nd", y, weights.astype(dt))
    combine = jnp.zeros((n, n_experts), dt).at[jnp.arange(n)[:, None], idx].add(weights.astype(dt))
    h = jax.nn.silu(jnp.einsum("nd,edf->nef", x, gate.astype(dt))) * jnp.einsum("nd,edf->nef", x, up.astype(dt))
    y = jnp.einsum("nef,efd->ned", h, down.astype(dt))
    return jnp.einsum("ned,ne->nd", y, combine)


class MoE(nn.Module):
    """Routed SwiGLU experts (+ an optional sigmoid-gated shared expert, Qwen2-MoE)."""

    cfg: ModelConfig

    def setup(self):
        c = self.cfg
        pd = dtype_of(c.param_dtype)
        self.router = Linear(c.n_experts, False, pd)
        shape_in = (c.n_experts, c.d_model, c.moe_d_ff)
        self.experts_gate = self.param("experts_gate", _INIT, shape_in, pd)
        self.experts_up = self.param("experts_up", _INIT, shape_in, pd)
        self.experts_down = self.param("experts_down", _INIT, (c.n_experts, c.moe_d_ff, c.d_model), pd)
        if c.shared_expert_d_ff:
            self.shared_expert = MLP(c.shared_expert_d_ff, c.d_model, pd)
            self.shared_expert_gate = Linear(1, False, pd)

    def router_logits(self, x: Array) -> Array:
        return self.router(x)

    def __call__(self, x: Array, adapters: Adapters = None, lora_scale: float = 1.0, with_lora: bool = True):
        """Returns (None, output, router_logits). Adapters do not apply to routed experts."""
        c = self.cfg
        lead = x.shape[:-1]
        flat = x.reshape(-1, c.d_model)
        logits = self.router(flat)
        weights, idx = route(c, logits)
        y = experts_forward(flat, self.experts_gate, self.experts_up, self.experts_down, weights, idx, c.n_experts)
        if c.shared_expert_d_ff:
            _, shared = self.shared_expert(flat)
            y = y + jax.nn.sigmoid(self.shared_expert_gate(flat)) * shared
        return None, y.reshape(*lead, c.d_model), logits.reshape(*lead, c.n_experts)


# --------------------------------------------------------------------------------------------
# Decoder layer
# --------------------------------------------------------------------------------------------
class DecoderLayer(nn.Module):
    """One pre-norm decoder layer, exposed as its two sub-blocks so that the slow stream
    (`models.transformer`) and the fast stream (`m2r2.fast_stream`) wire the same weights.

    Each sub-block adds `post(block(norm(x)))` to the residual x, where `post` is the identity
    except with `cfg.post_norms` (Gemma: a second RMSNorm after the sub-block, `post_attn` /
    `post_mlp`)."""

    cfg: ModelConfig

    def setup(self):
        c = self.cfg
        pd = dtype_of(c.param_dtype)
        self.attn_norm = norm_module(c)
        self.attn = Attention(c)
        self.mlp_norm = norm_module(c)
        self.mlp = MoE(c) if c.is_moe else MLP(c.d_ff, c.d_model, pd, c.mlp_activation)
        if c.post_norms:
            self.attn_post_norm = norm_module(c)
            self.mlp_post_norm = norm_module(c)

    def norm_attn(self, x):
        return self.attn_norm(x)

    def norm_mlp(self, x):
        return self.mlp_norm(x)

    def post_attn(self, u):
        """The attention sub-block's residual update from its output (`attn_out`)."""
        return self.attn_post_norm(u) if self.cfg.post_norms else u

    def post_mlp(self, u):
        """The MLP sub-block's residual update from its output (`mlp_block`)."""
        return self.mlp_post_norm(u) if self.cfg.post_norms else u

    def qkv(self, xn, positions, adapters: Adapters = None, lora_scale: float = 1.0, layer=None):
        """`layer`: this layer's index (static or traced), needed where layers differ in their
        rotary embedding (`layer_inv_freq`; Gemma 3's local and global layers)."""
        return self.attn.qkv(xn, positions, adapters, lora_scale, layer)

    def attn_out(self, a, adapters: Adapters = None, lora_scale: float = 1.0, with_lora: bool = True):
        return self.attn.out(a, adapters, lora_scale, with_lora)

    def mlp_block(self, xn, adapters: Adapters = None, lora_scale: float = 1.0, with_lora: bool = True):
        """Returns (hidden before down_proj or None for MoE, output, router_logits or None)."""
        res = self.mlp(xn, adapters, lora_scale, with_lora)
        if self.cfg.is_moe:
            return res
        return res[0], res[1], None

    def __call__(self, x, positions, layer=0):
        """Full layer without a cache (used for init)."""
        xn = self.attn_norm(x)
        q, k, v = self.qkv(xn, positions, layer=layer)
        mask = attention_mask(positions, positions, layer_window(self.cfg, layer))
        a = attend(q, heads_major(k), heads_major(v), mask, **attention_options(self.cfg))
        x = x + self.post_attn(self.attn_out(a))
        _, out, _ = self.mlp_block(self.mlp_norm(x))
        return x + self.post_mlp(out)


# A tied head's product x @ table.T with 2..FEW_ROWS_MAX rows (a verification's positions, a small
# batch's tokens) runs on CPU as a broadcast multiply summed over d (`_few_rows_product`). Why: for
# one row XLA:CPU streams the [V, d] table at copy speed, but for 2-4 rows its dot leaves that path
# and takes 2.5-3x as long, while the broadcast form reads the table once for all rows (262,144 x
# 640, 2 cores: dot 21 ms for 1 row, 63-71 ms for 2-4; broadcast 33-39 ms). For one row the broadcast
# form is 30x slower, for layer-sized or [d, V] (untied) matrices it does not pay, and below
# FEW_ROWS_MIN_TABLE elements both take microseconds: the dot is kept there. Other platforms keep the
# dot (`jax.lax.platform_dependent`: lowering keeps only the target's branch).
FEW_ROWS_MAX = 4
FEW_ROWS_MIN_TABLE = 1 << 22


def tied_head_product(x: Array, table: Array) -> Array:
    """x [..., d] @ table[V, d].T -> [..., V] in x's dtype (the tied-embedding LM head)."""
    w = table.astype(x.dtype)
    rows = math.prod(x.shape[:-1])
    if not (2 <= rows <= FEW_ROWS_MAX) or w.size < FEW_ROWS_MIN_TABLE:
        return _table_dot(x, w)
    return jax.lax.platform_dependent(x, w, cpu=_few_rows_product, default=_table_dot)


def _table_dot(x: Array, w: Array) -> Array:
    return x @ w.T


def _few_rows_product(x: Array, w: Array) -> Array:
    flat = x.reshape(-1, x.shape[-1]).astype(jnp.float32)  # accumulate in float32, as the dot does
    out = (w[None].astype(jnp.float32) * flat[:, None, :]).sum(-1)
    return out.astype(x.dtype).reshape(x.shape[:-1] + (w.shape[0],))


class Embedder(nn.Module):
    vocab_size: int
    d_model: int
    param_dtype: Any = jnp.float32

    def setup(self):
        self.embedding = self.param("embedding", _INIT, (self.vocab_size, self.d_model), self.param_dtype)

    def encode(self, tokens):
        return jnp.take(self.embedding, tokens, axis=0)

    def decode(self, x):
        return tied_head_product(x, self.embedding)

    def __call__(self, tokens):
        return self.encode(tokens)
