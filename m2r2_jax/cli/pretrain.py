"""`m2r2 pretrain --config=configs/models/tiny_dense.py --workdir DIR [--config.train.steps=N]`

Pre-trains a base model from scratch: trains a sentencepiece tokenizer on the embedded corpus when
the config names none (once per workdir), packs the corpus, trains with `m2r2_jax.training.train`
(resuming from the workdir's latest checkpoint), reports the held-out loss and exports the model to
DIR/model (`m2r2_jax.models.checkpoint.save_model`, tokenizer included). SIGTERM saves a checkpoint
and exits with status 143; rerun the same command to resume.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from absl import flags

from m2r2_jax.cli import sharding_flags
from ml_collections import config_flags

config_flags.DEFINE_config_file("config", None, "config file, e.g. configs/models/tiny_dense.py", lock_config=True)
flags.DEFINE_string("workdir", None, "directory for checkpoints, TensorBoard logs, tokenizer and the exported model")
flags.mark_flags_as_required(["config", "workdir"])
sharding_flags.define("train")
FLAGS = flags.FLAGS


def main(argv):
    from m2r2_jax.cli.common import loaded_config
    plan = sharding_flags.start(FLAGS)
    from m2r2_jax.training.pretrain import pretrain

    summary = pretrain(loaded_config(FLAGS, "config"), Path(FLAGS.workdir), plan=plan)
    if summary["preempted"]:
        print(f"m2r2: preempted at step {summary['step']}; checkpoint saved in {FLAGS.workdir}; "
              "rerun the same command to resume", file=sys.stderr)
        sys.exit(143)
    print(json.dumps(summary, indent=2))

