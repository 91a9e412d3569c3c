"""`m2r2 bench` end to end on a tiny model, pinned to one CPU core (what `make demo` runs for its
one-core comparison), and the pinning helper's errors."""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import cpu_xla_flags
from m2r2_jax.bench.cpu_cores import pin_to_cores
from m2r2_jax.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "decoding"))
from cli_helpers import run_in_workers, run_m2r2  # noqa: E402


def test_pin_errors():
    n = len(os.sched_getaffinity(0))
    with pytest.raises(ConfigError, match=f"expected 1..{n}"):
        pin_to_cores(n + 1)
    with pytest.raises(ConfigError, match="expected 1"):
        pin_to_cores(0)
    import jax

    jax.devices()  # this test process already runs JAX: pinning now would leave its threads unpinned
    with pytest.raises(ConfigError, match="too late"):
        pin_to_cores(1)


def test_bench_cli_pinned_to_one_core(tmp_path):
    from decoding_helpers import model, random_m2r2
    from m2r2_jax.m2r2.checkpoint import save_m2r2
    from m2r2_jax.m2r2.loading import default_m2r2_config
    from m2r2_jax.models.checkpoint import params_fingerprint, save_model

    # two layers: every engine's layer loop is unrolled on CPU, so each of the ~55 programs this
    # bench compiles grows with the depth (4 layers: 78 s against 57 s here); one branch layer and
    # one fast step still give both drafters partial acceptance
    cfg, params = model("llama", vocab_size=64, n_layers=2)
    base = save_model(tmp_path / "base", cfg, params)
    mcfg = default_m2r2_config(cfg)
    m2r2 = save_m2r2(tmp_path / "m2r2", mcfg, random_m2r2(cfg, mcfg, 0), cfg, params_fingerprint(cfg, params))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"tokens": [1 + i, 5, 7 + i]}) + "\n" for i in range(3)))
    out = tmp_path / "out"
    # draft lengths tuned on the third prompt, benchmarked on the first two
    from m2r2_jax.decoding import draft_vocab as DV

    vocab = DV.save(tmp_path / "vocab.json", list(range(0, 64, 2)), 64, "test", np.ones(64))  # drafts from half
    # serving needs none of the training stack: a grain that cannot be imported must not matter
    blocked = tmp_path / "blocked" / "grain"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('grain is not installed here')\n")
    r = run_m2r2(["bench", f"--checkpoint={base}", f"--m2r2={m2r2}", f"--prompts={prompts}", f"--out={out}",
                  "--cpu_cores=1", "--batch_sizes=1", "--max_new_tokens=6", "--repeats=1", "--gamma=auto",
                  "--gamma_candidates=1,2", "--calibration_prompts=1", "--n_prompts=2", "--temperature=0.8",
                  f"--draft_vocab={tmp_path / 'vocab.json'}", "--kernel_implementation=xla"],
                 env={"PYTHONPATH": os.pathsep.join([str(blocked.parent), os.environ.get("PYTHONPATH", "")]),
                      "XLA_FLAGS": cpu_xla_flags(1, old_emitters=True)})  # compiling is most of this run
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads((out / "report.json").read_text())
    assert mcfg.kernel_implementation == "auto" and rep["m2r2"]["kernel_implementation"] == "xla"  # overridden
    assert rep["draft_vocab"]["size"] == vocab["size"] == 32
    ar_tokens = [t for a in rep["speculative"]["ar"]["answers"] for t in a]
    assert rep["draft_vocab"]["coverage_of_ar_answers"] == pytest.approx(sum(t % 2 == 0 for t in ar_tokens) / len(ar_tokens))
    assert rep["device"]["cpu_cores_in_use"] == 1
    # the default layer loop on CPU: ar and the drafters unrolled (ar at its fastest there)
    assert rep["layer_loop"] == {"ar": "unrolled", "m2r2_spec": "unrolled", "distance_spec": "unrolled"}
    assert "layer loop: unrolled (ar, m2r2_spec, distance_spec)" in r.stdout
    spec = rep["speculative"]
    assert set(spec) == {"ar", "m2r2_spec", "distance_spec"}
    assert spec["m2r2_spec"]["identical_to_ar"] and spec["distance_spec"]["identical_to_ar"]
    assert len(spec["m2r2_spec"]["speedup_vs_ar_per_answer"]) == 2 and rep["n_prompts"] == 2
    tuning = rep["gamma_tuning"]
    assert set(tuning) == {"m2r2_spec", "distance_spec"}
    for m, rec in tuning.items():
        assert rec["candidates"] == [1, 2] and rec["calibration_prompts"] == 1
        assert spec[m]["gamma"] == rec["gamma"] == rep["speculative_sampled"][m]["gamma"]
        assert len(spec[m]["acceptance_by_position"]) == rec["gamma"]
    assert "draft length m2r2_spec: gamma" in r.stdout
    assert (out / "gamma.png").is_file()
    for m in ("m2r2_spec", "distance_spec"):
        c = spec[m]["costs"]
        assert min(c["t_draft"], c["t_verify"], c["t_round"]) > 0  # timings: no ordering asserted (noise)
        assert c["round_overhead"] == pytest.approx((c["t_round"] - c["t_draft"] - c["t_verify"]) / c["t_ar_step"])
        assert spec[m]["ideal_speedup_from_round"] == pytest.approx(
            spec[m]["mean_accepted_tokens"] * c["t_ar_step"] / c["t_round"])
        assert c["t_prefill"] > 0 and c["t_prefill_ar"] == spec["ar"]["costs"]["t_prefill"] > 0
        assert len(c["samples"]) == 7  # 2 taken between the answers, topped up after them
        per = [spec[m]["mean_accepted_tokens"] * x["t_ar_step"] / (x["t_draft"] + x["t_verify"]) for x in c["samples"]]
        assert spec[m]["ideal_speedup_decode_only"] == pytest.approx(float(np.median(per)))
        lo, hi = spec[m]["ideal_speedup_spread"]
        assert lo <= spec[m]["ideal_speedup"] <= hi
        assert spec[m]["efficiency"] == pytest.approx(spec[m]["speedup_vs_ar"] / spec[m]["ideal_speedup"])
        # E[accepted] = 1 + sum_k P(draft position k accepted); tokens/s from the answers' own times
        assert spec[m]["mean_accepted_tokens"] == pytest.approx(1 + sum(spec[m]["acceptance_by_position"]))
        assert spec[m]["tokens_per_s"] == pytest.approx(
            np.mean([len(a) / t for a, t in zip(spec[m]["answers"], spec[m]["seconds_per_answer"])]))
        assert spec[m]["efficiency_decode_only"] == pytest.approx(
            spec[m]["speedup_vs_ar"] / spec[m]["ideal_speedup_decode_only"])
    sampled = rep["speculative_sampled"]
    assert sampled["temperature"] == 0.8 and set(sampled) >= {"ar", "m2r2_spec", "distance_spec"}
    assert sampled["m2r2_spec"]["speedup_vs_ar"] == pytest.approx(
        sampled["m2r2_spec"]["tokens_per_s"] / sampled["ar"]["tokens_per_s"])
    assert "sampled (temperature 0.8)" in r.stdout
    from m2r2_jax.bench.demo import one_core_summary  # what `make demo` keeps of its one-core run

    kept = one_core_summary(rep)
    assert set(kept["methods"]) == set(spec) and kept["methods"]["m2r2_spec"]["identical_to_ar"]
    assert kept["sampled"]["temperature"] == 0.8 and set(kept["sampled"]["methods"]) == {"ar", "m2r2_spec",
                                                                                        "distance_spec"}
    assert kept["sampled"]["methods"]["ar"]["speedup_vs_ar"] == 1.0
    assert kept["methods"]["m2r2_spec"]["gamma"] == spec["m2r2_spec"]["gamma"]
    assert kept["layer_loop"] == rep["layer_loop"]
    assert kept["methods"]["m2r2_spec"]["efficiency"] == spec["m2r2_spec"]["efficiency"]
    assert kept["methods"]["m2r2_spec"]["ideal_speedup"] == spec["m2r2_spec"]["ideal_speedup"]
    assert kept["methods"]["m2r2_spec"]["efficiency_decode_only"] == spec["m2r2_spec"]["efficiency_decode_only"]
    # the bad inputs: one `m2r2 bench` each, run in one process (verb_worker.py: the verb's main
    # under the same run_verb as the console script, stderr captured per case) so JAX starts once;
    # the real process and its pinning are what the run above checks
    short, bad_gamma, bad_top_p, no_kernel = run_in_workers({"bench": [
        [f"--checkpoint={base}", f"--prompts={prompts}", f"--out={out}", "--gamma=auto", "--n_prompts=3"],
        [f"--checkpoint={base}", f"--out={out}", "--gamma=m2r2_spec=0"],
        [f"--checkpoint={base}", f"--out={out}", "--top_p=1.5"],
        [f"--checkpoint={base}", f"--m2r2={m2r2}", f"--prompts={prompts}", f"--out={out}", "--batch_sizes=1",
         "--max_new_tokens=2", "--repeats=1", "--n_prompts=1", "--kernel_implementation=pallas"],
    ]})["bench"]
    for bad in (short, bad_gamma, bad_top_p, no_kernel):
        assert bad["code"] != 0 and bad["traceback"] is None, bad
    assert "--gamma auto needs 4 calibration prompts after the first --n_prompts=3" in short["stderr"]
    assert "Traceback" not in short["stderr"]
    assert "draft length must be a positive integer" in bad_gamma["stderr"]
    assert "top_p=1.5 is invalid" in bad_top_p["stderr"] and "Traceback" not in bad_top_p["stderr"]
    # no kernel on a CPU: one line, no traceback
    assert "implementation='pallas' needs a TPU or an NVIDIA GPU" in no_kernel["stderr"]
    assert "Traceback" not in no_kernel["stderr"]
