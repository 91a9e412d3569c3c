"""Model configuration: one dataclass describes every supported decoder family.

Families differ only by configuration and a few small hooks (qkv bias, q/k norms, MoE routing
normalisation, a shared expert; for Gemma 3: interleaved local/global attention layers, norms after
each sub-block, zero-centred norm weights, GeGLU, scaled embeddings, logit soft-capping), so a single
implementation in `transformer.py` serves them all.
The config is a frozen, hashable dataclass so it can be a static argument of `jax.jit`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

from m2r2_jax.errors import CheckpointError, ConfigError

DENSE_FAMILIES = ("llama", "mistral", "qwen2", "phi3", "gemma3")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "olmoe")
FAMILIES = DENSE_FAMILIES + MOE_FAMILIES
ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = ("float32", "bfloat16", "float16")
# Attention kinds of `ModelConfig.layer_types` (the names transformers uses)
LAYER_TYPES = ("full_attention", "sliding_attention")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")  # SwiGLU; GeGLU with tanh-approximated GELU (gelu_pytorch_tanh)
# How an MoE layer weighs its selected experts' outputs: "softmax" (the top-k router probabilities,
# renormalised when norm_topk_prob: every trained MoE family) or "none" (a plain sum, weight 1 each:
# a dense MLP split into experts, `moe_offload.moefy`, whose experts partition the dense output).
ROUTER_WEIGHTS = ("softmax", "none")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str = "llama"
    vocab_size: int = 32000
    d_model: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32
    head_dim: int = 128
    d_ff: int = 11008
    max_seq_len: int = 4096
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    partial_rotary_factor: float = 1.0
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False  # RMSNorm of q and k: over the full projections (OLMoE) or per head (below)
    sliding_window: Optional[int] = None
    # Per-layer attention kind ("full_attention" | "sliding_attention"), one per layer; empty: every
    # layer alike (then `sliding_window`, if set, applies to all of them). With layer_types only the
    # sliding layers use the window.
    layer_types: tuple = ()
    # RoPE base of the sliding layers (default rotary, no scaling; None: the global rotary, i.e.
    # rope_theta + rope_scaling, as every layer uses). Gemma 3: 10,000 local vs 1,000,000 global.
    rope_local_theta: Optional[float] = None
    qk_norm_per_head: bool = False  # with qk_norm: RMSNorm over each head's head_dim (Gemma 3, Qwen3)
    norm_unit_offset: bool = False  # RMSNorm weights zero-centred: x * (1 + w), applied in float32 (Gemma)
    post_norms: bool = False  # a norm after each sub-block, before the residual add (Gemma 2/3)
    mlp_activation: str = "silu"  # the gated MLP's activation: silu (SwiGLU) | gelu_tanh (GeGLU)
    scale_embeddings: bool = False  # embeddings times sqrt(d_model), rounded to the parameter dtype (Gemma)
    query_pre_attn_scalar: Optional[float] = None  # attention scale query_pre_attn_scalar**-0.5 (None: head_dim)
    attn_logit_softcap: Optional[float] = None  # attention scores -> cap * tanh(scores / cap)
    final_logit_softcap: Optional[float] = None  # LM-head logits -> cap * tanh(logits / cap)
    # MoE (n_experts == 0 means a dense MLP)
    n_experts: int = 0
    n_experts_per_tok: int = 0
    moe_d_ff: int = 0
    norm_topk_prob: bool = True
    shared_expert_d_ff: int = 0  # Qwen2-MoE shared expert (with a sigmoid gate)
    router_weights: str = "softmax"  # see ROUTER_WEIGHTS
    # numerics
    dtype: str = "float32"  # compute dtype of activations and the KV cache
    param_dtype: str = "float32"

    def __post_init__(self):
        if isinstance(self.layer_types, list):  # from JSON; a tuple keeps the config hashable
            object.__setattr__(self, "layer_types", tuple(self.layer_types))

    # -- derived -----------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def layer_window(self, i: int) -> Optional[int]:
        """The attention window of layer i (None: full causal attention)."""
        if not self.layer_types:
            return self.sliding_window
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    @property
    def layer_windows(self) -> tuple:
        return tuple(self.layer_window(i) for i in range(self.n_layers))

    @property
    def uniform_layers(self) -> bool:
        """Every layer attends alike (same window, same rotary): the layer index never matters."""
        if len(set(self.layer_windows)) > 1:
            return False
        return self.rope_local_theta is None or "sliding_attention" not in self.layer_types

    def local_rope(self, i: int) -> bool:
        """Layer i uses the local rotary embedding (`rope_local_theta`)."""
        return (self.rope_local_theta is not None and bool(self.layer_types)
                and self.layer_types[i] == "sliding_attention")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    # -- validation --------------------------------------------------------------------------
    def validate(self) -> "ModelConfig":
        def fail(field, value, allowed):
            raise ConfigError(f"model.{field}={value!r} is invalid: {allowed}")

        if self.family not in FAMILIES:
            fail("family", self.family, f"expected one of {', '.join(FAMILIES)}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                fail(name, value, "expected a positive integer")
        if self.n_heads % self.n_kv_heads:
            fail("n_kv_heads", self.n_kv_heads, f"must divide n_heads={self.n_heads}")
        if not self.is_moe and (not isinstance(self.d_ff, int) or self.d_ff <= 0):
            fail("d_ff", self.d_ff, "expected a positive integer for a dense model")
        if not (self.rms_eps > 0):
            fail("rms_eps", self.rms_eps, "expected a positive float")
        if not (self.rope_theta > 0):
            fail("rope_theta", self.rope_theta, "expected a positive float")
        if self.rope_scaling.rope_type not in ROPE_TYPES:
            fail("rope_scaling.rope_type", self.rope_scaling.rope_type, f"expected one of {', '.join(ROPE_TYPES)}")
        if not (self.rope_scaling.factor > 0):
            fail("rope_scaling.factor", self.rope_scaling.factor, "expected a positive float")
        if not (0.0 < self.partial_rotary_factor <= 1.0) or self.rotary_dim % 2:
            fail("partial_rotary_factor", self.partial_rotary_factor, "expected (0, 1] giving an even rotary dim")
        if self.sliding_window is not None and self.sliding_window <= 0:
            fail("sliding_window", self.sliding_window, "expected a positive integer or None")
        if not isinstance(self.layer_types, tuple):
            fail("layer_types", self.layer_types, "expected a list of layer kinds")
        if self.layer_types:
            if len(self.layer_types) != self.n_layers:
                fail("layer_types", self.layer_types, f"expected one entry per layer ({self.n_layers})")
            bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
            if bad:
                fail("layer_types", bad, f"expected entries of {', '.join(LAYER_TYPES)}")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                fail("sliding_window", None, "sliding_attention layers need a window")
        if self.rope_local_theta is not None and not (self.rope_local_theta > 0):
            fail("rope_local_theta", self.rope_local_theta, "expected a positive float or None")
        if self.qk_norm_per_head and not self.qk_norm:
            fail("qk_norm_per_head", self.qk_norm_per_head, "needs qk_norm=True")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            fail("mlp_activation", self.mlp_activation, f"expected one of {', '.join(MLP_ACTIVATIONS)}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or
                                      not value > 0):
                fail(name, value, "expected a positive number or None")
        if self.n_experts < 0:
            fail("n_experts", self.n_experts, "expected >= 0")
        if self.is_moe:
            if not (0 < self.n_experts_per_tok <= self.n_experts):
                fail("n_experts_per_tok", self.n_experts_per_tok, f"expected 1..n_experts={self.n_experts}")
            if self.moe_d_ff <= 0:
                fail("moe_d_ff", self.moe_d_ff, "expected a positive integer for an MoE model")
            if self.family not in MOE_FAMILIES:
                fail("family", self.family, f"n_experts > 0 needs an MoE family ({', '.join(MOE_FAMILIES)})")
            # The MoE-only paths (expert offloading, the fast stream's MoE MLP) compute the
            # Llama-style layer: none of the Gemma layer options there.
            for name, off in (("post_norms", False), ("norm_unit_offset", False), ("mlp_activation", "silu"),
                              ("query_pre_attn_scalar", None), ("attn_logit_softcap", None)):
                if getattr(self, name) != off:
                    fail(name, getattr(self, name), f"not supported for an MoE model (expected {off!r})")
            if not self.uniform_layers:
                fail("layer_types", self.layer_types, "layers of one MoE model must attend alike")
        elif self.family in MOE_FAMILIES:
            fail("n_experts", self.n_experts, f"family {self.family} is MoE: expected n_experts > 0")
        if self.shared_expert_d_ff < 0:
            fail("shared_expert_d_ff", self.shared_expert_d_ff, "expected >= 0")
        if self.router_weights not in ROUTER_WEIGHTS:
            fail("router_weights", self.router_weights, f"expected one of {', '.join(ROUTER_WEIGHTS)}")
        if self.router_weights != "softmax" and not self.is_moe:
            fail("router_weights", self.router_weights, "only an MoE model weighs experts (n_experts > 0)")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                fail(name, getattr(self, name), f"expected one of {', '.join(DTYPES)}")
        return self

    # -- (de)serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"model config has unknown fields {unknown}; allowed: {sorted(known)}")
        rs = d.get("rope_scaling")
        if isinstance(rs, dict):
            rs_known = {f.name for f in dataclasses.fields(RopeScaling)}
            bad = sorted(set(rs) - rs_known)
            if bad:
                raise ConfigError(f"model.rope_scaling has unknown fields {bad}; allowed: {sorted(rs_known)}")
            d["rope_scaling"] = RopeScaling(**rs)
        elif rs is None:
            d["rope_scaling"] = RopeScaling()
        if isinstance(d.get("layer_types"), list):
            d["layer_types"] = tuple(d["layer_types"])
        return cls(**d)

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


CONFIG_FILE = "model_config.json"


def read_model_config(directory) -> ModelConfig:
    """The validated ModelConfig of a model checkpoint directory (no jax import: CLI verbs check
    their inputs with it before paying for JAX start-up)."""
    from pathlib import Path

    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory} is not a model checkpoint: {CONFIG_FILE} is missing")
    from m2r2_jax.json_files import read_json_object

    data = read_json_object(path)
    try:
        return ModelConfig.from_dict(data).validate()
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{path}: {e}") from None
