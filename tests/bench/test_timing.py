"""Side-by-side timing: call pattern, medians, rotation, and one compile per in-graph component."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from m2r2_jax.bench import speculative as S
from m2r2_jax.decoding.api import SequenceResult
from m2r2_jax.errors import ConfigError


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_rotations_put_every_method_in_every_slot(n):
    names = [f"m{i}" for i in range(n)]
    orders = [S._rotations(names, r) for r in range(n)]
    assert all(sorted(o) == names for o in orders)
    for slot in range(n):  # over n consecutive repeats each method runs once in each position
        assert sorted(o[slot] for o in orders) == names


class _FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_side_by_side_interleaves_and_takes_medians(monkeypatch):
    """A fake engine advances a fake clock; the machine gets 3x slower after the 4th timed pair.
    Every (repeat, prompt) runs all methods back to back, so both see the slowdown alike, while
    timing one method after the other (the old way) charges it to one of them."""
    clock = _FakeClock()
    calls = []
    cost = {"fast": 1.0, "slow": 2.0}

    def fake_run(engine, prompts, batch_size, width, tau):
        calls.append((engine, tuple(prompts[0]), tau))
        load = 3.0 if len(calls) > SWITCH else 1.0
        clock.now += cost[engine] * load * len(prompts[0])
        return [SequenceResult(tokens=list(prompts[0]) * 2, accepted=[], rounds=1, target_layers=0, draft_layers=0)]

    monkeypatch.setattr(S, "_run", fake_run)
    monkeypatch.setattr(S.time, "perf_counter", clock)
    prompts = [[1], [2, 2]]
    out = S.per_answer_timing_side_by_side({"a": ("fast", 0.5), "b": ("slow", 0.9)}, prompts, width=2, repeats=3)
    # two compiles first, then repeats x prompts x methods timed calls, each (repeat, prompt) pair adjacent
    assert [c[0] for c in calls[:2]] == ["fast", "slow"]
    timed = calls[2:]
    assert len(timed) == 3 * 2 * 2
    for pair in zip(timed[::2], timed[1::2]):
        assert {c[0] for c in pair} == {"fast", "slow"} and pair[0][1] == pair[1][1]
    assert all(c[2] == (0.5 if c[0] == "fast" else 0.9) for c in calls)
    for name, engine in (("a", "fast"), ("b", "slow")):
        results, tps, secs = out[name]
        assert [r.tokens for r in results] == [[1, 1], [2, 2, 2, 2]]
        for i, p in enumerate(prompts):
            per_call = sorted(c for c in _durations(calls, engine, p))
            assert secs[i] == pytest.approx(per_call[1])  # median of 3
            assert tps[i] == pytest.approx(2 * len(p) / secs[i])
    # the slow method is 2x the fast one per answer, whatever the load did
    ratio = [b / a for a, b in zip(out["a"][2], out["b"][2])]
    assert ratio == pytest.approx([2.0, 2.0])

    # one method after the other: the slowdown lands on the second method only
    calls.clear()
    first = S.per_answer_timing("fast", prompts, width=2, repeats=3, tau=0.5)
    second = S.per_answer_timing("slow", prompts, width=2, repeats=3, tau=0.9)
    assert [b / a for a, b in zip(first[2], second[2])] == pytest.approx([6.0, 6.0])


SWITCH = 10  # calls before the machine slows down: 2 compiles + 4 timed pairs


def _durations(calls, engine, prompt):
    """Re-derive each timed call's duration from the fake cost model (load switch after SWITCH calls)."""
    out = []
    for idx, c in enumerate(calls, start=1):
        if idx <= 2 or c[0] != engine or list(c[1]) != list(prompt):
            continue
        load = 3.0 if idx > SWITCH else 1.0
        out.append({"fast": 1.0, "slow": 2.0}[engine] * load * len(prompt))
    return out


def test_between_runs_after_each_group_outside_the_timed_calls(monkeypatch):
    clock = _FakeClock()
    log = []

    def fake_run(engine, prompts, batch_size, width, tau):
        log.append(("run", engine))
        clock.now += 1.0
        return [SequenceResult(tokens=[1], accepted=[], rounds=1, target_layers=0, draft_layers=0)]

    def between(g):
        log.append(("between", g))
        clock.now += 100.0  # would show in every answer's time if it ran inside a timed call

    monkeypatch.setattr(S, "_run", fake_run)
    monkeypatch.setattr(S.time, "perf_counter", clock)
    out = S.per_answer_timing_side_by_side({"a": ("x", 0.5), "b": ("y", 0.5)}, [[1], [2], [3]], width=1, repeats=2,
                                           between=between)
    assert [e for e in log if e[0] == "between"] == [("between", g) for g in range(6)]
    timed = log[2:]  # after the two compiles: each group is two runs, then its between
    assert [e[0] for e in timed] == ["run", "run", "between"] * 6
    assert all(t == 1.0 for _, _, secs in out.values() for t in secs)


@pytest.mark.parametrize("groups,samples", [(15, 7), (7, 7), (3, 7), (48, 7), (1, 1)])
def test_spread_schedule_takes_samples_spread_over_the_groups(groups, samples):
    at = S.spread_schedule(groups, samples)
    assert len(at) == min(groups, samples) and max(at) == groups - 1 and min(at) >= 0
    gaps = sorted(at)
    assert max(b - a for a, b in zip([-1] + gaps, gaps)) <= -(-groups // min(groups, samples))


def test_timer_sampled_in_between_is_topped_up_to_the_repeats():
    comps = {"a": (lambda c: c * 1.0001 + 1.0, jnp.ones((4,))), "b": (lambda c: c @ jnp.eye(4), jnp.ones((4,)))}
    timer = S.InGraphTimer(comps, n_short=1, n_long=3)
    timer.measure(0)
    timer.measure(1)
    assert timer.samples == 2
    while timer.samples < 5:
        timer.measure(timer.samples)
    res = timer.result()
    assert set(res) == {"a", "b"} and all(len(v) == 5 for v in timer.per.values())
    for r in res.values():
        assert r["spread"][0] <= r["seconds"] <= r["spread"][1]


def test_in_graph_seconds_compiles_each_component_once():
    traces = {"a": 0, "b": 0}

    def make(name, k):
        def fn(c):
            traces[name] += 1  # runs at trace time only
            return c @ jnp.eye(c.shape[0]) * k + 1.0
        return fn

    comps = {"a": (make("a", 1.0), jnp.ones((8, 8))), "b": (make("b", 0.5), jnp.ones((16, 16)))}
    out = S.in_graph_seconds(comps, repeats=3, n_short=1, n_long=4)
    assert traces == {"a": 1, "b": 1}  # the trip count is a runtime argument: one program each
    for name in comps:
        lo, hi = out[name]["spread"]
        assert 0 < lo <= out[name]["seconds"] <= hi


def test_durations_helper_matches_cost_model():
    # guards the helper the interleaving test relies on
    calls = [("fast", (1,), 0.5)] * 2 + list(itertools.islice(itertools.cycle([("fast", (1,), 0.5)]), 10))
    assert _durations(calls, "fast", [1]) == [1.0] * (SWITCH - 2) + [3.0] * 2


def test_sampled_comparison_and_distinct_fraction():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "decoding"))
    from decoding_helpers import model, random_m2r2
    from m2r2_jax.m2r2.loading import default_m2r2_config

    cfg, params = model("llama", vocab_size=64)
    mcfg = default_m2r2_config(cfg)
    out = S.sampled_comparison(cfg, params, [[1, 2, 3], [4, 5]], max_new_tokens=6, temperature=0.8, gamma=2,
                               m2r2=(mcfg, random_m2r2(cfg, mcfg, 0)), repeats=1)
    assert out["temperature"] == 0.8 and set(out) >= {"ar", "m2r2_spec", "distance_spec"}
    assert out["ar"]["speedup_vs_ar"] == 1.0 and out["ar"]["mean_accepted_tokens"] == 1.0
    from m2r2_jax.decoding import api

    for m in ("m2r2_spec", "distance_spec"):
        # the same draws again, prompt by prompt as the comparison makes them (batch 1, seed 0)
        eng = api.build_engine(m, cfg, params, max_new_tokens=6, temperature=0.8, gamma=2,
                               m2r2=(mcfg, random_m2r2(cfg, mcfg, 0)), layer_loop="auto")
        again = [api.run_engine(eng, [p], batch_size=1, width=3, fixed_batch=True)[0] for p in ([1, 2, 3], [4, 5])]
        assert out[m]["mean_accepted_tokens"] == pytest.approx(np.mean([a for r in again for a in r.accepted]))
        assert out[m]["distinct_token_fraction"] == pytest.approx(S.distinct_token_fraction(again))
        assert out[m]["speedup_vs_ar"] == pytest.approx(out[m]["tokens_per_s"] / out["ar"]["tokens_per_s"])
    looping = [SequenceResult(tokens=[7, 7, 7, 7], accepted=[], rounds=1, target_layers=0, draft_layers=0),
               SequenceResult(tokens=[1, 2], accepted=[], rounds=1, target_layers=0, draft_layers=0)]
    assert S.distinct_token_fraction(looping) == pytest.approx((1 / 4 + 1) / 2)


def test_context_acceptance_is_the_first_round_after_each_context():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "decoding"))
    from decoding_helpers import model, random_m2r2, sharpen
    from m2r2_jax.decoding import api
    from m2r2_jax.m2r2.loading import default_m2r2_config

    cfg, params = model("llama", vocab_size=64)
    params = sharpen(cfg, params, 1.0)
    mcfg = default_m2r2_config(cfg)
    m2r2 = (mcfg, random_m2r2(cfg, mcfg, 0))
    contexts = [[1, 2, 3], [4, 5, 6, 7], [9, 8], [10, 11, 12], [13], [20, 30, 40, 50]]
    out = S.context_acceptance(cfg, params, contexts, gamma={"m2r2_spec": 3, "distance_spec": 2}, m2r2=m2r2,
                               draft=(cfg, params), batch_size=4)
    assert set(out) == {"m2r2_spec", "distance_spec", "two_model"}
    # a draft model that is the target itself guesses every token: every draft is accepted
    assert out["two_model"]["mean_accepted_tokens"] == 5.0 and out["two_model"]["acceptance_by_position"] == [1.0] * 4
    for m, g in (("m2r2_spec", 3), ("distance_spec", 2)):
        rec = out[m]
        assert rec["gamma"] == g and rec["contexts"] == len(contexts)
        # the same first rounds as a longer generation from the same contexts
        long = api.run_engine(api.build_engine(m, cfg, params, max_new_tokens=12, gamma=g, m2r2=m2r2), contexts,
                              batch_size=4, fixed_batch=True)
        first = np.asarray([r.accepted[0] for r in long])
        assert rec["mean_accepted_tokens"] == pytest.approx(first.mean())
        assert rec["acceptance_by_position"] == pytest.approx([np.mean(first > k) for k in range(1, g + 1)])
        assert all(a >= b for a, b in zip(rec["acceptance_by_position"], rec["acceptance_by_position"][1:]))
    with pytest.raises(ConfigError, match="at least one context"):
        S.context_acceptance(cfg, params, [], gamma=2, m2r2=m2r2)


def _timing_engines(head_sign: float):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "decoding"))
    from decoding_helpers import model, random_m2r2, sharpen
    from m2r2_jax.decoding import api
    from m2r2_jax.m2r2.loading import default_m2r2_config

    cfg, params = model("llama", vocab_size=64)
    params = sharpen(cfg, params, head_sign)
    mcfg = default_m2r2_config(cfg)
    m2r2 = (mcfg, random_m2r2(cfg, mcfg, 0))
    engines = {m: api.build_engine(m, cfg, params, max_new_tokens=16, gamma=2, m2r2=m2r2)
               for m in ("m2r2_spec", "distance_spec")}
    return engines, api.build_engine("ar", cfg, params, max_new_tokens=16)


def test_round_cost_components_keep_every_pass_live():
    """Each timed component's result depends on the logits its pass computes (so the compiler
    cannot drop the LM head from the timing), computed from the parameters in its carry: flipping
    the sign of the LM head there changes every component's output. Every pass and the round decode
    at new positions each iteration (commit_width further on), wrapping before max_new, so the
    sequence never finishes however often they run."""
    import jax

    comps = [S.round_cost_components(*_timing_engines(sign), [1, 2, 3], width=4) for sign in (1.0, -1.0)]
    # the first sign's functions and state with each sign's parameters: the outputs differ only if
    # the parameters are read from the carry (runtime values, as in the generation program), not
    # baked into the functions as constants
    outs = [{k: comps[0][k][0]((carry[0],) + comps[0][k][1][1:])[-1] for k, (_, carry) in c.items()} for c in comps]
    assert set(outs[0]) == {("ar", "step"), ("ar", "prefill")} | {
        (m, p) for m in ("m2r2_spec", "distance_spec") for p in ("draft", "verify", "round", "prefill")}
    for key in outs[0]:
        a, b = outs[0][key], outs[1][key]
        assert (a.pending != b.pending).any() or (a.out != b.out).any(), key
    engines, ar = _timing_engines(1.0)
    comps = S.round_cost_components(engines, ar, [1, 2, 3], width=4)
    for key, (fn, carry) in comps.items():
        if key[1] == "prefill":
            continue
        spec = (ar if key[0] == "ar" else engines[key[0]]).spec
        stride, span = spec.commit_width, spec.max_new - spec.commit_width
        assert span > 3 * stride  # the engines leave room for three moves before the wrap
        n_gen = [int(carry[1].n_gen[0])]
        for _ in range(span // stride + 2):  # past the wrap
            carry = jax.jit(fn)(carry)
            n_gen.append(int(carry[1].n_gen[0]))
            assert not bool(carry[1].done[0]), key
        assert n_gen[:4] == [1, 1 + stride, 1 + 2 * stride, 1 + 3 * stride], key
        assert all(1 <= n <= span for n in n_gen) and all(a != b for a, b in zip(n_gen, n_gen[1:])), key
        if key[1] == "round":
            assert int(carry[1].out[0, 1:].astype(bool).sum()) > 0  # the round's commit wrote tokens


def test_prefill_component_is_the_engines_prefill_and_stays_in_the_loop():
    """The timed prefill computes what the generation program's prefill computes (first token and
    KV cache equal to `prefill_batch`), hands the next iteration the prompt unchanged, and makes
    that prompt depend on its own output, so the loop cannot hoist it as loop-invariant."""
    import jax

    from m2r2_jax.decoding import api

    engines, ar = _timing_engines(1.0)
    for engine in (ar, engines["m2r2_spec"]):
        fn, carry = S.prefill_component(engine, [1, 2, 3], width=4)
        params, toks, st = jax.jit(lambda c: fn(fn(c)))(carry)
        prompt, lengths, valid = api.pad_batch([[1, 2, 3]], 1, 4)
        ref = api.prefill_batch(engine.spec, engine.params, prompt, lengths, api.sequence_keys(0, [0]), valid)
        assert (toks == carry[1]).all()
        assert (st.pending == ref.pending).all()
        for a, b in zip(jax.tree.leaves(st.cache), jax.tree.leaves(ref.cache)):
            assert jnp.allclose(a, b)
        closed = jax.make_jaxpr(fn)(carry)
        n_params = len(jax.tree.leaves(carry[0]))
        toks_out = closed.jaxpr.outvars[n_params]  # the carried prompt is computed, not passed through
        assert toks_out not in closed.jaxpr.invars


def test_ideal_answer_speedup_counts_each_answers_prefill_and_passes():
    """A perfect implementation (every answer costs exactly prefill + its passes) scores the
    measured speedup exactly, at any answer length; the decode-only ideal would not."""
    costs = {"t_prefill": 3.0, "t_prefill_ar": 2.0, "t_ar_step": 1.0, "t_draft": 0.5, "t_verify": 1.5}
    ar = [SequenceResult(tokens=[0] * n, accepted=[], rounds=n - 1, target_layers=0, draft_layers=0)
          for n in (9, 33)]
    spec = [SequenceResult(tokens=[0] * n, accepted=[], rounds=r, target_layers=0, draft_layers=0)
            for n, r in ((9, 2), (33, 8))]
    t_ar = [2.0 + 8, 2.0 + 32]
    t_spec = [3.0 + 2 * 2.0, 3.0 + 8 * 2.0]
    measured = ((9 / t_spec[0] + 33 / t_spec[1]) / 2) / ((9 / t_ar[0] + 33 / t_ar[1]) / 2)
    assert S.ideal_answer_speedup(spec, ar, costs) == pytest.approx(measured)
    assert S.ideal_answer_speedup(spec, ar, costs) < 4.0 * 1.0 / 2.0  # below the decode-only bound
