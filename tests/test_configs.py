"""Every config file loads and validates; bad values fail with a message naming field and value."""

import glob
from pathlib import Path

import ml_collections
import pytest

from m2r2_jax.errors import ConfigError
from m2r2_jax.training.config import load_config_file, validate_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG_FILES = sorted(glob.glob(str(ROOT / "configs" / "**" / "*.py"), recursive=True))


def test_config_files_exist():
    names = {Path(f).relative_to(ROOT / "configs").as_posix() for f in CONFIG_FILES}
    assert {"base.py", "models/tiny_dense.py", "models/tiny_moe.py", "models/tiny_draft.py", "models/llama3_8b.py",
            "models/phi3_mini.py", "models/qwen2_7b.py", "models/mixtral_8x7b.py", "models/olmoe_1b7b.py"} <= names


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: Path(p).relative_to(ROOT / "configs").as_posix())
def test_every_config_file_validates(path):
    cfg = load_config_file(path)
    if "model" in cfg:  # a base-model (pre-training) config
        mcfg = validate_config(cfg, process_count=1)
        assert mcfg.n_layers == cfg.model.n_layers and mcfg.family == cfg.model.family
    elif "m2r2" in cfg:  # an M2R2 distillation config (validated by its own module)
        from m2r2_jax.m2r2.distill import validate_distill

        validate_distill(cfg)
    elif "rules" in cfg:  # a sharding preset
        from m2r2_jax.sharding.rules import Rules

        Rules.from_pairs(cfg.rules)
        from m2r2_jax.sharding.mesh import parse_mesh

        parse_mesh(cfg.mesh)
    elif "axes" in cfg:  # a sweep: every run validated by launch/sweep.py
        import importlib.util

        spec = importlib.util.spec_from_file_location("sweep", ROOT / "launch" / "sweep.py")
        sweep = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sweep)
        plain = sweep.apply_sets(cfg, ["fixed.base_checkpoint=/path/to/base"])
        runs = sweep.expand(plain)
        assert runs
        sweep.validate(plain, runs)
    else:
        pytest.fail(f"{path}: unknown kind of config (sections {sorted(cfg)})")


def test_published_architectures():
    def model(name):
        return validate_config(load_config_file(ROOT / "configs" / "models" / f"{name}.py"), process_count=1)

    l3, phi, qw, mx, ol = (model(n) for n in ("llama3_8b", "phi3_mini", "qwen2_7b", "mixtral_8x7b", "olmoe_1b7b"))
    assert (l3.vocab_size, l3.n_kv_heads, l3.d_ff, l3.rope_theta) == (128256, 8, 14336, 500000.0)
    assert (phi.d_model, phi.head_dim, phi.d_ff, phi.vocab_size) == (3072, 96, 8192, 32064)
    assert (qw.n_layers, qw.n_kv_heads, qw.qkv_bias, qw.d_ff) == (28, 4, True, 18944)
    assert (mx.n_experts, mx.n_experts_per_tok, mx.moe_d_ff) == (8, 2, 14336)
    assert (ol.n_experts, ol.n_experts_per_tok, ol.qk_norm, ol.norm_topk_prob) == (64, 8, True, False)
    tiny = [model(n) for n in ("tiny_dense", "tiny_draft", "tiny_moe")]
    assert len({m.vocab_size for m in tiny}) == 1  # one shared tokenizer
    assert tiny[0].n_layers >= 12 and tiny[1].n_layers < tiny[0].n_layers and tiny[2].is_moe


BAD = [
    ("model.family", "gpt", r"model.family='gpt' is invalid: expected one of"),
    ("model.n_layers", 0, r"model.n_layers=0 is invalid: expected a positive integer"),
    ("model.n_layers", 2.5, r"model.n_layers=2.5 is invalid: expected an integer"),
    ("model.n_kv_heads", 3, r"model.n_kv_heads=3 is invalid: must divide n_heads=4"),
    ("model.bogus", 1, r"unknown fields \['bogus'\]"),
    ("train.steps", 0, r"train.steps=0 is invalid: expected an integer >= 1"),
    ("train.steps", "10", r"train.steps='10' is invalid: expected an integer"),
    ("train.learning_rate", -1e-3, r"train.learning_rate=-0.001 is invalid: expected a number in \(0"),
    ("train.warmup_steps", 5000, r"train.warmup_steps=5000 is invalid: must be <= train.steps=1000"),
    ("train.b2", 1.0, r"train.b2=1.0 is invalid: expected a number in \[0.0, 1.0\)"),
    ("train.nonfinite", "ignore", r"train.nonfinite='ignore' is invalid: expected one of stop, skip"),
    ("train.progress", 1, r"train.progress=1 is invalid: expected true or false"),
    ("train.checkpoint_every", 0, r"train.checkpoint_every=0 is invalid"),
    ("data.seq_len", 512, r"data.seq_len=512 is invalid: must be <= model.max_seq_len=256"),
    ("data.source", "hdfs", r"data.source='hdfs' is invalid: expected one of embedded, text, jsonl, tfds"),
    ("data.split", "dev", r"data.split='dev' is invalid"),
    ("data.heldout_fraction", 0.0, r"data.heldout_fraction=0.0 is invalid"),
    ("data.paths", "a.txt", r"data.paths='a.txt' is invalid: expected a list"),
]


@pytest.mark.parametrize("field, value, message", BAD, ids=[f"{f}={v!r}" for f, v, _ in BAD])
def test_bad_values_raise_clear_errors(field, value, message):
    d = load_config_file(ROOT / "configs" / "base.py").to_dict()
    section, name = field.split(".")
    d[section][name] = value
    with pytest.raises(ConfigError, match=message):
        validate_config(ml_collections.ConfigDict(d), process_count=1)


def test_cross_field_rules():
    cfg = load_config_file(ROOT / "configs" / "base.py")
    with pytest.raises(ConfigError, match=r"train.batch_size=16 is invalid: must be divisible by the number of hosts \(3\)"):
        validate_config(cfg, process_count=3)
    cfg.data.source = "jsonl"
    with pytest.raises(ConfigError, match=r"data.paths=\(\) is invalid: data.source=jsonl needs at least one file"):
        validate_config(cfg, process_count=1)
    cfg.data.paths = ("x.jsonl",)
    with pytest.raises(ConfigError, match=r"data.tokenizer='' is invalid: data.source=jsonl needs a tokenizer"):
        validate_config(cfg, process_count=1)
    cfg.data.source = "tfds"
    cfg.data.tokenizer = "t.model"
    with pytest.raises(ConfigError, match=r"data.tfds_name='' is invalid"):
        validate_config(cfg, process_count=1)


def test_load_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config_file(tmp_path / "none.py")
    (tmp_path / "c.py").write_text("x = 1\n")
    with pytest.raises(ConfigError, match="defines no get_config"):
        load_config_file(tmp_path / "c.py")
    cfg = load_config_file(ROOT / "configs" / "models" / "tiny_dense.py", {"train.steps": 7})
    assert cfg.train.steps == 7
    with pytest.raises(ConfigError, match="train.nope is not a config field"):
        load_config_file(ROOT / "configs" / "base.py", {"train.nope": 1})
