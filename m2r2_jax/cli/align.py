"""`m2r2 align --checkpoint CKPT --m2r2 M2R2_CKPT --data {embedded|FILE.txt|FILE.jsonl} --out DIR`

Per-layer (slow) and per-step (fast) top-1 agreement with the final output and cosine alignment,
against compute spent, on held-out text. Writes DIR/alignment.json and DIR/alignment.png.
"""

from __future__ import annotations

import json
from pathlib import Path

from absl import flags

from m2r2_jax.atomic import write_text_atomic

flags.DEFINE_string("checkpoint", None, "base model directory")
flags.DEFINE_string("m2r2", None, "M2R2 checkpoint directory (omit: freshly initialised M2R2 parameters)")
flags.DEFINE_string("data", "embedded", "'embedded' (the held-out split of the embedded corpus), a .txt or a .jsonl file")
flags.DEFINE_string("text_field", "text", "jsonl field holding the text")
flags.DEFINE_integer("seq_len", 128, "tokens per sequence", lower_bound=2)
flags.DEFINE_integer("batch_size", 8, "sequences per batch", lower_bound=1)
flags.DEFINE_integer("max_batches", 8, "batches evaluated", lower_bound=1)
flags.DEFINE_string("out", None, "output directory")
flags.mark_flags_as_required(["checkpoint", "out"])
FLAGS = flags.FLAGS


def heldout_text(data: str, text_field: str) -> str:
    from m2r2_jax.data import sources
    from m2r2_jax.data.corpus import embedded_split
    from m2r2_jax.errors import DataError

    if data == "embedded":
        return embedded_split("heldout")
    if not Path(data).is_file():
        raise DataError(f"--data {data}: no such file")
    docs = sources.jsonl_documents([data], text_field) if data.endswith(".jsonl") else sources.text_documents([data])
    return "\n".join(docs)


def main(argv):
    from m2r2_jax.cli.common import required_tokenizer
    from m2r2_jax.errors import ConfigError
    from m2r2_jax.m2r2 import analysis
    from m2r2_jax.m2r2.loading import load_base_and_m2r2
    from m2r2_jax.m2r2.distill import heldout_batches
    from m2r2_jax.models.config import read_model_config

    # the cheap checks first: config, tokenizer and data fail before any weights are read
    cfg = read_model_config(FLAGS.checkpoint)
    if FLAGS.seq_len > cfg.max_seq_len:
        raise ConfigError(f"--seq_len={FLAGS.seq_len} is invalid: the model's max_seq_len is {cfg.max_seq_len}")
    tok = required_tokenizer(FLAGS.checkpoint, "to encode the held-out text with")
    text = heldout_text(FLAGS.data, FLAGS.text_field)
    base_cfg, base_params, mcfg, m2r2_params, fresh = load_base_and_m2r2(FLAGS.checkpoint, FLAGS.m2r2)
    batches = heldout_batches(tok, FLAGS.seq_len, FLAGS.batch_size, FLAGS.max_batches, text)
    record = analysis.alignment(base_cfg, mcfg, base_params, m2r2_params, batches)
    record["fast_beats_slow_at_equal_compute"] = analysis.fast_beats_slow(record)
    record["fresh_m2r2_params"] = fresh
    out = Path(FLAGS.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "alignment.json", json.dumps(record, indent=2))
    analysis.plot_alignment(record, out / "alignment.png")
    print(json.dumps({k: record[k] for k in ("slow_agreement", "fast_agreement", "slow_cost", "fast_cost",
                                            "fast_beats_slow_at_equal_compute")}, indent=1))
