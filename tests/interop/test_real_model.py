"""The real SmolLM2-135M-Instruct, end to end: the GGUF from the fetch cache (filled by `m2r2
fetch` or the demo; the test suite downloads nothing, so without it this test is skipped)
converts to a checkpoint whose `m2r2 generate` answers to chat-templated prompts equal
transformers' greedy answers token for token, stopping at <|im_end|>; the M2R2 parameters the
project ships for it load onto it (same fingerprint) and draft losslessly."""

import json
import os
import subprocess

import pytest

from real_models import M2R2, converted_checkpoint, fetched, transformers_reference

SOURCE, CACHED, pytestmark = fetched("smollm2-135m-instruct")
ckpt = converted_checkpoint(CACHED)
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "List three prime numbers greater than 100, then explain why 91 is not prime."]
MAX_NEW = 48


def test_generate_equals_transformers_greedy(tmp_path, ckpt):
    pytest.importorskip("torch")  # before the slow part: the reference needs both
    pytest.importorskip("transformers")
    from m2r2_jax.data.chat_template import encode_prompt
    from m2r2_jax.data.tokenizer import load_tokenizer

    tok = load_tokenizer(ckpt / "tokenizer")
    assert tok.eos_ids == (0, 2) and tok.chat_template is not None
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": q}) + "\n" for q in QUESTIONS))
    r = subprocess.run([M2R2, "generate", "--checkpoint", ckpt, "--prompts", tmp_path / "p.jsonl",
                        "--out", tmp_path / "o.jsonl", "--max-new-tokens", str(MAX_NEW), "--batch-size", "1"],
                       capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=600)
    assert r.returncode == 0, r.stderr
    ours = [json.loads(line)["tokens"] for line in (tmp_path / "o.jsonl").read_text().splitlines()]

    torch, ref_tok, model = transformers_reference(CACHED)
    for q, got in zip(QUESTIONS, ours):
        ids = ref_tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
        assert encode_prompt(tok, q, tok.chat_template) == list(ids), q
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                 eos_token_id=list(tok.eos_ids), pad_token_id=2)
        want = out[0, len(ids):].tolist()
        assert got == want, (q, got, want)
    assert ours[0][-1] == 2 and len(ours[0]) < MAX_NEW  # the short answer stops at <|im_end|>


def test_shipped_m2r2_loads_and_drafts_losslessly(ckpt):
    from m2r2_jax import pretrained
    from m2r2_jax.data.chat_template import encode_prompt
    from m2r2_jax.data.tokenizer import load_tokenizer
    from m2r2_jax.decoding import api, draft_vocab
    from m2r2_jax.m2r2.loading import load_base_and_m2r2

    shipped = pretrained.pretrained_dir(SOURCE.name)
    cfg, params, mcfg, m2r2, fresh = load_base_and_m2r2(ckpt, shipped)  # the fingerprint check passes
    assert not fresh
    tok = load_tokenizer(ckpt / "tokenizer")
    ids = encode_prompt(tok, QUESTIONS[1], tok.chat_template)
    vocab = draft_vocab.load(shipped / pretrained.DRAFT_VOCAB_FILE, cfg.vocab_size)
    kw = dict(max_new_tokens=24, eos_ids=tok.eos_ids, layer_loop="scan")
    [ar] = api.generate("ar", cfg, params, [ids], **kw)
    [spec] = api.generate("m2r2_spec", cfg, params, [ids], gamma=3, m2r2=(mcfg, m2r2), draft_vocab=vocab, **kw)
    assert spec.tokens == ar.tokens
    assert spec.mean_accepted > 1.0  # trained parameters draft some tokens right (fresh ones: almost none)
