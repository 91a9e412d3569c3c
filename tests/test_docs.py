"""The documentation agrees with the code: every report.json key docs/REPORT.md documents is written
by the code, every key the demo writes is documented, every relative link in README.md and docs/
points to a file that exists, and the README stays a short front door. Reads files only (no demo
run, no JAX)."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REPORT_MD = ROOT / "docs" / "REPORT.md"

# The code that writes report.json, moe_report.json and the records they embed.
SOURCES = [
    "m2r2_jax/bench/demo.py",
    "m2r2_jax/bench/demo_pretrained.py",
    "m2r2_jax/bench/roofline.py",
    "m2r2_jax/bench/report.py",
    "m2r2_jax/bench/speculative.py",
    "m2r2_jax/bench/gamma.py",
    "m2r2_jax/bench/gamma_tuning.py",
    "m2r2_jax/bench/compile_cache.py",
    "m2r2_jax/bench/cpu_cores.py",
    "m2r2_jax/cli/bench.py",
    "m2r2_jax/m2r2/analysis.py",
    "m2r2_jax/moe_offload/report.py",
    "m2r2_jax/moe_offload/metrics.py",
    "m2r2_jax/moe_offload/simulator.py",
    "m2r2_jax/moe_offload/platforms.py",
    "m2r2_jax/moe_offload/record.py",
]

# What `m2r2 demo` writes, collected by reading bench/demo.py and the functions it calls
# (speculative.compare_methods / round_costs / batch_throughput_side_by_side / sampled_comparison /
# context_acceptance / early_exit_sweep, gamma_tuning.tune_gammas, analysis.alignment, report.targets,
# compile_cache, cpu_cores.device_summary, moe_offload.report.moe_report). Each must be documented.
DEMO_KEYS = {
    # top level
    "budget", "device", "budget_settings", "models", "sample", "alignment", "gamma_tuning", "speculative",
    "layer_loop", "speculative_one_core", "speculative_sampled", "speculative_heldout_contexts", "early_exit",
    "moe", "timings", "compile_cache", "targets",
    # device, sample, timings, compile_cache
    "platform", "device_kind", "count", "cpu_count", "cpu_cores_in_use", "machine", "jax",
    "prompt", "temperature", "text",
    "pretrain_s", "distill_s", "alignment_s", "gamma_tuning_s", "speculative_s", "early_exit_s", "moe_s", "total_s",
    "hits", "compile_s_saved",
    # alignment
    "slow_agreement", "fast_agreement", "slow_cosine", "fast_cosine", "slow_cost", "fast_cost", "visited_layers",
    "branch_layer", "tokens", "fast_beats_slow_at_equal_compute",
    # speculative[method]
    "tokens_per_s", "tokens_per_s_per_answer", "seconds_per_answer", "generated_tokens", "answers", "costs",
    "batch_sweep", "layers_per_token", "distinct_token_fraction", "identical_to_ar", "mean_accepted_tokens",
    "accepted_per_answer", "gamma", "acceptance_by_position", "draft_cost_layers", "draft_cost_ratio_layers",
    "efficiency", "speedup_vs_ar", "speedup_vs_ar_per_answer", "ideal_speedup", "ideal_speedup_spread",
    "ideal_speedup_decode_only", "efficiency_decode_only", "ideal_speedup_from_round",
    "ideal_speedup_if_verify_is_one_step",
    # speculative[method].costs and its samples
    "t_ar_step", "t_draft", "t_verify", "t_round", "t_prefill", "t_prefill_ar", "t_ar_step_spread",
    "t_draft_spread", "t_verify_spread", "t_round_spread", "t_prefill_spread", "draft_cost_per_token",
    "verify_cost_ratio", "round_cost_ratio", "round_overhead", "samples",
    # batch_sweep rows
    "batch_size", "seconds", "seconds_all",
    # gamma_tuning[method]
    "candidates", "expected_tokens", "predicted_speedup", "calibration_prompts",
    # speculative_one_core, speculative_sampled, speculative_heldout_contexts
    "cpu_cores", "command", "methods", "sampled", "top_p", "contexts",
    # early_exit rows
    "threshold", "speedup", "rouge_l", "agreement", "early_exit_fraction",
    # targets
    "value", "met", "source", "m2r2_spec_speedup_ge_1.5", "m2r2_spec_efficiency_ge_0.85",
    "m2r2_spec_identical_to_ar", "m2r2_above_distance_accepted", "m2r2_above_distance_speedup",
    "m2r2_spec_speedup_ge_1.5_one_core", "m2r2_spec_efficiency_ge_0.85_one_core",
    "fast_above_slow_at_equal_compute",
    # models
    "base", "m2r2", "draft", "config", "params", "pretrain", "distill",
    # moe
    "model", "trace", "capacity", "recall", "recall_after_branch", "recall_per_layer", "recall_by_lookahead",
    "hit_rate", "simulated_speedup", "simulated_speedup_model", "ceiling", "simulation", "confidence_sweep",
    "recall_needed", "chunked_link", "lead_needed", "rho_sweep", "bandwidth_capacity_sweep", "assumptions",
    "engine", "simulation_measured_costs",
    "expert_load", "skewed", "busiest_expert_load", "teacher_forced", "sources", "fast_steps", "fast_steps_max",
    "recall_by_fast_steps", "break_even_recall", "speedup_vs_whole_expert_on_demand_lru", "regime",
    "bound_speedup_vs_on_demand_lru", "speedup_vs_on_demand_lru", "tokens_equal_all_resident",
    "m2r2_recall_above_next_gate_at_lookahead_ge_2", "m2r2_lfu_faster_than_on_demand_lfu_per_platform",
    "speedup_ge_{TARGET_SPEEDUP}_reachable_by_any_policy",
}

# what the default demo (bench/demo_pretrained.py) writes beyond the keys above
PRETRAINED_DEMO_KEYS = {
    "model", "base", "prompts", "stop_ids", "draft_vocab", "set", "n", "chat_template",
    "name", "fingerprint", "source", "heldout_perplexity", "heldout_tokens", "heldout_text",
    "sampled_repeats", "exit_repeats", "align_seq_len", "head_cost_layers", "checkpoint", "recipe",
    "base_s", "m2r2_s", "file", "size", "coverage_of_ar_answers",
    "ar_roofline", "weight_bytes_per_token", "copy_bandwidth", "bytes_per_s", "spread", "buffer_bytes", "threads",
    "bound_tokens_per_s", "ar_tokens_per_s", "fraction_of_bound",
}

# the keys `m2r2 bench` adds to the demo's schema
BENCH_KEYS = {"prompts", "n_prompts", "stop_ids", "fresh_m2r2_params", "sharding", "draft_vocab",
              "speculative_by_category", "coverage_of_ar_answers"}


def documented_keys() -> list:
    """Keys in REPORT.md: the backticked name at the start of a list item."""
    return re.findall(r"^\s*- `([^`]+)`", REPORT_MD.read_text(), flags=re.M)


def _fstring_text(node: ast.JoinedStr) -> str:
    """f"speedup_ge_{TARGET_SPEEDUP}_x" -> "speedup_ge_{TARGET_SPEEDUP}_x"."""
    return "".join(v.value if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}" for v in node.values)


def names_in_code() -> set:
    """Every name the report code can write as a key: string literals (dict keys, subscripts),
    f-string templates, keyword arguments (dict(..., key=...), rec.update(key=...)) and dataclass
    fields (dataclasses.asdict)."""
    names = set()
    for rel in SOURCES:
        tree = ast.parse((ROOT / rel).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)
            elif isinstance(node, ast.JoinedStr):
                names.add(_fstring_text(node))
            elif isinstance(node, ast.keyword) and node.arg:
                names.add(node.arg)
            elif isinstance(node, ast.ClassDef):
                names.update(s.target.id for s in node.body
                             if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name))
    return names


def test_report_md_documents_keys():
    keys = documented_keys()
    assert len(keys) > 150, "REPORT.md lists its keys as '- `key`: ...' items"


def test_every_documented_key_is_written_by_the_code():
    code = names_in_code()
    missing = sorted({k for k in documented_keys() if k not in code})
    assert not missing, f"documented in docs/REPORT.md but not found in {', '.join(SOURCES)}: {missing}"


@pytest.mark.parametrize("keys", [DEMO_KEYS, PRETRAINED_DEMO_KEYS, BENCH_KEYS], ids=["demo", "pretrained", "bench"])
def test_every_key_written_is_documented(keys):
    undocumented = sorted(keys - set(documented_keys()))
    assert not undocumented, f"written to report.json but not documented in docs/REPORT.md: {undocumented}"


def test_the_fixed_key_lists_are_real_keys():
    """DEMO_KEYS and BENCH_KEYS themselves must name keys the code writes (a renamed key fails here)."""
    code = names_in_code()
    assert not sorted((DEMO_KEYS | PRETRAINED_DEMO_KEYS | BENCH_KEYS) - code)


def _markdown_files() -> list:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def _links(text: str) -> list:
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold no links
    return re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", text)


def _anchors(path: Path) -> set:
    """GitHub's anchors of a markdown file's headings."""
    out = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


@pytest.mark.parametrize("md", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files(md):
    bad = []
    for link in _links(md.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        path = md if not target else (md.parent / target).resolve()
        if not path.exists():
            bad.append(link)
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            bad.append(link + " (no such heading)")
    assert not bad, f"{md.relative_to(ROOT)}: broken links {bad}"


def test_readme_is_short_and_lists_every_verb_and_model_config():
    from m2r2_jax.cli.main import VERBS

    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 200
    verbs = re.findall(r"^\| `([a-z-]+)` \|", text, flags=re.M)
    assert sorted(verbs) == sorted(VERBS), "README's verb table differs from m2r2_jax/cli/main.py VERBS"
    for cfg in (ROOT / "configs" / "models").glob("*.py"):
        assert f"`{cfg.stem}`" in text, f"README does not name configs/models/{cfg.name}"


def test_every_results_file_is_in_the_index():
    index = (ROOT / "docs" / "RESULTS.md").read_text()
    for f in (ROOT / "docs" / "results").glob("*.md"):
        assert f"(results/{f.name})" in index, f"docs/results/{f.name} is not linked from docs/RESULTS.md"


def test_licence_and_citation():
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text()
    assert "2502.02040" in (ROOT / "CITATION.cff").read_text()
