"""Hugging Face `config.json` <-> `ModelConfig`.

Reads both the transformers 4.x style (`rope_theta`, `rope_scaling`, `torch_dtype` at the top level)
and the 5.x style (`rope_parameters` holding rope_theta / rope_type / scaling fields, `dtype`).
Whatever the decoder here cannot reproduce exactly (remote code, other rope types, biases on
o_proj/MLP, non-uniform layers, q/k/v clipping, other activations) is refused with one line naming
the field, never approximated.

Gemma 3 (`model_type` gemma3_text, our family "gemma3") is read in both styles too: 4.x
(`rope_theta` + `rope_scaling` for the global layers, `rope_local_base_freq` for the local ones,
`sliding_window_pattern`) and 5.x (`rope_parameters` nested per layer type, `layer_types`).

Defaults for fields a config.json leaves out are the transformers defaults of each family's config
class (they differ: e.g. Mistral's sliding_window defaults to 4096, Mixtral's rope_theta to 1e6).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

from m2r2_jax.errors import CheckpointError, ConfigError
from m2r2_jax.json_files import read_json_object
from m2r2_jax.models.config import DTYPES, ModelConfig, RopeScaling

# model_type -> the causal-LM architecture class transformers uses for it
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
# our family -> its model_type where the names differ
MODEL_TYPES = {"gemma3": "gemma3_text"}
FAMILY_OF = {mt: f for f, mt in MODEL_TYPES.items()}


def model_type(family: str) -> str:
    return MODEL_TYPES.get(family, family)

# transformers defaults of the config classes (5.x; the same as 4.x for these fields)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(rms_norm_eps=1e-6, max_position_embeddings=2048, num_key_value_heads=None, rope_theta=1e4),
    "mistral": dict(rms_norm_eps=1e-6, max_position_embeddings=4096 * 32, num_key_value_heads=8, rope_theta=1e4,
                    sliding_window=4096),
    "qwen2": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, num_key_value_heads=32, rope_theta=1e4,
                  sliding_window=4096, max_window_layers=28),
    "phi3": dict(rms_norm_eps=1e-5, max_position_embeddings=4096, num_key_value_heads=None, rope_theta=1e4,
                 sliding_window=None),
    "mixtral": dict(rms_norm_eps=1e-5, max_position_embeddings=4096 * 32, num_key_value_heads=8, rope_theta=1e6,
                    sliding_window=None, num_experts_per_tok=2, num_local_experts=8),
    "qwen2_moe": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, num_key_value_heads=16, rope_theta=1e4,
                      sliding_window=4096, max_window_layers=28, num_experts_per_tok=4, num_experts=60,
                      moe_intermediate_size=1408, shared_expert_intermediate_size=5632, norm_topk_prob=False,
                      decoder_sparse_step=1, qkv_bias=True),
    "olmoe": dict(rms_norm_eps=1e-5, max_position_embeddings=4096, num_key_value_heads=None, rope_theta=1e4,
                  num_experts_per_tok=8, num_experts=64, norm_topk_prob=False),
    "gemma3": dict(rms_norm_eps=1e-6, max_position_embeddings=131072, num_key_value_heads=4, rope_theta=1e6,
                   rope_local_base_freq=1e4, head_dim=256, sliding_window=4096, sliding_window_pattern=6,
                   query_pre_attn_scalar=256, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh"),
}

_HF_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "fp32": "float32",
              "bf16": "bfloat16", "fp16": "float16", "torch.float32": "float32", "torch.bfloat16": "bfloat16",
              "torch.float16": "float16"}

_SUPPORTED_ROPE = ("default", "linear", "llama3")


def read_config_json(path) -> dict[str, Any]:
    """The raw config.json of a Hugging Face model directory (or the file itself)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise CheckpointError(f"{p} not found: expected a Hugging Face model directory with config.json")
    return read_json_object(p, ConfigError)


def checkpoint_dtype(d: dict[str, Any]) -> Optional[str]:
    """The weights' dtype recorded in config.json (`dtype` in 5.x, `torch_dtype` in 4.x), if ours."""
    raw = d.get("dtype", d.get("torch_dtype"))
    return _HF_DTYPES.get(str(raw)) if raw is not None else None


def _int(d, key, default=None, *, where="config.json"):
    v = d.get(key, default)
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise ConfigError(f"{where}: {key}={v!r} is invalid: expected an integer")
    return int(v)


def _float(d, key, default=None, *, where="config.json"):
    v = d.get(key, default)
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(f"{where}: {key}={v!r} is invalid: expected a number")
    return float(v)


def _rope_params(d: dict[str, Any], family: str) -> dict[str, Any]:
    """Merge 4.x (`rope_theta` + `rope_scaling`) and 5.x (`rope_parameters`) into one flat dict."""
    params: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):
        v = d.get(key)
        if v is None:
            continue
        if not isinstance(v, dict):
            raise ConfigError(f"config.json: {key}={v!r} is invalid: expected an object or null")
        if v and all(isinstance(x, dict) for x in v.values()):  # nested per layer type (5.x)
            distinct = {json.dumps(x, sort_keys=True) for x in v.values()}
            if len(distinct) != 1:
                raise ConfigError(f"config.json: {key} differs between layer types {sorted(v)}: layers must "
                                  "share one rotary embedding")
            v = next(iter(v.values()))
        params.update(v)
    params.setdefault("rope_theta", d.get("rope_theta", _DEFAULTS[family]["rope_theta"]))
    if "rope_type" not in params:
        params["rope_type"] = params.get("type", "default")
    if "partial_rotary_factor" not in params and d.get("partial_rotary_factor") is not None:
        params["partial_rotary_factor"] = d["partial_rotary_factor"]
    return params


def _rope(d: dict[str, Any], family: str, max_pos: int) -> tuple[float, RopeScaling, float]:
    p = _rope_params(d, family)
    theta = _float(p, "rope_theta", where="config.json rope parameters")
    rtype = p["rope_type"]
    if family == "phi3" and rtype in ("su", "yarn"):
        rtype = "longrope"  # what transformers maps them to
    if rtype not in _SUPPORTED_ROPE:
        raise ConfigError(f"config.json: rope type {rtype!r} is not supported (supported: "
                          f"{', '.join(_SUPPORTED_ROPE)})")
    if family == "phi3" and rtype != "default":
        raise ConfigError(f"config.json: rope type {rtype!r} is not valid for phi3 (transformers accepts only "
                          "default and longrope; longrope is not supported here)")
    prf = p.get("partial_rotary_factor", 1.0)
    prf = 1.0 if prf is None else _float({"partial_rotary_factor": prf}, "partial_rotary_factor")
    if prf != 1.0 and family != "phi3":
        raise ConfigError(f"config.json: partial_rotary_factor={prf} is only supported for phi3 "
                          f"({family} applies rotary to the full head)")
    where = "config.json rope parameters"
    if rtype == "default":
        rs = RopeScaling()
    elif rtype == "linear":
        rs = RopeScaling("linear", factor=_float(p, "factor", where=where))
    else:
        # transformers gives a top-level original_max_position_embeddings priority over the one
        # inside the rope parameters, and falls back to max_position_embeddings
        omp = d.get("original_max_position_embeddings")
        omp = p.get("original_max_position_embeddings", max_pos) if omp is None else omp
        for k in ("factor", "low_freq_factor", "high_freq_factor"):
            if p.get(k) is None:
                raise ConfigError(f"{where}: llama3 rope scaling needs {k!r}")
        rs = RopeScaling("llama3", factor=_float(p, "factor", where=where),
                         low_freq_factor=_float(p, "low_freq_factor", where=where),
                         high_freq_factor=_float(p, "high_freq_factor", where=where),
                         original_max_position_embeddings=_int({"v": omp}, "v", where=where))
        if rs.high_freq_factor <= rs.low_freq_factor:
            raise ConfigError(f"{where}: high_freq_factor={rs.high_freq_factor} must exceed "
                              f"low_freq_factor={rs.low_freq_factor}")
    return theta, rs, prf


def _layer_types(d: dict[str, Any], family: str, n_layers: int) -> list[str]:
    """Per-layer attention kind as transformers derives it (Qwen2 / Qwen2-MoE)."""
    lt = d.get("layer_types")
    if lt is not None:
        if not isinstance(lt, list) or len(lt) != n_layers:
            raise ConfigError(f"config.json: layer_types must be a list of {n_layers} entries")
        return list(lt)
    dflt = _DEFAULTS[family]
    use = bool(d.get("use_sliding_window", False))
    mwl = d.get("max_window_layers", dflt["max_window_layers"])
    if family == "qwen2":
        return ["sliding_attention" if use and d.get("sliding_window", dflt["sliding_window"]) is not None
                and i >= mwl else "full_attention" for i in range(n_layers)]
    return ["sliding_attention" if use and (i + 1) % 2 and i < mwl else "full_attention" for i in range(n_layers)]


def _gemma3(d: dict[str, Any], n_layers: int, max_pos: int) -> tuple[float, RopeScaling, float, dict[str, Any]]:
    """Gemma 3's own fields: (global rope_theta, its scaling, partial rotary factor 1, ModelConfig
    fields). The global layers' rotary embedding takes any scaling `_rope` reads (Gemma 3 4B+:
    linear, factor 8); the local layers' must be the default one."""
    dflt = _DEFAULTS["gemma3"]
    rp = d.get("rope_parameters")
    full: dict[str, Any] = {}
    local: dict[str, Any] = {}
    if rp is not None:
        if not isinstance(rp, dict) or not all(isinstance(v, dict) or v is None for v in rp.values()) or \
                set(rp) - {"full_attention", "sliding_attention"}:
            raise ConfigError(f"config.json: rope_parameters={rp!r} is invalid for gemma3: expected an object per "
                              "layer type (full_attention, sliding_attention)")
        full = dict(rp.get("full_attention") or {})
        local = dict(rp.get("sliding_attention") or {})
    if d.get("rope_scaling") is not None:  # 4.x: the global layers' scaling
        if not isinstance(d["rope_scaling"], dict):
            raise ConfigError(f"config.json: rope_scaling={d['rope_scaling']!r} is invalid: expected an object or null")
        full.update(d["rope_scaling"])
    full.setdefault("rope_theta", d.get("rope_theta", dflt["rope_theta"]))
    theta, rope_scaling, prf = _rope({"rope_parameters": full}, "gemma3", max_pos)
    ltype = local.get("rope_type", local.get("type", "default"))
    if ltype != "default":
        raise ConfigError(f"config.json: rope type {ltype!r} for the sliding-window layers is not supported "
                          "(only default)")
    local_theta = _float({"v": local.get("rope_theta", d.get("rope_local_base_freq", dflt["rope_local_base_freq"]))},
                         "v", where="config.json rope_local_base_freq")
    lt = d.get("layer_types")
    if lt is None:
        pattern = _int(d, "sliding_window_pattern", dflt["sliding_window_pattern"])
        lt = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    if not isinstance(lt, list) or len(lt) != n_layers:
        raise ConfigError(f"config.json: layer_types must be a list of {n_layers} entries")
    bad = sorted(set(lt) - {"full_attention", "sliding_attention"})
    if bad:
        raise ConfigError(f"config.json: layer_types {bad} are not supported (full_attention, sliding_attention)")
    sw = d.get("sliding_window", dflt["sliding_window"])
    sliding = None if sw is None else _int({"sliding_window": sw}, "sliding_window")
    if sliding is None and "sliding_attention" in lt:
        raise ConfigError("config.json: sliding_window=null with sliding_attention layers")

    def optional(key):
        v = d.get(key, dflt.get(key))
        return None if v is None else _float({key: v}, key)

    fields = dict(layer_types=tuple(lt), sliding_window=sliding, rope_local_theta=local_theta, qk_norm_per_head=True,
                  norm_unit_offset=True, post_norms=True, mlp_activation="gelu_tanh", scale_embeddings=True,
                  query_pre_attn_scalar=optional("query_pre_attn_scalar"),
                  final_logit_softcap=optional("final_logit_softcapping"))
    return theta, rope_scaling, prf, fields


def config_from_hf(d: dict[str, Any], dtype: Optional[str] = None) -> ModelConfig:
    """A Hugging Face config.json (as a dict) -> a validated `ModelConfig`.

    `dtype` sets both the parameter and compute dtype; None means the dtype recorded in config.json
    (`dtype`/`torch_dtype`), or float32 when it is absent or not one of ours."""
    mtype = d.get("model_type")
    archs = d.get("architectures")
    remote = bool(d.get("auto_map") or d.get("trust_remote_code"))
    if mtype not in ARCHITECTURES:
        if remote:
            raise ConfigError(f"config.json: model_type={mtype!r} (architectures={archs}) needs remote code "
                              f"(auto_map/trust_remote_code), which is never run: supported model types are "
                              f"{', '.join(ARCHITECTURES)}")
        hint = " (the multimodal Gemma 3; only its text model, gemma3_text, is supported)" if mtype == "gemma3" else ""
        raise ConfigError(f"config.json: model_type={mtype!r} (architectures={archs}) is not supported{hint}: "
                          f"expected one of {', '.join(ARCHITECTURES)}")
    if archs is not None:
        if not isinstance(archs, list) or archs != [ARCHITECTURES[mtype]]:
            why = "needs remote code (auto_map), which is never run" if remote else \
                "is not supported (a causal LM without extra heads is expected)"
            raise ConfigError(f"config.json: architectures={archs} for model_type {mtype!r} {why}: expected "
                              f"[{ARCHITECTURES[mtype]!r}]")
    family = FAMILY_OF.get(mtype, mtype)
    # An auto_map next to a built-in model_type and architecture (e.g. the Phi-3 hub repos, written
    # before transformers had Phi3) is ignored, as transformers ignores it without trust_remote_code.
    dflt = _DEFAULTS[family]
    if family == "gemma3":
        act = d.get("hidden_activation", dflt["hidden_activation"])
        if act != "gelu_pytorch_tanh":
            raise ConfigError(f"config.json: hidden_activation={act!r} is not supported for gemma3: only "
                              "gelu_pytorch_tanh (GeGLU with the tanh approximation)")
        if d.get("attention_bias"):
            raise ConfigError("config.json: attention_bias=true is not supported (biases on the attention projections)")
        if d.get("attn_logit_softcapping") is not None:
            # transformers' Gemma3Attention stores it but never applies it: which logits a checkpoint
            # means is ambiguous (the released Gemma 3 checkpoints all have null)
            raise ConfigError(f"config.json: attn_logit_softcapping={d['attn_logit_softcapping']!r} is not supported "
                              "for gemma3 (transformers ignores it; expected null)")
        if d.get("use_bidirectional_attention"):
            raise ConfigError("config.json: use_bidirectional_attention=true is not supported (a causal decoder is "
                              "expected)")
    else:
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config.json: hidden_act={act!r} is not supported: only silu (SwiGLU)")
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key) and family in ("llama", "olmoe"):
            raise ConfigError(f"config.json: {key}=true is not supported (biases on o_proj/MLP projections)")
    if d.get("clip_qkv") is not None:
        raise ConfigError(f"config.json: clip_qkv={d['clip_qkv']!r} is not supported (only null, as in the "
                          "released OLMoE checkpoints)")

    vocab = _int(d, "vocab_size")
    hidden = _int(d, "hidden_size")
    n_layers = _int(d, "num_hidden_layers")
    n_heads = _int(d, "num_attention_heads")
    kv = d.get("num_key_value_heads", dflt["num_key_value_heads"])
    n_kv = n_heads if kv is None else _int({"num_key_value_heads": kv}, "num_key_value_heads")
    hd = d.get("head_dim", dflt.get("head_dim"))
    if hd is None:
        if hidden % n_heads:
            raise ConfigError(f"config.json: hidden_size={hidden} is not a multiple of num_attention_heads={n_heads} "
                              "and head_dim is not given")
        hd = hidden // n_heads
    head_dim = _int({"head_dim": hd}, "head_dim")
    if family == "olmoe" and head_dim != hidden // n_heads:
        raise ConfigError(f"config.json: head_dim={head_dim} must equal hidden_size/num_attention_heads for olmoe")
    max_pos = _int(d, "max_position_embeddings", dflt["max_position_embeddings"])
    eps = _float(d, "rms_norm_eps", dflt["rms_norm_eps"])
    kw: dict[str, Any] = {}
    if family == "gemma3":
        theta, rope_scaling, prf, gemma = _gemma3(d, n_layers, max_pos)
        kw.update(gemma)
    else:
        theta, rope_scaling, prf = _rope(d, family, max_pos)

    sliding: Optional[int] = None
    if family in ("mistral", "mixtral", "phi3"):
        sw = d.get("sliding_window", dflt["sliding_window"])
        sliding = None if sw is None else _int({"sliding_window": sw}, "sliding_window")
    elif family in ("qwen2", "qwen2_moe"):
        kinds = set(_layer_types(d, family, n_layers))
        if len(kinds) > 1:
            raise ConfigError("config.json: mixed sliding-window and full-attention layers (use_sliding_window="
                              f"{d.get('use_sliding_window')}, max_window_layers={d.get('max_window_layers')}) are not "
                              "supported: layers are stacked and must be uniform")
        if kinds == {"sliding_attention"}:
            sliding = _int(d, "sliding_window", dflt["sliding_window"])
        elif kinds - {"full_attention"}:
            raise ConfigError(f"config.json: layer_types {sorted(kinds)} are not supported")
    elif family == "gemma3":
        sliding = kw.pop("sliding_window")
    if sliding is not None and sliding <= 0:
        raise ConfigError(f"config.json: sliding_window={sliding} is invalid: expected a positive integer or null")

    if family in ("mixtral", "qwen2_moe", "olmoe"):
        if family == "mixtral":
            ne = d.get("num_local_experts", d.get("num_experts", dflt["num_local_experts"]))
        else:
            ne = d.get("num_experts", d.get("num_local_experts", dflt["num_experts"]))
        kw["n_experts"] = _int({"num_experts": ne}, "num_experts")
        kw["n_experts_per_tok"] = _int(d, "num_experts_per_tok", dflt["num_experts_per_tok"])
        if family == "mixtral":
            kw["moe_d_ff"] = _int(d, "intermediate_size")
            kw["norm_topk_prob"] = True  # Mixtral always renormalises the top-k weights
        elif family == "olmoe":
            kw["moe_d_ff"] = _int(d, "intermediate_size")
            kw["norm_topk_prob"] = bool(d.get("norm_topk_prob", dflt["norm_topk_prob"]))
        else:
            kw["moe_d_ff"] = _int(d, "moe_intermediate_size", dflt["moe_intermediate_size"])
            kw["norm_topk_prob"] = bool(d.get("norm_topk_prob", dflt["norm_topk_prob"]))
            kw["shared_expert_d_ff"] = _int(d, "shared_expert_intermediate_size",
                                            dflt["shared_expert_intermediate_size"])
            if kw["shared_expert_d_ff"] <= 0:
                raise ConfigError("config.json: shared_expert_intermediate_size must be positive for qwen2_moe")
            mlp_only = d.get("mlp_only_layers") or []
            if mlp_only:
                raise ConfigError(f"config.json: mlp_only_layers={mlp_only} is not supported: layers are stacked and "
                                  "must all be MoE layers")
            step = d.get("decoder_sparse_step", dflt["decoder_sparse_step"])
            if step != 1:
                raise ConfigError(f"config.json: decoder_sparse_step={step} is not supported: layers are stacked and "
                                  "must all be MoE layers (expected 1)")
        if kw["n_experts_per_tok"] > kw["n_experts"]:
            raise ConfigError(f"config.json: num_experts_per_tok={kw['n_experts_per_tok']} exceeds the number of "
                              f"experts {kw['n_experts']}")
        d_ff = _int(d, "intermediate_size", kw["moe_d_ff"])
    else:
        d_ff = _int(d, "intermediate_size")
    qkv_bias = {"qwen2": True, "qwen2_moe": bool(d.get("qkv_bias", True))}.get(family, False)

    if dtype is None:
        dtype = checkpoint_dtype(d) or "float32"
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is invalid: expected one of {', '.join(DTYPES)}")
    tie = d.get("tie_word_embeddings", dflt.get("tie_word_embeddings", False))
    try:
        return ModelConfig(
            family=family, vocab_size=vocab, d_model=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
            head_dim=head_dim, d_ff=d_ff, max_seq_len=max_pos, rms_eps=eps, rope_theta=theta,
            rope_scaling=rope_scaling, partial_rotary_factor=prf, tie_embeddings=bool(tie), qkv_bias=qkv_bias,
            qk_norm=(family in ("olmoe", "gemma3")), sliding_window=sliding, dtype=dtype, param_dtype=dtype, **kw,
        ).validate()
    except ConfigError as e:
        raise ConfigError(f"config.json gives an invalid model: {e}") from None


def load_hf_config(hf_dir, dtype: Optional[str] = None) -> ModelConfig:
    return config_from_hf(read_config_json(hf_dir), dtype)


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------
def check_exportable(cfg: ModelConfig) -> None:
    """Refuse configs the family's transformers class cannot express exactly."""
    f = cfg.family

    def no(what):
        raise ConfigError(f"cannot export a {f} model with {what}: transformers' {ARCHITECTURES[model_type(f)]} has no "
                          "such option")

    gemma = f == "gemma3"
    if cfg.router_weights != "softmax":  # a moefied model sums its experts unweighted
        no(f"router_weights={cfg.router_weights!r} (transformers weighs every expert by its router probability)")
    if cfg.qkv_bias and f not in ("qwen2", "qwen2_moe"):
        no("qkv_bias")
    if not cfg.qkv_bias and f == "qwen2":
        no("qkv_bias=False")
    if cfg.qk_norm != (f in ("olmoe", "gemma3")):
        no(f"qk_norm={cfg.qk_norm}")
    # Gemma's layer: every one of these is fixed by the family (on for gemma3, off elsewhere)
    for name in ("qk_norm_per_head", "norm_unit_offset", "post_norms", "scale_embeddings"):
        if getattr(cfg, name) != gemma:
            no(f"{name}={getattr(cfg, name)}")
    if cfg.mlp_activation != ("gelu_tanh" if gemma else "silu"):
        no(f"mlp_activation={cfg.mlp_activation}")
    if not gemma:
        for name in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap", "rope_local_theta"):
            if getattr(cfg, name) is not None:
                no(f"{name}={getattr(cfg, name)}")
        if cfg.layer_types:
            no("per-layer layer_types")
    elif cfg.query_pre_attn_scalar is not None and not float(cfg.query_pre_attn_scalar).is_integer():
        no(f"query_pre_attn_scalar={cfg.query_pre_attn_scalar} (an integer in transformers)")
    elif cfg.attn_logit_softcap is not None:
        no(f"attn_logit_softcap={cfg.attn_logit_softcap} (transformers' Gemma 3 ignores attn_logit_softcapping)")
    elif cfg.rope_local_theta is None and "sliding_attention" in cfg.layer_types and \
            cfg.rope_scaling.rope_type != "default":
        no("scaled rotary embeddings on its sliding-window layers")
    if cfg.shared_expert_d_ff and f != "qwen2_moe":
        no("a shared expert")
    if f == "qwen2_moe" and not cfg.shared_expert_d_ff:
        no("no shared expert")
    if f == "mixtral" and not cfg.norm_topk_prob:
        no("norm_topk_prob=False")
    if cfg.partial_rotary_factor != 1.0 and f != "phi3":
        no(f"partial_rotary_factor={cfg.partial_rotary_factor}")
    if f == "phi3" and cfg.rope_scaling.rope_type != "default":
        no(f"rope type {cfg.rope_scaling.rope_type}")
    if f == "olmoe" and cfg.head_dim * cfg.n_heads != cfg.d_model:
        no("head_dim != hidden_size / num_attention_heads")
    if f == "olmoe" and cfg.sliding_window is not None:
        no("a sliding window")
    if f == "llama" and cfg.sliding_window is not None:
        no("a sliding window")


def hf_config_dict(cfg: ModelConfig, dtype: Optional[str] = None) -> dict[str, Any]:
    """`ModelConfig` -> a transformers config.json (4.x style, which transformers 4.x and 5.x load)."""
    check_exportable(cfg)
    f = cfg.family
    rs = cfg.rope_scaling
    if rs.rope_type == "default":
        rope_scaling = None
    elif rs.rope_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": rs.factor}
    else:
        rope_scaling = {"rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
                        "high_freq_factor": rs.high_freq_factor,
                        "original_max_position_embeddings": rs.original_max_position_embeddings}
    d: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type(f)]],
        "model_type": model_type(f),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.moe_d_ff if f in ("mixtral", "olmoe") else cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": dtype or cfg.param_dtype,
        "attention_dropout": 0.0,
        "use_cache": True,
    }
    if f == "gemma3":
        d["hidden_activation"] = "gelu_pytorch_tanh"
    else:
        d["hidden_act"] = "silu"
    if f in ("llama", "olmoe", "gemma3"):
        d["attention_bias"] = False
    if f == "llama":
        d["mlp_bias"] = False
    if f in ("mistral", "mixtral", "phi3"):
        d["sliding_window"] = cfg.sliding_window
    if f in ("qwen2", "qwen2_moe"):
        d["use_sliding_window"] = cfg.sliding_window is not None
        d["sliding_window"] = cfg.sliding_window
        d["max_window_layers"] = 0 if f == "qwen2" else cfg.n_layers
        d["layer_types"] = ["sliding_attention" if cfg.sliding_window else "full_attention"] * cfg.n_layers
    if f == "phi3":
        d["partial_rotary_factor"] = cfg.partial_rotary_factor
        d["original_max_position_embeddings"] = cfg.max_seq_len
        d["pad_token_id"] = None  # Phi3Config defaults to 32000, outside small vocabularies
        d["eos_token_id"] = None
        d["bos_token_id"] = None
    if f == "mixtral":
        d["num_local_experts"] = cfg.n_experts
        d["num_experts_per_tok"] = cfg.n_experts_per_tok
    if f in ("qwen2_moe", "olmoe"):
        d["num_experts"] = cfg.n_experts
        d["num_experts_per_tok"] = cfg.n_experts_per_tok
        d["norm_topk_prob"] = cfg.norm_topk_prob
    if f == "qwen2_moe":
        d["moe_intermediate_size"] = cfg.moe_d_ff
        d["shared_expert_intermediate_size"] = cfg.shared_expert_d_ff
        d["decoder_sparse_step"] = 1
        d["mlp_only_layers"] = []
        d["qkv_bias"] = cfg.qkv_bias
    if f == "olmoe":
        d["clip_qkv"] = None
        d["pad_token_id"] = None
        d["eos_token_id"] = None
    if f == "gemma3":
        # 4.x keys, which transformers 5 converts too: rope_theta/rope_scaling are the global layers'
        types = cfg.layer_types or ("sliding_attention" if cfg.sliding_window else "full_attention",) * cfg.n_layers
        d["layer_types"] = list(types)
        d["sliding_window"] = cfg.sliding_window
        d["rope_local_base_freq"] = cfg.rope_theta if cfg.rope_local_theta is None else cfg.rope_local_theta
        d["query_pre_attn_scalar"] = int(cfg.query_pre_attn_scalar or cfg.head_dim)  # an int in Gemma3TextConfig
        d["attn_logit_softcapping"] = None
        d["final_logit_softcapping"] = cfg.final_logit_softcap
        d["use_bidirectional_attention"] = False
    return d
