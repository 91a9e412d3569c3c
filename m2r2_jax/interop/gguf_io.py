"""GGUF files (llama.cpp's format) -> our model config and parameter tree.

    gguf = open_gguf(path)                      metadata + tensors, memory-mapped (the `gguf` package)
    cfg = config_from_gguf(gguf, dtype)         the ModelConfig its metadata describes
    params = read_params(cfg, GGUFWeights(gguf, cfg))   (`safetensors_io.read_params`)

Tensors are dequantised by the `gguf` package's own reader (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0 and the K-quants among others) to float32, then cast to the checkpoint dtype. `GGUFWeights`
serves them under Hugging Face tensor names, so the one mapping to our layout in
`safetensors_io.read_params` (shapes checked, unexpected tensors refused) serves both formats.

llama.cpp's converter reorders the rows of the Q and K projections of `llama`-architecture models
(rotary embedding on interleaved pairs instead of the two halves of each head); the order is
restored here. Architectures whose tensors are not reordered (qwen2) are read as they are.

Supported GGUF architectures: `llama` (Llama, Mistral and Mixtral-style MoE files all use it),
`qwen2` and `gemma3`. Anything else is refused in one line naming it, as is any metadata this decoder
cannot reproduce exactly (other rope scalings, per-layer rope frequency tensors).

`gemma3` follows llama.cpp's reading of the file: its converter stores every norm weight as 1 + w
(Gemma's RMSNorm scales by 1 + w), undone here; the metadata holds no layer pattern, local RoPE base
or attention scale, so llama.cpp's fixed values are used: every sixth layer global, the others
sliding with RoPE base 10,000 (no sliding_window key: all global), and the query scale
head_dim**-0.5 except for the 62-layer 27B model, whose query_pre_attn_scalar is
embedding_length / head_count.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from m2r2_jax.errors import CheckpointError, ConfigError
from m2r2_jax.models.config import DTYPES, ModelConfig, RopeScaling

# GGUF architecture -> our family for a dense model (MoE files of the llama architecture: mixtral)
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "gemma3": "gemma3"}
# Architectures whose Q/K rows llama.cpp's converter reorders for its interleaved rotary embedding.
_PERMUTED_QK = ("llama",)

# Hugging Face per-layer suffix -> GGUF per-layer name (both under the layer's prefix)
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
}
# Gemma 3's per-layer names where they differ (a norm before and after each sub-block, q/k norms)
_GEMMA3_LAYER_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if "bias" not in k and "block_sparse_moe" not in k},
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
# llama.cpp's fixed Gemma 3 values (llama-model.cpp): layer pattern, local RoPE base
_GEMMA3_SWA_PATTERN = 6
_GEMMA3_LOCAL_ROPE_BASE = 10000.0


def _layer_names(arch: str) -> dict:
    return _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES


_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# Mixtral experts: hub name -> (stacked GGUF tensor, per-expert GGUF tensor of older files)
_EXPERT_NAMES = {"w1": ("ffn_gate_exps.weight", "ffn_gate"), "w3": ("ffn_up_exps.weight", "ffn_up"),
                 "w2": ("ffn_down_exps.weight", "ffn_down")}


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    """The llama.cpp name of a Hugging Face tensor name (for messages about missing tensors)."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    parts = hf_name.split(".")
    names = _layer_names(arch)
    if parts[:2] == ["model", "layers"] and len(parts) > 3:
        suffix = ".".join(parts[3:])
        if suffix in names:
            return f"blk.{parts[2]}.{names[suffix]}"
        if "experts" in parts and parts[-2] in _EXPERT_NAMES:
            return f"blk.{parts[2]}.{_EXPERT_NAMES[parts[-2]][0]}"
    return hf_name


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return (s.splitlines()[0] if s else type(e).__name__)[:300]


class GGUFFile:
    """One GGUF file: `meta` (key -> python value; token arrays left as reader fields) and its
    tensors by name, memory-mapped."""

    def __init__(self, path):
        self.path = Path(path)
        if self.path.is_dir():
            raise CheckpointError(f"{self.path} is a directory, not a .gguf file")
        if not self.path.is_file():
            raise CheckpointError(f"{self.path} does not exist (expected a .gguf file)")
        try:
            from gguf import GGUFReader

            self._reader = GGUFReader(str(self.path))
        except Exception as e:  # the reader raises ValueError/IndexError/... on corrupt or truncated files
            raise CheckpointError(f"{self.path} is not a readable GGUF file ({_first_line(e)})") from None
        self.fields = self._reader.fields
        self.tensors = {t.name: t for t in self._reader.tensors}
        try:
            self.architecture = str(self.value("general.architecture"))
        except CheckpointError:
            raise CheckpointError(f"{self.path}: general.architecture is missing: not a model GGUF") from None

    def has(self, key: str) -> bool:
        return key in self.fields

    def value(self, key: str, default: Any = None, *, required: bool = True) -> Any:
        """A scalar or string metadata value (arrays of strings come back as lists)."""
        f = self.fields.get(key)
        if f is None:
            if required and default is None:
                raise CheckpointError(f"{self.path}: metadata {key} is missing")
            return default
        try:
            return f.contents()
        except Exception as e:
            raise CheckpointError(f"{self.path}: metadata {key} is unreadable ({_first_line(e)})") from None

    def arch(self, key: str, default: Any = None, *, required: bool = True) -> Any:
        return self.value(f"{self.architecture}.{key}", default, required=required)

    def string_array(self, key: str) -> list[str]:
        f = self.fields.get(key)
        if f is None:
            return []
        return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]

    def int_array(self, key: str) -> list[int]:
        f = self.fields.get(key)
        if f is None:
            return []
        return [int(f.parts[i][0]) for i in f.data]

    def tensor(self, name: str) -> np.ndarray:
        """The tensor `name` dequantised to float32, in numpy (row-major) shape: [out, in] for a
        linear weight, as Hugging Face stores it."""
        from gguf.quants import dequantize

        t = self.tensors[name]
        try:
            arr = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise CheckpointError(f"{self.path}: tensor {name!r} has quantisation type {t.tensor_type.name}, which "
                                  "the gguf package cannot dequantise") from None
        except Exception as e:
            raise CheckpointError(f"{self.path}: cannot read tensor {name!r} ({_first_line(e)})") from None
        want = tuple(int(s) for s in reversed(t.shape))  # GGML lists dimensions innermost first
        return np.asarray(arr, np.float32).reshape(want)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(s) for s in reversed(self.tensors[name].shape))


def open_gguf(path) -> GGUFFile:
    return GGUFFile(path)


def _int(g: GGUFFile, key: str, default: Optional[int] = None) -> int:
    v = g.arch(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) <= 0:
        raise ConfigError(f"{g.path}: {g.architecture}.{key}={v!r} is invalid: expected a positive integer")
    return int(v)


def _float(g: GGUFFile, key: str, default: Optional[float] = None) -> float:
    v = g.arch(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float, np.floating)) or not np.isfinite(v) or v <= 0:
        raise ConfigError(f"{g.path}: {g.architecture}.{key}={v!r} is invalid: expected a positive number")
    return float(v)


def config_from_gguf(g: GGUFFile, dtype: Optional[str] = None) -> ModelConfig:
    """The ModelConfig a GGUF file's metadata describes; `dtype` (default float32, which keeps the
    dequantised weights exact) sets the parameter and compute dtype."""
    arch = g.architecture
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{g.path}: GGUF architecture {arch!r} is not supported (supported: "
                          f"{', '.join(ARCHITECTURES)})")
    if "rope_freqs.weight" in g.tensors:
        raise ConfigError(f"{g.path}: per-dimension rope frequency factors (rope_freqs.weight, Llama 3.1-style "
                          "rope scaling) are not supported")
    scaling = g.arch("rope.scaling.type", "none", required=False)
    if scaling not in ("none", "linear"):
        raise ConfigError(f"{g.path}: rope scaling {scaling!r} is not supported (none, linear)")
    rope = RopeScaling() if scaling == "none" else RopeScaling("linear", factor=_float(g, "rope.scaling.factor"))
    d_model = _int(g, "embedding_length")
    n_heads = _int(g, "attention.head_count")
    n_kv = _int(g, "attention.head_count_kv", n_heads)
    if d_model % n_heads and not g.has(f"{arch}.attention.key_length"):
        raise ConfigError(f"{g.path}: embedding_length {d_model} is not a multiple of head_count {n_heads}")
    head_dim = _int(g, "attention.key_length", d_model // n_heads)
    if _int(g, "attention.value_length", head_dim) != head_dim:
        raise ConfigError(f"{g.path}: attention.value_length differs from key_length: not supported")
    rot = _int(g, "rope.dimension_count", head_dim)
    if rot != head_dim:
        raise ConfigError(f"{g.path}: rope.dimension_count={rot} differs from the head dimension {head_dim}: "
                          "partial rotary embeddings are not supported for this architecture")
    tokens = g.fields.get("tokenizer.ggml.tokens")
    vocab = _int(g, "vocab_size", len(tokens.data) if tokens is not None else None)
    n_experts = int(g.arch("expert_count", 0, required=False) or 0)
    n_layers = _int(g, "block_count")
    kw: dict[str, Any] = {}
    family = ARCHITECTURES[arch]
    if arch == "gemma3":
        kw = _gemma3_fields(g, n_layers, d_model, n_heads, head_dim)
    if n_experts:
        if arch != "llama":
            raise ConfigError(f"{g.path}: an MoE file of architecture {arch!r} is not supported (llama: Mixtral-style)")
        family = "mixtral"
        kw = dict(n_experts=n_experts, n_experts_per_tok=_int(g, "expert_used_count"),
                  moe_d_ff=_int(g, "feed_forward_length"), norm_topk_prob=True)
    dtype = dtype or "float32"
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is invalid: expected one of {', '.join(DTYPES)}")
    try:
        return ModelConfig(
            family=family, vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
            n_kv_heads=n_kv, head_dim=head_dim, d_ff=_int(g, "feed_forward_length"),
            max_seq_len=_int(g, "context_length"), rms_eps=_float(g, "attention.layer_norm_rms_epsilon"),
            rope_theta=_float(g, "rope.freq_base", 10000.0), rope_scaling=rope,
            tie_embeddings="output.weight" not in g.tensors, qkv_bias=(arch == "qwen2"), dtype=dtype,
            param_dtype=dtype, **kw,
        ).validate()
    except ConfigError as e:
        raise ConfigError(f"{g.path}: the metadata gives an invalid model: {e}") from None


def _gemma3_fields(g: GGUFFile, n_layers: int, d_model: int, n_heads: int, head_dim: int) -> dict[str, Any]:
    """The ModelConfig fields of a gemma3 file beyond the common ones, as llama.cpp reads them."""
    window = g.arch("attention.sliding_window", 0, required=False) or 0
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 0:
        raise ConfigError(f"{g.path}: gemma3.attention.sliding_window={window!r} is invalid: expected an integer")
    pattern = g.arch("attention.sliding_window_pattern", _GEMMA3_SWA_PATTERN, required=False)
    if isinstance(pattern, list):  # one flag per layer
        if len(pattern) != n_layers:
            raise ConfigError(f"{g.path}: gemma3.attention.sliding_window_pattern has {len(pattern)} entries for "
                              f"{n_layers} layers")
        sliding = [bool(x) for x in pattern]
    else:
        if isinstance(pattern, bool) or not isinstance(pattern, (int, np.integer)) or pattern <= 0:
            raise ConfigError(f"{g.path}: gemma3.attention.sliding_window_pattern={pattern!r} is invalid")
        sliding = [(i + 1) % int(pattern) != 0 for i in range(n_layers)]
    if not window:
        sliding = [False] * n_layers
    cap = g.arch("final_logit_softcapping", 0.0, required=False) or 0.0
    if isinstance(cap, bool) or not isinstance(cap, (int, float, np.floating)) or not np.isfinite(cap) or cap < 0:
        raise ConfigError(f"{g.path}: gemma3.final_logit_softcapping={cap!r} is invalid")
    return dict(layer_types=tuple("sliding_attention" if s else "full_attention" for s in sliding),
                sliding_window=int(window) if window else None, rope_local_theta=_GEMMA3_LOCAL_ROPE_BASE,
                qk_norm=True, qk_norm_per_head=True, norm_unit_offset=True, post_norms=True,
                mlp_activation="gelu_tanh", scale_embeddings=True,
                query_pre_attn_scalar=float(d_model // n_heads if n_layers == 62 else head_dim),
                final_logit_softcap=float(cap) if cap else None)


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: within each head, rows (0, 2, 4, ..., 1, 3, ...) of the
    Hugging Face layout were stored as interleaved pairs; this restores the half-split order."""
    rows = w.shape[0]
    hd = rows // n_heads
    return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order from the Hugging Face one (the inverse of `unpermute_rows`; the
    tests write GGUF fixtures with it)."""
    rows = w.shape[0]
    hd = rows // n_heads
    return w.reshape(n_heads, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFWeights:
    """A GGUF file's tensors under Hugging Face names: the reader interface
    `safetensors_io.read_params` takes (names, get with a shape check, unexpected, where)."""

    def __init__(self, g: GGUFFile, cfg: ModelConfig):
        self.g, self.cfg = g, cfg
        self.dir = g.path
        self._map: dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]] = {}
        self._cache: dict[str, np.ndarray] = {}
        self.consumed: set[str] = set()
        permuted = g.architecture in _PERMUTED_QK
        shifted = g.architecture == "gemma3"  # norm weights stored as 1 + w

        def same(a):
            return a

        def unshift(a):
            return a - np.float32(1.0)

        def qk(n):
            return (lambda a: unpermute_rows(a, n)) if permuted else same

        for hf, gg in _GLOBAL_NAMES.items():
            if gg in g.tensors:
                self._map[hf] = (gg, unshift if shifted and hf.endswith("norm.weight") else same)
        for i in range(cfg.n_layers):
            for suffix, gg in _layer_names(g.architecture).items():
                name = f"blk.{i}.{gg}"
                if name not in g.tensors:
                    continue
                fix = same
                if shifted and suffix.endswith("norm.weight"):
                    fix = unshift
                elif suffix.startswith("self_attn.q_proj"):
                    fix = qk(cfg.n_heads)
                elif suffix.startswith("self_attn.k_proj"):
                    fix = qk(cfg.n_kv_heads)
                self._map[f"model.layers.{i}.{suffix}"] = (name, fix)
            for e in range(cfg.n_experts):
                for hub, (stacked, single) in _EXPERT_NAMES.items():
                    hf = f"model.layers.{i}.block_sparse_moe.experts.{e}.{hub}.weight"
                    if f"blk.{i}.{stacked}" in g.tensors:
                        self._map[hf] = (f"blk.{i}.{stacked}", (lambda a, e=e: a[e]))
                    elif f"blk.{i}.{single}.{e}.weight" in g.tensors:
                        self._map[hf] = (f"blk.{i}.{single}.{e}.weight", same)

    def names(self) -> set[str]:
        return set(self._map)

    def __contains__(self, name: str) -> bool:
        return name in self._map

    def where(self, name: str) -> str:
        return self.g.path.name

    def _raw(self, gg: str) -> np.ndarray:
        # stacked expert tensors are sliced once per expert: keep the dequantised tensor meanwhile
        if gg not in self._cache:
            arr = self.g.tensor(gg)
            if arr.ndim == 3:
                self._cache[gg] = arr
            return arr
        return self._cache[gg]

    def get(self, name: str, shape) -> np.ndarray:
        shape = tuple(int(s) for s in shape)
        if name not in self._map:
            raise CheckpointError(f"{self.g.path}: tensor {gguf_name(name, self.g.architecture)!r} is missing")
        gg, fix = self._map[name]
        arr = fix(self._raw(gg))
        if tuple(arr.shape) != shape:
            raise CheckpointError(f"{self.g.path}: tensor {gg!r} has shape {list(arr.shape)}, expected "
                                  f"{list(shape)} from the metadata")
        self.consumed.add(gg)
        return arr

    def unexpected(self) -> list[str]:
        return sorted(n for n in self.g.tensors if n not in self.consumed)

    def close(self):
        self._cache.clear()


def load_gguf(path, dtype: Optional[str] = None) -> tuple[ModelConfig, dict, GGUFFile]:
    """(cfg, params, the open file) from a GGUF file, params as numpy arrays in our layout."""
    from m2r2_jax.interop.safetensors_io import read_params

    g = open_gguf(path)
    cfg = config_from_gguf(g, dtype)
    return cfg, read_params(cfg, GGUFWeights(g, cfg)), g


__all__ = ["GGUFFile", "GGUFWeights", "open_gguf", "config_from_gguf", "load_gguf", "permute_rows",
           "unpermute_rows", "ARCHITECTURES"]
