"""Several stop ids (`eos_ids`): every method stops a sequence right after the first generated token
that is any of them, inside the jitted loop, and otherwise emits exactly what it emits without stop
ids. Greedy decoding is deterministic per row, so the stopped output must be the unstopped output
cut after that first stop token -- including when it lands in the middle of a speculative commit."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest

from decoding_helpers import BATCH, WIDTH, model, noisy_copy, random_m2r2
from m2r2_jax.decoding import api
from m2r2_jax.errors import ConfigError
from m2r2_jax.m2r2.config import M2R2Config

MAX_NEW = 12  # longer than the helpers' 8: more tokens to pick stop ids from
PROMPTS = [[1, 2, 3], [4, 5], [9, 10, 11, 12, 13, 14], [6], [20, 30], [17, 18, 19], [40], [55, 2, 8, 33]]
MCFG = M2R2Config(branch_layer=1, rate=2, lora_rank=4, router_dim=8, router_hidden=8)


@functools.lru_cache(maxsize=None)
def method_options(method: str) -> tuple:
    cfg, _ = model("llama")
    if method == "m2r2_spec":  # fresh adapters: drafts often accepted, so commits span several tokens
        return (("gamma", 3), ("m2r2", (MCFG, random_m2r2(cfg, MCFG, 7, adapter_scale=0.0))))
    if method == "distance_spec":
        return (("gamma", 3), ("exit_layer", 2))
    if method == "two_model":
        return (("gamma", 3), ("draft", noisy_copy("llama", 0.05)))
    if method == "m2r2_exit":
        return (("m2r2", (MCFG, random_m2r2(cfg, MCFG, 3, adapter_scale=0.2))),)
    return ()


def build(method: str, eos_ids=None) -> api.Engine:
    cfg, params = model("llama")
    return api.build_engine(method, cfg, params, max_new_tokens=MAX_NEW, eos_ids=eos_ids,
                            **dict(method_options(method)))


def generate(engine: api.Engine) -> list:
    # two batches of one compiled program; tau 0.5: the early-exit methods exit now and then
    return api.run_engine(engine, PROMPTS, batch_size=BATCH, width=WIDTH, fixed_batch=True, tau=0.5)


@functools.lru_cache(maxsize=None)
def unstopped(method: str) -> tuple:
    return tuple(generate(build(method)))


def cut(tokens, ids) -> list:
    """`tokens` up to and including the first that is in `ids` (all of them if none is)."""
    for i, t in enumerate(tokens):
        if t in ids:
            return list(tokens[: i + 1])
    return list(tokens)


def stop_position(tokens, ids):
    return next((i for i, t in enumerate(tokens) if t in ids), None)


def inside_commit(result: api.SequenceResult, pos) -> bool:
    """Whether token `pos` was committed by a round that committed more tokens after it (index 0
    comes from the prefill; round r commits the next accepted[r] tokens)."""
    end = 0
    for acc in result.accepted:
        end += acc
        if pos is not None and end - acc < pos <= end:
            return pos < end
    return False


def pick_stop_ids(results, speculative: bool):
    """Two token ids such that each one is the first stop of some prompt (so honouring only one of
    them gives other tokens), preferring pairs with more stops inside a multi-token commit, then
    more prompts cut. Returns (a, b, the number of stops inside a commit)."""
    candidates = sorted({t for r in results for t in r.tokens})
    best, best_score = None, None
    for a, b in itertools.combinations(candidates, 2):
        both = [cut(r.tokens, (a, b)) for r in results]
        if both == [cut(r.tokens, (a,)) for r in results] or both == [cut(r.tokens, (b,)) for r in results]:
            continue
        inside = sum(inside_commit(r, stop_position(r.tokens, (a, b))) for r in results) if speculative else 0
        score = (inside, sum(len(x) < len(r.tokens) for x, r in zip(both, results)))
        if best_score is None or score > best_score:
            best, best_score = (a, b), score
    assert best is not None, "no pair of stop ids tells the ids apart"
    return best[0], best[1], best_score[0]


@pytest.mark.parametrize("method", api.METHODS)
def test_every_method_stops_at_the_first_of_several_ids(method):
    ref = unstopped(method)
    speculative = method in api.SPEC_METHODS
    a, b, inside = pick_stop_ids(ref, speculative)
    if speculative:
        assert inside > 0, "the unstopped runs give no stop inside a multi-token commit"
    eng = build(method, [b, a, b])  # any order, repeats allowed
    assert eng.spec.eos_ids == (a, b)
    got = generate(eng)
    for i, (g, r) in enumerate(zip(got, ref)):
        assert g.tokens == cut(r.tokens, (a, b)), f"prompt {i}, stop ids {(a, b)}"
        if speculative:
            assert g.accepted == r.accepted[: g.rounds]  # the rounds up to the stop are unchanged
            if inside_commit(r, stop_position(r.tokens, (a, b))):
                # the last round verified more tokens than it kept: the stop cut a commit short
                assert sum(g.accepted) > len(g.tokens) - 1
            assert g.rounds <= r.rounds


@pytest.mark.parametrize("method", ["ar", "two_model"])
def test_the_prefill_token_stops_at_any_id(method):
    ref = unstopped(method)
    firsts = sorted({r.tokens[0] for r in ref})
    assert len(firsts) >= 2
    ids = (firsts[0], firsts[-1])
    got = generate(build(method, ids))
    for g, r in zip(got, ref):
        assert g.tokens == cut(r.tokens, ids)
    assert sum(len(g.tokens) == 1 for g in got) >= 2


def test_a_single_int_still_works():
    ref = unstopped("ar")
    a, _, _ = pick_stop_ids(ref, False)
    for ids in (a, np.int32(a)):
        eng = build("ar", ids)
        assert eng.spec.eos_ids == (a,)
        assert [g.tokens for g in generate(eng)] == [cut(r.tokens, (a,)) for r in ref]


@pytest.mark.parametrize("ids", [(), []])
def test_an_empty_sequence_never_stops(ids):
    eng = build("ar", ids)
    assert eng.spec.eos_ids == () and eng.spec == build("ar").spec
    got = generate(eng)
    assert [g.tokens for g in got] == [r.tokens for r in unstopped("ar")]
    assert all(len(g.tokens) == MAX_NEW for g in got)


@pytest.mark.parametrize("bad", [61, -1, [3, 61], 2.0, "7", True, [3, None], [1.5], {3: 4}])
def test_ids_outside_the_vocabulary_or_not_ints_are_refused(bad):
    cfg, params = model("llama")
    with pytest.raises(ConfigError) as err:
        api.build_engine("ar", cfg, params, max_new_tokens=4, eos_ids=bad)
    assert "eos_ids" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="eos_ids"):
        api.generate("ar", cfg, params, [[1, 2]], max_new_tokens=4, eos_ids=bad)
