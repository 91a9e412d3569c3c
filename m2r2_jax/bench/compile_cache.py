"""JAX's persistent compilation cache for the benchmark runs.

The demo compiles the same programs more than once: the draft-length tuning times the round of
each candidate gamma, and the benchmark then compiles the chosen gamma's round again; the one-core
benchmark is a fresh process that compiles every engine anew; a rerun on trained artifacts compiles
everything again. With the cache, a program whose HLO and compile options were seen before is
loaded from disk instead (JAX keys entries by both, and by the jax version), so the timed programs
are exactly the ones that would have been compiled.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import jax
import jax.monitoring
from jax.experimental.compilation_cache import compilation_cache

# Programs that compile faster than this are not written: loading them saves too little.
MIN_COMPILE_S = 0.2

_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
_HIT = "/jax/compilation_cache/cache_hits"
_SAVED = "/jax/compilation_cache/compile_time_saved_sec"


def child_env(directory) -> dict:
    """Environment variables that give a child process the same cache."""
    return {"JAX_COMPILATION_CACHE_DIR": str(Path(directory).absolute()),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": str(MIN_COMPILE_S)}


@contextlib.contextmanager
def persistent_cache(directory):
    """Inside the block every compile is looked up in, and written to, `directory` (created);
    the previous settings come back afterwards. `reset_cache` makes JAX open the new location
    (it opens the cache once, at the first compile that uses it).
    Yields {"hits": programs loaded from the cache, "compile_s_saved": their compile seconds
    (as recorded when they were written) minus the seconds spent loading them}, counted in this
    process while the block is open."""
    path = Path(directory).absolute()
    path.mkdir(parents=True, exist_ok=True)
    before = {name: getattr(jax.config, name) for name in _OPTIONS}
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
    compilation_cache.reset_cache()
    stats = {"hits": 0, "compile_s_saved": 0.0}

    def on_event(event: str, **_) -> None:
        if event == _HIT:
            stats["hits"] += 1

    def on_duration(event: str, seconds: float, **_) -> None:
        if event == _SAVED:
            stats["compile_s_saved"] += seconds

    jax.monitoring.register_event_listener(on_event)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        yield stats
    finally:
        jax.monitoring.unregister_event_listener(on_event)
        jax.monitoring.unregister_event_duration_listener(on_duration)
        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()
