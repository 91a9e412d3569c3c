"""Draft-length tuning: expected tokens from per-position acceptance, the choice rule, the command
line syntax, and a real tuning run on a tiny model (acceptance consistent with a plain run)."""

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from m2r2_jax.bench import gamma as G
from m2r2_jax.bench.gamma_tuning import tune_gammas
from m2r2_jax.bench import report as R
from m2r2_jax.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "decoding"))


def test_expected_tokens_and_choice():
    acc = [0.9, 0.8, 0.5, 0.1]
    assert G.expected_tokens(acc, 1) == pytest.approx(1.9)
    assert G.expected_tokens(acc, 2) == pytest.approx(2.7)
    assert G.expected_tokens(acc, 4) == pytest.approx(3.3)
    with pytest.raises(ValueError, match="beyond the 4 measured"):
        G.expected_tokens(acc, 5)
    rec = G.choose(acc, 1.0, {4: 4.0, 1: 2.0, 2: 2.5})
    assert rec["candidates"] == [1, 2, 4] and rec["gamma"] == 2
    assert rec["predicted_speedup"] == pytest.approx([0.95, 2.7 / 2.5, 3.3 / 4.0])
    # equal predictions: the shorter draft (less work wasted when acceptance drifts)
    assert G.choose([1.0, 1.0], 1.0, {1: 2.0, 2: 3.0})["gamma"] == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=10), st.data())
def test_choice_maximises_predicted_speedup(raw, data):
    acc = sorted(raw, reverse=True)  # P(position k accepted) never grows with k
    cands = data.draw(st.lists(st.integers(1, len(acc)), min_size=1, max_size=len(acc), unique=True))
    costs = {g: data.draw(st.floats(0.5, 20.0)) for g in cands}
    t_ar = data.draw(st.floats(0.1, 5.0))
    rec = G.choose(acc, t_ar, costs)
    exp = [1.0 + sum(acc[:g]) for g in rec["candidates"]]
    assert np.all(np.diff(exp) >= -1e-12)
    assert rec["expected_tokens"] == pytest.approx(exp)
    pred = [e * t_ar / costs[g] for e, g in zip(exp, rec["candidates"])]
    assert rec["predicted_speedup"] == pytest.approx(pred)
    assert pred[rec["candidates"].index(rec["gamma"])] == pytest.approx(max(pred))


def test_parse_gamma():
    methods = ("m2r2_spec", "distance_spec", "two_model")
    assert G.parse_gamma("4", methods) == 4
    assert G.parse_gamma(" auto ", methods) == "auto"
    assert G.parse_gamma("m2r2_spec=8,distance_spec=2", methods) == {"m2r2_spec": 8, "distance_spec": 2}
    for bad, msg in (("0", "positive integer"), ("four", "positive integer"), ("m2r2=3", "'m2r2' is not one of"),
                     ("m2r2_spec=x", "positive integer"), ("m2r2_spec=0", "positive integer")):
        with pytest.raises(ConfigError, match=msg):
            G.parse_gamma(bad, methods)
    assert G.parse_candidates(["4", "1", "4"]) == (1, 4)
    for bad in (["0", "2"], ["x"], []):
        with pytest.raises(ConfigError, match="gamma_candidates"):
            G.parse_candidates(bad)
    gammas, records = G.resolve_gammas({"m2r2_spec": 6}, ("ar",) + methods, tune=None)
    assert gammas == {"m2r2_spec": 6, "distance_spec": 4, "two_model": 4} and records == {}
    gammas, records = G.resolve_gammas("auto", ("ar", "m2r2_spec"), tune=lambda ms: {m: {"gamma": 3, "m": m} for m in ms})
    assert gammas == {"m2r2_spec": 3} and records["m2r2_spec"]["m"] == "m2r2_spec"


def test_tune_gammas_on_a_tiny_model():
    from decoding_helpers import model, random_m2r2
    from m2r2_jax.bench import speculative as S
    from m2r2_jax.decoding import api
    from m2r2_jax.m2r2.loading import default_m2r2_config

    cfg, params = model("llama", vocab_size=64)
    mcfg = default_m2r2_config(cfg)
    m2r2 = (mcfg, random_m2r2(cfg, mcfg, 0, adapter_scale=0.1))
    prompts = [[1, 5, 7], [3, 9, 2, 4]]
    records = tune_gammas(("m2r2_spec", "distance_spec"), cfg, params, prompts, max_new_tokens=10,
                            candidates=(3, 1), m2r2=m2r2, repeats=2)
    assert set(records) == {"m2r2_spec", "distance_spec"}
    assert records["m2r2_spec"]["t_ar_step"] == records["distance_spec"]["t_ar_step"]  # one shared ar step
    rec = records["m2r2_spec"]
    assert rec["candidates"] == [1, 3] and rec["gamma"] in (1, 3) and rec["calibration_prompts"] == 2
    assert min(rec["t_round"]) > 0 and rec["t_ar_step"] > 0
    # the acceptance it chose from is that of a plain run at the largest candidate, fixed draft length
    eng = api.build_engine("m2r2_spec", cfg, params, max_new_tokens=10, gamma=3, m2r2=m2r2)
    res = api.run_engine(eng, prompts, batch_size=1, width=4, fixed_batch=True)
    assert rec["acceptance_by_position"] == pytest.approx(S.acceptance_by_position(res, 3))
    assert rec["expected_tokens"] == pytest.approx([G.expected_tokens(rec["acceptance_by_position"], g) for g in (1, 3)])
    assert rec["predicted_speedup"] == pytest.approx([e * rec["t_ar_step"] / t for e, t in
                                                      zip(rec["expected_tokens"], rec["t_round"])])
    assert "m2r2_spec: gamma" in G.format_choice("m2r2_spec", rec)
    with pytest.raises(ConfigError, match="calibration prompt"):
        tune_gammas(("m2r2_spec",), cfg, params, [], max_new_tokens=10, m2r2=m2r2)


def test_accepted_tokens_compared_at_equal_gamma():
    """With tuned draft lengths the methods run at different gammas; the acceptance target then
    compares them at m2r2_spec's gamma from the tuning curves, not across gammas."""
    rep = {"speculative": {"ar": {}, "m2r2_spec": {"gamma": 3, "mean_accepted_tokens": 3.5},
                           "distance_spec": {"gamma": 1, "mean_accepted_tokens": 1.9}},
           "gamma_tuning": {"m2r2_spec": {"acceptance_by_position": [0.9, 0.8, 0.7]},
                            "distance_spec": {"acceptance_by_position": [0.95, 0.9, 0.85]}}}
    t = R._accepted_at_equal_gamma(rep, rep["speculative"]["m2r2_spec"], rep["speculative"]["distance_spec"])
    assert t["value"] == pytest.approx([3.4, 3.7]) and t["gamma"] == 3 and not t["met"]
    assert "tuning" in t["source"]
    rep["speculative"]["distance_spec"]["gamma"] = 3  # same gamma: the benchmark runs themselves
    t = R._accepted_at_equal_gamma(rep, rep["speculative"]["m2r2_spec"], rep["speculative"]["distance_spec"])
    assert t["value"] == [3.5, 1.9] and t["met"] and t["source"] == "benchmark runs"
