"""What the early-exit measurement scripts (`bench.exit_overhead`, `bench.exit_sweep`) share: their
model and run arguments, checked before anything is loaded, and the model with its MT-Bench prompts."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_run_args(p: argparse.ArgumentParser, n_prompts: int, max_new_tokens: int, repeats: int) -> None:
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--m2r2", required=True)
    p.add_argument("--n_prompts", type=int, default=n_prompts)
    p.add_argument("--max_new_tokens", type=int, default=max_new_tokens)
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--out", default=None)


def check_run_args(p: argparse.ArgumentParser, a) -> None:
    """One `p.error` line (exit 2) for a missing directory, a non-positive size or an unwritable --out."""
    from m2r2_jax.json_files import report_path_error

    for flag, path in (("--checkpoint", a.checkpoint), ("--m2r2", a.m2r2)):
        if not Path(path).is_dir():
            p.error(f"{flag} {path}: no such directory")
    if min(a.n_prompts, a.max_new_tokens, a.repeats) < 1:
        p.error("--n_prompts, --max_new_tokens and --repeats must be positive")
    err = report_path_error(a.out)
    if err:
        p.error(err)


def load_run(a) -> tuple:
    """(cfg, params, M2R2 config, M2R2 params, tokenizer, prompts): the first --n_prompts MT-Bench
    prompts rendered with the checkpoint's chat template."""
    from m2r2_jax.bench.prompts import chat_prompt_ids
    from m2r2_jax.data.tokenizer import load_tokenizer
    from m2r2_jax.m2r2.loading import load_base_and_m2r2
    from m2r2_jax.models.checkpoint import tokenizer_path

    cfg, params, mcfg, m2r2_params, _ = load_base_and_m2r2(a.checkpoint, a.m2r2)
    tok = load_tokenizer(tokenizer_path(a.checkpoint))
    prompts, _ = chat_prompt_ids(tok, "mt_bench", a.n_prompts, limit=cfg.max_seq_len - a.max_new_tokens - 1)
    return cfg, params, mcfg, m2r2_params, tok, prompts
