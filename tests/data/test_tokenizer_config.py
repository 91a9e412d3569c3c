"""What a tokenizer.json checkpoint carries beside the vocabulary: every stop id
(generation_config.json's int or list plus the eos token), the chat template (tokenizer_config.json
or chat_template.jinja), BOS for raw prompts; and that `convert --hf` keeps those files."""

import json

import pytest

from m2r2_jax.data.chat_template import encode_prompt, resolve_chat_template
from m2r2_jax.data.tokenizer import load_tokenizer
from m2r2_jax.errors import DataError

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}" \
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"


def _write_tokenizer(d, config=None, generation=None, jinja=None):
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    d.mkdir(parents=True, exist_ok=True)
    vocab = {"<s>": 0, "</s>": 1, "<|im_start|>": 2, "<|im_end|>": 3, "<|endoftext|>": 4}
    for i, ch in enumerate("abcdefghijklmnopqrstuvwxyz \n"):
        vocab[ch] = 5 + i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.add_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<|im_start|>", "<|im_end|>",
                                                           "<|endoftext|>")])
    tok.save(str(d / "tokenizer.json"))
    if config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (d / "generation_config.json").write_text(json.dumps(generation))
    if jinja is not None:
        (d / "chat_template.jinja").write_text(jinja)
    return d / "tokenizer.json"


@pytest.mark.parametrize("generation,want", [(None, (3,)), ({"eos_token_id": 4}, (3, 4)),
                                             ({"eos_token_id": [1, 4]}, (1, 3, 4))])
def test_stop_ids_join_generation_config_and_the_eos_token(tmp_path, generation, want):
    tok = load_tokenizer(_write_tokenizer(tmp_path, {"eos_token": "<|im_end|>"}, generation))
    assert tok.eos_id == 3 and tok.eos_ids == want


def test_bad_generation_config_is_one_line(tmp_path):
    with pytest.raises(DataError, match="eos_token_id"):
        load_tokenizer(_write_tokenizer(tmp_path, {}, {"eos_token_id": [1, 999]}))


def test_chat_template_from_config_or_jinja_and_prompt_encoding(tmp_path):
    tok = load_tokenizer(_write_tokenizer(tmp_path / "a", {"eos_token": "<|im_end|>", "chat_template": TEMPLATE}))
    assert tok.chat_template == TEMPLATE
    ids = encode_prompt(tok, "hi", resolve_chat_template(tok, "auto"))
    assert ids == tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert ids[0] == 2 and ids.count(3) == 1  # special tokens encoded whole
    assert encode_prompt(tok, "hi", resolve_chat_template(tok, "none")) == tok.encode("hi")
    # a chat_template.jinja beside the tokenizer wins (transformers 4.5x+ writes templates there)
    tok = load_tokenizer(_write_tokenizer(tmp_path / "b", {"chat_template": "ignored"}, jinja=TEMPLATE))
    assert tok.chat_template == TEMPLATE
    # raw prompts start with BOS when the tokenizer asks for it
    tok = load_tokenizer(_write_tokenizer(tmp_path / "c", {"bos_token": "<s>", "add_bos_token": True}))
    assert tok.add_bos and encode_prompt(tok, "ab") == [0] + tok.encode("ab")
    assert resolve_chat_template(tok, "auto") is None
