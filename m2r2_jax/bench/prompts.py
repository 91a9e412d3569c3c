"""Named evaluation prompt sets shipped with the package (see data/prompts/SOURCES.md for their
sources and licences), and user jsonl files with "prompt" (text) or "tokens" (ids)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

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
    """A list of prompts: each a str (text) or a list of ints (token ids)."""
    if name_or_file in PROMPT_SETS:
        text = resources.files("m2r2_jax.data").joinpath("prompts", PROMPT_SETS[name_or_file]).read_text("utf-8")
        source = name_or_file
        generic = False
    else:
        path = Path(name_or_file)
        if not path.is_file():
            raise DataError(f"--prompts {name_or_file}: not a prompt set ({', '.join(PROMPT_SETS)}) nor a file")
        try:
            text = path.read_text("utf-8")
        except UnicodeDecodeError:
            raise DataError(f"{path} is not UTF-8 text") from None
        source, generic = str(path), True
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{source} line {i}: invalid JSON ({e.msg})") from None
        if not isinstance(rec, dict):
            raise DataError(f"{source} line {i}: expected a JSON object")
        if generic:
            if "tokens" in rec:
                toks = rec["tokens"]
                if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
                    raise DataError(f"{source} line {i}: \"tokens\" must be a list of integer ids")
                out.append(toks)
            elif "prompt" in rec:
                if not isinstance(rec["prompt"], str):
                    raise DataError(f"{source} line {i}: \"prompt\" must be a string")
                out.append(rec["prompt"])
            else:
                raise DataError(f"{source} line {i}: expected a \"prompt\" or \"tokens\" field")
        else:
            out.append(_text_of(rec))
    if not out:
        raise DataError(f"{source} holds no prompts")
    return out
