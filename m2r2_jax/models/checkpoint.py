"""Saving and loading a base model: orbax parameters + the model config + (optionally) a tokenizer.

Layout of a model directory:

    DIR/model_config.json      ModelConfig as JSON
    DIR/params/                orbax checkpoint of the parameter pytree
    DIR/tokenizer/             tokenizer.model (sentencepiece) or tokenizer.json, when known, with
                               tokenizer_config.json (special tokens, chat template) and
                               generation_config.json (end-of-sequence ids) when the source has them
    DIR/fingerprint.json       shapes/dtypes hash, so dependent checkpoints (M2R2, drafts) can
                               check they belong to this base

A model is written to `DIR.tmp-*` and renamed into place, so a crash never leaves a half-written
directory under the final name.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Mapping, Optional, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp

from m2r2_jax.atomic import atomic_directory
from m2r2_jax.errors import CheckpointError
from m2r2_jax.json_files import read_json_object
from m2r2_jax.models.config import CONFIG_FILE, ModelConfig, read_model_config
from m2r2_jax.models.transformer import init_params

PARAMS_DIR = "params"
TOKENIZER_DIR = "tokenizer"
FINGERPRINT_FILE = "fingerprint.json"


# The ModelConfig fields that fingerprints have hashed from the start. A field added to ModelConfig
# later is hashed only where it differs from its default, so every model that does not use it keeps
# the fingerprint its M2R2 checkpoints recorded (the parameters shipped in m2r2_jax/pretrained/
# included); a model that does use it gets a fingerprint of its own.
FINGERPRINT_FIELDS = frozenset({
    "d_ff", "d_model", "dtype", "family", "head_dim", "max_seq_len", "moe_d_ff", "n_experts", "n_experts_per_tok",
    "n_heads", "n_kv_heads", "n_layers", "norm_topk_prob", "param_dtype", "partial_rotary_factor", "qk_norm",
    "qkv_bias", "rms_eps", "rope_scaling", "rope_theta", "shared_expert_d_ff", "sliding_window", "tie_embeddings",
    "vocab_size"})


def fingerprint_config_json(cfg: ModelConfig) -> str:
    """The config text a fingerprint hashes (see FINGERPRINT_FIELDS)."""
    d, defaults = cfg.to_dict(), ModelConfig().to_dict()
    kept = {k: v for k, v in d.items() if k in FINGERPRINT_FIELDS or v != defaults.get(k)}
    return json.dumps(kept, indent=2, sort_keys=True)


def params_fingerprint(cfg: ModelConfig, params) -> str:
    """Hash of the config and a small sample of the weights: identifies one base model."""
    h = hashlib.sha256(fingerprint_config_json(cfg).encode())
    for path, leaf in sorted(jax.tree_util.tree_flatten_with_path(params)[0], key=lambda x: str(x[0])):
        arr = np.asarray(leaf).reshape(-1)
        h.update(str(path).encode())
        h.update(str(arr.shape).encode())
        h.update(np.asarray(arr[:: max(1, arr.size // 64)], np.float32).tobytes())
    return h.hexdigest()[:16]


def save_model(directory, cfg: ModelConfig, params, tokenizer_file: Optional[str] = None, overwrite: bool = False,
               tokenizer_extras: Sequence = (), extra_files: Optional[Mapping[str, str]] = None) -> Path:
    """Write a model directory. `tokenizer_extras`: files copied beside the tokenizer file
    (tokenizer_config.json, generation_config.json, chat_template.jinja). `extra_files`: name ->
    text written at the top of the directory with the rest (a record of how the model was made)."""
    with atomic_directory(directory, overwrite) as tmp:
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        save_pytree(tmp / PARAMS_DIR, params)
        (tmp / CONFIG_FILE).write_text(cfg.to_json())
        (tmp / FINGERPRINT_FILE).write_text(json.dumps({"fingerprint": params_fingerprint(cfg, params)}))
        if tokenizer_file:
            (tmp / TOKENIZER_DIR).mkdir()
            for f in (tokenizer_file, *tokenizer_extras):
                shutil.copy(f, tmp / TOKENIZER_DIR / Path(f).name)
    return Path(directory).absolute()


def save_pytree(directory, tree) -> None:
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(directory, jax.device_get(tree))
    ckptr.wait_until_finished()


def restore_pytree(directory, abstract, what: str):
    """Restore an orbax pytree onto `abstract` (shapes/dtypes checked) as device arrays."""
    try:
        tree = ocp.StandardCheckpointer().restore(directory, abstract)
    except Exception as e:  # orbax raises many types; the user needs one line
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot restore {what} from {directory.parent}: {msg[:300]}") from None
    return jax.device_put(tree)


def load_config(directory) -> ModelConfig:
    return read_model_config(directory)


def load_fingerprint(directory) -> str:
    path = Path(directory) / FINGERPRINT_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory} has no {FINGERPRINT_FILE}")
    fingerprint = read_json_object(path).get("fingerprint")
    if not isinstance(fingerprint, str):
        raise CheckpointError(f"{path} is not a valid fingerprint file")
    return fingerprint


def load_model(directory, cfg: Optional[ModelConfig] = None):
    """Returns (cfg, params). Shapes and dtypes are checked against the config."""
    directory = Path(directory).absolute()
    cfg = cfg or load_config(directory)
    if not (directory / PARAMS_DIR).is_dir():
        raise CheckpointError(f"{directory} is not a model checkpoint: {PARAMS_DIR}/ is missing")
    abstract = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    return cfg, restore_pytree(directory / PARAMS_DIR, abstract, "parameters")


def tokenizer_path(directory) -> Optional[Path]:
    d = Path(directory) / TOKENIZER_DIR
    for name in ("tokenizer.model", "tokenizer.json"):
        if (d / name).is_file():
            return d / name
    if d.is_dir():
        files = sorted(d.iterdir())
        return files[0] if files else None
    return None
