"""M2R2 checkpoints: the M2R2 parameter tree on its own, tied to the base it was trained on.

    DIR/m2r2_config.json   M2R2Config
    DIR/base.json          the base model's config and fingerprint
    DIR/params/            orbax checkpoint of the M2R2 parameters, or
    DIR/params.safetensors the same tree flattened ("adapters/q_proj/A", ...) in float16: the
                           portable form, small enough to ship with the project
                           (`export_portable`; m2r2_jax/pretrained/ holds such checkpoints)

Loading onto another base (different config or weights) is refused with one clear line.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

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
PORTABLE_FILE = "params.safetensors"
PORTABLE_DTYPE = np.float16  # adapters, rates and router weights are O(1e-3..10): float16 keeps ~3 digits


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


def _same_architecture(saved, base_cfg: ModelConfig) -> bool:
    """The base config saved with a checkpoint describes `base_cfg`. Read through
    `ModelConfig.from_dict`, so fields added to ModelConfig after the checkpoint was written take
    their defaults (which keep every existing family as it was) instead of making every older
    checkpoint look foreign."""
    if not isinstance(saved, dict):
        return False
    try:
        return ModelConfig.from_dict(saved) == base_cfg
    except (ConfigError, TypeError, ValueError):
        return False


def load_m2r2(directory, base_cfg: ModelConfig, base_fingerprint: str):
    """Returns (M2R2Config, params) after checking the checkpoint belongs to this base."""
    directory = Path(directory).absolute()
    mcfg = load_m2r2_config(directory)
    base_file = directory / BASE_FILE
    if not base_file.is_file():
        raise CheckpointError(f"{directory} is not an M2R2 checkpoint: {BASE_FILE} is missing")
    meta = read_json_object(base_file)
    if not _same_architecture(meta.get("config"), base_cfg):
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
    if (directory / PORTABLE_FILE).is_file():
        return mcfg, _read_portable(directory / PORTABLE_FILE, abstract)
    return mcfg, restore_pytree(directory / PARAMS_DIR, abstract, "M2R2 parameters")


def _flat_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def export_portable(src, dst, base_cfg: ModelConfig, base_fingerprint: str, overwrite: bool = False) -> Path:
    """Copy the M2R2 checkpoint `src` to `dst` in the portable form (params.safetensors, float16),
    after checking it belongs to the base. Values float16 cannot hold are refused, not clipped."""
    from safetensors.numpy import save_file

    mcfg, params = load_m2r2(src, base_cfg, base_fingerprint)
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        a = np.asarray(jax.device_get(leaf), np.float32)
        if a.size and np.abs(a).max() > np.finfo(PORTABLE_DTYPE).max:
            raise CheckpointError(f"{_flat_name(path)} of {src} holds values beyond float16's range; keep the orbax form")
        flat[_flat_name(path)] = a.astype(PORTABLE_DTYPE)
    with atomic_directory(dst, overwrite) as tmp:
        save_file(flat, str(tmp / PORTABLE_FILE))
        (tmp / CONFIG_FILE).write_text(mcfg.to_json())
        (tmp / BASE_FILE).write_text(json.dumps({"fingerprint": base_fingerprint, "config": base_cfg.to_dict()}, indent=2))
    return Path(dst).absolute()


def _read_portable(path: Path, abstract):
    """The tree `abstract` describes, read from a portable file (names and shapes checked, cast to
    the abstract dtypes)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        flat = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"cannot read M2R2 parameters from {path}: {str(e).splitlines()[0][:200]}") from None
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    names = [_flat_name(p) for p, _ in leaves]
    missing, extra = sorted(set(names) - set(flat)), sorted(set(flat) - set(names))
    if missing or extra:
        what = f"missing {missing[0]}" if missing else f"unexpected {extra[0]}"
        raise CheckpointError(f"M2R2 parameters in {path} do not fit the config: {what}")
    out = []
    for name, (_, leaf) in zip(names, leaves):
        if flat[name].shape != tuple(leaf.shape):
            raise CheckpointError(f"M2R2 parameters in {path}: {name} has shape {flat[name].shape}, "
                                  f"the config needs {tuple(leaf.shape)}")
        out.append(jax.device_put(flat[name].astype(leaf.dtype)))
    return jax.tree_util.tree_unflatten(treedef, out)
