"""Side-by-side measurement of speculative decoding methods on one model and one prompt set.

Definitions (Spec-Bench's):
- tokens/s of a method: the mean over answers of (generated tokens / wall time of that answer) at
  batch 1; each answer is timed `repeats` times and its median kept;
- speedup over ar: mean per-answer tokens/s of the method / that of ar, measured in the same run;
- mean accepted tokens per verification: accepted drafts + the target's own token (ar = 1.00);
- identical_to_ar: every greedy answer equals ar's token for token (checked, not assumed).

Costs, measured on the same device inside compiled loops: one ar decoding step (t_ar), one draft
phase of gamma tokens (t_draft), one verification pass over gamma + 1 positions (t_verify), and
each method's prefill of the prompt (t_prefill, the drafter's own prefill included).

The ideal speedup is what the measured speedup would be if each answer cost exactly its passes:
an ar answer  t_prefill_ar + steps * t_ar,  a speculative one  t_prefill + rounds * (t_draft +
t_verify),  with each answer's own step and round counts, put through the same mean of per-answer
tokens/s as the measurement. measured/ideal is the implementation efficiency: what the loop,
padding, bookkeeping and the host cost on top; a perfect implementation scores 1.0 at any answer
length. The decode-only ideal  mean_accepted * t_ar / (t_draft + t_verify)  leaves the prefill out
of both sides, so a fixed prefill that both methods pay pulls the measured ratio below it even with
no overhead at all (by ~10% on a 96-token answer of the embedded model); it is kept as
`ideal_speedup_decode_only` / `efficiency_decode_only`. Both are computed for every cost sample
(all components of a sample are timed back to back, so they share one state of the machine) and
the median is kept, with the min-max over samples as `ideal_speedup_spread`. The whole round is timed as well
(t_round): mean_accepted * t_ar / t_round is the decode-only bound with acceptance, commit and the
two passes compiled together, which separates in-graph costs from host overheads. The costs are
sampled 7 times spread between the batch-1 answers (`InGraphTimer`, `spread_schedule`), so on a
machine whose speed drifts they come from the same stretch of time as the answers.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from m2r2_jax.bench.gamma import gamma_of
from m2r2_jax.decoding import api
from m2r2_jax.errors import ConfigError

SPEC_METHODS = ("m2r2_spec", "distance_spec", "two_model")
COST_SAMPLES = 7  # in-graph cost measurements per benchmark (medians over them)


def vocab_option(method: str, draft_vocab) -> dict:
    """build_engine's draft_vocab for `method`: the subset for the self-drafting methods, nothing
    for the others (ar, two_model)."""
    return {"draft_vocab": draft_vocab} if draft_vocab is not None and method in api.SELF_DRAFT_METHODS else {}


def _run(engine, prompts, batch_size, width, tau):
    return api.run_engine(engine, prompts, batch_size=batch_size, width=width, tau=tau, fixed_batch=True)


def _rotations(names: Sequence[str], r: int) -> list:
    """The method order of repeat r: rotated by one place per repeat, so no method always runs
    first (right after another method's compile or warm caches) or last."""
    k = r % max(len(names), 1)
    return list(names[k:]) + list(names[:k])


def per_answer_timing_side_by_side(runners: dict, prompts: Sequence[Sequence[int]], width: int,
                                   repeats: int, bar: str = "", between=None, first_calls: Optional[dict] = None) -> dict:
    """Batch 1, every runner side by side. `runners` maps a name to (engine, tau). For each repeat
    and each prompt the runners go one after another (order rotating), so slow drifts of a shared
    machine's load hit every method alike instead of whichever method happened to be timed during
    them. Each answer's time is the median of its `repeats`.
    With `bar`, a progress bar of that name counts compiles and timed answers. `between(g)`, if
    given, runs after each (repeat, prompt) group g = 0, 1, ... (outside the timed calls).
    `first_calls`, if given, receives {name: seconds of the first (compiling) call, on prompts[0]}.
    Returns {name: (results, tokens_per_s, seconds)}, each a list over prompts."""
    from tqdm.auto import tqdm

    names = list(runners)
    progress = tqdm(total=len(names) * (1 + repeats * len(prompts)), desc=bar, disable=not bar, leave=False)
    for m in names:
        engine, tau = runners[m]
        t0 = time.perf_counter()
        _run(engine, [prompts[0]], 1, width, tau)  # compile
        if first_calls is not None:
            first_calls[m] = time.perf_counter() - t0
        progress.update()
    times = {m: [[] for _ in prompts] for m in names}
    results = {m: [None] * len(prompts) for m in names}
    for r in range(repeats):
        for i, p in enumerate(prompts):
            for m in _rotations(names, r + i):
                engine, tau = runners[m]
                t0 = time.perf_counter()
                res = _run(engine, [p], 1, width, tau)  # returns host values: synchronised
                times[m][i].append(time.perf_counter() - t0)
                results[m][i] = res[0]
                progress.update()
            if between is not None:
                between(r * len(prompts) + i)
    progress.close()
    out = {}
    for m in names:
        med = [float(np.median(t)) for t in times[m]]
        out[m] = (results[m], [len(res.tokens) / t for res, t in zip(results[m], med)], med)
    return out


def per_answer_timing(engine, prompts: Sequence[Sequence[int]], width: int, repeats: int, tau: float = 0.5):
    """Batch 1: each answer generated and timed on its own (median of `repeats`)."""
    return per_answer_timing_side_by_side({"m": (engine, tau)}, prompts, width, repeats)["m"]


def batch_throughput_side_by_side(engines: dict, prompts, batch_size: int, width: int, repeats: int,
                                  tau: float = 0.5) -> dict:
    """Tokens/s of the whole prompt set at a given batch size for every engine, timed side by side
    (order rotating per repeat; median over repeats). Returns {name: row}."""
    reps = max(1, -(-batch_size // len(prompts)))  # enough prompts to fill at least one batch
    pool = (list(prompts) * reps)[: max(batch_size, len(prompts))]
    names = list(engines)
    for m in names:
        _run(engines[m], pool[:batch_size], batch_size, width, tau)  # compile
    times = {m: [] for m in names}
    results = {}
    for r in range(repeats):
        for m in _rotations(names, r):
            t0 = time.perf_counter()
            results[m] = _run(engines[m], pool, batch_size, width, tau)
            times[m].append(time.perf_counter() - t0)
    out = {}
    for m in names:
        med = float(np.median(times[m]))
        n_tokens = sum(len(r.tokens) for r in results[m])
        acc = [a for r in results[m] for a in r.accepted]
        out[m] = {"batch_size": batch_size, "tokens_per_s": n_tokens / med, "seconds": med,
                  "seconds_all": times[m], "tokens": n_tokens,
                  "mean_accepted_tokens": float(np.mean(acc)) if acc else 1.0}
    return out


class InGraphTimer:
    """Seconds per application of each `fn` (carry -> carry) in `components` {name: (fn, carry)},
    measured inside one compiled loop whose trip count is a runtime argument (one compile per
    component, at construction): (t(n_long) - t(n_short)) / (n_long - n_short), so dispatch and
    host overheads cancel. The carry threads the cache through every iteration, so nothing can be
    hoisted out of the loop. Each `measure` call times every component once, side by side (order
    rotating with its argument), each one's short and long runs back to back; `result` is the
    median over the calls so far. Calls can be spread over a longer measurement (between the
    answers of `per_answer_timing_side_by_side`), so the costs sample the same machine states as
    the answers they are compared with."""

    def __init__(self, components: dict, n_short: int = 2, n_long: int = 18, progress=None):
        self.n_short, self.n_long = n_short, n_long
        self.looped = {}
        for name, (fn, carry) in components.items():
            f = jax.jit(lambda c, n, fn=fn: jax.lax.fori_loop(0, n, lambda i, c: fn(c), c))
            jax.block_until_ready(f(carry, n_short))  # compile (n is traced: the same program for both)
            self.looped[name] = (f, carry)
            if progress is not None:
                progress.update()
        self.per = {name: [] for name in components}

    def measure(self, rotation: int = 0) -> None:
        for name in _rotations(list(self.looped), rotation):
            f, carry = self.looped[name]
            t = {}
            for n in (self.n_short, self.n_long):
                t0 = time.perf_counter()
                jax.block_until_ready(f(carry, n))
                t[n] = time.perf_counter() - t0
            self.per[name].append(max(t[self.n_long] - t[self.n_short], 1e-9) / (self.n_long - self.n_short))

    @property
    def samples(self) -> int:
        return min((len(v) for v in self.per.values()), default=0)

    def result(self) -> dict:
        """{name: {"seconds": median, "spread": [min, max]}} over the `measure` calls so far."""
        return {name: {"seconds": float(np.median(v)), "spread": [float(min(v)), float(max(v))]}
                for name, v in self.per.items()}


def in_graph_seconds(components: dict, repeats: int = 7, n_short: int = 2, n_long: int = 18, bar: str = "") -> dict:
    """`InGraphTimer` over `components`, measured `repeats` times in a row. With `bar`, a progress
    bar of that name counts compiles and timed repeats.
    Returns {name: {"seconds": s, "spread": [min, max] over repeats}}."""
    from tqdm.auto import tqdm

    progress = tqdm(total=len(components) + repeats, desc=bar, disable=not bar, leave=False)
    timer = InGraphTimer(components, n_short, n_long, progress)
    for r in range(repeats):
        timer.measure(r)
        progress.update()
    progress.close()
    return timer.result()


def _advance(st, stride: int, max_new: int):
    """The state's generated count moved on by `stride` tokens, wrapping back to where it started
    (1, after the prefill) before it reaches `max_new`: every iteration of a timing loop then
    decodes at new positions, as the generation loop does, however many iterations it runs.

    Why it matters: a loop that decodes at the same positions every iteration runs measurably
    faster than the generation loop on CPU. On the demo's dense model (2-core EPYC), m2r2_spec's
    gamma-4 round took 1.23-1.29 ms at fixed positions, 1.56-1.63 ms with its positions moving
    (advancing, alternating between two places, or stepping by 5 and wrapping: all alike), and the
    generation program's answers 1.8-2.5 ms per round, their prefill included. Only the change of
    position matters: fixed positions 40 or 80 tokens further along were as cheap as fixed
    positions at the start. Which hardware effect makes repeated positions cheap is not
    established; the timing loops avoid it rather than model it."""
    span = max(max_new - stride, 1)  # generated counts 1 .. span: a stride more stays below max_new
    return 1 + (st.n_gen - 1 + stride) % span


def _kept_running(round_fn, stride: int, max_new: int):
    """A decoding round that can be iterated in a timing loop without the sequence finishing: the
    done flag and the round counter are put back after every round and the generated count moves
    on by `stride` (`_advance`), so each iteration decodes at new positions and commits (writes
    `out`, `accepted`) like a real round, and the loop never reaches `max_new`."""

    def fn(st):
        nxt = round_fn(st)
        return nxt._replace(n_gen=_advance(st, stride, max_new), done=st.done, n_rounds=st.n_rounds)

    return fn


def _fold_tokens(tokens: jax.Array, vocab: int) -> jax.Array:
    """[B, ...] token ids -> [B] ids depending on every input (feeds a component's output back
    as the next pending token, so the compiler cannot drop the work that produced it)."""
    return (jnp.sum(tokens.reshape(tokens.shape[0], -1), axis=1) % vocab).astype(jnp.int32)


def round_cost_components(engines: dict, ar_engine, prompt: Sequence[int], width: int) -> dict:
    """The compiled-loop components `round_costs` times: {(name, part): (fn, carry)} with parts
    "step" (ar), "draft", "verify" and "round" (each speculative engine), batch 1 on `prompt`.

    Every component's result feeds the next iteration (drafts and the verify pass's argmax become
    the next pending token), so nothing it computes is dead code: a pass whose logits went unused
    would be timed without its LM head. The round is the decoding loop's own round function, kept
    running (`_kept_running`)."""
    from m2r2_jax.decoding import speculative as SP

    tau = jnp.float32(0.5)
    components = {("ar", "step"): round_component(ar_engine, prompt, width),
                  ("ar", "prefill"): prefill_component(ar_engine, prompt, width)}
    for m, engine in engines.items():
        spec = engine.spec
        vocab = spec.cfg.vocab_size
        _, (params, st) = components[(m, "round")] = round_component(engine, prompt, width)
        components[(m, "prefill")] = prefill_component(engine, prompt, width)

        def draft_phase(c, spec=spec, vocab=vocab):
            params, st = c
            d = SP.draft(spec.drafter, spec.sampling, spec.gamma, False, params, st, tau, st.keys)
            live = d.drafts if d.hidden is None else jnp.concatenate(
                [d.drafts, (d.hidden[..., 0] > 0).astype(jnp.int32)], axis=1)  # the verifier's input too
            return params, st._replace(cache=d.cache, dstate=d.dstate, pending=_fold_tokens(live, vocab),
                                       n_gen=_advance(st, spec.commit_width, spec.max_new))

        d = SP.draft(spec.drafter, spec.sampling, spec.gamma, False, params, st, tau, st.keys)

        def verify_pass(c, spec=spec, drafts=d.drafts, hidden=d.hidden, vocab=vocab):
            params, st = c
            logits, cache = SP.verify(spec.cfg, params, st, st.cache, drafts, hidden, spec.drafter.shared_layers)
            return params, st._replace(cache=cache, pending=_fold_tokens(jnp.argmax(logits, axis=-1), vocab),
                                       n_gen=_advance(st, spec.commit_width, spec.max_new))

        components[(m, "draft")] = (draft_phase, (params, st))
        components[(m, "verify")] = (verify_pass, (params, st))
    return components


def round_component(engine, prompt: Sequence[int], width: int, tau: float = 0.5):
    """(fn, carry) for `in_graph_seconds`: one decoding round of `engine` (an ar step, or a whole
    speculative round: draft, verify, acceptance, commit), kept running from the prefill of
    `prompt` (batch 1), each iteration `commit_width` positions further on (`_advance`). The
    carry is (params, state): the parameters are runtime values of the loop, as in the real
    generation program. Closed over as constants, they would
    let the compiler fold work on the weights that the real program pays for (slices of the
    layer stack, for one)."""
    toks, lengths, valid = api.pad_batch([prompt], 1, width)
    keys = api.sequence_keys(0, [0])
    spec = engine.spec
    st = api.prefill_batch(spec, engine.params, toks, lengths, keys, valid)

    def fn(carry):
        params, st = carry
        return params, _kept_running(api._round_fn(spec, params, jnp.float32(tau)), spec.commit_width, spec.max_new)(st)

    return fn, (engine.params, st)


def prefill_component(engine, prompt: Sequence[int], width: int):
    """(fn, carry) for `in_graph_seconds`: the engine's prefill of `prompt` (batch 1, padded to
    `width`), the drafter's prefill included, as the generation program runs it. The carry is
    (params, prompt tokens, state). The prompt handed to the next iteration depends on this
    prefill's first token (it is unchanged: token ids are never negative, which the compiler
    cannot see), so the prefill cannot be hoisted out of the loop as loop-invariant."""
    toks, lengths, valid = api.pad_batch([prompt], 1, width)
    keys = api.sequence_keys(0, [0])
    spec = engine.spec
    st = api.prefill_batch(spec, engine.params, toks, lengths, keys, valid)

    def fn(carry):
        params, toks, _ = carry
        st = api._prefill(spec, params, toks, lengths, keys, valid)
        return params, jnp.where(st.pending[:, None] < 0, toks + 1, toks), st

    return fn, (engine.params, jnp.asarray(toks), st)


def spread_schedule(groups: int, samples: int) -> set:
    """`samples` group indices spread evenly over 0..groups-1 (all of them when fewer): where a
    measurement interleaved with `groups` others takes its samples."""
    n = min(samples, groups)
    return {(k + 1) * groups // n - 1 for k in range(n)} if n > 0 else set()


def round_costs(engines: dict, ar_engine, prompt: Sequence[int], width: int, repeats: int = 7,
                timer: Optional[InGraphTimer] = None) -> dict:
    """Seconds of one ar decoding step and, for each speculative engine in `engines` {name: engine},
    one draft phase (gamma tokens), one verification pass over gamma + 1 positions and one whole
    round (draft, verify, acceptance, commit), batch 1, all measured side by side inside compiled
    loops (an `InGraphTimer` over `round_cost_components`).
    `round_overhead` = (t_round - t_draft - t_verify) / t_ar is what the round costs beyond its two
    passes timed apart: acceptance, commit, and whatever the compiler does differently when they
    run in one loop body.
    `t_prefill` is each engine's prefill of `prompt` (`prefill_component`), ar's as `t_prefill_ar`.
    `timer`: an `InGraphTimer` over `round_cost_components` that was already sampled (e.g. between
    the answers being timed); topped up to `repeats` samples.
    Returns {"ar": {"t_ar_step", "t_prefill"}, name: {"t_ar_step", "t_draft", "t_verify", "t_round",
    "t_prefill", "t_prefill_ar", ratios, spreads}} (ratios in ar steps)."""
    if timer is None:
        timer = InGraphTimer(round_cost_components(engines, ar_engine, prompt, width))
    while timer.samples < repeats:  # a timer sampled during the answers already holds some
        timer.measure(timer.samples)
    timed = timer.result()
    t_ar = timed[("ar", "step")]["seconds"]
    pf = timed[("ar", "prefill")]
    out = {"ar": {"t_ar_step": t_ar, "t_ar_step_spread": timed[("ar", "step")]["spread"],
                  "t_prefill": pf["seconds"], "t_prefill_spread": pf["spread"]}}
    for m, engine in engines.items():
        d, v, r, p = timed[(m, "draft")], timed[(m, "verify")], timed[(m, "round")], timed[(m, "prefill")]
        out[m] = {"t_ar_step": t_ar, "t_draft": d["seconds"], "t_verify": v["seconds"], "t_round": r["seconds"],
                  "t_prefill": p["seconds"], "t_prefill_ar": pf["seconds"],
                  "t_draft_spread": d["spread"], "t_verify_spread": v["spread"], "t_round_spread": r["spread"],
                  "t_prefill_spread": p["spread"],
                  "draft_cost_per_token": d["seconds"] / engine.spec.gamma / t_ar,
                  "verify_cost_ratio": v["seconds"] / t_ar,
                  "round_cost_ratio": r["seconds"] / t_ar,
                  "round_overhead": (r["seconds"] - d["seconds"] - v["seconds"]) / t_ar,
                  "samples": _paired_samples(timer, m)}
    return out


def _paired_samples(timer: InGraphTimer, m: str) -> list:
    """Method m's costs sample by sample: every `InGraphTimer.measure` call times all components
    back to back, so one sample's costs share one state of the machine, while medians taken
    component by component may each come from a different one."""
    per = timer.per
    keys = {"t_ar_step": ("ar", "step"), "t_prefill_ar": ("ar", "prefill"), "t_draft": (m, "draft"),
            "t_verify": (m, "verify"), "t_round": (m, "round"), "t_prefill": (m, "prefill")}
    return [{k: float(per[c][i]) for k, c in keys.items()} for i in range(timer.samples)]


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
    gamma=4,
    m2r2=None,
    draft=None,
    methods: Sequence[str] = ("ar",) + SPEC_METHODS,
    batch_sizes: Sequence[int] = (1, 4, 16),
    repeats: int = 3,
    progress=None,
    plan=None,
    draft_vocab=None,
    layer_loop: str = "auto",
    eos_ids=None,
) -> dict:
    """Greedy speculative decoding side by side with ar. Returns report["speculative"]. `eos_ids`:
    every method stops an answer at any of these ids (None: answers run to max_new_tokens). `gamma`:
    one draft length for every method or {method: gamma} (see `bench.gamma`). `plan`: run every
    method sharded (`sharding.ShardingPlan`, e.g. the specdec preset). `draft_vocab`: the token
    ids m2r2_spec's and distance_spec's draft heads score (`decoding.draft_vocab`). `layer_loop`:
    every engine's (`api.resolve_layer_loop`; "auto": each method on the fastest loop measured
    for its platform, so ar is not timed on a slower loop than the drafters)."""
    width = max(len(p) for p in prompts)
    engines = {}
    for m in methods:
        if m == "two_model" and draft is None:
            continue
        engines[m] = api.build_engine(m, cfg, base_params, max_new_tokens=max_new_tokens, gamma=gamma_of(gamma, m),
                                      m2r2=m2r2, draft=draft, plan=plan, layer_loop=layer_loop, eos_ids=eos_ids,
                                      **vocab_option(m, draft_vocab))
    spec_engines = {m: e for m, e in engines.items() if m != "ar"}
    if progress:
        progress("speculative: compiling the draft, verify, round, prefill and ar step cost loops")
    # The costs are sampled between the answers (7 times, spread over them): on a machine whose
    # speed drifts, the ideal and the measured speedup then see the same machine states.
    timer = InGraphTimer(round_cost_components(spec_engines, engines["ar"], prompts[0], width))
    sample_at = spread_schedule(repeats * len(prompts), COST_SAMPLES)
    if progress:
        progress(f"speculative: batch 1, {', '.join(engines)} side by side, their costs sampled in between")
    first_calls: dict = {}
    timed = per_answer_timing_side_by_side({m: (e, 0.5) for m, e in engines.items()}, prompts, width, repeats,
                                           bar="speculative b=1" if progress else "",
                                           between=lambda g: timer.measure(g) if g in sample_at else None,
                                           first_calls=first_calls)
    sweeps = {m: [] for m in engines}
    for bs in batch_sizes:
        if progress:
            progress(f"speculative: batch {bs}")
        row = batch_throughput_side_by_side(engines, prompts, bs, width, repeats)
        for m in engines:
            sweeps[m].append(row[m])
    costs = round_costs(spec_engines, engines["ar"], prompts[0], width, COST_SAMPLES, timer=timer)

    out: dict = {}
    ar_results = timed["ar"][0]
    for m, eng in engines.items():
        results, tps, times = timed[m]
        rec = {"tokens_per_s": float(np.mean(tps)), "tokens_per_s_per_answer": tps, "seconds_per_answer": times,
               "generated_tokens": int(sum(len(r.tokens) for r in results)),
               "answers": [r.tokens for r in results], "costs": costs[m], "batch_sweep": sweeps[m]}
        # compiling apart from decoding: the first call (prompt 0) less that answer's timed median
        rec["first_call_seconds"] = float(first_calls[m])
        rec["compile_seconds"] = float(max(first_calls[m] - times[0], 0.0))
        rec["layers_per_token"] = float(np.mean([r.layers_per_token for r in results]))
        rec["distinct_token_fraction"] = distinct_token_fraction(results)
        # ar is the reference, not a candidate: null, so no reader takes a false for a mismatch
        rec["identical_to_ar"] = None if m == "ar" else all(a.tokens == b.tokens for a, b in zip(results, ar_results))
        if m == "ar":
            rec.update(mean_accepted_tokens=1.0, efficiency=1.0)
        else:
            rec["mean_accepted_tokens"] = float(np.mean([a for r in results for a in r.accepted]))
            rec["accepted_per_answer"] = [float(np.mean(r.accepted)) if r.accepted else 1.0 for r in results]
            rec["gamma"] = eng.spec.gamma
            rec["acceptance_by_position"] = acceptance_by_position(results, rec["gamma"])
            rec["draft_cost_layers"] = float(eng.spec.drafter.cost_per_token())
            rec["draft_cost_ratio_layers"] = api.draft_cost_ratio(eng.spec)
        out[m] = rec
    ar = out["ar"]
    for m, rec in out.items():
        rec["speedup_vs_ar"] = rec["tokens_per_s"] / ar["tokens_per_s"]
        rec["speedup_vs_ar_per_answer"] = [a / b for a, b in zip(rec["tokens_per_s_per_answer"],
                                                                 ar["tokens_per_s_per_answer"])]
        for i, b in enumerate(rec["batch_sweep"]):
            b["speedup_vs_ar"] = b["tokens_per_s"] / ar["batch_sweep"][i]["tokens_per_s"]
        if m == "ar":
            continue
        c = rec["costs"]
        # the ideal of every cost sample (paired: one sample's costs were timed back to back); the
        # median is the ideal, the min-max its spread over the samples
        per = [ideal_answer_speedup(timed[m][0], ar_results, x) for x in c["samples"]]
        rec["ideal_speedup"] = float(np.median(per))
        rec["ideal_speedup_spread"] = [float(min(per)), float(max(per))]
        rec["efficiency"] = float(rec["speedup_vs_ar"] / rec["ideal_speedup"])
        decode_only = [rec["mean_accepted_tokens"] * x["t_ar_step"] / (x["t_draft"] + x["t_verify"]) for x in c["samples"]]
        rec["ideal_speedup_decode_only"] = float(np.median(decode_only))
        rec["efficiency_decode_only"] = float(rec["speedup_vs_ar"] / rec["ideal_speedup_decode_only"])
        # the same bound with the whole round as compiled (acceptance, commit, pass interplay)
        rec["ideal_speedup_from_round"] = float(rec["mean_accepted_tokens"] * c["t_ar_step"] / c["t_round"])
        # hardware-independent prediction for a device where verifying gamma+1 tokens costs one step
        rec["ideal_speedup_if_verify_is_one_step"] = api.ideal_speedup(
            rec["mean_accepted_tokens"], rec["gamma"], rec["draft_cost_ratio_layers"])
    return out


def by_category(spec: dict, categories: Sequence[str]) -> dict:
    """Spec-Bench's per-task view of a `compare_methods` result: for every category (one per
    prompt, in order) and method, the mean per-answer tokens/s over that category's answers, its
    ratio to ar's on the same answers, and the mean tokens per verification."""
    out: dict = {}
    ar = spec["ar"]["tokens_per_s_per_answer"]
    for cat in dict.fromkeys(categories):
        idx = [i for i, c in enumerate(categories) if c == cat]
        row = {"n_prompts": len(idx)}
        for m, rec in spec.items():
            tps = float(np.mean([rec["tokens_per_s_per_answer"][i] for i in idx]))
            cell = {"tokens_per_s": tps, "speedup_vs_ar": tps / float(np.mean([ar[i] for i in idx]))}
            if "accepted_per_answer" in rec:
                cell["mean_accepted_tokens"] = float(np.mean([rec["accepted_per_answer"][i] for i in idx]))
            row[m] = cell
        out[cat] = row
    return out


def ideal_answer_speedup(results, ar_results, costs: dict) -> float:
    """The speedup the measurement would show if every answer cost exactly its compiled passes:
    the mean over answers of tokens / (t_prefill + rounds * (t_draft + t_verify)) over the same
    mean for ar's answers, tokens / (t_prefill_ar + steps * t_ar_step). Each answer's own token,
    round and step counts are used, so answer lengths and the last, partly used round are
    accounted as the measurement meets them."""
    per_round = costs["t_draft"] + costs["t_verify"]
    tps = [len(r.tokens) / (costs["t_prefill"] + r.rounds * per_round) for r in results]
    tps_ar = [len(r.tokens) / (costs["t_prefill_ar"] + r.rounds * costs["t_ar_step"]) for r in ar_results]
    return float(np.mean(tps) / np.mean(tps_ar))


def context_acceptance(cfg, base_params, contexts: Sequence[Sequence[int]], *, gamma, m2r2=None, draft=None,
                       methods: Sequence[str] = SPEC_METHODS, batch_size: int = 8, draft_vocab=None) -> dict:
    """Tokens per verification of each speculative method's *first* round after each of `contexts`
    (real text, e.g. held-out windows), greedy.

    A young base's greedy answers loop on a few tokens, which every drafter predicts well, so the
    acceptance over whole answers overstates what a drafter does on text. The first round after a
    real prefix verifies the base model's own greedy continuation of real text against the
    drafter's guesses of it, so its acceptance is measured on real text. `gamma`: one draft length
    or {method: gamma}, as in `compare_methods`. Returns {method: {"mean_accepted_tokens",
    "acceptance_by_position" (P(draft position k accepted), k = 1..gamma), "contexts", "gamma"}}."""
    if not contexts:
        raise ConfigError("context acceptance needs at least one context")
    width = max(len(c) for c in contexts)
    out = {}
    for m in methods:
        if m == "two_model" and draft is None:
            continue
        g = gamma_of(gamma, m)
        # max_new = g + 2: the prefill's token, then room for one whole round (g drafts + 1)
        engine = api.build_engine(m, cfg, base_params, max_new_tokens=g + 2, gamma=g, m2r2=m2r2, draft=draft,
                                  **vocab_option(m, draft_vocab))
        results = api.run_engine(engine, contexts, batch_size=batch_size, width=width, fixed_batch=True)
        first = np.asarray([r.accepted[0] for r in results if r.accepted])  # none if the prefill ended it (EOS)
        if first.size == 0:
            raise ConfigError(f"no context left a verification round for {m} (every first token was EOS)")
        out[m] = {"mean_accepted_tokens": float(first.mean()),
                  "acceptance_by_position": [float(np.mean(first - 1 >= k)) for k in range(1, g + 1)],
                  "contexts": int(first.size), "gamma": g}
    return out


def distinct_token_fraction(results) -> float:
    """Mean over answers of distinct tokens / tokens: near 0 when greedy decoding loops on a few
    tokens (a young model does), which makes every drafter look better than on real text."""
    return float(np.mean([len(set(r.tokens)) / max(len(r.tokens), 1) for r in results]))


def sampled_comparison(cfg, base_params, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                       temperature: float, top_p: float = 1.0, gamma=4, m2r2=None, draft=None,
                       methods: Sequence[str] = ("ar", "m2r2_spec", "distance_spec"), repeats: int = 3,
                       progress=None, plan=None, draft_vocab=None, layer_loop: str = "auto", eos_ids=None) -> dict:
    """Speed and acceptance with sampling, side by side with sampled ar. Speculative sampling is
    lossless in distribution (pinned by the decoding tests), so answers differ from ar's draw by
    draw and no identity is checked; the point is acceptance on text that does not loop. `gamma`,
    `draft_vocab`, `layer_loop`, `eos_ids`: as in `compare_methods`."""
    width = max(len(p) for p in prompts)
    runners = {m: (api.build_engine(m, cfg, base_params, max_new_tokens=max_new_tokens, temperature=temperature,
                                    top_p=top_p, gamma=gamma_of(gamma, m), m2r2=m2r2, draft=draft, plan=plan,
                                    layer_loop=layer_loop, eos_ids=eos_ids, **vocab_option(m, draft_vocab)), 0.5)
               for m in methods}
    if progress:
        progress(f"speculative sampling (temperature {temperature}): {', '.join(methods)} side by side")
    timed = per_answer_timing_side_by_side(runners, prompts, width, repeats, bar="sampled" if progress else "")
    ar_tps = float(np.mean(timed["ar"][1]))
    out = {"temperature": float(temperature), "top_p": float(top_p)}
    for m, (results, tps, _) in timed.items():
        acc = [a for r in results for a in r.accepted]
        out[m] = {"tokens_per_s": float(np.mean(tps)), "speedup_vs_ar": float(np.mean(tps)) / ar_tps,
                  "gamma": runners[m][0].spec.gamma if m != "ar" else None,
                  "mean_accepted_tokens": float(np.mean(acc)) if acc else 1.0,
                  "distinct_token_fraction": distinct_token_fraction(results)}
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


# the early-exit sweep's methods: (api method, its options)
EXIT_VARIANTS = {"m2r2_exit": ("m2r2_exit", {}),
                 "m2r2_exit_confirm": ("m2r2_exit", {"exit_confirm": True}),  # router exits confirmed by the head
                 "distance_exit": ("distance_exit", {})}


def early_exit_sweep(cfg, base_params, prompts, *, max_new_tokens: int, thresholds: Sequence[float], m2r2=None,
                     methods=("m2r2_exit", "distance_exit"), repeats: int = 3, progress=None,
                     layer_loop: str = "auto", eos_ids=None, kv_missing: str = "propagate") -> dict:
    """Quality (vs the full model's greedy output) against speed for early-exit deciders. Every
    (method, threshold) and plain decoding are timed side by side in one sweep, so each speedup
    is measured against ar under the same machine load. `layer_loop`: every engine's, as in
    `compare_methods` (unrolled, the exit runners put each layer behind a `lax.cond`); `eos_ids`:
    every method stops an answer there (None: answers run to max_new_tokens); `kv_missing`: how
    every exit method fills the K/V of the layers an exited token skipped ("propagate" copies the
    exit state into them, which changes what later tokens attend to; "deferred" computes them
    exactly, later: `decoding.early_exit`)."""
    bad = sorted(set(methods) - set(EXIT_VARIANTS))
    if bad:
        raise ConfigError(f"early-exit method {bad[0]!r} is unknown: expected one of {', '.join(EXIT_VARIANTS)}")
    width = max(len(p) for p in prompts)
    runners = {"ar": (api.build_engine("ar", cfg, base_params, max_new_tokens=max_new_tokens,
                                       layer_loop=layer_loop, eos_ids=eos_ids), 0.5)}
    for m in methods:
        method, kw = EXIT_VARIANTS[m]
        eng = api.build_engine(method, cfg, base_params, max_new_tokens=max_new_tokens, m2r2=m2r2, eos_ids=eos_ids,
                               layer_loop=layer_loop, kv_missing=kv_missing, **kw)
        for tau in thresholds:
            runners[(m, float(tau))] = (eng, float(tau))
    if progress:
        progress(f"early exit: {', '.join(methods)} at tau {', '.join(str(t) for t in thresholds)} "
                 "side by side with ar")
    timed = per_answer_timing_side_by_side(runners, prompts, width, repeats, bar="early exit" if progress else "")
    ref_tokens = [r.tokens for r in timed["ar"][0]]
    ar_tps = float(np.mean(timed["ar"][1]))
    out = {}
    for m in methods:
        rows = []
        for tau in thresholds:
            results, tps, _ = timed[(m, float(tau))]
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
