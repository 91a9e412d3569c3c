"""Writes the Colab notebooks of this folder (committed without outputs).

    .venv/bin/python colab/make_notebooks.py            # rewrite colab/*.ipynb
    .venv/bin/python colab/make_notebooks.py --check    # exit 1 if a notebook differs from this script

This script is the source of the notebooks: edit the cells here, rerun it, commit both. Every
notebook starts with a code cell tagged `parameters` holding its sizes (steps, tokens, prompts,
workdir); tests/colab/test_notebooks.py runs each notebook top to bottom on CPU with a reduced
setting injected right after that cell. The cells only call the package (its Python API or the
`m2r2` command); no model or decoding logic lives here.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
NOTEBOOKS = ("quickstart", "moe_offload", "bring_your_own_model")


def md(text: str):
    return new_markdown_cell(text.strip("\n"))


def code(text: str, tags=()):
    cell = new_code_cell(text.strip("\n"))
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def params(text: str):
    return code(text, tags=("parameters",))


# ------------------------------------------------------------------------------------------------
# Cells shared by the notebooks
# ------------------------------------------------------------------------------------------------
SETUP = '''
# Colab set-up: mount Google Drive when a path in the parameters lives there, then install this
# project unless it is already importable (a local checkout after `make install`, or a rerun).
import importlib.util
import os
import shutil
import subprocess
import sys

IN_COLAB = "google.colab" in sys.modules
_paths = [str(v) for k, v in dict(globals()).items() if k.isupper() and isinstance(v, (str, os.PathLike))]
if IN_COLAB and any(p.startswith("/content/drive") for p in _paths):
    from google.colab import drive

    drive.mount("/content/drive")

if importlib.util.find_spec("m2r2_jax") is None:
    if not M2R2_SOURCE:
        raise RuntimeError("m2r2_jax is not installed: set M2R2_SOURCE in the parameters cell to this "
                           "project's git URL or to a folder holding a checkout (e.g. on Drive)")
    src = M2R2_SOURCE
    if "://" in src or src.startswith("git@"):
        dest = "/content/m2r2_jax" if IN_COLAB else os.path.abspath("m2r2_jax_src")
        if not os.path.isdir(dest):
            subprocess.run(["git", "clone", "--depth", "1", src, dest], check=True)
        src = dest
    # the accelerator's JAX build: CUDA on a GPU runtime, libtpu on a TPU runtime
    on_tpu = bool(os.environ.get("COLAB_TPU_ADDR")) or os.path.exists("/dev/accel0") or (
        os.path.isdir("/dev/vfio") and any(d != "vfio" for d in os.listdir("/dev/vfio")))
    extra = "[cuda]" if shutil.which("nvidia-smi") else ("[tpu]" if on_tpu else "")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", os.path.abspath(src) + extra], check=True)
    # an editable install hooks itself in through a .pth file that only new processes read: read it now
    import site

    for d in site.getsitepackages():
        site.addsitedir(d)
    importlib.invalidate_caches()

import jax

print("m2r2_jax:", importlib.util.find_spec("m2r2_jax").origin)
print("JAX", jax.__version__, "backend:", jax.default_backend(), "devices:", jax.devices())
'''

SETUP_MD = '''
## Set-up

On Colab this installs the project from `M2R2_SOURCE`; elsewhere it only checks
that `m2r2_jax` is importable. If pip replaced a package the runtime had already imported (numpy, for
instance), restart the session (Runtime > Restart session) and run the notebook again: the install
is skipped the second time.
'''

SOURCE_PARAM = '''
# Where to install the project from when it is not installed yet (Colab): its git URL, or a
# folder holding a checkout (e.g. "/content/drive/MyDrive/m2r2_jax"). Ignored when importable.
M2R2_SOURCE = ""
'''


def pretrain_code(config: str, indent: str = "") -> str:
    """The notebook lines that pre-train configs/models/<config>.py on the embedded corpus and point
    BASE_DIR at the result (`indent`: to sit inside a block)."""
    return textwrap.indent(f'''
cfg = load_config_file(CONFIG_DIR / "models" / "{config}.py")
cfg.model.update(MODEL_OVERRIDES)
cfg.train.update(dict(steps=PRETRAIN_STEPS, batch_size=BATCH_SIZE, warmup_steps=max(1, PRETRAIN_STEPS // 10),
                      checkpoint_every=max(10, PRETRAIN_STEPS // 2)))
cfg.data.update({{"seq_len": SEQ_LEN, **DATA_OVERRIDES}})
summary = pretrain(cfg, OUT / "pretrain")
print({{k: summary.get(k) for k in ("step", "first_loss", "last_loss", "heldout_loss", "heldout_accuracy")}})
BASE_DIR = OUT / "pretrain" / "model"
''', indent)


def distill_code(config: str) -> str:
    """The notebook lines that distill M2R2 for the base in BASE_DIR with configs/m2r2/<config>.py."""
    return f'''
dcfg = load_config_file(CONFIG_DIR / "m2r2" / "{config}.py")
dcfg.base_checkpoint = str(BASE_DIR)
dcfg.m2r2.update(M2R2_OVERRIDES)
dcfg.train.update(dict(steps=DISTILL_STEPS, batch_size=BATCH_SIZE, warmup_steps=max(1, DISTILL_STEPS // 10),
                       checkpoint_every=max(10, DISTILL_STEPS // 2)))
dcfg.router_train.update(dict(steps=ROUTER_STEPS, batch_size=BATCH_SIZE, warmup_steps=max(1, ROUTER_STEPS // 10),
                              checkpoint_every=max(10, ROUTER_STEPS // 2)))
dcfg.data.update({{"seq_len": SEQ_LEN, **DATA_OVERRIDES}})
dsum = distill(dcfg, OUT / "distill")
'''


def _params(body: str) -> str:
    return body.strip("\n") + "\n" + SOURCE_PARAM.strip("\n")


# ------------------------------------------------------------------------------------------------
# 1. quickstart
# ------------------------------------------------------------------------------------------------
def quickstart():
    cells = [
        md('''
# M2R2 quickstart: a fast residual stream, self-speculative decoding and early exit

M2R2 (Mixture of Multi-Rate Residuals) freezes a pretrained decoder (the *slow* residual stream)
and adds a *fast* stream that branches after `b` layers and moves `r` layers' worth per step, with
small LoRA adapters and learned per-channel rates. This notebook:

1. pre-trains the embedded tiny base model on the bundled Shakespeare corpus (or converts a
   Hugging Face checkpoint from your Drive, see `HF_CHECKPOINT`);
2. distills the M2R2 parameters for a few minutes (adapters and rates, then the router);
3. plots how early the fast stream agrees with the model's final output, against compute;
4. runs lossless self-speculative decoding side by side with plain decoding (tokens/s, accepted
   tokens per verification, an identical-output check);
5. sweeps the early-exit threshold and plots quality against speed.

Everything runs on a CPU runtime. The default sizes are those of the dense model in `make demo`
(whose whole run, MoE and draft model included, takes about 15 minutes on 2 CPU cores); a GPU or
TPU runtime is faster. Every cell calls the `m2r2_jax` package; the same pipeline is `make demo` /
`m2r2 demo` on a machine of your own.
'''),
        params(_params('''
# Parameters (the test suite replaces these with a reduced setting)
WORKDIR = "runs/colab_quickstart"  # checkpoints, report.json and plots
PRETRAIN_STEPS = 150               # tiny base pre-training steps (ignored with HF_CHECKPOINT)
DISTILL_STEPS = 80                 # M2R2 stage 1: adapters + rates
ROUTER_STEPS = 30                  # M2R2 stage 2: the router
BATCH_SIZE = 8                     # sequences per training step and per alignment batch
SEQ_LEN = 128                      # tokens per training sequence
ALIGN_BATCHES = 4                  # held-out batches of the alignment analysis
N_PROMPTS = 5                      # held-out prompts for decoding
PROMPT_LEN = 32                    # tokens per prompt
MAX_NEW_TOKENS = 96                # tokens generated per answer
GAMMA = 4                          # draft tokens per speculative round
BATCH_SWEEP = (1, 4)               # batch sizes of the throughput sweep
REPEATS = 3                        # timing repeats (median kept)
THRESHOLDS = (0.5, 0.7, 0.9)       # early-exit thresholds
METHODS = ("ar", "m2r2_spec", "distance_spec")  # decoding methods compared side by side
EXIT_METHODS = ("m2r2_exit", "distance_exit")   # early-exit deciders swept
MODEL_OVERRIDES = {}               # tiny base fields, e.g. {"n_layers": 8}
M2R2_OVERRIDES = {}                # M2R2 fields, e.g. {"rate": 4, "lora_rank": 16}
DATA_OVERRIDES = {}                # training text, e.g. {"split": "all"} (fields of the config's data section)
HF_CHECKPOINT = ""                 # a Hugging Face model folder (config.json + *.safetensors) to use instead
HF_DTYPE = ""                      # dtype of the converted checkpoint ("" = the one in config.json)
''')),
        md(SETUP_MD),
        code(SETUP),
        code('''
import json
from pathlib import Path

from IPython.display import Image, display

from m2r2_jax.bench import report as R
from m2r2_jax.bench import speculative as S
from m2r2_jax.bench.demo import CONFIG_DIR, heldout_prompts
from m2r2_jax.data.corpus import embedded_split
from m2r2_jax.data.tokenizer import load_tokenizer
from m2r2_jax.m2r2 import analysis
from m2r2_jax.m2r2.checkpoint import load_m2r2
from m2r2_jax.m2r2.distill import distill, heldout_batches
from m2r2_jax.m2r2.fast_stream import draft_cost_layers, visited_layers
from m2r2_jax.models.checkpoint import load_model, params_fingerprint, tokenizer_path
from m2r2_jax.training.config import load_config_file
from m2r2_jax.training.pretrain import pretrain
from m2r2_jax.training.sampling import sample_tokens

OUT = Path(WORKDIR).absolute()
OUT.mkdir(parents=True, exist_ok=True)
print("configs:", CONFIG_DIR)
'''),
        md('''
## 1. The base model

Either the embedded tiny model (`configs/models/tiny_dense.py`: a 16-layer Llama-family decoder
with a 2048-token sentencepiece vocabulary trained here on the corpus) pre-trained from scratch, or
your own checkpoint converted from the Hugging Face format (`m2r2 convert`). A rerun resumes from
the checkpoints in `WORKDIR`.
'''),
        code('''
if HF_CHECKPOINT:
    from m2r2_jax.interop.convert import convert_hf

    BASE_DIR = OUT / "base"
    if not (BASE_DIR / "model_config.json").is_file():
        convert_hf(HF_CHECKPOINT, BASE_DIR, dtype=HF_DTYPE or None)
else:''' + pretrain_code("tiny_dense", "    ") + '''
base_cfg, base_params = load_model(BASE_DIR)
tok = load_tokenizer(tokenizer_path(BASE_DIR))
print(f"{base_cfg.family}: {base_cfg.n_layers} layers, d_model {base_cfg.d_model}, vocabulary {base_cfg.vocab_size}")
prompt = "ROMEO.\\n"
print(prompt + tok.decode(sample_tokens(base_cfg, base_params, tok.encode(prompt), 48, temperature=0.8, seed=0)))
'''),
        md('''
## 2. Distill M2R2

Self-distillation from the frozen base (`configs/m2r2/tiny_dense.py`: branch after `b=2` layers,
rate 7): stage 1 trains the adapters, rate vectors and exit norms so every fast step agrees with
the final output; stage 2 trains the router that decides when a fast step is good enough. The base
weights are an input of every step, never an optimiser input: the summary checks they are
unchanged. The CLI equivalent is `m2r2 distill --config=configs/m2r2/tiny_dense.py
--config.base_checkpoint=DIR --workdir WD`.
'''),
        code(distill_code("tiny_dense") + '''assert dsum["base_fingerprint"] == dsum["base_fingerprint_after"]

mcfg, m2r2_params = load_m2r2(OUT / "distill" / "m2r2", base_cfg, params_fingerprint(base_cfg, base_params))
print(f"b={mcfg.branch_layer}, rate {mcfg.rate}: {mcfg.steps(base_cfg)} fast steps visiting layers "
      f"{[j + 1 for j in visited_layers(base_cfg, mcfg)]}; a draft costs {draft_cost_layers(base_cfg, mcfg):.1f} "
      f"of {base_cfg.n_layers} layers")
print("stream stage:", {k: dsum["stream"].get(k) for k in ("step", "last_loss", "agreement_per_step")})
print("router stage:", {k: dsum["router"].get(k) for k in ("step", "last_loss", "router_acc")})
'''),
        md('''
## 3. Early residual alignment

Top-1 agreement of each point with the model's final output on held-out text, against the compute
spent to reach it: slow layer `l` costs `l` layers; fast step `i` costs the shared `b` layers plus
`i` fast steps with their adapters. The paper's central claim is that the fast curve lies above the
slow one at equal compute.
'''),
        code('''
batches = heldout_batches(tok, SEQ_LEN, BATCH_SIZE, ALIGN_BATCHES, embedded_split("heldout"))
align = analysis.alignment(base_cfg, mcfg, base_params, m2r2_params, batches)
align["fast_beats_slow_at_equal_compute"] = analysis.fast_beats_slow(align)
analysis.plot_alignment(align, OUT / "alignment.png")
display(Image(filename=str(OUT / "alignment.png")))
for c, a, beats in zip(align["fast_cost"], align["fast_agreement"], align["fast_beats_slow_at_equal_compute"]):
    print(f"fast at {c:4.1f} layers: agreement {a:.3f} vs slow {analysis.slow_agreement_at(align, c):.3f}"
          f" -> {'above' if beats else 'not above'}")
'''),
        md('''
## 4. Self-speculative decoding, side by side with plain decoding

Greedy, batch 1, on held-out prompts: `ar` is plain autoregressive decoding; `m2r2_spec` drafts
`GAMMA` tokens with the fast stream and verifies them with one pass of the full model;
`distance_spec` drafts with the first `E` slow layers at the same draft cost. Speculative decoding
is lossless: the answers must equal `ar`'s token for token (checked, not assumed). Speedups are
ratios measured in this run; on a CPU a verification pass over several tokens costs more than one
step, so an accelerator gains more from the same acceptance.
'''),
        code('''
prompts = heldout_prompts(tok, N_PROMPTS, PROMPT_LEN)
spec = S.compare_methods(base_cfg, base_params, prompts, max_new_tokens=MAX_NEW_TOKENS, gamma=GAMMA,
                         m2r2=(mcfg, m2r2_params), methods=METHODS,
                         batch_sizes=BATCH_SWEEP, repeats=REPEATS, progress=print)
print(R.table({"speculative": spec}))
identical = all(spec[m]["identical_to_ar"] for m in spec if m != "ar")
print("speculative answers identical to plain decoding:", identical)

print("\\nprompt:", repr(tok.decode(prompts[0])))
for m in ("ar", "m2r2_spec"):
    print(f"{m:>10}:", repr(tok.decode(spec[m]["answers"][0])))
'''),
        md('''
## 5. Early exit: quality against speed

`m2r2_exit` emits a token from a fast step once the router is confident enough (threshold `tau`);
`distance_exit` exits the slow stream on the exit head's confidence. Both are lossy by design:
quality is ROUGE-L and token agreement against the full model's greedy answers.
'''),
        code('''
early = S.early_exit_sweep(base_cfg, base_params, prompts, max_new_tokens=MAX_NEW_TOKENS, thresholds=THRESHOLDS,
                           m2r2=(mcfg, m2r2_params), methods=EXIT_METHODS, repeats=REPEATS, progress=print)
for m, rows in early.items():
    for r in rows:
        print(f"{m:<14} tau={r['threshold']:<4} speedup {r['speedup']:.2f}  ROUGE-L {r['rouge_l']:.3f}  "
              f"layers/token {r['layers_per_token']:.1f}")
report = {"alignment": align, "speculative": spec, "early_exit": early}
plots = R.write_plots(report, OUT)
for name in ("early_exit.png", "speculative.png"):
    display(Image(filename=str(OUT / name)))
'''),
        md("## 6. The report\n`report.json` follows the schema of `make demo`'s `runs/demo/report.json` (see README)."),
        code('''
report["targets"] = R.targets(report)
report["models"] = {"base": base_cfg.to_dict(), "m2r2": mcfg.to_dict(), "distill": dsum}
(OUT / "report.json").write_text(json.dumps(report, indent=2, default=float))
for k, v in report["targets"].items():
    print(f"{k}: {v['value']} -> {'met' if v['met'] else 'missed'}")
print("wrote", OUT / "report.json", "and", [p.name for p in plots])
'''),
    ]
    return cells


# ------------------------------------------------------------------------------------------------
# 2. MoE ahead-of-time expert loading
# ------------------------------------------------------------------------------------------------
def moe_offload():
    cells = [
        md('''
# M2R2 for MoE models: ahead-of-time expert loading

When a mixture-of-experts model does not fit in accelerator memory, its experts live in host
memory (or flash) and are copied in when the router picks them. The M2R2 fast stream reaches a
layer's input *early*, so its own routing predicts which experts a later layer will pick, and the
copies can start before the slow stream gets there. This notebook:

1. pre-trains the embedded tiny MoE (`configs/models/tiny_moe.py`: 8 layers, 8 experts, top-2);
2. distills M2R2 on it (`configs/m2r2/tiny_moe.py`: at MoE layers the fast stream runs a dense
   low-rank MLP instead of experts, so it moves no expert bytes of its own; its routers' outputs
   are the predictions);
3. records the true routing along held-out text (teacher-forced, as `make demo` does: a briefly
   trained model's greedy output loops on a few tokens whose routing never changes) and every
   predictor's guess, and scores them (recall@k per layer and by lookahead);
4. replays the trace through the cost model of real MoE shapes (Mixtral-8x7B, OLMoE) on named
   platforms (phone flash, PCIe Gen4/Gen5, NVLink-C2C) and reports simulated speedups over
   on-demand loading with an LRU cache, up to the ceilings no predictor can pass (Belady's
   eviction, which knows the future), plus the real offload engine on this machine.

The CLI equivalent of steps 3-4 is `m2r2 moe-bench --checkpoint MOE_CKPT --m2r2 M2R2 --prompts FILE.jsonl --out DIR`.
'''),
        params(_params('''
# Parameters (the test suite replaces these with a reduced setting)
WORKDIR = "runs/colab_moe"        # checkpoints, moe_report.json and plots
PRETRAIN_STEPS = 120              # tiny MoE pre-training steps (fewer leave its routing on a few experts)
DISTILL_STEPS = 90                # M2R2 stage 1 (the demo's; 30 predicts the experts less well)
ROUTER_STEPS = 30                 # M2R2 stage 2
BATCH_SIZE = 8
SEQ_LEN = 128
N_PROMPTS = 3                     # held-out prompts decoded for the routing trace
PROMPT_LEN = 32
MAX_NEW_TOKENS = 96               # held-out tokens fed after each prompt (the trace)
CAPACITY = None                   # device expert slots per layer (None: 2 x experts per token)
SHAPES = ("mixtral-8x7b", "olmoe-1b-7b")                             # real model shapes of the cost model
PLATFORMS = ("phone_flash", "pcie_gen4", "pcie_gen5", "nvlink_c2c")  # named platforms
RUN_REAL_ENGINE = True            # also run the real offload engine (slow: per-layer Python control)
MODEL_OVERRIDES = {}              # tiny MoE fields, e.g. {"n_experts": 16}
M2R2_OVERRIDES = {}               # e.g. {"moe_fast_mlp": "experts"} (or "none")
DATA_OVERRIDES = {}               # training text, e.g. {"split": "all"} (fields of the config's data section)
''')),
        md(SETUP_MD),
        code(SETUP),
        code('''
import json
from pathlib import Path

from IPython.display import Image, display

from m2r2_jax.bench.demo import CONFIG_DIR, heldout_prompts
from m2r2_jax.data.tokenizer import load_tokenizer
from m2r2_jax.m2r2.checkpoint import load_m2r2
from m2r2_jax.m2r2.distill import distill
from m2r2_jax.models.checkpoint import load_model, params_fingerprint, tokenizer_path
from m2r2_jax.moe_offload import platforms as P
from m2r2_jax.moe_offload.report import moe_report, write_plots
from m2r2_jax.training.config import load_config_file
from m2r2_jax.training.pretrain import pretrain

OUT = Path(WORKDIR).absolute()
OUT.mkdir(parents=True, exist_ok=True)
'''),
        md("## 1. The tiny MoE base and its M2R2 parameters"),
        code(pretrain_code("tiny_moe") + distill_code("tiny_moe") + '''
base_cfg, base_params = load_model(BASE_DIR)
mcfg, m2r2_params = load_m2r2(OUT / "distill" / "m2r2", base_cfg, params_fingerprint(base_cfg, base_params))
tok = load_tokenizer(tokenizer_path(BASE_DIR))
print(f"{base_cfg.family}: {base_cfg.n_layers} layers, {base_cfg.n_experts} experts, top-{base_cfg.n_experts_per_tok}; "
      f"M2R2 b={mcfg.branch_layer}, rate {mcfg.rate}, fast MLP {mcfg.moe_fast_mlp!r}")
'''),
        md('''
## 2. Predicted against actual routing, and simulated speedups

`moe_report` feeds each prompt and its held-out continuation, records which experts every layer really picked and what
each predictor guessed: `next_gate` (the next layer's router applied to the current hidden state),
`m2r2` (the fast stream's routing, issued when the fast stream passes the layer) and `oracle` (the
true routing, an upper bound). Recall@k is the share of the truly picked experts among a
predictor's top-k. The trace is then replayed through a discrete-event simulator: one transfer link,
sequential compute, a cache of `capacity` expert slots per layer, evicting the least recently used
expert or, in the `*_lfu` rungs, the least often demanded one; every assumption is written into
the report.
'''),
        code('''
texts = heldout_prompts(tok, N_PROMPTS, PROMPT_LEN + MAX_NEW_TOKENS)
report = moe_report(base_cfg, base_params, mcfg, m2r2_params, [t[:PROMPT_LEN] for t in texts],
                    max_new_tokens=MAX_NEW_TOKENS, continuations=[t[PROMPT_LEN:] for t in texts],
                    capacity=CAPACITY, shapes=SHAPES, platforms=PLATFORMS, run_real_engine=RUN_REAL_ENGINE)
plots = write_plots(report, OUT)
(OUT / "moe_report.json").write_text(json.dumps(report, indent=2, sort_keys=True, default=float))

print(f"trace: {report['trace']['decoded_tokens']} tokens of held-out text (teacher-forced: "
      f"{report['trace']['teacher_forced']}), {report['trace']['distinct_token_fraction']:.0%} distinct")
print("recall@k (mean over layers):", {p: round(v, 3) for p, v in report["recall"].items()})
print("\\nrecall@k per layer (layers before the branch have no m2r2 prediction of their own)")
per_layer = report["recall_per_layer"]
print("layer " + "".join(f"{p:>11}" for p in ("next_gate", "m2r2", "oracle")))
for layer in range(base_cfg.n_layers):
    vals = [per_layer[p][layer] for p in ("next_gate", "m2r2", "oracle")]
    print(f"{layer:>5} " + "".join(f"{v:>11.3f}" if v is not None else f"{'-':>11}" for v in vals))
for name in ("recall_per_layer.png", "recall_by_lookahead.png"):
    display(Image(filename=str(OUT / name)))
'''),
        code('''
print(f"cache hit rate (capacity {report['capacity']} slots per layer):",
      {r: round(v, 3) for r, v in report["hit_rate"].items()})
print(f"\\nsimulated speedup vs on-demand loading + LRU ({report['simulated_speedup_model']} costs)")
plats = list(PLATFORMS)
print(f"{'':<18}" + "".join(f"{p:>13}" for p in plats))
for rung, per_plat in report["simulated_speedup"].items():
    print(f"{rung:<18}" + "".join(f"{per_plat[p]:>13.2f}" for p in plats))
print("\\nceiling per platform (no policy can beat it on this trace):",
      {p: round(c["bound_speedup_vs_on_demand_lru"], 2) for p, c in report["ceiling"].items()})
print("\\nrho = expert transfer time / layer compute time:",
      {p: round(report["simulation"][report["simulated_speedup_model"]][p]["costs"]["rho"], 2) for p in plats})
need = report["recall_needed"]
print(f"\\nm2r2 recall after the branch {need['recall'][0]:.3f}; recall at which its prefetching would beat "
      "on-demand LFU (None: not even perfect guesses):", need["break_even_recall"])
for name in ("simulated_speedup.png", "speedup_vs_rho.png", "recall_needed.png"):
    display(Image(filename=str(OUT / name)))
if "engine" in report:
    print("\\nreal offload engine on this machine (", report["engine"]["calibration"]["caveat"], ")")
    for rung, st in report["engine"]["ladder"].items():
        print(f"  {rung:<14} hit rate {st['hit_rate']:.3f}  tokens equal to all-resident: {st['tokens_equal_all_resident']}")
print("\\ntargets:", json.dumps(report["targets"], indent=1, default=float))
print("wrote", OUT / "moe_report.json", "and", [Path(p).name for p in plots])
'''),
    ]
    return cells


# ------------------------------------------------------------------------------------------------
# 3. bring your own model
# ------------------------------------------------------------------------------------------------
def bring_your_own_model():
    cells = [
        md('''
# Bring your own model: convert, distill, benchmark

M2R2 on a real pretrained decoder: a Llama 2/3, Mistral, Qwen2, Phi-3, Mixtral, Qwen2-MoE or OLMoE
checkpoint in the Hugging Face format (a folder with `config.json`, `*.safetensors` and
`tokenizer.json` or `tokenizer.model`, e.g. downloaded to your Drive with `huggingface-cli
download`). The notebook uses the `m2r2` command, so every step is also what you would run on a
VM:

1. `m2r2 convert` imports the checkpoint;
2. `m2r2 distill` trains the M2R2 parameters on a JSON-lines dataset, a tfds dataset or the
   embedded corpus;
3. `m2r2 align` measures how early the fast stream agrees with the final output;
4. `m2r2 bench` runs lossless self-speculative decoding against plain decoding on MT-Bench (or
   another embedded prompt set) and writes `report.json`.

Use a GPU or TPU runtime (Runtime > Change runtime type) for anything beyond a toy model. The
default sizes are a starting point for a model of about 0.5B parameters (e.g. Qwen2-0.5B) on one
Colab GPU, not a measured recipe; a T4 has no bfloat16 units, so pick an L4/A100 runtime for
`DTYPE = "bfloat16"` or use "float32" on a T4. A
`tfds:NAME` dataset must already be prepared in the ArrayRecord format under `TFDS_DATA_DIR`.
'''),
        params(_params('''
# Parameters (the test suite replaces these with a reduced setting)
HF_DIR = "/content/drive/MyDrive/models/Qwen2-0.5B"  # Hugging Face model folder
WORKDIR = "runs/colab_byom"        # converted checkpoint, M2R2 checkpoint, reports
DTYPE = "bfloat16"                 # checkpoint dtype: float32 | bfloat16 | float16 | "" (config.json's)
DATA = "embedded"                  # "embedded", a .jsonl file (text in TEXT_FIELD) or "tfds:NAME"
TEXT_FIELD = "text"                # jsonl / tfds field holding the text
TFDS_SPLIT = "train"
TFDS_DATA_DIR = ""                 # a prepared tfds data_dir (ArrayRecord format)
BRANCH_LAYER = None                # b (None: about 1/8 of the layers)
RATE = 4                           # r: layers per fast step
LORA_RANK = 16
DISTILL_STEPS = 1000               # stage 1 (adapters + rates)
ROUTER_STEPS = 200                 # stage 2 (router)
BATCH_SIZE = 8
SEQ_LEN = 512
LEARNING_RATE = 1e-3
PROMPTS = "mt_bench"               # mt_bench | spec_bench | koala | self_instruct | wizardlm | a .jsonl file
N_PROMPTS = 16
MAX_PROMPT_TOKENS = 256            # prompts are cut to their last N tokens
MAX_NEW_TOKENS = 128
GAMMA = 4
REPEATS = 3
BATCH_SIZES = "1,4"                # throughput sweep
ALIGN_SEQ_LEN = 256                # alignment analysis: tokens per sequence
ALIGN_BATCHES = 4
''')),
        md(SETUP_MD),
        code(SETUP),
        code('''
import json
import shlex
from pathlib import Path

from IPython.display import Image, display

from m2r2_jax.bench.demo import CONFIG_DIR

OUT = Path(WORKDIR).absolute()
OUT.mkdir(parents=True, exist_ok=True)
CKPT = OUT / "checkpoint"
DISTILL_DIR = OUT / "distill"
if not Path(HF_DIR).is_dir():
    raise FileNotFoundError(f"HF_DIR={HF_DIR!r} is not a folder: point it at a Hugging Face model folder")
print(sorted(p.name for p in Path(HF_DIR).iterdir()))
Q = {name: shlex.quote(str(value)) for name, value in
     dict(HF_DIR=HF_DIR, CKPT=CKPT, DISTILL_DIR=DISTILL_DIR, OUT=OUT).items()}
'''),
        md('''
## 1. Convert

Reads `config.json` and the safetensors shards, maps the weights onto the project's decoder (one
implementation for every family) and writes a checkpoint with the tokenizer beside it. Skipped when
the checkpoint already exists.
'''),
        code('''
if not (CKPT / "model_config.json").is_file():
    dtype_flag = f"--dtype={DTYPE}" if DTYPE else ""
    !m2r2 convert --hf {Q["HF_DIR"]} --out {Q["CKPT"]} {dtype_flag}
    assert _exit_code == 0, "m2r2 convert failed (the line above says why)"
model_cfg = json.loads((CKPT / "model_config.json").read_text())
print({k: model_cfg[k] for k in ("family", "n_layers", "d_model", "vocab_size", "n_experts", "param_dtype")})
'''),
        md('''
## 2. Distill

Starts from `configs/m2r2/llama3_8b.py` (any family) and overrides the sizes from the parameters
cell on the command line — every `--config.*` flag is a field of the config. The text is tokenized
with the checkpoint's own tokenizer. Rerunning the cell resumes from the stage checkpoints in
`WORKDIR/distill`.
'''),
        code('''
from m2r2_jax.models.checkpoint import tokenizer_path

n_layers = model_cfg["n_layers"]
b = BRANCH_LAYER if BRANCH_LAYER is not None else min(max(1, n_layers // 8), n_layers - 1)
flags = {
    "config.base_checkpoint": CKPT,
    "config.m2r2.branch_layer": b,
    "config.m2r2.rate": RATE,
    "config.m2r2.lora_rank": LORA_RANK,
    "config.m2r2.lora_alpha": 2.0 * LORA_RANK,
    "config.train.steps": DISTILL_STEPS,
    "config.train.warmup_steps": max(1, DISTILL_STEPS // 10),
    "config.train.checkpoint_every": max(10, DISTILL_STEPS // 4),
    "config.train.batch_size": BATCH_SIZE,
    "config.train.learning_rate": LEARNING_RATE,
    "config.router_train.steps": ROUTER_STEPS,
    "config.router_train.warmup_steps": max(1, ROUTER_STEPS // 10),
    "config.router_train.checkpoint_every": max(10, ROUTER_STEPS // 2),
    "config.router_train.batch_size": BATCH_SIZE,
    "config.router_train.learning_rate": LEARNING_RATE,
    "config.data.seq_len": SEQ_LEN,
    "config.data.tokenizer": tokenizer_path(CKPT) or "",
    "config.data.text_field": TEXT_FIELD,
}
if DATA == "embedded":
    flags["config.data.source"] = "embedded"
elif DATA.startswith("tfds:"):
    flags.update({"config.data.source": "tfds", "config.data.tfds_name": DATA[len("tfds:"):],
                  "config.data.split": TFDS_SPLIT})
    if TFDS_DATA_DIR:
        flags["config.data.tfds_data_dir"] = TFDS_DATA_DIR
else:
    flags.update({"config.data.source": "jsonl", "config.data.paths": f"({str(Path(DATA).absolute())!r},)"})
DISTILL_FLAGS = " ".join(shlex.quote(f"--{k}={v}") for k, v in flags.items())
print("m2r2 distill --config=configs/m2r2/llama3_8b.py", DISTILL_FLAGS, "--workdir", Q["DISTILL_DIR"])
Q["CONFIG"] = shlex.quote(str(CONFIG_DIR / "m2r2" / "llama3_8b.py"))
'''),
        code('''
!m2r2 distill --config={Q["CONFIG"]} {DISTILL_FLAGS} --workdir {Q["DISTILL_DIR"]}
assert _exit_code == 0, "m2r2 distill failed (the line above says why)"
dsum = json.loads((DISTILL_DIR / "distill_summary.json").read_text())
print("stream stage:", {k: dsum["stream"].get(k) for k in ("step", "last_loss", "agreement_per_step")})
print("router stage:", {k: dsum["router"].get(k) for k in ("step", "last_loss", "router_acc")})
'''),
        md('''
## 3. Alignment

Slow-stream layers against fast-stream steps at equal compute, on held-out text (the dataset
file, or the embedded corpus's held-out split).
'''),
        code('''
align_data = DATA if DATA.endswith((".jsonl", ".txt")) else "embedded"
align_seq = min(ALIGN_SEQ_LEN, model_cfg["max_seq_len"])
!m2r2 align --checkpoint {Q["CKPT"]} --m2r2 {Q["DISTILL_DIR"]}/m2r2 --data {shlex.quote(align_data)} --text_field {TEXT_FIELD} --seq_len {align_seq} --batch_size {BATCH_SIZE} --max_batches {ALIGN_BATCHES} --out {Q["OUT"]}/align
assert _exit_code == 0, "m2r2 align failed (the line above says why)"
display(Image(filename=str(OUT / "align" / "alignment.png")))
'''),
        md('''
## 4. Benchmark on MT-Bench

Spec-Bench's definitions: speedup from mean per-answer tokens/s at batch 1 (greedy), mean accepted
tokens per verification counting the target's own token, and an identical-output check against
plain decoding. Prompts are used as plain text (no chat template).
'''),
        code('''
!m2r2 bench --checkpoint {Q["CKPT"]} --m2r2 {Q["DISTILL_DIR"]}/m2r2 --prompts {shlex.quote(PROMPTS)} --n_prompts {N_PROMPTS} --max_prompt_tokens {MAX_PROMPT_TOKENS} --max_new_tokens {MAX_NEW_TOKENS} --gamma {GAMMA} --repeats {REPEATS} --batch_sizes {BATCH_SIZES} --out {Q["OUT"]}/bench
assert _exit_code == 0, "m2r2 bench failed (the line above says why)"
bench = json.loads((OUT / "bench" / "report.json").read_text())
spec = bench["speculative"]
for m, r in spec.items():
    print(f"{m:<14} {r['tokens_per_s']:8.1f} tok/s  speedup {r['speedup_vs_ar']:.2f}  "
          f"accepted/verification {r['mean_accepted_tokens']:.2f}  identical to ar: {r['identical_to_ar'] if m != 'ar' else '-'}")
identical = all(r["identical_to_ar"] for m, r in spec.items() if m != "ar")
print("speculative answers identical to plain decoding:", identical)
display(Image(filename=str(OUT / "bench" / "speculative.png")))
'''),
    ]
    return cells


BUILDERS = {"quickstart": quickstart, "moe_offload": moe_offload, "bring_your_own_model": bring_your_own_model}


def build(name: str) -> nbformat.NotebookNode:
    nb = new_notebook(cells=BUILDERS[name]())
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nb.metadata["colab"] = {"provenance": [], "toc_visible": True}
    if name == "bring_your_own_model":
        nb.metadata["accelerator"] = "GPU"
    for i, cell in enumerate(nb.cells):  # stable ids, so regenerating gives byte-identical files
        cell["id"] = f"{name[:12]}-{i:02d}"
    nbformat.validate(nb)
    return nb


def render(name: str) -> str:
    return nbformat.writes(build(name)) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a committed notebook differs")
    ap.add_argument("--out", default=str(HERE), help="folder to write the notebooks to")
    args = ap.parse_args(argv)
    stale = []
    for name in NOTEBOOKS:
        path = Path(args.out) / f"{name}.ipynb"
        text = render(name)
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(path)
        else:
            path.write_text(text)
            print("wrote", path)
    if stale:
        print("out of date (run colab/make_notebooks.py):", *map(str, stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
