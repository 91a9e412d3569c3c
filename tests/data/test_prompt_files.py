"""The shared prompt-file reader: formats, encoding, and one FILE:LINE error per problem."""

import json

import pytest

from m2r2_jax.data.prompt_files import read_prompt_file
from m2r2_jax.errors import DataError


class _Tok:
    def encode(self, text):
        return [ord(c) % 50 for c in text]


def _write(tmp_path, lines, name="p.jsonl"):
    f = tmp_path / name
    f.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return f


def test_formats_blank_lines_and_labels(tmp_path):
    f = _write(tmp_path, [{"tokens": [1, 2]}, "", "   ", {"prompt": "ab"}, {"text": "c"}])
    prompts, where = read_prompt_file(f, _Tok())
    assert prompts == [[1, 2], [ord("a") % 50, ord("b") % 50], [ord("c") % 50]]
    assert where == [f"{f}:1", f"{f}:4", f"{f}:5"]
    assert read_prompt_file(f, encode=False)[0] == [[1, 2], "ab", "c"]
    assert read_prompt_file(f, _Tok(), max_prompts=2)[0] == prompts[:2]


@pytest.mark.parametrize("line, message", [
    ("not json", ":1: not valid JSON"),
    ('["tokens"]', ":1: expected an object with exactly one of"),
    ('{"tokens": [1], "prompt": "x"}', ":1: expected an object with exactly one of"),
    ('{"question": "x"}', ":1: expected an object with exactly one of"),
    ('{"tokens": "12"}', ':1: "tokens" must be a list of integer ids'),
    ('{"tokens": [1, 2.0]}', ':1: "tokens" must be a list of integer ids'),
    ('{"tokens": [true]}', ':1: "tokens" must be a list of integer ids'),
    ('{"prompt": 3}', ':1: "prompt" must be a string'),
    ('{"tokens": []}', ":1: the prompt is empty"),
    ('{"prompt": ""}', ":1: the prompt is empty"),
])
def test_bad_lines_name_file_and_line(tmp_path, line, message):
    f = _write(tmp_path, [line])
    with pytest.raises(DataError, match=message):
        read_prompt_file(f, _Tok())


def test_file_level_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_prompt_file(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match="has no prompts"):
        read_prompt_file(_write(tmp_path, ["", " "]))
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "\xff"}\n')
    with pytest.raises(DataError, match="not UTF-8"):
        read_prompt_file(bad)
    f = _write(tmp_path, [{"tokens": [1]}, {"prompt": "hi"}])
    with pytest.raises(DataError, match=":2: a text prompt needs a tokenizer"):
        read_prompt_file(f)

    class Empty:
        def encode(self, text):
            return []

    with pytest.raises(DataError, match=":2: the prompt encodes to no tokens"):
        read_prompt_file(f, Empty())
