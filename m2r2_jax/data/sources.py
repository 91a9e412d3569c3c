"""Text sources: each returns a list of documents (strings).

    text_documents(paths)                      one document per file (globs allowed)
    jsonl_documents(paths, field)              one document per line's `field`
    tfds_documents(name, split, data_dir, field)  a tfds ArrayRecord `data_source`, no TensorFlow
    embedded_documents(split)                  the embedded corpus (one document)

Every problem the user can fix becomes a `DataError` that names the file (and line) at fault.
`tensorflow_datasets` is imported only inside `tfds_documents`, so the text paths never load it.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Sequence, Union

from m2r2_jax.data import corpus
from m2r2_jax.errors import DataError

SOURCES = ("embedded", "text", "jsonl", "tfds")
Paths = Union[str, Sequence[str]]


def expand_paths(paths: Paths) -> list[Path]:
    """Expand files and globs (in the order given, each glob sorted); error on a miss."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    out: list[Path] = []
    for p in paths:
        p = str(p)
        if glob.has_magic(p):
            hits = sorted(glob.glob(p))
            if not hits:
                raise DataError(f"no file matches {p!r}")
            out += [Path(h) for h in hits]
        elif Path(p).is_file():
            out.append(Path(p))
        else:
            raise DataError(f"data file {p} does not exist")
    if not out:
        raise DataError("no data files given")
    return out


def _decode_utf8(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where} is not UTF-8 text (invalid byte 0x{raw[e.start]:02x} at byte offset {e.start})") from None


def text_documents(paths: Paths) -> list[str]:
    return [_decode_utf8(p.read_bytes(), str(p)) for p in expand_paths(paths)]


def jsonl_documents(paths: Paths, field: str = "text") -> list[str]:
    docs = []
    for p in expand_paths(paths):
        for lineno, raw in enumerate(p.read_bytes().split(b"\n"), start=1):
            if not raw.strip():
                continue
            line = _decode_utf8(raw, f"{p}:{lineno}")
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{p}:{lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(record, dict) or field not in record:
                raise DataError(f"{p}:{lineno}: no field {field!r} in this JSON line")
            value = record[field]
            if not isinstance(value, str):
                raise DataError(f"{p}:{lineno}: field {field!r} is {type(value).__name__}, expected a string")
            docs.append(value)
    return docs


def tfds_documents(name: str, split: str = "train", data_dir=None, field: str = "text", max_documents: int = 0) -> list[str]:
    """Documents from a prepared tfds dataset in ArrayRecord format (`tfds.data_source`)."""
    try:
        import tensorflow_datasets as tfds  # lazy: heavy, and only this source needs it
    except ImportError as e:
        raise DataError(f"data.source=tfds needs tensorflow-datasets: {e}") from None
    try:
        source = tfds.data_source(name, split=split, data_dir=data_dir)
    except Exception as e:  # tfds raises many types for a missing/unprepared dataset
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"cannot open tfds dataset {name!r} split {split!r}: {msg[:300]}") from None
    n = len(source) if not max_documents else min(len(source), max_documents)
    docs = []
    for i in range(n):
        record = source[i]
        if field not in record:
            raise DataError(f"tfds {name}/{split} record {i}: no field {field!r} (fields: {sorted(record)})")
        value = record[field]
        if hasattr(value, "item") and getattr(value, "shape", None) == ():
            value = value.item()
        if isinstance(value, bytes):
            value = _decode_utf8(value, f"tfds {name}/{split} record {i} field {field!r}")
        if not isinstance(value, str):
            raise DataError(f"tfds {name}/{split} record {i}: field {field!r} is {type(value).__name__}, expected text")
        docs.append(value)
    return docs


def embedded_documents(split: str = "train", heldout_fraction: float = corpus.DEFAULT_HELDOUT_FRACTION) -> list[str]:
    return [corpus.embedded_split(split, heldout_fraction)]


def load_documents(dcfg) -> list[str]:
    """Documents named by a data config section (see `m2r2_jax.training.config`)."""
    source = dcfg.source
    if source == "embedded":
        docs = embedded_documents(dcfg.split, dcfg.heldout_fraction)
    elif source == "text":
        docs = text_documents(list(dcfg.paths))
    elif source == "jsonl":
        docs = jsonl_documents(list(dcfg.paths), dcfg.text_field)
    elif source == "tfds":
        docs = tfds_documents(dcfg.tfds_name, dcfg.split, dcfg.tfds_data_dir or None, dcfg.text_field, dcfg.max_documents)
    else:
        raise DataError(f"data.source={source!r} is invalid: expected one of {', '.join(SOURCES)}")
    if dcfg.get("max_documents", 0) and source != "tfds":
        docs = docs[: dcfg.max_documents]
    if not any(d.strip() for d in docs):
        raise DataError(f"the corpus (data.source={source}) is empty: no non-blank text")
    return docs
