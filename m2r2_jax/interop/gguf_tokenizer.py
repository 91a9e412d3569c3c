"""The tokenizer a GGUF file describes, as Hugging Face `tokenizers` files.

A GGUF carries no tokenizer.json: its metadata holds the vocabulary (`tokenizer.ggml.tokens`, token
types), the BPE merges, which pre-tokenizer the merges were learned under (`tokenizer.ggml.pre`, a
llama.cpp name), the special ids and the chat template. `write_gguf_tokenizer` rebuilds from them:

    tokenizer.json           byte-level BPE (`tokenizers`), control tokens as special added tokens
    tokenizer_config.json    bos/eos/unk/pad token strings, add_bos_token, chat_template
    generation_config.json   eos_token_id: every end-of-generation id (a list)

The pre-tokenizer follows llama.cpp's table for the named type (e.g. `smollm` splits every digit
before the GPT-2 pattern, as SmolLM2's own tokenizer does); a type not in the table is refused
rather than tokenised differently from the model's training. Sentencepiece-style vocabularies
(`tokenizer.ggml.model` = llama, gemma) are refused in one line: convert those models from their
Hugging Face checkpoint (`m2r2 convert --hf`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from m2r2_jax.errors import CheckpointError

# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte
_CONTROL, _USER_DEFINED = 3, 4

_GPT2 = "gpt2"
_DIGITS_THEN_GPT2 = "digits+gpt2"
_LLAMA3 = "llama3"
_QWEN2 = "qwen2"
# llama.cpp pre-tokenizer type -> how its merges split text
PRE_TOKENIZERS = {
    "default": _GPT2, "gpt2": _GPT2, "gpt-2": _GPT2, "mpt": _GPT2, "olmo": _GPT2,
    "smollm": _DIGITS_THEN_GPT2, "starcoder": _DIGITS_THEN_GPT2, "refact": _DIGITS_THEN_GPT2,
    "command-r": _DIGITS_THEN_GPT2, "codeshell": _DIGITS_THEN_GPT2,
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3, "dbrx": _LLAMA3, "smaug-bpe": _LLAMA3,
    "falcon3": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
}
# Split patterns of the Llama 3 and Qwen2 vocabularies (facts of those tokenizers, as llama.cpp
# and their tokenizer.json files give them).
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                   r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Control tokens that end a turn in common chat formats; llama.cpp stops at these as well as at
# the eos/eot/eom ids the metadata names, and so does every decoding method here.
END_OF_TURN = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
               "<|end_of_text|>", "</s>")


def _pre_tokenizer(kind: str):
    from tokenizers import Regex, pre_tokenizers

    if kind == _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    pattern = _LLAMA3_PATTERN if kind == _LLAMA3 else _QWEN2_PATTERN
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def special_ids(g) -> dict[str, Optional[int]]:
    """bos / eos / unk / pad ids named by the metadata (None when absent)."""
    out = {}
    for kind, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
                      ("pad", "padding_token_id")):
        v = g.value(f"tokenizer.ggml.{key}", required=False)
        out[kind] = None if v is None else int(v)
    return out


def stop_ids(g, tokens: list[str], types: list[int]) -> list[int]:
    """Every end-of-generation id: eos, eot and eom from the metadata, and the control tokens of
    `END_OF_TURN`."""
    ids = set()
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        v = g.value(f"tokenizer.ggml.{key}", required=False)
        if v is not None:
            ids.add(int(v))
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        if kind == _CONTROL and tok in END_OF_TURN:
            ids.add(i)
    return sorted(i for i in ids if 0 <= i < len(tokens))


def build_tokenizer(g):
    """(tokenizers.Tokenizer, tokenizer_config dict, generation_config dict) from the metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    model = g.value("tokenizer.ggml.model", required=False)
    if model is None:
        raise CheckpointError(f"{g.path}: the file has no tokenizer (tokenizer.ggml.model is missing)")
    if model != "gpt2":
        raise CheckpointError(f"{g.path}: GGUF tokenizer model {model!r} is not supported (byte-level BPE, 'gpt2', "
                              "is): convert this model from its Hugging Face checkpoint (m2r2 convert --hf)")
    pre = g.value("tokenizer.ggml.pre", "default", required=False)
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"{g.path}: GGUF pre-tokenizer {pre!r} is not supported (supported: "
                              f"{', '.join(sorted(PRE_TOKENIZERS))})")
    tokens = g.string_array("tokenizer.ggml.tokens")
    merges = g.string_array("tokenizer.ggml.merges")
    types = g.int_array("tokenizer.ggml.token_type") or [1] * len(tokens)
    if not tokens or len(types) != len(tokens):
        raise CheckpointError(f"{g.path}: tokenizer.ggml.tokens / token_type are missing or of different lengths")
    if not merges:
        raise CheckpointError(f"{g.path}: a byte-level BPE tokenizer needs tokenizer.ggml.merges, which is missing")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = []
    for m in merges:
        parts = m.split(" ")
        if len(parts) != 2:
            raise CheckpointError(f"{g.path}: BPE merge {m!r} is not two tokens separated by a space")
        pairs.append((parts[0], parts[1]))
    ignore_merges = PRE_TOKENIZERS[pre] == _LLAMA3  # the Llama 3 vocabulary takes whole words first
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
    except Exception as e:
        raise CheckpointError(f"{g.path}: cannot build the BPE tokenizer ({str(e).splitlines()[0][:200]})") from None
    tok.pre_tokenizer = _pre_tokenizer(PRE_TOKENIZERS[pre])
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(t, special=(k == _CONTROL), normalized=False)
             for t, k in zip(tokens, types) if k in (_CONTROL, _USER_DEFINED)]
    tok.add_tokens(added)

    ids = special_ids(g)

    def name(i):
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    config = {f"{k}_token": name(i) for k, i in ids.items()}
    config["add_bos_token"] = bool(g.value("tokenizer.ggml.add_bos_token", False, required=False))
    config["add_eos_token"] = bool(g.value("tokenizer.ggml.add_eos_token", False, required=False))
    template = g.value("tokenizer.chat_template", required=False)
    if template is not None:
        config["chat_template"] = str(template)
    generation = {"eos_token_id": stop_ids(g, tokens, types)}
    if ids["bos"] is not None:
        generation["bos_token_id"] = ids["bos"]
    return tok, config, generation


def write_gguf_tokenizer(g, out_dir) -> list[Path]:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json into `out_dir`."""
    tok, config, generation = build_tokenizer(g)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return [out / "tokenizer.json", out / "tokenizer_config.json", out / "generation_config.json"]


__all__ = ["build_tokenizer", "write_gguf_tokenizer", "special_ids", "stop_ids", "PRE_TOKENIZERS", "END_OF_TURN"]
