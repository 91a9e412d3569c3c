"""`m2r2 bench --checkpoint CKPT [--m2r2 M2R2_CKPT] [--draft-checkpoint CKPT]
   --prompts {mt_bench,spec_bench,koala,self_instruct,wizardlm,FILE} --out DIR`

Speculative decoding side by side with plain decoding on a (converted) model and a prompt set,
with Spec-Bench's definitions: speedup from mean per-answer tokens/s at batch 1, accepted tokens
counting the target's own token, an identical-output check; plus a batch sweep and the costs
(ar step, draft phase, verify pass) the ideal speedup is computed from. Writes DIR/report.json and
DIR/speculative.png. Text prompts are rendered as a user turn with the checkpoint's chat
template (--chat_template auto) and truncated from the left to --max-prompt-tokens; answers stop at
the tokenizer's stop ids (--nostop_at_eos: run to --max_new_tokens).
"""

from __future__ import annotations

from absl import flags

from m2r2_jax.cli import sharding_flags

flags.DEFINE_string("checkpoint", None, "base model directory")
flags.DEFINE_string("m2r2", None, "M2R2 checkpoint (omit: fresh M2R2 parameters, still lossless)")
flags.DEFINE_string("draft_checkpoint", None, "draft model for two_model (same vocabulary)")
flags.DEFINE_string("prompts", "mt_bench", "prompt set name or a jsonl file")
flags.DEFINE_integer("n_prompts", 16, "first N prompts of the set", lower_bound=1)
flags.DEFINE_bool("stop_at_eos", True, "every method stops an answer at the tokenizer's end-of-sequence ids (as a chat "
                  "model's answers end); --nostop_at_eos runs every answer to --max_new_tokens")
flags.DEFINE_string("chat_template", "auto", "text prompts: auto (rendered as a user turn with the checkpoint's chat "
                    "template when it has one), none (raw text), or a template file (.jinja or tokenizer_config.json)")
flags.DEFINE_integer("max_prompt_tokens", 256, "prompts are cut to their last N tokens", lower_bound=1)
flags.DEFINE_integer("max_new_tokens", 128, "tokens generated per answer", lower_bound=1)
flags.DEFINE_string("gamma", "4", "draft length: N for every method, METHOD=N,... per method, or 'auto': each "
                    "method's gamma chosen from its acceptance on --calibration_prompts further prompts of the set "
                    "and its measured round cost at every --gamma_candidates value (m2r2_jax/bench/gamma.py)")
flags.DEFINE_list("gamma_candidates", ["1", "2", "3", "4", "6", "8"], "draft lengths --gamma auto measures")
flags.DEFINE_integer("calibration_prompts", 4, "--gamma auto: prompts after the first --n_prompts of the set "
                     "that acceptance is measured on", lower_bound=1)
flags.DEFINE_list("batch_sizes", ["1", "4", "16"], "batch sizes of the throughput sweep")
flags.DEFINE_integer("repeats", 3, "timing repeats (median kept)", lower_bound=1)
flags.DEFINE_enum("layer_loop", "auto", ["auto", "scan", "unrolled"], "every engine's layer loop: a lax.scan over "
                  "the stacked layers, unrolled over per-layer weights (faster decoding on CPU; no --sharding plan), "
                  "or auto: unrolled on CPU without a plan, the scan elsewhere")
flags.DEFINE_string("out", None, "output directory")
flags.DEFINE_integer("cpu_cores", 0, "CPU benchmarks: pin the process to the first N cores it may use "
                     "before JAX starts (0: all); see m2r2_jax/bench/cpu_cores.py", lower_bound=0)
flags.DEFINE_float("temperature", 0.0, "also compare the methods sampled at this temperature, side by side with "
                   "sampled ar (0: greedy only)", lower_bound=0.0)
flags.DEFINE_float("top_p", 1.0, "nucleus mass of the sampled comparison")
flags.DEFINE_string("draft_vocab", None, "m2r2_spec and distance_spec draft from this token subset only (a JSON "
                    "file from `m2r2 draft-vocab`); verification keeps the full vocabulary")
flags.DEFINE_enum("kernel_implementation", None, ["auto", "xla", "pallas", "interpret"],
                  "the fast stream's fused residual-rate update (m2r2_jax.kernels): override the M2R2 "
                  "checkpoint's setting, e.g. xla to compare with the Pallas kernel on a GPU/TPU")
flags.mark_flags_as_required(["checkpoint", "out"])
sharding_flags.define("specdec")
FLAGS = flags.FLAGS


def main(argv):
    import json
    import sys
    from pathlib import Path

    from m2r2_jax.bench import report as R
    from m2r2_jax.bench.cpu_cores import device_summary, pin_to_cores
    from m2r2_jax.atomic import write_text_atomic
    from m2r2_jax.bench.prompts import load_prompt_set
    from m2r2_jax.bench.speculative import SPEC_METHODS, compare_methods, sampled_comparison
    from m2r2_jax.decoding.sampling import Sampling
    from m2r2_jax.cli.common import required_tokenizer
    from m2r2_jax.errors import ConfigError, DataError
    from m2r2_jax.m2r2.loading import load_base_and_m2r2
    from m2r2_jax.models.checkpoint import load_model

    Sampling(FLAGS.temperature, FLAGS.top_p).validate()
    if FLAGS.cpu_cores:  # before anything starts JAX's backend
        pin_to_cores(FLAGS.cpu_cores)
    plan = sharding_flags.start(FLAGS)
    from m2r2_jax.decoding.api import resolve_layer_loop

    methods = ("ar",) + tuple(m for m in SPEC_METHODS if m != "two_model" or FLAGS.draft_checkpoint)
    layer_loops = {m: resolve_layer_loop(FLAGS.layer_loop, m, plan) for m in methods}  # checked before any load
    try:
        batch_sizes = [int(b) for b in FLAGS.batch_sizes]
    except ValueError:
        raise ConfigError(f"--batch_sizes={FLAGS.batch_sizes} is invalid: expected integers") from None
    if any(b < 1 for b in batch_sizes):
        raise ConfigError(f"--batch_sizes={FLAGS.batch_sizes} is invalid: expected positive integers")
    from m2r2_jax.bench import gamma as G
    from m2r2_jax.bench.gamma_tuning import tune_gammas

    gamma = G.parse_gamma(FLAGS.gamma, SPEC_METHODS)
    candidates = G.parse_candidates(FLAGS.gamma_candidates)
    n_calib = FLAGS.calibration_prompts if gamma == "auto" else 0
    prompts = load_prompt_set(FLAGS.prompts)
    from m2r2_jax.bench.prompts import interleave_categories, prompt_categories

    categories = prompt_categories(FLAGS.prompts) if FLAGS.prompts == "spec_bench" else None
    if categories is not None:  # the first --n_prompts then cover every task
        order = interleave_categories(categories)
        prompts, categories = [prompts[i] for i in order], [categories[i] for i in order]
    if n_calib and len(prompts) < FLAGS.n_prompts + n_calib:
        raise ConfigError(f"--gamma auto needs {n_calib} calibration prompts after the first --n_prompts="
                          f"{FLAGS.n_prompts} of {FLAGS.prompts}, which has {len(prompts)}")
    prompts = prompts[: FLAGS.n_prompts + n_calib]
    base_cfg, base_params, mcfg, m2r2_params, fresh = load_base_and_m2r2(FLAGS.checkpoint, FLAGS.m2r2)
    if FLAGS.kernel_implementation:
        import dataclasses

        mcfg = dataclasses.replace(mcfg, kernel_implementation=FLAGS.kernel_implementation)
        mcfg.validate()
    draft = load_model(FLAGS.draft_checkpoint) if FLAGS.draft_checkpoint else None
    from m2r2_jax.data.tokenizer import load_tokenizer
    from m2r2_jax.models.checkpoint import tokenizer_path

    tok_file = tokenizer_path(FLAGS.checkpoint)
    tok = load_tokenizer(tok_file) if tok_file is not None else None
    if any(isinstance(p, str) for p in prompts):
        from m2r2_jax.data.chat_template import encode_prompt, resolve_chat_template

        if tok is None:
            tok = required_tokenizer(FLAGS.checkpoint, "to encode text prompts with")  # the one-line error
        template = resolve_chat_template(tok, FLAGS.chat_template)
        prompts = [encode_prompt(tok, p, template) if isinstance(p, str) else p for p in prompts]
    longest_draft = max(candidates) if gamma == "auto" else max(gamma.values()) if isinstance(gamma, dict) else gamma
    limit = min(FLAGS.max_prompt_tokens, base_cfg.max_seq_len - FLAGS.max_new_tokens - longest_draft - 1)
    if limit < 1:
        raise ConfigError(f"--max_new_tokens={FLAGS.max_new_tokens} leaves no room for a prompt in the "
                          f"model's context of {base_cfg.max_seq_len}")
    prompts = [list(p)[-limit:] for p in prompts]
    for i, p in enumerate(prompts):
        if not p:
            raise DataError(f"prompt {i} is empty")
        if max(p) >= base_cfg.vocab_size or min(p) < 0:
            raise DataError(f"prompt {i} has token ids outside the vocabulary [0, {base_cfg.vocab_size})")
    vocab = None
    if FLAGS.draft_vocab:
        from m2r2_jax.decoding import draft_vocab as DV

        vocab = DV.load(FLAGS.draft_vocab, base_cfg.vocab_size)

    def say(msg: str) -> None:
        print(f"[bench] {msg}", file=sys.stderr, flush=True)

    prompts, calib = prompts[: len(prompts) - n_calib], prompts[len(prompts) - n_calib:]

    def tune(spec_methods):
        say(f"draft lengths of {', '.join(spec_methods)}: acceptance at gamma {max(candidates)} on {len(calib)} "
            f"calibration prompts, round costs at gamma {', '.join(map(str, candidates))}")
        records = tune_gammas(spec_methods, base_cfg, base_params, calib, max_new_tokens=FLAGS.max_new_tokens,
                                candidates=candidates, m2r2=(mcfg, m2r2_params), draft=draft, plan=plan,
                                bar="draft lengths", draft_vocab=vocab, layer_loop=FLAGS.layer_loop)
        for m, rec in records.items():
            say("  " + G.format_choice(m, rec))
        return records

    gammas, tuning = G.resolve_gammas(gamma, methods, tune)
    eos = list(tok.eos_ids) if FLAGS.stop_at_eos and tok is not None else None
    spec = compare_methods(base_cfg, base_params, prompts, max_new_tokens=FLAGS.max_new_tokens, gamma=gammas,
                           m2r2=(mcfg, m2r2_params), draft=draft, methods=methods, batch_sizes=batch_sizes,
                           repeats=FLAGS.repeats, plan=plan, progress=say, draft_vocab=vocab,
                           layer_loop=FLAGS.layer_loop, eos_ids=eos)
    report = {"device": device_summary(), "layer_loop": layer_loops, "prompts": FLAGS.prompts,
              "n_prompts": len(prompts), "stop_ids": eos,
              "fresh_m2r2_params": fresh, "sharding": _placement(plan, base_params, m2r2_params, draft),
              "m2r2": mcfg.to_dict(),
              "draft_vocab": None if vocab is None else {
                  "file": FLAGS.draft_vocab, "size": int(vocab.size),
                  # how much of what ar actually wrote the subset could have drafted
                  "coverage_of_ar_answers": DV.coverage(DV.count_tokens(spec["ar"]["answers"], base_cfg.vocab_size),
                                                        vocab)},
              "speculative": spec}
    if tuning:
        report["gamma_tuning"] = tuning
    from m2r2_jax.bench.speculative import by_category

    if categories is not None:  # the timed prompts are the first n_prompts of the interleaved set
        report["speculative_by_category"] = by_category(spec, categories[:len(prompts)])
    if FLAGS.temperature > 0:
        report["speculative_sampled"] = sampled_comparison(
            base_cfg, base_params, prompts, max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature,
            top_p=FLAGS.top_p, gamma=gammas, m2r2=(mcfg, m2r2_params), draft=draft, methods=methods,
            repeats=FLAGS.repeats, plan=plan, progress=say, draft_vocab=vocab, layer_loop=FLAGS.layer_loop,
            eos_ids=eos)
    report["targets"] = R.targets(report)
    out = Path(FLAGS.out)
    import jax

    if jax.process_index() == 0:  # multi-host: one process writes the report
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out / "report.json", json.dumps(report, indent=2))
        R.write_plots(report, out)
    print(R.table(report))
    print(json.dumps({"report": str(out / "report.json")}))


def _placement(plan, base_params, m2r2_params, draft):
    """The plan and how it placed the benchmarked parameters (padded or replicated dimensions), or None."""
    if plan is None:
        return None
    from m2r2_jax.sharding.params import named_placement_notes

    trees = {"base": base_params, "m2r2": m2r2_params, "draft": None if draft is None else draft[1]}
    return plan.describe(named_placement_notes(plan, trees))
