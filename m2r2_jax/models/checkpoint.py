"""Saving and loading a base model: orbax parameters + the model config + (optionally) a tokenizer.

Layout of a model directory:

    DIR/model_config.json      ModelConfig as JSON
    DIR/params/                orbax checkpoint of the parameter pytree
    DIR/tokenizer/             tokenizer.model (sentencepiece) or tokenizer.json, when known
    DIR/fingerprint.json       shapes/dtypes hash, so dependent checkpoints (M2R2, drafts) can
                               check they belong to this base

A model is written to `DIR.tmp-*` and renamed into place, so a crash never leaves a half-written
directory under the final name.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

from m2r2_jax.errors import CheckpointError, ConfigError
from m2r2_jax.models.config import ModelConfig
from m2r2_jax.models.transformer import init_params

CONFIG_FILE = "model_config.json"
PARAMS_DIR = "params"
TOKENIZER_DIR = "tokenizer"
FINGERPRINT_FILE = "fingerprint.json"


def params_fingerprint(cfg: ModelConfig, params) -> str:
    """Hash of the config and a small sample of the weights: identifies one base model."""
    h = hashlib.sha256(cfg.to_json().encode())
    for path, leaf in sorted(jax.tree_util.tree_flatten_with_path(params)[0], key=lambda x: str(x[0])):
        arr = np.asarray(leaf).reshape(-1)
        h.update(str(path).encode())
        h.update(str(arr.shape).encode())
        h.update(np.asarray(arr[:: max(1, arr.size // 64)], np.float32).tobytes())
    return h.hexdigest()[:16]


def save_model(directory, cfg: ModelConfig, params, tokenizer_file: Optional[str] = None, overwrite: bool = False) -> Path:
    out = Path(directory).absolute()
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out} already exists (pass overwrite/--force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(tmp / PARAMS_DIR, jax.device_get(params))
        ckptr.wait_until_finished()
        (tmp / CONFIG_FILE).write_text(cfg.to_json())
        (tmp / FINGERPRINT_FILE).write_text(json.dumps({"fingerprint": params_fingerprint(cfg, params)}))
        if tokenizer_file:
            (tmp / TOKENIZER_DIR).mkdir()
            shutil.copy(tokenizer_file, tmp / TOKENIZER_DIR / Path(tokenizer_file).name)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_config(directory) -> ModelConfig:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory} is not a model checkpoint: {CONFIG_FILE} is missing")
    try:
        return ModelConfig.from_dict(json.loads(path.read_text())).validate()
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{path}: {e}") from None


def load_fingerprint(directory) -> str:
    path = Path(directory) / FINGERPRINT_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory} has no {FINGERPRINT_FILE}")
    return json.loads(path.read_text())["fingerprint"]


def load_model(directory, cfg: Optional[ModelConfig] = None):
    """Returns (cfg, params). Shapes and dtypes are checked against the config."""
    directory = Path(directory).absolute()
    cfg = cfg or load_config(directory)
    if not (directory / PARAMS_DIR).is_dir():
        raise CheckpointError(f"{directory} is not a model checkpoint: {PARAMS_DIR}/ is missing")
    abstract = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    try:
        params = ocp.StandardCheckpointer().restore(directory / PARAMS_DIR, abstract)
    except Exception as e:  # orbax raises many types; the user needs one line
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot restore parameters from {directory}: {msg[:300]}") from None
    return cfg, jax.device_put(params)


def tokenizer_path(directory) -> Optional[Path]:
    d = Path(directory) / TOKENIZER_DIR
    for name in ("tokenizer.model", "tokenizer.json"):
        if (d / name).is_file():
            return d / name
    if d.is_dir():
        files = sorted(d.iterdir())
        return files[0] if files else None
    return None
