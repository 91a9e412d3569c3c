"""A reduced draft vocabulary: self-drafters score only the most frequent tokens.

A self-drafter's step is a few layers plus the full LM head. With a large vocabulary the head
dominates that step (Qwen2.5-0.5B: d 896, V 151,936; its head costs as much as ~9 of its layers),
so the draft path's cost is mostly the head however short the layer path is. Scoring only the
n most frequent tokens of a reference corpus (token frequencies are heavily skewed: the top few
thousand ids cover most running text) cuts that cost by V / n, at the price of never drafting a
rarer token. Verification keeps the full head, so decoding stays lossless: greedy output is
ar's, and with sampling the draft distribution q is the renormalised softmax over the subset,
which rejection sampling corrects exactly like any other q.

The subset is a JSON file {"ids": [...], "vocab_size": V, "source": ..., "coverage": ...}
written by `m2r2 draft-vocab` (or `save`), loaded with `load`, and handed to
`api.build_engine(..., draft_vocab=ids)`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from m2r2_jax.errors import ConfigError


def _first_outside(a: np.ndarray, vocab_size: int):
    """The first id of `a` outside [0, vocab_size), or None."""
    bad = a[(a < 0) | (a >= vocab_size)]
    return int(bad[0]) if bad.size else None


def count_tokens(sequences: Iterable[Sequence[int]], vocab_size: int) -> np.ndarray:
    """[V] int64: how often each token id occurs in `sequences` (ids outside [0, V) are an error)."""
    counts = np.zeros(vocab_size, np.int64)
    for seq in sequences:
        a = np.asarray(seq, np.int64).ravel()
        bad = _first_outside(a, vocab_size)
        if bad is not None:
            raise ConfigError(f"token id {bad} is outside the vocabulary (size {vocab_size})")
        counts += np.bincount(a, minlength=vocab_size)
    return counts


def most_frequent(counts: np.ndarray, size: int) -> np.ndarray:
    """The `size` most frequent ids (ties: lower id first), sorted ascending, int32."""
    counts = np.asarray(counts)
    if not isinstance(size, (int, np.integer)) or not 1 <= size <= counts.shape[0]:
        raise ConfigError(f"draft vocabulary size={size!r} is invalid: expected 1..{counts.shape[0]} "
                          "(the vocabulary size)")
    order = np.lexsort((np.arange(counts.shape[0]), -counts))  # by count descending, then by id
    return np.sort(order[:size]).astype(np.int32)


def coverage(counts: np.ndarray, ids: Sequence[int]) -> float:
    """Fraction of the counted tokens that fall inside `ids` (the best-case draft acceptance
    ceiling: a token outside is never drafted)."""
    counts = np.asarray(counts)
    total = counts.sum()
    return float(counts[np.asarray(ids, np.int64)].sum() / total) if total else 0.0


def check_ids(ids, vocab_size: int) -> np.ndarray:
    """Validated subset: a non-empty list of distinct ids in [0, V), returned sorted as int32."""
    try:
        a = np.asarray(ids)
    except (TypeError, ValueError):
        raise ConfigError("draft vocabulary is invalid: expected a list of token ids") from None
    if a.ndim != 1 or a.size == 0 or not np.issubdtype(a.dtype, np.integer):
        raise ConfigError("draft vocabulary is invalid: expected a non-empty list of integer token ids")
    bad = _first_outside(a, vocab_size)
    if bad is not None:
        raise ConfigError(f"draft vocabulary is invalid: token id {bad} is outside the model's vocabulary "
                          f"(size {vocab_size})")
    if np.unique(a).size != a.size:
        raise ConfigError("draft vocabulary is invalid: it lists a token id twice")
    return np.sort(a).astype(np.int32)


def save(path, ids: Sequence[int], vocab_size: int, source: str, counts: np.ndarray) -> dict:
    """Write the subset file (atomically); returns what was written."""
    from m2r2_jax.atomic import write_text_atomic

    ids = check_ids(ids, vocab_size)
    rec = {"ids": [int(i) for i in ids], "size": int(ids.size), "vocab_size": int(vocab_size), "source": source,
           "counted_tokens": int(np.asarray(counts).sum()), "coverage": coverage(counts, ids)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(rec) + "\n")
    return rec


def load(path, vocab_size: int) -> np.ndarray:
    """The validated ids of a subset file, for a model with `vocab_size` tokens."""
    path = Path(path)
    try:
        rec = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"draft vocabulary file {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"draft vocabulary file {path} is not readable JSON: {e}") from None
    if not isinstance(rec, dict) or "ids" not in rec:
        raise ConfigError(f"draft vocabulary file {path} has no \"ids\" list (write it with `m2r2 draft-vocab`)")
    if rec.get("vocab_size", vocab_size) != vocab_size:
        raise ConfigError(f"draft vocabulary file {path} is for a vocabulary of {rec['vocab_size']} tokens, "
                          f"the model has {vocab_size}")
    return check_ids(rec["ids"], vocab_size)
