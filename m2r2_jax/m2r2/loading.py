"""Load a base model and (optionally) its M2R2 parameters, checking they belong together."""

from __future__ import annotations

from typing import Optional

import jax

from m2r2_jax.m2r2.checkpoint import load_m2r2
from m2r2_jax.m2r2.config import M2R2Config, default_m2r2_config
from m2r2_jax.m2r2.fast_stream import init_m2r2_params
from m2r2_jax.models.checkpoint import load_model, params_fingerprint


def load_base_and_m2r2(checkpoint, m2r2_checkpoint: Optional[str] = None, default: Optional[M2R2Config] = None,
                       seed: int = 0):
    """Returns (base_cfg, base_params, mcfg, m2r2_params, fresh). Without an M2R2 checkpoint the
    M2R2 parameters are freshly initialised (`fresh=True`) from `default` (or
    `m2r2.config.default_m2r2_config`, the one every verb uses)."""
    base_cfg, base_params = load_model(checkpoint)
    if m2r2_checkpoint:
        mcfg, m2r2_params = load_m2r2(m2r2_checkpoint, base_cfg, params_fingerprint(base_cfg, base_params))
        return base_cfg, base_params, mcfg, m2r2_params, False
    mcfg = default or default_m2r2_config(base_cfg)
    return base_cfg, base_params, mcfg, init_m2r2_params(base_cfg, mcfg, jax.random.key(seed)), True
