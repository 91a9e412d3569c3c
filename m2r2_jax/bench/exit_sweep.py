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
from pathlib import Path


def _floats(text: str) -> list:
    return [float(t) for t in text.split(",") if t]


def main(argv=None) -> dict:
    from m2r2_jax.bench.speculative import EXIT_VARIANTS

    p = argparse.ArgumentParser(prog="python -m m2r2_jax.bench.exit_sweep", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--m2r2", required=True)
    p.add_argument("--taus", default="0.5,0.9")
    p.add_argument("--methods", default="m2r2_exit,distance_exit")
    p.add_argument("--kv_missing", default="propagate", choices=("propagate", "deferred"))
    p.add_argument("--n_prompts", type=int, default=4)
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", default=None)
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    for flag, path in (("--checkpoint", a.checkpoint), ("--m2r2", a.m2r2)):
        if not Path(path).is_dir():
            p.error(f"{flag} {path}: no such directory")
    if min(a.n_prompts, a.max_new_tokens, a.repeats) < 1:
        p.error("--n_prompts, --max_new_tokens and --repeats must be positive")
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
    from m2r2_jax.json_files import emit_json_report, report_path_error

    err = report_path_error(a.out)
    if err:
        p.error(err)

    from m2r2_jax.bench.prompts import chat_prompt_ids
    from m2r2_jax.bench.speculative import early_exit_sweep
    from m2r2_jax.data.tokenizer import load_tokenizer
    from m2r2_jax.m2r2.loading import load_base_and_m2r2
    from m2r2_jax.models.checkpoint import tokenizer_path

    cfg, params, mcfg, m2r2_params, _ = load_base_and_m2r2(a.checkpoint, a.m2r2)
    tok = load_tokenizer(tokenizer_path(a.checkpoint))
    prompts, _ = chat_prompt_ids(tok, "mt_bench", a.n_prompts, limit=cfg.max_seq_len - a.max_new_tokens - 1)
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
