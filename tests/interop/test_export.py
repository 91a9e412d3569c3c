"""Export: our checkpoints back to Hugging Face; transformers loads them and gives the same logits."""

import json

import numpy as np
import pytest

from hf_helpers import CASES, assert_close, build_hf, hf_logits, random_tokens, save_hf, transformers

from m2r2_jax.errors import CheckpointError
from m2r2_jax.interop.convert import convert_hf, export_hf, load_hf, write_hf
from m2r2_jax.interop.hf_config import config_from_hf
from m2r2_jax.interop.safetensors_io import INDEX_FILE


def transformers_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


def _load_transformers(d):
    return transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_write_hf_round_trip(case, tmp_path):
    """HF -> ours -> HF (sharded): transformers loads it and reproduces the original logits."""
    model = build_hf(case)
    save_hf(model, tmp_path / "hf")
    cfg, params = load_hf(tmp_path / "hf")
    write_hf(cfg, params, tmp_path / "out", max_shard_size="30KB")
    assert (tmp_path / "out" / INDEX_FILE).is_file()
    assert config_from_hf(json.loads((tmp_path / "out" / "config.json").read_text())) == cfg
    tokens = random_tokens(cfg.vocab_size)
    again = _load_transformers(tmp_path / "out")
    # The round trip is exact: every tensor transformers loads equals the original bit for bit.
    ref = model.state_dict()
    got = again.state_dict()
    assert set(got) == set(ref)
    assert all(transformers_equal(got[k], ref[k]) for k in ref), [k for k in ref if not transformers_equal(got[k], ref[k])]
    # Logits only up to float32 rounding: with transformers 5.24 the Qwen2-MoE case gives logits
    # 1.1e-6 apart (|logit| 4.3) for the original and this bit-identical re-export, the same with
    # the original config.json over the exported weights; the cause is inside transformers.
    assert_close(hf_logits(again, tokens), hf_logits(model, tokens), tol=1e-5)


def test_convert_then_export(tmp_path):
    """Through a model checkpoint on disk, with the tokenizer file carried both ways."""
    model = build_hf("phi3_partial")
    save_hf(model, tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text('{"version": "1.0"}')
    ckpt = convert_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert (ckpt / "tokenizer" / "tokenizer.json").is_file()
    with pytest.raises(CheckpointError, match="already exists"):
        convert_hf(tmp_path / "hf", tmp_path / "ckpt")
    out = export_hf(ckpt, tmp_path / "out")
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    with pytest.raises(CheckpointError, match="already exists"):
        export_hf(ckpt, tmp_path / "out")
    export_hf(ckpt, tmp_path / "out", overwrite=True)
    tokens = random_tokens(97)
    assert_close(hf_logits(_load_transformers(out), tokens), hf_logits(model, tokens), tol=1e-6)
    assert not list(tmp_path.glob("*.tmp-*"))


def test_export_from_scratch_model(tmp_path):
    """A model that never came from Hugging Face exports and loads in transformers."""
    import jax

    from m2r2_jax.interop.safetensors_io import abstract_params
    from m2r2_jax.models.config import ModelConfig
    from m2r2_jax.models.transformer import forward

    cfg = ModelConfig(family="qwen2_moe", vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                      d_ff=48, max_seq_len=64, n_experts=4, n_experts_per_tok=2, moe_d_ff=24, norm_topk_prob=False,
                      shared_expert_d_ff=40, qkv_bias=True).validate()
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: (1.0 + 0.2 * rng.standard_normal(a.shape) if "scale" in jax.tree_util.keystr(path)
                         else 0.15 * rng.standard_normal(a.shape)).astype(a.dtype), abstract_params(cfg))
    write_hf(cfg, params, tmp_path / "out")
    tokens = random_tokens(cfg.vocab_size)
    ours = np.asarray(jax.jit(lambda p, t: forward(cfg, p, t)[0])(params, tokens))
    assert_close(hf_logits(_load_transformers(tmp_path / "out"), tokens), ours)
