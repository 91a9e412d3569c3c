"""Prediction quality of a routing trace: recall@k per layer and by lookahead (lead time)."""

from __future__ import annotations

import numpy as np

from m2r2_jax.moe_offload.trace import RoutingTrace

SKEW_MIN_ASSIGNMENTS = 10  # per expert and layer, before `expert_load` calls a trace's routing skewed


def recall_per_layer(trace: RoutingTrace, name: str, k: int | None = None) -> list:
    """Mean over tokens of |top-k guess ∩ true experts| / top_k, per layer (None: no guess)."""
    k = trace.top_k if k is None else k
    r = trace.rankings[name]
    out = []
    for l in range(trace.n_layers):
        if np.all(r[:, l, 0] < 0):
            out.append(None)
            continue
        hits = [len(set(r[n, l, :k]) & set(trace.true[n, l])) for n in range(trace.n_tokens)]
        out.append(float(np.mean(hits)) / trace.top_k)
    return out


def mean_recall(per_layer, layers=None) -> float | None:
    vals = [v for l, v in enumerate(per_layer) if v is not None and (layers is None or l in layers)]
    return float(np.mean(vals)) if vals else None


def recall_by_lookahead(trace: RoutingTrace) -> dict:
    """For every lookahead a seen in the trace: each predictor's recall on the layers it guesses
    with lead a, and the layer-matched comparison of m2r2 against next_gate@a on m2r2's layers of
    lead a (m2r2's layers before the branch, which use next-gate, are excluded)."""
    per_layer = {p: recall_per_layer(trace, p) for p in trace.rankings}
    out: dict = {"by_predictor": {}, "m2r2_vs_next_gate": {}}
    for p, rec in per_layer.items():
        if p == "oracle":
            continue
        lead = trace.lead(p)
        by = {}
        for a in sorted(set(int(x) for x in lead if x > 0)):
            layers = [l for l in range(trace.n_layers) if lead[l] == a
                      and not (p == "m2r2" and l < trace.branch_layer)]
            v = mean_recall(rec, layers)
            if v is not None:
                by[a] = v
        out["by_predictor"][p] = by
    if "m2r2" in per_layer:
        lead = trace.lead("m2r2")
        for a in sorted(set(int(x) for x in lead if x > 0)):
            ng = "next_gate" if a == 1 else f"next_gate@{a}"
            if ng not in per_layer:
                continue
            layers = [l for l in range(trace.n_layers) if lead[l] == a and l >= trace.branch_layer]
            m, n = mean_recall(per_layer["m2r2"], layers), mean_recall(per_layer[ng], layers)
            if m is not None and n is not None:
                out["m2r2_vs_next_gate"][a] = {"layers": layers, "m2r2": m, ng: n}
    return out


def expert_load(trace: RoutingTrace) -> dict:
    """How evenly the slow stream spreads its expert assignments over the trace: per layer, the
    busiest expert's share of the (token, top-k slot) assignments times E. 1 is an even split; E /
    top_k means every token picks the same experts. (Pre-training logs the same figure as
    `expert_load_max`.) A cache of 2 x top_k slots hits almost always on skewed routing, so a trace
    far above 1 makes every offload policy look better than it would on a balanced MoE.
    `skewed`: the mean is at least half way from even to collapsed, over enough assignments (10 per
    expert and layer) for a few tokens' chance picks not to decide it."""
    E, k = trace.n_experts, trace.top_k
    per_layer = [float(np.bincount(trace.true[:, l].ravel(), minlength=E).max()) * E / (trace.n_tokens * k)
                 for l in range(trace.n_layers)]
    mean = float(np.mean(per_layer))
    return {"busiest_expert_load_per_layer": per_layer, "busiest_expert_load": mean, "even": 1.0,
            "collapsed": E / k,
            "skewed": bool(mean >= (1 + E / k) / 2 and trace.n_tokens * k >= SKEW_MIN_ASSIGNMENTS * E)}
