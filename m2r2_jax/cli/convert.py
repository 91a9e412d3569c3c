"""`m2r2 convert (--hf DIR | --gguf FILE.gguf) --out CKPT_DIR [--dtype float32|bfloat16|float16] [--force]`

--hf imports a Hugging Face checkpoint (config.json + *.safetensors, single file or sharded with an
index) of a supported family (llama, mistral, qwen2, phi3, mixtral, qwen2_moe, olmoe, gemma3), copying
tokenizer.model / tokenizer.json with tokenizer_config.json, generation_config.json and
chat_template.jinja when present. The dtype defaults to the one recorded in config.json (float32
when absent).

--gguf imports a llama.cpp GGUF file (architectures llama, qwen2, gemma3; every quantisation the gguf
package dequantises), with the tokenizer, special ids, stop ids and chat template rebuilt from its
metadata. The dtype defaults to float32, which keeps the dequantised weights exact.
"""

from __future__ import annotations

from absl import flags

flags.DEFINE_string("hf", None, "Hugging Face model directory (config.json + *.safetensors)")
flags.DEFINE_string("gguf", None, "GGUF model file (e.g. from `m2r2 fetch`)")
flags.DEFINE_string("out", None, "model checkpoint directory to write")
flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"],
                  "parameter dtype of the checkpoint (default: --hf: the dtype in config.json, else float32; "
                  "--gguf: float32)")
flags.DEFINE_bool("force", False, "replace --out if it exists")
flags.mark_flags_as_required(["out"])
FLAGS = flags.FLAGS


def main(argv):
    import json
    import time

    from m2r2_jax.errors import ConfigError
    from m2r2_jax.interop.convert import convert_gguf, convert_hf

    if bool(FLAGS.hf) == bool(FLAGS.gguf):
        raise ConfigError("give exactly one of --hf DIR (Hugging Face checkpoint) or --gguf FILE (GGUF file)")
    start = time.perf_counter()
    if FLAGS.hf:
        out = convert_hf(FLAGS.hf, FLAGS.out, dtype=FLAGS.dtype, overwrite=FLAGS.force)
    else:
        out = convert_gguf(FLAGS.gguf, FLAGS.out, dtype=FLAGS.dtype, overwrite=FLAGS.force)
    c = json.loads((out / "model_config.json").read_text())
    print(f"wrote {out} ({c['family']}, {c['n_layers']} layers, d_model {c['d_model']}, vocab {c['vocab_size']}, "
          f"{c['param_dtype']}) in {time.perf_counter() - start:.1f} s")
