"""Named evaluation prompt sets shipped with the package (see data/prompts/SOURCES.md for their
sources and licences), and user jsonl files with "prompt" (text) or "tokens" (ids)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from m2r2_jax.data.prompt_files import read_prompt_file
from m2r2_jax.errors import DataError

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
