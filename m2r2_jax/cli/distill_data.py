"""`m2r2 distill-data --checkpoint CKPT --out DATA.jsonl [--prompts self_instruct,koala,wizardlm] [...]`

Distillation data from the base itself: its greedy answers to instruction prompts, each rendered
with the checkpoint's chat template, written as JSONL rows {"text": prompt + answer, ...} for
`--config.data.source=jsonl --config.data.paths="('DATA.jsonl',)"`. The last --heldout_fraction of
every set is not answered; those prompts go to DATA.heldout.jsonl ({"prompt": ...} rows that
`generate` and `bench` read) for measuring acceptance on unseen prompts. MT-Bench and Spec-Bench are
refused: the drafter is never trained on its benchmark. Both files are written atomically.
"""

from __future__ import annotations

from absl import flags

flags.DEFINE_string("checkpoint", None, "base model directory")
flags.DEFINE_string("out", None, "output JSONL file (the held-out prompts go beside it, *.heldout.jsonl)")
flags.DEFINE_list("prompts", ["self_instruct", "koala", "wizardlm"], "shipped prompt sets or JSONL prompt files")
flags.DEFINE_integer("max_new_tokens", 192, "longest answer, in tokens", lower_bound=1)
flags.DEFINE_integer("max_prompts", 0, "at most this many prompts per set (0: all)", lower_bound=0)
flags.DEFINE_integer("max_prompt_tokens", 512, "prompts longer than this (rendered) are skipped", lower_bound=1)
flags.DEFINE_float("heldout_fraction", 0.1, "last fraction of every set kept out of the data", lower_bound=0.0,
                   upper_bound=0.99)
flags.DEFINE_integer("batch_size", 16, "prompts answered together", lower_bound=1)
flags.DEFINE_string("chat_template", "auto", "auto (the checkpoint's), none (raw prompts), or a template file")
flags.mark_flags_as_required(["checkpoint", "out"])
FLAGS = flags.FLAGS


def heldout_path(out):
    from pathlib import Path

    out = Path(out)
    return out.with_name(out.stem + ".heldout.jsonl")


def main(argv):
    import time

    from m2r2_jax.cli.common import required_tokenizer
    from m2r2_jax.json_files import write_jsonl_atomic
    from m2r2_jax.data.chat_template import resolve_chat_template
    from m2r2_jax.m2r2.distill_data import BENCHMARK_SETS, make_distill_data
    from m2r2_jax.models.checkpoint import load_config, load_model
    from m2r2_jax.errors import ConfigError

    bad = sorted(set(FLAGS.prompts) & set(BENCHMARK_SETS))
    if bad:  # before loading anything
        raise ConfigError(f"--prompts {bad[0]} is a benchmark set: the drafter is never trained on its benchmark")
    cfg = load_config(FLAGS.checkpoint)
    tok = required_tokenizer(FLAGS.checkpoint, "to encode the prompts and decode the answers")
    template = resolve_chat_template(tok, FLAGS.chat_template)
    _, params = load_model(FLAGS.checkpoint, cfg)
    start = time.perf_counter()
    rows, heldout = make_distill_data(cfg, params, tok, FLAGS.prompts, max_new_tokens=FLAGS.max_new_tokens,
                                      heldout_fraction=FLAGS.heldout_fraction, max_prompts=FLAGS.max_prompts,
                                      batch_size=FLAGS.batch_size, chat_template=template,
                                      max_prompt_tokens=FLAGS.max_prompt_tokens)
    write_jsonl_atomic(FLAGS.out, rows)
    write_jsonl_atomic(heldout_path(FLAGS.out), heldout)
    n_tok = sum(r["prompt_tokens"] + r["answer_tokens"] for r in rows)
    print(f"wrote {len(rows)} answers ({n_tok} tokens, {sum(r['answer_tokens'] for r in rows)} generated) to "
          f"{FLAGS.out} in {time.perf_counter() - start:.0f} s, and {len(heldout)} held-out prompts to "
          f"{heldout_path(FLAGS.out)}")
