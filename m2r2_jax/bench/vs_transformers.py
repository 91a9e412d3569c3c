"""Plain greedy decoding, ours against transformers' `generate`, on the same GGUF file, prompts and threads.

    python -m m2r2_jax.bench.vs_transformers --gguf models/smollm2-135m-instruct.Q4_1.gguf \
        --checkpoint ckpt/smollm2 [--n_prompts 4 --max_new_tokens 96 --repeats 3 --out runs/vs_hf.json]

`--checkpoint` is `m2r2 convert --gguf` of the same file. Batch 1, MT-Bench prompts with the chat
template, each stopping at the model's end-of-turn tokens. After one warm-up call of each side on a
short prompt, every prompt is run:
  first call   the first time this process sees the prompt (ours compiles only when prompt + new
               tokens fall in a new cache-length bucket, `api.prompt_width`; transformers has
               nothing to compile);
  steady       the median of `--repeats` further calls.
Both sides run in this process, one after the other per prompt, with torch on as many threads as
JAX's CPU client uses (the cores this process may run on). Ours runs without the persistent
compilation cache (`--persistent_cache` to measure with it). The greedy tokens must agree: a
mismatch is reported, not hidden. Prints a JSON report (also to --out).

Needs the `dev` extra (torch, transformers, gguf); not on the package's import path.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m m2r2_jax.bench.vs_transformers", description=__doc__.split("\n")[0])
    p.add_argument("--gguf", required=True, help="the GGUF file transformers loads")
    p.add_argument("--checkpoint", required=True, help="our checkpoint of the same file (m2r2 convert --gguf)")
    p.add_argument("--n_prompts", type=int, default=4)
    p.add_argument("--max_new_tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--persistent_cache", action="store_true", help="keep JAX's persistent compilation cache on")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not Path(a.gguf).is_file():
        p.error(f"--gguf {a.gguf}: no such file")
    if not Path(a.checkpoint).is_dir():
        p.error(f"--checkpoint {a.checkpoint}: no such directory")
    if min(a.n_prompts, a.max_new_tokens, a.repeats) < 1:
        p.error("--n_prompts, --max_new_tokens and --repeats must be positive")
    from m2r2_jax.json_files import report_path_error

    err = report_path_error(a.out)
    if err:
        p.error(err)
    return a


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main(argv=None) -> dict:
    a = _args(sys.argv[1:] if argv is None else argv)
    import jax
    import torch
    import transformers

    from m2r2_jax.bench.prompts import chat_prompt_ids
    from m2r2_jax.bench.roofline import ar_roofline
    from m2r2_jax.data.chat_template import encode_prompt
    from m2r2_jax.data.tokenizer import load_tokenizer
    from m2r2_jax.decoding import api
    from m2r2_jax.models.checkpoint import load_model, tokenizer_path

    if not a.persistent_cache:
        jax.config.update("jax_compilation_cache_dir", None)
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(threads)

    cfg, params = load_model(a.checkpoint)
    tok = load_tokenizer(tokenizer_path(a.checkpoint))
    prompts, template = chat_prompt_ids(tok, "mt_bench", a.n_prompts)
    eos = list(tok.eos_ids)
    gguf = Path(a.gguf)
    hf = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                           dtype=torch.float32).eval()

    def ours(ids):
        [r] = api.generate("ar", cfg, params, [ids], max_new_tokens=a.max_new_tokens, eos_ids=eos,
                           batch_size=1, layer_loop="auto")
        return r.tokens

    def theirs(ids):
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=a.max_new_tokens, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos[0])
        return out[0, len(ids):].tolist()

    warm = encode_prompt(tok, "Hi", template)
    _, ours_warm_s = _timed(lambda: ours(warm))
    _, theirs_warm_s = _timed(lambda: theirs(warm))
    rows = []
    for ids in prompts:
        programs = api.run_batch._cache_size()
        mine, ours_first = _timed(lambda: ours(ids))
        compiled = api.run_batch._cache_size() > programs
        ref, theirs_first = _timed(lambda: theirs(ids))
        ours_steady = statistics.median(_timed(lambda: ours(ids))[1] for _ in range(a.repeats))
        theirs_steady = statistics.median(_timed(lambda: theirs(ids))[1] for _ in range(a.repeats))
        n = len(mine)
        rows.append({"prompt_tokens": len(ids), "new_tokens": n, "same_tokens": mine == ref, "compiled": compiled,
                     "ours_first_tokens_per_s": n / ours_first, "transformers_first_tokens_per_s": len(ref) / theirs_first,
                     "ours_steady_tokens_per_s": n / ours_steady,
                     "transformers_steady_tokens_per_s": len(ref) / theirs_steady})

    def ratio(key):
        per = [r[f"ours_{key}_tokens_per_s"] / r[f"transformers_{key}_tokens_per_s"] for r in rows]
        return {"median": statistics.median(per), "min": min(per), "max": max(per)}

    steady = statistics.median(r["ours_steady_tokens_per_s"] for r in rows)
    report = {"threads": threads, "jax": jax.__version__, "torch": torch.__version__,
              "transformers": transformers.__version__, "persistent_cache": a.persistent_cache,
              "max_new_tokens": a.max_new_tokens, "repeats": a.repeats,
              "warm_up_seconds": {"ours": ours_warm_s, "transformers": theirs_warm_s},
              "prompts": rows, "first_call_speedup": ratio("first"), "steady_speedup": ratio("steady"),
              "all_tokens_equal": all(r["same_tokens"] for r in rows),
              "roofline": ar_roofline(cfg, params, steady)}
    from m2r2_jax.json_files import emit_json_report

    emit_json_report(report, a.out)
    return report


if __name__ == "__main__":
    main()
