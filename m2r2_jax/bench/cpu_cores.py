"""Pinning a CPU benchmark to fewer cores.

On a small CPU machine XLA's thread pools can cost a decode loop of tiny ops more than they give:
on the 2-core CI-like machine plain decoding of the embedded model runs ~1.6x faster pinned to one
core than spread over two, while the speculative methods (fewer, larger steps) gain much less. A
benchmark that only ran on all cores would flatter them, so `make demo` also measures pinned to one
core (`m2r2 bench --cpu_cores 1`) and reports both.

The pin must happen before JAX starts its CPU backend: the backend's threads inherit the affinity
of the thread that creates them, and threads that already exist keep theirs.
"""

from __future__ import annotations

import os

from m2r2_jax.errors import ConfigError


def pin_to_cores(n: int) -> list:
    """Restrict this process to the first `n` of the CPU cores it may use. Returns those cores."""
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError(f"--cpu_cores={n} needs os.sched_setaffinity (Linux)")
    allowed = sorted(os.sched_getaffinity(0))
    if not 1 <= n <= len(allowed):
        raise ConfigError(f"--cpu_cores={n} is invalid: expected 1..{len(allowed)} (the cores this process may use)")
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise ConfigError(f"--cpu_cores={n} came too late: JAX's backend is already running with its threads")
    cores = allowed[:n]
    os.sched_setaffinity(0, cores)
    return cores


def cores_in_use() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def device_summary() -> dict:
    """Where a benchmark ran: JAX's platform and device, and the host CPUs it may use."""
    import platform

    import jax

    d = jax.devices()[0]
    return {"platform": d.platform, "device_kind": d.device_kind, "count": jax.device_count(),
            "cpu_count": os.cpu_count(), "cpu_cores_in_use": cores_in_use(), "machine": platform.machine(),
            "jax": jax.__version__}
