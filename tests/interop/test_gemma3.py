"""Gemma 3 (transformers `gemma3_text`): a tiny random Gemma3ForCausalLM written by transformers
reads into the one model implementation and matches it: logits on prompts longer than the
sliding window, greedy generation, lossless M2R2 speculation, export back, config.json in both
styles, clear refusals.

The tiny model has 6 layers in the pattern local, local, global (sliding_window_pattern 3), a
window of 5 (every prompt is longer), head_dim 16 != hidden_size / heads = 12, a local RoPE base
that differs from the global one, and zero-centred norm weights drawn away from zero.
"""

import copy
import json

import numpy as np
import pytest

from hf_helpers import assert_close, hf_logits, our_logits, random_tokens, save_hf, torch, transformers

from m2r2_jax.errors import ConfigError
from m2r2_jax.interop.convert import load_hf, write_hf
from m2r2_jax.interop.hf_config import config_from_hf, hf_config_dict

WINDOW = 5
TINY = dict(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, sliding_window=WINDOW,
            sliding_window_pattern=3, query_pre_attn_scalar=24, rope_theta=10000.0, rope_local_base_freq=100.0,
            pad_token_id=None, bos_token_id=None, eos_token_id=None)
# the global layers' RoPE linearly scaled (as Gemma 3 4B+) and final logit soft-capping on
SCALED = dict(rope_scaling={"rope_type": "linear", "factor": 2.0}, final_logit_softcapping=3.0)


def build_gemma3(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = transformers.Gemma3TextConfig(**{**TINY, **overrides})
    config._attn_implementation = "eager"
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # norms are x * (1 + w): w around 0 (not the transformers init of exactly 0)
            p.copy_((0.2 if "norm" in name and p.ndim == 1 else 0.15) * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(transformers model, our cfg, our params) of the plain tiny Gemma 3."""
    d = tmp_path_factory.mktemp("gemma3") / "hf"
    model = build_gemma3()
    save_hf(model, d)
    cfg, params = load_hf(d)
    return model, cfg, params


def test_config_and_layers(gemma):
    model, cfg, params = gemma
    assert cfg.family == "gemma3" and model.config.model_type == "gemma3_text"
    assert cfg.layer_types == tuple(model.config.layer_types) == ("sliding_attention", "sliding_attention",
                                                                  "full_attention") * 2
    assert cfg.layer_windows == (WINDOW, WINDOW, None) * 2
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.head_dim, cfg.query_pre_attn_scalar) == (1e4, 100.0, 16, 24.0)
    assert cfg.tie_embeddings and "lm_head" not in params
    # four norms per layer, in HF's zero-centred convention
    assert {"attn_norm", "attn_post_norm", "mlp_norm", "mlp_post_norm"} <= set(params["layers"])
    assert params["layers"]["attn"]["q_norm"]["scale"].shape == (6, 16)
    np.testing.assert_array_equal(params["layers"]["mlp_norm"]["scale"][2],
                                  model.model.layers[2].pre_feedforward_layernorm.weight.detach().numpy())


def test_logits_parity_past_the_window(gemma):
    model, cfg, params = gemma
    tokens = random_tokens(cfg.vocab_size, shape=(2, 17))
    assert_close(our_logits(cfg, params, tokens), hf_logits(model, tokens), tol=1e-4)


def test_logits_parity_scaled_rope_softcap_4x_config(tmp_path):
    """Global RoPE scaled and final soft-capping, with config.json rewritten the way transformers
    4.x (and the hub's Gemma 3 checkpoints) write it: rope_theta + rope_scaling for the global
    layers, rope_local_base_freq, sliding_window_pattern, no layer_types."""
    model = build_gemma3(seed=1, **SCALED)
    save_hf(model, tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    d = json.loads(path.read_text())
    rp = d.pop("rope_parameters")
    d["rope_theta"] = rp["full_attention"]["rope_theta"]
    d["rope_scaling"] = {k: v for k, v in rp["full_attention"].items() if k != "rope_theta"}
    d["rope_local_base_freq"] = rp["sliding_attention"]["rope_theta"]
    d.pop("layer_types")
    d["sliding_window_pattern"] = 3
    d["torch_dtype"] = d.pop("dtype")
    path.write_text(json.dumps(d))
    cfg, params = load_hf(tmp_path / "hf")
    assert cfg.rope_scaling.rope_type == "linear" and cfg.final_logit_softcap == 3.0
    assert cfg.layer_types == tuple(model.config.layer_types)
    tokens = random_tokens(cfg.vocab_size, shape=(2, 15), seed=4)
    ref = hf_logits(model, tokens)
    assert np.abs(ref).max() < 3.0  # the cap is active
    assert_close(our_logits(cfg, params, tokens), ref, tol=1e-4)


PROMPTS = [[5, 9, 14, 2, 33, 21, 7, 11, 40], [3, 17, 5, 29, 8, 60, 1]]  # both longer than the window
NEW = 12


def _hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_generation_equals_transformers(gemma):
    from m2r2_jax.decoding import api

    model, cfg, params = gemma
    ours = api.generate("ar", cfg, params, PROMPTS, max_new_tokens=NEW)
    for p, r in zip(PROMPTS, ours):
        assert r.tokens == _hf_greedy(model, p, NEW)


def test_m2r2_spec_greedy_is_lossless(gemma):
    """Self-speculation through the fast stream (which reuses the layers' post-norms) drafts, the
    slow stream verifies: greedy output identical to plain decoding, with the fresh default M2R2
    config (the API's default) and with random adapters (drafts often rejected)."""
    import jax

    from m2r2_jax.decoding import api
    from m2r2_jax.m2r2.config import default_m2r2_config
    from m2r2_jax.m2r2.fast_stream import init_m2r2_params

    _, cfg, params = gemma
    ar = [r.tokens for r in api.generate("ar", cfg, params, PROMPTS, max_new_tokens=NEW)]
    fresh = api.generate("m2r2_spec", cfg, params, PROMPTS, max_new_tokens=NEW, gamma=3)
    assert [r.tokens for r in fresh] == ar
    mcfg = default_m2r2_config(cfg)
    mp = init_m2r2_params(cfg, mcfg, jax.random.key(1))
    rng = np.random.default_rng(0)
    mp["adapters"] = {t: {"A": a["A"], "B": 0.3 * rng.normal(size=a["B"].shape).astype(np.float32)}
                      for t, a in mp["adapters"].items()}
    noisy = api.generate("m2r2_spec", cfg, params, PROMPTS, max_new_tokens=NEW, gamma=3, m2r2=(mcfg, mp))
    assert [r.tokens for r in noisy] == ar


def test_export_round_trip(gemma, tmp_path):
    """Ours -> Hugging Face: transformers loads the exported directory with every tensor equal."""
    model, cfg, params = gemma
    write_hf(cfg, params, tmp_path / "out")
    assert config_from_hf(json.loads((tmp_path / "out" / "config.json").read_text())) == cfg
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert type(again).__name__ == "Gemma3ForCausalLM"
    ref, got = model.state_dict(), again.state_dict()
    assert set(got) == set(ref)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_sharding_axes_cover_every_leaf(gemma):
    from m2r2_jax.sharding.params import logical_axes

    _, cfg, params = gemma
    axes = logical_axes(params)
    assert axes["layers"]["attn_post_norm"]["scale"] == ("layers", "norm")
    assert axes["layers"]["attn"]["q_norm"]["scale"] == ("layers", "norm")


# A trimmed copy of google/gemma-3-1b-it's config.json (4.x style).
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
    "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144}


def test_hub_config():
    c = config_from_hf(GEMMA3_1B)
    assert (c.family, c.d_model, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff) == \
        ("gemma3", 1152, 26, 4, 1, 256, 6912)
    assert c.layer_types.count("full_attention") == 4 and c.layer_types[5] == "full_attention"
    assert (c.sliding_window, c.rope_theta, c.rope_local_theta, c.query_pre_attn_scalar) == (512, 1e6, 1e4, 256.0)
    assert c.tie_embeddings and c.dtype == "bfloat16" and c.final_logit_softcap is None
    # what transformers 5 writes for the same model reads the same
    hf5 = transformers.Gemma3TextConfig(**{k: v for k, v in GEMMA3_1B.items()
                                           if k not in ("architectures", "torch_dtype", "model_type")})
    d5 = dict(hf5.to_dict(), architectures=["Gemma3ForCausalLM"], dtype="bfloat16")
    assert "rope_parameters" in d5 and config_from_hf(d5) == c
    assert config_from_hf(hf_config_dict(c)) == c


BAD = {
    "attention softcap": (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    "bidirectional": (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    "activation": (dict(hidden_activation="gelu"), "hidden_activation"),
    "local rope scaled": (dict(rope_scaling=None, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}), "sliding-window layers"),
    "layer types": (dict(layer_types=["sliding_attention"] * 25 + ["chunked_attention"]), "layer_types"),
    "multimodal": (dict(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"]), "gemma3_text"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_refusals(name):
    over, needle = BAD[name]
    d = copy.deepcopy(GEMMA3_1B)
    d.update(over)
    with pytest.raises(ConfigError) as e:
        config_from_hf(d)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_export_refuses_what_gemma3_cannot_express():
    c = config_from_hf(GEMMA3_1B)
    for bad in (dict(post_norms=False), dict(mlp_activation="silu"), dict(attn_logit_softcap=50.0),
                dict(qk_norm_per_head=False)):
        with pytest.raises(ConfigError):
            hf_config_dict(c.replace(**bad))
    llama = c.replace(family="llama", qk_norm=False, qk_norm_per_head=False, norm_unit_offset=False,
                      post_norms=False, mlp_activation="silu", scale_embeddings=False, query_pre_attn_scalar=None,
                      rope_local_theta=None, layer_types=())
    hf_config_dict(llama.replace(sliding_window=None))
    with pytest.raises(ConfigError, match="layer_types"):
        hf_config_dict(llama.replace(sliding_window=None, layer_types=("full_attention",) * 26))


def _write_gemma3_gguf(path, model, pattern=3, skip=()):
    """`model` as llama.cpp's converter writes a gemma3 GGUF: llama.cpp tensor names, Q/K rows
    as they are (NEOX rotary), every norm weight stored as 1 + w, all tensors F32."""
    gguf = pytest.importorskip("gguf")
    c = model.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["full_attention"]["rope_theta"]))
    w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    w.add_sliding_window(c.sliding_window)
    if pattern is not None:
        w.add_uint32("gemma3.attention.sliding_window_pattern", pattern)
    w.add_vocab_size(c.vocab_size)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    tensors = {}
    for k, v in model.state_dict().items():
        a = v.detach().float().numpy()
        if k.endswith("norm.weight"):
            a = a + 1.0
        if k == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = a
        elif k == "model.norm.weight":
            tensors["output_norm.weight"] = a
        elif k.startswith("model.layers."):
            _, _, i, rest = k.split(".", 3)
            tensors[f"blk.{i}.{names[rest.removesuffix('.weight')]}.weight"] = a
    for name, a in tensors.items():
        if name not in skip:
            w.add_tensor(name, np.ascontiguousarray(a, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_import(tmp_path):
    """A gemma3 GGUF (F32) reads into the same model: llama.cpp's local RoPE base (10,000) and
    query scale (head_dim) are fixed, so the reference model uses them."""
    from m2r2_jax.errors import CheckpointError
    from m2r2_jax.interop.gguf_io import load_gguf

    model = build_gemma3(seed=2, rope_local_base_freq=10000.0, query_pre_attn_scalar=16)
    cfg, params, _ = load_gguf(_write_gemma3_gguf(tmp_path / "g.gguf", model))
    assert cfg.family == "gemma3" and cfg.layer_types == tuple(model.config.layer_types)
    assert (cfg.rope_local_theta, cfg.query_pre_attn_scalar, cfg.sliding_window) == (1e4, 16.0, WINDOW)
    tokens = random_tokens(cfg.vocab_size, shape=(2, 13), seed=5)
    assert_close(our_logits(cfg, params, tokens), hf_logits(model, tokens), tol=1e-4)
    # without the pattern key: llama.cpp's fixed every-sixth-layer-global pattern
    cfg6, _, _ = load_gguf(_write_gemma3_gguf(tmp_path / "g6.gguf", model, pattern=None))
    assert cfg6.layer_windows == (WINDOW,) * 5 + (None,)
    with pytest.raises(CheckpointError, match="blk.1.post_ffw_norm.weight"):
        load_gguf(_write_gemma3_gguf(tmp_path / "bad.gguf", model, skip=("blk.1.post_ffw_norm.weight",)))
