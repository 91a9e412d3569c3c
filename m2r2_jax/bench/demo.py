"""The main job: the whole M2R2 story on the embedded default (what `make demo` runs).

1. train a sentencepiece tokenizer and pre-train the tiny dense base, the tiny MoE base and the
   small two-model draft model on the embedded corpus;
2. distill the M2R2 parameters (adapters + rates, then the router) for the dense and MoE bases;
3. measure side by side and write OUT/report.json, OUT/*.png and print one table:
   alignment, speculative decoding (batch 1 and a batch sweep), early exit, MoE AoT loading.

Trained artifacts live in OUT/artifacts/<name>-<hash of their config>/ and are reused by a rerun
(unless `force`); a stage interrupted half-way resumes from its training checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Optional

import jax

from m2r2_jax.atomic import write_text_atomic
from m2r2_jax.bench.artifacts import CONFIG_DIR, artifact, say
from m2r2_jax.bench.compile_cache import child_env, persistent_cache
from m2r2_jax.bench.cpu_cores import cores_in_use, device_summary
from m2r2_jax.bench import report as R
from m2r2_jax.bench import speculative as S
from m2r2_jax.data.corpus import embedded_split
from m2r2_jax.data.tokenizer import load_tokenizer
from m2r2_jax.decoding import api
from m2r2_jax.errors import ConfigError, M2R2Error
from m2r2_jax.m2r2 import analysis
from m2r2_jax.m2r2.checkpoint import load_m2r2
from m2r2_jax.m2r2.distill import distill, heldout_batches
from m2r2_jax.models.checkpoint import load_model, params_fingerprint
from m2r2_jax.training.config import load_config_file
from m2r2_jax.training.pretrain import pretrain



@dataclasses.dataclass(frozen=True)
class Budget:
    """Step counts and measurement sizes of one demo budget."""

    dense_steps: int
    moe_steps: int
    draft_steps: int
    distill_steps: int
    router_steps: int
    moe_distill_steps: int
    batch_size: int
    seq_len: int
    n_prompts: int
    prompt_len: int
    max_new_tokens: int
    batch_sizes: tuple
    repeats: int
    thresholds: tuple
    align_batches: int
    moe_prompts: int
    gamma_candidates: tuple  # draft lengths the tuning step measures (bench/gamma.py)
    calibration_prompts: int  # held-out prompts it measures acceptance on (not the benchmark's)
    context_prompts: int  # held-out windows whose first speculative round is measured (real text)
    # every engine's layer loop (`api.resolve_layer_loop`). The tiny budget keeps the scan: the
    # unrolled programs' compiles add ~100 s to its ~3 minutes, and its speeds are a smoke test.
    layer_loop: str = "auto"


BUDGETS = {
    # ~15 minutes on 2 CPU cores
    "full": Budget(dense_steps=150, moe_steps=120, draft_steps=80, distill_steps=240, router_steps=30,
                   moe_distill_steps=90, batch_size=8, seq_len=128, n_prompts=5, prompt_len=32,
                   max_new_tokens=96, batch_sizes=(1, 4, 16), repeats=3, thresholds=(0.5, 0.7, 0.9),
                   align_batches=4, moe_prompts=3, gamma_candidates=(2, 4, 6), calibration_prompts=8,
                   context_prompts=32),
    # ~3 minutes: the same pipeline, smaller everything
    "tiny": Budget(dense_steps=30, moe_steps=15, draft_steps=15, distill_steps=20, router_steps=10,
                   moe_distill_steps=10, batch_size=8, seq_len=64, n_prompts=3, prompt_len=16,
                   max_new_tokens=16, batch_sizes=(1, 4), repeats=1, thresholds=(0.5, 0.9),
                   align_batches=1, moe_prompts=2, gamma_candidates=(2, 4), calibration_prompts=2,
                   context_prompts=8, layer_loop="scan"),
}


XLA_CACHE = "xla_cache"  # under OUT/artifacts: the persistent compilation cache of the demo's programs
SAMPLED_TEMPERATURE = 0.8  # the demo's sampled comparisons (text that does not loop)


def _pretrain_cfg(name: str, steps: int, budget: Budget, tokenizer: str = ""):
    cfg = load_config_file(CONFIG_DIR / "models" / f"{name}.py")
    cfg.train.update(dict(steps=steps, warmup_steps=max(1, min(cfg.train.warmup_steps, steps // 10)),
                          checkpoint_every=max(10, steps // 2), batch_size=budget.batch_size))
    cfg.data.update(dict(seq_len=budget.seq_len, tokenizer=tokenizer))
    return cfg


def _distill_cfg(name: str, base_dir: Path, steps: int, router_steps: int, budget: Budget):
    cfg = load_config_file(CONFIG_DIR / "m2r2" / f"{name}.py")
    cfg.base_checkpoint = str(base_dir)
    cfg.train.update(dict(steps=steps, warmup_steps=max(1, steps // 10), checkpoint_every=max(10, steps // 2),
                          batch_size=budget.batch_size))
    cfg.router_train.update(dict(steps=router_steps, warmup_steps=max(1, router_steps // 10),
                                 checkpoint_every=max(10, router_steps // 2), batch_size=budget.batch_size))
    cfg.data.update(dict(seq_len=budget.seq_len))
    return cfg


def heldout_prompts(tok, n: int, length: int, phase: float = 0.0) -> list:
    """n prompts of `length` tokens from evenly spaced places of the held-out split, each starting
    `phase` (0 <= phase < 1) of the spacing after its place: phase 0.5 gives prompts from between
    those of phase 0 (the gamma tuning's calibration prompts, apart from the benchmark's)."""
    ids = tok.encode(embedded_split("heldout"))
    stride = len(ids) // max(n, 1)
    if stride < 2 * length:
        raise ConfigError(f"held-out split too small for {n} prompts of {length} tokens")
    start = int(phase * stride)
    return [ids[i * stride + start:i * stride + start + length] for i in range(n)]


STEP_OVERRIDES = ("dense_steps", "distill_steps")


def budget_with(budget_name: str, steps: Optional[dict] = None) -> Budget:
    """The named budget with step counts replaced by `steps` {field: n} (fields STEP_OVERRIDES)."""
    if budget_name not in BUDGETS:
        raise ConfigError(f"--budget={budget_name!r} is invalid: expected one of {', '.join(BUDGETS)}")
    steps = dict(steps or {})
    for k, v in steps.items():
        if k not in STEP_OVERRIDES:
            raise ConfigError(f"{k} cannot be overridden: expected one of {', '.join(STEP_OVERRIDES)}")
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"--{k}={v!r} is invalid: expected a positive integer")
    return dataclasses.replace(BUDGETS[budget_name], **steps)


def run_demo(out, budget_name: str = "full", force: bool = False, skip_moe: bool = False,
             steps: Optional[dict] = None) -> dict:
    """The main job (see the module docstring). `steps` overrides the budget's step counts
    (`budget_with`); the artifacts are keyed by their configs, so other counts train new ones.
    Compiled programs are kept in OUT/artifacts/xla_cache (`compile_cache`): the one-core child
    and a rerun load the programs this run compiled instead of compiling them again."""
    budget = budget_with(budget_name, steps)
    out = Path(out).absolute()
    with persistent_cache(out / "artifacts" / XLA_CACHE) as compile_stats:
        return _run_demo(out, budget_name, budget, force, skip_moe, compile_stats)


def _run_demo(out: Path, budget_name: str, budget: Budget, force: bool, skip_moe: bool, compile_stats: dict) -> dict:
    arts = out / "artifacts"
    arts.mkdir(parents=True, exist_ok=True)
    timings = {}
    t_start = time.time()

    # 1. base models ---------------------------------------------------------------------
    t0 = time.time()
    dense_cfg = _pretrain_cfg("tiny_dense", budget.dense_steps, budget)
    dense_dir = artifact(arts, "dense", dense_cfg.to_dict(), lambda wd: pretrain(dense_cfg, wd), force)
    tok_file = str(dense_dir / "model" / "tokenizer" / "tokenizer.model")
    draft_cfg = _pretrain_cfg("tiny_draft", budget.draft_steps, budget, tok_file)
    draft_dir = artifact(arts, "draft", draft_cfg.to_dict(), lambda wd: pretrain(draft_cfg, wd), force)
    if not skip_moe:
        moe_cfg = _pretrain_cfg("tiny_moe", budget.moe_steps, budget, tok_file)
        moe_dir = artifact(arts, "moe", moe_cfg.to_dict(), lambda wd: pretrain(moe_cfg, wd), force)
    timings["pretrain_s"] = time.time() - t0

    # 2. M2R2 distillation ----------------------------------------------------------------
    t0 = time.time()
    dcfg = _distill_cfg("tiny_dense", dense_dir / "model", budget.distill_steps, budget.router_steps, budget)
    m2r2_dir = artifact(arts, "m2r2_dense", {**dcfg.to_dict(), "base": _read_fp(dense_dir)},
                         lambda wd: distill(dcfg, wd), force)
    if not skip_moe:
        mdcfg = _distill_cfg("tiny_moe", moe_dir / "model", budget.moe_distill_steps, budget.router_steps, budget)
        m2r2_moe_dir = artifact(arts, "m2r2_moe", {**mdcfg.to_dict(), "base": _read_fp(moe_dir)},
                                 lambda wd: distill(mdcfg, wd), force)
    timings["distill_s"] = time.time() - t0

    # 3. measurements ---------------------------------------------------------------------
    base_cfg, base_params = load_model(dense_dir / "model")
    fp = params_fingerprint(base_cfg, base_params)
    mcfg, m2r2_params = load_m2r2(m2r2_dir / "m2r2", base_cfg, fp)
    draft = load_model(draft_dir / "model")
    tok = load_tokenizer(tok_file)
    report = {"budget": budget_name, "device": device_summary(), "budget_settings": dataclasses.asdict(budget),
              "models": _models(base_cfg, base_params, mcfg, draft, dense_dir, m2r2_dir, draft_dir)}

    report["sample"] = _sample(base_cfg, base_params, tok)

    t0 = time.time()
    say("alignment (slow vs fast stream against compute)")
    batches = heldout_batches(tok, budget.seq_len, budget.batch_size, budget.align_batches, embedded_split("heldout"))
    align = analysis.alignment(base_cfg, mcfg, base_params, m2r2_params, batches)
    align["fast_beats_slow_at_equal_compute"] = analysis.fast_beats_slow(align)
    report["alignment"] = align
    timings["alignment_s"] = time.time() - t0

    t0 = time.time()
    prompts = heldout_prompts(tok, budget.n_prompts, budget.prompt_len)
    gammas, report["gamma_tuning"] = _tune_gammas(base_cfg, base_params, (mcfg, m2r2_params), draft, tok, budget)
    timings["gamma_tuning_s"] = time.time() - t0
    t0 = time.time()
    spec = S.compare_methods(base_cfg, base_params, prompts, max_new_tokens=budget.max_new_tokens,
                             gamma=gammas, m2r2=(mcfg, m2r2_params), draft=draft, batch_sizes=budget.batch_sizes,
                             repeats=budget.repeats, progress=say, layer_loop=budget.layer_loop)
    report["speculative"] = spec
    pre = report["models"]["base"]["pretrain"]
    report["base"] = {"name": "tiny_dense (pre-trained here)", "params": report["models"]["base"]["params"],
                      "fingerprint": fp, "heldout_perplexity": math.exp(pre["heldout_loss"]) if "heldout_loss" in pre
                      else None, "heldout_text": "embedded corpus, held-out split",
                      "distinct_token_fraction": spec["ar"]["distinct_token_fraction"]}
    # every method on the loop "auto" gives it (the one the benchmarks above used): on CPU ar runs
    # unrolled, its fastest loop there, so no speedup is measured against a slower plain decoder
    report["layer_loop"] = {m: api.resolve_layer_loop(budget.layer_loop, m)
                            for m in api.METHODS}
    if budget_name == "full" and jax.default_backend() == "cpu" and cores_in_use() > 1:
        say("speculative: again pinned to one CPU core (m2r2 bench --cpu_cores 1, a fresh process)")
        report["speculative_one_core"] = _one_core_bench(out, dense_dir / "model", m2r2_dir / "m2r2", prompts,
                                                         budget, gammas)
    report["speculative_sampled"] = S.sampled_comparison(
        base_cfg, base_params, prompts, max_new_tokens=budget.max_new_tokens, temperature=SAMPLED_TEMPERATURE,
        gamma=gammas, m2r2=(mcfg, m2r2_params), repeats=budget.repeats, progress=say,
        layer_loop=budget.layer_loop)
    # the answers loop (a young base), which flatters every drafter: acceptance on real text too
    say(f"speculative: the first round after {budget.context_prompts} held-out text windows")
    contexts = heldout_prompts(tok, budget.context_prompts, budget.prompt_len, phase=0.25)
    report["speculative_heldout_contexts"] = S.context_acceptance(base_cfg, base_params, contexts, gamma=gammas,
                                                                  m2r2=(mcfg, m2r2_params), draft=draft)
    timings["speculative_s"] = time.time() - t0

    t0 = time.time()
    report["early_exit"] = S.early_exit_sweep(base_cfg, base_params, prompts, max_new_tokens=budget.max_new_tokens,
                                              thresholds=budget.thresholds, m2r2=(mcfg, m2r2_params),
                                              repeats=budget.repeats, progress=say,
                                              layer_loop=budget.layer_loop)
    timings["early_exit_s"] = time.time() - t0

    if not skip_moe:
        t0 = time.time()
        say("MoE ahead-of-time expert loading")
        from m2r2_jax.moe_offload.report import moe_report, write_plots

        moe_cfg_, moe_params = load_model(moe_dir / "model")
        mm_cfg, mm_params = load_m2r2(m2r2_moe_dir / "m2r2", moe_cfg_, params_fingerprint(moe_cfg_, moe_params))
        # The routing trace follows held-out text (teacher-forced): a briefly trained base's greedy
        # output loops on a few tokens, whose routing never changes, and that would make expert
        # caching look trivially easy. The real engine still decodes greedily (tokens checked).
        texts = heldout_prompts(tok, budget.moe_prompts, budget.prompt_len + budget.max_new_tokens)
        moe = moe_report(moe_cfg_, moe_params, mm_cfg, mm_params, [t[: budget.prompt_len] for t in texts],
                         max_new_tokens=budget.max_new_tokens,
                         continuations=[t[budget.prompt_len:] for t in texts], bar="moe")
        report["moe"] = moe
        write_plots(moe, out)
        timings["moe_s"] = time.time() - t0

    timings["total_s"] = time.time() - t_start
    report["timings"] = timings
    # this process's programs loaded from OUT/artifacts/xla_cache (the one-core child's are its own)
    report["compile_cache"] = dict(compile_stats)
    report["targets"] = R.targets(report)
    write_text_atomic(out / "report.json", json.dumps(report, indent=2))
    R.write_plots(report, out)
    print(R.table(report))
    return report


def _tune_gammas(base_cfg, base_params, m2r2, draft, tok, budget: Budget) -> tuple:
    """Each speculative method's draft length, chosen from its acceptance on held-out calibration
    prompts (apart from the benchmark's) and its measured round costs (bench/gamma.py).
    Returns ({method: gamma}, {method: tuning record})."""
    from m2r2_jax.bench import gamma as G
    from m2r2_jax.bench.gamma_tuning import tune_gammas

    calib = heldout_prompts(tok, budget.calibration_prompts, budget.prompt_len, phase=0.5)
    say(f"draft lengths: acceptance at gamma {max(budget.gamma_candidates)} on {len(calib)} calibration prompts, "
         f"round costs at gamma {', '.join(map(str, budget.gamma_candidates))}, every method side by side")
    records = tune_gammas(S.SPEC_METHODS, base_cfg, base_params, calib, max_new_tokens=budget.max_new_tokens,
                            candidates=budget.gamma_candidates, m2r2=m2r2, draft=draft, bar="draft lengths",
                            layer_loop=budget.layer_loop)
    for m, rec in records.items():
        say("  " + G.format_choice(m, rec))
    return {m: rec["gamma"] for m, rec in records.items()}, records


def _one_core_bench(out: Path, base_dir: Path, m2r2_dir: Path, prompts, budget: Budget, gammas: dict) -> dict:
    """ar, m2r2_spec and distance_spec at batch 1 in a child process pinned to one core (see
    bench/cpu_cores.py: on a small CPU plain decoding can be fastest there), side by side as usual,
    greedy, at the draft lengths tuned on all cores. (Its sampled twin, 40 s of the demo's
    15 minutes, repeated the all-core sampled comparison; `m2r2 bench --temperature` runs it.)"""
    import subprocess

    work = out / "one_core"
    work.mkdir(parents=True, exist_ok=True)
    prompt_file = work / "prompts.jsonl"
    write_text_atomic(prompt_file, "".join(json.dumps({"tokens": list(p)}) + "\n" for p in prompts))
    cmd = [sys.executable, "-m", "m2r2_jax.cli.main", "bench", "--cpu_cores=1", f"--checkpoint={base_dir}",
           f"--m2r2={m2r2_dir}", f"--prompts={prompt_file}", f"--out={work}", "--batch_sizes=1",
           f"--max_new_tokens={budget.max_new_tokens}", f"--n_prompts={len(prompts)}", f"--repeats={budget.repeats}",
           "--gamma=" + ",".join(f"{m}={g}" for m, g in gammas.items() if m != "two_model")]
    env = dict(os.environ)
    if jax.config.jax_compilation_cache_dir:  # the child loads the engines this process compiled
        env.update(child_env(jax.config.jax_compilation_cache_dir))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
        raise M2R2Error(f"the one-core benchmark failed: {' '.join(tail)}")
    return {"cpu_cores": 1, "command": " ".join(cmd[1:]),
            **one_core_summary(json.loads((work / "report.json").read_text()))}


def one_core_summary(bench_report: dict) -> dict:
    """The parts of an `m2r2 bench` report the demo keeps: per method the greedy speed, speedup,
    acceptance, identity check, ideal speedup and efficiency ("methods") and, when it ran, the sampled comparison ("sampled")."""
    spec = bench_report["speculative"]
    out = {"methods": {m: {**{k: spec[m][k] for k in ("tokens_per_s", "speedup_vs_ar", "speedup_vs_ar_per_answer",
                                                        "mean_accepted_tokens", "identical_to_ar")},
                           **{k: spec[m][k] for k in ("ideal_speedup", "efficiency", "ideal_speedup_decode_only",
                                                        "efficiency_decode_only") if k in spec[m]},
                           "gamma": spec[m].get("gamma")}
                       for m in spec},
           "layer_loop": bench_report.get("layer_loop")}
    sam = bench_report.get("speculative_sampled")
    if sam:
        out["sampled"] = {"temperature": sam["temperature"], "top_p": sam["top_p"],
                          "methods": {m: {k: r[k] for k in ("tokens_per_s", "speedup_vs_ar", "mean_accepted_tokens")}
                                      for m, r in sam.items() if isinstance(r, dict)}}
    return out


def _sample(cfg, params, tok, prompt: str = "ROMEO.\n", n: int = 80) -> dict:
    """A temperature-0.8 sample of the dense base, so a reader sees what the model learned."""
    from m2r2_jax.training.sampling import sample_tokens

    ids = sample_tokens(cfg, params, tok.encode(prompt), n, temperature=0.8, seed=0)
    return {"prompt": prompt, "temperature": 0.8, "text": tok.decode(ids)}


def _read_fp(model_workdir: Path) -> str:
    return json.loads((model_workdir / "model" / "fingerprint.json").read_text())["fingerprint"]


def _models(base_cfg, base_params, mcfg, draft, dense_dir, m2r2_dir, draft_dir) -> dict:
    from m2r2_jax.m2r2.fast_stream import draft_cost_layers, visited_layers
    from m2r2_jax.models.transformer import count_params

    def summary(path):
        p = path / "pretrain_summary.json"
        return json.loads(p.read_text()) if p.is_file() else {}

    dsum = m2r2_dir / "distill_summary.json"
    return {
        "base": {"config": base_cfg.to_dict(), "params": count_params(base_params), "pretrain": summary(dense_dir)},
        "m2r2": {"config": mcfg.to_dict(), "visited_layers": [j + 1 for j in visited_layers(base_cfg, mcfg)],
                 "draft_cost_layers": draft_cost_layers(base_cfg, mcfg),
                 "distill": json.loads(dsum.read_text()) if dsum.is_file() else {}},
        "draft": {"config": draft[0].to_dict(), "params": count_params(draft[1]), "pretrain": summary(draft_dir)},
    }
