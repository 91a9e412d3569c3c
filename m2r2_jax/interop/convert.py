"""Hugging Face and GGUF checkpoints <-> model checkpoint (`m2r2_jax.models.checkpoint`).

    convert_hf(hf_dir, out_dir, dtype=None)   config.json + safetensors -> model checkpoint
    convert_gguf(path, out_dir, dtype=None)   a llama.cpp GGUF file -> model checkpoint
    export_hf(ckpt_dir, out_dir)              model checkpoint -> config.json + safetensors
    load_hf(hf_dir, dtype=None)               (cfg, params) in memory, without writing anything

From a Hugging Face directory the tokenizer file (`tokenizer.model`, else `tokenizer.json`) is
copied as is when present, with tokenizer_config.json, generation_config.json (end-of-sequence
ids) and chat_template.jinja beside it. From a GGUF file the tokenizer is rebuilt from the
file's metadata (`gguf_tokenizer`).
"""

from __future__ import annotations

import json

import shutil

from pathlib import Path
from typing import Optional, Union

from m2r2_jax.atomic import atomic_directory
from m2r2_jax.errors import CheckpointError
from m2r2_jax.interop.hf_config import hf_config_dict, read_config_json, config_from_hf
from m2r2_jax.interop.safetensors_io import (DEFAULT_MAX_SHARD_SIZE, params_to_hf, parse_size, read_params,
                                             write_safetensors)
from m2r2_jax.models.config import ModelConfig

TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json")
# Kept beside the tokenizer: special tokens and chat template, stop ids, a separate template file.
TOKENIZER_EXTRAS = ("tokenizer_config.json", "generation_config.json", "chat_template.jinja")


def _hf_dir(hf_dir) -> Path:
    d = Path(hf_dir)
    if not d.is_dir():
        raise CheckpointError(f"{d} is not a directory (expected a Hugging Face model directory)")
    return d


def load_hf(hf_dir, dtype: Optional[str] = None) -> tuple[ModelConfig, dict]:
    """Read a Hugging Face model directory: returns (cfg, params) with numpy parameters."""
    d = _hf_dir(hf_dir)
    cfg = config_from_hf(read_config_json(d), dtype)
    return cfg, read_params(cfg, d)


def tokenizer_file(hf_dir) -> Optional[Path]:
    for name in TOKENIZER_FILES:
        p = Path(hf_dir) / name
        if p.is_file():
            return p
    return None


def convert_hf(hf_dir, out_dir, dtype: Optional[str] = None, overwrite: bool = False) -> Path:
    """Convert a Hugging Face checkpoint into a model checkpoint at `out_dir`. `dtype` (float32,
    bfloat16, float16) defaults to the dtype recorded in config.json."""
    out = Path(out_dir)
    if out.exists() and not overwrite:  # fail before reading gigabytes
        raise CheckpointError(f"{out.absolute()} already exists (pass overwrite/--force to replace it)")
    cfg, params = load_hf(hf_dir, dtype)
    from m2r2_jax.models.checkpoint import save_model  # (imports jax and orbax)

    tok = tokenizer_file(hf_dir)
    extras = [p for p in (Path(hf_dir) / n for n in TOKENIZER_EXTRAS) if p.is_file()] if tok else []
    return save_model(out, cfg, params, tokenizer_file=str(tok) if tok else None, overwrite=overwrite,
                      tokenizer_extras=extras)


def convert_gguf(path, out_dir, dtype: Optional[str] = None, overwrite: bool = False) -> Path:
    """Convert a GGUF file (`gguf_io`: llama / qwen2 / gemma3 architectures, any quantisation the gguf
    package dequantises) into a model checkpoint at `out_dir`, with the tokenizer rebuilt from its
    metadata. `dtype` defaults to float32, which keeps the dequantised weights exact."""
    import tempfile

    from m2r2_jax.interop.gguf_io import load_gguf
    from m2r2_jax.interop.gguf_tokenizer import write_gguf_tokenizer

    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out.absolute()} already exists (pass overwrite/--force to replace it)")
    cfg, params, g = load_gguf(path, dtype)
    from m2r2_jax.models.checkpoint import save_model

    with tempfile.TemporaryDirectory() as tmp:
        tok, *extras = write_gguf_tokenizer(g, tmp)  # checked before anything is written under `out`
        return save_model(out, cfg, params, tokenizer_file=str(tok), overwrite=overwrite, tokenizer_extras=extras)


def write_hf(cfg: ModelConfig, params, out_dir, max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
             tokenizer: Optional[Path] = None, overwrite: bool = False) -> Path:
    """Write (cfg, params) as a Hugging Face directory: config.json + safetensors in the hub layout
    (sharded with an index above `max_shard_size`) + the tokenizer file if given, with the
    `TOKENIZER_EXTRAS` found beside it. Written to a
    temporary directory and renamed into place."""
    limit = parse_size(max_shard_size)
    out = Path(out_dir).absolute()
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out} already exists (pass overwrite/--force to replace it)")
    config = hf_config_dict(cfg)  # refuses what transformers cannot express, before writing
    tensors = params_to_hf(cfg, params)
    with atomic_directory(out, overwrite) as tmp:
        write_safetensors(tensors, tmp, limit)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if tokenizer is not None:
            for f in (tokenizer, *(Path(tokenizer).parent / n for n in TOKENIZER_EXTRAS)):
                if Path(f).is_file():
                    shutil.copy(f, tmp / Path(f).name)
    return out


def export_hf(ckpt_dir, out_dir, max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
              overwrite: bool = False) -> Path:
    """Export a model checkpoint as a Hugging Face directory (see `write_hf`), with the
    checkpoint's tokenizer file when it has one."""
    from m2r2_jax.models.checkpoint import load_model, tokenizer_path

    parse_size(max_shard_size)
    out = Path(out_dir).absolute()
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out} already exists (pass overwrite/--force to replace it)")
    cfg, params = load_model(ckpt_dir)
    return write_hf(cfg, params, out, max_shard_size, tokenizer_path(ckpt_dir), overwrite)


__all__ = ["load_hf", "convert_hf", "convert_gguf", "export_hf", "write_hf", "tokenizer_file"]
