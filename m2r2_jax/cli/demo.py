"""`m2r2 demo [--out runs/demo] [--budget full|tiny] [--force]`: the main job on the embedded default
(what `make demo` runs). Trains, distills, measures; writes OUT/report.json and plots."""

from __future__ import annotations

from absl import flags

flags.DEFINE_string("out", "runs/demo", "output directory (report.json, plots, artifacts/)")
flags.DEFINE_enum("budget", "full", ["full", "tiny"], "full: ~15 min on 2 CPU cores; tiny: ~3 min")
flags.DEFINE_bool("force", False, "retrain every artifact instead of reusing ones with the same config")
flags.DEFINE_bool("skip_moe", False, "leave out the MoE base and the expert-loading measurements")
FLAGS = flags.FLAGS


def main(argv):
    from m2r2_jax.bench.demo import run_demo

    run_demo(FLAGS.out, FLAGS.budget, FLAGS.force, FLAGS.skip_moe)
