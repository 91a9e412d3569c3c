"""GGUF fixtures for the interop tests: tiny random transformers models written as GGUF files the
way llama.cpp's converter writes them (llama.cpp tensor names, Q/K rows reordered for the llama
architecture, 1-D tensors in F32, quantised weights), and small byte-level BPE vocabularies
trained here with `tokenizers` under each supported pre-tokenizer."""

from __future__ import annotations

import gzip
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from m2r2_jax.interop.gguf_io import permute_rows  # noqa: E402

CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
          "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
          "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
          "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
          "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight",
          "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def corpus_text(chars: int = 200_000) -> str:
    raw = resources.files("m2r2_jax.data").joinpath("embedded", "shakespeare.txt.gz").read_bytes()
    text = gzip.decompress(raw).decode("utf-8")[:chars]
    # numbers and mixed scripts, so merges over digits and multi-byte characters exist
    extra = " ".join(f"{i} {i * 37} {i * 1013}" for i in range(400)) + " naïve café 日本語 don't I'll "
    return text + "\n" + extra * 3


def train_bpe(pre: str, vocab_size: int = 600):
    """(tokenizers.Tokenizer trained with the pre-tokenizer `pre` means, tokens, merges, types)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from m2r2_jax.interop.gguf_tokenizer import _LLAMA3_PATTERN, _QWEN2_PATTERN, PRE_TOKENIZERS

    kind = PRE_TOKENIZERS[pre]
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "gpt2":
        tok.pre_tokenizer = byte_level
    elif kind == "digits+gpt2":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        pattern = _LLAMA3_PATTERN if kind == "llama3" else _QWEN2_PATTERN
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CONTROL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_text().splitlines(keepends=True), trainer)
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    import json

    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(tok.to_str())["model"]["merges"]]
    types = [3 if t in CONTROL else 1 for t in tokens]
    return tok, tokens, merges, types


def _quantise(arr: np.ndarray, qtype):
    from gguf import GGMLQuantizationType as Q

    arr = np.ascontiguousarray(arr, np.float32)
    if qtype == Q.F32 or arr.ndim == 1:  # llama.cpp keeps 1-D tensors (norms, biases) in F32
        return arr, None
    if qtype == Q.F16:
        return arr.astype(np.float16), None
    return gguf.quants.quantize(arr, qtype), qtype


class AsTransformers:
    """Weights in Hugging Face names (e.g. `params_to_hf` of ours) in the shape write_gguf reads
    from a transformers model (its config's attributes, a state dict of tensors), so building a
    GGUF file needs no torch."""

    class _Tensor:
        def __init__(self, a):
            self.a = np.asarray(a, np.float32)

        def detach(self):
            return self

        def float(self):
            return self

        def numpy(self):
            return self.a

    def __init__(self, config: dict, tensors: dict):
        from types import SimpleNamespace

        self.config = SimpleNamespace(**config)
        self.tensors = tensors

    def state_dict(self):
        return {k: self._Tensor(v) for k, v in self.tensors.items()}


def write_gguf(path, model=None, *, arch: str = "llama", qtype="F32", tokenizer=None, pre: str = "default",
               chat_template: str | None = CHATML, meta: dict | None = None, skip_tensors=(), extra_tensors=None,
               tokenizer_model: str = "gpt2"):
    """Write `model` (a transformers causal LM of the llama / mistral / qwen2 / mixtral families) as
    a GGUF file of architecture `arch` with weights in `qtype` and, when given, the vocabulary of
    `tokenizer` (train_bpe's tuple). `meta` overrides or adds metadata keys; `skip_tensors` leaves
    GGUF tensors out, `extra_tensors` (name -> (array, qtype name)) adds some."""
    from gguf import GGMLQuantizationType as Q

    qtype = getattr(Q, qtype)
    w = gguf.GGUFWriter(str(path), arch)
    tensors: dict = {}
    if model is not None:
        c = model.config
        n_heads, n_kv = c.num_attention_heads, c.num_key_value_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // n_heads
        w.add_block_count(c.num_hidden_layers)
        w.add_context_length(c.max_position_embeddings)
        w.add_embedding_length(c.hidden_size)
        w.add_feed_forward_length(c.intermediate_size)
        w.add_head_count(n_heads)
        w.add_head_count_kv(n_kv)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_dimension_count(head_dim)
        rope = getattr(c, "rope_parameters", None) or {}
        w.add_rope_freq_base(float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))))
        w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
        w.add_vocab_size(c.vocab_size)
        n_experts = getattr(c, "num_local_experts", 0) or 0
        if n_experts:
            w.add_expert_count(n_experts)
            w.add_expert_used_count(c.num_experts_per_tok)
        sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
        permute = arch == "llama"
        tensors["token_embd.weight"] = sd["model.embed_tokens.weight"]
        tensors["output_norm.weight"] = sd["model.norm.weight"]
        if not c.tie_word_embeddings:
            tensors["output.weight"] = sd["lm_head.weight"]
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            for hf, gg in _LAYER.items():
                if p + hf not in sd:
                    continue
                a = sd[p + hf]
                if permute and hf.startswith("self_attn.q_proj"):
                    a = permute_rows(a, n_heads)
                elif permute and hf.startswith("self_attn.k_proj"):
                    a = permute_rows(a, n_kv)
                tensors[f"blk.{i}.{gg}"] = a
            if n_experts:
                tensors[f"blk.{i}.ffn_gate_inp.weight"] = sd[p + "mlp.gate.weight"]
                gate_up = sd[p + "mlp.experts.gate_up_proj"]  # transformers 5: [E, 2F, d]
                f = gate_up.shape[1] // 2
                tensors[f"blk.{i}.ffn_gate_exps.weight"] = gate_up[:, :f]
                tensors[f"blk.{i}.ffn_up_exps.weight"] = gate_up[:, f:]
                tensors[f"blk.{i}.ffn_down_exps.weight"] = sd[p + "mlp.experts.down_proj"]
    if tokenizer is not None:
        _, tokens, merges, types = tokenizer
        w.add_tokenizer_model(tokenizer_model)
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(False)
        if chat_template is not None:
            w.add_chat_template(chat_template)
    for key, value in (meta or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, int(value))
    for name, arr in tensors.items():
        if name in skip_tensors:
            continue
        data, raw = _quantise(arr, qtype)
        w.add_tensor(name, data, raw_dtype=raw)
    for name, (arr, q) in (extra_tensors or {}).items():
        w.add_tensor(name, arr, raw_dtype=getattr(Q, q))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
