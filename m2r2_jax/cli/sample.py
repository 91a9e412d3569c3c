"""`m2r2 sample --checkpoint DIR --prompt TEXT --max-new-tokens N --temperature T --seed S`

Prints the prompt followed by a sampled continuation from a base-model checkpoint (greedy at
temperature 0), using the tokenizer stored with the checkpoint.
"""

from __future__ import annotations

from absl import flags

flags.DEFINE_string("checkpoint", None, "model directory (e.g. WORKDIR/model from m2r2 pretrain)")
flags.DEFINE_string("prompt", "", "text to continue")
flags.DEFINE_integer("max_new_tokens", 100, "tokens to generate", lower_bound=1)
flags.DEFINE_float("temperature", 0.8, "sampling temperature; 0 = greedy", lower_bound=0.0)
flags.DEFINE_integer("seed", 0, "sampling seed")
flags.DEFINE_alias("max-new-tokens", "max_new_tokens")  # both spellings are accepted
flags.mark_flag_as_required("checkpoint")
FLAGS = flags.FLAGS


def main(argv):
    from m2r2_jax.cli.common import required_tokenizer
    from m2r2_jax.models.checkpoint import load_config, load_model
    from m2r2_jax.training.sampling import sample_tokens

    load_config(FLAGS.checkpoint)  # a clear error first when DIR is not a model checkpoint
    tok = required_tokenizer(FLAGS.checkpoint, "to encode the prompt with")
    cfg, params = load_model(FLAGS.checkpoint)
    # An empty prompt starts a new document, which in training follows an EOS.
    prompt_ids = tok.encode(FLAGS.prompt) if FLAGS.prompt else [tok.eos_id]
    ids = sample_tokens(cfg, params, prompt_ids, FLAGS.max_new_tokens, FLAGS.temperature, FLAGS.seed, tok.eos_id)
    if ids and ids[-1] == tok.eos_id:
        ids = ids[:-1]
    print(FLAGS.prompt + decode_in_vocab(tok, ids))


def decode_in_vocab(tok, ids) -> str:
    """Text of `ids`; ids past the tokenizer's pieces (a model vocabulary padded beyond the
    tokenizer's, as converted checkpoints often have) have no text and show as U+FFFD."""
    text, run = [], []
    for i in ids:
        if 0 <= i < tok.vocab_size:
            run.append(i)
            continue
        if run:
            text.append(tok.decode(run))
            run = []
        text.append("\ufffd")
    if run:
        text.append(tok.decode(run))
    return "".join(text)
