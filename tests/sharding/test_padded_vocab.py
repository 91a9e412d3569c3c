"""A vocabulary the mesh does not divide (257 over tensor=4): the embedding and LM head are padded
for the plan (vocabulary-parallel), the padded logits never reach a caller, and decoding and
training give the unsharded results. Other non-dividing dimensions are replicated, with a note."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "decoding"))
from decoding_helpers import model, random_m2r2  # noqa: E402

from m2r2_jax.decoding import api  # noqa: E402
from m2r2_jax.decoding.sampling import Sampling, select  # noqa: E402
from m2r2_jax.m2r2 import losses as L  # noqa: E402
from m2r2_jax.m2r2.config import M2R2Config  # noqa: E402
from m2r2_jax.m2r2.distill import _loss_fn  # noqa: E402
from m2r2_jax.models.transformer import forward  # noqa: E402
from m2r2_jax.sharding.params import pad_vocab_leaves, param_shardings, placement_notes, shard_params  # noqa: E402
from m2r2_jax.sharding.plan import ShardingPlan  # noqa: E402
from m2r2_jax.training.config import train_section  # noqa: E402
from m2r2_jax.training.lm import lm_loss_fn  # noqa: E402
from m2r2_jax.training.loop import train  # noqa: E402

VOCAB = 257  # prime: no tensor split divides it


@pytest.mark.parametrize("tied", [False, True])
def test_padded_logits_never_win_and_logits_keep_the_vocabulary_size(tied):
    cfg, base = model("llama", vocab_size=VOCAB, tie_embeddings=tied)
    plan = ShardingPlan.from_preset("specdec", mesh="data=2,tensor=4")
    placed = shard_params(plan, base)
    name, dim = ("embed/embedding", 0) if tied else ("lm_head/kernel", 1)
    leaf = placed["embed"]["embedding"] if tied else placed["lm_head"]["kernel"]
    assert leaf.shape[dim] == 260 and tuple(leaf.sharding.spec)[dim] == "tensor"  # padded, split 65 x 4
    assert f"{name}: vocab 257 padded to 260 for tensor=4" in plan.describe(placement_notes(plan, base))
    # Make every padded token the best one by far: had a padded logit survived, it would win.
    idx = (slice(VOCAB, None), slice(None)) if tied else (slice(None), slice(VOCAB, None))
    hot = leaf.at[idx].set(50.0)
    placed = {**placed, "embed": {"embedding": hot}} if tied else {**placed, "lm_head": {"kernel": hot}}

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (4, 5)), jnp.int32)

    def step(params, keys):
        with plan.scope():
            logits = forward(cfg, params, tokens)[0]
        last = logits[:, -1]
        return logits, select(keys, last, Sampling()), select(keys, last, Sampling(1.5, 0.99))

    keys = jax.random.split(jax.random.key(0), 4)
    logits, greedy, sampled = jax.jit(step)(placed, keys)
    assert logits.shape == (4, 5, VOCAB)
    ref = jax.jit(lambda p: forward(cfg, p, tokens)[0])(base)  # unsharded, unpadded
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), rtol=2e-5, atol=2e-5)
    assert int(jnp.max(greedy)) < VOCAB and int(jnp.max(sampled)) < VOCAB
    draw = jax.jit(lambda lg, k: select(k, lg, Sampling(2.0)))
    for seed in range(3):  # sampling never draws a padded id, whatever the keys
        assert int(jnp.max(draw(logits[:, -1], jax.random.split(jax.random.key(seed), 4)))) < VOCAB


def test_greedy_decoding_on_a_mesh_that_does_not_divide_the_vocabulary_gives_the_unsharded_tokens():
    cfg, base = model("llama", vocab_size=VOCAB)
    mcfg = M2R2Config(branch_layer=1, rate=2, lora_rank=4)
    m2r2 = (mcfg, random_m2r2(cfg, mcfg, 0, adapter_scale=0.3))
    plan = ShardingPlan.from_preset("specdec", mesh="data=2,tensor=4")
    rng = np.random.default_rng(3)
    prompts = [list(map(int, rng.integers(0, VOCAB, size=int(rng.integers(1, 7))))) for _ in range(4)]
    kw = dict(max_new_tokens=8, batch_size=4)
    ref = [r.tokens for r in api.generate("ar", cfg, base, prompts, **kw)]
    assert [r.tokens for r in api.generate("ar", cfg, base, prompts, plan=plan, **kw)] == ref
    spec = api.generate("m2r2_spec", cfg, base, prompts, plan=plan, gamma=3, m2r2=m2r2, **kw)
    assert [r.tokens for r in spec] == ref
    assert all(0 <= t < VOCAB for r in spec for t in r.tokens)
    notes = api.build_engine("m2r2_spec", cfg, base, max_new_tokens=8, gamma=3, m2r2=m2r2, plan=plan).placement_notes
    assert notes == {"base/embed/embedding:0": "embed/embedding: vocab 257 padded to 260 for tensor=4",
                     "base/lm_head/kernel:1": "lm_head/kernel: vocab 257 padded to 260 for tensor=4"}
    assert "; lm_head/kernel: vocab 257 padded to 260 for tensor=4" in plan.describe(notes)


class Batches:
    def __init__(self):
        self.rng = np.random.default_rng(0)

    def __iter__(self):
        return self

    def __next__(self):
        return self.rng.integers(0, VOCAB, (8, 17)).astype(np.int32)


def _train(tmp, trainable, frozen, loss_fn, plan):
    """One sharded train step's loss, and the unsharded loss of the same batch and parameters."""
    t = train_section()
    t.update(dict(steps=1, batch_size=8, learning_rate=1e-2, warmup_steps=0, progress=False,
                  async_checkpointing=False, checkpoint_every=100))
    got = train(t, tmp, trainable, frozen, loss_fn, Batches(), rng=jax.random.key(0), plan=plan)
    key = jax.random.fold_in(jax.random.key(0), 0)  # the loop's key for step 0
    ref = jax.jit(loss_fn)(trainable, frozen, jnp.asarray(next(Batches())), key)[0]
    np.testing.assert_allclose(got.history[0]["loss"], float(ref), rtol=1e-5)
    return got


def test_distill_and_pretrain_steps_on_a_mesh_that_does_not_divide_the_vocabulary_match_unsharded(tmp_path):
    cfg, base = model("llama", vocab_size=VOCAB)
    # distillation: the frozen base's vocabulary is padded for fsdp=4,tensor=2
    mcfg = M2R2Config(branch_layer=1, rate=2, lora_rank=4)
    trainable, rest = L.split_params(random_m2r2(cfg, mcfg, 0, adapter_scale=0.1), "stream")
    plan = ShardingPlan.from_preset("train", mesh="fsdp=4,tensor=2")
    _train(tmp_path / "distill", trainable, (base, rest), _loss_fn(cfg, mcfg, L.LossConfig(), 16), plan)
    assert "lm_head/kernel: vocab 257 padded to 258 for tensor=2" in plan.describe(placement_notes(plan, base))
    # pre-training: the trained vocabulary is replicated over tensor (not padded), so the train
    # state and the returned parameters keep the model's shapes
    plan = ShardingPlan.from_preset("train", mesh="fsdp=4,tensor=2")
    got = _train(tmp_path / "pretrain", base, {}, lm_loss_fn(cfg), plan)
    head = got.trainable["lm_head"]["kernel"]
    assert head.shape == (cfg.d_model, VOCAB) and tuple(head.sharding.spec) == ("fsdp", None)
    notes = placement_notes(plan, base, pad_vocab=False)
    assert "lm_head/kernel: dimension 1 (vocab=257) replicated over tensor=2" in plan.describe(notes)


def test_other_dimensions_the_mesh_does_not_divide_are_replicated_with_a_note():
    plan = ShardingPlan.from_preset("train", mesh="fsdp=2,tensor=4")
    tree = {"layers": {"mlp": {"up_proj": {"kernel": jax.ShapeDtypeStruct((2, 32, 50), "float32")}}},
            "embed": {"embedding": jax.ShapeDtypeStruct((61, 6), "float32")}}
    sh = param_shardings(plan, tree)
    # mlp 50 over tensor=4: replicated; embed 6 over fsdp=2 divides; vocab 61 keeps its split
    assert tuple(sh["layers"]["mlp"]["up_proj"]["kernel"].spec) == (None, "fsdp", None)
    assert tuple(sh["embed"]["embedding"].spec) == ("tensor", "fsdp")
    text = plan.describe(placement_notes(plan, tree))
    assert text.startswith("train on mesh data=1,fsdp=2,tensor=4,expert=1; ")
    assert "layers/mlp/up_proj/kernel: dimension 2 (mlp=50) replicated over tensor=4: 50 is not divisible by 4" in text
    assert "embed/embedding: vocab 61 padded to 64 for tensor=4" in text
    # placement pads the vocabulary only (ahead-of-time checks pad abstract shapes the same way)
    padded = pad_vocab_leaves(tree, sh)
    assert padded["embed"]["embedding"].shape == (64, 6)
    assert padded["layers"]["mlp"]["up_proj"]["kernel"] is tree["layers"]["mlp"]["up_proj"]["kernel"]
    # a split over several mesh axes keeps the longest leading part that divides the dimension
    from m2r2_jax.sharding.params import _dividing_part

    assert _dividing_part(plan.mesh, ("fsdp", "tensor"), 6) == "fsdp"
    assert _dividing_part(plan.mesh, ("tensor", "fsdp"), 6) is None
    # a plan with nothing to pad or replicate describes itself as before
    plain = ShardingPlan.from_preset("specdec", mesh="tensor=8")
    assert plain.describe() == "specdec on mesh data=1,fsdp=1,tensor=8,expert=1"
    # notes are computed, not stored: describing the plan again, or placing other trees, leaves it as it was
    assert placement_notes(plain, tree) and plain.describe() == "specdec on mesh data=1,fsdp=1,tensor=8,expert=1"
