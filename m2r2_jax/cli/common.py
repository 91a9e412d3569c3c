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
