"""The tokenizer a GGUF file describes, as Hugging Face `tokenizers` files.

A GGUF carries no tokenizer.json: its metadata holds the vocabulary (`tokenizer.ggml.tokens`, token
types), the BPE merges, which pre-tokenizer the merges were learned under (`tokenizer.ggml.pre`, a
llama.cpp name), the special ids and the chat template. `write_gguf_tokenizer` rebuilds from them:

    tokenizer.json           byte-level BPE (`tokenizers`), control tokens as special added tokens
    tokenizer_config.json    bos/eos/unk/pad token strings, add_bos_token, chat_template
    generation_config.json   eos_token_id: every end-of-generation id (a list)

Two kinds of vocabulary are rebuilt:

- byte-level BPE (`tokenizer.ggml.model` = gpt2): the merges are in the file; the pre-tokenizer
  follows llama.cpp's table for the named type (e.g. `smollm` splits every digit before the GPT-2
  pattern, as SmolLM2's own tokenizer does); a type not in the table is refused rather than
  tokenised differently from the model's training.
- SentencePiece BPE of the Gemma models (`tokenizer.ggml.model` = llama, architecture gemma,
  gemma2 or gemma3): spaces become U+2581 before the merges, bytes the vocabulary lacks fall back to
  its `<0xNN>` tokens. The file lists no merges: every token that two vocabulary pieces spell makes
  one, ranked by the token's position in the vocabulary (earlier first; Gemma's scores do not give
  the merge order), the split with the longer left piece first. Runs of spaces are stored as real
  spaces but looked up after the normaliser, so they are respelled as U+2581 runs. This is the
  rebuild transformers' GGUF loader makes, the reference the import is checked against.

Other SentencePiece vocabularies (Llama 2, Mistral: the same model name with other architectures,
whose scores and prefix-space rules differ) are refused in one line: convert those models from
their Hugging Face checkpoint (`m2r2 convert --hf`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from m2r2_jax.errors import CheckpointError

_SPACE = "\u2581"  # SentencePiece's visible space
# architectures whose SentencePiece vocabulary (tokenizer.ggml.model "llama") is rebuilt here
SENTENCEPIECE_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
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
    model = g.value("tokenizer.ggml.model", required=False)
    if model is None:
        raise CheckpointError(f"{g.path}: the file has no tokenizer (tokenizer.ggml.model is missing)")
    sentencepiece = model == "llama" and g.architecture in SENTENCEPIECE_ARCHITECTURES
    if model != "gpt2" and not sentencepiece:
        raise CheckpointError(f"{g.path}: GGUF tokenizer model {model!r} of architecture {g.architecture!r} is not "
                              "supported (byte-level BPE, 'gpt2', is, and SentencePiece 'llama' for "
                              f"{', '.join(SENTENCEPIECE_ARCHITECTURES)}): convert this model from its Hugging Face "
                              "checkpoint (m2r2 convert --hf)")
    tokens = g.string_array("tokenizer.ggml.tokens")
    types = g.int_array("tokenizer.ggml.token_type") or [1] * len(tokens)
    if not tokens or len(types) != len(tokens):
        raise CheckpointError(f"{g.path}: tokenizer.ggml.tokens / token_type are missing or of different lengths")
    if sentencepiece:
        tok = _sentencepiece_bpe(g, tokens, types)
    else:
        tok = _byte_level_bpe(g, tokens, types)
    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise
    config, generation = _configs(g, tokens, types, add_bos_default=sentencepiece)
    return tok, config, generation


def _byte_level_bpe(g, tokens: list[str], types: list[int]):
    from tokenizers import AddedToken, Tokenizer, decoders, models

    pre = g.value("tokenizer.ggml.pre", "default", required=False)
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"{g.path}: GGUF pre-tokenizer {pre!r} is not supported (supported: "
                              f"{', '.join(sorted(PRE_TOKENIZERS))})")
    merges = g.string_array("tokenizer.ggml.merges")
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
    return tok


def spelled_by_position(tokens: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) of a SentencePiece BPE vocabulary that lists no merges: space runs respelled
    as U+2581 runs (a later duplicate spelling keeps its id), and one merge per way two vocabulary
    pieces spell a token, ranked by that token's position, the longer left piece first."""
    spelled = [_SPACE * len(t) if t and set(t) == {" "} else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    ranked = []
    for t, i in vocab.items():
        for cut in range(len(t) - 1, 0, -1):  # longer left piece first
            left, right = t[:cut], t[cut:]
            if left in vocab and right in vocab:
                ranked.append((i, left, right))
    ranked.sort(key=lambda r: r[0])  # stable: the cut order stays within a token
    return vocab, [(left, right) for _, left, right in ranked]


def _sentencepiece_bpe(g, tokens: list[str], types: list[int]):
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    vocab, merges = spelled_by_position(tokens)
    unk = special_ids(g)["unk"]
    unk_token = tokens[unk] if unk is not None and 0 <= unk < len(tokens) else None
    if unk_token is None:
        raise CheckpointError(f"{g.path}: a SentencePiece vocabulary needs tokenizer.ggml.unknown_token_id")
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=True,
                                   byte_fallback=True))
    except Exception as e:
        raise CheckpointError(f"{g.path}: cannot build the SentencePiece tokenizer "
                              f"({str(e).splitlines()[0][:200]})") from None
    prefix = bool(g.value("tokenizer.ggml.add_space_prefix", False, required=False))
    steps = [normalizers.Prepend(_SPACE)] if prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", _SPACE)])
    tok.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    # user-defined pieces are matched whole in the raw text (newline runs, '[multimodal]'); the
    # respelled space runs are reached through the normaliser instead
    added = [AddedToken(t, special=(k == _CONTROL), normalized=False) for t, k in zip(tokens, types)
             if k == _CONTROL or (k == _USER_DEFINED and t in vocab)]
    tok.add_tokens(added)
    return tok


def _configs(g, tokens: list[str], types: list[int], add_bos_default: bool) -> tuple[dict, dict]:
    """tokenizer_config (special token strings, add_bos/add_eos, chat template) and
    generation_config (every stop id, bos)."""
    ids = special_ids(g)

    def name(i):
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    config = {f"{k}_token": name(i) for k, i in ids.items()}
    config["add_bos_token"] = bool(g.value("tokenizer.ggml.add_bos_token", add_bos_default, required=False))
    config["add_eos_token"] = bool(g.value("tokenizer.ggml.add_eos_token", False, required=False))
    template = g.value("tokenizer.chat_template", required=False)
    if template is not None:
        config["chat_template"] = str(template)
    generation = {"eos_token_id": stop_ids(g, tokens, types)}
    if ids["bos"] is not None:
        generation["bos_token_id"] = ids["bos"]
    return config, generation


def write_gguf_tokenizer(g, out_dir) -> list[Path]:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json into `out_dir`."""
    tok, config, generation = build_tokenizer(g)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return [out / "tokenizer.json", out / "tokenizer_config.json", out / "generation_config.json"]


__all__ = ["build_tokenizer", "write_gguf_tokenizer", "spelled_by_position", "SENTENCEPIECE_ARCHITECTURES", "special_ids", "stop_ids", "PRE_TOKENIZERS", "END_OF_TURN"]
