"""The demo's persistent compilation cache: programs compiled inside the block are written to its
directory and loaded (counted as hits) by a later compile of the same program, in this process or
in a child given `child_env`; the settings before the block come back after it."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from m2r2_jax.bench import compile_cache

CHILD = """
import json, sys, jax, jax.numpy as jnp, numpy as np
hits = []
jax.monitoring.register_event_listener(lambda e, **_: hits.append(e) if e.endswith("cache_hits") else None)
y = jax.jit(lambda x: jnp.tanh(x @ x.T) * float(sys.argv[1]))(jnp.arange(12.0).reshape(3, 4))
print(json.dumps({"hits": len(hits), "y": np.asarray(y).tolist()}))
"""


def _program(scale: float):
    return jax.jit(lambda x: jnp.tanh(x @ x.T) * scale)


def test_programs_are_written_and_loaded_again(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_cache, "MIN_COMPILE_S", 0.0)  # the test's programs compile in milliseconds
    x = jnp.arange(12.0).reshape(3, 4)
    before = jax.config.jax_compilation_cache_dir
    with compile_cache.persistent_cache(tmp_path / "c") as stats:
        want = np.asarray(_program(1.7)(x))
        written = sorted(os.listdir(tmp_path / "c"))
        assert written and stats["hits"] == 0
        jax.clear_caches()  # the in-memory caches: the next compile has to come from disk
        again = np.asarray(_program(1.7)(x))
        assert stats["hits"] >= 1 and stats["compile_s_saved"] > -1.0
        np.testing.assert_array_equal(again, want)
    assert jax.config.jax_compilation_cache_dir == before
    assert jax.config.jax_persistent_cache_min_compile_time_secs != 0.0  # restored
    # outside the block nothing is written there any more, and nothing is counted
    _program(2.9)(x).block_until_ready()
    assert sorted(os.listdir(tmp_path / "c")) == written and stats["hits"] >= 1

    # across processes (as the demo's one-core child): a process given child_env writes a program,
    # the next one running the same code loads it, and a program not seen before is compiled
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, **compile_cache.child_env(tmp_path / "x"), "JAX_PLATFORMS": "cpu",
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}

    def child(scale):
        out = subprocess.run([sys.executable, str(script), str(scale)], capture_output=True, text=True, env=env,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second, other = child(1.7), child(1.7), child(3.1)
    # (the input's arange and reshape are programs of their own, loaded by both later children)
    assert first["hits"] == 0 and second["hits"] == other["hits"] + 1 >= 1
    assert second["y"] == first["y"] != other["y"]


def test_child_env_names_the_directory_absolutely(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = compile_cache.child_env("rel/cache")
    assert env["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "rel" / "cache")
    assert float(env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]) == compile_cache.MIN_COMPILE_S


def test_the_demos_one_core_child_gets_the_cache_and_runs_greedy_only(tmp_path, monkeypatch):
    """`_one_core_bench` hands its child the demo's cache directory (so the child loads the
    engines the demo compiled) and no --temperature (the all-core run has the sampled comparison)."""
    import subprocess as sp
    from types import SimpleNamespace

    from m2r2_jax.bench import demo

    seen = {}
    row = {"tokens_per_s": 10.0, "speedup_vs_ar": 1.0, "speedup_vs_ar_per_answer": [1.0], "mean_accepted_tokens": 1.0,
           "identical_to_ar": True}

    def fake_run(cmd, **kw):
        seen["cmd"], seen["env"] = cmd, kw.get("env")
        report = {"speculative": {"ar": row, "m2r2_spec": dict(row, gamma=4)}, "layer_loop": {"ar": "unrolled"}}
        (tmp_path / "out" / "one_core" / "report.json").write_text(json.dumps(report))
        return SimpleNamespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(sp, "run", fake_run)
    budget = demo.BUDGETS["full"]
    with compile_cache.persistent_cache(tmp_path / "cache"):
        got = demo._one_core_bench(tmp_path / "out", tmp_path / "base", tmp_path / "m2r2", [[5, 6, 7]], budget,
                                   {"m2r2_spec": 4, "distance_spec": 4, "two_model": 2})
    assert seen["env"]["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "cache")
    assert "--cpu_cores=1" in seen["cmd"] and not any(a.startswith("--temperature") for a in seen["cmd"])
    assert "--gamma=m2r2_spec=4,distance_spec=4" in seen["cmd"]
    assert got["methods"]["m2r2_spec"]["gamma"] == 4 and "sampled" not in got


# ----------------------------------------------------------------- the CLI verbs' default cache


def _cli_env(**extra) -> dict:
    from conftest import cpu_xla_flags

    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")}
    return {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(1), **extra}


def test_a_second_generate_loads_the_first_ones_programs(tmp_path):
    """`m2r2 generate` twice with nothing configured but the default location (here HOME's): the
    first run writes its programs, the second loads them all (JAX logs hits and misses)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "decoding"))
    from decoding_helpers import model

    from m2r2_jax.models.checkpoint import save_model

    ckpt = save_model(tmp_path / "base", *model("llama", vocab_size=64))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"tokens": [1, 2, 3, 4, 5]}\n{"tokens": [7, 8, 9]}\n')
    home = tmp_path / "home"
    # every program is kept (the tiny model's compile in well under MIN_COMPILE_S otherwise)
    env = _cli_env(HOME=str(home), JAX_LOG_COMPILES="1", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env.pop("M2R2_COMPILE_CACHE", None)

    def generate(out):
        r = subprocess.run([sys.executable, "-m", "m2r2_jax.cli.main", "generate", f"--checkpoint={ckpt}",
                            f"--prompts={prompts}", f"--out={tmp_path / out}", "--max_new_tokens=6"],
                           capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stderr

    first = generate("a.jsonl")
    cache = home / ".cache" / "m2r2_jax" / "xla"
    hit = re.compile(r"Persistent compilation cache hit for '\w*run_batch'")
    assert "run_batch" in first and not hit.search(first)
    assert any(cache.iterdir())
    second = generate("b.jsonl")
    assert hit.search(second)
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()


def test_cli_default_location_precedence_and_off(tmp_path, monkeypatch, capsys):
    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax_own"))
        assert compile_cache.cli_default() == str(tmp_path / "jax_own")  # JAX's setting wins
        jax.config.update("jax_compilation_cache_dir", None)
        monkeypatch.setenv(compile_cache.CACHE_ENV, "off")
        assert compile_cache.cli_default() is None and jax.config.jax_compilation_cache_dir is None
        monkeypatch.setenv(compile_cache.CACHE_ENV, str(tmp_path / "mine"))
        assert compile_cache.cli_default() == str(tmp_path / "mine") == jax.config.jax_compilation_cache_dir
        compile_cache.leave_default_for_multiprocess()  # a jax.distributed run: not the shared default
        assert jax.config.jax_compilation_cache_dir is None
        (tmp_path / "a_file").write_text("")
        monkeypatch.setenv(compile_cache.CACHE_ENV, str(tmp_path / "a_file" / "cache"))
        assert compile_cache.cli_default() is None
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("m2r2: warning: compiling without a persistent cache:")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
