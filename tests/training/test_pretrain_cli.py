"""`m2r2 pretrain` / `m2r2 sample` end to end on a tiny model: SIGTERM checkpoint, resume, export,
sampling, and one-line errors. Also the cached sampler against full forwards."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import cpu_xla_flags, tiny_config, tiny_pretrain_config
from m2r2_jax.models.transformer import forward, init_params
from m2r2_jax.training.loop import latest_step
from m2r2_jax.training.sampling import sample_tokens

TINY = tiny_pretrain_config()


def m2r2(*args, **kw):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_xla_flags(1))
    return subprocess.Popen([sys.executable, "-m", "m2r2_jax.cli.main", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kw)


def finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def test_pretrain_sigterm_resume_export_and_sample(tmp_path):
    cfg, work = tmp_path / "tiny.py", tmp_path / "work"
    cfg.write_text(TINY)
    proc = m2r2("pretrain", f"--config={cfg}", f"--workdir={work}")
    deadline = time.time() + 240
    while not (work / "tb").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(2.0)  # let it take a few steps
    proc.send_signal(signal.SIGTERM)
    rc, out, err = finish(proc)
    assert rc == 143, err[-3000:]
    assert "Traceback" not in err and "preempted at step" in err
    step = latest_step(work)
    assert step is not None and step >= 1
    assert (work / "tokenizer" / "tokenizer.model").is_file() and not (work / "model").exists()

    rc, out, err = finish(m2r2("pretrain", f"--config={cfg}", f"--workdir={work}", f"--config.train.steps={step + 3}"))
    assert rc == 0, err[-3000:]
    summary = json.loads(out)
    assert summary["step"] == step + 3 and not summary["preempted"] and np.isfinite(summary["heldout_loss"])
    assert f"resumed from the checkpoint at step {step}" in err
    assert (work / "model" / "model_config.json").is_file() and (work / "model" / "tokenizer" / "tokenizer.model").is_file()

    args = ["sample", f"--checkpoint={work / 'model'}", "--prompt=ROMEO.", "--max-new-tokens=6", "--temperature=0"]
    rc, out, err = finish(m2r2(*args))
    assert rc == 0, err[-3000:]
    assert out.startswith("ROMEO.") and len(out) > len("ROMEO.\n")


@pytest.mark.parametrize("args, message", [
    (["pretrain", "--config={cfg}", "--workdir={tmp}/w", "--config.train.steps=0"], "train.steps=0 is invalid"),
    (["pretrain", "--config={cfg}", "--workdir={tmp}/w", "--config.data.seq_len=128"],
     "data.seq_len=128 is invalid: must be <= model.max_seq_len=64"),
    (["pretrain", "--config={tmp}/none.py", "--workdir={tmp}/w"], "none.py"),
    (["pretrain", "--config={cfg}"], "workdir"),
    (["sample", "--checkpoint={tmp}/nothing", "--prompt=x"], "not a model checkpoint"),
])
def test_cli_errors_are_one_line(tmp_path, args, message):
    cfg = tmp_path / "tiny.py"
    cfg.write_text(TINY)
    rc, out, err = finish(m2r2(*[a.format(cfg=cfg, tmp=tmp_path) for a in args]), timeout=120)
    assert rc == 2
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("m2r2: error:") and message in lines[0], err


def test_sampler_matches_full_forward_greedy():
    cfg = tiny_config("llama")
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0))
    prompt = [5, 9, 2, 33]
    new = sample_tokens(cfg, params, prompt, 10, temperature=0.0)
    # Causal: the uncached forward over prompt + new gives, at each position, the logits of its prefix;
    # every greedy token must be the argmax there.
    logits, _ = jax.jit(forward, static_argnums=0)(cfg, params, jnp.asarray([prompt + new], jnp.int32))
    expected = np.asarray(jnp.argmax(logits[0, len(prompt) - 1:-1], axis=-1)).tolist()
    assert new == expected
    a = sample_tokens(cfg, params, prompt, 10, temperature=1.0, seed=1)
    assert a == sample_tokens(cfg, params, prompt, 10, temperature=1.0, seed=1)
    assert a != sample_tokens(cfg, params, prompt, 10, temperature=1.0, seed=2)
    with pytest.raises(Exception, match="exceeds the model's max_seq_len=64"):
        sample_tokens(cfg, params, prompt, 61)


def test_resume_refuses_a_different_model_or_data(tmp_path):
    from m2r2_jax.errors import ConfigError
    from m2r2_jax.training.config import base_config
    from m2r2_jax.training.pretrain import _check_workdir_config

    cfg = base_config()
    _check_workdir_config(cfg, tmp_path)
    cfg.train.steps += 100  # extending a run is allowed
    _check_workdir_config(cfg, tmp_path)
    cfg.model.n_layers = 6
    with pytest.raises(ConfigError, match=r"model.n_layers=6 differs from the run in .* \(4\)"):
        _check_workdir_config(cfg, tmp_path)
