"""Trace recording from real decoding, the report, and the `m2r2 moe-bench` verb."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from moe_fixtures import NEW, PROMPTS, tiny_moe_setup

from m2r2_jax.errors import DataError
from m2r2_jax.m2r2 import fast_stream as F
from m2r2_jax.models import transformer as T
from m2r2_jax.models.checkpoint import save_model
from m2r2_jax.moe_offload.metrics import recall_per_layer
from m2r2_jax.moe_offload.record import record_trace
from m2r2_jax.moe_offload.report import LADDER, load_prompts, moe_report, write_plots


@pytest.fixture(scope="module")
def setup():
    cfg, params, mcfg, mp, refs = tiny_moe_setup()
    trace, gen = record_trace(cfg, params, mcfg, mp, PROMPTS, NEW, lookaheads=(1, 2))
    return cfg, params, mcfg, mp, trace, gen, refs


def test_trace_matches_real_decoding(setup):
    cfg, params, mcfg, mp, trace, gen, refs = setup
    assert gen == [list(r) for r in refs]
    assert trace.n_tokens == len(PROMPTS) * NEW
    assert recall_per_layer(trace, "oracle") == [1.0] * cfg.n_layers
    # Re-derive token 0's true routing and the m2r2 guess at the first visited layer.
    p, k = list(PROMPTS[0]), cfg.n_experts_per_tok
    toks = jnp.asarray([p + [gen[0][0]]])
    _, _, aux = T.forward(cfg, params, toks, return_aux=True)
    true = np.argsort(-np.asarray(aux.router_logits[:, 0, -1]), axis=-1)[:, :k]
    np.testing.assert_array_equal(np.sort(trace.true[0], -1), np.sort(true, -1))
    cache = T.init_cache(cfg, 1, len(p) + NEW)
    _, cache = T.forward(cfg, params, jnp.asarray([p]), None, cache)
    fo = F.fast_forward(cfg, mcfg, params, mp, toks[:, -1:], jnp.asarray([[len(p)]]), cache, collect=True)
    j0 = F.visited_layers(cfg, mcfg)[0]
    want = np.argsort(-np.asarray(fo.moe_router_logits[0, 0, -1]))
    np.testing.assert_array_equal(trace.rankings["m2r2"][0, j0][:k], want[:k])
    assert list(trace.lead("next_gate@2")) == [-1, 2, 2, 2]
    assert list(trace.lead("m2r2"))[mcfg.branch_layer:] == [1, 2, 3]


def test_report_and_plots(setup, tmp_path):
    cfg, params, mcfg, mp, _, _, _ = setup
    rep = moe_report(cfg, params, mcfg, mp, PROMPTS[:1], max_new_tokens=NEW, shapes=("mixtral-8x7b",),
                     platforms=("pcie_gen4", "nvlink_c2c"), run_real_engine=False, fresh_m2r2=True,
                     lookaheads=(1, 2))
    for key in ("recall", "hit_rate", "simulated_speedup"):
        assert set(rep[key]) >= {"next_gate", "m2r2"}
    assert rep["recall"]["oracle"] == 1.0 and rep["hit_rate"]["oracle"] == 1.0
    sp = rep["simulated_speedup"]
    for plat in ("pcie_gen4", "nvlink_c2c"):
        assert sp["all_resident"][plat] >= max(sp[r][plat] for r in LADDER[1:-1]) - 1e-9
        assert all(sp[r][plat] > 0 for r in LADDER[1:])
    assert rep["trace"]["trace_tokens_equal_reference"]
    assert "fresh" in rep["m2r2"]["note"]
    json.dumps(rep)
    paths = write_plots(rep, tmp_path)
    assert len(paths) == 7 and all(os.path.getsize(p) > 1000 for p in paths)


def test_prompt_file_errors(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"tokens": [1, 2]}\n\n{"prompt": "hi"}\n')
    with pytest.raises(DataError, match=":3: a text prompt needs a tokenizer"):
        load_prompts(f)
    f.write_text('{"tokens": [1, 2]}\n{"tokens": "x"}\n')
    with pytest.raises(DataError, match=":2: 'tokens'"):
        load_prompts(f)
    f.write_text('{"tokens": [1, 2]}\nnot json\n')
    with pytest.raises(DataError, match=":2: not valid JSON"):
        load_prompts(f)
    f.write_text('{"tokens": [1, 2]}\n{"tokens": [3]}\n')
    assert load_prompts(f, max_prompts=1) == [[1, 2]]


def _run_cli(args, cwd):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    return subprocess.run([sys.executable, "-m", "m2r2_jax.cli.main", "moe-bench", *args],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=600)


def test_cli_writes_report_and_plots(setup, tmp_path):
    cfg, params = setup[:2]
    ckpt = save_model(tmp_path / "moe", cfg, params)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"tokens": [3, 17, 5]}\n')
    out = tmp_path / "out"
    r = _run_cli(["--checkpoint", str(ckpt), "--prompts", str(prompts), "--out", str(out), "--max_new_tokens", "2",
                  "--noengine", "--shapes", "olmoe-1b-7b", "--platforms", "pcie_gen5"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "FRESH (untrained)" in r.stderr
    rep = json.loads((out / "moe_report.json").read_text())
    assert rep["m2r2"]["fresh_untrained_params"] is True
    assert set(rep["simulated_speedup"]["m2r2"]) == {"pcie_gen5"}
    assert (out / "speedup_vs_rho.png").is_file()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    r = _run_cli(["--checkpoint", str(ckpt), "--prompts", str(bad), "--out", str(out)], tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("m2r2: error:") and "bad.jsonl:1" in r.stderr
