"""M2R2 checkpoints: the M2R2 parameter tree on its own, tied to the base it was trained on.

    DIR/m2r2_config.json   M2R2Config
    DIR/base.json          the base model's config and fingerprint
    DIR/params/            orbax checkpoint of the M2R2 parameters

Loading onto another base (different config or weights) is refused with one clear line.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax

from m2r2_jax.atomic import atomic_directory
from m2r2_jax.errors import CheckpointError, ConfigError
from m2r2_jax.json_files import read_json_object
from m2r2_jax.m2r2.config import M2R2Config
from m2r2_jax.m2r2.fast_stream import init_m2r2_params
from m2r2_jax.models.checkpoint import restore_pytree, save_pytree
from m2r2_jax.models.config import ModelConfig

CONFIG_FILE = "m2r2_config.json"
BASE_FILE = "base.json"
PARAMS_DIR = "params"


def save_m2r2(directory, mcfg: M2R2Config, params, base_cfg: ModelConfig, base_fingerprint: str, overwrite: bool = True) -> Path:
    with atomic_directory(directory, overwrite) as tmp:
        save_pytree(tmp / PARAMS_DIR, params)
        (tmp / CONFIG_FILE).write_text(mcfg.to_json())
        (tmp / BASE_FILE).write_text(json.dumps({"fingerprint": base_fingerprint, "config": base_cfg.to_dict()}, indent=2))
    return Path(directory).absolute()


def load_m2r2_config(directory) -> M2R2Config:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory} is not an M2R2 checkpoint: {CONFIG_FILE} is missing")
    try:
        return M2R2Config.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, ConfigError, TypeError) as e:
        raise CheckpointError(f"{path}: {e}") from None


def load_m2r2(directory, base_cfg: ModelConfig, base_fingerprint: str):
    """Returns (M2R2Config, params) after checking the checkpoint belongs to this base."""
    directory = Path(directory).absolute()
    mcfg = load_m2r2_config(directory)
    base_file = directory / BASE_FILE
    if not base_file.is_file():
        raise CheckpointError(f"{directory} is not an M2R2 checkpoint: {BASE_FILE} is missing")
    meta = read_json_object(base_file)
    if meta.get("config") != json.loads(base_cfg.to_json()):
        raise CheckpointError(f"M2R2 checkpoint {directory} was trained on a different base architecture")
    if meta.get("fingerprint") != base_fingerprint:
        raise CheckpointError(
            f"M2R2 checkpoint {directory} belongs to another base model (fingerprint {meta.get('fingerprint')}, "
            f"this base {base_fingerprint})")
    try:
        mcfg.validate(base_cfg)
    except ConfigError as e:
        raise CheckpointError(f"{directory}: {e}") from None
    abstract = jax.eval_shape(lambda: init_m2r2_params(base_cfg, mcfg, jax.random.key(0)))
    return mcfg, restore_pytree(directory / PARAMS_DIR, abstract, "M2R2 parameters")
