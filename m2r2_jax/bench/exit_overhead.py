"""What early exit costs where no token exits: ar, m2r2_exit and distance_exit (both deciders) at
tau 1.0, each exit method on both layer loops (a while loop over the stacked layers, and the
unrolled loop with one `lax.cond` per layer), side by side, same prompts, greedy batch 1.

    python -m m2r2_jax.bench.exit_overhead --checkpoint ckpt/smollm2 \
        --m2r2 m2r2_jax/pretrained/smollm2-135m-instruct [--n_prompts 2 --max_new_tokens 64 --repeats 3]

At tau 1.0 a token leaves only where the decider is certain (it may happen through rounding; the
report counts exits), so each method's speed against ar is the price of its machinery: the layer
loop, the deciders' inputs, the fast steps. For a checkpoint whose router reads the exit head's
logits, "m2r2_exit_state_router" is m2r2_exit with its fast stream and a router that reads the
state only (`m2r2.router_features="state"`), freshly initialised: untrained, so its figure is the
cost of that design where nothing exits, not a quality. A router that can give up
(`m2r2.router_give_up`) stops a token's fast steps once it expects no later step to be safe with
probability tau: at tau 1.0 after the first one. Prints a JSON report (also to --out).
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> dict:
    from m2r2_jax.bench.exit_cli import add_run_args, check_run_args, load_run

    p = argparse.ArgumentParser(prog="python -m m2r2_jax.bench.exit_overhead", description=__doc__.split("\n")[0])
    add_run_args(p, n_prompts=2, max_new_tokens=64, repeats=3)
    p.add_argument("--loops", default="scan,unrolled", help="the exit methods' layer loops, comma-separated")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    check_run_args(p, a)
    loops = [x for x in a.loops.split(",") if x]
    if not loops or set(loops) - {"scan", "unrolled"}:
        p.error(f"--loops {a.loops}: expected scan, unrolled or both")

    import dataclasses

    import jax
    import numpy as np

    from m2r2_jax.bench.speculative import per_answer_timing_side_by_side
    from m2r2_jax.decoding import api
    from m2r2_jax.m2r2.fast_stream import init_m2r2_params

    cfg, params, mcfg, m2r2_params, tok, prompts = load_run(a)
    common = dict(max_new_tokens=a.max_new_tokens, eos_ids=list(tok.eos_ids))
    runners = {"ar": (api.build_engine("ar", cfg, params, layer_loop="auto", **common), 0.5)}
    exits = {"m2r2_exit": ("m2r2_exit", dict(m2r2=(mcfg, m2r2_params)))}
    if mcfg.router_features == "logits":
        state_mcfg = dataclasses.replace(mcfg, router_features="state", router_give_up=False)
        state_router = init_m2r2_params(cfg, state_mcfg, jax.random.key(0))["router"]
        exits["m2r2_exit_state_router"] = ("m2r2_exit", dict(m2r2=(state_mcfg, {**m2r2_params, "router": state_router})))
    exits.update({"distance_exit_confidence": ("distance_exit", dict(decider="confidence")),
                  "distance_exit_saturation": ("distance_exit", dict(decider="saturation"))})
    for name, (method, kw) in exits.items():
        for loop in loops:
            runners[f"{name}/{loop}"] = (api.build_engine(method, cfg, params, layer_loop=loop, **kw, **common), 1.0)
    width = max(len(x) for x in prompts)
    timed = per_answer_timing_side_by_side(runners, prompts, width, a.repeats)
    ar_results, ar_tps = timed["ar"][0], float(np.mean(timed["ar"][1]))
    report = {"max_new_tokens": a.max_new_tokens, "repeats": a.repeats, "n_prompts": len(prompts),
              "m2r2": {"router_features": mcfg.router_features, "router_give_up": mcfg.router_give_up},
              "methods": {}}
    for name, (results, tps, _) in timed.items():
        report["methods"][name] = {
            "tokens_per_s": float(np.mean(tps)), "speedup_vs_ar": float(np.mean(tps)) / ar_tps,
            "early_exits": [r.early_exits for r in results],
            "same_tokens_as_ar": all(r.tokens == q.tokens for r, q in zip(results, ar_results)),
            "layers_per_token": float(np.mean([r.layers_per_token for r in results]))}
    from m2r2_jax.json_files import emit_json_report

    emit_json_report(report, a.out)
    return report


if __name__ == "__main__":
    main()
