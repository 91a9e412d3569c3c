"""Float32 logits of converted checkpoints match transformers for every family."""

import json

import pytest

from hf_helpers import CASES, assert_close, build_hf, hf_logits, our_logits, random_tokens, save_hf  # noqa: E402

from m2r2_jax.interop.convert import load_hf


@pytest.mark.parametrize("case", sorted(CASES))
def test_family_parity(case, tmp_path):
    model = build_hf(case)
    save_hf(model, tmp_path / "hf")
    cfg, params = load_hf(tmp_path / "hf")
    assert cfg.family == model.config.model_type
    tokens = random_tokens(cfg.vocab_size)
    assert_close(our_logits(cfg, params, tokens), hf_logits(model, tokens))


def test_transformers_4x_style_config(tmp_path):
    """The same checkpoint with its config.json rewritten the way transformers 4.x wrote it
    (top-level rope_theta, rope_scaling with the old "type" key, torch_dtype)."""
    model = build_hf("llama_llama3_tied")
    save_hf(model, tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    d = json.loads(path.read_text())
    assert "rope_parameters" in d and "dtype" in d  # what transformers 5 writes
    rp = d.pop("rope_parameters")
    d["rope_theta"] = rp.pop("rope_theta")
    rp["type"] = rp.pop("rope_type")
    d["rope_scaling"] = rp
    d["torch_dtype"] = d.pop("dtype")
    path.write_text(json.dumps(d))
    cfg, params = load_hf(tmp_path / "hf")
    assert cfg.rope_scaling.rope_type == "llama3" and cfg.tie_embeddings
    tokens = random_tokens(cfg.vocab_size)
    assert_close(our_logits(cfg, params, tokens), hf_logits(model, tokens))
