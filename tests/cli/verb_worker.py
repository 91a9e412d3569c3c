"""Runs many argument lists through one verb in one process (the JAX import and the compilation
of the tiny models are paid once per verb instead of once per case).

    python verb_worker.py VERB cases CASES.json            -> JSON results on stdout
    python verb_worker.py VERB fuzz SEED N FIXTURES.json   -> JSON results on stdout

`cases`: a JSON list of argument lists. `fuzz`: N random argument lists generated from the verb's
real flags (seeded, see `cases`). Each runs through `m2r2_jax.cli.common.run_verb` exactly as
`m2r2 VERB ARGS` would, with file descriptor 2 redirected to a file (so everything the case
writes to stderr is seen: Python, absl logging, C++ libraries) and SystemExit caught. A result
records the argv, the exit status, the stdout and stderr text and, when an exception other than SystemExit
escaped run_verb (a user would see a traceback), its traceback."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import random
import sys
import traceback

# values by flag kind; every string is passed as is, so quoting/unicode reach the parser raw
INTS = ["0", "-1", "-7", "3", "1", "100000", "99999999999999999999999999", "-99999999999999999999", "1e999", "nan",
        "abc", "", "\uff13", "0x10", "2.5"]
FLOATS = ["0", "-1", "0.5", "1", "nan", "inf", "-inf", "1e309", "-1e-320", "abc", "", "\u0663"]
STRINGS = ["", " ", "\u00fcn\u00efc\u00f8d\u00e9\u2713", "x" * 300, "-", "--", "a,b,,c", "../../..", "\x7f", "NaN"]


def _paths(fx):
    return [fx[k] for k in ("missing", "file", "empty_dir", "garbage_config", "corrupt_params", "base", "moe",
                            "m2r2", "m2r2_garbage_base", "prompts", "prompts_not_utf8", "prompts_empty",
                            "prompts_too_long", "prompts_oov", "tokens_junk", "data_not_utf8", "tokenizer")] + [
        fx["file"] + "/below_a_file", fx["missing"] + "/\u00fc\u2713"]


def _verb_flags(module_name):
    from absl import flags

    own = flags.FLAGS.flags_by_module_dict().get(module_name, [])
    shared = flags.FLAGS.flags_by_module_dict().get("m2r2_jax.cli.sharding_flags", [])
    return {f.name: f for f in own + (shared if module_name.endswith("aot_check") else [])}


def _value(rng, flag, fx):
    kind = flag.flag_type()
    if kind == "int":
        return rng.choice(INTS)
    if kind == "float":
        return rng.choice(FLOATS)
    if kind == "bool":
        return rng.choice(["true", "false", "maybe", "", "1", "\u2713"])
    if kind == "enum" or "enum" in kind:
        choices = list(getattr(flag.parser, "enum_values", []) or [])
        return rng.choice(choices + STRINGS) if choices else rng.choice(STRINGS)
    if "config" in type(flag).__name__.lower():
        return rng.choice([fx["syntax_error_cfg"], fx["raising_cfg"], fx["missing"] + ".py", fx["file"],
                           fx["pretrain_cfg"], fx["distill_cfg"]])
    return rng.choice(_paths(fx) + STRINGS)


CONFIG_FIELDS = ["train.steps", "train.batch_size", "train.learning_rate", "train.seed", "train.checkpoint_every",
                 "model.n_layers", "model.vocab_size", "data.seq_len", "m2r2.rate", "m2r2.branch_layer",
                 "m2r2.lora_rank", "loss.temperature", "schedule", "nope.nothing"]


# Flags that switch a verb into a mode that succeeds without its other inputs (`fetch --list`).
NOT_FUZZED = {"list"}


def cases(verb, module_name, seed, n, fx):
    """N argument lists for one verb. Each holds one sure problem (the 'poison': a checkpoint
    that is not one, a missing required flag, an unknown flag, positional junk, an unparsable
    number) plus 1-4 random flags with random values (valid or not) on other flags."""
    rng = random.Random(f"{seed}-{verb}")
    fl = _verb_flags(module_name)
    required = sorted(n_ for n_, f in fl.items() if n_ in ("checkpoint", "hf", "out", "prompts", "config", "workdir",
                                                            "model", "tokens") and f.default is None)
    out = []
    for _ in range(n):
        args, touched = {}, set()
        poisons = ["unknown", "positional"]
        if "checkpoint" in fl or "hf" in fl:
            poisons += ["bad_checkpoint", "bad_checkpoint"]
        if required:
            poisons += ["missing_required"]
        if any(f.flag_type() == "int" for f in fl.values()):
            poisons += ["bad_int"]
        poison = rng.choice(poisons)
        # a plausible base: the required flags set to working inputs
        base = {"checkpoint": fx["moe"] if verb == "moe-bench" else fx["base"], "hf": fx["hf"],
                "prompts": fx["prompts"], "tokens": fx["tokens"], "out": fx["root"] + f"/fuzz_out/{verb}",
                "workdir": fx["root"] + f"/fuzz_out/{verb}_wd",
                "config": fx["distill_cfg"] if verb == "distill" else fx["pretrain_cfg"],
                "model": fx["pretrain_cfg"]}
        for name in required:
            args[name] = base[name]
        extra = []
        if poison == "unknown":
            extra.append(rng.choice(["--zzz", "--\u00fcnknown=1", "--max_new_tokenz=3", "-x"]))
        elif poison == "positional":
            extra.append(rng.choice(["junk", "\u2603", "0", "-"]))
        elif poison == "bad_checkpoint":
            name = "checkpoint" if "checkpoint" in fl else "hf"
            args[name] = rng.choice([fx["missing"], fx["file"], fx["empty_dir"], fx["garbage_config"],
                                     fx["hf_garbage"] if name == "hf" else fx["invalid_config"]])
            touched.add(name)
        elif poison == "missing_required":
            name = rng.choice(required)
            args.pop(name)
            touched.add(name)
        else:  # bad_int
            name = rng.choice(sorted(n_ for n_, f in fl.items() if f.flag_type() == "int"))
            args[name] = rng.choice(["abc", "", "1e999", "nan", "2.5", "\uff13"])
            touched.add(name)
        for _ in range(rng.randint(1, 4)):
            choices = sorted(set(fl) - touched - NOT_FUZZED)
            if not choices:
                break
            name = rng.choice(choices)
            args[name] = _value(rng, fl[name], fx)
            touched.add(name)
        if "config" in fl and rng.random() < 0.5:
            extra.append(f"--config.{rng.choice(CONFIG_FIELDS)}={rng.choice(INTS + FLOATS + STRINGS)}")
        argv = []
        for name, value in args.items():
            if fl.get(name) is not None and fl[name].flag_type() == "bool" and rng.random() < 0.5:
                argv.append(f"--{name}" if value == "true" else f"--no{name}")
            elif rng.random() < 0.5:
                argv.append(f"--{name}={value}")
            else:
                argv += [f"--{name}", str(value)]
        pos = rng.randint(0, len(argv))
        out.append(argv[:pos] + extra + argv[pos:])
    return out


def run_case(run_verb, module, verb, argv):
    import os
    import tempfile

    from absl import app, flags

    flags.FLAGS.unparse_flags()
    # ml_collections registers a `--config.a.b` flag for each override it parses, and a name cannot
    # be registered twice: drop the last case's (a dotted name below a registered flag's)
    for name in [n for n in flags.FLAGS if "." in n and n.split(".")[0] in flags.FLAGS]:
        delattr(flags.FLAGS, name)
    sys.argv = [f"m2r2 {verb}"] + list(argv)  # where ml_collections reads the overrides from
    # absl refuses a second app.run in one process; reset its once-only guards between cases
    app._register_and_parse_flags_with_usage.done = False
    app._run_init.done = False
    tb, code, out = None, None, io.StringIO()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            with contextlib.redirect_stdout(out):
                run_verb(module.main, [f"m2r2 {verb}"] + argv)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # what a user would see as a traceback
            tb = traceback.format_exc()
            code = 1
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        capture.seek(0)
        err = capture.read().decode("utf-8", "replace")
    return {"argv": argv, "code": code, "stderr": err, "traceback": tb, "stdout": out.getvalue()}


def main():
    verb, mode = sys.argv[1], sys.argv[2]
    from m2r2_jax.cli.common import run_verb
    from m2r2_jax.cli.main import VERBS

    module_name = f"m2r2_jax.cli.{VERBS[verb][0]}"
    module = importlib.import_module(module_name)
    if mode == "cases":
        todo = json.loads(open(sys.argv[3]).read())
    else:
        seed, n, fixtures = sys.argv[3], int(sys.argv[4]), sys.argv[5]
        todo = cases(verb, module_name, seed, n, json.loads(open(fixtures).read()))
    real_stdout = sys.stdout
    results = [run_case(run_verb, module, verb, argv) for argv in todo]
    real_stdout.write(json.dumps(results))


if __name__ == "__main__":
    main()
