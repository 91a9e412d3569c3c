"""Tokenizers: one interface, two backends (sentencepiece `tokenizer.model`, HF `tokenizer.json`).

    tok = load_tokenizer(path_or_dir)      # picks the backend by file
    ids = tok.encode(text); text = tok.decode(ids)
    tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id   (an id is None when the tokenizer has none)
    tok.eos_ids          every id that ends a generation (generation_config.json's eos_token_id,
                         an int or a list, plus the tokenizer's eos token)
    tok.chat_template    the model's chat template (tokenizer_config.json or chat_template.jinja), or None
    tok.special_tokens   {"bos_token": "<s>", ...}: the strings a chat template sees

`train_sentencepiece(text, vocab_size, out_path)` trains the project's own tokenizer on a corpus:
byte-level BPE with byte fallback (every string round-trips), no text normalisation, "\\n" as a
single piece (verse is line-structured), fixed special ids (unk 0, bos 1, eos 2, pad 3). It trains
on a deterministic subsample of the lines with one thread, so the same text always gives the same
model file — the tiny dense, MoE and draft models rely on that to share one vocabulary.
"""

from __future__ import annotations

import abc
import io
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

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation (sorted)."""
        return () if self.eos_id is None else (self.eos_id,)

    @property
    def chat_template(self) -> Optional[str]:
        return None

    @property
    def add_bos(self) -> bool:
        """Whether the model expects BOS before a raw (untemplated) prompt."""
        return False

    @property
    def special_tokens(self) -> dict:
        return {}


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


def _json_beside(path: Path, name: str) -> dict:
    """A JSON object file next to the tokenizer file ({} when absent)."""
    from m2r2_jax.json_files import read_json_object

    p = path.parent / name
    return read_json_object(p, DataError) if p.is_file() else {}


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer.json. Special tokens and the chat template come from a
    tokenizer_config.json beside it when present (else the usual token names), the stop ids from a
    generation_config.json beside it."""

    def __init__(self, path):
        from tokenizers import Tokenizer as _Tok

        self.path = Path(path)
        try:
            self._tok = _Tok.from_file(str(self.path))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise DataError(f"{self.path} is not a tokenizers JSON file: {str(e).splitlines()[0][:200]}") from None
        self._config = _json_beside(self.path, "tokenizer_config.json")
        self._special = self._find_special()
        self._eos_ids = self._find_eos_ids()

    def _token_string(self, kind: str) -> Optional[str]:
        tok = self._config.get(f"{kind}_token")
        if isinstance(tok, dict):
            tok = tok.get("content")
        return tok if isinstance(tok, str) else None

    def _find_special(self) -> dict:
        named = {}
        for kind in ("bos", "eos", "pad"):
            tok = self._token_string(kind)
            if tok is not None:
                named[kind] = self._tok.token_to_id(tok)
        for kind, names in _HF_SPECIAL.items():
            if named.get(kind) is None:
                ids = [self._tok.token_to_id(n) for n in names]
                named[kind] = next((i for i in ids if i is not None), None)
        return named

    def _find_eos_ids(self) -> tuple[int, ...]:
        gen = _json_beside(self.path, "generation_config.json")
        raw = gen.get("eos_token_id")
        ids = set() if raw is None else set(raw if isinstance(raw, list) else [raw])
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab_size for i in ids):
            raise DataError(f"{self.path.parent / 'generation_config.json'}: eos_token_id={raw!r} is invalid: "
                            f"expected ids in [0, {self.vocab_size})")
        if self._special["eos"] is not None:
            ids.add(self._special["eos"])
        return tuple(sorted(ids))

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    @property
    def chat_template(self) -> Optional[str]:
        jinja = self.path.parent / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        t = self._config.get("chat_template")
        if isinstance(t, list):  # named templates: the default one
            t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
        return t if isinstance(t, str) and t.strip() else None

    @property
    def add_bos(self) -> bool:
        return bool(self._config.get("add_bos_token", False)) and self.bos_id is not None

    @property
    def special_tokens(self) -> dict:
        out = {}
        for kind in ("bos", "eos", "unk", "pad"):
            tok = self._token_string(kind)
            if tok is None and kind != "unk" and self._special.get(kind) is not None:
                tok = self._tok.id_to_token(self._special[kind])
            out[f"{kind}_token"] = tok
        return out

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
