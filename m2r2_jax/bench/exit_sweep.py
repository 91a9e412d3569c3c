"""Early exit on a converted model: quality against speed at several thresholds, every method side
by side with ar on the same MT-Bench prompts (chat template applied), greedy batch 1.

    python -m m2r2_jax.bench.exit_sweep --checkpoint ckpt/smollm2 \
        --m2r2 m2r2_jax/pretrained/smollm2-135m-instruct --taus 0.5,0.7,0.9,1.0 \
        [--methods m2r2_exit,m2r2_exit_confirm,distance_exit] [--kv_missing propagate|deferred] \
        [--n_prompts 4 --max_new_tokens 128 --repeats 1] [--out runs/exit_sweep.json]

Methods: m2r2_exit (the router decides), m2r2_exit_confirm (a released token leaves only if its exit
head is as confident as tau too), distance_exit (confidence decider). Each row: speed against ar,
ROUGE-L and token agreement with ar's answers, layers per token, the fraction of tokens that exit
(`bench.speculative.early_exit_sweep`). `--kv_missing`: how the skipped layers' K/V are filled
(`decoding.early_exit`): "propagate" copies the exit state into them (later tokens then attend to
approximations), "deferred" computes them exactly a round later. Prints a JSON report (also to --out).
"""

from __future__ import annotations

import argparse
import sys


def _floats(text: str) -> list:
    return [float(t) for t in text.split(",") if t]


def main(argv=None) -> dict:
    from m2r2_jax.bench.exit_cli import add_run_args, check_run_args, load_run
    from m2r2_jax.bench.speculative import EXIT_VARIANTS

    p = argparse.ArgumentParser(prog="python -m m2r2_jax.bench.exit_sweep", description=__doc__.split("\n")[0])
    add_run_args(p, n_prompts=4, max_new_tokens=128, repeats=1)
    p.add_argument("--taus", default="0.5,0.9")
    p.add_argument("--methods", default="m2r2_exit,distance_exit")
    p.add_argument("--kv_missing", default="propagate", choices=("propagate", "deferred"))
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    check_run_args(p, a)
    try:
        taus = _floats(a.taus)
    except ValueError:
        p.error(f"--taus {a.taus}: expected numbers in [0, 1], comma-separated")
    if not taus or any(not 0.0 <= t <= 1.0 for t in taus):
        p.error(f"--taus {a.taus}: expected numbers in [0, 1], comma-separated")
    methods = [m for m in a.methods.split(",") if m]
    unknown = sorted(set(methods) - set(EXIT_VARIANTS))
    if not methods or unknown:
        p.error(f"--methods {a.methods}: expected some of {', '.join(EXIT_VARIANTS)}")

    from m2r2_jax.bench.speculative import early_exit_sweep
    from m2r2_jax.json_files import emit_json_report

    cfg, params, mcfg, m2r2_params, tok, prompts = load_run(a)
    rows = early_exit_sweep(cfg, params, prompts, max_new_tokens=a.max_new_tokens, thresholds=taus,
                            m2r2=(mcfg, m2r2_params), methods=tuple(methods), repeats=a.repeats,
                            eos_ids=list(tok.eos_ids), kv_missing=a.kv_missing)
    report = {"n_prompts": len(prompts), "max_new_tokens": a.max_new_tokens, "repeats": a.repeats,
              "kv_missing": a.kv_missing,
              "m2r2": {"router_features": mcfg.router_features, "router_give_up": mcfg.router_give_up},
              "methods": rows}
    emit_json_report(report, a.out)
    return report


if __name__ == "__main__":
    main()
