"""Load a base model and (optionally) its M2R2 parameters, checking they belong together."""

from __future__ import annotations

from typing import Optional

import jax

from m2r2_jax.m2r2.checkpoint import load_m2r2
from m2r2_jax.m2r2.config import M2R2Config
from m2r2_jax.m2r2.fast_stream import init_m2r2_params
from m2r2_jax.models.checkpoint import load_model, params_fingerprint


def load_base_and_m2r2(checkpoint, m2r2_checkpoint: Optional[str] = None, default: Optional[M2R2Config] = None,
                       seed: int = 0):
    """Returns (base_cfg, base_params, mcfg, m2r2_params, fresh). Without an M2R2 checkpoint the
    M2R2 parameters are freshly initialised (`fresh=True`) from `default` (or the defaults, with
    the branch layer clipped to the base's depth)."""
    base_cfg, base_params = load_model(checkpoint)
    if m2r2_checkpoint:
        mcfg, m2r2_params = load_m2r2(m2r2_checkpoint, base_cfg, params_fingerprint(base_cfg, base_params))
        return base_cfg, base_params, mcfg, m2r2_params, False
    mcfg = default or default_m2r2_config(base_cfg)
    return base_cfg, base_params, mcfg, init_m2r2_params(base_cfg, mcfg, jax.random.key(seed)), True


def default_m2r2_config(base_cfg) -> M2R2Config:
    """Default M2R2 config that fits any base depth (branch after ~1/8 of the layers, rate 2)."""
    b = min(max(1, base_cfg.n_layers // 8), base_cfg.n_layers - 1)
    return M2R2Config(branch_layer=b, rate=2).validate(base_cfg)
