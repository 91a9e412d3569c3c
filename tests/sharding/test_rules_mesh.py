"""Mesh specs, the rules table, presets and parameter logical axes (no compilation)."""

from __future__ import annotations

import jax
import pytest

from conftest import tiny_config
from m2r2_jax.errors import ConfigError
from m2r2_jax.m2r2.config import M2R2Config
from m2r2_jax.m2r2.fast_stream import init_m2r2_params
from m2r2_jax.models.transformer import init_params
from m2r2_jax.sharding.mesh import make_mesh, parse_mesh, resolve_sizes
from m2r2_jax.sharding.params import describe_shardings, logical_axes, param_shardings, placement_notes
from m2r2_jax.sharding.plan import ShardingPlan, constrain
from m2r2_jax.sharding.presets import load_preset
from m2r2_jax.sharding.rules import LOGICAL_AXES, Rules


def test_parse_mesh_fills_missing_axes_and_one_minus_one():
    assert parse_mesh("data=2,tensor=4") == {"data": 2, "fsdp": 1, "tensor": 4, "expert": 1}
    assert resolve_sizes(parse_mesh("tensor=2,fsdp=-1"), 8) == {"data": 1, "fsdp": 4, "tensor": 2, "expert": 1}
    mesh = make_mesh("data=2,fsdp=1,tensor=4")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 4, "expert": 1}


@pytest.mark.parametrize("spec,needle", [
    ("data=3", "needs 3 devices but 8 are available"),
    ("data=2,tensor=2", "needs 4 devices"),
    ("data=3,fsdp=-1", "does not divide 8"),
    ("model=8", "mesh axis 'model' is invalid"),
    ("data=two", "not an integer"),
    ("data", "is not AXIS=SIZE"),
    ("data=2,data=4", "given twice"),
    ("data=0", "expected a positive integer or -1"),
    ("data=-1,fsdp=-1", "at most one axis may be -1"),
])
def test_bad_mesh_specs_name_the_problem(spec, needle):
    with pytest.raises(ConfigError, match=needle):
        make_mesh(spec)


def test_presets_cover_every_logical_axis_and_files_match_named_presets():
    for name in ("train", "specdec"):
        named = Rules.from_pairs(load_preset(name).rules)
        from_file = Rules.from_pairs(load_preset(f"configs/sharding/{name}.py").rules)
        assert named == from_file
        assert [n for n, _ in named.table] == list(LOGICAL_AXES)
    train = Rules.from_pairs(load_preset("train").rules)
    assert train.mesh_axes("batch") == ("data", "fsdp") and train.mesh_axes("embed") == ("fsdp",)
    specdec = Rules.from_pairs(load_preset("specdec").rules)
    assert specdec.mesh_axes("cache_heads") == ("tensor",) and specdec.mesh_axes("embed") == ()


@pytest.mark.parametrize("pairs,needle", [
    ([("batch", "data")], "incomplete"),
    ([("nonsense", None)], "unknown logical axis"),
    ([("batch", "model")], "unknown mesh axis"),
    ([("batch", ("data", "data"))], "appears twice"),
    ([("batch", "data"), ("batch", None)], "twice"),
    ([("batch",)], "expected \\(logical axis, mesh axes\\)"),
])
def test_bad_rules_are_refused(pairs, needle):
    with pytest.raises(ConfigError, match=needle):
        Rules.from_pairs(pairs)


def test_bad_preset_names_and_files(tmp_path):
    with pytest.raises(ConfigError, match="expected one of train, specdec"):
        load_preset("serve")
    with pytest.raises(ConfigError, match="does not exist"):
        load_preset(str(tmp_path / "nope.py"))
    bad = tmp_path / "bad.py"
    bad.write_text("def get_config():\n    raise ValueError('broken preset')\n")
    with pytest.raises(ConfigError, match="broken preset"):
        load_preset(str(bad))


def test_a_mesh_axis_is_used_once_per_spec():
    rules = Rules.from_pairs(load_preset("train").rules)
    # batch takes data and fsdp; embed (fsdp) on a later dimension of the same array stays unsharded
    assert tuple(rules.spec(("batch", "embed"))) == (("data", "fsdp"), None)


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3", "mixtral", "qwen2_moe", "olmoe", "gemma3"])
def test_every_parameter_of_every_family_has_logical_axes(family):
    cfg = tiny_config(family, vocab_size=64)
    base = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    m2r2 = jax.eval_shape(lambda: init_m2r2_params(cfg, M2R2Config(branch_layer=1, rate=2), jax.random.key(0)))
    plan = ShardingPlan.from_preset("train", mesh="fsdp=2,tensor=2,expert=2")
    for tree in (base, m2r2):
        axes = jax.tree.leaves(logical_axes(tree), is_leaf=lambda x: isinstance(x, tuple))
        assert all(isinstance(a, tuple) for a in axes)
        specs = describe_shardings(param_shardings(plan, tree))
        assert specs  # one entry per leaf
    specs = describe_shardings(param_shardings(plan, base))
    assert specs["layers/attn/q_proj/kernel"] == "P(None, 'fsdp', 'tensor')"
    if cfg.is_moe:
        assert specs["layers/mlp/experts_gate"] == "P(None, 'expert', 'fsdp', 'tensor')"


def test_unknown_parameters_are_errors_and_an_indivisible_vocabulary_is_padded():
    plan = ShardingPlan.from_preset("specdec", mesh="tensor=8")
    with pytest.raises(ConfigError, match="no logical axes for parameter mystery/kernel"):
        param_shardings(plan, {"mystery": {"kernel": jax.ShapeDtypeStruct((4, 4), "float32")}})
    cfg = tiny_config("llama")  # vocab 61: no tensor split can divide it
    base = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    specs = describe_shardings(param_shardings(plan, base))  # padded to 64 when placed (test_padded_vocab.py)
    assert specs["embed/embedding"] == "P('tensor', None)" and specs["lm_head/kernel"] == "P(None, 'tensor')"
    assert "embed/embedding: vocab 61 padded to 64 for tensor=8" in plan.describe(placement_notes(plan, base))


def test_constrain_is_the_identity_without_a_plan_and_fits_odd_shapes_with_one():
    x = jax.numpy.ones((3, 5, 32))
    assert constrain(x, ("batch", "length", "act_embed")) is x
    plan = ShardingPlan.from_preset("specdec", mesh="data=2,tensor=4")
    with plan.scope():
        y = jax.jit(lambda a: constrain(a, ("batch", "length", "act_vocab")))(jax.numpy.ones((3, 5, 32)))
    # batch 3 does not split over data=2: that dimension stays whole; vocab 32 splits over tensor=4
    assert tuple(y.sharding.spec) in ((None, None, "tensor"),)
