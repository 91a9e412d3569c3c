"""`m2r2 convert / logits / export` end to end in subprocesses; bad inputs give exit 2 and one line."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from hf_helpers import assert_close, build_hf, hf_logits, random_tokens, save_hf, transformers

M2R2 = str(Path(sys.executable).with_name("m2r2"))


def _start(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.Popen([M2R2, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def _finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _run(*args):
    return _finish(_start(*args))


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    model = build_hf("olmoe")
    save_hf(model, root / "hf")
    (root / "hf" / "tokenizer.model").write_bytes(b"not really sentencepiece")
    return root, model


def test_convert_logits_export(hf):
    root, model = hf
    rc, out, err = _run("convert", "--hf", root / "hf", "--out", root / "ckpt")
    assert rc == 0, err
    assert "olmoe" in out and (root / "ckpt" / "tokenizer" / "tokenizer.model").is_file()
    tokens = random_tokens(97, shape=(3, 11))
    np.save(root / "tokens.npy", tokens)
    rc, out, err = _run("logits", "--checkpoint", root / "ckpt", "--tokens", root / "tokens.npy",
                        "--out", root / "logits.npy")
    assert rc == 0, err
    logits = np.load(root / "logits.npy")
    assert logits.dtype == np.float32 and logits.shape == (3, 11, 97)
    assert_close(logits, hf_logits(model, tokens))
    assert not [p for p in root.iterdir() if ".tmp-" in p.name]
    rc, out, err = _run("export", "--checkpoint", root / "ckpt", "--out", root / "exported", "--max_shard_size", "40KB")
    assert rc == 0, err
    again = transformers.AutoModelForCausalLM.from_pretrained(root / "exported", attn_implementation="eager")
    assert_close(hf_logits(again.eval(), tokens), hf_logits(model, tokens), tol=1e-6)


def _bad_hf(root, name, edit=None, config_edit=None):
    d = root / name
    d.mkdir()
    cfg = (root / "hf" / "config.json").read_text()
    (d / "config.json").write_text(config_edit(cfg) if config_edit else cfg)
    tensors = load_file(str(root / "hf" / "model.safetensors"))
    save_file(edit(tensors) if edit else tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def test_bad_inputs(hf, tmp_path):
    root, _ = hf
    k = "model.layers.0.self_attn.q_norm.weight"
    dirs = {
        "architecture": _bad_hf(root, "b_arch", config_edit=lambda c: c.replace('"olmoe"', '"gpt_neox"')
                                .replace("OlmoeForCausalLM", "GPTNeoXForCausalLM")),
        "missing tensor": _bad_hf(root, "b_missing", lambda t: {n: v for n, v in t.items() if n != k}),
        "extra tensor": _bad_hf(root, "b_extra", lambda t: t | {"model.layers.0.foo.weight": np.zeros(2, np.float32)}),
        "shape": _bad_hf(root, "b_shape", lambda t: t | {k: np.zeros(7, np.float32)}),
        "corrupt": _bad_hf(root, "b_corrupt"),
    }
    (dirs["corrupt"] / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    np.save(tmp_path / "int64.npy", np.zeros((1, 4), np.int64))
    np.save(tmp_path / "rank1.npy", np.zeros(4, np.int32))
    np.save(tmp_path / "oov.npy", np.full((1, 4), 97, np.int32))
    np.save(tmp_path / "long.npy", np.zeros((1, 200), np.int32))
    (tmp_path / "junk.npy").write_bytes(b"junk")
    needles = {"architecture": "gpt_neox", "missing tensor": k, "extra tensor": "model.layers.0.foo.weight",
               "shape": k, "corrupt": "model.safetensors", "int64.npy": "int32", "rank1.npy": "rank 2",
               "oov.npy": "97", "long.npy": "max_seq_len", "junk.npy": "junk.npy", "absent.npy": "not found"}
    procs = {name: _start("convert", "--hf", d, "--out", tmp_path / f"ck_{i}") for i, (name, d) in
             enumerate(dirs.items())}
    # logits input errors need a checkpoint, but not a real one: they are found before its weights are read
    ck = tmp_path / "ckpt"
    ck.mkdir()
    from m2r2_jax.interop.hf_config import load_hf_config

    (ck / "model_config.json").write_text(load_hf_config(root / "hf").to_json())
    for f in ("int64.npy", "rank1.npy", "oov.npy", "long.npy", "junk.npy", "absent.npy"):
        procs[f] = _start("logits", "--checkpoint", ck, "--tokens", tmp_path / f, "--out", tmp_path / "o.npy")
    procs["no checkpoint"] = _start("logits", "--checkpoint", tmp_path / "nothing", "--tokens", tmp_path / "oov.npy",
                                    "--out", tmp_path / "o.npy")
    needles["no checkpoint"] = "model_config.json"
    for name, proc in procs.items():
        rc, out, err = _finish(proc)
        lines = err.strip().splitlines()
        assert rc == 2, (name, err)
        assert len(lines) == 1 and lines[0].startswith("m2r2: error:"), (name, err)
        assert "Traceback" not in err and needles[name] in lines[0], (name, err)
    assert not (tmp_path / "o.npy").exists() and not list(tmp_path.glob("ck_*"))
