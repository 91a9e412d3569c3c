"""GGUF import: tiny random transformers models written as GGUF files (gguf_helpers) convert to
checkpoints whose logits match transformers loading the same file, with the same dequantised
weights; the GGUF tokenizer encodes like the tokenizer its vocabulary was trained as and like
transformers' GGUF tokenizer; bad files give one line and exit 2 with nothing written."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gguf_helpers import CHATML, train_bpe, write_gguf
from hf_helpers import assert_close, build_hf, hf_logits, our_logits, random_tokens, torch, transformers

from m2r2_jax.errors import CheckpointError, ConfigError
from m2r2_jax.interop.gguf_io import load_gguf, open_gguf, permute_rows, unpermute_rows

M2R2 = str(Path(sys.executable).with_name("m2r2"))
SHAPE = dict(hidden_size=64, intermediate_size=64, head_dim=16)  # quantised rows need multiples of 32
PLAIN_ROPE = {"rope_type": "default", "rope_theta": 500.0}


@pytest.fixture(scope="module")
def vocab():
    return train_bpe("default", 300)


def _model(case, vocab, **kw):
    over = dict(SHAPE, vocab_size=len(vocab[1]), **kw)
    if case.startswith("llama"):
        over["rope_parameters"] = PLAIN_ROPE
    if case.startswith("mistral"):
        over["sliding_window"] = None  # GGUF files carry no sliding window
    if case.startswith("qwen2"):
        over["use_sliding_window"] = False
    if case == "mixtral":
        over["intermediate_size"] = 32
    return build_hf(case, **over)


def _transformers_from_gguf(path):
    m = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return m.eval()


# (transformers case, GGUF architecture, weight type)
DENSE = [("llama_linear", "llama", "F32"), ("llama_linear", "llama", "F16"), ("llama_linear", "llama", "Q8_0"),
         ("llama_linear", "llama", "Q4_1"), ("llama_llama3_tied", "llama", "Q4_1"),
         ("mistral_sliding", "llama", "F32"), ("mistral_sliding", "llama", "Q8_0"),
         ("qwen2_bias_sliding", "qwen2", "F32"), ("qwen2_bias_sliding", "qwen2", "Q4_1")]


@pytest.mark.parametrize("case,arch,qtype", DENSE, ids=["-".join(c) for c in DENSE])
def test_logits_and_weights_match_transformers(tmp_path, vocab, case, arch, qtype):
    model = _model(case, vocab)
    path = write_gguf(tmp_path / "m.gguf", model, arch=arch, qtype=qtype, tokenizer=vocab)
    cfg, params, _ = load_gguf(path)
    assert cfg.family == {"llama": "llama", "qwen2": "qwen2"}[arch] and cfg.tie_embeddings == (case.endswith("tied"))
    ref = _transformers_from_gguf(path)
    tokens = random_tokens(cfg.vocab_size, (2, 11))
    assert_close(our_logits(cfg, params, tokens), hf_logits(ref, tokens), tol=1e-4)
    # the same dequantised numbers, exactly: transformers dequantises with its own code
    sd = {k: v.float().numpy() for k, v in ref.state_dict().items()}
    layers = params["layers"]
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        for ours, theirs in ((layers["attn"]["q_proj"]["kernel"][i].T, sd[p + "self_attn.q_proj.weight"]),
                             (layers["attn"]["k_proj"]["kernel"][i].T, sd[p + "self_attn.k_proj.weight"]),
                             (layers["mlp"]["down_proj"]["kernel"][i].T, sd[p + "mlp.down_proj.weight"])):
            np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(params["embed"]["embedding"], sd["model.embed_tokens.weight"])
    if qtype == "F32":  # and, unquantised, the original model itself
        assert_close(our_logits(cfg, params, tokens), hf_logits(model, tokens), tol=1e-4)


def test_mixtral_style_moe_file_matches_the_original_model(tmp_path, vocab):
    model = _model("mixtral", vocab)
    path = write_gguf(tmp_path / "moe.gguf", model, arch="llama", qtype="F32", tokenizer=vocab)
    cfg, params, _ = load_gguf(path)
    assert (cfg.family, cfg.n_experts, cfg.n_experts_per_tok) == ("mixtral", 4, 2)
    tokens = random_tokens(cfg.vocab_size, (2, 9))
    assert_close(our_logits(cfg, params, tokens), hf_logits(model, tokens), tol=1e-4)


def test_qk_row_order_round_trips_and_is_not_the_identity():
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(32, 3)
    np.testing.assert_array_equal(unpermute_rows(permute_rows(w, 4), 4), w)
    assert not np.array_equal(permute_rows(w, 4), w)
    # llama.cpp's order within a head of 8 rows: 0 4 1 5 2 6 3 7 (pairs for interleaved rotary)
    np.testing.assert_array_equal(permute_rows(w, 4)[:8, 0], w[[0, 4, 1, 5, 2, 6, 3, 7], 0])


# -- tokenizer ---------------------------------------------------------------------------------
def _strings():
    base = ["Hello world!", "  two leading spaces", "tabs\tand\nnewlines\n\n", "naïve café", "日本語のテキスト",
            "emoji 🙂🎉 end", "don't I'll we've they're", "Numbers: 12345, 3.14159, 2024-12-05", "x" * 40,
            "<|im_start|>user\nhi<|im_end|>\n", "trailing space ", "   ", "MiXeD CaSe WoRdS", "a\r\nb",
            "ROMEO: But, soft! what light through yonder window breaks?"]
    rng = np.random.default_rng(0)
    alphabet = list("abcdefghij ABC 0123456789.,;:!?'\"\n\t-é日🙂") + ["<|im_end|>", "  ", "'s", "000"]
    for _ in range(300):
        base.append("".join(rng.choice(alphabet, size=rng.integers(1, 30))))
    return base


@pytest.mark.parametrize("pre", ["default", "smollm", "llama-bpe", "qwen2"])
def test_gguf_tokenizer_encodes_like_its_original(tmp_path, pre):
    from m2r2_jax.data.tokenizer import load_tokenizer
    from m2r2_jax.interop.gguf_tokenizer import write_gguf_tokenizer

    vocab = train_bpe(pre, 400)
    original = vocab[0]
    path = write_gguf(tmp_path / "tok.gguf", None, tokenizer=vocab, pre=pre)
    write_gguf_tokenizer(open_gguf(path), tmp_path / "tok")
    ours = load_tokenizer(tmp_path / "tok" / "tokenizer.json")
    theirs = None
    if pre != "smollm":  # transformers' GGUF loader splits digits only by its regex table
        from transformers import AutoTokenizer

        theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tok.gguf")
    for s in _strings():
        ids = ours.encode(s)
        assert ids == original.encode(s).ids, s
        if theirs is not None:
            assert ids == theirs.encode(s, add_special_tokens=False), s
        assert ours.decode(ids) == s
    # the control tokens stay whole
    assert ours.encode("<|im_end|>") == [2]
    if pre == "smollm":  # every digit its own piece, as llama.cpp's smollm pre-tokenizer splits them
        assert len(ours.encode("12345")) == 5


def test_convert_cli_writes_tokenizer_stop_ids_and_template(tmp_path, vocab):
    from m2r2_jax.data.tokenizer import load_tokenizer

    path = write_gguf(tmp_path / "m.gguf", _model("qwen2_bias_sliding", vocab), arch="qwen2", qtype="Q8_0",
                      tokenizer=vocab)
    r = subprocess.run([M2R2, "convert", "--gguf", path, "--out", tmp_path / "ckpt"], capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300)
    assert r.returncode == 0, r.stderr
    assert "qwen2" in r.stdout
    tok = load_tokenizer(tmp_path / "ckpt" / "tokenizer")
    # eos (<|im_end|>, id 2) and the end-of-text control token (id 0)
    assert tok.eos_ids == (0, 2) and tok.eos_id == 2 and tok.chat_template == CHATML
    assert tok.special_tokens["eos_token"] == "<|im_end|>"
    gen = json.loads((tmp_path / "ckpt" / "tokenizer" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [0, 2]


# -- bad input -------------------------------------------------------------------------------
def _bad_files(tmp, vocab):
    model = _model("llama_linear", vocab)
    good = write_gguf(tmp / "good.gguf", model, qtype="Q8_0", tokenizer=vocab)
    data = good.read_bytes()
    (tmp / "truncated.gguf").write_bytes(data[: len(data) // 2])
    (tmp / "text.gguf").write_text("not a gguf file")
    write_gguf(tmp / "gemma.gguf", None, arch="gemma2", tokenizer=vocab)
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_1]  # a type the gguf package cannot dequantise
    write_gguf(tmp / "q8_1.gguf", model, tokenizer=vocab, skip_tensors=("blk.0.attn_v.weight",),
               extra_tensors={"blk.0.attn_v.weight": (np.zeros((32, 64 // block * size), np.uint8), "Q8_1")})
    write_gguf(tmp / "spm.gguf", model, tokenizer=vocab, tokenizer_model="llama")
    write_gguf(tmp / "pre.gguf", model, tokenizer=vocab, pre="some-new-pretokenizer")
    write_gguf(tmp / "missing.gguf", model, tokenizer=vocab, skip_tensors=("blk.1.ffn_up.weight",))
    write_gguf(tmp / "yarn.gguf", model, tokenizer=vocab, meta={"llama.rope.scaling.type": "yarn"})
    return {
        "truncated": "not a readable GGUF file",
        "text": "not a readable GGUF file",
        "gemma": "GGUF architecture 'gemma2' is not supported",
        "q8_1": "quantisation type Q8_1",
        "spm": "GGUF tokenizer model 'llama' of architecture 'llama' is not supported",
        "pre": "pre-tokenizer 'some-new-pretokenizer' is not supported",
        "missing": "blk.1.ffn_up.weight",
        "yarn": "rope scaling 'yarn' is not supported",
    }


def test_bad_gguf_files_are_one_line_and_write_nothing(tmp_path, vocab):
    from m2r2_jax.interop.convert import convert_gguf

    cases = _bad_files(tmp_path, vocab)
    for name, message in cases.items():
        out = tmp_path / f"out_{name}"
        with pytest.raises((CheckpointError, ConfigError)) as e:
            convert_gguf(tmp_path / f"{name}.gguf", out)
        assert message in str(e.value) and "\n" not in str(e.value), (name, str(e.value))
        assert not out.exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name], name
    # the CLI: exit 2, one line
    r = subprocess.run([M2R2, "convert", "--gguf", tmp_path / "q8_1.gguf", "--out", tmp_path / "cli_out"],
                       capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("m2r2: error:"), r.stderr
    assert not (tmp_path / "cli_out").exists()
    r = subprocess.run([M2R2, "convert", "--out", tmp_path / "x"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "exactly one of --hf" in r.stderr
