"""Sources, packing, grain batching: determinism, host sharding, resume state, clear errors."""

import json
import subprocess
import sys
import types

import ml_collections
import numpy as np
import pytest

from m2r2_jax.data import sources
from m2r2_jax.data.pipeline import batch_iterator, lm_pipeline, pack, tokenize_documents
from m2r2_jax.data.tokenizer import Tokenizer
from m2r2_jax.errors import DataError
from m2r2_jax.training.config import data_section


class CharTokenizer(Tokenizer):
    """Byte-level test tokenizer: id = byte + 4, eos = 2."""

    path = "chars"
    vocab_size, bos_id, eos_id, pad_id = 260, 1, 2, 3

    def encode(self, text):
        return [b + 4 for b in text.encode()]

    def decode(self, ids):
        return bytes(i - 4 for i in ids if i >= 4).decode()


def test_tokenize_marks_document_ends_with_eos():
    stream = tokenize_documents(CharTokenizer(), ["ab", "", "c"])
    assert stream.tolist() == [101, 102, 2, 103, 2]  # the empty document adds nothing
    assert stream.dtype == np.int32


def test_pack_windows_cover_every_target_once():
    stream = np.arange(23, dtype=np.int32)
    ex = pack(stream, 5)
    assert ex.shape == (4, 6)
    np.testing.assert_array_equal(ex[1], np.arange(5, 11))
    targets = ex[:, 1:].reshape(-1)
    np.testing.assert_array_equal(targets, np.arange(1, 21))  # each once, in order
    np.testing.assert_array_equal(ex[:-1, -1], ex[1:, 0])  # consecutive windows share one token
    with pytest.raises(DataError, match="too small for one example"):
        pack(np.arange(5, dtype=np.int32), 5)


def _examples(n=40, t=9):
    return np.arange(n * t, dtype=np.int32).reshape(n, t)


def _take(it, k):
    return [next(it).copy() for _ in range(k)]


def test_batches_are_deterministic_and_reshuffled_each_epoch():
    ex = _examples()
    a, b = _take(batch_iterator(ex, 8, seed=3), 10), _take(batch_iterator(ex, 8, seed=3), 10)
    assert all((x == y).all() for x, y in zip(a, b))
    c = _take(batch_iterator(ex, 8, seed=4), 10)
    assert not all((x == y).all() for x, y in zip(a, c))
    epoch1, epoch2 = np.concatenate(a[:5])[:, 0], np.concatenate(a[5:])[:, 0]
    assert sorted(epoch1.tolist()) == sorted(ex[:, 0].tolist()) == sorted(epoch2.tolist())
    assert epoch1.tolist() != epoch2.tolist()
    unshuffled = next(batch_iterator(ex, 8, seed=0, shuffle=False))
    np.testing.assert_array_equal(unshuffled, ex[:8])


def test_iterator_state_resumes_the_same_next_batch():
    ex = _examples()
    it = batch_iterator(ex, 8, seed=1)
    _take(it, 7)
    state = it.get_state()
    json.dumps(state)  # checkpointed as JSON
    expected = _take(it, 4)
    fresh = batch_iterator(ex, 8, seed=1)
    fresh.set_state(state)
    assert all((x == y).all() for x, y in zip(expected, _take(fresh, 4)))


def test_hosts_get_disjoint_shards_of_the_global_batch():
    ex = _examples()
    hosts = [batch_iterator(ex, 8, seed=5, process_index=i, process_count=2) for i in range(2)]
    rows = [np.concatenate(_take(h, 5))[:, 0] for h in hosts]  # one epoch: 20 rows per host
    assert all(r.shape == (20,) for r in rows)
    assert not set(rows[0].tolist()) & set(rows[1].tolist())
    assert sorted(rows[0].tolist() + rows[1].tolist()) == sorted(ex[:, 0].tolist())
    with pytest.raises(DataError, match="not divisible by the number of hosts"):
        batch_iterator(ex, 7, seed=0, process_index=0, process_count=2)


def test_corpus_too_small_for_one_batch():
    with pytest.raises(DataError, match="too small for one batch.*3 packed examples"):
        batch_iterator(_examples(3), 4, seed=0)


def test_text_and_jsonl_sources(tmp_path):
    (tmp_path / "a.txt").write_text("first file\n")
    (tmp_path / "b.txt").write_text("second file\n")
    assert sources.text_documents(str(tmp_path / "*.txt")) == ["first file\n", "second file\n"]
    (tmp_path / "c.jsonl").write_text('{"text": "one"}\n\n{"text": "two", "x": 1}\n')
    assert sources.jsonl_documents([str(tmp_path / "c.jsonl")]) == ["one", "two"]
    (tmp_path / "d.jsonl").write_text('{"body": "one"}\n')
    assert sources.jsonl_documents([str(tmp_path / "d.jsonl")], "body") == ["one"]


@pytest.mark.parametrize("content, message", [
    (b'{"text": "ok"}\n{"txt": "no"}\n', r"e.jsonl:2: no field 'text'"),
    (b'{"text": "ok"}\n{"text": "ok"}\n{not json\n', r"e.jsonl:3: invalid JSON"),
    (b'{"text": 5}\n', r"e.jsonl:1: field 'text' is int"),
    (b'{"text": "caf\xe9"}\n', r"e.jsonl:1 is not UTF-8 text \(invalid byte 0xe9"),
])
def test_jsonl_errors_name_the_line(tmp_path, content, message):
    (tmp_path / "e.jsonl").write_bytes(content)
    with pytest.raises(DataError, match=message):
        sources.jsonl_documents([str(tmp_path / "e.jsonl")])


def test_text_source_errors(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("ok\nna\xefve\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.txt is not UTF-8 text \(invalid byte 0xef at byte offset 5\)"):
        sources.text_documents([str(tmp_path / "latin1.txt")])
    with pytest.raises(DataError, match="does not exist"):
        sources.text_documents([str(tmp_path / "missing.txt")])
    with pytest.raises(DataError, match="no file matches"):
        sources.text_documents([str(tmp_path / "*.none")])
    (tmp_path / "blank.txt").write_text("  \n\n")
    d = data_section()
    d.update(dict(source="text", paths=(str(tmp_path / "blank.txt"),), tokenizer="x"))
    with pytest.raises(DataError, match="corpus .*is empty"):
        sources.load_documents(d)


def test_lm_pipeline_end_to_end(tmp_path):
    (tmp_path / "a.txt").write_text("abcdefghij" * 20)
    d = data_section()
    d.update(dict(source="text", paths=(str(tmp_path / "a.txt"),), seq_len=16, tokenizer="chars"))
    it, info = lm_pipeline(d, CharTokenizer(), batch_size=4, seed=0)
    assert (info.documents, info.tokens, info.examples) == (1, 201, 12)
    batch = next(it)
    assert batch.shape == (4, 17) and batch.dtype == np.int32
    assert CharTokenizer().decode(batch[0][batch[0] != 2]) in "abcdefghij" * 20


def test_tfds_source_reads_a_data_source(monkeypatch):
    calls = {}

    def data_source(name, split, data_dir):
        calls.update(name=name, split=split, data_dir=data_dir)
        if name == "missing":
            raise FileNotFoundError("dataset missing not found")
        return [{"text": np.asarray(b"doc one")}, {"text": b"doc two"}, {"text": "doc three"}]

    monkeypatch.setitem(sys.modules, "tensorflow_datasets", types.SimpleNamespace(data_source=data_source))
    d = ml_collections.ConfigDict(data_section().to_dict())
    d.update(dict(source="tfds", tfds_name="my_ds", split="validation", tfds_data_dir="/d", tokenizer="x"))
    assert sources.load_documents(d) == ["doc one", "doc two", "doc three"]
    assert calls == dict(name="my_ds", split="validation", data_dir="/d")
    d.max_documents = 2
    assert sources.load_documents(d) == ["doc one", "doc two"]
    with pytest.raises(DataError, match="no field 'body'"):
        sources.tfds_documents("my_ds", field="body")
    with pytest.raises(DataError, match="cannot open tfds dataset 'missing'.*not found"):
        sources.tfds_documents("missing")


def test_text_path_never_imports_tensorflow(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 50)
    code = f"""
import sys
import m2r2_jax, m2r2_jax.data, m2r2_jax.training
from m2r2_jax.data.pipeline import lm_pipeline
from m2r2_jax.data.sources import embedded_documents
from m2r2_jax.training.config import data_section
from m2r2_jax.training.loop import train
sys.path.insert(0, {str(__file__.rsplit('/', 1)[0])!r})
from test_data_pipeline import CharTokenizer
d = data_section(); d.update(dict(source="text", paths=({str(tmp_path / 'a.txt')!r},), seq_len=8, tokenizer="c"))
it, info = lm_pipeline(d, CharTokenizer(), 4, 0); next(it)
embedded_documents("heldout")
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "tensorflow_datasets"))
print(bad)
assert not bad, bad
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"
