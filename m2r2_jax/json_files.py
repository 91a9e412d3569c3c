"""Reading JSON files that users and other tools hand us (checkpoint metadata, config.json)."""

from __future__ import annotations

import json
from pathlib import Path

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
