"""`m2r2 export --checkpoint CKPT_DIR --out HF_DIR [--max_shard_size 5GB] [--force]`

Exports a model checkpoint as a Hugging Face directory that transformers loads: config.json and
safetensors in the hub layout (sharded with model.safetensors.index.json above --max_shard_size),
plus the checkpoint's tokenizer file when it has one.
"""

from __future__ import annotations

from absl import flags

flags.DEFINE_string("checkpoint", None, "model checkpoint directory")
flags.DEFINE_string("out", None, "Hugging Face directory to write")
flags.DEFINE_string("max_shard_size", "5GB", "largest safetensors shard, e.g. 500MB, 5GB, 2GiB")
flags.DEFINE_bool("force", False, "replace --out if it exists")
flags.mark_flags_as_required(["checkpoint", "out"])
FLAGS = flags.FLAGS


def main(argv):
    from m2r2_jax.interop.convert import export_hf

    out = export_hf(FLAGS.checkpoint, FLAGS.out, max_shard_size=FLAGS.max_shard_size, overwrite=FLAGS.force)
    print(f"wrote {out}")
