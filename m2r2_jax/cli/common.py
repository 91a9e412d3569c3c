"""Shared CLI plumbing: absl app start-up and the one-line error contract."""

from __future__ import annotations

import sys

from absl import app, flags

from m2r2_jax.errors import M2R2Error, Preempted


def fail(message: str, code: int = 2):
    """Print one clear line and exit non-zero."""
    print(f"m2r2: error: {message}", file=sys.stderr)
    sys.exit(code)


def run_verb(main, argv) -> None:
    """Run a verb's `main(argv)` under absl; user errors become one line and exit status 2."""

    def wrapped(args):
        from absl import logging

        if not flags.FLAGS["verbosity"].present:  # orbax logs every save and restore at INFO
            logging.set_verbosity(logging.WARNING)
        from m2r2_jax.bench.compile_cache import cli_default

        cli_default()  # a later run with the same programs loads them instead of compiling
        try:
            if len(args) > 1:  # every verb takes flags only
                raise M2R2Error(f"unexpected arguments {args[1:]}; pass options as --flags")
            return main(args)
        except M2R2Error as e:
            fail(str(e))
        except flags.IllegalFlagValueError as e:
            fail(str(e))
        except OSError as e:  # unreadable/unwritable paths, full disks: one line, not a traceback
            fail(_os_error_line(e))
        except KeyboardInterrupt:
            fail("interrupted", 130)
        except Preempted as e:  # SIGTERM stopped a training stage after a checkpoint: resumable
            print(f"m2r2: preempted: {e}", file=sys.stderr)
            sys.exit(143)

    try:
        app.run(wrapped, argv=argv, flags_parser=_parse_flags)
    except M2R2Error as e:  # raised while parsing/validating --config
        fail(str(e))


def _os_error_line(e: OSError) -> str:
    from pathlib import Path

    if isinstance(e, FileExistsError) and e.filename and not Path(e.filename).is_dir():
        # mkdir of an output directory whose path runs through an existing file
        return f"{e.filename} is a file, not a directory: cannot create an output path inside it"
    where = f"{e.filename}: " if e.filename else ""
    return f"{where}{e.strerror or e}"


INT64 = (-(2 ** 63), 2 ** 63 - 1)


def _check_integer_flags(flag_values) -> None:
    """Integer flags end up in numpy/JAX (seeds, sizes, counts), which hold 64-bit integers: a
    larger value is refused here, before it overflows deep inside a library."""
    for name in flag_values:
        flag = flag_values[name]
        if (flag.present and flag.flag_type() == "int" and isinstance(flag.value, int)
                and not INT64[0] <= flag.value <= INT64[1]):
            fail(f"flag --{name}={flag.value}: out of range, expected a 64-bit integer")


def _parse_flags(argv):
    try:
        rest = flags.FLAGS(argv)
    except flags.Error as e:
        fail(str(e).splitlines()[0])
    except M2R2Error as e:
        fail(str(e))
    except Exception as e:  # config files that fail to load/override (ml_collections raises assorted types)
        fail(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    _check_integer_flags(flags.FLAGS)
    return rest


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


def required_tokenizer(checkpoint, purpose: str):
    """The tokenizer stored with a model checkpoint, loaded; a checkpoint without one is a
    CheckpointError naming what it was needed for ("to encode the prompt", ...)."""
    from m2r2_jax.data.tokenizer import load_tokenizer
    from m2r2_jax.errors import CheckpointError
    from m2r2_jax.models.checkpoint import tokenizer_path

    tok_file = tokenizer_path(checkpoint)
    if tok_file is None:
        raise CheckpointError(f"{checkpoint} has no tokenizer/ directory {purpose}")
    return load_tokenizer(tok_file)
