"""`m2r2 generate --checkpoint CKPT --method METHOD --prompts FILE.jsonl --out OUT.jsonl [...]`

Generates a continuation for every line of a JSONL prompt file with one decoding method:
ar | m2r2_spec | distance_spec | two_model | m2r2_exit | distance_exit.

Each input line is an object with "prompt" (text, encoded with the checkpoint's tokenizer; with
`--chat_template auto`, the default, rendered first as a user turn with the checkpoint's chat
template when it has one) or "tokens" (ids, taken as they are). A sequence stops after any of the
tokenizer's end-of-sequence ids (generation_config.json's list and the eos token).

Each output line (same order) holds "tokens" (generated ids), "text" (their decoding; null
without a tokenizer), "accepted" (per verification round: accepted drafts + 1; empty for
non-speculative methods), "rounds", "layers" (decode-phase layer-equivalents) and "early_exits".
Line i samples from its own stream `fold_in(key(seed), i)`, so results do not depend on
--batch-size. `--include_prompt` puts the prompt's ids in front of "tokens", adds "prompt_len"
(their number) and names the answer's decoding "answer_text": the rows that
`m2r2 moe-bench --forced_per_row` teacher-forces (a model's answers to chat prompts of different
lengths). Without --m2r2 the m2r2 methods use freshly initialised M2R2 parameters (still lossless
for m2r2_spec). The output file is written atomically.
"""

from __future__ import annotations

from absl import flags

from m2r2_jax.cli import sharding_flags

flags.DEFINE_string("checkpoint", None, "base model directory")
flags.DEFINE_string("m2r2", None, "M2R2 checkpoint directory (m2r2_spec, m2r2_exit, distance_spec's E)")
flags.DEFINE_string("draft_checkpoint", None, "draft model directory (two_model)")
flags.DEFINE_enum("method", "ar", ["ar", "m2r2_spec", "distance_spec", "two_model", "m2r2_exit", "distance_exit"],
                  "decoding method")
flags.DEFINE_string("prompts", None, "JSONL file: one {\"prompt\": TEXT} or {\"tokens\": [ids]} per line")
flags.DEFINE_integer("max_new_tokens", 64, "tokens to generate per prompt")
flags.DEFINE_float("temperature", 0.0, "sampling temperature; 0 = greedy")
flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass in (0, 1]")
flags.DEFINE_integer("seed", 0, "random seed (line i uses fold_in(key(seed), i))")
flags.DEFINE_integer("batch_size", 8, "sequences decoded together")
flags.DEFINE_integer("gamma", 4, "draft tokens per speculative round")
flags.DEFINE_float("tau", 0.5, "router / decider threshold in [0, 1]")
flags.DEFINE_enum("draft_length", "fixed", ["fixed", "dynamic"], "speculative draft length")
flags.DEFINE_enum("kv_missing", "propagate", ["propagate", "deferred"], "early exit: K/V of skipped layers")
flags.DEFINE_enum("decider", "confidence", ["confidence", "saturation"], "distance_exit decider")
flags.DEFINE_bool("exit_confirm", False, "m2r2_exit: a token the router releases leaves only if its exit head's max "
                  "probability is >= --tau too")
flags.DEFINE_integer("exit_layer", None, "distance_spec draft depth E (default: the M2R2 draft's cost)")
flags.DEFINE_string("out", None, "output JSONL file")
flags.DEFINE_string("chat_template", "auto", "text prompts: auto (the checkpoint's chat template when it has one), "
                    "none (raw text), or a template file (.jinja or a tokenizer_config.json)")
flags.DEFINE_string("draft_vocab", None, "m2r2_spec / distance_spec: draft from this token subset only (a JSON file "
                    "from `m2r2 draft-vocab`); output is unchanged, drafting cheaper")
flags.DEFINE_bool("include_prompt", False, "each row's \"tokens\" start with its prompt's ids, and \"prompt_len\" "
                  "says how many (the input of moe-bench --forced_per_row)")
flags.DEFINE_enum("layer_loop", "auto", ["auto", "scan", "unrolled"], "the layer loop: a lax.scan over the stacked "
                  "layers, unrolled over per-layer weights (ar and speculative methods, no --sharding plan), or auto: "
                  "unrolled where it serves on CPU, the scan elsewhere (same tokens either way)")
for _name in ("max_new_tokens", "draft_checkpoint", "top_p", "batch_size", "draft_length", "kv_missing", "exit_layer",
              "draft_vocab", "layer_loop", "chat_template"):
    flags.DEFINE_alias(_name.replace("_", "-"), _name)
flags.mark_flags_as_required(["checkpoint", "prompts", "out"])
sharding_flags.define("specdec")
FLAGS = flags.FLAGS


def main(argv):
    from m2r2_jax.data.tokenizer import load_tokenizer
    from m2r2_jax.decoding import api
    from m2r2_jax.decoding.sampling import Sampling
    from m2r2_jax.json_files import write_jsonl_atomic
    from m2r2_jax.errors import ConfigError
    from m2r2_jax.models.checkpoint import load_config, load_fingerprint, load_model, tokenizer_path

    # cheap checks first: a bad flag fails before any model is loaded
    if FLAGS.max_new_tokens <= 0:
        raise ConfigError(f"--max-new-tokens={FLAGS.max_new_tokens} is invalid: expected a positive integer")
    if FLAGS.batch_size <= 0:
        raise ConfigError(f"--batch-size={FLAGS.batch_size} is invalid: expected a positive integer")
    if FLAGS.gamma <= 0:
        raise ConfigError(f"--gamma={FLAGS.gamma} is invalid: expected a positive integer")
    if not (0.0 <= FLAGS.tau <= 1.0):
        raise ConfigError(f"--tau={FLAGS.tau} is invalid: expected a value in [0, 1]")
    Sampling(FLAGS.temperature, FLAGS.top_p).validate()
    plan = sharding_flags.start(FLAGS)
    if FLAGS.method == "two_model" and not FLAGS.draft_checkpoint:
        raise ConfigError("--method=two_model needs --draft-checkpoint")

    cfg = load_config(FLAGS.checkpoint)
    vocab = None
    if FLAGS.draft_vocab:
        from m2r2_jax.decoding import draft_vocab as DV

        if FLAGS.method not in api.SELF_DRAFT_METHODS:
            raise ConfigError(f"--draft-vocab is for --method m2r2_spec or distance_spec, not {FLAGS.method}")
        vocab = DV.load(FLAGS.draft_vocab, cfg.vocab_size)
    tok_file = tokenizer_path(FLAGS.checkpoint)
    tokenizer = load_tokenizer(tok_file) if tok_file is not None else None
    from m2r2_jax.data.prompt_files import read_prompt_file

    from m2r2_jax.data.chat_template import resolve_chat_template

    template = resolve_chat_template(tokenizer, FLAGS.chat_template)
    prompts, where = read_prompt_file(FLAGS.prompts, tokenizer, chat_template=template)
    prompts = api.check_prompts(cfg, prompts, FLAGS.max_new_tokens, where)
    m2r2 = None
    if FLAGS.m2r2 and FLAGS.method in ("m2r2_spec", "m2r2_exit", "distance_spec"):
        from m2r2_jax.m2r2.checkpoint import load_m2r2

        m2r2 = load_m2r2(FLAGS.m2r2, cfg, load_fingerprint(FLAGS.checkpoint))
    draft = load_model(FLAGS.draft_checkpoint) if FLAGS.method == "two_model" else None
    _, params = load_model(FLAGS.checkpoint, cfg)
    eos = tokenizer.eos_ids if tokenizer is not None else None
    results = api.generate(FLAGS.method, cfg, params, prompts, plan=plan, max_new_tokens=FLAGS.max_new_tokens,
                           temperature=FLAGS.temperature, top_p=FLAGS.top_p, seed=FLAGS.seed,
                           batch_size=FLAGS.batch_size, gamma=FLAGS.gamma, draft_length=FLAGS.draft_length,
                           tau=FLAGS.tau, eos_ids=eos, m2r2=m2r2, draft=draft, exit_layer=FLAGS.exit_layer,
                           decider=FLAGS.decider, exit_confirm=FLAGS.exit_confirm, kv_missing=FLAGS.kv_missing,
                           draft_vocab=vocab, layer_loop=FLAGS.layer_loop)
    rows = [_output_row(p, r, tokenizer, FLAGS.include_prompt) for p, r in zip(prompts, results)]
    import jax

    if jax.process_index() == 0:  # multi-host: every process holds the gathered results; one writes
        write_jsonl_atomic(FLAGS.out, rows)
    n_tok = sum(len(r.tokens) for r in results)
    print(f"wrote {len(rows)} lines, {n_tok} tokens, to {FLAGS.out}")


def _output_row(prompt, result, tokenizer, include_prompt: bool) -> dict:
    row = {
        "tokens": result.tokens,
        "text": tokenizer.decode(result.tokens) if tokenizer is not None else None,
        "accepted": result.accepted,
        "rounds": result.rounds,
        "layers": result.layers,
        "early_exits": result.early_exits,
    }
    if include_prompt:
        # with the prompt in "tokens", a "text" field would read as a second prompt: "answer_text"
        row.update(tokens=list(prompt) + list(result.tokens), prompt_len=len(prompt), answer_text=row.pop("text"))
    return row
