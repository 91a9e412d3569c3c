"""Model configuration: one dataclass describes every supported decoder family.

Families differ only by configuration and a few small hooks (qkv bias, q/k norms, MoE routing
normalisation, a shared expert), so a single implementation in `transformer.py` serves them all.
The config is a frozen, hashable dataclass so it can be a static argument of `jax.jit`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

from m2r2_jax.errors import CheckpointError, ConfigError

DENSE_FAMILIES = ("llama", "mistral", "qwen2", "phi3")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "olmoe")
FAMILIES = DENSE_FAMILIES + MOE_FAMILIES
ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = ("float32", "bfloat16", "float16")




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
    qk_norm: bool = False  # OLMoE: RMSNorm over the full q and k projections
    sliding_window: Optional[int] = None
    # MoE (n_experts == 0 means a dense MLP)
    n_experts: int = 0
    n_experts_per_tok: int = 0
    moe_d_ff: int = 0
    norm_topk_prob: bool = True
    shared_expert_d_ff: int = 0  # Qwen2-MoE shared expert (with a sigmoid gate)
    # numerics
    dtype: str = "float32"  # compute dtype of activations and the KV cache
    param_dtype: str = "float32"

    # -- derived -----------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

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
        if self.n_experts < 0:
            fail("n_experts", self.n_experts, "expected >= 0")
        if self.is_moe:
            if not (0 < self.n_experts_per_tok <= self.n_experts):
                fail("n_experts_per_tok", self.n_experts_per_tok, f"expected 1..n_experts={self.n_experts}")
            if self.moe_d_ff <= 0:
                fail("moe_d_ff", self.moe_d_ff, "expected a positive integer for an MoE model")
            if self.family not in MOE_FAMILIES:
                fail("family", self.family, f"n_experts > 0 needs an MoE family ({', '.join(MOE_FAMILIES)})")
        elif self.family in MOE_FAMILIES:
            fail("n_experts", self.n_experts, f"family {self.family} is MoE: expected n_experts > 0")
        if self.shared_expert_d_ff < 0:
            fail("shared_expert_d_ff", self.shared_expert_d_ff, "expected >= 0")
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
