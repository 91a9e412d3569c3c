"""`m2r2 distill --config=configs/m2r2/tiny_dense.py --config.base_checkpoint=DIR --workdir WD`

Trains the M2R2 parameters (adapters, rate vectors, exit norms; then the router) by
self-distillation from the frozen base, with the same training loop, checkpointing and resume as
pre-training. Writes WD/m2r2 (the M2R2 checkpoint, tied to its base) and WD/distill_summary.json.
SIGTERM saves a checkpoint and exits with status 143; rerun the same command to resume.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from absl import flags

from m2r2_jax.cli import sharding_flags
from ml_collections import config_flags

config_flags.DEFINE_config_file("config", None, "distillation config, e.g. configs/m2r2/tiny_dense.py", lock_config=True)
flags.DEFINE_string("workdir", None, "directory for stage checkpoints, TensorBoard logs and the M2R2 checkpoint")
flags.mark_flags_as_required(["config", "workdir"])
sharding_flags.define("train")
FLAGS = flags.FLAGS


def main(argv):
    from m2r2_jax.cli.common import loaded_config
    plan = sharding_flags.start(FLAGS)
    from m2r2_jax.m2r2.distill import distill

    summary = distill(loaded_config(FLAGS, "config"), Path(FLAGS.workdir), plan=plan)
    if summary.get("preempted"):
        print(f"m2r2: preempted; checkpoint saved in {FLAGS.workdir}; rerun the same command to resume", file=sys.stderr)
        sys.exit(143)
    print(json.dumps(summary, indent=2))
