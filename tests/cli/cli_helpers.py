"""Fixtures shared by the CLI reliability tests: a set of tiny checkpoints (good and broken), bad
input files, a runner for real `m2r2` subprocesses and the one-line error contract check.

The models come from the decoding tests' helpers (numpy-initialised weights: no compilation), so
building the whole set costs a couple of seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS / "decoding") not in sys.path:
    sys.path.insert(0, str(TESTS / "decoding"))

M2R2 = str(Path(sys.executable).with_name("m2r2"))
REPO = TESTS.parent

VOCAB = 384  # the size of the sentencepiece tokenizer trained below



def tiny_pretrain(tokenizer) -> str:
    """A pretrain config for the tokenizer trained below: 4 steps, a checkpoint every step."""
    from conftest import tiny_pretrain_config

    return tiny_pretrain_config(vocab_size=VOCAB, tokenizer=str(tokenizer), steps=4, batch_size=4, warmup_steps=1,
                                checkpoint_every=1)


TINY_DISTILL = """
from m2r2_jax.m2r2.distill import distill_config

def get_config():
    cfg = distill_config()
    cfg.base_checkpoint = {base!r}
    cfg.m2r2.update(dict(branch_layer=1, rate=2, lora_rank=2, router_dim=8, router_hidden=8))
    cfg.train.update(dict(steps=2, batch_size=4, warmup_steps=1, checkpoint_every=1, progress=False))
    cfg.router_train.update(dict(steps=1, batch_size=4, warmup_steps=0, checkpoint_every=1, progress=False))
    cfg.data.update(dict(source="embedded", split="heldout", seq_len=32))
    return cfg
"""


def subprocess_env() -> dict:
    from conftest import cpu_xla_flags

    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_xla_flags(1),
               TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore")
    return env


def train_tokenizer(path: Path) -> Path:
    """A 384-piece sentencepiece model trained on a slice of the embedded corpus."""
    from m2r2_jax.data.corpus import embedded_split
    from m2r2_jax.data.tokenizer import train_sentencepiece

    train_sentencepiece(embedded_split("heldout")[:20000], 384, path)
    return path


def build_fixtures(root: Path) -> dict:
    """Good and broken checkpoints, prompt files and configs under `root`; returns name -> path."""
    import numpy as np

    from decoding_helpers import model, random_m2r2
    from m2r2_jax.interop.hf_config import hf_config_dict
    from m2r2_jax.interop.safetensors_io import params_to_hf, write_safetensors
    from m2r2_jax.m2r2.checkpoint import save_m2r2
    from m2r2_jax.m2r2.loading import default_m2r2_config
    from m2r2_jax.models.checkpoint import params_fingerprint, save_model

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    p = {"root": root}
    tok = train_tokenizer(root / "tokenizer.model")
    p["tokenizer"] = tok

    # good checkpoints: a dense base with a tokenizer, its M2R2 checkpoint, a MoE base
    cfg, params = model("llama", vocab_size=VOCAB)
    p["base"] = save_model(root / "base", cfg, params, tokenizer_file=str(tok))
    mcfg = default_m2r2_config(cfg)
    p["m2r2"] = save_m2r2(root / "m2r2", mcfg, random_m2r2(cfg, mcfg, 0), cfg, params_fingerprint(cfg, params))
    ocfg, oparams = model("llama", vocab_size=VOCAB, seed=7)
    p["m2r2_other"] = save_m2r2(root / "m2r2_other", mcfg, random_m2r2(ocfg, mcfg, 1), ocfg,
                                params_fingerprint(ocfg, oparams))
    moe_cfg, moe_params = model("mixtral")
    p["moe"] = save_model(root / "moe", moe_cfg, moe_params)
    p["notok"] = save_model(root / "notok", *model("llama"))  # no tokenizer, vocab 61
    # a model whose embedding has more rows than the tokenizer has pieces (padded vocabularies are
    # common in converted checkpoints): it can sample ids the tokenizer cannot decode
    p["padded"] = save_model(root / "padded", *model("llama", vocab_size=VOCAB + 16), tokenizer_file=str(tok))

    # a Hugging Face directory (config.json + safetensors) of the dense base
    hf = root / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
    write_safetensors(params_to_hf(cfg, params), hf)
    p["hf"] = hf

    # broken checkpoints
    p["file"] = root / "a_file"
    p["file"].write_text("not a directory\n")
    p["empty_dir"] = root / "empty_dir"
    p["empty_dir"].mkdir()
    p["garbage_config"] = _copy_with(root, "garbage_config", p["base"], {"model_config.json": "{garbage"})
    bad_cfg = json.loads((p["base"] / "model_config.json").read_text())
    bad_cfg["n_layers"] = -3
    p["invalid_config"] = _copy_with(root, "invalid_config", p["base"], {"model_config.json": json.dumps(bad_cfg)})
    arr_cfg = json.dumps([1, 2, 3])
    p["array_config"] = _copy_with(root, "array_config", p["base"], {"model_config.json": arr_cfg})
    p["no_params"] = _copy_with(root, "no_params", p["base"], {}, drop=("params",))
    p["corrupt_params"] = _copy_with(root, "corrupt_params", p["base"], {}, corrupt_params=True)
    p["garbage_fingerprint"] = _copy_with(root, "garbage_fingerprint", p["base"], {"fingerprint.json": "{{{"})
    p["m2r2_garbage_base"] = _copy_with(root, "m2r2_garbage_base", p["m2r2"], {"base.json": "not json"})
    p["m2r2_garbage_config"] = _copy_with(root, "m2r2_garbage_config", p["m2r2"], {"m2r2_config.json": "[1,"})
    p["hf_garbage"] = _copy_with(root, "hf_garbage", hf, {"config.json": "\x00\x01garbage"})
    remote = json.loads((hf / "config.json").read_text())
    remote.update(model_type="custom_thing", architectures=["CustomForCausalLM"],
                  auto_map={"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"})
    p["hf_remote"] = _copy_with(root, "hf_remote", hf, {"config.json": json.dumps(remote)})
    p["hf_no_weights"] = _copy_with(root, "hf_no_weights", hf, {}, drop=("model.safetensors",))

    # prompt files
    files = {
        "prompts": "".join(json.dumps({"tokens": t}) + "\n" for t in ([1, 2, 3], [4, 5, 6, 7])),
        "prompts_text": json.dumps({"prompt": "ROMEO."}) + "\n",
        "prompts_not_jsonl": "this is not json\n",
        "prompts_empty": "",
        "prompts_blank": "\n\n   \n",
        "prompts_empty_prompt": json.dumps({"prompt": ""}) + "\n",
        "prompts_empty_tokens": json.dumps({"tokens": []}) + "\n",
        "prompts_oov": json.dumps({"tokens": [1, VOCAB + 5]}) + "\n",
        "prompts_negative": json.dumps({"tokens": [1, -4]}) + "\n",
        "prompts_wrong_field": json.dumps({"question": "hi"}) + "\n",
        "prompts_tokens_string": json.dumps({"tokens": "1 2 3"}) + "\n",
        "prompts_tokens_floats": json.dumps({"tokens": [1.5, 2]}) + "\n",
        "prompts_array": "[1, 2, 3]\n",
        "prompts_too_long": json.dumps({"tokens": [1] * 200}) + "\n",
    }
    for name, text in files.items():
        p[name] = root / f"{name}.jsonl"
        p[name].write_text(text)
    p["prompts_not_utf8"] = root / "prompts_not_utf8.jsonl"
    p["prompts_not_utf8"].write_bytes(b'{"prompt": "\xff\xfe caf\xe9"}\n')
    p["missing"] = root / "does_not_exist"

    # token arrays for `logits`
    np.save(root / "tokens.npy", np.array([[1, 2, 3]], np.int32))
    p["tokens"] = root / "tokens.npy"
    np.save(root / "tokens_oov.npy", np.array([[1, VOCAB]], np.int32))
    p["tokens_oov"] = root / "tokens_oov.npy"
    (root / "tokens_junk.npy").write_bytes(b"\x93NUMPY garbage")
    p["tokens_junk"] = root / "tokens_junk.npy"

    # text data for `align --data`
    p["data_not_utf8"] = root / "data_not_utf8.txt"
    p["data_not_utf8"].write_bytes(b"caf\xe9 \xff\xfe\n" * 50)
    p["data_empty"] = root / "data_empty.txt"
    p["data_empty"].write_text("")
    p["data_jsonl_wrong_field"] = root / "data_wrong_field.jsonl"
    p["data_jsonl_wrong_field"].write_text(json.dumps({"body": "some text"}) + "\n")

    # configs for pretrain / distill
    p["pretrain_cfg"] = root / "pretrain_cfg.py"
    p["pretrain_cfg"].write_text(tiny_pretrain(tok))
    p["distill_cfg"] = root / "distill_cfg.py"
    p["distill_cfg"].write_text(TINY_DISTILL.format(base=str(p["base"])))
    p["syntax_error_cfg"] = root / "syntax_error_cfg.py"
    p["syntax_error_cfg"].write_text("def get_config(:\n")
    p["raising_cfg"] = root / "raising_cfg.py"
    p["raising_cfg"].write_text("def get_config():\n    raise RuntimeError('boom in the config file')\n")
    p["no_get_config_cfg"] = root / "no_get_config_cfg.py"
    p["no_get_config_cfg"].write_text("x = 1\n")
    return p


def _copy_with(root: Path, name: str, src: Path, files: dict, drop=(), corrupt_params: bool = False) -> Path:
    import shutil

    dst = root / name
    shutil.copytree(src, dst)
    for rel in drop:
        target = dst / rel
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    for rel, text in files.items():
        (dst / rel).write_text(text)
    if corrupt_params:  # every file of the orbax tree overwritten with junk
        for f in (dst / "params").rglob("*"):
            if f.is_file():
                f.write_bytes(b"\x00junk\xff" * 3)
    return dst


# ---------------------------------------------------------------------------------------------
# running the CLI
# ---------------------------------------------------------------------------------------------
def run_m2r2(args, timeout: float = 300, cwd=None, env=None) -> subprocess.CompletedProcess:
    """One real `m2r2 ARGS` process (the installed console script); `env` adds to subprocess_env()."""
    return subprocess.run([M2R2, *map(str, args)], capture_output=True, text=True,
                          env={**subprocess_env(), **(env or {})}, timeout=timeout, cwd=cwd)


def run_many(arg_lists, workers: int = 2, timeout: float = 300) -> list:
    """Several `m2r2` processes, `workers` at a time (most bad-input cases are short)."""
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda a: run_m2r2(a, timeout), arg_lists))


def contract_violations(rc: int, stderr: str, needles=(), expected_rc: int = 2) -> list:
    """What is wrong with a bad-input run (empty list: it kept the contract): exit status
    `expected_rc`, exactly one non-empty stderr line starting with 'm2r2: error:' that mentions
    every needle, and no traceback."""
    problems = []
    if rc != expected_rc:
        problems.append(f"exit status {rc}, expected {expected_rc}")
    if "Traceback" in stderr:
        problems.append("a Python traceback on stderr")
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    if len(lines) != 1:
        problems.append(f"{len(lines)} stderr lines, expected exactly one")
    if not lines or not lines[0].startswith("m2r2: error: ") or len(lines[0]) <= len("m2r2: error: "):
        problems.append("no 'm2r2: error: ...' line first")
    elif any(n not in lines[0] for n in needles):
        problems.append(f"the error line does not mention {[n for n in needles if n not in lines[0]]}")
    return problems


def run_in_workers(jobs, workers: int = 2, timeout: float = 900) -> dict:
    """`jobs`: {verb: [argv, ...]} or {verb: ("fuzz", seed, n, fixtures_json)}. Runs each verb's
    cases in one `verb_worker.py` process (two verbs at a time); returns {verb: [result, ...]}."""
    import tempfile

    worker = str(Path(__file__).with_name("verb_worker.py"))

    def one(item):
        verb, spec = item
        if isinstance(spec, tuple):
            cmd = [sys.executable, worker, verb, "fuzz", *map(str, spec[1:])]
            r = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=timeout, cwd=REPO)
        else:
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump(spec, f)
            cmd = [sys.executable, worker, verb, "cases", f.name]
            r = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=timeout, cwd=REPO)
            os.unlink(f.name)
        if r.returncode != 0:
            raise RuntimeError(f"verb worker for {verb} failed (status {r.returncode}):\n{r.stderr[-4000:]}")
        return verb, json.loads(r.stdout)

    with ThreadPoolExecutor(workers) as pool:
        return dict(pool.map(one, jobs.items()))
