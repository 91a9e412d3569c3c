"""Sharded = unsharded on 8 fake CPU devices: train steps (pre-training, distillation, MoE with an
expert axis), checkpoints resumed on another mesh, and speculative decoding token for token."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "decoding"))
from decoding_helpers import model, random_m2r2  # noqa: E402

from m2r2_jax.decoding import api  # noqa: E402
from m2r2_jax.m2r2 import losses as L  # noqa: E402
from m2r2_jax.m2r2.config import M2R2Config  # noqa: E402
from m2r2_jax.m2r2.distill import _loss_fn  # noqa: E402
from m2r2_jax.sharding.plan import ShardingPlan  # noqa: E402
from m2r2_jax.training.config import train_section  # noqa: E402
from m2r2_jax.training.lm import lm_loss_fn  # noqa: E402
from m2r2_jax.training.loop import train  # noqa: E402

VOCAB = 64  # divisible by every tensor split used here


class Batches:
    def __init__(self, batch, width, seed=0):
        self.rng = np.random.default_rng(seed)
        self.shape = (batch, width)
        self.n = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.n += 1
        return self.rng.integers(0, VOCAB, self.shape).astype(np.int32)

    def get_state(self):
        return {"n": self.n}

    def set_state(self, state):  # replay: the same batches after a resume
        self.rng, self.n = np.random.default_rng(0), 0
        for _ in range(state["n"]):
            next(self)


def tcfg(steps=2):
    t = train_section()
    t.update(dict(steps=steps, batch_size=8, learning_rate=1e-2, warmup_steps=0, progress=False,
                  async_checkpointing=False, checkpoint_every=1))
    return t


def close(a, b, tol=2e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def run(tmp, trainable, frozen, loss_fn, plan, steps=2, **kw):
    return train(tcfg(steps), tmp, trainable, frozen, loss_fn, Batches(8, 17), rng=jax.random.key(0), plan=plan, **kw)


def test_sharded_pretrain_steps_match_unsharded(tmp_path):
    cfg, params = model("llama", vocab_size=VOCAB)
    ref = run(tmp_path / "ref", params, {}, lm_loss_fn(cfg), None)
    plan = ShardingPlan.from_preset("train", mesh="data=2,fsdp=2,tensor=2")
    got = run(tmp_path / "sharded", params, {}, lm_loss_fn(cfg), plan)
    np.testing.assert_allclose([h["loss"] for h in got.history], [h["loss"] for h in ref.history], rtol=1e-5)
    close(got.trainable, ref.trainable)
    q = got.trainable["layers"]["attn"]["q_proj"]["kernel"]
    assert tuple(q.sharding.spec) == (None, "fsdp", "tensor")  # the params really are sharded


def _distill_setup(family):
    cfg, base = model(family, vocab_size=VOCAB)
    mcfg = M2R2Config(branch_layer=1, rate=2, lora_rank=4)
    trainable, rest = L.split_params(random_m2r2(cfg, mcfg, 0, adapter_scale=0.1), "stream")
    return trainable, (base, rest), _loss_fn(cfg, mcfg, L.LossConfig(), 16)


def test_sharded_distill_steps_match_unsharded_and_resume_on_another_mesh(tmp_path):
    trainable, frozen, loss_fn = _distill_setup("llama")
    ref = run(tmp_path / "ref", trainable, frozen, loss_fn, None, steps=3)
    # stop after step 1 on one mesh, resume on another: orbax restores onto the current shardings
    plan = ShardingPlan.from_preset("train", mesh="fsdp=4,tensor=2")
    first = run(tmp_path / "sharded", trainable, frozen, loss_fn, plan, steps=3, stop_at=1)
    assert first.preempted and first.step == 1
    other = ShardingPlan.from_preset("train", mesh="data=2,fsdp=2,tensor=2")
    got = run(tmp_path / "sharded", trainable, frozen, loss_fn, other, steps=3)
    losses = [h["loss"] for h in first.history + got.history]
    np.testing.assert_allclose(losses, [h["loss"] for h in ref.history], rtol=1e-5)
    close(got.trainable, ref.trainable)
    assert tuple(got.trainable["rates"]["attn"].sharding.spec) == (None, "fsdp")


def test_sharded_moe_distill_steps_with_an_expert_axis_match_unsharded(tmp_path):
    trainable, frozen, loss_fn = _distill_setup("mixtral")
    ref = run(tmp_path / "ref", trainable, frozen, loss_fn, None)
    got = run(tmp_path / "sharded", trainable, frozen, loss_fn,
              ShardingPlan.from_preset("train", mesh="fsdp=2,tensor=2,expert=2"))
    np.testing.assert_allclose([h["loss"] for h in got.history], [h["loss"] for h in ref.history], rtol=1e-5)
    close(got.trainable, ref.trainable)


def _random_prompts(rng, n):
    return [list(map(int, rng.integers(0, VOCAB, size=int(rng.integers(1, 7))))) for _ in range(n)]


@pytest.mark.parametrize("family,mesh", [("llama", "data=2,tensor=4"), ("mixtral", "data=2,tensor=2,expert=2")])
def test_sharded_speculative_decoding_gives_the_unsharded_tokens(family, mesh):
    cfg, base = model(family, vocab_size=VOCAB)
    mcfg = M2R2Config(branch_layer=1, rate=2, lora_rank=4)
    m2r2 = (mcfg, random_m2r2(cfg, mcfg, 0, adapter_scale=0.3))
    plan = ShardingPlan.from_preset("specdec", mesh=mesh)
    rng = np.random.default_rng(7)
    for trial in range(3):  # random prompts and seeds; greedy, then sampled
        prompts = _random_prompts(rng, 5)
        temperature = 0.0 if trial == 0 else 0.8
        kw = dict(max_new_tokens=8, temperature=temperature, seed=trial, batch_size=4, gamma=3, m2r2=m2r2)
        spec = api.generate("m2r2_spec", cfg, base, prompts, plan=plan, **kw)
        # greedy: lossless against plain decoding; sampled: the same draws as unsharded
        ref = api.generate("ar" if temperature == 0.0 else "m2r2_spec", cfg, base, prompts, **kw)
        assert [r.tokens for r in spec] == [r.tokens for r in ref]
        if temperature > 0:
            assert [r.accepted for r in spec] == [r.accepted for r in ref]
        assert all(len(r.tokens) == 8 for r in spec)


def test_sharded_drafting_from_a_reduced_vocabulary_gives_the_unsharded_tokens():
    """The draft head over a token subset (replicated on the mesh) drafts as unsharded does."""
    cfg, base = model("llama", vocab_size=VOCAB)
    mcfg = M2R2Config(branch_layer=1, rate=2, lora_rank=4)
    m2r2 = (mcfg, random_m2r2(cfg, mcfg, 0, adapter_scale=0.3))
    plan = ShardingPlan.from_preset("specdec", mesh="data=2,tensor=4")
    prompts = _random_prompts(np.random.default_rng(3), 5)
    vocab = list(range(0, VOCAB, 2))
    for temperature in (0.0, 0.8):
        kw = dict(max_new_tokens=8, temperature=temperature, seed=1, batch_size=4, gamma=3, m2r2=m2r2,
                  draft_vocab=vocab)
        spec = api.generate("m2r2_spec", cfg, base, prompts, plan=plan, **kw)
        ref = api.generate("m2r2_spec", cfg, base, prompts, **kw)
        assert [r.tokens for r in spec] == [r.tokens for r in ref]
        assert [r.accepted for r in spec] == [r.accepted for r in ref]
    greedy_ar = api.generate("ar", cfg, base, prompts, max_new_tokens=8, batch_size=4)
    greedy = api.generate("m2r2_spec", cfg, base, prompts, plan=plan, max_new_tokens=8, batch_size=4, gamma=3,
                          m2r2=m2r2, draft_vocab=vocab)
    assert [r.tokens for r in greedy] == [r.tokens for r in greedy_ar]


def test_sharded_engine_places_the_kv_cache_by_batch_and_kv_heads():
    cfg, base = model("llama", vocab_size=VOCAB)
    plan = ShardingPlan.from_preset("specdec", mesh="data=4,tensor=2")  # 2 kv heads over tensor=2
    engine = api.build_engine("ar", cfg, base, max_new_tokens=4, plan=plan)
    _, states = api.run_engine(engine, [[1, 2, 3], [4, 5]], batch_size=2, return_states=True)
    k = states[0].cache["k"]  # [L, B, KV, S, hd]
    assert tuple(k.sharding.spec)[:4] == (None, "data", "tensor", None)
    wq = engine.params["base"]["layers"]["attn"]["q_proj"]["kernel"]
    assert tuple(wq.sharding.spec) == (None, None, "tensor")
    assert len(states[0].out) == 4  # two prompts, padded with idle rows to the data axis


def test_sharded_benchmark_compares_methods_on_the_mesh():
    """`m2r2 bench --mesh` runs compare_methods with a plan: every method sharded, same answers."""
    from m2r2_jax.bench.speculative import compare_methods

    cfg, base = model("llama", vocab_size=VOCAB)
    mcfg = M2R2Config(branch_layer=1, rate=2, lora_rank=4)
    plan = ShardingPlan.from_preset("specdec", mesh="data=2,tensor=4")
    prompts = _random_prompts(np.random.default_rng(3), 2)
    m2r2 = (mcfg, random_m2r2(cfg, mcfg, 0, 0.3))
    rep = compare_methods(cfg, base, prompts, max_new_tokens=6, gamma=3, m2r2=m2r2,
                          methods=("ar", "m2r2_spec"), batch_sizes=(2,), repeats=1, plan=plan)
    assert rep["m2r2_spec"]["identical_to_ar"] is True
    assert rep["m2r2_spec"]["answers"] == [r.tokens for r in api.generate("ar", cfg, base, prompts, max_new_tokens=6)]
    unsharded = api.generate("m2r2_spec", cfg, base, prompts, max_new_tokens=6, gamma=3, m2r2=m2r2)
    assert rep["m2r2_spec"]["mean_accepted_tokens"] == pytest.approx(np.mean([a for r in unsharded for a in r.accepted]))
