"""`m2r2 demo [--model smollm2-135m-instruct|tiny] [--out runs/demo] [--budget full|tiny] [--distill] [--force]`:
the main job (what `make demo` runs). By default on SmolLM2-135M-Instruct: fetch, convert, the shipped
M2R2 parameters (or `--distill`: made here), then every measurement side by side on MT-Bench prompts
(bench/demo_pretrained.py). `--model tiny`: the self-contained story on tiny models trained here on
the embedded corpus, with the MoE expert-loading part (bench/demo.py). Writes OUT/report.json and plots."""

from __future__ import annotations

from absl import flags

flags.DEFINE_string("model", "smollm2-135m-instruct", "the base: a fetchable pretrained model "
                    "(smollm2-135m-instruct), or tiny (dense and MoE bases trained here on the embedded corpus)")
flags.DEFINE_string("out", "runs/demo", "output directory (report.json, plots, artifacts/)")
flags.DEFINE_enum("budget", "full", ["full", "tiny"], "full: ~15 min on 2 CPU cores; tiny: ~4 min")
flags.DEFINE_bool("force", False, "rebuild every artifact instead of reusing ones with the same config")
flags.DEFINE_bool("distill", False, "pretrained model: make the M2R2 parameters here with the committed recipe "
                  "(the base's answers to instruction prompts, then m2r2 distill; about an hour on 2 CPU cores) "
                  "instead of using the shipped ones")
flags.DEFINE_bool("skip_moe", False, "--model tiny: leave out the MoE base and the expert-loading measurements")
flags.DEFINE_integer("dense_steps", None, "--model tiny: pre-training steps of the dense base (default: the "
                     "budget's); more steps give a base whose later layers matter more, which every drafter finds harder")
flags.DEFINE_integer("distill_steps", None, "M2R2 distillation steps (--model tiny: of the dense base; a pretrained "
                     "model: with --distill, the recipe's train.steps)")
FLAGS = flags.FLAGS


def main(argv):
    from m2r2_jax.errors import ConfigError

    if FLAGS.model == "tiny":
        if FLAGS.distill:
            raise ConfigError("--distill is for a pretrained model: --model tiny always distills its own M2R2")
        from m2r2_jax.bench.demo import run_demo

        steps = {k: v for k, v in (("dense_steps", FLAGS.dense_steps), ("distill_steps", FLAGS.distill_steps))
                 if v is not None}
        run_demo(FLAGS.out, FLAGS.budget, FLAGS.force, FLAGS.skip_moe, steps)
        return
    if FLAGS.dense_steps is not None:
        raise ConfigError(f"--dense_steps is for --model tiny (a pretrained {FLAGS.model} is not trained here)")
    if FLAGS.distill_steps is not None and not FLAGS.distill:
        raise ConfigError("--distill_steps needs --distill (the shipped M2R2 parameters are already trained)")
    if FLAGS.distill_steps is not None and FLAGS.distill_steps < 1:
        raise ConfigError(f"--distill_steps={FLAGS.distill_steps} is invalid: expected a positive integer")
    from m2r2_jax.bench.demo_pretrained import run_pretrained_demo

    overrides = {"train.steps": FLAGS.distill_steps} if FLAGS.distill_steps is not None else {}
    run_pretrained_demo(FLAGS.out, FLAGS.model, FLAGS.budget, distill=FLAGS.distill, force=FLAGS.force,
                        recipe_overrides=overrides)
