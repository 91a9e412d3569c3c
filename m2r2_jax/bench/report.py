"""report.json helpers: the printed table, the targets check and the plots."""

from __future__ import annotations

from pathlib import Path

from m2r2_jax.bench.gamma import expected_tokens, format_choice

SPEC_ORDER = ("ar", "m2r2_spec", "distance_spec", "two_model")


def targets(report: dict) -> dict:
    """The main job's benchmark targets, each with the measured value (not a test: a record)."""
    out = {}
    spec = report.get("speculative", {})
    m, d = spec.get("m2r2_spec"), spec.get("distance_spec")
    if m:
        out["m2r2_spec_speedup_ge_1.5"] = {"value": m["speedup_vs_ar"], "met": m["speedup_vs_ar"] >= 1.5}
        out["m2r2_spec_efficiency_ge_0.85"] = {"value": m["efficiency"], "met": m["efficiency"] >= 0.85}
        out["m2r2_spec_identical_to_ar"] = {"value": m["identical_to_ar"], "met": bool(m["identical_to_ar"])}
    if m and d:
        out["m2r2_above_distance_accepted"] = _accepted_at_equal_gamma(report, m, d)
        out["m2r2_above_distance_speedup"] = {"value": [m["speedup_vs_ar"], d["speedup_vs_ar"]],
                                              "met": m["speedup_vs_ar"] > d["speedup_vs_ar"]}
    one = report.get("speculative_one_core", {}).get("methods", {})
    if "m2r2_spec" in one:  # the same target where plain decoding is fastest on a small CPU
        sp = one["m2r2_spec"]["speedup_vs_ar"]
        out["m2r2_spec_speedup_ge_1.5_one_core"] = {"value": sp, "met": sp >= 1.5}
        if "efficiency" in one["m2r2_spec"]:  # its own in-graph costs, measured on the one core too
            eff = one["m2r2_spec"]["efficiency"]
            out["m2r2_spec_efficiency_ge_0.85_one_core"] = {"value": eff, "met": eff >= 0.85}
    al = report.get("alignment")
    if al:
        beats = al.get("fast_beats_slow_at_equal_compute", [])
        out["fast_above_slow_at_equal_compute"] = {"value": beats, "met": bool(beats) and all(beats)}
    ee = report.get("early_exit", {})
    if "distance_exit" in ee and any(m.startswith("m2r2_exit") for m in ee):
        out["m2r2_exit_rouge_ge_0.9_faster_than_distance_exit"] = _exit_target(ee)
    return out


def _exit_target(ee: dict, rouge: float = 0.9) -> dict:
    """The fastest threshold of the M2R2 exits (any variant) and of distance_exit whose answers
    keep ROUGE-L >= `rouge` against the full model's: met when M2R2's is the faster one. Also says
    whether that M2R2 point exits at all (at a threshold where no token leaves, the speed is only
    the machinery's cost)."""
    def best(rows):
        ok = [r for r in rows if r["rouge_l"] >= rouge]
        return max(ok, key=lambda r: r["speedup"]) if ok else None

    m = [(name, best(rows)) for name, rows in ee.items() if name.startswith("m2r2_exit")]
    m = max(((n, r) for n, r in m if r), key=lambda nr: nr[1]["speedup"], default=(None, None))
    d = best(ee["distance_exit"])
    value = {"m2r2": None if m[1] is None else {"method": m[0], "threshold": m[1]["threshold"],
                                                "speedup": m[1]["speedup"], "rouge_l": m[1]["rouge_l"],
                                                "early_exit_fraction": m[1].get("early_exit_fraction")},
             "distance_exit": None if d is None else {"threshold": d["threshold"], "speedup": d["speedup"],
                                                      "rouge_l": d["rouge_l"]}}
    met = m[1] is not None and (d is None or m[1]["speedup"] > d["speedup"])
    return {"value": value, "met": met}


def _accepted_at_equal_gamma(report: dict, m: dict, d: dict) -> dict:
    """Mean accepted tokens of m2r2_spec vs distance_spec at the same draft length: from the runs
    when both used one gamma, else from the gamma tuning's acceptance curves at m2r2_spec's gamma."""
    tuning = report.get("gamma_tuning", {})
    g = m.get("gamma")
    if g != d.get("gamma") and {"m2r2_spec", "distance_spec"} <= set(tuning):
        acc = [expected_tokens(tuning[k]["acceptance_by_position"], min(g, len(tuning[k]["acceptance_by_position"])))
               for k in ("m2r2_spec", "distance_spec")]
        return {"value": acc, "gamma": g, "source": "gamma tuning (calibration prompts)", "met": acc[0] > acc[1]}
    acc = [m["mean_accepted_tokens"], d["mean_accepted_tokens"]]
    return {"value": acc, "gamma": g, "source": "benchmark runs", "met": acc[0] > acc[1]}


def _base_quality_line(report: dict) -> str:
    """How far the base is trained, printed next to the speedups that depend on it: a young base's
    later layers change few of its predictions, so every self-drafter's acceptance is high on it
    and falls as the base learns (docs/RESULTS.md, "How the speedup depends on the base's training")."""
    base = report.get("base") or {}
    pre = report.get("models", {}).get("base", {}).get("pretrain", {})
    if base.get("heldout_perplexity") is not None:
        line = f"  base: {base['name']}, held-out perplexity {base['heldout_perplexity']:.1f} ({base['heldout_text']})"
    elif "heldout_loss" in pre:
        line = f"  base: held-out loss {pre['heldout_loss']:.2f} nats/token after {pre.get('step', '?')} pre-training steps"
    else:
        return ""
    slow = report.get("alignment", {}).get("slow_agreement")
    if slow:
        half = len(slow) // 2
        line += f"; its layer {half} agrees with its output on {slow[half - 1]:.0%} of held-out tokens"
    return line


def _sampled_speedups(by_method: dict) -> str:
    """"m2r2_spec 1.25x, 4.36 accepted, ..." for the speculative methods present in `by_method`."""
    return ", ".join(f"{m} {by_method[m]['speedup_vs_ar']:.2f}x, {by_method[m]['mean_accepted_tokens']:.2f} accepted"
                     for m in SPEC_ORDER[1:] if m in by_method)


def table(report: dict) -> str:
    lines = []
    spec = report.get("speculative", {})
    if spec:
        hdr = (f"{'method':<14}{'tok/s':>9}{'speedup':>9}{'per answer':>12}{'accepted':>10}{'ideal':>8}{'effic.':>8}"
               f"{'same':>6}")
        sweep_sizes = [b["batch_size"] for b in spec["ar"]["batch_sweep"]]
        hdr += "".join(f"{'x@b' + str(b):>8}" for b in sweep_sizes)
        lines += ["speculative decoding (greedy, batch 1, every method timed side by side with ar; per answer: "
                  "lowest-highest answer speedup; batch sweep: speedup vs ar)", hdr, "-" * len(hdr)]
        for m in SPEC_ORDER:
            if m not in spec:
                continue
            r = spec[m]
            ideal = r.get("ideal_speedup", 1.0)
            per = r.get("speedup_vs_ar_per_answer") or [r["speedup_vs_ar"]]
            rng = f"{min(per):.2f}-{max(per):.2f}"
            row = (f"{m:<14}{r['tokens_per_s']:>9.1f}{r['speedup_vs_ar']:>9.2f}{rng:>12}{r['mean_accepted_tokens']:>10.2f}"
                   f"{ideal:>8.2f}{r['efficiency']:>8.2f}{('yes' if r['identical_to_ar'] else 'NO') if m != 'ar' else '-':>6}")
            row += "".join(f"{b['speedup_vs_ar']:>8.2f}" for b in r["batch_sweep"])
            lines.append(row)
        if all("compile_seconds" in spec[m] for m in SPEC_ORDER if m in spec):
            lines.append("  compiling, not in the timings above (first call less its answer): "
                         + ", ".join(f"{m} {spec[m]['compile_seconds']:.1f} s" for m in SPEC_ORDER if m in spec))
        one = report.get("speculative_one_core", {}).get("methods", {})
        if one and "ar" in one:
            lines.append(f"  pinned to one core (a separate run): ar {one['ar']['tokens_per_s']:.1f} tok/s; "
                         + ", ".join(f"{m} {r['speedup_vs_ar']:.2f}x ({r['tokens_per_s']:.1f} tok/s"
                                     + (f", efficiency {r['efficiency']:.2f}" if "efficiency" in r else "") + ")"
                                     for m, r in one.items() if m != "ar"))
        one_sam = report.get("speculative_one_core", {}).get("sampled")
        if one_sam:
            lines.append(f"  pinned to one core, sampled (temperature {one_sam['temperature']}): "
                         + _sampled_speedups(one_sam["methods"]))
        sam = report.get("speculative_sampled")
        if sam:
            lines.append(f"  sampled (temperature {sam['temperature']}), side by side with sampled ar: "
                         + _sampled_speedups(sam))
        if "distinct_token_fraction" in spec["ar"]:
            lines.append(f"  ar's greedy answers: {spec['ar']['distinct_token_fraction']:.0%} distinct tokens"
                         + ("  (they loop: acceptance is inflated for every drafter)"
                            if spec["ar"]["distinct_token_fraction"] < 0.3 else ""))
        loops = report.get("layer_loop")
        if loops:
            by_loop = {}
            for m, loop in loops.items():
                by_loop.setdefault(loop, []).append(m)
            lines.append("  layer loop: " + "; ".join(f"{loop} ({', '.join(ms)})" for loop, ms in by_loop.items()))
        base_line = _base_quality_line(report)
        if base_line:
            lines.append(base_line)
        ctx = report.get("speculative_heldout_contexts")
        if ctx:
            n = max(v["contexts"] for v in ctx.values())
            lines.append(f"  first round after {n} held-out text windows (real text), tokens per verification: "
                         + ", ".join(f"{m} {v['mean_accepted_tokens']:.2f}"
                                     + (f" (answers {spec[m]['mean_accepted_tokens']:.2f})"
                                        if "mean_accepted_tokens" in spec.get(m, {}) else "")
                                     + f" at gamma {v['gamma']}" for m, v in ctx.items()))
        for m, rec in report.get("gamma_tuning", {}).items():
            lines.append("  draft length " + format_choice(m, rec))
        for m in SPEC_ORDER[1:]:
            if m in spec and "costs" in spec[m]:
                c = spec[m]["costs"]
                lines.append(f"  {m} (gamma {spec[m].get('gamma')}): draft {spec[m]['draft_cost_layers']:.1f} layer-eq/token "
                             f"(measured {c['draft_cost_per_token']:.2f} ar-steps), verify {c['verify_cost_ratio']:.2f} ar-steps"
                             + (f"; whole round {c['round_cost_ratio']:.2f} ar-steps ({c['round_overhead']:+.2f} beyond "
                                f"the two passes), bound {spec[m]['ideal_speedup_from_round']:.2f}x"
                                if "round_cost_ratio" in c and "ideal_speedup_from_round" in spec[m] else "")
                             + (f"; ideal {spec[m]['ideal_speedup']:.2f}x (cost samples "
                                f"{spec[m]['ideal_speedup_spread'][0]:.2f}-{spec[m]['ideal_speedup_spread'][1]:.2f})"
                                if "ideal_speedup_spread" in spec[m] else "")
                             + (f"; prefill {c['t_prefill'] / c['t_ar_step']:.2f} ar-steps (ar's "
                                f"{c['t_prefill_ar'] / c['t_ar_step']:.2f}); without it ideal "
                                f"{spec[m]['ideal_speedup_decode_only']:.2f}x, efficiency "
                                f"{spec[m]['efficiency_decode_only']:.2f}"
                                if "t_prefill" in c and "ideal_speedup_decode_only" in spec[m] else ""))
    roof = report.get("ar_roofline")
    if roof:
        lines.append(f"  ar: {roof['ar_tokens_per_s']:.1f} tok/s = {roof['fraction_of_bound']:.0%} of the weight-streaming "
                     f"bound {roof['bound_tokens_per_s']:.1f} tok/s ({roof['weight_bytes_per_token'] / 1e6:.0f} MB of "
                     f"weights per token at {roof['copy_bandwidth']['bytes_per_s'] / 1e9:.1f} GB/s measured copy bandwidth)")
    al = report.get("alignment")
    if al:
        lines += ["", "alignment: top-1 agreement with the final output at compute (layers)"]
        lines.append("  slow: " + " ".join(f"{c:.0f}:{a:.2f}" for c, a in zip(al["slow_cost"], al["slow_agreement"])))
        lines.append("  fast: " + " ".join(f"{c:.1f}:{a:.2f}" for c, a in zip(al["fast_cost"], al["fast_agreement"])))
    ee = report.get("early_exit")
    if ee:
        lines += ["", "early exit (quality vs the full model's greedy output)"]
        for m, rows in ee.items():
            for r in rows:
                lines.append(f"  {m:<14} tau={r['threshold']:<5} speedup {r['speedup']:.2f}  ROUGE-L {r['rouge_l']:.3f}"
                             f"  agreement {r['agreement']:.3f}  layers/token {r['layers_per_token']:.1f}")
    moe = report.get("moe")
    if moe:
        lines += ["", "MoE ahead-of-time loading: recall / hit rate per predictor"]
        load = moe.get("trace", {}).get("expert_load")
        if load:
            lines.append(f"  routing of the traced base: busiest expert {load['busiest_expert_load']:.2f} x an even "
                         f"share (1 = balanced, {load['collapsed']:g} = every token picks the same experts)"
                         + ("  SKEWED: caches hit more than on a balance-trained MoE" if load.get("skewed") else ""))
        for p, v in moe.get("recall", {}).items():
            hr = moe.get("hit_rate", {}).get(p)
            lines.append(f"  {p:<12} recall {v if isinstance(v, str) else f'{v:.3f}'}"
                         + (f"  hit rate {hr:.3f}" if isinstance(hr, float) else ""))
        sp = moe.get("simulated_speedup", {})
        if sp:
            plats = list(next(iter(sp.values())))
            lines.append(f"  simulated speedup vs on-demand LRU ({moe.get('simulated_speedup_model', '')} costs, "
                         f"{moe.get('capacity')} slots per layer)")
            lines.append(f"  {'':<18}" + "".join(f"{pl:>13}" for pl in plats))
            for rung, row in sp.items():
                lines.append(f"  {rung:<18}" + "".join(f"{row[pl]:>13.2f}" for pl in plats))
            cs = moe.get("confidence_sweep", {})
            for rung in ("next_gate", "next_gate_lfu", "m2r2", "m2r2_lfu"):
                if all(rung in cs.get(pl, {}) for pl in plats):
                    best = [max(cs[pl][rung].items(), key=lambda kv: kv[1]) for pl in plats]
                    lines.append(f"  {rung + ' gated':<18}" + "".join(f"{v:>8.2f} @{float(g):<3.2g}" for g, v in best))
            ch = moe.get("chunked_link")
            if ch:
                row = ch["speedup_vs_whole_expert_on_demand_lru"]
                lines.append(f"  on a link moving {ch['chunks']} pieces per expert (a miss preempts a prefetch): "
                             + ", ".join(f"{pl} m2r2_lfu {row['m2r2_lfu'][pl]:.2f} / next_gate_lfu "
                                         f"{row['next_gate_lfu'][pl]:.2f} / on_demand_lfu {row['on_demand_lfu'][pl]:.2f}"
                                         for pl in plats))
            need = moe.get("recall_needed")
            if need:
                be = need["break_even_recall"]
                lines.append(f"  m2r2 recall after the branch {need['recall'][0]:.2f}; recall at which its prefetching "
                             "beats on-demand LFU: " + ", ".join(f"{pl} {'never' if be.get(pl) is None else f'{be[pl]:.2f}'}"
                                                                 for pl in plats))
            lead = moe.get("lead_needed")
            if lead:
                picks = sorted({a for a in (1, 2, 4, lead["lead_layers"][-1]) if a in lead["lead_layers"]})
                lines.append(f"  true routing issued a layers ahead (a = {'/'.join(map(str, picks))}): " + ", ".join(
                    f"{pl} " + "/".join(f"{lead['speedup'][pl][lead['lead_layers'].index(a)]:.2f}" for a in picks)
                    for pl in plats))
    if report.get("sample"):
        lines += ["", "sample of the dense base: " + repr(report["sample"]["prompt"] + report["sample"]["text"])[:300]]
    t = report.get("targets")
    if t:
        lines += ["", "targets: " + ", ".join(f"{k}={'met' if v['met'] else 'MISSED'}" for k, v in t.items())]
    tm = report.get("timings")
    if tm:
        lines.append("time: " + ", ".join(f"{k}={v:.0f}s" for k, v in tm.items()))
    cc = report.get("compile_cache")
    if cc:
        lines.append(f"compiled programs loaded from the cache: {cc['hits']} "
                     f"({cc['compile_s_saved']:.0f}s of compiling saved)")
    return "\n".join(lines)


def write_plots(report: dict, out) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from m2r2_jax.m2r2.analysis import plot_alignment

    out = Path(out)
    written = []
    if report.get("alignment"):
        plot_alignment(report["alignment"], out / "alignment.png")
        written.append(out / "alignment.png")
    spec = report.get("speculative")
    if spec:
        methods = [m for m in SPEC_ORDER if m in spec]
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        axes[0].bar(methods, [spec[m]["speedup_vs_ar"] for m in methods], color="C0", label="measured")
        axes[0].scatter(methods, [spec[m].get("ideal_speedup", 1.0) for m in methods], color="C3", zorder=3, label="ideal (measured costs)")
        axes[0].axhline(1.0, color="k", lw=0.5)
        axes[0].set_title("speedup over ar (batch 1)")
        axes[0].legend()
        axes[1].bar(methods, [spec[m]["mean_accepted_tokens"] for m in methods], color="C1")
        axes[1].set_title("mean tokens per verification")
        for m in methods[1:]:
            acc = spec[m].get("acceptance_by_position", [])
            axes[2].plot(range(1, len(acc) + 1), acc, "o-", label=m)
        axes[2].set_title("acceptance by draft position")
        axes[2].set_xlabel("draft position")
        axes[2].legend()
        fig.tight_layout()
        fig.savefig(out / "speculative.png", dpi=110)
        plt.close(fig)
        written.append(out / "speculative.png")
        fig, ax = plt.subplots(figsize=(6, 4))
        for m in methods:
            sw = spec[m]["batch_sweep"]
            ax.plot([b["batch_size"] for b in sw], [b["speedup_vs_ar"] for b in sw], "o-", label=m)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("speedup over ar")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "batch_sweep.png", dpi=110)
        plt.close(fig)
        written.append(out / "batch_sweep.png")
    tuning = report.get("gamma_tuning")
    if tuning:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for i, (m, rec) in enumerate(tuning.items()):
            axes[0].plot(rec["candidates"], rec["predicted_speedup"], "o-", color=f"C{i}", label=m)
            axes[0].plot([rec["gamma"]], [rec["predicted_speedup"][rec["candidates"].index(rec["gamma"])]], "*",
                         color=f"C{i}", ms=14)
            axes[1].plot(rec["candidates"], [t / rec["t_ar_step"] for t in rec["t_round"]], "o-", color=f"C{i}", label=m)
        written.append(_save_panels(fig, axes, out / "gamma.png", "draft length gamma",
                                    ("predicted speedup over ar (star: chosen)", "one round, in ar steps (measured)"),
                                    "draft length from acceptance (calibration prompts) and measured round costs"))
    ee = report.get("early_exit")
    if ee:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for m, rows in ee.items():
            axes[0].plot([r["speedup"] for r in rows], [r["rouge_l"] for r in rows], "o-", label=m)
            axes[1].plot([r["speedup"] for r in rows], [r["agreement"] for r in rows], "o-", label=m)
        written.append(_save_panels(fig, axes, out / "early_exit.png", "speedup over ar", ("ROUGE-L", "token agreement"),
                                    "early exit: quality vs speed (threshold sweep)"))
    return written


def _save_panels(fig, axes, path: Path, xlabel: str, ylabels, title: str) -> Path:
    """Label, grid and legend every panel, title the figure, write it to `path` and close it."""
    import matplotlib.pyplot as plt

    for ax, ylabel in zip(axes, ylabels):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
