"""`kill -9` at a random moment of `m2r2 pretrain` (checkpoint every step, async saves) loses
nothing: the rerun of the same command resumes from the newest complete checkpoint (never a
half-written one), completes, and its final model is bitwise the model of an uninterrupted run."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time

import numpy as np

from cli_helpers import M2R2, subprocess_env, tiny_pretrain, train_tokenizer

SEED = int(os.environ.get("M2R2_KILL_SEED", "3"))
STEPS = 12


def _start(cfg, work):
    return subprocess.Popen([M2R2, "pretrain", f"--config={cfg}", f"--workdir={work}", f"--config.train.steps={STEPS}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())


def _first_checkpoint(work, proc, deadline):
    """Seconds until the first step directory appears in work/checkpoints (None: it never did)."""
    t0 = time.time()
    while time.time() < deadline and proc.poll() is None:
        d = work / "checkpoints"
        if d.is_dir() and any(p.name.isdigit() for p in d.iterdir()):
            return time.time() - t0
        time.sleep(0.02)
    return None


def _params(model_dir):
    import jax

    from m2r2_jax.models.checkpoint import load_model

    _, params = load_model(model_dir)
    return jax.tree_util.tree_leaves_with_path(jax.device_get(params))


def test_kill9_at_a_random_moment_then_resume_matches_an_uninterrupted_run(tmp_path):
    from m2r2_jax.training.loop import latest_step

    tok = train_tokenizer(tmp_path / "tokenizer.model")
    cfg = tmp_path / "tiny.py"
    cfg.write_text(tiny_pretrain(tok))

    # the reference: uninterrupted; it also measures how long the training phase lasts
    ref = tmp_path / "ref"
    proc = _start(cfg, ref)
    to_ckpt = _first_checkpoint(ref, proc, time.time() + 300)
    t_ckpt = time.time()
    out, err = proc.communicate(timeout=300)
    train_phase = time.time() - t_ckpt
    assert proc.returncode == 0 and to_ckpt is not None, err[-3000:]

    # the victim: SIGKILL at a seeded random moment between the first checkpoint and the end; a
    # kill that lands after the last checkpoint would exercise no resume, so it is retried sooner
    delay = random.Random(SEED).uniform(0.0, train_phase)
    for _ in range(4):
        work = tmp_path / "work"
        shutil.rmtree(work, ignore_errors=True)
        proc = _start(cfg, work)
        assert _first_checkpoint(work, proc, time.time() + 300) is not None
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        killed = proc.returncode == -signal.SIGKILL
        step = latest_step(work)  # the newest complete checkpoint (orbax ignores unfinished ones)
        if killed and step is not None and step < STEPS:
            break
        delay /= 3
    assert killed and step is not None and 1 <= step < STEPS, ("the kill never interrupted training", SEED, delay)

    proc = _start(cfg, work)
    out, err = proc.communicate(timeout=300)
    where = f"seed {SEED}, killed after {delay:.2f}s of {train_phase:.2f}s (killed={killed}), checkpoint {step}"
    assert proc.returncode == 0, f"{where}\n{err[-3000:]}"
    assert "Traceback" not in err
    assert f"resumed from the checkpoint at step {step}" in err, f"{where}\n{err[-3000:]}"
    assert latest_step(work) == STEPS
    # bitwise the same model as the uninterrupted run (same data order, same losses, CPU)
    a, b = _params(ref / "model"), _params(work / "model")
    assert [str(p) for p, _ in a] == [str(p) for p, _ in b]
    for (path, x), (_, y) in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{where}: {path}")
