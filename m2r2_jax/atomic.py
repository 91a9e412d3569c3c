"""Writing a directory all at once: build it under a temporary name beside the target and rename
it into place, so a crash never leaves a half-written directory under the final name."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from m2r2_jax.errors import CheckpointError


@contextlib.contextmanager
def atomic_directory(directory, overwrite: bool = False):
    """Yields a temporary directory; on success it replaces `directory` (refused when it exists
    and not `overwrite`), on any failure it is removed."""
    out = Path(directory).absolute()
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out} already exists (pass overwrite/--force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text_atomic(path, text: str) -> Path:
    """Write `text` to `path` all at once: a temporary file beside it, renamed into place, removed
    on any failure. The parent directory must exist."""
    out = Path(path).absolute()
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".tmp-", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return out
