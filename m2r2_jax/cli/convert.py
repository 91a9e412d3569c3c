"""`m2r2 convert --hf DIR --out CKPT_DIR [--dtype float32|bfloat16|float16] [--force]`

Imports a Hugging Face checkpoint (config.json + *.safetensors, single file or sharded with an
index) of a supported family (llama, mistral, qwen2, phi3, mixtral, qwen2_moe, olmoe) as a model
checkpoint, copying tokenizer.model / tokenizer.json when present. The dtype defaults to the one
recorded in config.json (float32 when absent).
"""

from __future__ import annotations

from absl import flags

flags.DEFINE_string("hf", None, "Hugging Face model directory (config.json + *.safetensors)")
flags.DEFINE_string("out", None, "model checkpoint directory to write")
flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"],
                  "parameter dtype of the checkpoint (default: the dtype in config.json, else float32)")
flags.DEFINE_bool("force", False, "replace --out if it exists")
flags.mark_flags_as_required(["hf", "out"])
FLAGS = flags.FLAGS


def main(argv):
    import json

    from m2r2_jax.interop.convert import convert_hf

    out = convert_hf(FLAGS.hf, FLAGS.out, dtype=FLAGS.dtype, overwrite=FLAGS.force)
    c = json.loads((out / "model_config.json").read_text())
    print(f"wrote {out} ({c['family']}, {c['n_layers']} layers, d_model {c['d_model']}, vocab {c['vocab_size']}, "
          f"{c['param_dtype']})")
