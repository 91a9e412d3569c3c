"""Experiment configs: `base_config()` defaults and `validate_config()`.

A config is an `ml_collections.ConfigDict` with three sections:

    model   fields of `m2r2_jax.models.config.ModelConfig` (rope_scaling as a nested dict)
    train   optimiser, schedule, checkpointing and logging of `m2r2_jax.training.loop.train`
    data    corpus source, tokenizer and packing of `m2r2_jax.data.pipeline`

Config files under `configs/` start from `base_config()` and override what they need. The defaults
live in the package (not only in `configs/base.py`) so an installed package can build them.
`validate_config(cfg)` checks every field and the rules that tie fields together and raises one
`ConfigError` naming the field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import ml_collections

from m2r2_jax.errors import ConfigError
from m2r2_jax.models.config import ModelConfig, RopeScaling

NONFINITE_POLICIES = ("stop", "skip")
DATA_SOURCES = ("embedded", "text", "jsonl", "tfds")
DATA_SPLITS = ("train", "heldout", "all")
TOKENIZER_TYPES = ("bpe", "unigram")


def model_section(**overrides) -> ml_collections.ConfigDict:
    d = dataclasses.asdict(ModelConfig())
    d.update(overrides)
    return ml_collections.ConfigDict(d)


def train_section() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(
        steps=1000,                 # total optimiser steps of the run
        batch_size=16,              # global batch (sequences); split evenly across hosts
        learning_rate=3e-3,         # peak of the warmup-cosine schedule
        warmup_steps=50,
        min_lr_ratio=0.1,           # final lr = learning_rate * min_lr_ratio
        weight_decay=0.1,           # AdamW; applied to matrices only (not norms / biases / vectors)
        b1=0.9,
        b2=0.95,
        eps=1e-8,
        grad_clip=1.0,              # global-norm clipping; 0 disables
        seed=0,                     # parameter init and per-step rngs
        checkpoint_every=200,       # steps between checkpoints (and one at the end)
        keep_checkpoints=2,
        async_checkpointing=True,
        log_every=10,               # steps between TensorBoard writes
        nonfinite="stop",           # non-finite loss/grad: "stop" (error naming the step) or "skip"
        max_skipped=100,            # with "skip": stop after this many skipped steps (0: no limit)
        data_parallel=True,         # shard the batch over all devices (params replicated)
        progress=True,              # tqdm progress bar
        moe_aux_loss_coef=0.0,      # MoE pre-training: weight of the load-balancing loss (0: off; MoE models only)
    ))


def data_section() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(
        source="embedded",          # embedded | text | jsonl | tfds
        paths=(),                   # text / jsonl files or globs
        text_field="text",          # jsonl / tfds field holding the text
        tfds_name="",
        tfds_data_dir="",
        split="train",              # embedded: train | heldout | all; tfds: any split name
        heldout_fraction=0.05,      # embedded corpus: last fraction of lines held out
        max_documents=0,            # 0: all
        seq_len=128,
        shuffle=True,
        seed=0,
        tokenizer="",               # tokenizer.model / tokenizer.json (or a dir); "" = train one
        tokenizer_type="bpe",       # when trained: sentencepiece bpe | unigram
    ))


def base_config() -> ml_collections.ConfigDict:
    """Defaults: a small dense Llama-family model on the embedded corpus."""
    cfg = ml_collections.ConfigDict()
    cfg.model = model_section(
        family="llama", vocab_size=2048, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32,
        d_ff=384, max_seq_len=256, rms_eps=1e-5, rope_theta=10000.0, tie_embeddings=False,
    )
    cfg.train = train_section()
    cfg.data = data_section()
    return cfg


def load_config_file(path, overrides: dict | None = None) -> ml_collections.ConfigDict:
    """Load `get_config()` from a config file (as `--config=path` does) and apply dotted overrides."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"_m2r2_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path} defines no get_config()")
    cfg = module.get_config()
    for key, value in (overrides or {}).items():
        section, _, name = key.rpartition(".")
        node = cfg
        for part in section.split(".") if section else []:
            node = node[part]
        if name not in node:
            raise ConfigError(f"{key} is not a config field")
        node[name] = value
    return cfg


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------
def _fail(field, value, allowed):
    raise ConfigError(f"{field}={value!r} is invalid: {allowed}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_int(sec, section, name, lo, hi=None):
    v = sec[name]
    if not _is_int(v) or v < lo or (hi is not None and v > hi):
        _fail(f"{section}.{name}", v, f"expected an integer >= {lo}" + (f" and <= {hi}" if hi is not None else ""))


def _check_float(sec, section, name, lo, hi, lo_open=False, hi_open=False):
    v = sec[name]
    ok = _is_num(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not ok:
        _fail(f"{section}.{name}", v, f"expected a number in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}")


def _check_choice(sec, section, name, choices):
    if sec[name] not in choices:
        _fail(f"{section}.{name}", sec[name], f"expected one of {', '.join(choices)}")


def _check_bool(sec, section, name):
    if not isinstance(sec[name], bool):
        _fail(f"{section}.{name}", sec[name], "expected true or false")


def model_config_from(section) -> ModelConfig:
    """The `model` section as a validated `ModelConfig`."""
    d = section.to_dict() if hasattr(section, "to_dict") else dict(section)
    if "rope_scaling" in d and d["rope_scaling"] is not None and not isinstance(d["rope_scaling"], RopeScaling):
        d["rope_scaling"] = dict(d["rope_scaling"])
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "max_seq_len",
                 "n_experts", "n_experts_per_tok", "moe_d_ff", "shared_expert_d_ff"):
        if name in d and not _is_int(d[name]):
            _fail(f"model.{name}", d[name], "expected an integer")
    try:
        return ModelConfig.from_dict(d).validate()
    except TypeError as e:
        raise ConfigError(f"model section: {e}") from None


def validate_train(t) -> None:
    s = "train"
    _check_int(t, s, "steps", 1)
    _check_int(t, s, "batch_size", 1)
    _check_float(t, s, "learning_rate", 0.0, 10.0, lo_open=True)
    _check_int(t, s, "warmup_steps", 0)
    _check_float(t, s, "min_lr_ratio", 0.0, 1.0)
    _check_float(t, s, "weight_decay", 0.0, 10.0)
    _check_float(t, s, "b1", 0.0, 1.0, hi_open=True)
    _check_float(t, s, "b2", 0.0, 1.0, hi_open=True)
    _check_float(t, s, "eps", 0.0, 1.0, lo_open=True)
    _check_float(t, s, "grad_clip", 0.0, 1e9)
    _check_float(t, s, "moe_aux_loss_coef", 0.0, 1e9)
    _check_int(t, s, "seed", 0, 2**32 - 1)
    _check_int(t, s, "checkpoint_every", 1)
    _check_int(t, s, "keep_checkpoints", 1)
    _check_int(t, s, "log_every", 1)
    _check_choice(t, s, "nonfinite", NONFINITE_POLICIES)
    _check_int(t, s, "max_skipped", 0)
    for name in ("async_checkpointing", "data_parallel", "progress"):
        _check_bool(t, s, name)
    if t.warmup_steps > t.steps:
        _fail("train.warmup_steps", t.warmup_steps, f"must be <= train.steps={t.steps}")


def validate_data(d, model_tokenizer: bool = False) -> None:
    """`model_tokenizer`: an empty data.tokenizer means the base checkpoint's own tokenizer
    (distillation), not one trained here (pre-training, embedded corpus only)."""
    s = "data"
    _check_choice(d, s, "source", DATA_SOURCES)
    _check_int(d, s, "seq_len", 1)
    _check_int(d, s, "seed", 0, 2**32 - 1)
    _check_int(d, s, "max_documents", 0)
    _check_float(d, s, "heldout_fraction", 0.0, 1.0, lo_open=True, hi_open=True)
    _check_bool(d, s, "shuffle")
    _check_choice(d, s, "tokenizer_type", TOKENIZER_TYPES)
    if not isinstance(d.text_field, str) or not d.text_field:
        _fail("data.text_field", d.text_field, "expected a non-empty string")
    if not isinstance(d.tokenizer, str):
        _fail("data.tokenizer", d.tokenizer, "expected a path string ('' trains a tokenizer on the embedded corpus)")
    paths = d.paths
    if isinstance(paths, str) or not all(isinstance(p, str) for p in paths):
        _fail("data.paths", paths, "expected a list of file paths or globs")
    if d.source in ("text", "jsonl") and not paths:
        _fail("data.paths", paths, f"data.source={d.source} needs at least one file")
    if d.source == "tfds" and not d.tfds_name:
        _fail("data.tfds_name", d.tfds_name, "data.source=tfds needs a dataset name")
    if d.source == "embedded":
        _check_choice(d, s, "split", DATA_SPLITS)
    if d.source != "embedded" and not d.tokenizer and not model_tokenizer:
        _fail("data.tokenizer", d.tokenizer, f"data.source={d.source} needs a tokenizer file (only the embedded corpus trains its own)")


def validate_config(cfg, process_count: int | None = None) -> ModelConfig:
    """Validate all sections; returns the model section as a `ModelConfig`."""
    for section in ("model", "train", "data"):
        if section not in cfg:
            raise ConfigError(f"config has no {section!r} section (expected model, train, data)")
    mcfg = model_config_from(cfg.model)
    validate_train(cfg.train)
    validate_data(cfg.data)
    if cfg.train.moe_aux_loss_coef > 0 and not mcfg.is_moe:
        # a balance loss on a dense model would silently do nothing; say so instead
        _fail("train.moe_aux_loss_coef", cfg.train.moe_aux_loss_coef,
              f"a load-balancing loss needs a MoE model (model.n_experts > 0), model.n_experts={mcfg.n_experts}")
    if cfg.data.seq_len > mcfg.max_seq_len:
        _fail("data.seq_len", cfg.data.seq_len, f"must be <= model.max_seq_len={mcfg.max_seq_len}")
    if process_count is None:
        import jax

        process_count = jax.process_count()
    if cfg.train.batch_size % process_count:
        _fail("train.batch_size", cfg.train.batch_size, f"must be divisible by the number of hosts ({process_count})")
    return mcfg
