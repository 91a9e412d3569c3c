"""Helpers for the interop tests: tiny random transformers models of every supported family."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
BASE = dict(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, pad_token_id=None, bos_token_id=None,
            eos_token_id=None)

# case -> (config class, model class, config overrides); each switches the family's features on
CASES = {
    "llama_llama3_tied": ("LlamaConfig", "LlamaForCausalLM",
                          dict(tie_word_embeddings=True, rope_parameters=dict(LLAMA3_ROPE, rope_theta=10000.0))),
    "llama_linear": ("LlamaConfig", "LlamaForCausalLM",
                     dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
                          head_dim=16, rms_norm_eps=1e-5)),
    "mistral_sliding": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=5, head_dim=8)),
    "qwen2_bias_sliding": ("Qwen2Config", "Qwen2ForCausalLM",
                           dict(use_sliding_window=True, sliding_window=6, max_window_layers=0)),
    "phi3_partial": ("Phi3Config", "Phi3ForCausalLM", dict(partial_rotary_factor=0.5, num_key_value_heads=4)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                       shared_expert_intermediate_size=40, norm_topk_prob=False)),
    "qwen2_moe_norm": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                       dict(num_experts=4, num_experts_per_tok=3, moe_intermediate_size=24,
                            shared_expert_intermediate_size=40, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32, norm_topk_prob=False)),
    "olmoe_norm": ("OlmoeConfig", "OlmoeForCausalLM",
                   dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32, norm_topk_prob=True)),
}


def build_hf(case: str, seed: int = 0, **overrides):
    """A random tiny transformers model for `case`, weights scaled so logits are of order 1."""
    cfg_cls, model_cls, kw = CASES[case]
    torch.manual_seed(seed)
    config = getattr(transformers, cfg_cls)(**{**BASE, **kw, **overrides})
    config._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


def save_hf(model, directory, **kw):
    model.save_pretrained(directory, safe_serialization=True, **kw)
    return directory


def random_tokens(vocab: int, shape=(2, 13), seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=shape).astype(np.int32)


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


def our_logits(cfg, params, tokens: np.ndarray) -> np.ndarray:
    import jax
    import jax.numpy as jnp

    from m2r2_jax.models.transformer import forward

    params = jax.tree.map(jnp.asarray, params)
    logits, _ = jax.jit(lambda p, t: forward(cfg, p, t))(params, jnp.asarray(tokens))
    return np.asarray(logits)


def assert_close(ours: np.ndarray, ref: np.ndarray, tol: float = 1e-4):
    assert ours.shape == ref.shape
    scale = float(np.abs(ref).max())
    assert scale > 0.3, f"logits too small for a meaningful comparison: max |logit| = {scale}"
    diff = float(np.abs(ours - ref).max())
    assert diff <= tol, f"max abs diff {diff:.3g} > {tol} (max |logit| {scale:.3g})"
