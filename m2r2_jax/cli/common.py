"""Shared CLI plumbing: absl app start-up and the one-line error contract."""

from __future__ import annotations

import sys

from absl import app, flags

from m2r2_jax.errors import M2R2Error


def fail(message: str, code: int = 2):
    """Print one clear line and exit non-zero."""
    print(f"m2r2: error: {message}", file=sys.stderr)
    sys.exit(code)


def run_verb(main, argv) -> None:
    """Run a verb's `main(argv)` under absl; user errors become one line and exit status 2."""

    def wrapped(args):
        try:
            return main(args)
        except M2R2Error as e:
            fail(str(e))
        except flags.IllegalFlagValueError as e:
            fail(str(e))
        except OSError as e:  # unreadable/unwritable paths, full disks: one line, not a traceback
            where = f"{e.filename}: " if e.filename else ""
            fail(f"{where}{e.strerror or e}")
        except KeyboardInterrupt:
            fail("interrupted", 130)

    try:
        app.run(wrapped, argv=argv, flags_parser=_parse_flags)
    except M2R2Error as e:  # raised while parsing/validating --config
        fail(str(e))


def _parse_flags(argv):
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        fail(str(e).splitlines()[0])
    except M2R2Error as e:
        fail(str(e))
    except Exception as e:  # config files that fail to load/override (ml_collections raises assorted types)
        fail(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


def loaded_config(flag_values, name: str = "config"):
    """A config_flags value, with a failure to load the file turned into one clear line."""
    from pathlib import Path

    from ml_collections import config_flags

    from m2r2_jax.errors import ConfigError

    path = config_flags.get_config_filename(flag_values[name])
    if not Path(path).is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        return getattr(flag_values, name)
    except Exception as e:  # ml_collections re-raises the file's own error (any type) on access
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        raise ConfigError(f"cannot load config file {path}: {lines[-1] if lines else type(e).__name__}") from None
