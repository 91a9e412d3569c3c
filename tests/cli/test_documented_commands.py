"""Every `m2r2 ...` command in the README's and USAGE.md's code blocks parses: its verb exists, each
flag is one the verb defines (either spelling), values have the flag's type, and `--config` files
load with their `--config.*` overrides applied. The commands are parsed by the verbs' own absl
flags, not run: running them needs models and data the suite does not have (the verbs' behaviour
is tested with tiny models elsewhere). Optional parts in brackets are kept, the first of `a|b`
alternatives is taken and placeholders like `N` get a number, so the documented flags are all
checked."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from m2r2_jax.cli.main import VERBS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/USAGE.md")
NUMBER_PLACEHOLDERS = {"N": "2", "T": "0.5", "P": "0.9"}

PARSE = r"""
import importlib, json, sys
from absl import flags
from m2r2_jax.cli.main import VERBS, verb_argv
verb = sys.argv[1]
importlib.import_module(f"m2r2_jax.cli.{VERBS[verb][0]}")
out = []
for args, partial in json.loads(sys.argv[2]):
    flags.FLAGS.unparse_flags()
    sys.argv = verb_argv(verb, args)  # ml_collections reads --config.* overrides from sys.argv
    try:
        left = flags.FLAGS(sys.argv)
        if "config" in flags.FLAGS:
            flags.FLAGS.config  # loads the file and applies the overrides
        out.append(None if len(left) == 1 else f"unexpected arguments {left[1:]}")
    except Exception as e:
        msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        # "m2r2 VERB ... --flag": the elided part holds the required flags
        out.append(None if partial and "must have a value other than None" in msg else msg)
print(json.dumps(out))
"""


def code_lines(text: str):
    """Lines of indented (4 spaces) and fenced code blocks, continuation backslashes joined."""
    fenced, pending = False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not (fenced or line.startswith("    ") or pending):
            continue
        line = pending + " " + line.strip() if pending else line.strip()
        if line.endswith("\\"):
            pending = line[:-1].strip()
            continue
        pending = ""
        yield line


def documented_commands():
    """[(doc, command line, verb, (args, partial))] for every `m2r2 VERB ...` line of the docs' code blocks."""
    found = []
    for doc in DOCS:
        for line in code_lines((ROOT / doc).read_text()):
            line = re.split(r"\s{2,}#", line)[0].strip()  # a trailing comment
            if not line.startswith("m2r2 "):
                continue
            words = shlex.split(line)[1:]
            verb, args, partial = words[0], [], "..." in words
            for w in words[1:]:
                w = w.strip("[]")
                if w in ("...", ""):
                    continue
                w = w.split("|")[0]  # the first of the alternatives a|b|c
                args.append(NUMBER_PLACEHOLDERS.get(w, w))
            found.append((doc, line, verb, (args, partial)))
    return found


def parse_all(verb: str, arg_lists) -> list:
    r = subprocess.run([sys.executable, "-c", PARSE, verb, json.dumps(arg_lists)], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.splitlines()[-1])


def test_the_docs_hold_commands_for_most_verbs():
    verbs = {verb for _, _, verb, _ in documented_commands()}
    assert verbs <= set(VERBS), verbs - set(VERBS)
    assert len(verbs) >= 12 and {"convert", "distill", "generate", "bench", "fetch"} <= verbs, verbs


def test_every_documented_command_parses():
    # one process per verb; one per command with a --config (its override flags, once registered,
    # cannot be registered again in that process)
    groups: dict = {}
    for i, (doc, line, verb, parsed) in enumerate(documented_commands()):
        key = (verb, i) if any(a.startswith("--config") for a in parsed[0]) else (verb, -1)
        groups.setdefault(key, []).append((doc, line, parsed))
    # deliberately wrong commands: the check itself must notice an unknown flag and a bad value
    probes = [("probe", "bench --no-such-flag", (["--checkpoint", "x", "--no-such-flag", "1"], False)),
              ("probe", "bench --n_prompts many", (["--checkpoint", "x", "--n_prompts", "many"], False))]
    groups[("bench", -1)] = groups.get(("bench", -1), []) + probes
    with ThreadPoolExecutor(2) as pool:
        errors = dict(zip(groups, pool.map(lambda k: parse_all(k[0], [p for _, _, p in groups[k]]), groups)))
    bench = errors[("bench", -1)]
    assert "no_such_flag" in str(bench[-2]) and "many" in str(bench[-1]), bench[-2:]
    bad = [f"{doc}: {line}\n    -> {err}" for key, cmds in groups.items()
           for (doc, line, _), err in zip(cmds, errors[key]) if err and doc != "probe"]
    assert not bad, "\n".join(bad)
