"""Reading JSON files that users and other tools hand us (checkpoint metadata, config.json),
writing JSON-lines outputs all at once, and a report printed and saved."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from m2r2_jax.errors import CheckpointError


def read_json_object(path, error=CheckpointError) -> dict:
    """The JSON object in `path`; unreadable text, invalid JSON or a non-object raise `error`
    with one line naming the file (never a decoder traceback)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{p} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise error(f"{p} must hold a JSON object, got {type(data).__name__}")
    return data


def write_jsonl_atomic(path, rows) -> None:
    """One JSON object per line, written to a temporary file and renamed into place (the parent
    directory is created)."""
    from m2r2_jax.atomic import write_text_atomic

    Path(path).absolute().parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))


def report_path_error(out) -> Optional[str]:
    """Make the directory a report will be written to; the one-line reason it cannot be, or None.
    Called before a measurement starts, so that minutes of work are not lost at the end."""
    if not out:
        return None
    path = Path(out).absolute()
    if path.is_dir():
        return f"--out {out} is a directory: expected a file name"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"--out {out}: cannot create its directory: {e.strerror or e}"
    return None


def emit_json_report(report: dict, out=None) -> None:
    """Print `report` as indented JSON and, with `out`, write the same text there atomically (the
    directory is created)."""
    from m2r2_jax.atomic import write_text_atomic

    text = json.dumps(report, indent=2)
    if out:
        Path(out).absolute().parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out, text + "\n")
    print(text)
