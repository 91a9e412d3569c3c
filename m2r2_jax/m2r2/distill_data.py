"""Distillation data from the base model itself: its own greedy answers to instruction prompts.

    rows, heldout = make_distill_data(cfg, params, tokenizer, prompt_sets, max_new_tokens=...)

The fast stream drafts the text the base writes, so it learns best from that text: each prompt of
the named sets is rendered with the base's chat template (as `generate` and `bench` render it),
answered greedily by plain decoding (stopping at any end-of-sequence id), and written as one JSONL
row whose "text" is the rendered prompt followed by the answer, ready for `data.source=jsonl`.
The last `heldout_fraction` of every set is not answered but kept apart (for measuring acceptance
on prompts the fast stream never saw). Benchmark sets (MT-Bench, Spec-Bench) are refused: the
drafter is never trained on what it is measured on.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from m2r2_jax.errors import ConfigError

BENCHMARK_SETS = ("mt_bench", "spec_bench")
DEFAULT_SETS = ("self_instruct", "koala", "wizardlm")
WIDTH_BUCKET = 64  # prompts padded to a multiple of this: a handful of compiled programs, not one per batch


def split_prompts(texts: Sequence[str], heldout_fraction: float, max_prompts: int = 0) -> tuple[list, list]:
    """(training prompts, held-out prompts): the last `heldout_fraction` of the set is held out,
    then at most `max_prompts` (0: all) of the rest are kept."""
    if not 0.0 <= heldout_fraction < 1.0:
        raise ConfigError(f"heldout_fraction={heldout_fraction!r} is invalid: expected [0, 1)")
    n_held = int(round(len(texts) * heldout_fraction))
    train, held = list(texts[: len(texts) - n_held]), list(texts[len(texts) - n_held:])
    return (train[:max_prompts] if max_prompts else train), held


def answer_prompts(cfg, params, token_prompts: list, *, max_new_tokens: int, eos_ids, batch_size: int,
                   progress: bool = True, desc: str = "answers") -> list:
    """Greedy answers (token lists, stop id included when reached) to token prompts, batched by
    length so padding stays small, in the prompts' order."""
    from tqdm.auto import tqdm

    from m2r2_jax.decoding import api

    engine = api.build_engine("ar", cfg, params, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                              layer_loop="auto")
    order = np.argsort([len(p) for p in token_prompts], kind="stable")
    answers: list = [None] * len(token_prompts)
    bar = tqdm(total=len(token_prompts), desc=desc, disable=not progress, leave=False)
    for lo in range(0, len(order), batch_size):
        idx = order[lo:lo + batch_size]
        chunk = [token_prompts[i] for i in idx]
        width = -(-max(len(p) for p in chunk) // WIDTH_BUCKET) * WIDTH_BUCKET
        for i, r in zip(idx, api.run_engine(engine, chunk, batch_size=batch_size, width=width, fixed_batch=True)):
            answers[i] = r.tokens
        bar.update(len(idx))
    bar.close()
    return answers


def make_distill_data(cfg, params, tokenizer, prompt_sets: Sequence[str] = DEFAULT_SETS, *, max_new_tokens: int = 192,
                      heldout_fraction: float = 0.1, max_prompts: int = 0, batch_size: int = 16,
                      chat_template: Optional[str] = None, max_prompt_tokens: int = 512,
                      progress: bool = True) -> tuple[list, list]:
    """(rows, heldout): JSONL rows {"text", "set", "index", "prompt_tokens", "answer_tokens"} of
    the base's answers, and held-out rows {"prompt", "set", "index"} (user text, unanswered)."""
    from m2r2_jax.bench.prompts import load_prompt_set
    from m2r2_jax.data.chat_template import chat_prompt, encode_prompt

    bad = sorted(set(prompt_sets) & set(BENCHMARK_SETS))
    if bad:
        raise ConfigError(f"prompt set {bad[0]!r} is a benchmark set: the drafter is never trained on the prompts it is "
                          f"measured on (use e.g. {', '.join(DEFAULT_SETS)})")
    if max_new_tokens < 1 or batch_size < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens} and batch_size={batch_size} must be positive")
    rows, heldout = [], []
    limit = min(max_prompt_tokens, cfg.max_seq_len - max_new_tokens - 1)
    for name in prompt_sets:
        texts = [t for t in load_prompt_set(name) if isinstance(t, str)]
        train, held = split_prompts(texts, heldout_fraction, max_prompts)
        heldout += [{"prompt": t, "set": name, "index": len(train) + i} for i, t in enumerate(held)]
        encoded = [encode_prompt(tokenizer, t, chat_template) for t in train]
        keep = [i for i, p in enumerate(encoded) if 0 < len(p) <= limit]  # longer prompts are skipped, not cut
        answers = answer_prompts(cfg, params, [encoded[i] for i in keep], max_new_tokens=max_new_tokens,
                                 eos_ids=tokenizer.eos_ids, batch_size=batch_size, progress=progress, desc=name)
        for i, ans in zip(keep, answers):
            if ans and ans[-1] in tokenizer.eos_ids:  # the data pipeline ends every document with EOS itself
                ans = ans[:-1]
            shown = chat_prompt(chat_template, train[i], special_tokens=tokenizer.special_tokens) \
                if chat_template is not None else train[i]
            rows.append({"text": shown + tokenizer.decode(ans), "set": name, "index": i,
                         "prompt_tokens": len(encoded[i]), "answer_tokens": len(ans)})
    if not rows:
        raise ConfigError("no prompt fits: every prompt is longer than max_prompt_tokens or the model's context")
    return rows, heldout


__all__ = ["make_distill_data", "answer_prompts", "split_prompts", "BENCHMARK_SETS", "DEFAULT_SETS"]
