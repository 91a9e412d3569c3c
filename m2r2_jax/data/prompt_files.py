"""The one reader of user prompt files: JSON lines, one prompt per line (blank lines skipped).

Each line is an object with exactly one of "prompt" (text; "text" is accepted as its synonym)
or "tokens" (a list of integer ids). Every problem is one `DataError` naming the file and line as
FILE:LINE. `generate`, `bench` and `moe-bench` all read their `--prompts` files through here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

from m2r2_jax.errors import DataError

TEXT_KEYS = ("prompt", "text")
Prompt = Union[str, list]


def _lines(path) -> list:
    p = Path(path)
    if not p.is_file():
        raise DataError(f"prompts file {path} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"prompts file {path} is not UTF-8 text (invalid byte at offset {e.start})") from None
    return [(f"{path}:{i}", line) for i, line in enumerate(text.splitlines(), start=1) if line.strip()]


def _prompt_of(where: str, line: str) -> Prompt:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg})") from None
    keys = [k for k in ("tokens",) + TEXT_KEYS if isinstance(obj, dict) and k in obj]
    if len(keys) != 1:
        raise DataError(f"{where}: expected an object with exactly one of \"prompt\" (text) or \"tokens\" (ids)")
    value = obj[keys[0]]
    if keys[0] == "tokens":
        if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise DataError(f"{where}: \"tokens\" must be a list of integer ids")
    elif not isinstance(value, str):
        raise DataError(f"{where}: \"{keys[0]}\" must be a string")
    if not value:
        raise DataError(f"{where}: the prompt is empty")
    return value


def read_prompt_file(path, tokenizer=None, *, encode: bool = True, max_prompts: Optional[int] = None,
                     chat_template: Optional[str] = None):
    """(prompts, where): the file's prompts and a "FILE:LINE" label for each.

    With `encode` (default) every prompt comes back as token ids: text is encoded with
    `tokenizer` (rendered as a user turn with `chat_template` when given, see
    `chat_template.encode_prompt`), and a text prompt without one is an error. With
    `encode=False` text prompts stay strings (the caller tokenizes later). `max_prompts` stops
    after that many. Token prompts are taken as they are."""
    prompts, where_all = [], []
    for where, line in _lines(path):
        prompt = _prompt_of(where, line)
        if isinstance(prompt, str) and encode:
            if tokenizer is None:
                raise DataError(f"{where}: a text prompt needs a tokenizer, but the checkpoint has none "
                                "(give \"tokens\")")
            from m2r2_jax.data.chat_template import encode_prompt

            prompt = encode_prompt(tokenizer, prompt, chat_template)
            if not prompt:
                raise DataError(f"{where}: the prompt encodes to no tokens")
        prompts.append(prompt)
        where_all.append(where)
        if max_prompts and len(prompts) >= max_prompts:
            break
    if not prompts:
        raise DataError(f"prompts file {path} has no prompts")
    return prompts, where_all


def row_split_points(path, max_prompts: Optional[int] = None) -> list:
    """Each prompt row's "prompt_len" field (a positive int: how many of the row's tokens are the
    prompt, the rest a continuation to feed, e.g. the model's own answer), in the order
    `read_prompt_file` returns the rows. A row without it, or with anything but a positive int, is
    a `DataError` naming FILE:LINE."""
    out = []
    for where, line in _lines(path):
        _prompt_of(where, line)  # the same checks as read_prompt_file
        value = json.loads(line).get("prompt_len")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DataError(f"{where}: expected \"prompt_len\", a positive integer (the row's prompt tokens), "
                            f"got {value!r}")
        out.append(value)
        if max_prompts and len(out) >= max_prompts:
            break
    return out

