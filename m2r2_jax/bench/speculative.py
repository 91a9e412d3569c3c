"""Side-by-side measurement of speculative decoding methods on one model and one prompt set.

Definitions (Spec-Bench's):
- tokens/s of a method: the mean over answers of (generated tokens / wall time of that answer) at
  batch 1; each answer is timed `repeats` times and its median kept;
- speedup over ar: mean per-answer tokens/s of the method / that of ar, measured in the same run;
- mean accepted tokens per verification: accepted drafts + the target's own token (ar = 1.00);
- identical_to_ar: every greedy answer equals ar's token for token (checked, not assumed).

Costs, measured on the same device: one ar decoding step (t_ar), one draft phase of gamma tokens
(t_draft) and one verification pass over gamma + 1 positions (t_verify). The ideal speedup implied
by the acceptance and these costs is  mean_accepted * t_ar / (t_draft + t_verify);  measured/ideal
is the implementation efficiency (what the loop, padding and bookkeeping cost on top).
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from m2r2_jax.decoding import api

SPEC_METHODS = ("m2r2_spec", "distance_spec", "two_model")


def _median_time(fn, repeats: int) -> tuple[float, list]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), times


def _run(engine, prompts, batch_size, width, tau):
    return api.run_engine(engine, prompts, batch_size=batch_size, width=width, tau=tau, fixed_batch=True)


def per_answer_timing(engine, prompts: Sequence[Sequence[int]], width: int, repeats: int, tau: float = 0.5):
    """Batch 1: each answer generated and timed on its own (median of `repeats`)."""
    results, tps, times = [], [], []
    _run(engine, [prompts[0]], 1, width, tau)  # compile
    for p in prompts:
        res = None

        def once():
            nonlocal res
            res = _run(engine, [p], 1, width, tau)
            return jnp.zeros(())

        med, _ = _median_time(once, repeats)
        results.append(res[0])
        times.append(med)
        tps.append(len(res[0].tokens) / med)
    return results, tps, times


def batch_throughput(engine, prompts, batch_size: int, width: int, repeats: int, tau: float = 0.5) -> dict:
    """Tokens/s of the whole prompt set at a given batch size (median over repeats)."""
    reps = max(1, -(-batch_size // len(prompts)))  # enough prompts to fill at least one batch
    pool = (list(prompts) * reps)[: max(batch_size, len(prompts))]
    _run(engine, pool[:batch_size], batch_size, width, tau)  # compile
    out = {}

    def once():
        out["res"] = _run(engine, pool, batch_size, width, tau)
        return jnp.zeros(())

    med, times = _median_time(once, repeats)
    n_tokens = sum(len(r.tokens) for r in out["res"])
    return {"batch_size": batch_size, "tokens_per_s": n_tokens / med, "seconds": med,
            "seconds_all": times, "tokens": n_tokens,
            "mean_accepted_tokens": float(np.mean([a for r in out["res"] for a in r.accepted])) if out["res"][0].accepted else 1.0}


def _in_graph_seconds(fn, carry, repeats: int, n_short: int = 2, n_long: int = 12) -> float:
    """Seconds per application of `fn` (carry -> carry) measured inside one compiled loop, so
    dispatch and host overheads cancel: (t(n_long) - t(n_short)) / (n_long - n_short). The carry
    threads the cache through every iteration, so nothing can be hoisted out of the loop."""

    def looped(n):
        return jax.jit(lambda c: jax.lax.fori_loop(0, n, lambda i, c: fn(c), c))

    short, long_ = looped(n_short), looped(n_long)
    jax.block_until_ready(short(carry))
    jax.block_until_ready(long_(carry))
    t_short, _ = _median_time(lambda: short(carry), repeats)
    t_long, _ = _median_time(lambda: long_(carry), repeats)
    return max(t_long - t_short, 1e-9) / (n_long - n_short)


def round_costs(engine, ar_engine, prompt: Sequence[int], width: int, repeats: int = 5) -> dict:
    """Seconds of one ar decoding step, one draft phase (gamma tokens) and one verification pass
    over gamma + 1 positions, batch 1, each measured inside a compiled loop."""
    from m2r2_jax.decoding import speculative as SP

    toks, lengths, valid = api.pad_batch([prompt], 1, width)
    keys = api.sequence_keys(0, [0])
    tau = jnp.float32(0.5)
    st_ar = api.prefill_batch(ar_engine.spec, ar_engine.params, toks, lengths, keys, valid)
    ar_step = api._round_fn(ar_engine.spec, ar_engine.params, tau)
    t_ar = _in_graph_seconds(ar_step, st_ar, repeats)
    out = {"t_ar_step": t_ar}
    if engine is None:
        return out
    spec, params = engine.spec, engine.params
    st = api.prefill_batch(spec, params, toks, lengths, keys, valid)

    def draft_phase(st):
        d = SP.draft(spec.drafter, spec.sampling, spec.gamma, False, params, st, tau, st.keys)
        return st._replace(cache=d[4], dstate=d[5])

    drafts = SP.draft(spec.drafter, spec.sampling, spec.gamma, False, params, st, tau, st.keys)[0]

    def verify_pass(st):
        return st._replace(cache=SP.verify(spec.cfg, params, st, st.cache, drafts)[1])

    t_draft = _in_graph_seconds(draft_phase, st, repeats)
    t_verify = _in_graph_seconds(verify_pass, st, repeats)
    out.update({"t_draft": t_draft, "t_verify": t_verify,
                "draft_cost_per_token": t_draft / spec.gamma / t_ar,
                "verify_cost_ratio": t_verify / t_ar})
    return out


def acceptance_by_position(results, gamma: int) -> list:
    """P(draft position k accepted) over all rounds, k = 1..gamma (accepted counts include the
    target's own token, so a round with count a accepted positions 1..a-1)."""
    counts = [a for r in results for a in r.accepted]
    if not counts:
        return []
    counts = np.asarray(counts)
    return [float(np.mean(counts - 1 >= k)) for k in range(1, gamma + 1)]


def compare_methods(
    cfg,
    base_params,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    gamma: int = 4,
    m2r2=None,
    draft=None,
    methods: Sequence[str] = ("ar",) + SPEC_METHODS,
    batch_sizes: Sequence[int] = (1, 4, 16),
    repeats: int = 3,
    progress=None,
    plan=None,
) -> dict:
    """Greedy speculative decoding side by side with ar. Returns report["speculative"]. `plan`:
    run every method sharded (`sharding.ShardingPlan`, e.g. the specdec preset)."""
    width = max(len(p) for p in prompts)
    engines = {}
    for m in methods:
        if m == "two_model" and draft is None:
            continue
        engines[m] = api.build_engine(m, cfg, base_params, max_new_tokens=max_new_tokens, gamma=gamma,
                                      m2r2=m2r2, draft=draft, plan=plan)
    out: dict = {}
    ar_results = None
    for m, eng in engines.items():
        if progress:
            progress(f"speculative: {m}")
        results, tps, times = per_answer_timing(eng, prompts, width, repeats)
        rec = {"tokens_per_s": float(np.mean(tps)), "tokens_per_s_per_answer": tps, "seconds_per_answer": times,
               "generated_tokens": int(sum(len(r.tokens) for r in results)),
               "answers": [r.tokens for r in results]}
        if m == "ar":
            ar_results = results
            rec["mean_accepted_tokens"] = 1.0
        else:
            rec["mean_accepted_tokens"] = float(np.mean([a for r in results for a in r.accepted]))
            rec["acceptance_by_position"] = acceptance_by_position(results, gamma)
            rec["gamma"] = gamma
            rec["draft_cost_layers"] = float(eng.spec.drafter.cost_per_token())
            rec["draft_cost_ratio_layers"] = api.draft_cost_ratio(eng.spec)
        rec["layers_per_token"] = float(np.mean([r.layers_per_token for r in results]))
        rec["identical_to_ar"] = (ar_results is not None and
                                  all(a.tokens == b.tokens for a, b in zip(results, ar_results)))
        rec["batch_sweep"] = [batch_throughput(eng, prompts, bs, width, repeats) for bs in batch_sizes]
        out[m] = rec
    ar = out["ar"]
    costs_ar = round_costs(None, engines["ar"], prompts[0], width)
    for m, rec in out.items():
        rec["speedup_vs_ar"] = rec["tokens_per_s"] / ar["tokens_per_s"]
        for i, b in enumerate(rec["batch_sweep"]):
            b["speedup_vs_ar"] = b["tokens_per_s"] / ar["batch_sweep"][i]["tokens_per_s"]
        if m == "ar":
            rec["efficiency"] = 1.0
            rec["costs"] = costs_ar
            continue
        costs = round_costs(engines[m], engines["ar"], prompts[0], width)
        rec["costs"] = costs
        ideal = rec["mean_accepted_tokens"] * costs["t_ar_step"] / (costs["t_draft"] + costs["t_verify"])
        rec["ideal_speedup"] = float(ideal)
        rec["efficiency"] = float(rec["speedup_vs_ar"] / ideal)
        # hardware-independent prediction for a device where verifying gamma+1 tokens costs one step
        rec["ideal_speedup_if_verify_is_one_step"] = api.ideal_speedup(
            rec["mean_accepted_tokens"], gamma, rec["draft_cost_ratio_layers"])
    return out


def rouge_l(candidate: Sequence[int], reference: Sequence[int]) -> float:
    """ROUGE-L F1 between two token-id sequences (rouge-score on ids written as words)."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    ref = " ".join(f"t{t}" for t in reference)
    cand = " ".join(f"t{t}" for t in candidate)
    return float(scorer.score(ref, cand)["rougeL"].fmeasure)


def token_agreement(candidate: Sequence[int], reference: Sequence[int]) -> float:
    n = max(len(reference), 1)
    return float(sum(a == b for a, b in zip(candidate, reference)) / n)


def early_exit_sweep(cfg, base_params, prompts, *, max_new_tokens: int, thresholds: Sequence[float], m2r2=None,
                     methods=("m2r2_exit", "distance_exit"), repeats: int = 3, ar_reference=None,
                     progress=None) -> dict:
    """Quality (vs the full model's greedy output) against speed for early-exit deciders."""
    width = max(len(p) for p in prompts)
    ar_engine = api.build_engine("ar", cfg, base_params, max_new_tokens=max_new_tokens)
    if ar_reference is None:
        ar_results, ar_tps, _ = per_answer_timing(ar_engine, prompts, width, repeats)
        ar_reference = ([r.tokens for r in ar_results], float(np.mean(ar_tps)))
    ref_tokens, ar_tps = ar_reference
    out = {}
    for m in methods:
        eng = api.build_engine(m, cfg, base_params, max_new_tokens=max_new_tokens, m2r2=m2r2)
        rows = []
        for tau in thresholds:
            if progress:
                progress(f"early exit: {m} tau={tau}")
            results, tps, _ = per_answer_timing(eng, prompts, width, repeats, tau=tau)
            rows.append({
                "threshold": float(tau),
                "speedup": float(np.mean(tps) / ar_tps),
                "rouge_l": float(np.mean([rouge_l(r.tokens, ref) for r, ref in zip(results, ref_tokens)])),
                "agreement": float(np.mean([token_agreement(r.tokens, ref) for r, ref in zip(results, ref_tokens)])),
                "layers_per_token": float(np.mean([r.layers_per_token for r in results])),
                "early_exit_fraction": float(np.mean([r.early_exits / max(1, len(r.tokens) - 1) for r in results])),
            })
        out[m] = rows
    return out


def ar_reference(cfg, base_params, prompts, max_new_tokens: int, repeats: int = 3) -> Optional[tuple]:
    width = max(len(p) for p in prompts)
    eng = api.build_engine("ar", cfg, base_params, max_new_tokens=max_new_tokens)
    results, tps, _ = per_answer_timing(eng, prompts, width, repeats)
    return [r.tokens for r in results], float(np.mean(tps))
