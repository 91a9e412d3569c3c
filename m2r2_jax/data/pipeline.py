"""Language-model input pipeline: documents -> token stream -> packed examples -> grain batches.

    stream   = tokenize_documents(tokenizer, docs)     # int32, EOS after every document
    examples = pack(stream, seq_len)                   # [N, seq_len + 1]
    it       = batch_iterator(examples, batch_size, seed)   # grain iterator, per-host shard

Packing: the documents are concatenated, each followed by EOS (so a model sees where one text ends
and the next begins), and cut into windows of seq_len + 1 tokens with stride seq_len: the inputs are
window[:-1], the targets window[1:], and every token of the stream is a target exactly once.

Batches: the example index space is sharded across hosts first (`process_index::process_count`),
then shuffled with a seed, re-shuffled every epoch (grain's per-epoch seeds), repeated forever and
batched to batch_size / process_count rows per host. The iterator is grain's `DatasetIterator`:
`get_state()` is a small JSON-able dict and `set_state()` restores it, so a resumed run draws the
same next batch as an uninterrupted one. Tokenisation happens once, in memory, at start-up.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import grain
import jax
import numpy as np

from m2r2_jax.data.sources import load_documents
from m2r2_jax.data.tokenizer import Tokenizer
from m2r2_jax.errors import DataError

# Documents are tokenised in groups so long corpora don't hold every Python id list at once.
_ENCODE_GROUP = 256


def tokenize_documents(tokenizer: Tokenizer, docs: Sequence[str]) -> np.ndarray:
    """One int32 stream: tokens of each document followed by EOS."""
    eos = tokenizer.eos_id
    if eos is None:
        raise DataError(f"tokenizer {tokenizer.path} has no EOS token; packing needs one to mark document ends")
    parts = []
    for i in range(0, len(docs), _ENCODE_GROUP):
        for ids in tokenizer.encode_batch(docs[i : i + _ENCODE_GROUP]):
            if ids:
                parts.append(np.asarray(ids, np.int32))
                parts.append(np.asarray([eos], np.int32))
    if not parts:
        raise DataError("the corpus is empty: no document produced any token")
    return np.concatenate(parts)


def pack(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """Windows [N, seq_len + 1] with stride seq_len (consecutive windows share one token)."""
    if seq_len <= 0:
        raise DataError(f"seq_len={seq_len} is invalid: expected a positive integer")
    n = (len(stream) - 1) // seq_len
    if n <= 0:
        raise DataError(f"the corpus has {len(stream)} tokens: too small for one example of seq_len={seq_len} (+1)")
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return stream[idx]


def batch_iterator(
    examples: np.ndarray,
    batch_size: int,
    seed: int,
    *,
    shuffle: bool = True,
    process_index: Optional[int] = None,
    process_count: Optional[int] = None,
) -> grain.DatasetIterator:
    """Endless iterator of host-local batches [batch_size // process_count, seq_len + 1]."""
    pi = jax.process_index() if process_index is None else process_index
    pc = jax.process_count() if process_count is None else process_count
    if batch_size % pc:
        raise DataError(f"batch_size={batch_size} is not divisible by the number of hosts ({pc})")
    local_batch = batch_size // pc
    ds = grain.MapDataset.source(examples)[pi::pc]
    if len(ds) < local_batch:
        raise DataError(
            f"the corpus is too small for one batch: {len(examples)} packed examples "
            f"({len(ds)} on this host) < {local_batch} rows per host (batch_size={batch_size})"
        )
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(None).batch(local_batch, drop_remainder=True)
    # In-memory source: threads would only contend for the GIL.
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))


@dataclasses.dataclass(frozen=True)
class PipelineInfo:
    documents: int
    tokens: int
    examples: int
    seq_len: int
    batch_size: int


def lm_pipeline(dcfg, tokenizer: Tokenizer, batch_size: int, seed: int, docs: Optional[Sequence[str]] = None):
    """Iterator and sizes for a data config section: (grain iterator, PipelineInfo)."""
    docs = load_documents(dcfg) if docs is None else docs
    stream = tokenize_documents(tokenizer, docs)
    if stream.max(initial=0) >= tokenizer.vocab_size:
        raise DataError(f"token id {int(stream.max())} >= tokenizer vocab_size {tokenizer.vocab_size}")
    examples = pack(stream, dcfg.seq_len)
    it = batch_iterator(examples, batch_size, seed, shuffle=dcfg.shuffle)
    return it, PipelineInfo(len(docs), int(stream.size), int(examples.shape[0]), dcfg.seq_len, batch_size)
