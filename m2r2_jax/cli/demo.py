"""`m2r2 demo [--out runs/demo] [--budget full|tiny] [--force] [--dense_steps N] [--distill_steps N]`: the main job on the embedded default
(what `make demo` runs). Trains, distills, measures; writes OUT/report.json and plots."""

from __future__ import annotations

from absl import flags

flags.DEFINE_string("out", "runs/demo", "output directory (report.json, plots, artifacts/)")
flags.DEFINE_enum("budget", "full", ["full", "tiny"], "full: ~15 min on 2 CPU cores; tiny: ~3 min")
flags.DEFINE_bool("force", False, "retrain every artifact instead of reusing ones with the same config")
flags.DEFINE_bool("skip_moe", False, "leave out the MoE base and the expert-loading measurements")
flags.DEFINE_integer("dense_steps", None, "pre-training steps of the dense base (default: the budget's); more "
                     "steps give a base whose later layers matter more, which every drafter finds harder")
flags.DEFINE_integer("distill_steps", None, "M2R2 distillation steps of the dense base (default: the budget's)")
FLAGS = flags.FLAGS


def main(argv):
    from m2r2_jax.bench.demo import run_demo

    steps = {k: v for k, v in (("dense_steps", FLAGS.dense_steps), ("distill_steps", FLAGS.distill_steps))
             if v is not None}
    run_demo(FLAGS.out, FLAGS.budget, FLAGS.force, FLAGS.skip_moe, steps)
