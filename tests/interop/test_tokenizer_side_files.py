"""`convert --hf` keeps the tokenizer's side files (tokenizer_config.json, generation_config.json,
chat_template.jinja) in the checkpoint, and `export` writes them back."""

import json

from gguf_helpers import CHATML, train_bpe
from hf_helpers import build_hf, save_hf

from m2r2_jax.data.tokenizer import load_tokenizer
from m2r2_jax.interop.convert import convert_hf, export_hf


def test_convert_hf_keeps_the_tokenizer_side_files(tmp_path):
    vocab = train_bpe("default", 300)
    hf = save_hf(build_hf("llama_linear", vocab_size=len(vocab[1])), tmp_path / "hf")
    vocab[0].save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": [0]}))
    (hf / "chat_template.jinja").write_text(CHATML)
    ckpt = convert_hf(hf, tmp_path / "ckpt")
    tok = load_tokenizer(ckpt / "tokenizer")
    assert tok.eos_ids == (0, 2) and tok.chat_template == CHATML
    out = export_hf(ckpt, tmp_path / "back")
    assert {p.name for p in out.iterdir()} >= {"tokenizer.json", "tokenizer_config.json", "generation_config.json",
                                                "chat_template.jinja"}
