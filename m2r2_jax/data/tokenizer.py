"""Tokenizers: one interface, two backends (sentencepiece `tokenizer.model`, HF `tokenizer.json`).

    tok = load_tokenizer(path_or_dir)      # picks the backend by file
    ids = tok.encode(text); text = tok.decode(ids)
    tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id   (an id is None when the tokenizer has none)

`train_sentencepiece(text, vocab_size, out_path)` trains the project's own tokenizer on a corpus:
byte-level BPE with byte fallback (every string round-trips), no text normalisation, "\\n" as a
single piece (verse is line-structured), fixed special ids (unk 0, bos 1, eos 2, pad 3). It trains
on a deterministic subsample of the lines with one thread, so the same text always gives the same
model file — the tiny dense, MoE and draft models rely on that to share one vocabulary.
"""

from __future__ import annotations

import abc
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from m2r2_jax.errors import DataError

SPM_FILE = "tokenizer.model"
HF_FILE = "tokenizer.json"
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
# Lines sampled for tokenizer training: enough for stable merges at a few-thousand vocab, and keeps
# training to about a second on the embedded corpus.
MAX_TRAINING_LINES = 80_000


class Tokenizer(abc.ABC):
    """Text <-> token ids. Special ids are None when the tokenizer does not define them."""

    path: Path

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abc.abstractmethod
    def bos_id(self) -> Optional[int]: ...

    @property
    @abc.abstractmethod
    def eos_id(self) -> Optional[int]: ...

    @property
    @abc.abstractmethod
    def pad_id(self) -> Optional[int]: ...

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, path):
        import sentencepiece as spm

        self.path = Path(path)
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(str(self.path))
        except (OSError, RuntimeError) as e:
            raise DataError(f"{self.path} is not a sentencepiece model: {str(e).splitlines()[0]}") from None

    @staticmethod
    def _opt(i: int) -> Optional[int]:
        return None if i < 0 else int(i)

    @property
    def vocab_size(self) -> int:
        return int(self._sp.GetPieceSize())

    @property
    def bos_id(self):
        return self._opt(self._sp.bos_id())

    @property
    def eos_id(self):
        return self._opt(self._sp.eos_id())

    @property
    def pad_id(self):
        return self._opt(self._sp.pad_id())

    def encode(self, text: str) -> list[int]:
        return list(self._sp.EncodeAsIds(text))

    def encode_batch(self, texts):
        return [list(x) for x in self._sp.Encode(list(texts), out_type=int)]

    def decode(self, ids) -> str:
        return self._sp.DecodeIds([int(i) for i in ids])


# Names under which tokenizer.json files commonly register their special tokens.
_HF_SPECIAL = {
    "bos": ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"),
    "eos": ("</s>", "<|end_of_text|>", "<eos>", "<|endoftext|>", "<|im_end|>"),
    "pad": ("<pad>", "<|pad|>", "[PAD]"),
}


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer.json. Special tokens come from a tokenizer_config.json
    beside it when present, else from the usual token names."""

    def __init__(self, path):
        from tokenizers import Tokenizer as _Tok

        self.path = Path(path)
        try:
            self._tok = _Tok.from_file(str(self.path))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise DataError(f"{self.path} is not a tokenizers JSON file: {str(e).splitlines()[0][:200]}") from None
        self._special = self._find_special()

    def _find_special(self) -> dict:
        named = {}
        cfg_path = self.path.parent / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text())
            except json.JSONDecodeError as e:
                raise DataError(f"{cfg_path} is not valid JSON: {e}") from None
            for kind in ("bos", "eos", "pad"):
                tok = cfg.get(f"{kind}_token")
                if isinstance(tok, dict):
                    tok = tok.get("content")
                if isinstance(tok, str):
                    named[kind] = self._tok.token_to_id(tok)
        for kind, names in _HF_SPECIAL.items():
            if named.get(kind) is None:
                ids = [self._tok.token_to_id(n) for n in names]
                named[kind] = next((i for i in ids if i is not None), None)
        return named

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def bos_id(self):
        return self._special["bos"]

    @property
    def eos_id(self):
        return self._special["eos"]

    @property
    def pad_id(self):
        return self._special["pad"]

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts):
        return [list(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def find_tokenizer_file(path_or_dir) -> Optional[Path]:
    p = Path(path_or_dir)
    if p.is_dir():
        for name in (SPM_FILE, HF_FILE):
            if (p / name).is_file():
                return p / name
        return None
    return p if p.is_file() else None


def load_tokenizer(path_or_dir) -> Tokenizer:
    """A tokenizer from `tokenizer.model` / `tokenizer.json` (a file, or a directory holding one)."""
    f = find_tokenizer_file(path_or_dir)
    if f is None:
        raise DataError(f"no tokenizer at {path_or_dir}: expected a {SPM_FILE} (sentencepiece) or {HF_FILE} (tokenizers) file")
    if f.suffix == ".json":
        return HFTokenizer(f)
    if f.suffix == ".model":
        return SentencePieceTokenizer(f)
    raise DataError(f"{f}: unknown tokenizer file type; expected *.model (sentencepiece) or *.json (tokenizers)")


def _training_lines(text: str) -> list[str]:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    stride = max(1, -(-len(lines) // MAX_TRAINING_LINES))
    return lines[::stride]


def train_sentencepiece(text: str, vocab_size: int, out_path, model_type: str = "bpe") -> SentencePieceTokenizer:
    """Train a sentencepiece model on `text` and write it atomically to `out_path`."""
    import sentencepiece as spm

    if model_type not in ("bpe", "unigram"):
        raise DataError(f"tokenizer model_type={model_type!r} is invalid: expected bpe or unigram")
    lines = _training_lines(text)
    if not lines:
        raise DataError("cannot train a tokenizer on an empty text")
    # Byte fallback reserves 256 ids, plus the 4 special ids and the newline piece.
    if not isinstance(vocab_size, int) or vocab_size < 300:
        raise DataError(f"tokenizer vocab_size={vocab_size!r} is invalid: expected an integer >= 300 (256 byte pieces + specials)")
    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=buf, model_type=model_type, vocab_size=vocab_size,
            byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
            remove_extra_whitespaces=False, add_dummy_prefix=False, allow_whitespace_only_pieces=True,
            split_digits=True, user_defined_symbols=["\n"], unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
            pad_id=PAD_ID, num_threads=1, minloglevel=2, max_sentence_length=1 << 16, hard_vocab_limit=True,
        )
    except RuntimeError as e:  # e.g. the vocabulary is larger than the text supports
        raise DataError(f"sentencepiece training failed: {str(e).splitlines()[0]}") from None
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".tmp-", dir=out.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(buf.getvalue())
    os.replace(tmp, out)
    return SentencePieceTokenizer(out)
