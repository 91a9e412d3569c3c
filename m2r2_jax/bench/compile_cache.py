"""JAX's persistent compilation cache: on by default for the CLI verbs, and for the benchmark runs.

Every `m2r2` verb compiles through a persistent cache (`cli_default`): a second `m2r2 generate`
with the same model and shapes loads the first one's programs instead of compiling them again.
Where: $JAX_COMPILATION_CACHE_DIR when set (JAX's own setting wins), else $M2R2_COMPILE_CACHE,
else ~/.cache/m2r2_jax/xla; M2R2_COMPILE_CACHE=off turns it off. A multi-process run (jax.distributed)
does not use the default location: its processes would write the same entries at once.

The demo compiles the same programs more than once: the draft-length tuning times the round of
each candidate gamma, and the benchmark then compiles the chosen gamma's round again; the one-core
benchmark is a fresh process that compiles every engine anew; a rerun on trained artifacts compiles
everything again. With the cache, a program whose HLO and compile options were seen before is
loaded from disk instead (JAX keys entries by both, and by the jax version), so the timed programs
are exactly the ones that would have been compiled.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Optional

import jax
import jax.monitoring
from jax.experimental.compilation_cache import compilation_cache

# Programs that compile faster than this are not written: loading them saves too little.
MIN_COMPILE_S = 0.2

_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
_HIT = "/jax/compilation_cache/cache_hits"
_SAVED = "/jax/compilation_cache/compile_time_saved_sec"


CACHE_ENV = "M2R2_COMPILE_CACHE"
OFF = ("off", "none", "0", "false", "no")
_DEFAULT_IN_USE = {"path": None}


def cli_default() -> Optional[str]:
    """Turn the persistent cache on for a CLI verb (see the module docstring); returns the
    directory in use, or None when it is off. Call before the first compile."""
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    setting = os.environ.get(CACHE_ENV, "").strip()
    if setting.lower() in OFF:
        return None
    path = Path(setting).expanduser() if setting else Path.home() / ".cache" / "m2r2_jax" / "xla"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"m2r2: warning: compiling without a persistent cache: {path}: {e.strerror or e}", file=sys.stderr)
        return None
    jax.config.update("jax_compilation_cache_dir", str(path.absolute()))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
    _DEFAULT_IN_USE["path"] = str(path.absolute())
    return _DEFAULT_IN_USE["path"]


def leave_default_for_multiprocess() -> None:
    """Stop using the default cache turned on by `cli_default` (a run of several processes)."""
    if _DEFAULT_IN_USE["path"] and jax.config.jax_compilation_cache_dir == _DEFAULT_IN_USE["path"]:
        jax.config.update("jax_compilation_cache_dir", None)
        compilation_cache.reset_cache()
        _DEFAULT_IN_USE["path"] = None


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
