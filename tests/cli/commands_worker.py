"""Runs a list of `m2r2 VERB ARGS` commands, of any verbs, one after another in one process, as
`m2r2` would run each (`m2r2_jax.cli.main.verb_argv`, then `run_verb` under absl), so JAX starts
and shared programs compile once for the whole list instead of once per command.

    python commands_worker.py PLAN.json   -> one JSON list of results on the last stdout line
    python commands_worker.py --parse CASES.json   -> the same for [[verb, args, partial], ...]: each
                                                  parsed by the verb's flags, not run (None or the error)

PLAN: {"cwd": DIR, "commands": [{"id": ID, "after": [ID, ...], "argv": [verb, arg, ...]}, ...],
"fetch_sources": [ModelSource fields, ...]}. A command starts once the commands named in `after`
are done, here or in another worker on the same plan directory (each done command leaves the file
DIR/.done/ID; DIR/.done/abort ends every wait): two workers share the cores and wait for each
other's outputs only where needed. `fetch_sources` are added to (or replace names in) the fetch
registry of this process: how a test points `m2r2 fetch NAME` at a local wheel. A result holds the
argv, the exit status, what the command wrote to stdout and stderr, its traceback when an exception
escaped (a user would have seen one), its wall time and its CPU time.

Each verb module defines its flags in absl's one global FlagValues, and several verbs define the
same names (`--out`, `--checkpoint`, the sharding flags), so two verb modules cannot be registered
at once. Before each command the worker removes the previous verb's flags (the `--config.*`
override flags ml_collections adds while parsing included) and registers this verb's own flags
again (the Flag objects, with their validators, kept from the verb's first import)."""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verb_worker import run_case  # noqa: E402


class VerbFlags:
    """Swaps one verb's flags into absl's global FlagValues at a time. A verb's flags are those its
    module (and m2r2_jax.cli.sharding_flags, which it calls) registered; flags that libraries
    register while a verb runs (grain's, absl's help flags) stay, and so do absl's own."""

    def __init__(self):
        from absl import app, flags

        self.flags = flags.FLAGS
        app.define_help_flags()  # --help, --helpfull: absl adds them on its first app.run
        self.saved: dict = {}  # verb -> (module, [(module name, Flag)])

    def _drop_verb_flags(self) -> None:
        fv = self.flags
        owned = {id(f) for _, pairs in self.saved.values() for _, f in pairs}
        # a verb's own flags, and the `--config.*` override flags ml_collections added while
        # parsing the verb's last command
        drop = [n for n in fv if id(fv[n]) in owned or ("." in n and n.split(".")[0] in fv)]
        for name in drop:
            delattr(fv, name)

    def use(self, verb: str):
        from m2r2_jax.cli.main import VERBS

        fv = self.flags
        self._drop_verb_flags()
        if verb not in self.saved:
            module = importlib.import_module(f"m2r2_jax.cli.{VERBS[verb][0]}")
            pairs = [(m, f) for m, fl in fv.flags_by_module_dict().items() if m.startswith("m2r2_jax.cli.") for f in fl]
            self.saved[verb] = (module, pairs)
            return module
        module, pairs = self.saved[verb]
        for mod, flag in pairs:
            fv[flag.name] = flag
            fv.register_flag_by_module(mod, flag)  # so `--helpfull` lists it under its module again
        return module


def add_fetch_sources(sources) -> None:
    from m2r2_jax.interop import fetch

    for s in sources:
        parts = tuple(fetch.WheelPart(**p) for p in s["parts"])
        src = fetch.ModelSource(**{**s, "parts": parts})
        fetch.REGISTRY[src.name] = src


def parse_case(swap: VerbFlags, verb: str, args, partial: bool):
    """None when the verb's flags take `args` (`--config`-like files loaded, overrides applied),
    else the error. `partial`: the command elides flags, so a missing required flag is no error."""
    from absl import flags
    from ml_collections.config_flags.config_flags import is_config_flag

    from m2r2_jax.cli.main import verb_argv

    swap.use(verb)
    flags.FLAGS.unparse_flags()
    sys.argv = verb_argv(verb, args)  # ml_collections reads --config.* overrides from sys.argv
    try:
        left = flags.FLAGS(sys.argv)
        for name in list(flags.FLAGS):
            if is_config_flag(flags.FLAGS[name]) and flags.FLAGS[name].present:
                getattr(flags.FLAGS, name)  # loads the file and applies the overrides
        return None if len(left) == 1 else f"unexpected arguments {left[1:]}"
    except Exception as e:
        msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return None if partial and "must have a value other than None" in msg else msg


def main():
    if sys.argv[1] == "--parse":
        swap = VerbFlags()
        cases = json.loads(Path(sys.argv[2]).read_text())
        print(json.dumps([parse_case(swap, verb, args, partial) for verb, args, partial in cases]))
        return
    plan = json.loads(Path(sys.argv[1]).read_text())
    os.chdir(plan["cwd"])
    add_fetch_sources(plan.get("fetch_sources", []))
    from m2r2_jax.cli.common import run_verb
    from m2r2_jax.cli.main import verb_argv

    swap = VerbFlags()
    results = []
    done = Path(plan["cwd"]) / ".done"
    done.mkdir(exist_ok=True)
    for cmd in plan["commands"]:
        # `abort`: the other worker died; its commands' outputs will not come
        while not all((done / str(i)).exists() for i in cmd["after"]) and not (done / "abort").exists():
            time.sleep(0.05)
        verb, *args = cmd["argv"]
        module = swap.use(verb)
        argv = verb_argv(verb, args)
        t, cpu = time.perf_counter(), time.process_time()
        res = run_case(run_verb, module, verb, argv[1:])
        res["seconds"] = round(time.perf_counter() - t, 2)
        res["cpu_seconds"] = round(time.process_time() - cpu, 2)  # all of the process's threads
        results.append(res)
        (done / str(cmd["id"])).touch()  # failed or not: a command waiting on it runs and says why
    print(json.dumps(results))


if __name__ == "__main__":
    main()
