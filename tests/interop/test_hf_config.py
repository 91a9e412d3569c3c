"""config.json parsing: 4.x and 5.x styles, family defaults, real hub configs, clear refusals."""

import copy

import pytest

from m2r2_jax.errors import ConfigError
from m2r2_jax.interop.hf_config import config_from_hf, hf_config_dict
from m2r2_jax.models.config import RopeScaling

# Trimmed copies of real hub config.json files (4.x style, as most hub checkpoints are).
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.43.0",
    "use_cache": True, "vocab_size": 128256}
MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000}
QWEN2_7B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
    "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
    "max_position_embeddings": 131072, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 152064}
PHI3_MINI_4K = {
    "_name_or_path": "Phi-3-mini-4k-instruct", "architectures": ["Phi3ForCausalLM"], "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_phi3.Phi3Config", "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"},
    "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 4096, "model_type": "phi3",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "attention_bias": False, "vocab_size": 32064}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32000}
QWEN15_MOE_A27B = {
    "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21,
    "model_type": "qwen2_moe", "moe_intermediate_size": 1408, "norm_topk_prob": False, "num_attention_heads": 16,
    "num_experts": 60, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 16,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 5632, "sliding_window": 32768, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
OLMOE_1B_7B = {
    "architectures": ["OlmoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "clip_qkv": None,
    "eos_token_id": 50279, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 1024, "max_position_embeddings": 4096, "model_type": "olmoe", "norm_topk_prob": False,
    "num_attention_heads": 16, "num_experts": 64, "num_experts_per_tok": 8, "num_hidden_layers": 16,
    "num_key_value_heads": 16, "output_router_logits": False, "pad_token_id": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 10000.0, "router_aux_loss_coef": 0.01, "tie_word_embeddings": False,
    "torch_dtype": "float32", "use_cache": True, "vocab_size": 50304}
HUB = {"llama": LLAMA31_8B, "mistral": MISTRAL_7B_V01, "qwen2": QWEN2_7B, "phi3": PHI3_MINI_4K,
       "mixtral": MIXTRAL_8X7B, "qwen2_moe": QWEN15_MOE_A27B, "olmoe": OLMOE_1B_7B}


def to_v5(d):
    """The same config as transformers 5 `save_pretrained` writes it: rope_parameters, dtype."""
    d = copy.deepcopy(d)
    rp = dict(d.pop("rope_scaling", None) or {})
    rp["rope_theta"] = d.pop("rope_theta")
    rp.setdefault("rope_type", rp.pop("type", "default"))
    d["rope_parameters"] = rp
    d["dtype"] = d.pop("torch_dtype")
    return d


def test_hub_configs():
    c = config_from_hf(LLAMA31_8B)
    assert (c.family, c.d_model, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff) == \
        ("llama", 4096, 32, 32, 8, 128, 14336)
    assert c.rope_theta == 500000.0 and c.max_seq_len == 131072 and c.param_dtype == c.dtype == "bfloat16"
    assert c.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert not c.tie_embeddings and not c.qkv_bias and c.sliding_window is None and c.rms_eps == 1e-5
    assert config_from_hf(MISTRAL_7B_V01).sliding_window == 4096
    q = config_from_hf(QWEN2_7B)
    assert q.qkv_bias and q.sliding_window is None and q.n_kv_heads == 4 and q.head_dim == 128
    p = config_from_hf(PHI3_MINI_4K)  # its auto_map is ignored: phi3 is built into transformers
    assert p.sliding_window == 2047 and p.partial_rotary_factor == 1.0 and p.rms_eps == 1e-5
    m = config_from_hf(MIXTRAL_8X7B)
    assert (m.n_experts, m.n_experts_per_tok, m.moe_d_ff, m.norm_topk_prob) == (8, 2, 14336, True)
    qm = config_from_hf(QWEN15_MOE_A27B)
    assert (qm.n_experts, qm.n_experts_per_tok, qm.moe_d_ff, qm.shared_expert_d_ff, qm.norm_topk_prob, qm.qkv_bias,
            qm.sliding_window) == (60, 4, 1408, 5632, False, True, None)
    o = config_from_hf(OLMOE_1B_7B)
    assert (o.n_experts, o.n_experts_per_tok, o.moe_d_ff, o.qk_norm, o.norm_topk_prob, o.param_dtype) == \
        (64, 8, 1024, True, False, "float32")


@pytest.mark.parametrize("family", sorted(HUB))
def test_v4_and_v5_styles_agree(family):
    assert config_from_hf(to_v5(HUB[family])) == config_from_hf(HUB[family])


def test_rope_scaling_styles():
    base = dict(LLAMA31_8B)
    old = dict(base, rope_scaling={"type": "linear", "factor": 4.0})  # the oldest key name
    assert config_from_hf(old).rope_scaling == RopeScaling("linear", 4.0)
    v5 = to_v5(old)
    assert v5["rope_parameters"]["rope_type"] == "linear" and config_from_hf(v5).rope_scaling.factor == 4.0
    # llama3 without original_max_position_embeddings falls back to max_position_embeddings
    rs = {k: v for k, v in base["rope_scaling"].items() if k != "original_max_position_embeddings"}
    assert config_from_hf(dict(base, rope_scaling=rs)).rope_scaling.original_max_position_embeddings == 131072
    # 5.x nests rope parameters per layer type when they are given per layer type
    nested = to_v5(base)
    nested["rope_parameters"] = {"full_attention": nested["rope_parameters"]}
    assert config_from_hf(nested) == config_from_hf(base)


def test_family_defaults_and_dtype():
    minimal = {k: MIXTRAL_8X7B[k] for k in ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                                             "num_hidden_layers", "num_attention_heads")}
    c = config_from_hf(minimal)
    assert c.rope_theta == 1e6 and c.n_kv_heads == 8 and c.rms_eps == 1e-5 and c.n_experts == 8
    assert c.param_dtype == "float32"  # no dtype recorded
    mistral = {k: v for k, v in MISTRAL_7B_V01.items() if k != "sliding_window"}
    assert config_from_hf(mistral).sliding_window == 4096  # MistralConfig's default
    assert config_from_hf(LLAMA31_8B, dtype="float32").param_dtype == "float32"
    assert config_from_hf(dict(LLAMA31_8B, torch_dtype="float16")).dtype == "float16"
    olmoe_alias = {k: v for k, v in OLMOE_1B_7B.items() if k != "num_experts"} | {"num_local_experts": 32}
    assert config_from_hf(olmoe_alias).n_experts == 32  # OlmoeConfig.attribute_map
    qwen_sw = dict(QWEN2_7B, use_sliding_window=True, sliding_window=4096, max_window_layers=0)
    assert config_from_hf(qwen_sw).sliding_window == 4096  # every layer slides


BAD = {
    "unknown model_type": (dict(LLAMA31_8B, model_type="gpt2", architectures=["GPT2LMHeadModel"]), "gpt2"),
    "remote code": (dict(LLAMA31_8B, model_type="deepseek", architectures=["DeepseekForCausalLM"],
                         auto_map={"AutoModelForCausalLM": "modeling_deepseek.DeepseekForCausalLM"}), "remote code"),
    "other head": (dict(LLAMA31_8B, architectures=["LlamaForSequenceClassification"]), "architectures"),
    "yarn": (dict(LLAMA31_8B, rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn"),
    "dynamic": (dict(LLAMA31_8B, rope_scaling={"type": "dynamic", "factor": 2.0}), "dynamic"),
    "longrope v5": (to_v5(dict(PHI3_MINI_4K, rope_scaling={"type": "longrope", "short_factor": [1.0] * 48,
                                                           "long_factor": [1.0] * 48})), "longrope"),
    "phi3 su": (dict(PHI3_MINI_4K, rope_scaling={"type": "su", "short_factor": [1.0], "long_factor": [1.0]}),
                "longrope"),
    "mlp_only_layers": (dict(QWEN15_MOE_A27B, mlp_only_layers=[0, 3]), "mlp_only_layers"),
    "decoder_sparse_step": (dict(QWEN15_MOE_A27B, decoder_sparse_step=2), "decoder_sparse_step"),
    "qwen2_moe alternating sliding": (dict(QWEN15_MOE_A27B, use_sliding_window=True), "sliding"),
    "qwen2 partial sliding": (dict(QWEN2_7B, use_sliding_window=True, max_window_layers=14), "sliding"),
    "clip_qkv": (dict(OLMOE_1B_7B, clip_qkv=8.0), "clip_qkv"),
    "olmoe bias": (dict(OLMOE_1B_7B, attention_bias=True), "attention_bias"),
    "llama bias": (dict(LLAMA31_8B, attention_bias=True), "attention_bias"),
    "llama mlp bias": (dict(LLAMA31_8B, mlp_bias=True), "mlp_bias"),
    "partial rotary on llama": (dict(LLAMA31_8B, partial_rotary_factor=0.5), "partial_rotary_factor"),
    "gelu": (dict(LLAMA31_8B, hidden_act="gelu"), "hidden_act"),
    "top-k > experts": (dict(MIXTRAL_8X7B, num_experts_per_tok=9), "num_experts_per_tok"),
    "bad kv heads": (dict(LLAMA31_8B, num_key_value_heads=7), "n_kv_heads"),
    "missing field": ({k: v for k, v in LLAMA31_8B.items() if k != "hidden_size"}, "hidden_size"),
    "nested rope differs": ({**to_v5(LLAMA31_8B), "layer_types": ["full_attention", "sliding_attention"],
                             "rope_parameters": {"full_attention": {"rope_theta": 1e4},
                                                 "sliding_attention": {"rope_theta": 1e6}}}, "layer types"),
    "bad dtype": (dict(LLAMA31_8B, torch_dtype="float8"), None),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_refusals(name):
    d, needle = BAD[name]
    if needle is None:  # an unknown recorded dtype is not an error: float32 is used
        assert config_from_hf(d).param_dtype == "float32"
        return
    with pytest.raises(ConfigError) as e:
        config_from_hf(d)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg


@pytest.mark.parametrize("family", sorted(HUB))
def test_export_config_round_trip(family):
    cfg = config_from_hf(HUB[family])
    assert config_from_hf(hf_config_dict(cfg)) == cfg


def test_export_refuses_inexpressible():
    cfg = config_from_hf(LLAMA31_8B)
    for bad in (dict(qkv_bias=True), dict(qk_norm=True), dict(partial_rotary_factor=0.5)):
        with pytest.raises(ConfigError):
            hf_config_dict(cfg.replace(**bad))
    with pytest.raises(ConfigError):
        hf_config_dict(config_from_hf(MIXTRAL_8X7B).replace(norm_topk_prob=False))
