"""Embedded corpus, train/held-out split, tokenizer backends and sentencepiece training."""

import json

import pytest
from hypothesis import given, settings, strategies as st

from m2r2_jax.data import corpus
from m2r2_jax.data.tokenizer import HFTokenizer, SentencePieceTokenizer, load_tokenizer, train_sentencepiece
from m2r2_jax.errors import DataError

SMALL = 200_000  # characters of the corpus used to train test tokenizers (fast)


def test_embedded_corpus_and_split():
    text = corpus.embedded_corpus()
    assert len(text.encode()) == 5_057_282 and text.startswith(text.lstrip())
    train, held = corpus.split_lines(text)
    assert train + held == text
    n_lines, n_held = len(text.splitlines()), len(held.splitlines())
    assert n_held == -(-n_lines * 5 // 100)  # ceil(5%)
    assert train.endswith("\n")  # cut at a line boundary
    assert corpus.embedded_split("heldout") == held and corpus.embedded_split("train") == train
    with pytest.raises(DataError, match="split='dev'"):
        corpus.embedded_split("dev")
    with pytest.raises(DataError, match="heldout_fraction"):
        corpus.split_lines(text, 1.5)
    with pytest.raises(DataError, match="1 line"):
        corpus.split_lines("one line")


@pytest.fixture(scope="module")
def spm_tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("spm") / "tokenizer.model"
    return train_sentencepiece(corpus.embedded_corpus()[:SMALL], 512, path)


def test_sentencepiece_training_is_deterministic(spm_tok, tmp_path):
    again = train_sentencepiece(corpus.embedded_corpus()[:SMALL], 512, tmp_path / "tokenizer.model")
    assert again.path.read_bytes() == spm_tok.path.read_bytes()
    assert (spm_tok.vocab_size, spm_tok.bos_id, spm_tok.eos_id, spm_tok.pad_id) == (512, 1, 2, 3)
    assert [p for p in tmp_path.iterdir()] == [tmp_path / "tokenizer.model"]  # no temp file left


def test_sentencepiece_newline_is_one_token(spm_tok):
    ids = spm_tok.encode("KING.\nGood morrow.\n")
    assert ids.count(spm_tok.encode("\n")[0]) == 2 and len(spm_tok.encode("\n")) == 1


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=80))
def test_sentencepiece_round_trips_any_text(spm_tok, text):
    assert spm_tok.decode(spm_tok.encode(text)) == text


def test_load_tokenizer_picks_backend_by_file(spm_tok, tmp_path):
    assert isinstance(load_tokenizer(spm_tok.path.parent), SentencePieceTokenizer)
    assert isinstance(load_tokenizer(spm_tok.path), SentencePieceTokenizer)
    with pytest.raises(DataError, match="tokenizer.model.*tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"not a model")
    with pytest.raises(DataError, match="not a sentencepiece model"):
        load_tokenizer(tmp_path)


def _hf_tokenizer(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus.embedded_corpus()[:20_000].splitlines(), trainer)
    tok.save(str(directory / "tokenizer.json"))


def test_hf_tokenizer_backend(tmp_path):
    _hf_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)
    text = "ROMEO.\nBut soft, what light through yonder window breaks?"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode_batch([text, "a"]) == [tok.encode(text), tok.encode("a")]
    # tokenizer_config.json overrides the name-based guess
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<pad>"}, "pad_token": None}))
    assert load_tokenizer(tmp_path / "tokenizer.json").eos_id == 3
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(DataError, match="not a tokenizers JSON"):
        load_tokenizer(tmp_path)


def test_train_sentencepiece_rejects_bad_input(tmp_path):
    with pytest.raises(DataError, match="empty"):
        train_sentencepiece("\n\n  \n", 512, tmp_path / "t.model")
    with pytest.raises(DataError, match="vocab_size=100"):
        train_sentencepiece("some text\nmore text\n", 100, tmp_path / "t.model")
    assert not (tmp_path / "t.model").exists()
