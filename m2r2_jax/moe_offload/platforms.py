"""Named platforms and named real MoE model shapes for the trace-replay simulator.

Every number here is an *assumption*, written down so that the benchmark JSON can state it:

* Model shapes are the published dimensions of the real checkpoints (Hugging Face config.json of
  mistralai/Mixtral-8x7B-v0.1 and allenai/OLMoE-1B-7B-0924), weights in bfloat16.
* Per-layer compute time of batch-1 decoding is modelled as memory-bound: the bytes of the weights a
  layer reads for one token (attention projections + router + the k active experts) divided by the
  device's achieved memory bandwidth, plus a fixed per-layer overhead (kernel launches).
* A link moves one expert in `latency + bytes / bandwidth` and carries one transfer at a time.

The ratio rho = expert transfer time / layer compute time says which regime a platform is in:
rho >> 1 is link-bound (only fewer transfers help), rho ~ 1 lets prefetching hide transfers.
"""

from __future__ import annotations

import dataclasses

from m2r2_jax.errors import ConfigError

BF16 = 2


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    moe_d_ff: int
    n_experts: int
    n_experts_per_tok: int
    bytes_per_param: int = BF16
    source: str = ""

    @property
    def expert_bytes(self) -> int:
        """gate + up + down of one SwiGLU expert."""
        return 3 * self.d_model * self.moe_d_ff * self.bytes_per_param

    @property
    def attn_bytes(self) -> int:
        q_o = 2 * self.d_model * self.n_heads * self.head_dim
        k_v = 2 * self.d_model * self.n_kv_heads * self.head_dim
        return (q_o + k_v) * self.bytes_per_param

    @property
    def router_bytes(self) -> int:
        return self.d_model * self.n_experts * self.bytes_per_param


@dataclasses.dataclass(frozen=True)
class Platform:
    name: str
    description: str
    link_gbps: float  # GB/s (1e9 bytes/s) of the slow-memory -> device link
    link_latency_s: float
    device: str  # the compute device assumed next to this link
    device_mem_gbps: float  # peak memory bandwidth of that device
    mem_efficiency: float  # fraction of the peak a decode step achieves
    layer_overhead_s: float  # fixed per-layer cost (launches, sync)


MODEL_SHAPES = {
    "mixtral-8x7b": ModelShape("mixtral-8x7b", 4096, 32, 32, 8, 128, 14336, 8, 2,
                               source="mistralai/Mixtral-8x7B-v0.1 config.json, bf16"),
    "olmoe-1b-7b": ModelShape("olmoe-1b-7b", 2048, 16, 16, 16, 128, 1024, 64, 8,
                              source="allenai/OLMoE-1B-7B-0924 config.json, bf16"),
}

PLATFORMS = {
    "phone_flash": Platform("phone_flash", "phone: experts in UFS 4.0 flash (2-4 GB/s; 3 GB/s assumed)",
                            3.0, 100e-6, "phone SoC, LPDDR5X 76.8 GB/s peak", 76.8, 0.6, 50e-6),
    "pcie_gen4": Platform("pcie_gen4", "GPU, experts in pinned host memory over PCIe Gen4 x16 (~25 GB/s achieved)",
                          25.0, 10e-6, "A100-80GB, HBM2e 2039 GB/s peak", 2039.0, 0.7, 10e-6),
    "pcie_gen5": Platform("pcie_gen5", "GPU, experts in pinned host memory over PCIe Gen5 x16 (~50 GB/s achieved)",
                          50.0, 10e-6, "H100-SXM, HBM3 3350 GB/s peak", 3350.0, 0.7, 10e-6),
    "nvlink_c2c": Platform("nvlink_c2c", "GH200: experts in Grace LPDDR5X over NVLink-C2C (~450 GB/s per direction)",
                           450.0, 5e-6, "GH200 Hopper, HBM3 4000 GB/s peak", 4000.0, 0.7, 10e-6),
}


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Per-op times (seconds) and the link, as the simulator consumes them."""

    attn_s: float  # attention sub-block + router of one slow layer
    moe_s: float  # the k active experts of one slow layer
    fast_attn_s: float  # one fast step's attention sub-block (base weights + adapters)
    fast_mlp_s: float  # one fast step's MLP at an MoE layer (depends on moe_fast_mlp)
    expert_bytes: int
    link_latency_s: float
    link_bytes_per_s: float

    @property
    def transfer_s(self) -> float:
        return self.link_latency_s + self.expert_bytes / self.link_bytes_per_s

    @property
    def layer_s(self) -> float:
        return self.attn_s + self.moe_s

    @property
    def rho(self) -> float:
        return self.transfer_s / self.layer_s

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(transfer_s=self.transfer_s, layer_s=self.layer_s, rho=self.rho)
        return d


def get_shape(name: str) -> ModelShape:
    if name not in MODEL_SHAPES:
        raise ConfigError(f"model shape {name!r} is unknown: expected one of {', '.join(MODEL_SHAPES)}")
    return MODEL_SHAPES[name]


def get_platform(name: str) -> Platform:
    if name not in PLATFORMS:
        raise ConfigError(f"platform {name!r} is unknown: expected one of {', '.join(PLATFORMS)}")
    return PLATFORMS[name]


def platform_costs(shape: ModelShape, platform: Platform, moe_fast_mlp: str = "experts",
                   adapter_overhead: float = 0.0, lowrank_dim: int = 64,
                   link_gbps: float | None = None) -> CostModel:
    """Cost model of `shape` decoding on `platform` (optionally with another link bandwidth).

    `adapter_overhead` is the fast step's extra cost as a fraction of an attention sub-block
    (LoRA terms); the fast MLP costs the k experts ("experts"), a d -> lowrank_dim -> d dense
    adapter ("lowrank") or nothing ("none")."""
    bw = platform.device_mem_gbps * 1e9 * platform.mem_efficiency
    attn_s = (shape.attn_bytes + shape.router_bytes) / bw + platform.layer_overhead_s / 2
    moe_s = shape.n_experts_per_tok * shape.expert_bytes / bw + platform.layer_overhead_s / 2
    fast_attn_s = attn_s * (1.0 + adapter_overhead)
    if moe_fast_mlp == "experts":
        fast_mlp_s = moe_s
    elif moe_fast_mlp == "lowrank":
        fast_mlp_s = 2 * shape.d_model * lowrank_dim * shape.bytes_per_param / bw + platform.layer_overhead_s / 2
    elif moe_fast_mlp == "none":
        fast_mlp_s = 0.0
    else:
        raise ConfigError(f"moe_fast_mlp={moe_fast_mlp!r} is invalid: expected experts, lowrank or none")
    return CostModel(attn_s, moe_s, fast_attn_s, fast_mlp_s, shape.expert_bytes, platform.link_latency_s,
                     (link_gbps if link_gbps is not None else platform.link_gbps) * 1e9)


def assumptions() -> dict:
    """Every platform and model-shape assumption, for the benchmark JSON."""
    return {
        "compute_model": "batch-1 decode is memory-bound: layer time = bytes read (attention + router + k active "
                         "experts, bf16) / (device peak memory bandwidth x efficiency) + fixed per-layer overhead",
        "link_model": "one transfer at a time (FIFO); one expert costs latency + expert_bytes / link bandwidth",
        "model_shapes": {k: dict(dataclasses.asdict(v), expert_bytes=v.expert_bytes, attn_bytes=v.attn_bytes)
                         for k, v in MODEL_SHAPES.items()},
        "platforms": {k: dataclasses.asdict(v) for k, v in PLATFORMS.items()},
    }
