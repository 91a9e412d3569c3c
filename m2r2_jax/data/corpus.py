"""The embedded corpus: the complete works of Shakespeare, shipped as package data.

It is the project's default text for tokenizer training, tiny base-model pre-training and M2R2
distillation, so every job runs offline on a fresh machine (see `embedded/SOURCES.md`).

`split_lines(text, heldout_fraction)` is the one train / held-out split every part of the project
uses: the last `heldout_fraction` of the lines (rounded up, cut at a line boundary) are held out.
The split is a pure function of the text, so distillation, alignment analysis and demo prompts all
see the same held-out text without storing indices anywhere.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import math
from importlib import resources

from m2r2_jax.errors import DataError

EMBEDDED_FILE = "shakespeare.txt.gz"
EMBEDDED_SHA256 = "3237e33221e73615c677bd59fd69a76da38f9a2eb51d6efb7191f32f8cb9fa4c"
DEFAULT_HELDOUT_FRACTION = 0.05
SPLITS = ("train", "heldout", "all")


@functools.lru_cache(maxsize=1)
def embedded_corpus() -> str:
    """The whole embedded corpus as one string (checked against its recorded sha256)."""
    blob = resources.files("m2r2_jax.data").joinpath("embedded", EMBEDDED_FILE).read_bytes()
    raw = gzip.decompress(blob)
    if hashlib.sha256(raw).hexdigest() != EMBEDDED_SHA256:
        raise DataError(f"embedded corpus {EMBEDDED_FILE} is corrupt (sha256 mismatch); reinstall the package")
    return raw.decode("utf-8")


def split_lines(text: str, heldout_fraction: float = DEFAULT_HELDOUT_FRACTION) -> tuple[str, str]:
    """(train, heldout): the last `heldout_fraction` of the lines are held out.

    `train + heldout == text` exactly, and both parts are non-empty for any text of >= 2 lines.
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise DataError(f"heldout_fraction={heldout_fraction!r} is invalid: expected a float in (0, 1)")
    lines = text.splitlines(keepends=True)
    if len(lines) < 2:
        raise DataError(f"cannot split a text of {len(lines)} line(s) into train and held-out parts")
    n_held = min(len(lines) - 1, max(1, math.ceil(len(lines) * heldout_fraction)))
    cut = len(lines) - n_held
    return "".join(lines[:cut]), "".join(lines[cut:])


def embedded_split(split: str = "train", heldout_fraction: float = DEFAULT_HELDOUT_FRACTION) -> str:
    """One split of the embedded corpus: "train", "heldout" or "all"."""
    if split not in SPLITS:
        raise DataError(f"split={split!r} is invalid: expected one of {', '.join(SPLITS)}")
    text = embedded_corpus()
    if split == "all":
        return text
    train, held = split_lines(text, heldout_fraction)
    return train if split == "train" else held
