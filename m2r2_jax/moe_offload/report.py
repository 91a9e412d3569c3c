"""The MoE ahead-of-time loading benchmark: recall, hit rate, real engine, simulated speedups.

`moe_report(...)` is the library entry point (the demo puts its result under report["moe"]);
`write_plots(report, out_dir)` draws the PNGs. Every assumption behind a simulated number is in
report["assumptions"].
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional, Sequence

import jax
import numpy as np

from m2r2_jax.errors import ConfigError
from m2r2_jax.m2r2.fast_stream import adapter_shapes, draft_cost_layers, visited_layers
from m2r2_jax.moe_offload import platforms as P
from m2r2_jax.moe_offload.engine import OffloadEngine, memory_kinds
from m2r2_jax.moe_offload.metrics import expert_load, mean_recall, recall_by_lookahead, recall_per_layer
from m2r2_jax.moe_offload.policies import FUTURE_POLICIES
from m2r2_jax.moe_offload.predictors import (choose_m2r2_sources, fast_steps_needed, m2r2_state_plan,
                                             sources_by_fast_steps)
from m2r2_jax.moe_offload.record import generate_reference, record_trace
from m2r2_jax.moe_offload.simulator import simulate
from m2r2_jax.moe_offload.trace import blend_with_oracle, oracle_with_lead

LADDER = ("on_demand_lru", "on_demand_lfu", "next_gate", "next_gate_lfu", "m2r2", "m2r2_lfu", "oracle",
          "on_demand_belady", "oracle_belady", "all_resident")
# (trace predictor, cache policy) of each rung; prefetching rungs use a prediction-aware policy
# (recency order, or demand-frequency order in the *_lfu rungs).
# The belady rungs are ceilings, not methods: on_demand_belady loads the fewest experts any demand
# paging can at this capacity; oracle_belady adds perfect prefetch at the token's start, the most
# any within-token predictor + eviction policy can reach here. They need the future, so the engine
# skips them.
RUNGS = {"on_demand_lru": ("none", "lru"), "on_demand_lfu": ("none", "lfu"),
         "next_gate": ("next_gate", "predictive"), "next_gate_lfu": ("next_gate", "predictive_lfu"),
         "m2r2": ("m2r2", "predictive"), "m2r2_lfu": ("m2r2", "predictive_lfu"), "oracle": ("oracle", "predictive"),
         "on_demand_belady": ("none", "belady"), "oracle_belady": ("oracle", "belady")}
SIMULATOR_ONLY = tuple(r for r, (_, policy) in RUNGS.items() if policy in FUTURE_POLICIES)
TARGET_SPEEDUP = 2.9  # the benchmark target: speedup over on-demand LRU at 2 x active experts
# prefetch gates swept in report["confidence_sweep"] (simulator.guess_confidence; 0 = prefetch every guess)
CONFIDENCE_GRID = (0.0, 1.1, 1.25, 1.5, 2.0)
GATED_RUNGS = ("next_gate", "next_gate_lfu", "m2r2", "m2r2_lfu")
BLEND_SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)  # report["recall_needed"]: share of m2r2's guesses set to the truth
RHO_GRID = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
# report["bandwidth_capacity_sweep"]: link bandwidths (GB/s), and at most this many cache sizes
# (`sweep_capacities`): every size from top_k to n_experts is a full ladder per bandwidth, which for
# a 64-expert layer took most of moe-bench's time
SWEEP_BANDWIDTHS = (2.0, 4.0, 25.0, 50.0, 450.0)
SWEEP_CAPACITY_POINTS = 12
# report["chunked_link"]: the ladder again on a link that moves an expert in this many pieces, so a
# miss overtakes a prefetch already on the link at the next piece (simulator.Link); the real engine
# copies whole experts (one device_put each), the ladder's link.
LINK_CHUNKS = 4


def sweep_capacities(top_k: int, n_experts: int, capacity: int, points: int = SWEEP_CAPACITY_POINTS) -> list:
    """Cache sizes for the bandwidth x capacity sweep: every size from top_k to n_experts when there
    are at most `points`, else `points` sizes spread evenly over that range, always with the
    benchmarked `capacity` and 2 x top_k among them."""
    if n_experts - top_k + 1 <= points:
        return list(range(top_k, n_experts + 1))
    spread = np.rint(np.linspace(top_k, n_experts, points)).astype(int).tolist()
    return sorted(set(spread) | {capacity, min(2 * top_k, n_experts)})


class _StageBar:
    """A progress bar over named stages, each entered by calling the bar with its name (the one
    before it is then done). Off when `name` is empty. Every step is drawn (no minimum interval
    between redraws): there are only a handful, and a quick stage would otherwise go unseen."""

    def __init__(self, n_stages: int, name: str):
        from tqdm.auto import tqdm

        self._bar = tqdm(total=n_stages, desc=name, disable=not name, leave=False, unit="stage",
                         mininterval=0, miniters=1)
        self._open = False

    def __call__(self, stage: str) -> None:
        if self._open:
            self._bar.update()
        self._open = True
        self._bar.set_postfix_str(stage)

    def close(self) -> None:
        if self._open:
            self._bar.update()
        self._bar.close()


def adapter_overhead(shape: P.ModelShape, base_cfg, mcfg) -> float:
    """Fast attention sub-block's LoRA cost relative to the attention weights, at the named
    model's dimensions (same rank and targets as the benchmarked M2R2 config)."""
    d, qd, kvd = shape.d_model, shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    dims = {"q_proj": (d, qd), "k_proj": (d, kvd), "v_proj": (d, kvd), "o_proj": (qd, d)}
    extra = sum(mcfg.lora_rank * sum(dims[t]) for t in adapter_shapes(base_cfg, mcfg) if t in dims)
    attn = 2 * d * qd + 2 * d * kvd
    return extra / attn


def adapter_overhead_of(base_cfg, mcfg) -> float:
    """LoRA overhead of a fast attention sub-block at the benchmarked model's own dimensions."""
    own = P.ModelShape("benchmarked", base_cfg.d_model, base_cfg.n_layers, base_cfg.n_heads, base_cfg.n_kv_heads,
                       base_cfg.head_dim, base_cfg.moe_d_ff, base_cfg.n_experts, base_cfg.n_experts_per_tok)
    return adapter_overhead(own, base_cfg, mcfg)


def _rung(trace, rung: str, costs, capacity: int, link_chunks: int = 1):
    if rung == "all_resident":
        return simulate(trace, "none", costs, capacity, all_resident=True)
    pred, policy = RUNGS[rung]
    return simulate(trace, pred, costs, capacity, policy, link_chunks=link_chunks)


def simulate_ladder(trace, costs, capacity: int, link_chunks: int = 1, base_s: Optional[float] = None) -> dict:
    """Every rung of the ladder; speedups over on-demand LRU on the same link, or over `base_s`."""
    res = {r: _rung(trace, r, costs, capacity, link_chunks) for r in LADDER}
    base = res["on_demand_lru"].total_s if base_s is None else base_s
    return {r: dict(v.to_dict(), speedup_vs_on_demand_lru=base / v.total_s) for r, v in res.items()}


def chunked_link(trace, costs_by_platform: dict, ladders: dict, capacity: int, chunks: int = LINK_CHUNKS) -> dict:
    """The ladder on a link that moves each expert in `chunks` pieces (a miss preempts a prefetch
    at a piece boundary), each speedup over the whole-expert on-demand LRU of `ladders`."""
    base_s, _ = _on_demand_rungs(ladders)
    lads = {pl: simulate_ladder(trace, costs, capacity, chunks, base_s[pl]) for pl, costs in costs_by_platform.items()}
    return {"chunks": chunks,
            "speedup_vs_whole_expert_on_demand_lru": {r: {pl: lads[pl][r]["speedup_vs_on_demand_lru"] for pl in lads}
                                                      for r in LADDER},
            "stall_s": {r: {pl: lads[pl][r]["stall_s"] for pl in lads} for r in LADDER}}


def ceiling(ladder: dict, costs, n_layers: int) -> dict:
    """What no policy can beat on this trace and platform, from a simulated ladder.

    Any schedule, prefetching or not, loads at least as many experts as Belady's demand paging
    (prefetching can be made lazy without extra loads), the link moves one at a time and the slow
    layers compute in sequence, so total >= max(compute, belady loads x transfer time). On-demand
    LRU takes exactly compute + its loads x transfer time, so on every platform the speedup is also
    at most 1 + LRU loads / Belady loads (`loads_ratio_bound`): 2.9x needs a policy that loads at
    most 1/1.9 of what LRU loads, whatever the link.

    Regime: "link-bound" when even Belady's loads keep the link busier than the compute (only
    fewer loads help: better eviction, more slots); "lead-limited" when the link has spare time
    but one transfer (rho layers) outlasts a whole token of compute (n_layers), so a guess made
    within the token still arrives late and the bound above is out of reach; otherwise overlap can
    hide the loads."""
    lru, bel = ladder["on_demand_lru"], ladder["on_demand_belady"]
    bound_s = max(lru["compute_s"], bel["transfers"] * costs.transfer_s)
    link = {r: ladder[r]["transfers"] * costs.transfer_s / ladder[r]["compute_s"]
            for r in ("on_demand_lru", "on_demand_belady")}
    if link["on_demand_belady"] > 1:
        regime = "link-bound"
    elif costs.rho > n_layers:
        regime = "lead-limited"
    else:
        regime = "overlap can hide the loads"
    return {"rho": costs.rho, "link_to_compute": link, "regime": regime,
            "lru_loads_per_token": lru["transfers"] / max(lru["tokens"], 1),
            "belady_loads_per_token": bel["transfers"] / max(bel["tokens"], 1),
            "oracle_belady_speedup": ladder["oracle_belady"]["speedup_vs_on_demand_lru"],
            "bound_s": bound_s, "bound_speedup_vs_on_demand_lru": lru["total_s"] / bound_s,
            "loads_ratio_bound": 1 + lru["transfers"] / max(bel["transfers"], 1)}


def recall_needed(trace, costs_by_platform: dict, ladders: dict, capacity: int, layers, predictor: str = "m2r2",
                  shares=BLEND_SHARES) -> dict:
    """How much recall `predictor` would need before prefetching beats on-demand frequency eviction.

    Its guesses are blended with the true routing (`blend_with_oracle`: a share of the guesses
    replaced by the truth; lead and fast-pass cost unchanged) and each blend is replayed with the
    frequency policy at every confidence gate. `ladders`: each platform's `simulate_ladder` on this
    trace (blending leaves the true routing, so its on-demand rungs hold for every blend). Per
    platform: the best speedup over on-demand LRU per blend, on-demand LFU's, and the lowest recall
    (over `layers`) whose best speedup beats it (None: not even perfect recall does)."""
    base_s, on_demand = _on_demand_rungs(ladders)
    recall, speedup = [], {pl: [] for pl in costs_by_platform}
    for share in shares:
        blended = blend_with_oracle(trace, predictor, share)
        recall.append(mean_recall(recall_per_layer(blended, "blend"), layers))
        for pl, costs in costs_by_platform.items():
            speedup[pl].append(max(base_s[pl] / simulate(blended, "blend", costs, capacity, "predictive_lfu",
                                                         min_confidence=g).total_s for g in CONFIDENCE_GRID))
    break_even = {pl: next((r for r, x in zip(recall, speedup[pl]) if x > on_demand[pl]), None) for pl in speedup}
    return {"predictor": predictor, "share_of_truth": list(shares), "recall": recall, "best_speedup": speedup,
            "on_demand_lfu": on_demand, "break_even_recall": break_even}


def lead_needed(trace, costs_by_platform: dict, ladders: dict, capacity: int) -> dict:
    """How far ahead a perfect predictor must issue its guesses: the true routing issued 1..L layers
    before each demand (`oracle_with_lead`), replayed with the frequency policy (`ladders` as in
    `recall_needed`). Per platform: the speedup over on-demand LRU per lead, on-demand LFU's, and
    the shortest lead that beats it (None: no lead within the token does)."""
    base_s, on_demand = _on_demand_rungs(ladders)
    leads = list(range(1, trace.n_layers + 1))
    with_lead = [oracle_with_lead(trace, a) for a in leads]
    speedup = {pl: [base_s[pl] / simulate(t, "oracle_lead", costs, capacity, "predictive_lfu").total_s for t in with_lead]
               for pl, costs in costs_by_platform.items()}
    shortest = {pl: next((a for a, x in zip(leads, speedup[pl]) if x > on_demand[pl]), None) for pl in speedup}
    return {"lead_layers": leads, "speedup": speedup, "on_demand_lfu": on_demand, "shortest_lead_beating_lfu": shortest,
            "m2r2_leads": trace.lead("m2r2").tolist() if "m2r2" in trace.issue else None}


def _on_demand_rungs(ladders: dict) -> tuple:
    """Per platform: on-demand LRU's total time (every speedup's baseline) and on-demand LFU's speedup."""
    return ({pl: lad["on_demand_lru"]["total_s"] for pl, lad in ladders.items()},
            {pl: lad["on_demand_lfu"]["speedup_vs_on_demand_lru"] for pl, lad in ladders.items()})


def calibrate_engine(base_cfg, base_params, repeats: int = 20) -> dict:
    """Measured on this machine: one expert's host -> device copy and one layer's decode compute
    (attention + k experts) of the real engine."""
    eng = OffloadEngine(base_cfg, base_params, capacity=base_cfg.n_experts)
    host = eng.store.experts[0][0]
    for a in host:  # warm the copy path
        jax.device_put(a, eng.on_device).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(repeats):
        for a in host:
            jax.device_put(a, eng.on_device).block_until_ready()
    transfer = (time.perf_counter() - t0) / repeats
    prompt = [1, 2, 3]
    eng.generate(prompt, 3)  # compile every piece
    eng.reset()
    t0 = time.perf_counter()
    eng.generate(prompt, 3 + repeats)
    per_token = (time.perf_counter() - t0) / (2 + repeats)  # all experts cached after warm-up loads
    layer = per_token / base_cfg.n_layers
    return {"device": str(eng.device), "platform": jax.default_backend(), "expert_bytes": eng.store.expert_bytes,
            "expert_transfer_s": transfer, "layer_compute_s": layer, "rho": transfer / layer,
            "caveat": ("CPU: host and device memory are the same RAM and the per-layer time is dominated by "
                       "Python dispatch; these numbers show the engine works, they are not a real platform")
            if jax.default_backend() == "cpu" else "measured on this device"}


def run_engine(base_cfg, base_params, mcfg, m2r2_params, prompts, max_new_tokens: int, capacity: int,
               reference: list, m2r2_sources=None) -> dict:
    """The real engine per ladder rung on every prompt: hit rate, bytes, stall, tokens/s, and
    whether its tokens equal the all-resident model's."""
    out = {}
    for rung in LADDER:
        if rung in SIMULATOR_ONLY:  # Belady eviction needs the future routing
            continue
        if rung == "all_resident":
            pred, policy, cap = "none", "lru", base_cfg.n_experts
        else:
            (pred, policy), cap = RUNGS[rung], capacity
        eng = OffloadEngine(base_cfg, base_params, capacity=cap, policy=policy, predictor=pred,
                            mcfg=mcfg, m2r2_params=m2r2_params, m2r2_sources=m2r2_sources)
        routes = []
        if pred == "oracle":  # the oracle's routing: a first pass over the same prompts
            first = OffloadEngine(base_cfg, base_params, capacity=cap)
            for p in prompts:
                first.routes = []
                first.generate(p, max_new_tokens)
                routes.append(first.routes)
        same = True
        for _sweep in ("compile", "measure"):  # the first sweep compiles every shape; the second is timed
            eng.reset()
            if rung == "all_resident":
                eng.preload_all()
            for i, (p, ref) in enumerate(zip(prompts, reference)):
                toks, _ = eng.generate(p, max_new_tokens, oracle_routes=routes[i] if routes else None)
                same &= toks == ref
        out[rung] = dict(eng.stats.to_dict(), tokens_equal_all_resident=bool(same), capacity=cap, policy=policy)
    return out


def moe_report(base_cfg, base_params, mcfg, m2r2_params, prompts_tokens: Sequence[Sequence[int]], *,
               max_new_tokens: int = 16, capacity: Optional[int] = None,
               shapes: Sequence[str] = ("mixtral-8x7b", "olmoe-1b-7b"),
               platforms: Sequence[str] = tuple(P.PLATFORMS), run_real_engine: bool = True,
               fresh_m2r2: bool = False, lookaheads: Sequence[int] = (1, 2, 3, 4),
               continuations: Optional[Sequence[Sequence[int]]] = None,
               calibration: Optional[Sequence[Sequence[int]]] = None, calibrate_m2r2: bool = True,
               m2r2_recall_tolerance: float = 0.0, bar: str = "") -> dict:
    """Record routing from real greedy decoding, score the predictors, replay the trace through
    the cost model of named real models on named platforms, and run the real engine.
    `continuations` (one per prompt): record the trace teacher-forced on these tokens instead of
    the model's greedy output (the real engine still decodes greedily).
    `calibrate_m2r2`: choose the m2r2 predictor's source per layer (`choose_m2r2_sources`) on
    `calibration` text, by default the prompts themselves (prefill tokens, never part of the trace),
    with the shortest fast pass whose calibration recall is within `m2r2_recall_tolerance` of the best.

    With `bar`, a progress bar of that name steps through the stages (trace, each simulation sweep,
    the real engine).

    Returns a dict with (at least) `recall`, `hit_rate` and `simulated_speedup` (per predictor,
    per platform, vs on-demand LRU with the cache at `capacity` = 2 x active experts)."""
    if not base_cfg.is_moe:
        raise ConfigError(f"moe-bench needs a MoE base model; family {base_cfg.family!r} has n_experts=0")
    if not prompts_tokens:
        raise ConfigError("moe-bench needs at least one prompt")
    k, E = base_cfg.n_experts_per_tok, base_cfg.n_experts
    capacity = 2 * k if capacity is None else capacity
    if not (k <= capacity <= E):
        raise ConfigError(f"cache capacity={capacity} is invalid: expected top_k={k} .. n_experts={E}")
    shapes = [P.get_shape(s) for s in shapes]
    plats = [P.get_platform(p) for p in platforms]

    stage = _StageBar(7 + int(calibrate_m2r2) + int(run_real_engine), bar)
    visited = tuple(visited_layers(base_cfg, mcfg))
    default_sources, _ = m2r2_state_plan(base_cfg.n_layers, mcfg.branch_layer, visited)
    sources, source_recall = default_sources, None
    calibration = prompts_tokens if calibration is None else calibration
    if calibrate_m2r2:
        stage("calibrating the m2r2 sources")
        sources, source_recall = choose_m2r2_sources(base_cfg, base_params, mcfg, m2r2_params, calibration,
                                                     recall_tolerance=m2r2_recall_tolerance)
    stage("recording the routing trace")
    trace, generated = record_trace(base_cfg, base_params, mcfg, m2r2_params, prompts_tokens, max_new_tokens, lookaheads,
                                    forced=continuations, m2r2_sources=sources)
    predictors = ("next_gate", "m2r2", "oracle")
    per_layer = {p: recall_per_layer(trace, p) for p in trace.rankings}
    recall = {p: mean_recall(per_layer[p]) for p in predictors}
    m2r2_layers = [l for l in range(base_cfg.n_layers) if l >= mcfg.branch_layer]
    recall_after_branch = {p: mean_recall(per_layer[p], m2r2_layers) for p in predictors}

    stage("ladders")
    sims, speedup, hit_rate, confidence_sweep, main_costs = {}, {}, {}, {}, {}
    for shape in shapes:
        ovh = adapter_overhead(shape, base_cfg, mcfg)
        sims[shape.name] = {}
        for plat in plats:
            costs = P.platform_costs(shape, plat, mcfg.moe_fast_mlp, ovh, mcfg.moe_lowrank_dim)
            lad = simulate_ladder(trace, costs, capacity)
            sims[shape.name][plat.name] = {"costs": costs.to_dict(), "ladder": lad,
                                           "ceiling": ceiling(lad, costs, trace.n_layers)}
            if shape is shapes[0]:  # confidence-gated prefetch: only the guesses a predictor is sure of
                main_costs[plat.name] = costs
                base_s = lad["on_demand_lru"]["total_s"]
                confidence_sweep[plat.name] = {
                    rung: {str(th): base_s / simulate(trace, RUNGS[rung][0], costs, capacity, RUNGS[rung][1],
                                                      min_confidence=th).total_s for th in CONFIDENCE_GRID}
                    for rung in GATED_RUNGS}
    main = shapes[0].name
    main_ladders = {pl: sims[main][pl]["ladder"] for pl in main_costs}
    stage("recall needed")
    needed = recall_needed(trace, main_costs, main_ladders, capacity, m2r2_layers)
    stage("chunked link")
    chunked = chunked_link(trace, main_costs, main_ladders, capacity)
    stage("lead needed")
    lead = lead_needed(trace, main_costs, main_ladders, capacity)
    for rung in LADDER[1:]:
        speedup[rung] = {pl: sims[main][pl]["ladder"][rung]["speedup_vs_on_demand_lru"] for pl in sims[main]}
    any_costs = sims[main][plats[0].name]["ladder"]
    for rung in LADDER:
        hit_rate[rung] = any_costs[rung]["hit_rate"]

    # speedup as a function of rho (vary the link; compute fixed at the first platform's device)
    stage("rho sweep")
    rho_sweep = {}
    ovh = adapter_overhead(shapes[0], base_cfg, mcfg)
    ref_costs = P.platform_costs(shapes[0], plats[0], mcfg.moe_fast_mlp, ovh, mcfg.moe_lowrank_dim)
    for rho in RHO_GRID:
        bw = shapes[0].expert_bytes / max(rho * ref_costs.layer_s - ref_costs.link_latency_s, 1e-12) / 1e9
        c = P.platform_costs(shapes[0], plats[0], mcfg.moe_fast_mlp, ovh, mcfg.moe_lowrank_dim, link_gbps=bw)
        lad = simulate_ladder(trace, c, capacity)
        rho_sweep[str(rho)] = {r: lad[r]["speedup_vs_on_demand_lru"] for r in LADDER}
    stage("bandwidth x capacity sweep")
    bw_sweep = []
    for bw in SWEEP_BANDWIDTHS:
        c = P.platform_costs(shapes[0], plats[0], mcfg.moe_fast_mlp, ovh, mcfg.moe_lowrank_dim, link_gbps=bw)
        for cap in sweep_capacities(k, E, capacity):
            lad = simulate_ladder(trace, c, cap)
            bw_sweep.append({"link_gbps": bw, "capacity": cap, "rho": c.rho,
                             **{f"{r}_speedup": lad[r]["speedup_vs_on_demand_lru"] for r in LADDER},
                             **{f"{r}_hit_rate": lad[r]["hit_rate"] for r in LADDER}})

    # the greedy reference: what the trace must equal (no teacher forcing) and the engine must decode
    reference = ([generate_reference(base_cfg, base_params, p, max_new_tokens) for p in prompts_tokens]
                 if continuations is None or run_real_engine else None)
    report = {
        "model": {"family": base_cfg.family, "n_layers": base_cfg.n_layers, "n_experts": E, "top_k": k,
                  "d_model": base_cfg.d_model, "moe_d_ff": base_cfg.moe_d_ff},
        "m2r2": {"config": mcfg.to_dict(), "fresh_untrained_params": bool(fresh_m2r2),
                 "visited_layers": list(visited),
                 "sources": [list(x) for x in sources], "default_sources": [list(x) for x in default_sources],
                 "sources_calibrated_on_tokens": sum(map(len, calibration)) if calibrate_m2r2 else 0,
                 "source_recall_on_calibration": ({str(l): {f"{kind}:{i}": r for (kind, i), r in tab.items()}
                                                   for l, tab in source_recall.items()} if source_recall else None),
                 "fast_steps": fast_steps_needed(sources), "fast_steps_max": len(visited),
                 "recall_tolerance": float(m2r2_recall_tolerance) if calibrate_m2r2 else None,
                 # calibration recall after the branch of the best sources for a pass of 0..K steps
                 "recall_by_fast_steps": ([mean for _, mean in sources_by_fast_steps(
                     source_recall, base_cfg.n_layers, mcfg.branch_layer, visited)] if source_recall else None),
                 "draft_cost_layers": float(draft_cost_layers(base_cfg, mcfg))},
        "trace": {"prompts": len(prompts_tokens), "decoded_tokens": trace.n_tokens,
                  "teacher_forced": continuations is not None,
                  # a teacher-forced trace follows the given text, not the greedy reference
                  "trace_tokens_equal_reference": generated == reference if continuations is None else None,
                  "distinct_token_fraction": len({t for g in generated for t in g}) / max(trace.n_tokens, 1),
                  "expert_load": expert_load(trace),
                  "leads": {p: trace.lead(p).tolist() for p in trace.rankings}, **trace.notes},
        "capacity": capacity,
        "recall": recall,
        "recall_after_branch": recall_after_branch,
        "recall_per_layer": per_layer,
        "recall_by_lookahead": recall_by_lookahead(trace),
        "hit_rate": hit_rate,
        "simulated_speedup": speedup,
        "simulated_speedup_model": main,
        "ceiling": {pl: sims[main][pl]["ceiling"] for pl in sims[main]},
        "simulation": sims,
        "confidence_sweep": confidence_sweep,
        "recall_needed": needed,
        "chunked_link": chunked,
        "lead_needed": lead,
        "rho_sweep": rho_sweep,
        "bandwidth_capacity_sweep": bw_sweep,
        "assumptions": dict(P.assumptions(), **{
            "trace_vs_costs": ("routing (which experts, predictions, leads) comes from decoding the benchmarked "
                               "checkpoint; expert bytes and per-layer compute come from the named real model "
                               "shape; the cache holds `capacity` experts per layer, capacity = 2 x top_k of "
                               "the benchmarked model unless set"),
            "ladder_policies": {r: RUNGS.get(r, ("none", "all resident")) for r in LADDER},
            "fast_pass_cost": ("m2r2 pays a fast attention sub-block (attention x (1 + LoRA overhead)) plus the "
                               "fast MLP for each fast step it runs (m2r2.fast_steps of m2r2.fast_steps_max: "
                               f"up to the last step its sources need): moe_fast_mlp={mcfg.moe_fast_mlp!r} (experts: k experts and their "
                               "loads; lowrank: a d x r adapter; none: nothing)"),
            "m2r2_before_branch": "layers before branch_layer use next_gate inside the m2r2 predictor",
            "confidence_sweep": ("speedup over on-demand LRU per platform when a predictor prefetches only the "
                                 "guesses whose confidence (router probability over that of the best expert left "
                                 "out of the guess) reaches the gate; 0 = every guess, as in the ladder"),
            "m2r2_sources": ("the m2r2 predictor guesses each layer from the source (a fast step's own router "
                             "or a layer's router on one of the fast states) that recalled the most routing on "
                             "the calibration text (the prompts' own tokens unless given); all sources exist "
                             "by the end of the fast pass, so the lead is the fast stream's"),
            "belady_rungs": ("on_demand_belady and oracle_belady evict the expert next needed furthest in the "
                             "future (Belady's MIN, read from the recorded routing): simulator-only ceilings, "
                             "not methods. on_demand_belady is the fewest loads of any demand paging at this "
                             "capacity; oracle_belady adds perfect prefetch at the token's start, the ceiling of predictors that "
                             "guess within the token (a guess issued a token earlier, even a lucky wrong one, can "
                             "rarely finish sooner; never with fewer loads); report['ceiling'] bounds every "
                             "schedule by max(compute, Belady loads x transfer time)"),
        }),
    }
    if fresh_m2r2:
        report["m2r2"]["note"] = ("fresh (untrained) M2R2 parameters: the fast stream is only a rate-vector "
                                  "extrapolation of the base layers, so its predictions may be weak")
    if run_real_engine:
        stage("real engine")
        cal = calibrate_engine(base_cfg, base_params)
        half = cal["layer_compute_s"] / 2  # attention vs experts split: assumed even (not measured apart)
        if mcfg.moe_fast_mlp == "experts":
            fast_mlp = half
        else:
            fast_mlp = half * (mcfg.moe_lowrank_dim / (k * base_cfg.moe_d_ff) if mcfg.moe_fast_mlp == "lowrank" else 0.0)
        measured = P.CostModel(half, half, half * (1 + adapter_overhead_of(base_cfg, mcfg)), fast_mlp,
                               cal["expert_bytes"], 0.0, cal["expert_bytes"] / cal["expert_transfer_s"])
        report["simulation_measured_costs"] = {
            "costs": measured.to_dict(), "ladder": simulate_ladder(trace, measured, capacity),
            "caveat": cal["caveat"] + "; attention and experts assumed to take half a layer each"}
        report["engine"] = {"memory_kinds": list(memory_kinds()), "host_memory_kind": "pinned_host",
                            "calibration": cal,
                            "ladder": run_engine(base_cfg, base_params, mcfg, m2r2_params, prompts_tokens,
                                                 max_new_tokens, capacity, reference, m2r2_sources=sources)}
    stage.close()
    report["targets"] = targets(report)
    return report


def targets(report: dict) -> dict:
    """The issue's benchmark targets, evaluated on this run (reported, not asserted)."""
    vs = report["recall_by_lookahead"]["m2r2_vs_next_gate"]
    recall_cmp = {a: v["m2r2"] > [x for kk, x in v.items() if kk.startswith("next_gate")][0]
                  for a, v in vs.items() if int(a) >= 2}
    sp = report["simulated_speedup"]
    faster = {pl: sp["m2r2"][pl] > sp["next_gate"][pl] for pl in sp["m2r2"]}
    faster_lfu = {pl: sp["m2r2_lfu"][pl] > sp["next_gate_lfu"][pl] for pl in sp["m2r2_lfu"]}
    # the same comparison at each predictor's best setting: either eviction order, any confidence gate
    cs = report.get("confidence_sweep", {})

    def best_of(pred: str, pl: str) -> float:
        rungs = (pred, pred + "_lfu")
        return max([sp[r][pl] for r in rungs] + [v for r in rungs for v in cs.get(pl, {}).get(r, {}).values()])

    faster_best = {pl: best_of("m2r2", pl) > best_of("next_gate", pl) for pl in sp["m2r2"]}
    # does prefetching pay at all: m2r2 against the best policy that needs no predictor
    beats_lfu = {pl: sp["m2r2_lfu"][pl] > sp["on_demand_lfu"][pl] for pl in sp["m2r2_lfu"]}
    ch = report.get("chunked_link", {}).get("speedup_vs_whole_expert_on_demand_lru")
    beats_lfu_chunked = ({pl: ch["m2r2_lfu"][pl] > ch["on_demand_lfu"][pl] for pl in ch["m2r2_lfu"]}
                         if ch else None)
    best_per_platform = {pl: best_of("m2r2", pl) for pl in sp["m2r2"]}
    best = max(best_per_platform.values()) if best_per_platform else float("nan")
    ceil = {pl: sp["oracle_belady"][pl] for pl in sp["oracle_belady"]}
    bound = {pl: c["bound_speedup_vs_on_demand_lru"] for pl, c in report["ceiling"].items()}
    return {"m2r2_recall_above_next_gate_at_lookahead_ge_2": recall_cmp,
            "m2r2_faster_than_next_gate_per_platform": faster,
            "m2r2_faster_than_next_gate_with_lfu_eviction_per_platform": faster_lfu,
            "m2r2_faster_than_next_gate_at_best_settings_per_platform": faster_best,
            "m2r2_lfu_faster_than_on_demand_lfu_per_platform": beats_lfu,
            "m2r2_lfu_faster_than_on_demand_lfu_on_a_chunked_link_per_platform": beats_lfu_chunked,
            "best_m2r2_speedup_per_platform": best_per_platform,
            "best_m2r2_speedup_vs_on_demand_lru": best,
            f"speedup_ge_{TARGET_SPEEDUP}_on_some_platform": bool(best >= TARGET_SPEEDUP),
            # what any predictor + policy could reach on this trace: the simulated oracle_belady rung
            # and the schedule-free bound max(compute, Belady loads x transfer) behind it
            "ceiling_speedup_vs_on_demand_lru": ceil,
            "bound_speedup_vs_on_demand_lru": bound,
            "regime_per_platform": {pl: c["regime"] for pl, c in report["ceiling"].items()},
            f"speedup_ge_{TARGET_SPEEDUP}_reachable_by_any_policy": bool(max(bound.values()) >= TARGET_SPEEDUP),
            f"oracle_belady_ge_{TARGET_SPEEDUP}_on_some_platform": bool(max(ceil.values()) >= TARGET_SPEEDUP)}


def write_plots(report: dict, out_dir) -> list:
    """recall per layer, recall by lookahead, hit rate, simulated speedup per platform, speedup vs rho,
    bytes and stalls, bandwidth x capacity, recall needed, lead needed, engine tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []

    def save(fig, name):
        p = out / name
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(str(p))

    fig, ax = plt.subplots(figsize=(6, 4))
    for p, vals in report["recall_per_layer"].items():
        if p.startswith("next_gate@"):
            continue
        xs = [l for l, v in enumerate(vals) if v is not None]
        ax.plot(xs, [vals[l] for l in xs], marker="o", label=p)
    ax.set(xlabel="layer (0-based)", ylabel="recall@k", title="expert prediction recall per layer", ylim=(0, 1.05))
    ax.legend()
    save(fig, "recall_per_layer.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    by_pred = report["recall_by_lookahead"]["by_predictor"]
    ng = {}
    for name, by in by_pred.items():
        if name.startswith("next_gate"):
            ng.update({int(a): v for a, v in by.items()})
    xs = sorted(ng)
    ax.plot(xs, [ng[a] for a in xs], marker="s", label="next_gate@lookahead")
    m2 = {int(a): v for a, v in by_pred.get("m2r2", {}).items()}
    xs = sorted(m2)
    ax.plot(xs, [m2[a] for a in xs], marker="o", label="m2r2 (by lead)")
    ax.set(xlabel="lookahead (layers)", ylabel="recall@k", title="recall vs lead time", ylim=(0, 1.05))
    ax.legend()
    save(fig, "recall_by_lookahead.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(report["hit_rate"])
    ax.bar(names, [report["hit_rate"][n] for n in names])
    ax.set(ylabel="cache hit rate", title=f"hit rate, capacity {report['capacity']} slots/layer", ylim=(0, 1.05))
    ax.tick_params(axis="x", rotation=20)
    save(fig, "hit_rate.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    sp = report["simulated_speedup"]
    plats = list(next(iter(sp.values())))
    width = 0.8 / len(sp)
    for i, (rung, vals) in enumerate(sp.items()):
        ax.bar(np.arange(len(plats)) + i * width, [vals[p] for p in plats], width, label=rung)
    ax.set_xticks(np.arange(len(plats)) + 0.4 - width / 2, plats)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(ylabel="speedup vs on-demand LRU", title=f"simulated ({report['simulated_speedup_model']} costs)")
    ax.legend(fontsize=8)
    save(fig, "simulated_speedup.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    rhos = sorted(report["rho_sweep"], key=float)
    for rung in LADDER[1:]:
        ax.plot([float(r) for r in rhos], [report["rho_sweep"][r][rung] for r in rhos], marker="o", label=rung)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="rho = expert transfer time / layer compute time", ylabel="speedup vs on-demand LRU",
           title="where prefetching pays")
    ax.legend()
    save(fig, "speedup_vs_rho.png")

    main = report["simulation"][report["simulated_speedup_model"]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    plats = list(main)
    width = 0.8 / len(LADDER)
    for i, rung in enumerate(LADDER):
        lad = [main[p]["ladder"][rung] for p in plats]
        axes[0].bar(np.arange(len(plats)) + i * width, [r["bytes_moved"] / max(r["tokens"], 1) / 1e9 for r in lad],
                    width, label=rung)
        axes[1].bar(np.arange(len(plats)) + i * width, [r["stall_s"] / r["total_s"] if r["total_s"] else 0 for r in lad],
                    width, label=rung)
    for ax, ylab in zip(axes, ("GB moved per token", "stall time / total time")):
        ax.set_xticks(np.arange(len(plats)) + 0.4 - width / 2, plats, rotation=15)
        ax.set(ylabel=ylab)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"simulated transfers and stalls ({report['simulated_speedup_model']} costs)")
    save(fig, "bytes_and_stall.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    rows = report["bandwidth_capacity_sweep"]
    for bw in sorted({r["link_gbps"] for r in rows}):
        sel = [r for r in rows if r["link_gbps"] == bw]
        ax.plot([r["capacity"] for r in sel], [r["m2r2_speedup"] for r in sel], marker="o", label=f"m2r2 {bw:g} GB/s")
        color = ax.lines[-1].get_color()
        ax.plot([r["capacity"] for r in sel], [r["oracle_speedup"] for r in sel], ls="--", color=color,
                label=f"oracle {bw:g} GB/s")
        ax.plot([r["capacity"] for r in sel], [r["oracle_belady_speedup"] for r in sel], ls=":", color=color,
                label=f"oracle_belady (ceiling) {bw:g} GB/s")
    ax.set(xlabel="cache slots per layer", ylabel="speedup vs on-demand LRU (same slots)",
           title="link bandwidth x cache size")
    ax.legend(fontsize=7)
    save(fig, "bandwidth_capacity_sweep.png")

    def against_on_demand_lfu(xs, curves: dict, on_demand: dict, label: str, **axes):
        """One speedup curve per platform, each with on-demand LFU's speedup as a dotted line."""
        fig, ax = plt.subplots(figsize=(6, 4))
        for pl, vals in curves.items():
            ax.plot(xs, vals, marker="o", label=f"{label}, {pl}")
            ax.axhline(on_demand[pl], ls=":", lw=0.8, color=ax.lines[-1].get_color())
        ax.set(ylabel="speedup vs on-demand LRU", **axes)
        ax.legend(fontsize=7)
        return fig, ax

    need = report.get("recall_needed")
    if need:
        fig, ax = against_on_demand_lfu(
            need["recall"], need["best_speedup"], need["on_demand_lfu"], f"{need['predictor']} blended",
            xlabel=f"recall after the branch ({need['predictor']} guesses partly replaced by the truth)",
            title="recall needed to beat on-demand LFU (dotted)")
        ax.axvline(need["recall"][0], color="k", lw=0.8)
        save(fig, "recall_needed.png")

    lead = report.get("lead_needed")
    if lead:
        fig, _ = against_on_demand_lfu(lead["lead_layers"], lead["speedup"], lead["on_demand_lfu"], "true routing",
                                       xlabel="lead (layers between the guess and the demand)",
                                       title="lead a perfect predictor needs (dotted: on-demand LFU)")
        save(fig, "lead_needed.png")

    if "engine" in report:
        fig, ax = plt.subplots(figsize=(6, 4))
        lad = report["engine"]["ladder"]
        ax.bar(list(lad), [lad[r]["tokens_per_s"] for r in lad])
        ax.set(ylabel="tokens/s (real engine, this machine)", title="real offload engine")
        ax.tick_params(axis="x", rotation=20)
        save(fig, "engine_tokens_per_s.png")
    return paths
