"""Benchmark helpers: quality metrics, acceptance statistics, prompt sets, the report table."""

import json

import pytest

from m2r2_jax.bench import report as R
from m2r2_jax.bench.prompts import PROMPT_SETS, load_prompt_set
from m2r2_jax.bench.speculative import acceptance_by_position, rouge_l, token_agreement
from m2r2_jax.decoding.api import SequenceResult
from m2r2_jax.errors import DataError


def test_quality_metrics():
    assert rouge_l([1, 2, 3], [1, 2, 3]) == 1.0
    assert rouge_l([4, 5], [1, 2, 3]) == 0.0
    # LCS 2 of 3 / 3 -> F1 2/3
    assert rouge_l([1, 9, 3], [1, 2, 3]) == pytest.approx(2 / 3)
    assert token_agreement([1, 9, 3, 4], [1, 2, 3]) == pytest.approx(2 / 3)
    assert token_agreement([], [1, 2]) == 0.0


def test_acceptance_by_position():
    res = [SequenceResult(tokens=[0] * 9, accepted=[1, 3, 5], rounds=3, target_layers=0, draft_layers=0)]
    # counts-1 = 0, 2, 4 accepted drafts: position 1 accepted in 2/3 rounds, 3 and 4 in 1/3
    assert acceptance_by_position(res, 4) == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 3])
    assert acceptance_by_position([SequenceResult([1], [], 0, 0, 0)], 4) == []


@pytest.mark.parametrize("name", list(PROMPT_SETS))
def test_shipped_prompt_sets_load(name):
    prompts = load_prompt_set(name)
    assert len(prompts) >= 50 and all(isinstance(p, str) and p.strip() for p in prompts)


def test_prompt_file_and_errors(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"tokens": [1, 2]}) + "\n")
    assert load_prompt_set(str(f)) == ["hi", [1, 2]]  # text stays text: bench tokenizes it later
    f.write_text(json.dumps({"question": "x"}) + "\n")
    with pytest.raises(DataError, match="p.jsonl:1"):
        load_prompt_set(str(f))
    with pytest.raises(DataError, match="not a prompt set"):
        load_prompt_set("no_such_set")


def _fake_report():
    sweep = lambda s: [{"batch_size": 1, "tokens_per_s": 10 * s, "speedup_vs_ar": s}]
    spec = {"ar": {"tokens_per_s": 10.0, "speedup_vs_ar": 1.0, "mean_accepted_tokens": 1.0, "efficiency": 1.0,
                   "identical_to_ar": None, "batch_sweep": sweep(1.0)}}
    for m, s, acc in (("m2r2_spec", 1.6, 3.0), ("distance_spec", 1.2, 2.0)):
        spec[m] = {"tokens_per_s": 10 * s, "speedup_vs_ar": s, "mean_accepted_tokens": acc, "efficiency": 0.9,
                   "ideal_speedup": s / 0.9, "identical_to_ar": True, "batch_sweep": sweep(s),
                   "draft_cost_layers": 4.0, "acceptance_by_position": [0.9, 0.5],
                   "costs": {"draft_cost_per_token": 0.3, "verify_cost_ratio": 1.4}}
    align = {"slow_cost": [1.0, 2.0, 3.0, 4.0], "slow_agreement": [0.1, 0.2, 0.5, 1.0], "fast_cost": [2.5, 3.5],
             "fast_agreement": [0.6, 0.8], "slow_cosine": [0.5] * 4, "fast_cosine": [0.7] * 2, "branch_layer": 1,
             "fast_beats_slow_at_equal_compute": [True, True]}
    ee = {"m2r2_exit": [{"threshold": 0.5, "speedup": 1.3, "rouge_l": 0.8, "agreement": 0.7, "layers_per_token": 2.0}]}
    return {"speculative": spec, "alignment": align, "early_exit": ee}


def test_early_exit_target_compares_the_fastest_points_that_keep_rouge():
    row = lambda tau, sp, rouge: {"threshold": tau, "speedup": sp, "rouge_l": rouge, "early_exit_fraction": 0.1}
    ee = {"m2r2_exit": [row(0.5, 1.3, 0.4), row(0.9, 0.95, 1.0)],
          "m2r2_exit_confirm": [row(0.5, 1.1, 0.92), row(0.9, 0.9, 1.0)],
          "distance_exit": [row(0.5, 0.9, 0.3), row(0.9, 0.2, 0.95)]}
    t = R.targets({"early_exit": ee})["m2r2_exit_rouge_ge_0.9_faster_than_distance_exit"]
    assert t["met"] and t["value"]["m2r2"]["method"] == "m2r2_exit_confirm" and t["value"]["m2r2"]["speedup"] == 1.1
    assert t["value"]["distance_exit"]["speedup"] == 0.2
    ee["distance_exit"].append(row(0.7, 1.2, 0.91))
    assert not R.targets({"early_exit": ee})["m2r2_exit_rouge_ge_0.9_faster_than_distance_exit"]["met"]
    ee = {"m2r2_exit": [row(0.5, 1.3, 0.4)], "distance_exit": [row(0.9, 0.2, 0.95)]}
    t = R.targets({"early_exit": ee})["m2r2_exit_rouge_ge_0.9_faster_than_distance_exit"]
    assert not t["met"] and t["value"]["m2r2"] is None  # no M2R2 point keeps the quality


def test_targets_table_and_plots(tmp_path):
    rep = _fake_report()
    t = R.targets(rep)
    assert t["m2r2_spec_speedup_ge_1.5"]["met"] and t["m2r2_spec_efficiency_ge_0.85"]["met"]
    assert t["m2r2_above_distance_accepted"]["met"] and t["fast_above_slow_at_equal_compute"]["met"]
    rep["speculative"]["m2r2_spec"]["speedup_vs_ar"] = 1.1
    assert not R.targets(rep)["m2r2_spec_speedup_ge_1.5"]["met"]
    assert "m2r2_exit_rouge_ge_0.9_faster_than_distance_exit" not in t  # no distance_exit to compare with
    rep["speculative_one_core"] = {"cpu_cores": 1, "methods": {
        "ar": {"tokens_per_s": 15.0, "speedup_vs_ar": 1.0},
        "m2r2_spec": {"tokens_per_s": 18.0, "speedup_vs_ar": 1.2}}}
    t = R.targets(rep)
    assert t["m2r2_spec_speedup_ge_1.5_one_core"] == {"value": 1.2, "met": False}
    assert "m2r2_spec_efficiency_ge_0.85_one_core" not in t  # a one-core record without its costs
    rep["speculative_one_core"]["methods"]["m2r2_spec"]["efficiency"] = 0.9
    t = R.targets(rep)
    assert t["m2r2_spec_efficiency_ge_0.85_one_core"] == {"value": 0.9, "met": True}
    rep["targets"] = t
    text = R.table(rep)
    assert "pinned to one core" in text and "m2r2_spec 1.20x (18.0 tok/s, efficiency 0.90)" in text
    assert "one core, sampled" not in text
    rep["speculative_one_core"]["sampled"] = {"temperature": 0.8, "top_p": 1.0, "methods": {
        "ar": {"tokens_per_s": 14.0, "speedup_vs_ar": 1.0, "mean_accepted_tokens": 1.0},
        "m2r2_spec": {"tokens_per_s": 19.7, "speedup_vs_ar": 1.41, "mean_accepted_tokens": 4.36}}}
    assert "pinned to one core, sampled (temperature 0.8): m2r2_spec 1.41x, 4.36 accepted" in R.table(rep)
    rep["speculative_sampled"] = {"temperature": 0.8, "m2r2_spec": {"speedup_vs_ar": 1.1, "mean_accepted_tokens": 2.5}}
    rep["speculative"]["ar"]["distinct_token_fraction"] = 0.05
    text = R.table(rep)
    assert "sampled (temperature 0.8)" in text and "m2r2_spec 1.10x, 2.50 accepted" in text and "they loop" in text
    assert "m2r2_spec" in text and "MISSED" in text and "alignment" in text
    assert "whole round" not in text  # reports from before the round was timed still print
    assert "held-out text windows" not in text
    assert "base: held-out loss" not in text  # a report without the base's pre-training summary
    rep["models"] = {"base": {"pretrain": {"step": 150, "heldout_loss": 5.3706}}}
    assert ("base: held-out loss 5.37 nats/token after 150 pre-training steps; its layer 2 agrees with its "
            "output on 20% of held-out tokens") in R.table(rep)
    rep["speculative_heldout_contexts"] = {
        "m2r2_spec": {"mean_accepted_tokens": 2.4, "acceptance_by_position": [0.8, 0.6], "contexts": 32, "gamma": 2},
        "distance_spec": {"mean_accepted_tokens": 1.5, "acceptance_by_position": [0.5, 0.0], "contexts": 32, "gamma": 2}}
    assert ("first round after 32 held-out text windows (real text), tokens per verification: m2r2_spec 2.40 "
            "(answers 3.00) at gamma 2, distance_spec 1.50 (answers 2.00) at gamma 2") in R.table(rep)
    rep["speculative"]["m2r2_spec"]["costs"].update(round_cost_ratio=2.9, round_overhead=0.45)
    rep["speculative"]["m2r2_spec"]["ideal_speedup_from_round"] = 1.31
    assert "whole round 2.90 ar-steps (+0.45 beyond the two passes), bound 1.31x" in R.table(rep)
    written = R.write_plots(rep, tmp_path)
    assert {p.name for p in written} == {"alignment.png", "speculative.png", "batch_sweep.png", "early_exit.png"}


def test_table_moe_section():
    plats = ("pcie_gen4", "nvlink_c2c")
    sweep = {r: {"0.0": 0.8, "2.0": 1.1} for r in ("next_gate", "next_gate_lfu", "m2r2", "m2r2_lfu")}
    moe = {"recall": {"next_gate": 0.8, "m2r2": 0.81}, "hit_rate": {"next_gate": 0.9, "m2r2": 0.92},
           "simulated_speedup_model": "mixtral-8x7b", "capacity": 4,
           "simulated_speedup": {r: {pl: 1.0 for pl in plats} for r in ("on_demand_lfu", "m2r2", "m2r2_lfu")},
           "confidence_sweep": {pl: sweep for pl in plats},
           "recall_needed": {"recall": [0.86, 1.0], "break_even_recall": {"pcie_gen4": 0.93, "nvlink_c2c": None}},
           "lead_needed": {"lead_layers": [1, 2, 3], "speedup": {"pcie_gen4": [1.0, 1.1, 1.2], "nvlink_c2c": [0.9, 1.3, 1.4]}},
           "chunked_link": {"chunks": 4, "speedup_vs_whole_expert_on_demand_lru": {
               "m2r2_lfu": {"pcie_gen4": 1.25, "nvlink_c2c": 1.11}, "next_gate_lfu": {"pcie_gen4": 1.22, "nvlink_c2c": 1.1},
               "on_demand_lfu": {"pcie_gen4": 1.24, "nvlink_c2c": 1.09}}}}
    text = R.table({"moe": moe})
    assert ("on a link moving 4 pieces per expert (a miss preempts a prefetch): pcie_gen4 m2r2_lfu 1.25 / "
            "next_gate_lfu 1.22 / on_demand_lfu 1.24, nvlink_c2c m2r2_lfu 1.11") in text
    assert "m2r2_lfu gated" in text and "next_gate_lfu gated" in text and "1.10 @2" in text
    assert "m2r2 recall after the branch 0.86" in text and "pcie_gen4 0.93, nvlink_c2c never" in text
    assert "(a = 1/2/3): pcie_gen4 1.00/1.10/1.20, nvlink_c2c 0.90/1.30/1.40" in text
    assert "routing of the traced base" not in text  # reports without the figure still print
    moe["trace"] = {"expert_load": {"busiest_expert_load": 3.2, "collapsed": 4.0, "skewed": True}}
    assert ("routing of the traced base: busiest expert 3.20 x an even share (1 = balanced, 4 = every token "
            "picks the same experts)  SKEWED") in R.table({"moe": moe})
    moe["trace"]["expert_load"].update(busiest_expert_load=1.49, skewed=False)
    line = next(x for x in R.table({"moe": moe}).splitlines() if "routing of the traced base" in x)
    assert "1.49 x an even share" in line and "SKEWED" not in line


def test_budget_with_step_overrides():
    from m2r2_jax.bench.demo import BUDGETS, budget_with
    from m2r2_jax.errors import ConfigError

    b = budget_with("full", {"dense_steps": 500, "distill_steps": 480})
    assert (b.dense_steps, b.distill_steps) == (500, 480)
    assert b.moe_steps == BUDGETS["full"].moe_steps and BUDGETS["full"].dense_steps == 150  # a copy, not a change
    assert budget_with("tiny") == BUDGETS["tiny"]
    for bad, word in (({"dense_steps": 0}, "positive"), ({"distill_steps": True}, "positive"),
                      ({"moe_steps": 5}, "cannot be overridden")):
        with pytest.raises(ConfigError, match=word):
            budget_with("full", bad)
    with pytest.raises(ConfigError, match="--budget"):
        budget_with("huge")


def test_budget_layer_loops():
    """The full budget measures every method on the loop `auto` gives it (on CPU ar at its
    fastest, unrolled); the tiny one keeps the scan, whose programs compile faster."""
    from m2r2_jax.bench.demo import BUDGETS
    from m2r2_jax.decoding import api

    assert BUDGETS["full"].layer_loop == "auto" and BUDGETS["tiny"].layer_loop == "scan"
    for b in BUDGETS.values():
        for m in api.METHODS:
            assert api.resolve_layer_loop(b.layer_loop, m) in ("scan", "unrolled")


def test_spec_bench_categories_interleave_and_aggregate():
    from m2r2_jax.bench.prompts import interleave_categories, prompt_categories
    from m2r2_jax.bench.speculative import by_category

    cats = prompt_categories("spec_bench")
    assert set(cats) == {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"}
    assert cats.count("mt_bench") == 80 and prompt_categories("koala") is None
    order = interleave_categories(cats)
    assert sorted(order) == list(range(len(cats))) and len({cats[i] for i in order[:6]}) == 6
    spec = {"ar": {"tokens_per_s_per_answer": [10.0, 20.0, 30.0]},
            "m2r2_spec": {"tokens_per_s_per_answer": [20.0, 20.0, 60.0], "accepted_per_answer": [2.0, 1.0, 3.0]}}
    got = by_category(spec, ["a", "a", "b"])
    assert got["a"]["n_prompts"] == 2 and got["a"]["m2r2_spec"]["speedup_vs_ar"] == pytest.approx(20 / 15)
    assert got["a"]["m2r2_spec"]["mean_accepted_tokens"] == 1.5 and got["b"]["m2r2_spec"]["speedup_vs_ar"] == 2.0
    assert got["b"]["ar"]["speedup_vs_ar"] == 1.0 and "mean_accepted_tokens" not in got["b"]["ar"]
