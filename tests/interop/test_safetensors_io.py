"""Reading and writing safetensors: shards, both expert layouts, dtypes, and one-line errors."""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from hf_helpers import assert_close, build_hf, hf_logits, our_logits, random_tokens, save_hf, torch

from m2r2_jax.errors import CheckpointError
from m2r2_jax.interop.convert import load_hf, write_hf
from m2r2_jax.interop.safetensors_io import INDEX_FILE, parse_size, write_safetensors


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[prefix + k] = v
    return out


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "llama"
    model = build_hf("llama_linear")
    save_hf(model, d)
    return d, model


def _rewrite(src, dst, edit):
    """Copy a single-file checkpoint, applying edit(tensors) -> tensors."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(edit(load_file(str(src / "model.safetensors"))), str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return dst


def test_sharded_checkpoint(tmp_path):
    model = build_hf("mistral_sliding")
    save_hf(model, tmp_path / "hf", max_shard_size="40KB")
    files = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert len(files) > 2 and (tmp_path / "hf" / INDEX_FILE).is_file()
    cfg, params = load_hf(tmp_path / "hf")
    tokens = random_tokens(cfg.vocab_size)
    assert_close(our_logits(cfg, params, tokens), hf_logits(model, tokens))


@pytest.mark.parametrize("case", ["mixtral", "olmoe"])
def test_fused_expert_layout(case, tmp_path):
    """transformers 5 keeps experts fused in memory (gate_up_proj [E, 2F, d], down_proj [E, d, F]);
    a checkpoint in that layout reads to the same parameters as the hub's per-expert layout."""
    save_hf(build_hf(case), tmp_path / "hub")
    _, ref = load_hf(tmp_path / "hub")

    def fuse(t):
        out = {}
        layers = sorted({int(k.split(".")[2]) for k in t if k.startswith("model.layers.")})
        hub = ("w1", "w3", "w2") if case == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        for k, v in t.items():
            if ".experts." not in k:
                out[k.replace(".block_sparse_moe.", ".mlp.")] = v
        for i in layers:
            p = f"model.layers.{i}." + ("block_sparse_moe." if case == "mixtral" else "mlp.")
            n = len([k for k in t if k.startswith(p + "experts.") and k.endswith(f".{hub[0]}.weight")])
            g, u, d = ([t[f"{p}experts.{e}.{h}.weight"] for e in range(n)] for h in hub)
            out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.stack([np.concatenate([a, b]) for a, b in zip(g, u)])
            out[f"model.layers.{i}.mlp.experts.down_proj"] = np.stack(d)
        return out

    _rewrite(tmp_path / "hub", tmp_path / "fused", fuse)
    _, got = load_hf(tmp_path / "fused")
    a, b = _flat(ref), _flat(got)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_bfloat16(tmp_path):
    model = build_hf("qwen2_bias_sliding")
    tokens = random_tokens(97)
    ref = hf_logits(model, tokens)
    save_hf(model.to(torch.bfloat16), tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    cfg, params = load_hf(tmp_path / "hf")  # the recorded dtype is the default
    assert cfg.param_dtype == "bfloat16" and str(params["layers"]["attn"]["q_proj"]["kernel"].dtype) == "bfloat16"
    cfg32, params32 = load_hf(tmp_path / "hf", dtype="float32")
    assert cfg32.param_dtype == "float32"
    # bf16 weights, f32 compute: only the weight rounding separates us from the f32 reference
    assert np.abs(our_logits(cfg32, params32, tokens) - ref).max() < 0.1
    assert np.abs(our_logits(cfg, params, tokens) - ref).max() < 0.5
    # exported back in one dtype (our norm scales are float32 in memory), bit-exact
    write_hf(cfg, params, tmp_path / "out")
    back = load_file(str(tmp_path / "out" / "model.safetensors"))
    orig = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert back.keys() == orig.keys()
    for k in orig:
        assert back[k].dtype == orig[k].dtype and np.array_equal(back[k], orig[k]), k


def test_rotary_buffers_ignored_and_tied_head(tmp_path, llama_dir):
    src, _ = llama_dir
    d = _rewrite(src, tmp_path / "inv", lambda t: t | {"model.layers.0.self_attn.rotary_emb.inv_freq":
                                                       np.ones(4, np.float32)})
    load_hf(d)
    tied = tmp_path / "tied"
    save_hf(build_hf("llama_llama3_tied"), tied)
    cfg, _ = load_hf(tied)
    assert cfg.tie_embeddings
    # a tied checkpoint that also stores lm_head: accepted when identical, refused when not
    same = _rewrite(tied, tmp_path / "same", lambda t: t | {"lm_head.weight": t["model.embed_tokens.weight"]})
    load_hf(same)
    differ = _rewrite(tied, tmp_path / "differ", lambda t: t | {"lm_head.weight": t["model.embed_tokens.weight"] + 1})
    with pytest.raises(CheckpointError, match="lm_head.weight differs"):
        load_hf(differ)


def _drop(name):
    return lambda t: {k: v for k, v in t.items() if k != name}


BAD = {
    "missing": (_drop("model.layers.1.self_attn.k_proj.weight"), "'model.layers.1.self_attn.k_proj.weight' is missing"),
    "missing head": (_drop("lm_head.weight"), "'lm_head.weight' is missing"),
    "extra": (lambda t: t | {"model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)},
              "unexpected tensor 'model.layers.0.mlp.extra.weight'"),
    "extra layer": (lambda t: t | {"model.layers.2.input_layernorm.weight": np.zeros(48, np.float32)},
                    "unexpected tensor 'model.layers.2.input_layernorm.weight'"),
    "shape": (lambda t: t | {"model.layers.0.mlp.up_proj.weight": np.zeros((64, 47), np.float32)},
              "'model.layers.0.mlp.up_proj.weight' in model.safetensors has shape [64, 47], expected [64, 48]"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_tensors(name, tmp_path, llama_dir):
    edit, needle = BAD[name]
    d = _rewrite(llama_dir[0], tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as e:
        load_hf(d)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_files(damage, tmp_path, llama_dir):
    d = _rewrite(llama_dir[0], tmp_path / "bad", lambda t: t)
    f = d / "model.safetensors"
    if damage == "truncate":
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) - 64)
    elif damage == "garbage":
        f.write_bytes(os.urandom(4096))
    else:
        f.write_bytes(b"")
    with pytest.raises(CheckpointError) as e:
        load_hf(d)
    assert "model.safetensors: not a readable safetensors file" in str(e.value) and "\n" not in str(e.value)


def test_directory_problems(tmp_path, llama_dir):
    with pytest.raises(CheckpointError, match="not a directory"):
        load_hf(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        load_hf(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text((llama_dir[0] / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_hf(tmp_path / "empty")
    (tmp_path / "empty" / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(CheckpointError, match="pickle"):
        load_hf(tmp_path / "empty")
    sharded = tmp_path / "sharded"
    save_hf(build_hf("llama_linear"), sharded, max_shard_size="40KB")
    victim = sorted(sharded.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"{victim.name} \\(listed in {INDEX_FILE}\\) is missing"):
        load_hf(sharded)


def test_write_safetensors_sharding(tmp_path):
    tensors = {f"t{i}": np.full((10, 10), i, np.float32) for i in range(7)}  # 400 bytes each
    files = write_safetensors(tensors, tmp_path / "one")
    assert [f.name for f in files] == ["model.safetensors"]
    files = write_safetensors(tensors, tmp_path / "many", max_shard_size=1000)
    names = [f.name for f in files]
    assert names[-1] == INDEX_FILE and names[0] == "model-00001-of-00004.safetensors" and len(names) == 5
    index = json.loads((tmp_path / "many" / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == 2800 and len(index["weight_map"]) == 7
    back = {}
    for f in files[:-1]:
        assert f.stat().st_size <= 1000 + 200  # data + header
        back.update(load_file(str(f)))
    assert all(np.array_equal(back[k], v) for k, v in tensors.items())
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size(123) == 123
    with pytest.raises(CheckpointError):
        parse_size("lots")
