"""The main job on a pretrained model, end to end on a tiny GGUF file: convert, the distillation
data (the base's own chat answers), a few distillation steps with a recipe, then every
measurement side by side on MT-Bench prompts rendered with the chat template. The shipped M2R2
parameters load in their portable form and are refused on any other base."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "interop"))  # the GGUF fixtures
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "decoding"))  # numpy-drawn M2R2 parameters

from m2r2_jax import pretrained  # noqa: E402
from m2r2_jax.errors import CheckpointError, ConfigError  # noqa: E402
from m2r2_jax.m2r2.checkpoint import export_portable, load_m2r2, save_m2r2  # noqa: E402
from m2r2_jax.m2r2.config import M2R2Config  # noqa: E402

from conftest import cpu_xla_flags, tiny_config  # noqa: E402

# The tiny_dense recipe distils on the embedded corpus: its held-out split (5% of it) is plenty for
# 3 + 2 steps, and tokenizing the whole corpus with the GGUF's BPE took ~11 s
RECIPE = {"train.steps": 3, "train.warmup_steps": 1, "train.batch_size": 8, "train.checkpoint_every": 3,
          "router_train.steps": 2, "router_train.warmup_steps": 1, "router_train.batch_size": 8,
          "router_train.checkpoint_every": 2, "data.seq_len": 32, "data.split": "heldout"}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny random Llama (4 layers, d_model 64, head_dim 16, rope theta 500) with a 300-piece
    byte-level BPE vocabulary, as a Q8_0 GGUF file. The weights are drawn with numpy in Hugging Face
    names, as a randomly initialised transformers model would hold them (norm scales 1 + 0.2 N(0, 1),
    the rest 0.15 N(0, 1)): importing torch and transformers to make them cost ~7 s."""
    gh = pytest.importorskip("gguf_helpers")
    from m2r2_jax.interop.hf_config import hf_config_dict
    from m2r2_jax.interop.safetensors_io import params_to_hf
    from m2r2_jax.models.config import ModelConfig
    from m2r2_jax.models.transformer import init_params

    vocab = gh.train_bpe("default", 300)
    cfg = ModelConfig(family="llama", vocab_size=len(vocab[1]), d_model=64, n_layers=4, n_heads=4, n_kv_heads=2,
                      head_dim=16, d_ff=64, max_seq_len=512, rope_theta=500.0, rms_eps=1e-5).validate()
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    names = params_to_hf(cfg, jax.tree.map(lambda a: np.zeros(a.shape, np.float32), shapes))
    rng = np.random.default_rng(0)
    tensors = {k: (1.0 + 0.2 * rng.standard_normal(v.shape) if "norm" in k else 0.15 * rng.standard_normal(v.shape))
               for k, v in names.items()}
    model = gh.AsTransformers(hf_config_dict(cfg), tensors)
    return gh.write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", model, qtype="Q8_0", tokenizer=vocab)


# The main job below is nearly all compiling (~160 programs), so it runs in a Python process of its
# own started with XLA:CPU's faster-compiling emitters (tests/conftest.py OLD_EMITTERS: only a
# process's XLA_FLAGS choose them): the same run_pretrained_demo call, whose return value the
# process prints as JSON.
DEMO = """
import json, sys
from m2r2_jax.bench.demo_pretrained import DemoModel, run_pretrained_demo

out, gguf, spec, recipe = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
report = run_pretrained_demo(out, budget_name="tiny", distill=True, gguf=gguf, spec=DemoModel(**spec),
                             recipe_overrides=recipe)
print(json.dumps(report))
"""


def test_distill_and_measure_from_a_gguf_file(tmp_path, tiny_gguf):
    spec = dict(name="tiny-gguf", recipe="tiny_dense", data_max_new_tokens=12, data_max_prompts=3,
                draft_vocab_size=64)
    r = subprocess.run([sys.executable, "-c", DEMO, str(tmp_path / "demo"), str(tiny_gguf), json.dumps(spec),
                        json.dumps(RECIPE)], capture_output=True, text=True, timeout=900, cwd=tmp_path,
                       env=dict(os.environ, XLA_FLAGS=cpu_xla_flags(1, old_emitters=True)))
    assert r.returncode == 0, r.stderr[-4000:]
    report = json.loads(r.stdout.splitlines()[-1])
    arts = tmp_path / "demo" / "artifacts"
    rows = [json.loads(x) for x in next(arts.glob("distill_data-*")).joinpath("answers.jsonl").read_text().splitlines()]
    assert 6 <= len(rows) <= 9 and all("<|im_start|>assistant\n" in r["text"] for r in rows)  # chat template applied
    assert {r["set"] for r in rows} == {"self_instruct", "koala", "wizardlm"}
    summary = report["models"]["m2r2"]["recipe"]["distill_summary"]
    assert summary["stream"]["step"] == 3 and summary["router"]["step"] == 2
    assert summary["base_fingerprint_after"] == report["base"]["fingerprint"]
    # ... and in the form m2r2_jax/pretrained ships, which loads onto that base only
    from m2r2_jax.models.checkpoint import load_config

    shipped = tmp_path / "demo" / "shipped" / "tiny-gguf"
    base_dir = next(arts.glob("base-*")) / "model"
    assert json.loads((shipped / "recipe.json").read_text())["base_fingerprint"] == report["base"]["fingerprint"]
    load_m2r2(shipped, load_config(base_dir), report["base"]["fingerprint"])

    base = report["base"]
    assert base["name"] == "tiny-gguf" and math.isfinite(base["heldout_perplexity"]) and base["heldout_perplexity"] > 1
    assert 0 < base["distinct_token_fraction"] <= 1
    spec_rec = report["speculative"]
    assert set(spec_rec) == {"ar", "m2r2_spec", "distance_spec"}
    for m in ("m2r2_spec", "distance_spec"):
        assert spec_rec[m]["identical_to_ar"] is True  # lossless on the real pipeline's prompts
        assert spec_rec[m]["gamma"] == 3
    assert report["draft_vocab"]["size"] == 64 and 0 < report["draft_vocab"]["coverage_of_ar_answers"] <= 1
    assert report["prompts"] == {"set": "mt_bench", "n": 2, "chat_template": True}
    assert set(report["speculative_sampled"]) >= {"ar", "m2r2_spec", "distance_spec", "temperature"}
    assert [r["threshold"] for r in report["early_exit"]["m2r2_exit"]] == [0.9]
    al = report["alignment"]
    assert len(al["fast_agreement"]) == len(al["fast_cost"]) and al["tokens"] >= 64
    assert set(report["targets"]) >= {"m2r2_spec_speedup_ge_1.5", "fast_above_slow_at_equal_compute"}
    written = json.loads((tmp_path / "demo" / "report.json").read_text())
    assert json.dumps(written, sort_keys=True) == json.dumps(report, sort_keys=True)  # NaN-safe equality
    assert (tmp_path / "demo" / "alignment.png").is_file()


def test_a_bad_recipe_override_is_one_line(tmp_path, tiny_gguf):
    from m2r2_jax.bench.demo_pretrained import DemoModel, run_pretrained_demo

    spec = DemoModel("tiny-gguf", "tiny_dense", data_max_new_tokens=4, data_max_prompts=1)
    with pytest.raises(ConfigError, match="recipe override 'train.stepz': no field 'stepz'"):
        run_pretrained_demo(tmp_path, distill=True, gguf=str(tiny_gguf), spec=spec, recipe_overrides={"train.stepz": 1})
    with pytest.raises(ConfigError, match="--model='nosuch' is invalid"):
        run_pretrained_demo(tmp_path, model="nosuch")
    with pytest.raises(ConfigError, match="GGUF file .* does not exist"):
        run_pretrained_demo(tmp_path, gguf=str(tmp_path / "missing.gguf"))


def _tiny_m2r2(tmp_path):
    cfg = tiny_config()
    mcfg = M2R2Config(branch_layer=1, rate=2, lora_rank=4).validate(cfg)
    # M2R2 parameters of the real tree's shapes, plus noise on every leaf, all drawn with numpy (the
    # real initialisers compile many small programs)
    from decoding_helpers import random_m2r2

    rng = np.random.default_rng(1)
    m2r2 = jax.tree.map(lambda a: np.asarray(a) + 0.01 * rng.standard_normal(a.shape).astype(a.dtype),
                        random_m2r2(cfg, mcfg, 2))
    save_m2r2(tmp_path / "orbax", mcfg, m2r2, cfg, "fp-a")
    return cfg, mcfg, m2r2


def test_portable_form_round_trips_in_float16(tmp_path):
    cfg, mcfg, m2r2 = _tiny_m2r2(tmp_path)
    dst = export_portable(tmp_path / "orbax", tmp_path / "portable", cfg, "fp-a")
    assert (dst / "params.safetensors").is_file() and not (dst / "params").exists()
    mcfg2, back = load_m2r2(dst, cfg, "fp-a")
    assert mcfg2 == mcfg
    for a, b in zip(jax.tree.leaves(m2r2), jax.tree.leaves(back)):
        assert b.dtype == a.dtype and b.shape == a.shape
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-3, atol=1e-6)
    with pytest.raises(CheckpointError, match="belongs to another base model"):
        load_m2r2(dst, cfg, "fp-b")


def test_portable_form_refuses_missing_or_misshapen_names(tmp_path):
    from safetensors.numpy import load_file, save_file

    cfg, _, _ = _tiny_m2r2(tmp_path)
    dst = export_portable(tmp_path / "orbax", tmp_path / "portable", cfg, "fp-a")
    flat = load_file(str(dst / "params.safetensors"))
    name = sorted(flat)[0]
    save_file({k: v for k, v in flat.items() if k != name}, str(dst / "params.safetensors"))
    with pytest.raises(CheckpointError, match=f"do not fit the config: missing {name}"):
        load_m2r2(dst, cfg, "fp-a")
    save_file({**flat, name: flat[name][..., :1]}, str(dst / "params.safetensors"))
    with pytest.raises(CheckpointError, match=f"{name} has shape"):
        load_m2r2(dst, cfg, "fp-a")
    (dst / "params.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="cannot read M2R2 parameters"):
        load_m2r2(dst, cfg, "fp-a")


def test_shipped_parameters_are_complete_and_refused_on_another_base():
    assert pretrained.shipped() == ["smollm2-135m-instruct"]
    d = pretrained.pretrained_dir("smollm2-135m-instruct")
    rec = pretrained.recipe("smollm2-135m-instruct")
    assert {"commands", "recipe", "seconds", "distill_summary", "gamma", "base_fingerprint"} <= set(rec)
    base = json.loads((d / "base.json").read_text())
    assert base["fingerprint"] == rec["base_fingerprint"] == rec["distill_summary"]["base_fingerprint"]
    assert json.loads((d / "draft_vocab.json").read_text())["vocab_size"] == base["config"]["vocab_size"]
    # the recipe the shipped parameters came from still describes them
    from m2r2_jax.training.config import load_config_file
    from m2r2_jax.bench.artifacts import CONFIG_DIR

    cfg = load_config_file(CONFIG_DIR / "m2r2" / "smollm2_135m.py")
    assert M2R2Config.from_dict(json.loads((d / "m2r2_config.json").read_text())) == \
        M2R2Config.from_dict(cfg.m2r2.to_dict())
    with pytest.raises(CheckpointError, match="trained on a different base architecture"):
        load_m2r2(d, tiny_config(), "whatever")
    with pytest.raises(ConfigError, match="no shipped M2R2 parameters for 'nosuch'.*m2r2 demo --distill"):
        pretrained.pretrained_dir("nosuch")
