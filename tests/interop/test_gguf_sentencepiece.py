"""The SentencePiece vocabulary of a Gemma GGUF, rebuilt as a `tokenizers` BPE: a vocabulary
trained by sentencepiece itself (byte fallback, whitespace pieces, no dummy prefix: Gemma's
settings) is written the way llama.cpp writes a gemma3 file (pieces, scores, token types, no
merges), read back by `build_tokenizer`, and must encode every text exactly as sentencepiece does
and as transformers' GGUF loader does, and decode back to the text. The real Gemma 3 270M file is
checked the same way in test_real_gemma3.py when it is in the fetch cache."""

from __future__ import annotations

import pytest

from gguf_helpers import corpus_text
from m2r2_jax.interop.gguf_io import open_gguf
from m2r2_jax.interop.gguf_tokenizer import build_tokenizer, spelled_by_position

TEXTS = ["Hello world", "  two leading spaces", "a    b     c", "tabs\tand\nnewlines\n\n\nend",
         "Ünïcödé — “quotes” 😀 中文", "12345 3.14159", "<start_of_turn>user\nHi<end_of_turn>\n", "", " ",
         "To be, or not to be: that is the question.\n", "x\u00a0y  \n  z", "\x00\x01 control bytes"]
CONTROL = ("<start_of_turn>", "<end_of_turn>")


def _write_spm_gguf(path, sp_model):
    """A gemma3 GGUF holding only the tokenizer of `sp_model` (llama.cpp's layout: token types
    1 normal, 2 unknown, 3 control, 4 user defined, 6 byte; scores; no merges), with two turn
    markers appended as control tokens and runs of spaces stored as real spaces."""
    gguf = pytest.importorskip("gguf")
    tokens, scores, types = [], [], []
    for i in range(sp_model.get_piece_size()):
        piece = sp_model.id_to_piece(i)
        kind = (2 if sp_model.is_unknown(i) else 3 if sp_model.is_control(i) else 6 if sp_model.is_byte(i)
                else 4 if piece == "\n" else 1)
        if set(piece) == {"\u2581"} and len(piece) > 1:
            piece = " " * len(piece)
        tokens.append(piece)
        scores.append(sp_model.get_score(i))
        types.append(kind)
    for t in CONTROL:
        tokens.append(t)
        scores.append(0.0)
        types.append(3)
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(3)
    w.add_bool("tokenizer.ggml.add_space_prefix", False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    import sentencepiece

    from m2r2_jax.data.tokenizer import train_sentencepiece

    d = tmp_path_factory.mktemp("spm")
    train_sentencepiece(corpus_text(400_000), 700, d / "tokenizer.model")
    sp = sentencepiece.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
    return sp, _write_spm_gguf(d / "t.gguf", sp)


def _texts():
    lines = corpus_text()[:20_000].splitlines(keepends=True)
    return TEXTS + ["".join(lines[i:i + 3]) for i in range(0, 120, 3)]


def test_encodes_as_sentencepiece_and_round_trips(spm):
    sp, path = spm
    tok, config, generation = build_tokenizer(open_gguf(path))
    assert config["add_bos_token"] is True  # llama.cpp's default for a SentencePiece vocabulary
    assert generation["eos_token_id"] == [2, sp.get_piece_size() + 1]  # </s> and <end_of_turn>
    for text in _texts():
        ids = tok.encode(text, add_special_tokens=False).ids
        if not any(c in text for c in CONTROL):
            assert ids == sp.encode(text), repr(text)
        assert tok.decode(ids, skip_special_tokens=False) == text, repr(text)
    turn = tok.encode("<start_of_turn>user", add_special_tokens=False).ids
    assert turn[0] == sp.get_piece_size()  # a control token is matched whole


def test_encodes_as_transformers_gguf_loader(spm):
    transformers = pytest.importorskip("transformers")
    sp, path = spm
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok, _, _ = build_tokenizer(open_gguf(path))
    for text in _texts():
        assert [1] + tok.encode(text, add_special_tokens=False).ids == ref(text)["input_ids"], repr(text)


def test_merges_rank_by_position_longer_left_piece_first():
    vocab, merges = spelled_by_position(["<unk>", "a", "b", "c", "ab", "bc", "abc", "  ", "\u2581"])
    assert vocab["\u2581\u2581"] == 7 and vocab["\u2581"] == 8
    assert merges == [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc"), ("\u2581", "\u2581")]


def test_other_sentencepiece_architectures_are_refused(tmp_path):
    gguf = pytest.importorskip("gguf")
    from m2r2_jax.errors import CheckpointError

    w = gguf.GGUFWriter(str(tmp_path / "l.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "a"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="SentencePiece 'llama' for gemma"):
        build_tokenizer(open_gguf(tmp_path / "l.gguf"))
