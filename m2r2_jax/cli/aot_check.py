"""`m2r2 aot-check --model=configs/models/llama3_8b.py [--m2r2=configs/m2r2/llama3_8b.py] --program train
--sharding train --mesh fsdp=8 --batch_size 8 --seq_len 2048 --device_memory 95GiB`

Compiles a sharded train step (distillation with --m2r2, else pre-training) or generation program
ahead of time for the mesh, without allocating anything, and reports the bytes one device needs
(XLA memory analysis) against --device_memory. Fake CPU devices stand in for the real ones:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu m2r2 aot-check ...

For a platform this machine does not have, `--platform tpu` (or cuda, rocm) compiles on as many fake
CPU devices as the mesh names (no XLA_FLAGS needed) and also exports each program for the platform:

    m2r2 aot-check --model=configs/models/llama3_8b.py --m2r2=configs/m2r2/llama3_8b.py \
        --platform=tpu --mesh=fsdp=8 --device_memory=16GiB

and the report says per program whether it lowered for the platform (else the first error line)
and which custom calls it holds (`tpu_custom_call`: the Pallas TPU kernel).

Prints a JSON report (also written to --out) and exits 1 when a program does not fit or does not
lower for --platform.
"""

from __future__ import annotations

import math

from absl import flags
from ml_collections import config_flags

from m2r2_jax.cli import sharding_flags
from m2r2_jax.errors import ConfigError

config_flags.DEFINE_config_file("model", None, "model config file, e.g. configs/models/llama3_8b.py", lock_config=True)
config_flags.DEFINE_config_file("m2r2", None, "distillation config (configs/m2r2/*.py): check M2R2 programs",
                                lock_config=True)
flags.DEFINE_enum("program", "both", ["train", "generate", "both"], "which programs to compile")
flags.DEFINE_integer("batch_size", 8, "global batch size", lower_bound=1)
flags.DEFINE_integer("seq_len", 2048, "train: tokens per sequence", lower_bound=1)
flags.DEFINE_integer("prompt_len", 1024, "generate: prompt width", lower_bound=1)
flags.DEFINE_integer("max_new_tokens", 256, "generate: new tokens", lower_bound=1)
flags.DEFINE_enum("method", "m2r2_spec", ["ar", "m2r2_spec", "distance_spec", "m2r2_exit", "distance_exit"],
                  "generate: decoding method")
flags.DEFINE_string("device_memory", None, "memory of one device, e.g. 16GiB (TPU v5e), 95GiB (v5p), 80GB (H100)")
flags.DEFINE_float("headroom", 0.1, "fraction of device memory kept free", lower_bound=0.0, upper_bound=0.9)
flags.DEFINE_enum("platform", None, ["tpu", "cuda", "rocm"], "also export every program for this platform, "
                  "compiling on fake CPU devices (as many as --mesh names, or --devices)")
flags.DEFINE_integer("devices", None, "with --platform: fake CPU devices (default: the size of --mesh)", lower_bound=1)
flags.DEFINE_string("out", None, "write the JSON report here too")
flags.mark_flags_as_required(["model"])
sharding_flags.define("train")
FLAGS = flags.FLAGS


def main(argv):
    import sys

    from m2r2_jax.cli.common import loaded_config
    from m2r2_jax.sharding import aot
    from m2r2_jax.sharding.plan import ShardingPlan
    from m2r2_jax.training.config import validate_config

    memory = aot.parse_bytes(FLAGS.device_memory) if FLAGS.device_memory else None
    if FLAGS.platform:
        _use_fake_cpu_devices(FLAGS.devices or _mesh_size(FLAGS.mesh))
    elif FLAGS.devices:
        raise ConfigError("--devices is only for --platform (fake CPU devices standing in for that platform's)")
    sharding_flags.start(FLAGS, use_plan=False)
    model_cfg = validate_config(loaded_config(FLAGS, "model"))
    mcfg = None
    if FLAGS["m2r2"].value is not None:
        from m2r2_jax.m2r2.distill import validate_distill

        # the whole distillation config, as `m2r2 distill` checks it, though only its m2r2 section
        # shapes the programs: a bad value in it fails here too
        mcfg, _ = validate_distill(loaded_config(FLAGS, "m2r2"), model_cfg)
    reports = []
    if FLAGS.program in ("train", "both"):
        preset = FLAGS.sharding
        plan = ShardingPlan.from_preset(preset, mesh=FLAGS.mesh)
        reports.append(aot.check_train(model_cfg, plan, batch_size=FLAGS.batch_size, seq_len=FLAGS.seq_len,
                                       m2r2_cfg=mcfg, device_memory_bytes=memory, headroom=FLAGS.headroom,
                                       platform=FLAGS.platform))
    if FLAGS.program in ("generate", "both"):
        preset = "specdec" if FLAGS["sharding"].using_default_value else FLAGS.sharding
        plan = ShardingPlan.from_preset(preset, mesh=FLAGS.mesh)
        reports.append(aot.check_generate(model_cfg, plan, method=FLAGS.method, batch_size=FLAGS.batch_size,
                                          prompt_len=FLAGS.prompt_len, max_new_tokens=FLAGS.max_new_tokens,
                                          m2r2_cfg=mcfg, device_memory_bytes=memory, headroom=FLAGS.headroom,
                                          platform=FLAGS.platform))
    from m2r2_jax.json_files import emit_json_report

    emit_json_report({"checks": reports}, FLAGS.out)
    failed = False
    if any(r.get("fits") is False for r in reports):
        print("m2r2: does not fit: " + "; ".join(f"{r['program']} needs {r['per_device_gib']} GiB per device"
                                                 for r in reports if r.get("fits") is False), file=sys.stderr)
        failed = True
    if any(r.get("lowered") is False for r in reports):
        print(f"m2r2: does not lower for {FLAGS.platform}: " + "; ".join(
            f"{r['program']}: {r['lowering_error']}" for r in reports if r.get("lowered") is False), file=sys.stderr)
        failed = True
    if failed:
        sys.exit(1)


def _mesh_size(spec) -> int:
    from m2r2_jax.sharding.mesh import parse_mesh

    sizes = parse_mesh(spec) if spec else {}
    if not spec or -1 in sizes.values():
        raise ConfigError("--platform needs a --mesh with every size given (e.g. fsdp=8) or --devices N: "
                          "it compiles on that many fake CPU devices")
    return math.prod(sizes.values())


def _use_fake_cpu_devices(n: int) -> None:
    """Compile on n fake CPU devices standing in for the target's (set before JAX starts a backend)."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)

