"""Multi-host start-up through JAX's own runtime (`jax.distributed.initialize`).

    initialize()                                    # auto: TPU VM pods and SLURM jobs
    initialize("10.0.0.1:1234", num_processes=2, process_id=0)   # explicit coordinator

Must run before anything touches a JAX backend. Auto-detection covers what
`jax.distributed.initialize()` itself detects (Cloud TPU multi-worker slices, SLURM with more than
one task, Open MPI); a single-host run without those signs initialises nothing, so the same
command works on a laptop and on a pod. The explicit form also reads M2R2_COORDINATOR,
M2R2_NUM_PROCESSES and M2R2_PROCESS_ID from the environment (what `launch/` scripts set).
"""

from __future__ import annotations

import os
from typing import Optional

import jax

from m2r2_jax.errors import ConfigError

ENV_COORDINATOR = "M2R2_COORDINATOR"
ENV_NUM_PROCESSES = "M2R2_NUM_PROCESSES"
ENV_PROCESS_ID = "M2R2_PROCESS_ID"

_STATE = {"initialized": False}


def cluster_detected(env=None) -> Optional[str]:
    """Which multi-process environment this process runs in, or None for a single host."""
    env = os.environ if env is None else env
    hosts = env.get("TPU_WORKER_HOSTNAMES", "")
    if "," in hosts:
        return "tpu"
    if env.get("SLURM_JOB_ID") and int(env.get("SLURM_NTASKS", "1") or 1) > 1:
        return "slurm"
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return "mpi"
    return None


def _int_or_none(name: str, value) -> Optional[int]:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} is invalid: expected an integer") from None


def initialize(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, *, env=None, timeout_s: int = 300) -> str:
    """Join the multi-process runtime if this is a multi-process run. Returns what happened:
    'explicit', 'tpu' / 'slurm' / 'mpi' (auto-detected), 'single' (nothing to do) or 'already'."""
    if _STATE["initialized"]:
        return "already"
    env = os.environ if env is None else env
    coordinator = coordinator or env.get(ENV_COORDINATOR) or None
    num_processes = _int_or_none("num_processes", num_processes if num_processes is not None
                                 else env.get(ENV_NUM_PROCESSES))
    process_id = _int_or_none("process_id", process_id if process_id is not None else env.get(ENV_PROCESS_ID))
    if coordinator:
        if num_processes is None or process_id is None:
            raise ConfigError("a coordinator address needs num_processes and process_id too "
                              f"(--num_processes/--process_id or {ENV_NUM_PROCESSES}/{ENV_PROCESS_ID})")
        if num_processes < 1 or not (0 <= process_id < num_processes):
            raise ConfigError(f"process_id={process_id} / num_processes={num_processes} is invalid: "
                              "expected 0 <= process_id < num_processes")
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id,
                                   initialization_timeout=timeout_s)
        _STATE["initialized"] = True
        return "explicit"
    if num_processes is not None or process_id is not None:
        raise ConfigError("num_processes/process_id need a coordinator address (--coordinator or "
                          f"{ENV_COORDINATOR})")
    kind = cluster_detected(env)
    if kind is None:
        return "single"
    jax.distributed.initialize(initialization_timeout=timeout_s)
    _STATE["initialized"] = True
    return kind
