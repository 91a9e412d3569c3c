"""Base-model pre-training from a config (what `m2r2 pretrain` runs).

    summary = pretrain(cfg, workdir)

Workdir layout:

    workdir/config.json            the config of the first run (a resumed run must match its
                                   model and data sections; train.steps may grow)
    workdir/tokenizer/             the sentencepiece model trained here (embedded corpus only)
    workdir/checkpoints/           orbax train checkpoints (see `loop.train`)
    workdir/tb/                    TensorBoard event files
    workdir/model/                 the exported model (`models.checkpoint.save_model`)
    workdir/pretrain_summary.json  losses, held-out loss, throughput
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np

from m2r2_jax.data.corpus import embedded_split
from m2r2_jax.data.pipeline import lm_pipeline, pack, tokenize_documents
from m2r2_jax.data.tokenizer import Tokenizer, load_tokenizer, train_sentencepiece
from m2r2_jax.errors import ConfigError
from m2r2_jax.models.checkpoint import save_model
from m2r2_jax.models.config import ModelConfig
from m2r2_jax.models.transformer import count_params, init_params
from m2r2_jax.training.config import validate_config
from m2r2_jax.training.lm import evaluate, lm_loss_fn
from m2r2_jax.training.loop import train

TOKENIZER_DIR = "tokenizer"
MODEL_DIR = "model"
EVAL_BATCHES = 16


def prepare_tokenizer(dcfg, mcfg: ModelConfig, workdir: Path) -> Tokenizer:
    """The configured tokenizer, or one trained on the embedded corpus (kept in the workdir)."""
    if dcfg.tokenizer:
        tok = load_tokenizer(dcfg.tokenizer)
    else:
        path = workdir / TOKENIZER_DIR / "tokenizer.model"
        if path.is_file():
            tok = load_tokenizer(path)
        else:
            tok = train_sentencepiece(embedded_split("train", dcfg.heldout_fraction), mcfg.vocab_size, path,
                                      model_type=dcfg.tokenizer_type)
    if tok.vocab_size > mcfg.vocab_size:
        raise ConfigError(f"model.vocab_size={mcfg.vocab_size} is invalid: the tokenizer {tok.path} has "
                          f"{tok.vocab_size} tokens")
    return tok


def _check_workdir_config(cfg, workdir: Path) -> None:
    """Record the config on the first run; refuse to resume with a different model or data."""
    path = workdir / "config.json"
    current = json.loads(cfg.to_json())
    if not path.is_file():
        workdir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(current, indent=2, sort_keys=True))
        return
    previous = json.loads(path.read_text())
    for section in ("model", "data"):
        for key in sorted(set(previous.get(section, {})) | set(current[section])):
            old, new = previous.get(section, {}).get(key), current[section].get(key)
            if old != new:
                raise ConfigError(f"{section}.{key}={new!r} differs from the run in {workdir} ({old!r}); "
                                  "use a new --workdir or the same config")


def _say(msg: str) -> None:
    if jax.process_index() == 0:
        print(msg, file=sys.stderr, flush=True)


def pretrain(cfg, workdir, plan=None) -> dict:
    """`plan`: a `sharding.ShardingPlan` for the train step (None: data parallel, see `loop.train`)."""
    workdir = Path(workdir).absolute()
    mcfg = validate_config(cfg)
    if cfg.data.tokenizer:  # a bad tokenizer path must fail before the workdir records this config
        prepare_tokenizer(cfg.data, mcfg, workdir)
    _check_workdir_config(cfg, workdir)
    tok = prepare_tokenizer(cfg.data, mcfg, workdir)
    data_iter, info = lm_pipeline(cfg.data, tok, cfg.train.batch_size, cfg.data.seed)
    # One compiled program instead of hundreds of eagerly dispatched small ops.
    params = jax.jit(init_params, static_argnums=0)(mcfg, jax.random.key(cfg.train.seed))
    _say(f"model: {mcfg.family}, {mcfg.n_layers} layers, d_model {mcfg.d_model}, {count_params(params):,} params; "
         f"data: {info.tokens:,} tokens -> {info.examples:,} examples of {info.seq_len}+1 tokens")
    result = train(cfg.train, workdir, params, {}, lm_loss_fn(mcfg, cfg.train.moe_aux_loss_coef), data_iter,
                   rng=jax.random.key(cfg.train.seed), metrics_prefix="pretrain", plan=plan)
    summary = {"step": result.step, "preempted": result.preempted, "skipped": result.skipped,
               "params": count_params(result.trainable), "train_tokens": info.tokens}
    hist = result.history
    if hist:
        summary["first_loss"] = hist[0]["loss"]
        summary["last_loss"] = float(np.mean([h["loss"] for h in hist[-10:]]))
        tps = [h["tokens_per_s"] for h in hist if "tokens_per_s" in h]
        if tps:
            summary["tokens_per_s"] = float(np.median(tps))
    if result.preempted:
        return summary
    if cfg.data.source == "embedded":
        held = pack(tokenize_documents(tok, [embedded_split("heldout", cfg.data.heldout_fraction)]), cfg.data.seq_len)
        ev = evaluate(mcfg, result.trainable, held, min(cfg.train.batch_size, len(held)), EVAL_BATCHES)
        summary["heldout_loss"] = ev.get("loss")
        summary["heldout_accuracy"] = ev.get("accuracy")
    model_dir = save_model(workdir / MODEL_DIR, mcfg, jax.device_get(result.trainable),
                           tokenizer_file=str(tok.path), overwrite=True)
    summary["model"] = str(model_dir)
    (workdir / "pretrain_summary.json").write_text(json.dumps(summary, indent=2))
    return summary
