"""`m2r2 moe-bench --checkpoint MOE_CKPT [--m2r2 M2R2_CKPT] --prompts FILE.jsonl --out DIR`

MoE ahead-of-time expert loading benchmark: greedy-decodes the prompts with the MoE base model,
records the true routing and every predictor's guesses (next_gate, m2r2, oracle), runs the real
offload engine (experts in pinned host memory, a device slot cache per layer) for every rung of the
ladder, and replays the trace through the cost model of named real models on named platforms. The
simulated ladder adds two Belady (MIN eviction) rungs, on_demand_belady and oracle_belady: ceilings
that need the future routing, so the engine skips them; "ceiling" in the output bounds every policy.
Writes DIR/moe_report.json and PNG plots. Without --m2r2 the M2R2 parameters are fresh (untrained)
and the report says so. `--forced_prompt_len N` records the trace teacher-forced on each prompt
row's tokens after the first N, `--forced_per_row` after each row's own "prompt_len" (the real
engine still decodes greedily). The m2r2 predictor's
source per layer is chosen on `--calibration FILE` (default: the prompts' own tokens, which are
prefill and never traced); `--nocalibrate_m2r2` keeps the built-in sources. The fast pass then runs
only the steps those sources need; `--m2r2_recall_tolerance T` lets the choice drop more steps while
calibration recall stays within T of the best.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from absl import flags

from m2r2_jax.atomic import write_text_atomic

flags.DEFINE_string("checkpoint", None, "MoE base model directory")
flags.DEFINE_string("m2r2", None, "M2R2 checkpoint trained on this base (omit: fresh untrained M2R2 params)")
flags.DEFINE_string("prompts", None, "JSON lines: {\"tokens\": [ids]} or {\"prompt\": text}")
flags.DEFINE_string("out", None, "output directory for moe_report.json and the plots")
flags.DEFINE_integer("max_new_tokens", 16, "greedy tokens decoded per prompt", lower_bound=1)
flags.DEFINE_integer("max_prompts", 8, "use at most this many prompts", lower_bound=1)
flags.DEFINE_integer("capacity", 0, "device expert slots per layer (0: 2 x experts per token)", lower_bound=0)
flags.DEFINE_list("shapes", ["mixtral-8x7b", "olmoe-1b-7b"], "named real model shapes for the cost model")
flags.DEFINE_list("platforms", ["phone_flash", "pcie_gen4", "pcie_gen5", "nvlink_c2c"], "named platforms")
flags.DEFINE_bool("engine", True, "also run the real offload engine (slow: per-layer Python control)")
flags.DEFINE_integer("branch_layer", 1, "fresh M2R2 params only: branch layer b")
flags.DEFINE_integer("rate", 2, "fresh M2R2 params only: rate r")
flags.DEFINE_enum("moe_fast_mlp", "none", ["experts", "lowrank", "none"], "fresh M2R2 params only: fast MLP at MoE layers")
flags.DEFINE_integer("seed", 0, "seed of fresh M2R2 params")
flags.DEFINE_integer("forced_prompt_len", 0,
                     "0: trace the model's own greedy decoding. N > 0: teacher forcing: each prompt's first N tokens "
                     "are the prompt and its next max_new_tokens tokens are fed instead of the greedy ones, so the "
                     "trace follows real text (a briefly trained model's greedy output repeats itself)", lower_bound=0)
flags.DEFINE_bool("forced_per_row", False,
                  "teacher forcing with each row's own split: a row's \"prompt_len\" field says how many of its tokens "
                  "are the prompt, and its next max_new_tokens are fed instead of the greedy ones (rows of chat "
                  "prompts of different lengths followed by a model's answers)")
flags.DEFINE_bool("calibrate_m2r2", True, "choose the m2r2 predictor's source per layer on calibration text")
flags.DEFINE_string("calibration", None, "prompt file whose texts choose the m2r2 predictor's sources "
                    "(default: the prompts' own tokens); keep it apart from the traced text")
flags.DEFINE_float("m2r2_recall_tolerance", 0.0, "the m2r2 predictor runs the fewest fast steps whose sources recall "
                   "within this of the best on the calibration text (0: drop only steps that add no recall)",
                   lower_bound=0.0, upper_bound=0.99)
flags.mark_flags_as_required(["checkpoint", "prompts", "out"])
FLAGS = flags.FLAGS


def forced_splits(prompts) -> list:
    """Per prompt row, how many of its tokens are the prompt under teacher forcing (0: none):
    --forced_prompt_len for every row, or each row's own "prompt_len" with --forced_per_row."""
    from m2r2_jax.data.prompt_files import row_split_points
    from m2r2_jax.errors import ConfigError

    if FLAGS.forced_per_row and FLAGS.forced_prompt_len:
        raise ConfigError("--forced_per_row and --forced_prompt_len are two ways to split the rows: give one")
    if FLAGS.forced_per_row:
        return row_split_points(FLAGS.prompts, max_prompts=FLAGS.max_prompts)[:len(prompts)]
    return [FLAGS.forced_prompt_len] * len(prompts)


def check_inputs(cfg, prompts, splits) -> None:
    """The flag and prompt checks the benchmark would otherwise make minutes into its run."""
    from m2r2_jax.errors import ConfigError, DataError
    from m2r2_jax.moe_offload import platforms as P

    k, n_experts = cfg.n_experts_per_tok, cfg.n_experts
    if FLAGS.capacity and not k <= FLAGS.capacity <= n_experts:
        raise ConfigError(f"--capacity={FLAGS.capacity} is invalid: expected 0 (2 x top_k) or top_k={k} .. "
                          f"n_experts={n_experts}")
    for name in FLAGS.shapes:
        P.get_shape(name)
    for name in FLAGS.platforms:
        P.get_platform(name)
    if not FLAGS.shapes or not FLAGS.platforms:
        raise ConfigError("--shapes and --platforms need at least one name each")
    split = "prompt_len={}" if FLAGS.forced_per_row else "--forced_prompt_len={}"
    for i, (p, n) in enumerate(zip(prompts, splits), 1):
        if min(p) < 0 or max(p) >= cfg.vocab_size:
            raise DataError(f"{FLAGS.prompts}: prompt {i} has a token id outside the vocabulary [0, {cfg.vocab_size})")
        if n and len(p) < n + FLAGS.max_new_tokens:
            raise DataError(f"{FLAGS.prompts}: prompt {i} has {len(p)} tokens; {split.format(n)} with "
                            f"--max_new_tokens={FLAGS.max_new_tokens} needs {n + FLAGS.max_new_tokens}")
        if n:
            p = p[:n]
        if len(p) + FLAGS.max_new_tokens > cfg.max_seq_len:
            raise DataError(f"{FLAGS.prompts}: prompt {i} has {len(p)} tokens; with --max_new_tokens="
                            f"{FLAGS.max_new_tokens} that exceeds the model's max_seq_len={cfg.max_seq_len}")


def main(argv):
    import jax

    from m2r2_jax.data.tokenizer import load_tokenizer
    from m2r2_jax.errors import ConfigError, DataError
    from m2r2_jax.m2r2.checkpoint import load_m2r2
    from m2r2_jax.m2r2.config import M2R2Config
    from m2r2_jax.m2r2.fast_stream import init_m2r2_params
    from m2r2_jax.models.checkpoint import load_config, load_model, params_fingerprint, tokenizer_path
    from m2r2_jax.data.prompt_files import read_prompt_file
    from m2r2_jax.moe_offload.report import moe_report, write_plots

    cfg = load_config(FLAGS.checkpoint)
    if not cfg.is_moe:
        raise ConfigError(f"{FLAGS.checkpoint} is a dense {cfg.family} model; moe-bench needs a MoE base (n_experts > 0)")
    tok_file = tokenizer_path(FLAGS.checkpoint)
    prompts = read_prompt_file(FLAGS.prompts, load_tokenizer(tok_file) if tok_file else None,
                               max_prompts=FLAGS.max_prompts)[0]
    calibration = None
    if FLAGS.calibration:
        calibration = read_prompt_file(FLAGS.calibration, load_tokenizer(tok_file) if tok_file else None)[0]
        if any(min(p) < 0 or max(p) >= cfg.vocab_size for p in calibration):
            raise DataError(f"{FLAGS.calibration}: a token id is outside the vocabulary [0, {cfg.vocab_size})")
        calibration = [p[: cfg.max_seq_len] for p in calibration]
    splits = forced_splits(prompts)
    check_inputs(cfg, prompts, splits)  # every input problem surfaces before the model is loaded or a line is printed
    cfg, params = load_model(FLAGS.checkpoint, cfg)
    fresh = FLAGS.m2r2 is None
    if fresh:
        mcfg = M2R2Config(branch_layer=FLAGS.branch_layer, rate=FLAGS.rate, moe_fast_mlp=FLAGS.moe_fast_mlp).validate(cfg)
        m2r2_params = init_m2r2_params(cfg, mcfg, jax.random.key(FLAGS.seed))
        print("m2r2 moe-bench: no --m2r2 given: using FRESH (untrained) M2R2 parameters; the fast stream is only "
              "a rate-vector extrapolation, so its expert predictions may be weak", file=sys.stderr)
    else:
        mcfg, m2r2_params = load_m2r2(FLAGS.m2r2, cfg, params_fingerprint(cfg, params))
    continuations = None
    if any(splits):
        prompts, continuations = ([p[:n] for p, n in zip(prompts, splits)],
                                  [p[n:n + FLAGS.max_new_tokens] for p, n in zip(prompts, splits)])
    report = moe_report(cfg, params, mcfg, m2r2_params, prompts, max_new_tokens=FLAGS.max_new_tokens,
                        capacity=FLAGS.capacity or None, shapes=FLAGS.shapes, platforms=FLAGS.platforms,
                        run_real_engine=FLAGS.engine, fresh_m2r2=fresh, continuations=continuations,
                        calibration=calibration, calibrate_m2r2=FLAGS.calibrate_m2r2,
                        m2r2_recall_tolerance=FLAGS.m2r2_recall_tolerance, bar="moe-bench")
    report["inputs"] = {"checkpoint": str(FLAGS.checkpoint), "m2r2": FLAGS.m2r2, "prompts": str(FLAGS.prompts),
                        "forced_prompt_len": FLAGS.forced_prompt_len, "forced_per_row": FLAGS.forced_per_row,
                        "calibration": FLAGS.calibration}
    load = report["trace"]["expert_load"]
    if load["skewed"]:
        print(f"m2r2 moe-bench: the base routes most tokens to a few experts (busiest expert "
              f"{load['busiest_expert_load']:.2f} x an even share; {load['collapsed']:g} = collapsed): caches hit "
              "more often than on a balance-trained MoE, so every offload figure is optimistic", file=sys.stderr)
    out = Path(FLAGS.out)
    out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(report, out)
    write_text_atomic(out / "moe_report.json", json.dumps(report, indent=2, sort_keys=True, default=float))
    print(json.dumps({"report": str(out / "moe_report.json"), "plots": plots, "fresh_m2r2_params": fresh,
                      "teacher_forced": report["trace"]["teacher_forced"],
                      "distinct_token_fraction": report["trace"]["distinct_token_fraction"],
                      "busiest_expert_load": load["busiest_expert_load"],
                      "recall": report["recall"], "hit_rate": report["hit_rate"],
                      "simulated_speedup": report["simulated_speedup"], "ceiling": report["ceiling"],
                      "targets": report["targets"]}, indent=2))
