"""Hugging Face safetensors <-> our parameter tree (numpy only; never pickle).

Reading accepts one `model.safetensors`, a sharded checkpoint with `model.safetensors.index.json`,
or several `*.safetensors` files without an index. Hugging Face stores linear weights [out, in];
ours are [in, out]. Per-layer tensors are stacked on a leading [L] axis and per-expert tensors on
[E]. Both expert layouts are read: the hub's per-expert tensors
(`block_sparse_moe.experts.{e}.w1/w2/w3` for Mixtral, `mlp.experts.{e}.gate_proj/up_proj/down_proj`
for Qwen2-MoE and OLMoE; transformers 5 `save_pretrained` writes this layout too) and the fused
in-memory layout of transformers 5 (`mlp.experts.gate_up_proj` [E, 2F, d], `mlp.experts.down_proj`
[E, d, F]). Phi-3's fused `qkv_proj` and `gate_up_proj` are split. Gemma 3's four norms per layer
map to ours as input_layernorm -> attn_norm, post_attention_layernorm -> attn_post_norm,
pre_feedforward_layernorm -> mlp_norm, post_feedforward_layernorm -> mlp_post_norm (elsewhere
post_attention_layernorm is the MLP's pre-norm, our mlp_norm); its zero-centred weights are kept as
they are (`ModelConfig.norm_unit_offset`).

Every problem is one line naming the tensor and file: missing or unexpected tensors (rotary
`inv_freq` buffers are ignored), wrong shapes, unreadable or truncated files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from m2r2_jax.errors import CheckpointError
from m2r2_jax.models.config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_IGNORED = re.compile(r"(^|\.)rotary_emb\.(inv_freq|original_inv_freq)$")  # buffers older checkpoints saved
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # "5GB"


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes  # (slow to import; only when needed)

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype({"float32": np.float32, "float16": np.float16}[name])


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return (s.splitlines()[0] if s else type(e).__name__)[:300]


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------
class WeightReader:
    """Name -> tensor over the safetensors files of one Hugging Face model directory."""

    def __init__(self, hf_dir):
        self.dir = Path(hf_dir)
        self._files: dict[str, Path] = {}  # tensor name -> file
        self._handles: dict[Path, Any] = {}
        self.consumed: set[str] = set()
        for path, wanted in self._weight_files():
            keys = set(self._open(path).keys())
            if wanted is not None:
                missing = sorted(wanted - keys)
                if missing:
                    raise CheckpointError(f"{path}: tensor {missing[0]!r} listed in {INDEX_FILE} is not in the file"
                                          + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
                keys = wanted
            for k in sorted(keys):
                if k in self._files:
                    raise CheckpointError(f"tensor {k!r} appears in both {self._files[k].name} and {path.name}")
                self._files[k] = path

    def _weight_files(self) -> list[tuple[Path, Optional[set]]]:
        d = self.dir
        index = d / INDEX_FILE
        if index.is_file():
            try:
                wm = json.loads(index.read_text())["weight_map"]
                assert isinstance(wm, dict)
            except Exception as e:
                raise CheckpointError(f"{index} is not a valid safetensors index ({_first_line(e)})") from None
            by_file: dict[str, set] = {}
            for name, fname in wm.items():
                by_file.setdefault(fname, set()).add(name)
            out = []
            for fname, names in sorted(by_file.items()):
                p = d / fname
                if not p.is_file():
                    raise CheckpointError(f"{p} (listed in {INDEX_FILE}) is missing")
                out.append((p, names))
            return out
        if (d / SINGLE_FILE).is_file():
            return [(d / SINGLE_FILE, None)]
        files = sorted(d.glob("*.safetensors"))
        if files:
            return [(p, None) for p in files]
        if list(d.glob("*.bin")) or list(d.glob("*.pt")) or list(d.glob("*.pth")):
            raise CheckpointError(f"{d} has only pickle weights (.bin/.pt): convert them to safetensors first "
                                  "(pickle files are never loaded)")
        raise CheckpointError(f"{d} has no *.safetensors weights")

    def _open(self, path: Path):
        h = self._handles.get(path)
        if h is None:
            try:
                h = safe_open(str(path), framework="numpy")
            except Exception as e:
                raise CheckpointError(f"{path}: not a readable safetensors file ({_first_line(e)})") from None
            self._handles[path] = h
        return h

    def names(self) -> set[str]:
        return set(self._files)

    def where(self, name: str) -> str:
        """The file that holds `name`, for error messages."""
        return self._files[name].name

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self._files[name]).get_slice(name).get_shape())

    def get(self, name: str, shape: Iterable[int]) -> np.ndarray:
        """The tensor `name`, checked to have `shape`; marks it consumed."""
        shape = tuple(int(s) for s in shape)
        if name not in self._files:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.dir}")
        path = self._files[name]
        got = self.shape(name)
        if got != shape:
            raise CheckpointError(f"tensor {name!r} in {path.name} has shape {list(got)}, expected {list(shape)} "
                                  "from config.json")
        try:
            arr = self._open(path).get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{path}: cannot read tensor {name!r} ({_first_line(e)})") from None
        self.consumed.add(name)
        return arr

    def unexpected(self) -> list[str]:
        return sorted(n for n in self._files if n not in self.consumed and not _IGNORED.search(n))

    def close(self):
        self._handles.clear()


def _expert_prefix(cfg: ModelConfig, names: set[str], i: int) -> str:
    if cfg.family == "mixtral" and not any(n.startswith(f"model.layers.{i}.mlp.") for n in names):
        return f"model.layers.{i}.block_sparse_moe."
    return f"model.layers.{i}.mlp."


def _norm_names(cfg: ModelConfig) -> dict[str, str]:
    """Our per-layer norm leaves -> their Hugging Face names (under the layer's prefix)."""
    if cfg.post_norms:  # Gemma 2/3: a norm before and after each sub-block
        return {"attn_norm": "input_layernorm.weight", "attn_post_norm": "post_attention_layernorm.weight",
                "mlp_norm": "pre_feedforward_layernorm.weight", "mlp_post_norm": "post_feedforward_layernorm.weight"}
    return {"attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight"}


def _layer_getters(cfg: ModelConfig, r: WeightReader) -> dict[tuple[str, ...], Callable[[int], np.ndarray]]:
    """Our per-layer leaf path -> function(layer) returning that leaf for the layer, our layout."""
    d, H, KV, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q_out, kv_out = H * hd, KV * hd

    def P(i):
        return f"model.layers.{i}."

    def lin(suffix, n_out, n_in):
        return lambda i: r.get(P(i) + suffix, (n_out, n_in)).T

    def vec(suffix, n):
        return lambda i: r.get(P(i) + suffix, (n,))

    g: dict[tuple[str, ...], Callable[[int], np.ndarray]] = {
        (leaf, "scale"): vec(hf, d) for leaf, hf in _norm_names(cfg).items()}
    g[("attn", "o_proj", "kernel")] = lin("self_attn.o_proj.weight", d, q_out)
    if cfg.family == "phi3":
        def qkv(lo, hi):
            return lambda i: r.get(P(i) + "self_attn.qkv_proj.weight", (q_out + 2 * kv_out, d))[lo:hi].T
        g[("attn", "q_proj", "kernel")] = qkv(0, q_out)
        g[("attn", "k_proj", "kernel")] = qkv(q_out, q_out + kv_out)
        g[("attn", "v_proj", "kernel")] = qkv(q_out + kv_out, q_out + 2 * kv_out)
    else:
        for name, n in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            g[("attn", name, "kernel")] = lin(f"self_attn.{name}.weight", n, d)
    if cfg.qkv_bias:
        for name, n in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            g[("attn", name, "bias")] = vec(f"self_attn.{name}.bias", n)
    if cfg.qk_norm:
        g[("attn", "q_norm", "scale")] = vec("self_attn.q_norm.weight", hd if cfg.qk_norm_per_head else q_out)
        g[("attn", "k_norm", "scale")] = vec("self_attn.k_norm.weight", hd if cfg.qk_norm_per_head else kv_out)

    if not cfg.is_moe:
        F = cfg.d_ff
        if cfg.family == "phi3":
            g[("mlp", "gate_proj", "kernel")] = lambda i: r.get(P(i) + "mlp.gate_up_proj.weight", (2 * F, d))[:F].T
            g[("mlp", "up_proj", "kernel")] = lambda i: r.get(P(i) + "mlp.gate_up_proj.weight", (2 * F, d))[F:].T
        else:
            g[("mlp", "gate_proj", "kernel")] = lin("mlp.gate_proj.weight", F, d)
            g[("mlp", "up_proj", "kernel")] = lin("mlp.up_proj.weight", F, d)
        g[("mlp", "down_proj", "kernel")] = lin("mlp.down_proj.weight", d, F)
        return g

    E, F = cfg.n_experts, cfg.moe_d_ff
    names = r.names()

    def pre(i):
        return _expert_prefix(cfg, names, i)

    g[("mlp", "router", "kernel")] = lambda i: r.get(pre(i) + "gate.weight", (E, d)).T

    def experts(kind):
        def get(i):
            p = pre(i) + "experts."
            if p + "gate_up_proj" in names:  # transformers 5 fused layout
                if kind == "down":
                    return np.swapaxes(r.get(p + "down_proj", (E, d, F)), 1, 2)
                w = r.get(p + "gate_up_proj", (E, 2 * F, d))
                return np.swapaxes(w[:, :F] if kind == "gate" else w[:, F:], 1, 2)
            if cfg.family == "mixtral":
                hub = {"gate": "w1", "up": "w3", "down": "w2"}[kind]
            else:
                hub = f"{kind}_proj"
            shape = (d, F) if kind == "down" else (F, d)
            return np.stack([r.get(f"{p}{e}.{hub}.weight", shape).T for e in range(E)])
        return get

    g[("mlp", "experts_gate")] = experts("gate")
    g[("mlp", "experts_up")] = experts("up")
    g[("mlp", "experts_down")] = experts("down")
    if cfg.shared_expert_d_ff:
        S = cfg.shared_expert_d_ff
        g[("mlp", "shared_expert", "gate_proj", "kernel")] = lin("mlp.shared_expert.gate_proj.weight", S, d)
        g[("mlp", "shared_expert", "up_proj", "kernel")] = lin("mlp.shared_expert.up_proj.weight", S, d)
        g[("mlp", "shared_expert", "down_proj", "kernel")] = lin("mlp.shared_expert.down_proj.weight", d, S)
        g[("mlp", "shared_expert_gate", "kernel")] = lin("mlp.shared_expert_gate.weight", 1, d)
    return g


def _flatten(tree, prefix=()) -> list[tuple[tuple[str, ...], Any]]:
    out = []
    for k in sorted(tree):
        v = tree[k]
        if isinstance(v, dict):
            out += _flatten(v, prefix + (k,))
        else:
            out.append((prefix + (k,), v))
    return out


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def abstract_params(cfg: ModelConfig):
    """Shapes and dtypes of our parameter tree for `cfg` (no memory allocated)."""
    import jax

    from m2r2_jax.models.transformer import init_params

    return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))


def read_params(cfg: ModelConfig, hf_dir, check_layout: bool = True) -> dict:
    """Read a Hugging Face checkpoint into our parameter tree: numpy arrays in `cfg.param_dtype`
    (norm scales float32), laid out exactly as `init_params` lays them out. `hf_dir` is a model
    directory or a reader serving tensors under Hugging Face names (`gguf_io.GGUFWeights`). Checkpoint problems
    raise `CheckpointError` before jax is imported; `check_layout` finally compares the tree with
    `init_params` (a guard against this module and `models/layers.py` drifting apart)."""
    pd = _np_dtype(cfg.param_dtype)

    def dt(path):
        return np.dtype(np.float32) if path[-1] == "scale" else pd

    r = hf_dir if hasattr(hf_dir, "unexpected") else WeightReader(hf_dir)
    try:
        d, V = cfg.d_model, cfg.vocab_size
        params: dict = {}
        emb = r.get("model.embed_tokens.weight", (V, d))
        params["embed"] = {"embedding": emb.astype(pd)}
        params["final_norm"] = {"scale": r.get("model.norm.weight", (d,)).astype(np.float32)}
        if cfg.tie_embeddings:
            if "lm_head.weight" in r:
                head = r.get("lm_head.weight", (V, d))
                if not np.array_equal(head, emb):
                    raise CheckpointError("config.json says tie_word_embeddings=true but lm_head.weight differs from "
                                          "model.embed_tokens.weight")
        else:
            head = r.get("lm_head.weight", (V, d))
            params["lm_head"] = {"kernel": np.ascontiguousarray(head.T).astype(pd)}

        layers: dict = {}
        for path, get in sorted(_layer_getters(cfg, r).items()):
            first = get(0)
            out = np.empty((cfg.n_layers,) + first.shape, dt(path))
            out[0] = first
            for i in range(1, cfg.n_layers):
                out[i] = get(i)
            _set(layers, path, out)
        params["layers"] = layers

        extra = r.unexpected()
        if extra:
            more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
            raise CheckpointError(f"unexpected tensor {extra[0]!r} in {r.where(extra[0])}{more}: the "
                                  f"checkpoint does not match its configuration ({cfg.family})")
    finally:
        r.close()
    if check_layout:
        want = {p: (tuple(a.shape), np.dtype(a.dtype)) for p, a in _flatten(abstract_params(cfg))}
        got = {p: (tuple(a.shape), a.dtype) for p, a in _flatten(params)}
        if want != got:  # not a user error: this module and models/layers.py disagree
            diff = sorted(set(want.items()) ^ set(got.items()))
            raise RuntimeError(f"parameter tree mismatch with init_params: {diff[:4]}")
    return params


# --------------------------------------------------------------------------------------------
# Writing (hub layout)
# --------------------------------------------------------------------------------------------
def params_to_hf(cfg: ModelConfig, params, dtype: Optional[str] = None) -> dict[str, np.ndarray]:
    """Our parameter tree -> Hugging Face tensor names in the hub layout ([out, in] weights,
    per-expert tensors, Phi-3 fused qkv/gate_up), every tensor in `dtype` (default
    `cfg.param_dtype`; our float32 norm scales included, as hub checkpoints use one dtype)."""
    import jax

    p = jax.tree.map(np.asarray, jax.device_get(params))
    want = _np_dtype(dtype or cfg.param_dtype)
    out: dict[str, np.ndarray] = {}

    def put(name, arr):
        out[name] = np.ascontiguousarray(arr, dtype=want)

    put("model.embed_tokens.weight", p["embed"]["embedding"])
    L = p["layers"]
    for i in range(cfg.n_layers):
        P = f"model.layers.{i}."
        at = L["attn"]
        for leaf, hf in _norm_names(cfg).items():
            put(P + hf, L[leaf]["scale"][i])
        if cfg.family == "phi3":
            put(P + "self_attn.qkv_proj.weight", np.concatenate(
                [at[n]["kernel"][i].T for n in ("q_proj", "k_proj", "v_proj")], axis=0))
        else:
            for n in ("q_proj", "k_proj", "v_proj"):
                put(P + f"self_attn.{n}.weight", at[n]["kernel"][i].T)
        if cfg.qkv_bias:
            for n in ("q_proj", "k_proj", "v_proj"):
                put(P + f"self_attn.{n}.bias", at[n]["bias"][i])
        put(P + "self_attn.o_proj.weight", at["o_proj"]["kernel"][i].T)
        if cfg.qk_norm:
            put(P + "self_attn.q_norm.weight", at["q_norm"]["scale"][i])
            put(P + "self_attn.k_norm.weight", at["k_norm"]["scale"][i])
        m = L["mlp"]
        if not cfg.is_moe:
            if cfg.family == "phi3":
                put(P + "mlp.gate_up_proj.weight",
                    np.concatenate([m["gate_proj"]["kernel"][i].T, m["up_proj"]["kernel"][i].T], axis=0))
            else:
                put(P + "mlp.gate_proj.weight", m["gate_proj"]["kernel"][i].T)
                put(P + "mlp.up_proj.weight", m["up_proj"]["kernel"][i].T)
            put(P + "mlp.down_proj.weight", m["down_proj"]["kernel"][i].T)
            continue
        mp = P + ("block_sparse_moe." if cfg.family == "mixtral" else "mlp.")
        put(mp + "gate.weight", m["router"]["kernel"][i].T)
        names = {"gate": "w1", "up": "w3", "down": "w2"} if cfg.family == "mixtral" else \
            {k: f"{k}_proj" for k in ("gate", "up", "down")}
        for e in range(cfg.n_experts):
            for kind in ("gate", "up", "down"):
                put(f"{mp}experts.{e}.{names[kind]}.weight", m[f"experts_{kind}"][i, e].T)
        if cfg.shared_expert_d_ff:
            se = m["shared_expert"]
            for n in ("gate_proj", "up_proj", "down_proj"):
                put(P + f"mlp.shared_expert.{n}.weight", se[n]["kernel"][i].T)
            put(P + "mlp.shared_expert_gate.weight", m["shared_expert_gate"]["kernel"][i].T)
    put("model.norm.weight", p["final_norm"]["scale"])
    if not cfg.tie_embeddings:
        put("lm_head.weight", p["lm_head"]["kernel"].T)
    return out


def parse_size(size: Union[int, str]) -> int:
    """Bytes from an int or '500MB' / '2GiB' / '10KB' (decimal for KB/MB/GB, binary for KiB/MiB/GiB)."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(size), re.IGNORECASE)
        if not m:
            raise CheckpointError(f"max shard size {size!r} is invalid: expected bytes or e.g. '500MB', '2GiB'")
        unit = (m.group(2) or "B").upper()
        mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
        n = int(float(m.group(1)) * mult)
    if n <= 0:
        raise CheckpointError(f"max shard size {size!r} is invalid: expected a positive size")
    return n


def write_safetensors(tensors: dict[str, np.ndarray], out_dir, max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE
                      ) -> list[Path]:
    """Write `tensors` as `model.safetensors`, or as `model-0000i-of-0000n.safetensors` shards with
    `model.safetensors.index.json` when they exceed `max_shard_size` (a tensor larger than the limit
    gets a shard of its own). Returns the files written."""
    limit = parse_size(max_shard_size)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in tensors.items():
        if shards[-1] and size + arr.nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / SINGLE_FILE), metadata=meta)
        return [out_dir / SINGLE_FILE]
    n = len(shards)
    files, weight_map = [], {}
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata=meta)
        files.append(out_dir / fname)
        weight_map.update({name: fname for name in shard})
    total = int(sum(a.nbytes for a in tensors.values()))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    files.append(out_dir / INDEX_FILE)
    return files


__all__ = ["WeightReader", "read_params", "params_to_hf", "write_safetensors", "parse_size", "abstract_params",
           "INDEX_FILE", "SINGLE_FILE", "DEFAULT_MAX_SHARD_SIZE"]
