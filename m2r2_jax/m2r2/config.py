"""M2R2 configuration: where the fast stream branches, how fast it moves, and what it trains."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Optional

from m2r2_jax.errors import ConfigError
from m2r2_jax.models.config import ModelConfig

SCHEDULES = ("strided", "consecutive")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MOE_FAST_MLP = ("experts", "lowrank", "none")
ROUTER_FEATURES = ("logits", "state")


@dataclasses.dataclass(frozen=True)
class M2R2Config:
    branch_layer: int = 2  # b: slow layers shared by both streams (computed once, exact)
    rate: int = 2  # r: slow layers' worth of change per fast step
    schedule: str = "strided"
    n_steps: int = 0  # K; 0 means ceil((N - b) / r) for strided, N - b for consecutive
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_targets: tuple = LORA_TARGETS
    router_dim: int = 64
    router_hidden: int = 64
    # what the router reads besides its trajectory: "logits" (the step's exit-head distribution:
    # max probability and entropy, plus the velocity) or "state" (the velocity only, so an early
    # exit computes the vocabulary-wide head only for tokens that leave: see router.py)
    router_features: str = "logits"
    # the router also predicts whether a later step will be safe, and m2r2_exit stops a token's fast
    # stream once neither this step nor a later one is expected to be (router.py: "Giving up")
    router_give_up: bool = False
    exit_norm: bool = True  # learned per-step scale on the frozen final norm
    moe_fast_mlp: str = "experts"  # fast MLP at MoE layers: routed experts | low-rank dense | none
    moe_lowrank_dim: int = 64
    kernel_implementation: str = "auto"  # residual-rate update: auto | xla | pallas | interpret

    @property
    def lora_scale(self) -> float:
        return self.lora_alpha / self.lora_rank

    def steps(self, base: ModelConfig) -> int:
        """K, the number of fast steps that take the stream from layer b to the last layer."""
        if self.n_steps:
            return self.n_steps
        span = base.n_layers - self.branch_layer
        return math.ceil(span / self.rate) if self.schedule == "strided" else span

    def targets(self, base: ModelConfig) -> tuple:
        """LoRA targets that exist on this base (routed experts get no LoRA: see moe_fast_mlp)."""
        return tuple(t for t in self.lora_targets if not (base.is_moe and t not in ATTN_TARGETS))

    def validate(self, base: Optional[ModelConfig] = None) -> "M2R2Config":
        """Check every field; those that depend on the base model (branch_layer, n_steps) only
        when `base` is given."""
        def fail(field, value, allowed):
            raise ConfigError(f"m2r2.{field}={value!r} is invalid: {allowed}")

        if not isinstance(self.rate, int) or self.rate < 1:
            fail("rate", self.rate, "expected an integer >= 1")
        if self.schedule not in SCHEDULES:
            fail("schedule", self.schedule, f"expected one of {', '.join(SCHEDULES)}")
        if self.schedule == "strided" and self.rate < 2 and not self.n_steps:
            fail("rate", self.rate, "the strided schedule needs rate >= 2 (rate 1 is the slow stream)")
        if not isinstance(self.branch_layer, int) or self.branch_layer < 0:
            fail("branch_layer", self.branch_layer, "expected an integer >= 0")
        if not isinstance(self.n_steps, int) or self.n_steps < 0:
            fail("n_steps", self.n_steps, "expected 0 (auto) or a positive integer")
        if base is not None:
            n = base.n_layers
            if not (0 <= self.branch_layer < n):
                fail("branch_layer", self.branch_layer, f"expected 0 <= branch_layer < n_layers={n}")
            span = n - self.branch_layer
            if self.n_steps > span:
                fail("n_steps", self.n_steps, f"expected 0 (auto) .. n_layers - branch_layer = {span}")
            if self.schedule == "strided" and self.n_steps and self.n_steps * self.rate < span:
                fail("n_steps", self.n_steps,
                     f"rate {self.rate} x {self.n_steps} steps covers {self.n_steps * self.rate} of the {span} layers after the branch")
        if not isinstance(self.lora_rank, int) or self.lora_rank <= 0:
            fail("lora_rank", self.lora_rank, "expected a positive integer")
        if not (self.lora_alpha > 0):
            fail("lora_alpha", self.lora_alpha, "expected a positive float")
        bad = [t for t in self.lora_targets if t not in LORA_TARGETS]
        if bad:
            fail("lora_targets", self.lora_targets, f"unknown targets {bad}; allowed: {', '.join(LORA_TARGETS)}")
        for name in ("router_dim", "router_hidden", "moe_lowrank_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                fail(name, getattr(self, name), "expected a positive integer")
        if not isinstance(self.router_give_up, bool):
            fail("router_give_up", self.router_give_up, "expected True or False")
        if self.router_features not in ROUTER_FEATURES:
            fail("router_features", self.router_features, f"expected one of {', '.join(ROUTER_FEATURES)}")
        if self.moe_fast_mlp not in MOE_FAST_MLP:
            fail("moe_fast_mlp", self.moe_fast_mlp, f"expected one of {', '.join(MOE_FAST_MLP)}")
        if self.kernel_implementation not in ("auto", "xla", "pallas", "interpret"):
            fail("kernel_implementation", self.kernel_implementation, "expected auto, xla, pallas or interpret")
        return self

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["lora_targets"] = list(self.lora_targets)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "M2R2Config":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"m2r2 config has unknown fields {unknown}; allowed: {sorted(known)}")
        d = dict(d)
        if "lora_targets" in d:
            d["lora_targets"] = tuple(d["lora_targets"])
        return cls(**d)


def default_m2r2_config(base: ModelConfig) -> M2R2Config:
    """The one M2R2 config every verb uses when no M2R2 checkpoint is given (fresh parameters):
    the branch after ~1/8 of the layers (at least 1, inside the model), rate 2, the rest default."""
    b = min(max(1, base.n_layers // 8), base.n_layers - 1)
    return M2R2Config(branch_layer=b, rate=2).validate(base)

