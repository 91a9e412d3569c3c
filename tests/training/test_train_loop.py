"""The generic training loop: frozen tree untouched, exact resume, preemption, non-finite steps,
half-written checkpoints."""

import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m2r2_jax.data.pipeline import batch_iterator
from m2r2_jax.errors import ConfigError, M2R2Error
from m2r2_jax.training.config import train_section
from m2r2_jax.training.loop import CHECKPOINT_DIR, latest_step, train

V, D, T = 16, 8, 6
POISON = V - 1


def tcfg(**kw):
    t = train_section()
    t.update(dict(steps=6, batch_size=8, learning_rate=0.05, warmup_steps=1, checkpoint_every=2,
                  keep_checkpoints=3, log_every=1, progress=False))
    t.update(kw)
    return t


def init_trainable():
    k1, k2 = jax.random.split(jax.random.key(1))
    return {"emb": jax.random.normal(k1, (V, D)), "norm": jnp.ones((D,)), "out_bias": jnp.zeros((V,))}


def init_frozen():
    return {"proj": jax.random.normal(jax.random.key(2), (D, V)) / np.sqrt(D)}


def loss_fn(trainable, frozen, batch, rng):
    """A bigram model whose embedding is jittered by the step rng; an all-POISON batch gives NaN."""
    x, y = batch[:, :-1], batch[:, 1:]
    emb = trainable["emb"] * (1 + 0.01 * jax.random.normal(rng, trainable["emb"].shape))
    logits = (emb[x] * trainable["norm"]) @ frozen["proj"] + trainable["out_bias"]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1).mean()
    poisoned = jnp.all(batch == POISON)
    return nll + jnp.where(poisoned, jnp.nan, 0.0), {"poisoned": poisoned.astype(jnp.float32)}


def examples():
    rng = np.random.default_rng(0)
    return rng.integers(0, V - 1, size=(64, T + 1)).astype(np.int32)


class Hooked:
    """Wraps a stateful data iterator; runs `hook(n, batch)` on the n-th batch (1-based)."""

    def __init__(self, it, hook=None):
        self.it, self.hook, self.n = it, hook, 0

    def __next__(self):
        batch = next(self.it)
        self.n += 1
        if self.hook:
            batch = self.hook(self.n, batch)
        return batch

    def get_state(self):
        return self.it.get_state()

    def set_state(self, state):
        self.it.set_state(state)


def data(hook=None):
    return Hooked(batch_iterator(examples(), 8, seed=7), hook)


def run(workdir, hook=None, **kw):
    t = tcfg(**{k: v for k, v in kw.items() if k in tcfg()})
    rest = {k: v for k, v in kw.items() if k not in t}
    return train(t, workdir, init_trainable(), init_frozen(), loss_fn, data(hook), rng=jax.random.key(3), **rest)


def leaves_equal(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    return run(tmp_path_factory.mktemp("full"))


def test_trains_only_trainable_and_leaves_frozen_untouched(tmp_path):
    frozen = init_frozen()
    before = jax.tree.map(lambda a: np.array(a, copy=True), frozen)
    result = train(tcfg(), tmp_path, init_trainable(), frozen, loss_fn, data(), rng=jax.random.key(3))
    assert leaves_equal(frozen, before)  # bitwise, and still readable (not donated)
    assert not leaves_equal(result.trainable["emb"], init_trainable()["emb"])
    h = result.history
    assert [r["step"] for r in h] == [1, 2, 3, 4, 5, 6] and result.step == 6 and not result.preempted
    assert h[-1]["loss"] < h[0]["loss"]
    assert h[0]["lr"] == 0.0 and h[1]["lr"] == pytest.approx(0.05)  # one warmup step, then cosine
    assert all("tokens_per_s" in r for r in h[1:]) and all(r["grad_norm"] > 0 for r in h)
    assert latest_step(tmp_path) == 6
    assert sorted(p.name for p in (tmp_path / CHECKPOINT_DIR).iterdir() if p.name.isdigit()) == ["2", "4", "6"]
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())


def test_sigterm_checkpoints_and_resume_is_bitwise_exact(tmp_path, full_run):
    def sigterm_at_3(n, batch):
        if n == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives during step 3; the loop stops after it
        return batch

    first = run(tmp_path, sigterm_at_3)
    assert first.preempted and first.step == 3 and latest_step(tmp_path) == 3
    second = run(tmp_path)  # fresh params and a fresh iterator: both come from the checkpoint
    losses = [r["loss"] for r in first.history + second.history]
    assert losses == [r["loss"] for r in full_run.history]  # bitwise
    assert [r["step"] for r in second.history] == [4, 5, 6]
    assert leaves_equal(second.trainable, full_run.trainable)


def test_stop_at_and_half_written_checkpoint_is_ignored(tmp_path, full_run):
    first = run(tmp_path, stop_at=4)
    assert first.preempted and latest_step(tmp_path) == 4
    # A save that died mid-write leaves only orbax's temporary directory behind.
    junk = tmp_path / CHECKPOINT_DIR / "5.orbax-checkpoint-tmp-1234"
    (junk / "state").mkdir(parents=True)
    (junk / "state" / "garbage").write_bytes(b"\0" * 10)
    assert latest_step(tmp_path) == 4
    second = run(tmp_path)
    assert [r["step"] for r in second.history] == [5, 6]
    assert [r["loss"] for r in second.history] == [r["loss"] for r in full_run.history[4:]]


def poison_3(n, batch):
    return np.full_like(batch, POISON) if n == 3 else batch


def test_nonfinite_stop_names_the_step(tmp_path):
    with pytest.raises(M2R2Error, match="non-finite loss or gradient at step 3.*not applied"):
        run(tmp_path, poison_3, nonfinite="stop")


def test_nonfinite_skip_drops_the_update_and_counts(tmp_path, full_run):
    result = run(tmp_path / "a", poison_3, nonfinite="skip", stop_at=3)
    assert result.skipped == 1 and [r["finite"] for r in result.history] == [True, True, False]
    two = run(tmp_path / "b", stop_at=2)
    assert leaves_equal(result.trainable, two.trainable)  # step 3's update was not applied
    rest = run(tmp_path / "a", nonfinite="skip")
    assert rest.skipped == 1 and all(np.isfinite(r["loss"]) for r in rest.history)
    with pytest.raises(M2R2Error, match="max_skipped=1"):
        run(tmp_path / "c", lambda n, b: np.full_like(b, POISON) if n >= 2 else b, nonfinite="skip", max_skipped=1)


def test_batch_must_divide_over_devices(tmp_path):
    assert jax.device_count() == 8, "conftest sets 8 fake CPU devices"
    with pytest.raises(ConfigError, match="train.batch_size=6.*devices"):
        train(tcfg(batch_size=6), tmp_path, init_trainable(), init_frozen(), loss_fn,
              Hooked(batch_iterator(examples(), 6, seed=0)), rng=jax.random.key(0))
