"""`m2r2 moefy --checkpoint DENSE_CKPT --out MOE_CKPT [--experts 16] [--top_k 4] [--data embedded|FILE]`

Splits a dense SwiGLU model into a Mixtral-family MoE of the same weights (`moe_offload.moefy`):
each layer's neurons are grouped into --experts equal experts by co-activation on the text of
--data, a linear router per layer is fitted to pick the groups that carry the most of each token's
MLP output, and --top_k experts run per token, summed unweighted (with --top_k = --experts the MoE
model is the dense model). The last --heldout_fraction of the text's sequences is never fitted on:
the routers' top-k recall and the perplexity of both models (and how often their greedy next tokens
agree) are measured there. OUT is a model checkpoint (the base's tokenizer included) that
`moe-bench`, `distill` and every MoE path take; OUT/moefy.json holds the measurements.
"""

from __future__ import annotations

import json
from pathlib import Path

from absl import flags

flags.DEFINE_string("checkpoint", None, "dense SwiGLU base model directory")
flags.DEFINE_string("out", None, "output MoE model directory (must not exist unless --force)")
flags.DEFINE_integer("experts", 16, "experts per layer (must divide the base's d_ff)")
flags.DEFINE_integer("top_k", 4, "experts run per token")
flags.DEFINE_string("data", "embedded", "calibration text: 'embedded' (the training split of the embedded corpus), "
                    "a .txt or a .jsonl file (e.g. `m2r2 distill-data` output)")
flags.DEFINE_string("text_field", "text", "jsonl field holding the text")
flags.DEFINE_integer("seq_len", 256, "tokens per sequence", lower_bound=8)
flags.DEFINE_integer("max_sequences", 64, "sequences of --data used (fitted and held out together)", lower_bound=2)
flags.DEFINE_float("heldout_fraction", 0.25, "last share of the sequences kept out of the fit, for measuring",
                   lower_bound=0.01, upper_bound=0.9)
flags.DEFINE_enum("propagate", "moe", ["moe", "dense"], "the states each layer is fitted on: those of the MoE "
                  "layers before it (moe) or the dense model's (dense)")
flags.DEFINE_integer("router_steps", 300, "full-batch Adam steps of each router fit", lower_bound=1)
flags.DEFINE_integer("cluster_tokens", 4096, "tokens whose activations group the neurons", lower_bound=16)
flags.DEFINE_bool("evaluate", True, "measure perplexity and greedy agreement against the dense model")
flags.DEFINE_integer("seed", 0, "seed of the grouping")
flags.DEFINE_bool("force", False, "replace --out if it exists")
flags.mark_flags_as_required(["checkpoint", "out"])
FLAGS = flags.FLAGS

RECORD_FILE = "moefy.json"


def calibration_documents(data: str, text_field: str) -> list:
    from m2r2_jax.data import sources
    from m2r2_jax.errors import DataError

    if data == "embedded":
        return sources.embedded_documents("train")
    if not Path(data).is_file():
        raise DataError(f"--data {data}: no such file")
    return sources.jsonl_documents([data], text_field) if data.endswith(".jsonl") else sources.text_documents([data])


def sequences(tokenizer, docs, seq_len: int, max_sequences: int):
    """[n, seq_len] int32: the documents' tokens (each followed by EOS, as the training pipeline
    packs them) cut into consecutive sequences, at most max_sequences; only as many documents are
    encoded as that takes."""
    import numpy as np

    from m2r2_jax.data.pipeline import tokenize_documents
    from m2r2_jax.errors import DataError

    need, parts, total = seq_len * max_sequences, [], 0
    for doc in docs:
        stream = tokenize_documents(tokenizer, [doc[: need * 8]])  # a long document (the embedded corpus) in part
        parts.append(stream)
        total += len(stream)
        if total >= need:
            break
    ids = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    n = min(len(ids) // seq_len, max_sequences)
    if n < 2:
        raise DataError(f"--data has {len(ids)} tokens: moefy needs at least 2 sequences of --seq_len={seq_len}")
    return ids[: n * seq_len].reshape(n, seq_len)


def main(argv):
    import time

    from m2r2_jax.cli.common import required_tokenizer
    from m2r2_jax.errors import CheckpointError, ConfigError
    from m2r2_jax.models.config import read_model_config
    from m2r2_jax.moe_offload.moefy import check_moefy

    # every cheap check before JAX or the weights: base, sizes, output path, tokenizer, data
    cfg = read_model_config(FLAGS.checkpoint)
    check_moefy(cfg, FLAGS.experts, FLAGS.top_k)
    if FLAGS.seq_len > cfg.max_seq_len:
        raise ConfigError(f"--seq_len={FLAGS.seq_len} is invalid: the model's max_seq_len is {cfg.max_seq_len}")
    out = Path(FLAGS.out)
    if out.exists() and not FLAGS.force:
        raise CheckpointError(f"{out.absolute()} already exists (pass --force to replace it)")
    tok = required_tokenizer(FLAGS.checkpoint, "to encode the calibration text")
    tokens = sequences(tok, calibration_documents(FLAGS.data, FLAGS.text_field), FLAGS.seq_len, FLAGS.max_sequences)

    from m2r2_jax.models.checkpoint import TOKENIZER_DIR, load_model, save_model, tokenizer_path
    from m2r2_jax.moe_offload.moefy import compare, moefy

    t0 = time.perf_counter()
    _, params = load_model(FLAGS.checkpoint, cfg)
    moe_cfg, moe_params, record = moefy(cfg, params, tokens, n_experts=FLAGS.experts, top_k=FLAGS.top_k,
                                        propagate=FLAGS.propagate, router_steps=FLAGS.router_steps,
                                        cluster_tokens=FLAGS.cluster_tokens, heldout_fraction=FLAGS.heldout_fraction,
                                        seed=FLAGS.seed, progress=_say)
    record["inputs"] = {"checkpoint": str(FLAGS.checkpoint), "data": FLAGS.data, "seq_len": FLAGS.seq_len,
                        "sequences": int(tokens.shape[0])}
    if FLAGS.evaluate:
        held = tokens[record["fit_sequences"]:]
        _say(f"perplexity of both models on {held.shape[0]} held-out sequences")
        record["quality"] = compare(cfg, params, moe_cfg, moe_params, held)
    record["seconds"]["with_evaluation_s"] = round(time.perf_counter() - t0, 2)
    tok_file = tokenizer_path(FLAGS.checkpoint)
    extras = [p for p in sorted((Path(FLAGS.checkpoint) / TOKENIZER_DIR).iterdir()) if p != tok_file]
    save_model(out, moe_cfg, moe_params, tokenizer_file=str(tok_file), overwrite=FLAGS.force,
               tokenizer_extras=extras, extra_files={RECORD_FILE: json.dumps(record, indent=2)})
    summary = {k: record[k] for k in ("n_experts", "top_k", "router_recall", "captured_mass", "best_captured_mass")}
    summary.update(out=str(out), quality=record.get("quality"), seconds=record["seconds"])
    print(json.dumps(summary, indent=2))


def _say(msg: str) -> None:
    import sys

    print(f"m2r2 moefy: {msg}", file=sys.stderr, flush=True)
