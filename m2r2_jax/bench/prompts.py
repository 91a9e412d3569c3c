"""Named evaluation prompt sets shipped with the package (see data/prompts/SOURCES.md for their
sources and licences), and user jsonl files with "prompt" (text) or "tokens" (ids)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from m2r2_jax.data.prompt_files import read_prompt_file
from m2r2_jax.errors import DataError

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
PROMPT_SETS = {
    "mt_bench": "mt_bench.jsonl",
    "spec_bench": "spec_bench.jsonl",
    "koala": "koala.jsonl",
    "self_instruct": "self_instruct_user_oriented.jsonl",
    "wizardlm": "wizardlm_testset.jsonl",
}


def _text_of(record: dict) -> str:
    """The first-turn prompt text of one record of any shipped set."""
    if "turns" in record:  # MT-Bench, Spec-Bench: first turn
        return record["turns"][0]
    if "prompt" in record:  # Koala
        return record["prompt"]
    if "Instruction" in record:  # WizardLM
        return record["Instruction"]
    if "instruction" in record:  # Self-Instruct: instruction + first instance input
        inst = record.get("instances") or [{}]
        extra = inst[0].get("input", "")
        return record["instruction"] + ("\n\n" + extra if extra else "")
    raise DataError(f"record has none of the prompt fields (turns, prompt, Instruction, instruction): {sorted(record)}")


def load_prompt_set(name_or_file: str) -> list:
    """A list of prompts: each a str (text) or a list of ints (token ids). A shipped set by name,
    else a user JSONL file (`data.prompt_files`: "prompt" text or "tokens" ids per line)."""
    if name_or_file not in PROMPT_SETS:
        if not Path(name_or_file).is_file():
            raise DataError(f"--prompts {name_or_file}: not a prompt set ({', '.join(PROMPT_SETS)}) nor a file")
        return read_prompt_file(name_or_file, encode=False)[0]
    text = resources.files("m2r2_jax.data").joinpath("prompts", PROMPT_SETS[name_or_file]).read_text("utf-8")
    out = [_text_of(json.loads(line)) for line in text.splitlines() if line.strip()]
    if not out:
        raise DataError(f"{name_or_file} holds no prompts")
    return out


def chat_prompt_ids(tok, name_or_file: str, n: int, limit=None) -> tuple:
    """(token ids of the set's first n text prompts, each rendered as a user turn with the model's
    chat template (raw text when it has none) and cut to its last `limit` tokens; the template)."""
    from m2r2_jax.data.chat_template import encode_prompt, resolve_chat_template

    template = resolve_chat_template(tok, "auto")
    texts = [t for t in load_prompt_set(name_or_file) if isinstance(t, str)][:n]
    ids = [encode_prompt(tok, t, template) for t in texts]
    return ([x[-limit:] for x in ids] if limit else ids), template


def prompt_categories(name_or_file: str):
    """The category of every prompt of a shipped set that has them (Spec-Bench: mt_bench's eight
    and translation, summarization, qa, math_reasoning, rag), in `load_prompt_set`'s order; None
    for sets and files without categories."""
    if name_or_file not in PROMPT_SETS:
        return None
    text = resources.files("m2r2_jax.data").joinpath("prompts", PROMPT_SETS[name_or_file]).read_text("utf-8")
    cats = [json.loads(line).get("category") for line in text.splitlines() if line.strip()]
    if not all(isinstance(c, str) for c in cats):
        return None
    if name_or_file == "spec_bench":  # Spec-Bench reports its 80 MT-Bench questions as one task
        cats = ["mt_bench" if c in MT_BENCH_CATEGORIES else c for c in cats]
    return cats


def interleave_categories(categories) -> list:
    """Indices that take the categories in turn (first of each, then second of each, ...), so
    the first n prompts of a set grouped by category cover every category."""
    groups: dict = {}
    for i, c in enumerate(categories):
        groups.setdefault(c, []).append(i)
    order = []
    for k in range(max(len(g) for g in groups.values())):
        order += [g[k] for g in groups.values() if k < len(g)]
    return order
