"""The named sharding presets (`configs/sharding/` re-exports them) and preset loading.

A preset is a ConfigDict with `name`, a default `mesh` spec and `rules`: one (logical axis, mesh
axes) pair per logical axis of `rules.LOGICAL_AXES`.

train    FSDP + tensor parallelism: the batch over data x fsdp; every weight's embed dimension
         over fsdp and its heads / mlp / vocab dimension over tensor; experts over expert. The
         frozen base, the trainable M2R2 parameters and the optimiser state (which follows its
         parameters) are all sharded, so no device holds a whole copy of anything large.
specdec  serving: weights tensor-parallel (heads / mlp / vocab over tensor, experts over expert),
         the batch over data, the KV cache over data (batch) and tensor (kv heads). Nothing is
         sharded over fsdp, so the per-token latency has no weight all-gathers.
"""

from __future__ import annotations

from pathlib import Path

import ml_collections

from m2r2_jax.errors import ConfigError

PRESETS = ("train", "specdec")

# Shared by both presets: the model-parallel part (the rest differs).
_TENSOR = [
    ("vocab", "tensor"), ("q_heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"),
    ("experts", "expert"), ("layers", None), ("norm", None), ("expert_logits", None), ("fast_steps", None),
    ("lora_rank", None), ("length", None), ("act_embed", None), ("act_vocab", "tensor"), ("act_heads", "tensor"),
    ("head_dim", None), ("cache_length", None), ("cache_heads", "tensor"),
]


def _preset(name: str, mesh: str, rules: list) -> ml_collections.ConfigDict:
    cfg = ml_collections.ConfigDict()
    cfg.name = name
    cfg.mesh = mesh
    cfg.rules = [list(r) for r in rules]
    return cfg


def train_preset() -> ml_collections.ConfigDict:
    return _preset("train", "fsdp=-1", _TENSOR + [
        ("batch", ("data", "fsdp")), ("cache_batch", ("data", "fsdp")), ("embed", "fsdp"),
    ])


def specdec_preset() -> ml_collections.ConfigDict:
    return _preset("specdec", "tensor=-1", _TENSOR + [
        ("batch", "data"), ("cache_batch", "data"), ("embed", None),
    ])


def load_preset(preset) -> ml_collections.ConfigDict:
    """`train`, `specdec`, a path to a preset file (`get_config()` returning such a ConfigDict),
    or a ConfigDict already."""
    if isinstance(preset, ml_collections.ConfigDict):
        cfg = preset
    elif preset == "train":
        cfg = train_preset()
    elif preset == "specdec":
        cfg = specdec_preset()
    elif isinstance(preset, (str, Path)) and str(preset).endswith(".py"):
        from m2r2_jax.training.config import load_config_file

        path = Path(preset)
        if not path.is_file():
            raise ConfigError(f"sharding preset file {path} does not exist")
        try:
            cfg = load_config_file(path)
        except ConfigError:
            raise
        except Exception as e:  # a user's file: report its error in one line
            raise ConfigError(f"cannot load sharding preset {path}: {type(e).__name__}: {e}") from None
    else:
        raise ConfigError(f"sharding preset {preset!r} is invalid: expected one of {', '.join(PRESETS)} "
                          "or a path to a preset .py file")
    for field in ("name", "mesh", "rules"):
        if field not in cfg:
            raise ConfigError(f"sharding preset {preset!r} has no field {field!r}")
    return cfg
