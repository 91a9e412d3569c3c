"""The flags every verb that runs on many devices shares: --mesh, --sharding and the multi-host
coordinator (see `m2r2_jax.sharding`)."""

from __future__ import annotations

from absl import flags


def define(default_preset: str) -> None:
    flags.DEFINE_string("mesh", None, "device mesh, e.g. data=2,fsdp=1,tensor=4 (axes data, fsdp, tensor, expert; "
                        "one size may be -1 = the rest); default: the preset's own mesh")
    flags.DEFINE_string("sharding", default_preset, "sharding preset: train, specdec or a preset file "
                        "(configs/sharding/*.py)")
    flags.DEFINE_string("coordinator", None, "multi-host: coordinator host:port of jax.distributed "
                        "(auto-detected on TPU VMs and SLURM)")
    flags.DEFINE_integer("num_processes", None, "multi-host: number of processes (with --coordinator)")
    flags.DEFINE_integer("process_id", None, "multi-host: this process's index (with --coordinator)")


def start(flag_values, use_plan: bool = True):
    """Join the multi-host runtime if needed, then build the sharding plan of the flags. Without
    --mesh and --sharding it returns None: the verb's unsharded path (training splits only the
    batch over the devices, `train.data_parallel`; generation runs on one device)."""
    import jax

    from m2r2_jax.bench.compile_cache import leave_default_for_multiprocess
    from m2r2_jax.sharding.distributed import initialize

    initialize(flag_values.coordinator, flag_values.num_processes, flag_values.process_id)
    if jax.process_count() > 1:
        leave_default_for_multiprocess()
    if not use_plan:
        return None
    from m2r2_jax.sharding.plan import ShardingPlan

    if flag_values.mesh is None and flag_values["sharding"].using_default_value:
        return None
    return ShardingPlan.from_preset(flag_values.sharding, mesh=flag_values.mesh)
