"""`m2r2 draft-vocab --checkpoint DIR --corpus {embedded,FILE[,FILE...]} --size N --out FILE`

Counts the tokens of a reference corpus with the checkpoint's tokenizer and writes the N most
frequent ids as a draft vocabulary (m2r2_jax/decoding/draft_vocab.py), with the fraction of the
corpus's tokens it covers. `m2r2 generate/bench --draft-vocab FILE` then draft from that subset:
cheaper drafting where the LM head is a large part of a draft step, identical output; `m2r2
distill --config.draft_vocab=FILE` trains the fast stream for that head. Text files are read as
UTF-8, `*.jsonl` files by their rows' "text" field (`m2r2 distill-data` output); `embedded` is the
training split of the embedded corpus. Use text like what the model will be asked to write, not
the benchmark's own prompts.
"""

from __future__ import annotations

from absl import flags

flags.DEFINE_string("checkpoint", None, "model directory (its tokenizer and vocabulary size are used)")
flags.DEFINE_list("corpus", ["embedded"], "text files, JSONL files (their \"text\" fields) to count, or 'embedded' "
                  "(the embedded corpus's train split)")
flags.DEFINE_integer("size", None, "number of token ids to keep", lower_bound=1)
flags.DEFINE_string("out", None, "output JSON file")
flags.mark_flags_as_required(["checkpoint", "size", "out"])
FLAGS = flags.FLAGS


def _texts(names):
    from pathlib import Path

    from m2r2_jax.data.corpus import embedded_split
    from m2r2_jax.data.sources import jsonl_documents
    from m2r2_jax.errors import DataError

    for name in names:
        if name == "embedded":
            yield name, embedded_split("train")
            continue
        path = Path(name)
        if path.suffix == ".jsonl":  # one-line errors of their own (missing file, bad row)
            yield name, "\n".join(jsonl_documents([path], "text"))
            continue
        try:
            yield name, path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise DataError(f"corpus file {path} does not exist") from None
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"corpus file {path} is not readable UTF-8 text: {e}") from None


def main(argv):
    from pathlib import Path

    from tqdm.auto import tqdm

    from m2r2_jax.cli.common import required_tokenizer
    from m2r2_jax.decoding import draft_vocab as DV
    from m2r2_jax.errors import ConfigError
    from m2r2_jax.models.checkpoint import load_config

    cfg = load_config(FLAGS.checkpoint)
    if FLAGS.size > cfg.vocab_size:
        raise ConfigError(f"--size={FLAGS.size} is invalid: the model's vocabulary has {cfg.vocab_size} tokens")
    tok = required_tokenizer(FLAGS.checkpoint, "to count a text corpus with")
    # every input read and the output's directory made (their errors reported) before any progress output
    texts = list(_texts(FLAGS.corpus))
    if not any(t.strip() for _, t in texts):
        raise ConfigError(f"--corpus={','.join(FLAGS.corpus)} has no tokens to count")
    Path(FLAGS.out).absolute().parent.mkdir(parents=True, exist_ok=True)
    counts = None
    for _, text in tqdm(texts, desc="counting tokens"):
        c = DV.count_tokens([tok.encode(text)], cfg.vocab_size)
        counts = c if counts is None else counts + c
    if not counts.sum():
        raise ConfigError(f"--corpus={','.join(FLAGS.corpus)} has no tokens to count")
    ids = DV.most_frequent(counts, FLAGS.size)
    rec = DV.save(FLAGS.out, ids, cfg.vocab_size, ",".join(FLAGS.corpus), counts)
    print(f"wrote {rec['size']} of {cfg.vocab_size} token ids to {FLAGS.out}: they cover {rec['coverage']:.1%} "
          f"of the {rec['counted_tokens']} counted tokens")
