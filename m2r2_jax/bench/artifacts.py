"""Trained artifacts of the demos: built once per config, reused by a rerun.

    workdir = artifact(root, "m2r2", cfg_json, build, force)

An artifact lives in ROOT/<name>-<hash of its config>/ and is done when its DONE marker exists; a
build interrupted half-way resumes from its own checkpoints when the same command runs again.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

from m2r2_jax.errors import Preempted

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"  # configs/models, configs/m2r2


def say(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


def config_hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def artifact(root: Path, name: str, cfg_json: dict, build, force: bool) -> Path:
    """Run `build(workdir)` once per config; reuse its result (marked by DONE) afterwards. A build
    that reports itself preempted (a training summary with "preempted": SIGTERM stopped it after a
    checkpoint) is not done: `Preempted` is raised and a rerun resumes it from its checkpoints."""
    key = f"{name}-{config_hash(cfg_json)}"
    workdir = root / key
    done = workdir / "DONE"
    if done.is_file() and not force:
        say(f"{name}: reusing {workdir}")
        return workdir
    if force and workdir.exists():
        shutil.rmtree(workdir)
    t0 = time.time()
    summary = build(workdir)
    if isinstance(summary, dict) and summary.get("preempted"):
        at = f" at step {summary['step']}" if "step" in summary else ""
        raise Preempted(f"{name} stopped{at}; its checkpoints are in {workdir}; rerun the same command to resume")
    done.write_text(json.dumps({"seconds": time.time() - t0}))
    return workdir
