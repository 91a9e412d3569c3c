"""Trace recording from real decoding, the report, and the `m2r2 moe-bench` verb."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_xla_flags
from moe_fixtures import NEW, PROMPTS, tiny_moe_setup

from m2r2_jax.errors import DataError
from m2r2_jax.m2r2 import fast_stream as F
from m2r2_jax.models import transformer as T
from m2r2_jax.models.checkpoint import save_model
from m2r2_jax.moe_offload.metrics import recall_per_layer
from m2r2_jax.moe_offload.record import record_trace
from m2r2_jax.moe_offload.predictors import fast_steps_needed
from m2r2_jax.moe_offload.report import (LADDER, LINK_CHUNKS, SIMULATOR_ONLY, SWEEP_BANDWIDTHS, _StageBar, moe_report,
                                         run_engine, sweep_capacities, write_plots)


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


def test_teacher_forced_trace_follows_the_given_tokens(setup):
    cfg, params, mcfg, mp, _, _, refs = setup
    cont = [[(7 * t + 4) % cfg.vocab_size for t in range(NEW)]]
    assert cont[0] != list(refs[0])
    trace, gen = record_trace(cfg, params, mcfg, mp, PROMPTS[:1], NEW, lookaheads=(1,), forced=cont)
    assert gen == cont and trace.n_tokens == NEW
    # token t's routing is the plain forward's over prompt + the forced tokens up to t
    t, k = 3, cfg.n_experts_per_tok
    _, _, aux = T.forward(cfg, params, jnp.asarray([list(PROMPTS[0]) + cont[0][: t + 1]]), return_aux=True)
    want = np.argsort(-np.asarray(aux.router_logits[:, 0, -1]), axis=-1)[:, :k]
    np.testing.assert_array_equal(np.sort(trace.true[t], -1), np.sort(want, -1))
    with pytest.raises(DataError, match="continuation has 2 tokens"):
        record_trace(cfg, params, mcfg, mp, PROMPTS[:1], NEW, forced=[cont[0][:2]])
    with pytest.raises(DataError, match="one continuation per prompt"):
        record_trace(cfg, params, mcfg, mp, PROMPTS, NEW, forced=cont)


def test_sweep_capacities_cover_every_size_or_a_spread_with_the_benchmarked_one():
    assert sweep_capacities(2, 8, 4) == [2, 3, 4, 5, 6, 7, 8]  # few sizes: all of them
    assert sweep_capacities(2, 13, 4) == list(range(2, 14))  # exactly `points` sizes
    # OLMoE's 64 experts, top 8: 12 sizes spread from 8 to 64, plus 2 x top_k = 16
    assert sweep_capacities(8, 64, 16) == [8, 13, 16, 18, 23, 28, 33, 39, 44, 49, 54, 59, 64]
    assert 20 in sweep_capacities(8, 64, 20) and 16 in sweep_capacities(8, 64, 20)
    assert sweep_capacities(4, 60, 8, points=3) == [4, 8, 32, 60]


def test_stage_bar_draws_every_stage_even_quick_ones(capsys):
    bar = _StageBar(3, "x")
    for stage in ("a", "b", "c"):  # microseconds apart: a redraw interval would hide the last step
        bar(stage)
    bar.close()
    shown = capsys.readouterr().err
    assert "1/3" in shown and "2/3" in shown and "3/3" in shown and "c]" in shown
    silent = _StageBar(2, "")
    silent("a")
    silent.close()
    assert capsys.readouterr().err == ""


def test_report_and_plots(setup, tmp_path, capsys):
    cfg, params, mcfg, mp, _, _, _ = setup
    rep = moe_report(cfg, params, mcfg, mp, PROMPTS[:1], max_new_tokens=NEW, shapes=("mixtral-8x7b",),
                     platforms=("pcie_gen4", "nvlink_c2c"), run_real_engine=False, fresh_m2r2=True,
                     lookaheads=(1, 2), bar="moe")
    shown = capsys.readouterr().err  # the progress bar names each stage as it enters it
    for stage in ("calibrating the m2r2 sources", "recording the routing trace", "ladders", "recall needed",
                  "chunked link", "lead needed", "rho sweep", "bandwidth x capacity sweep"):
        assert stage in shown
    assert "real engine" not in shown and "8/8" in shown
    k, E = cfg.n_experts_per_tok, cfg.n_experts
    assert [(r["link_gbps"], r["capacity"]) for r in rep["bandwidth_capacity_sweep"]] == [
        (bw, c) for bw in SWEEP_BANDWIDTHS for c in sweep_capacities(k, E, rep["capacity"])]
    for key in ("recall", "hit_rate", "simulated_speedup"):
        assert set(rep[key]) >= {"next_gate", "m2r2"}
    assert rep["recall"]["oracle"] == 1.0 and rep["hit_rate"]["oracle"] == 1.0
    sp = rep["simulated_speedup"]
    for plat in ("pcie_gen4", "nvlink_c2c"):
        assert sp["all_resident"][plat] >= max(sp[r][plat] for r in LADDER[1:-1]) - 1e-9
        assert all(sp[r][plat] > 0 for r in LADDER[1:])
    assert rep["trace"]["trace_tokens_equal_reference"] and rep["trace"]["teacher_forced"] is False
    load = rep["trace"]["expert_load"]
    assert len(load["busiest_expert_load_per_layer"]) == cfg.n_layers
    assert 1.0 <= load["busiest_expert_load"] <= load["collapsed"] == cfg.n_experts / cfg.n_experts_per_tok
    # the Belady rungs: no demand paging misses less than on_demand_belady, no rung beats the bound
    hr, t = rep["hit_rate"], rep["targets"]
    assert hr["on_demand_belady"] >= hr["on_demand_lru"] and hr["oracle_belady"] == 1.0
    for plat in ("pcie_gen4", "nvlink_c2c"):
        c = rep["ceiling"][plat]
        assert c["bound_speedup_vs_on_demand_lru"] >= sp["oracle_belady"][plat] - 1e-9
        assert c["regime"] in ("link-bound", "lead-limited", "overlap can hide the loads")
        assert t["ceiling_speedup_vs_on_demand_lru"][plat] == sp["oracle_belady"][plat]
    assert t["speedup_ge_2.9_reachable_by_any_policy"] == (
        max(c["bound_speedup_vs_on_demand_lru"] for c in rep["ceiling"].values()) >= 2.9)
    assert "fresh" in rep["m2r2"]["note"]
    # the m2r2 predictor's sources were chosen on the prompts, and the trace used them
    assert rep["m2r2"]["sources"] == rep["trace"]["m2r2_sources"]
    assert rep["m2r2"]["sources_calibrated_on_tokens"] == len(PROMPTS[0])
    # confidence-gated prefetch: gate 0 is the ladder's rung itself
    for plat in ("pcie_gen4", "nvlink_c2c"):
        for rung in ("next_gate", "next_gate_lfu", "m2r2", "m2r2_lfu"):
            sweep = rep["confidence_sweep"][plat][rung]
            assert sweep["0.0"] == pytest.approx(sp[rung][plat]) and len(sweep) == 5
    # the fast pass runs the steps the chosen sources need; the recall-needed blend starts at m2r2's own
    m = rep["m2r2"]
    assert m["fast_steps"] == fast_steps_needed([tuple(x) for x in m["sources"]]) <= m["fast_steps_max"]
    assert len(m["recall_by_fast_steps"]) == m["fast_steps_max"] + 1
    need = rep["recall_needed"]
    assert need["recall"][0] == pytest.approx(rep["recall_after_branch"]["m2r2"]) and need["recall"][-1] == 1.0
    for plat in ("pcie_gen4", "nvlink_c2c"):
        assert need["on_demand_lfu"][plat] == pytest.approx(sp["on_demand_lfu"][plat])
        assert need["best_speedup"][plat][0] >= max(rep["confidence_sweep"][plat]["m2r2_lfu"].values()) - 1e-9
        be = need["break_even_recall"][plat]
        beats = [r for r, x in zip(need["recall"], need["best_speedup"][plat]) if x > need["on_demand_lfu"][plat]]
        assert be == (beats[0] if beats else None)
    # a perfect predictor issued 1..L layers ahead: one speedup per lead and platform
    lead = rep["lead_needed"]
    assert lead["lead_layers"] == list(range(1, cfg.n_layers + 1)) and lead["m2r2_leads"] == rep["trace"]["leads"]["m2r2"]
    for plat in ("pcie_gen4", "nvlink_c2c"):
        assert len(lead["speedup"][plat]) == cfg.n_layers and all(x > 0 for x in lead["speedup"][plat])
        assert lead["on_demand_lfu"][plat] == pytest.approx(sp["on_demand_lfu"][plat])
        a = lead["shortest_lead_beating_lfu"][plat]
        assert a is None or lead["speedup"][plat][a - 1] > lead["on_demand_lfu"][plat]
    # the ladder on a chunked link, against the same whole-expert on-demand LRU baseline
    ch = rep["chunked_link"]
    assert ch["chunks"] == LINK_CHUNKS and set(ch["speedup_vs_whole_expert_on_demand_lru"]) == set(LADDER)
    for plat in ("pcie_gen4", "nvlink_c2c"):
        row = {r: v[plat] for r, v in ch["speedup_vs_whole_expert_on_demand_lru"].items()}
        assert row["all_resident"] == pytest.approx(sp["all_resident"][plat])  # nothing to move
        assert row["on_demand_lru"] <= 1.0 + 1e-9  # chunks only add latency when nothing is prefetched
        assert t["m2r2_lfu_faster_than_on_demand_lfu_on_a_chunked_link_per_platform"][plat] == (
            row["m2r2_lfu"] > row["on_demand_lfu"])
        assert t["m2r2_lfu_faster_than_on_demand_lfu_per_platform"][plat] == (
            sp["m2r2_lfu"][plat] > sp["on_demand_lfu"][plat])
    json.dumps(rep)
    paths = write_plots(rep, tmp_path)
    assert len(paths) == 9 and all(os.path.getsize(p) > 1000 for p in paths)
    assert any(p.endswith("recall_needed.png") for p in paths) and any(p.endswith("lead_needed.png") for p in paths)


def test_engine_ladder_skips_the_simulator_only_rungs(setup):
    cfg, params, mcfg, mp, _, _, refs = setup
    out = run_engine(cfg, params, mcfg, mp, PROMPTS[:1], 3, 2, [list(refs[0][:3])])
    assert list(out) == [r for r in LADDER if r not in SIMULATOR_ONLY]
    assert set(SIMULATOR_ONLY) == {"on_demand_belady", "oracle_belady"}
    assert all(v["tokens_equal_all_resident"] for v in out.values())


def _bad_runs(arg_lists) -> list:
    """`m2r2 moe-bench ARGS` for each bad input, in one process (tests/cli/verb_worker.py: the verb's
    main under the same run_verb as the console script, stderr captured per case): they fail before
    any compiling, so a process start each would be most of their time. Results as verb_worker's."""
    cli = str(Path(__file__).resolve().parents[1] / "cli")
    if cli not in sys.path:
        sys.path.insert(0, cli)
    from cli_helpers import run_in_workers

    return run_in_workers({"moe-bench": arg_lists})["moe-bench"]


def _run_cli(args, cwd):
    # one device, and the suite's fast compiles (compiling is most of a run)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_xla_flags(1, old_emitters=True))
    return subprocess.run([sys.executable, "-m", "m2r2_jax.cli.main", "moe-bench", *args],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=600)


def test_cli_teacher_forces_each_row_at_its_own_prompt_length(setup, tmp_path):
    """Chat prompts differ in length: with --forced_per_row each row's "prompt_len" splits it into
    the prompt and the tokens fed (here 3 + 2 and 2 + 2, the fed tokens 40 40 and 40 41)."""
    cfg, params = setup[:2]
    ckpt = save_model(tmp_path / "moe", cfg, params)
    prompts = tmp_path / "answers.jsonl"
    prompts.write_text('{"tokens": [3, 17, 5, 40, 40, 9], "prompt_len": 3}\n'
                       '{"tokens": [8, 9, 40, 41], "prompt_len": 2}\n')
    out = tmp_path / "out"
    common = ["--checkpoint", str(ckpt), "--out", str(out), "--max_new_tokens", "2", "--noengine",
              "--shapes", "olmoe-1b-7b", "--platforms", "pcie_gen5"]
    r = _run_cli([*common, "--prompts", str(prompts), "--forced_per_row"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads((out / "moe_report.json").read_text())
    assert rep["trace"]["teacher_forced"] and rep["trace"]["decoded_tokens"] == 4
    assert rep["trace"]["distinct_token_fraction"] == 0.5  # 40 40 40 41: the fed tokens, not greedy ones
    assert rep["inputs"]["forced_per_row"] is True
    # a row without its split, a split too late for max_new_tokens, or both ways of splitting: one line each
    cases = []
    for i, (text, flag, says) in enumerate((
            ('{"tokens": [3, 17, 5, 40]}\n', "--forced_per_row", "bad0.jsonl:1"),
            ('{"tokens": [3, 17, 5, 40], "prompt_len": 3}\n', "--forced_per_row", "prompt_len=3"),
            ('{"tokens": [3, 17, 5, 40], "prompt_len": 1}\n', "--forced_prompt_len=1", "two ways to split"))):
        bad = tmp_path / f"bad{i}.jsonl"
        bad.write_text(text)
        extra = ["--forced_per_row"] if says == "two ways to split" else []
        cases.append(([*common, "--prompts", str(bad), flag, *extra], says))
    for (_, says), r in zip(cases, _bad_runs([argv for argv, _ in cases])):
        assert r["code"] == 2 and r["traceback"] is None, r
        assert says in r["stderr"].strip().splitlines()[-1], r["stderr"][-1000:]


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
    assert json.loads(r.stdout)["busiest_expert_load"] >= 1.0
    assert "routes most tokens to a few experts" not in r.stderr  # 2 tokens: too few to call it skewed
    rep = json.loads((out / "moe_report.json").read_text())
    assert rep["m2r2"]["fresh_untrained_params"] is True
    assert set(rep["simulated_speedup"]["m2r2"]) == {"pcie_gen5"}
    assert (out / "speedup_vs_rho.png").is_file()
    assert rep["m2r2"]["sources_calibrated_on_tokens"] == 3  # the prompt's own tokens by default
    calib = tmp_path / "calib.jsonl"
    calib.write_text('{"tokens": [1, 2, 3, 4, 5, 6]}\n{"tokens": [9, 8, 7, 6]}\n')
    r = _run_cli(["--checkpoint", str(ckpt), "--prompts", str(prompts), "--out", str(out), "--max_new_tokens", "2",
                  "--noengine", "--shapes", "olmoe-1b-7b", "--platforms", "pcie_gen5", "--calibration", str(calib)],
                 tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads((out / "moe_report.json").read_text())
    assert rep["m2r2"]["sources_calibrated_on_tokens"] == 10 and rep["inputs"]["calibration"] == str(calib)
    calib.write_text('{"tokens": [1, 99999]}\n')
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    runs = _bad_runs([
        ["--checkpoint", str(ckpt), "--prompts", str(prompts), "--out", str(out), "--calibration", str(calib)],
        ["--checkpoint", str(ckpt), "--prompts", str(prompts), "--out", str(out), "--max_new_tokens", "2",
         "--forced_prompt_len", "2"],
        ["--checkpoint", str(ckpt), "--prompts", str(bad), "--out", str(out)]])
    for r, says in zip(runs, ("calib.jsonl", "--forced_prompt_len=2", "bad.jsonl:1")):
        assert r["code"] == 2 and r["traceback"] is None, r
        assert r["stderr"].strip().splitlines()[-1].startswith("m2r2: error:") and says in r["stderr"], r["stderr"]
