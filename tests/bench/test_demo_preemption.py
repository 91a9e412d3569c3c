"""A training stage of `m2r2 demo` stopped by SIGTERM is checkpointed, not done: the demo exits 143
with one line, marks nothing DONE, and a rerun resumes the stage instead of reusing half of it."""

import os
import signal
import subprocess
import sys
import time

import pytest

from m2r2_jax.bench import artifacts
from m2r2_jax.errors import Preempted


def _stage(summary, built=None):
    """A build step that makes its workdir (as training does) and returns `summary`."""

    def build(wd):
        wd.mkdir(parents=True, exist_ok=True)
        if built is not None:
            built.append(wd)
        return summary

    return build


def test_a_preempted_stage_is_not_marked_done(tmp_path):
    cfg = {"steps": 3}
    workdir = tmp_path / f"dense-{artifacts.config_hash(cfg)}"
    with pytest.raises(Preempted, match=r"dense stopped at step 7; its checkpoints are in .*rerun the same command"):
        artifacts.artifact(tmp_path, "dense", cfg, _stage({"preempted": True, "step": 7}), force=False)
    assert not (workdir / "DONE").exists()
    # the rerun builds again (resuming from the stage's checkpoints), then marks it done ...
    built = []
    assert artifacts.artifact(tmp_path, "dense", cfg, _stage({"preempted": False}, built), False) == workdir
    assert built == [workdir] and (workdir / "DONE").is_file()
    # ... and only then is it reused
    assert artifacts.artifact(tmp_path, "dense", cfg, lambda wd: pytest.fail("rebuilt a finished stage"), False) == workdir
    # builds that return no summary (or no preemption flag) are done as before
    assert (artifacts.artifact(tmp_path, "other", cfg, _stage(None), False) / "DONE").is_file()


def test_sigterm_during_pretraining_exits_143_without_marking_it_done(tmp_path):
    out = tmp_path / "demo"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-m", "m2r2_jax.cli.main", "demo", "--model=tiny", "--budget=tiny",
                             "--skip_moe", f"--out={out}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 240
    while not list((out / "artifacts").glob("dense-*/tb")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(2.0)  # inside the training loop (its SIGTERM handler is installed before metrics start)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    assert "m2r2: preempted: dense stopped at step" in err and "rerun the same command to resume" in err
    assert "Traceback" not in err
    dense = list((out / "artifacts").glob("dense-*"))
    assert len(dense) == 1 and not (dense[0] / "DONE").exists() and not (dense[0] / "model").exists()
    assert not (out / "report.json").exists() and not list((out / "artifacts").glob("draft-*"))
