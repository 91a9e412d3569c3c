"""The Colab notebooks (colab/*.ipynb): committed without outputs, in sync with their generator
(colab/make_notebooks.py), and executed top to bottom on CPU with nbclient in a reduced setting.

The reduced setting is a cell injected right after each notebook's `parameters` cell (tagged in
the cell metadata, as papermill does); every name it sets must be a parameter of that cell. The
kernel is this interpreter (an ipykernel `python3` kernelspec written to a temporary folder), run in
a temporary working directory, with this interpreter's bin folder first on PATH so the notebooks'
`!m2r2 ...` lines reach this install. The kernel sees one CPU device, as on a Colab CPU runtime:
the 8 fake devices that tests/conftest.py sets up for the sharding tests are dropped from its
XLA_FLAGS, which get the suite's fast-compile flags and XLA:CPU's faster-compiling emitters
(tests/conftest.py); the persistent JAX compilation cache is kept.

Compiling dominates these runs (about 40-60 CPU-seconds per notebook on a cold cache), so one module
fixture executes every selected notebook once, as many at a time as there are cores, and each
test then checks one notebook's outputs.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import jax
import nbformat
import numpy as np
import pytest
from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
COLAB = ROOT / "colab"
NOTEBOOKS = ("quickstart", "moe_offload", "bring_your_own_model")
CELL_TIMEOUT_S = 300

# Train on the embedded corpus's held-out split (5% of it): tokenizing the whole corpus for each of
# the four training stages would cost more than the training steps themselves.
HELDOUT_TEXT = {"split": "heldout"}
# The quickstart's decoding engines unroll their layer loop on CPU, so every program it compiles
# grows with the depth: 4 layers instead of 6 took its run from ~87 to ~66 s. Branching after 1
# layer at rate 2 keeps two fast steps (ceil(3 / 2)), as the 6-layer setting had.
QUICKSTART_LAYERS = 4
REDUCED = {
    "quickstart": dict(
        WORKDIR="work", PRETRAIN_STEPS=3, DISTILL_STEPS=2, ROUTER_STEPS=2, BATCH_SIZE=4, SEQ_LEN=32, ALIGN_BATCHES=1,
        N_PROMPTS=2, PROMPT_LEN=8, MAX_NEW_TOKENS=6, GAMMA=2, BATCH_SWEEP=(1,), REPEATS=1, THRESHOLDS=(0.5, 0.9),
        METHODS=("ar", "m2r2_spec"), EXIT_METHODS=("m2r2_exit",), MODEL_OVERRIDES={"n_layers": QUICKSTART_LAYERS},
        M2R2_OVERRIDES={"rate": 2, "lora_rank": 4, "branch_layer": 1}, DATA_OVERRIDES=HELDOUT_TEXT,
    ),
    "moe_offload": dict(
        WORKDIR="work", PRETRAIN_STEPS=3, DISTILL_STEPS=2, ROUTER_STEPS=2, BATCH_SIZE=4, SEQ_LEN=32, N_PROMPTS=2,
        PROMPT_LEN=8, MAX_NEW_TOKENS=4, SHAPES=("mixtral-8x7b",), PLATFORMS=("pcie_gen4", "nvlink_c2c"),
        RUN_REAL_ENGINE=True, MODEL_OVERRIDES={"n_layers": 4}, M2R2_OVERRIDES={"lora_rank": 4},
        DATA_OVERRIDES=HELDOUT_TEXT,
    ),
    # HF_DIR and DATA are filled in by the test (a tiny random checkpoint and a jsonl file)
    "bring_your_own_model": dict(
        WORKDIR="work", DTYPE="float32", TEXT_FIELD="text", BRANCH_LAYER=1, RATE=2, LORA_RANK=4, DISTILL_STEPS=2,
        ROUTER_STEPS=2, BATCH_SIZE=4, SEQ_LEN=32, PROMPTS="mt_bench", N_PROMPTS=2, MAX_PROMPT_TOKENS=16,
        MAX_NEW_TOKENS=4, GAMMA=2, REPEATS=1, BATCH_SIZES="1", ALIGN_SEQ_LEN=32, ALIGN_BATCHES=1,
    ),
}


def _read(name: str) -> nbformat.NotebookNode:
    nb = nbformat.read(COLAB / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    return nb


def _parameters_cell(nb) -> int:
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"expected exactly one cell tagged 'parameters', found {len(tagged)}"
    first_code = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
    assert tagged[0] == first_code, "the parameters cell must be the first code cell"
    return first_code


def _assigned_names(source: str) -> set:
    return {t.id for node in ast.parse(source).body if isinstance(node, ast.Assign)
            for t in node.targets if isinstance(t, ast.Name)}


def _inject(nb, overrides: dict):
    """Insert the reduced setting after the parameters cell; refuse names the cell does not define."""
    i = _parameters_cell(nb)
    unknown = set(overrides) - _assigned_names(nb.cells[i].source)
    assert not unknown, f"not parameters of this notebook: {sorted(unknown)}"
    src = "# reduced setting injected by tests/colab/test_notebooks.py\n" + "\n".join(
        f"{k} = {v!r}" for k, v in overrides.items())
    cell = nbformat.v4.new_code_cell(src)
    cell.metadata["tags"] = ["injected-parameters"]
    nb.cells.insert(i + 1, cell)
    return nb


def _kernel_env() -> dict:
    env = dict(os.environ)
    from conftest import FAST_COMPILE, OLD_EMITTERS

    # one device, as in Colab; compiling dominates these tiny runs, so the suite's fast compiles and
    # XLA:CPU's faster-compiling emitters (every comparison a notebook makes is inside its kernel or
    # a process it starts, all with these flags)
    fast = FAST_COMPILE.split() + OLD_EMITTERS.split()
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count") and f not in fast]
    env["XLA_FLAGS"] = " ".join(flags + fast)
    env["JAX_PLATFORMS"] = "cpu"
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["MPLBACKEND"] = "Agg"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _client(nb, workdir: Path, kernel_dir: Path) -> NotebookClient:
    """An executor of `nb` in a kernel of this interpreter, started in `workdir`."""
    from ipykernel.kernelspec import write_kernel_spec

    spec_dir = kernel_dir / "python3"
    if not spec_dir.is_dir():
        write_kernel_spec(str(spec_dir))
    ksm = KernelSpecManager(kernel_dirs=[str(kernel_dir)], ensure_native_kernel=False)
    assert ksm.get_kernel_spec("python3").argv[0] == sys.executable
    km = AsyncKernelManager(kernel_name="python3", kernel_spec_manager=ksm)
    return NotebookClient(nb, km=km, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                          resources={"metadata": {"path": str(workdir)}})


def _execute_all(jobs: dict, kernel_dir: Path, lanes: int) -> dict:
    """Run the notebooks of `jobs` ({key: (nb, workdir)}), at most `lanes` kernels at a time (each
    kernel mostly keeps one core busy compiling). Returns {key: (executed nb, None) or (nb, error)};
    a failing cell's error is a CellExecutionError."""

    async def one(key, sem):
        nb, workdir = jobs[key]
        async with sem:
            t0 = time.monotonic()
            try:
                await _client(nb, workdir, kernel_dir).async_execute(env=_kernel_env())
                err = None
            except Exception as e:  # reported by the test of this notebook
                err = e
            return key, nb, err, time.monotonic() - t0

    async def run():
        sem = asyncio.Semaphore(lanes)
        return await asyncio.gather(*(one(k, sem) for k in jobs))

    out = {}
    for key, nb, err, seconds in asyncio.run(run()):
        print(f"{key}: {seconds:.0f} s" + (f" (failed: {type(err).__name__})" if err else ""))
        out[key] = (nb, err)
    return out


def _text(nb) -> str:
    """All stream and text/plain output of an executed notebook."""
    parts = []
    for c in nb.cells:
        for o in c.get("outputs", []):
            if o.output_type == "stream":
                parts.append(o.text)
            elif "data" in o and "text/plain" in o.data:
                parts.append(o.data["text/plain"])
    return "\n".join(parts)


def _images(nb) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))


# ------------------------------------------------------------------------------------------------
# Static checks
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_without_outputs_and_with_a_parameters_cell(name):
    nb = _read(name)
    for i, c in enumerate(nb.cells):
        if c.cell_type == "code":
            assert c.outputs == [], f"{name}.ipynb cell {i} has outputs"
            assert c.execution_count is None, f"{name}.ipynb cell {i} has an execution count"
    params = nb.cells[_parameters_cell(nb)].source
    assert {"WORKDIR", "M2R2_SOURCE"} <= _assigned_names(params)
    assert set(REDUCED[name]) <= _assigned_names(params)
    # every cell compiles once IPython has turned `!cmd` lines into Python
    from IPython.core.inputtransformer2 import TransformerManager

    tm = TransformerManager()
    for i, c in enumerate(nb.cells):
        if c.cell_type == "code":
            compile(tm.transform_cell(c.source), f"{name}.ipynb cell {i}", "exec")


def test_notebooks_match_their_generator(tmp_path):
    spec = importlib.util.spec_from_file_location("make_notebooks", COLAB / "make_notebooks.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert tuple(gen.NOTEBOOKS) == NOTEBOOKS
    assert gen.main(["--check"]) == 0, "colab/*.ipynb differ from colab/make_notebooks.py: rerun it"
    # the check itself notices an edited notebook
    assert gen.main(["--out", str(tmp_path)]) == 0
    nb_path = tmp_path / "quickstart.ipynb"
    nb = nbformat.read(nb_path, as_version=4)
    nb.cells[0].source += "\nedited"
    nbformat.write(nb, nb_path)
    assert gen.main(["--check", "--out", str(tmp_path)]) == 1


# ------------------------------------------------------------------------------------------------
# Execution: every selected notebook runs once, concurrently, in a module fixture; one test each
# ------------------------------------------------------------------------------------------------
def _tiny_hf_checkpoint(root: Path):
    """A tiny random Qwen2-family checkpoint in the Hugging Face layout (config.json, safetensors,
    tokenizer.model), written by the package's own exporter, and a jsonl dataset."""
    from m2r2_jax.data.corpus import embedded_split
    from m2r2_jax.data.tokenizer import train_sentencepiece
    from m2r2_jax.interop.convert import write_hf
    from m2r2_jax.models.config import ModelConfig
    from m2r2_jax.models.transformer import init_params

    tok = train_sentencepiece(embedded_split("train")[:60000], 400, root / "tok" / "tokenizer.model")
    cfg = ModelConfig(family="qwen2", vocab_size=tok.vocab_size, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2,
                      head_dim=8, d_ff=64, max_seq_len=64, qkv_bias=True).validate()
    hf_dir = write_hf(cfg, jax.device_get(init_params(cfg, jax.random.key(0))), root / "Qwen2-tiny", tokenizer=tok.path)
    data = root / "data.jsonl"
    paragraphs = [p for p in embedded_split("heldout").split("\n\n") if p.strip()][:200]
    data.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    return hf_dir, data


# test name -> notebook it executes (the failing-command run stops early in bring_your_own_model)
RUNS = {"test_quickstart_runs": "quickstart", "test_moe_offload_runs": "moe_offload",
        "test_bring_your_own_model_runs": "bring_your_own_model",
        "test_failing_command_stops_the_notebook": "bring_your_own_model"}


@pytest.fixture(scope="module")
def executed(request, tmp_path_factory):
    """{test name: (executed notebook, workdir, error or None, extra)} for the selected tests."""
    selected = [t for t in RUNS if any(item.name == t for item in request.session.items)]
    root = tmp_path_factory.mktemp("colab")
    jobs, extra = {}, {}
    if {"test_bring_your_own_model_runs", "test_failing_command_stops_the_notebook"} & set(selected):
        hf_dir, data = _tiny_hf_checkpoint(root / "byom_inputs")
    for test in selected:
        name = RUNS[test]
        overrides = dict(REDUCED[name])
        if test == "test_bring_your_own_model_runs":
            overrides.update(HF_DIR=str(hf_dir), DATA=str(data))
            extra[test] = (hf_dir, data)
        elif test == "test_failing_command_stops_the_notebook":
            empty = root / "not_a_checkpoint"
            empty.mkdir()
            overrides.update(HF_DIR=str(empty), DATA="embedded")
        workdir = root / test
        workdir.mkdir()
        jobs[test] = (_inject(_read(name), overrides), workdir)
    kernel_dir = root / "kernels"
    kernel_dir.mkdir()
    # the longest first (cold cache, seconds alone: ~57, ~58, ~41, ~10), so the short ones fill the gaps
    cost_order = ("test_quickstart_runs", "test_bring_your_own_model_runs", "test_moe_offload_runs",
                  "test_failing_command_stops_the_notebook")
    order = sorted(jobs, key=cost_order.index)
    done = _execute_all({t: jobs[t] for t in order}, kernel_dir, lanes=max(1, min(len(jobs), os.cpu_count() or 1)))
    return {t: (nb, jobs[t][1], err, extra.get(t)) for t, (nb, err) in done.items()}


def _ran(executed, test: str):
    nb, workdir, err, extra = executed[test]
    if err is not None:
        raise err
    return nb, workdir / "work", extra


def test_quickstart_runs(executed):
    nb, out, _ = _ran(executed, "test_quickstart_runs")
    report = json.loads((out / "report.json").read_text())
    spec = report["speculative"]
    assert set(spec) == {"ar", "m2r2_spec"}
    # lossless speculative decoding: same answers as plain decoding, each as long as asked
    assert spec["m2r2_spec"]["identical_to_ar"] is True
    assert spec["m2r2_spec"]["answers"] == spec["ar"]["answers"]
    assert [len(a) for a in spec["ar"]["answers"]] == [REDUCED["quickstart"]["MAX_NEW_TOKENS"]] * 2
    assert spec["m2r2_spec"]["mean_accepted_tokens"] == pytest.approx(
        1 + sum(spec["m2r2_spec"]["acceptance_by_position"]))
    assert len(spec["m2r2_spec"]["acceptance_by_position"]) == REDUCED["quickstart"]["GAMMA"]
    for m in ("ar", "m2r2_spec"):
        assert spec[m]["tokens_per_s"] == pytest.approx(
            np.mean([len(a) / t for a, t in zip(spec[m]["answers"], spec[m]["seconds_per_answer"])]))
    al = report["alignment"]
    assert len(al["slow_agreement"]) == QUICKSTART_LAYERS
    assert len(al["fast_agreement"]) == len(al["fast_beats_slow_at_equal_compute"]) == 2
    assert al["slow_agreement"][-1] == pytest.approx(1.0)  # the last layer is the final output
    assert list(report["early_exit"]) == ["m2r2_exit"]
    assert [r["threshold"] for r in report["early_exit"]["m2r2_exit"]] == [0.5, 0.9]
    for png in ("alignment.png", "speculative.png", "early_exit.png", "batch_sweep.png"):
        assert (out / png).stat().st_size > 1000, png
    assert report["models"]["distill"]["stream"]["step"] == 2 and report["models"]["distill"]["router"]["step"] == 2
    text = _text(nb)
    assert "speculative answers identical to plain decoding: True" in text
    assert "m2r2_spec" in text and "ROUGE-L" in text
    assert _images(nb) == 3  # alignment, early exit, speculative


def test_moe_offload_runs(executed):
    nb, out, _ = _ran(executed, "test_moe_offload_runs")
    report = json.loads((out / "moe_report.json").read_text())
    assert report["model"]["n_layers"] == 4 and report["model"]["n_experts"] == 8
    # the trace follows held-out text (teacher-forced); the real engine still decodes greedily
    assert report["trace"]["teacher_forced"] is True and report["trace"]["trace_tokens_equal_reference"] is None
    assert report["trace"]["decoded_tokens"] > 0 and 0 < report["trace"]["distinct_token_fraction"] <= 1
    assert set(report["ceiling"]) == {"pcie_gen4", "nvlink_c2c"}
    assert report["recall"]["oracle"] == pytest.approx(1.0)  # the true routing predicts itself
    assert all(0.0 <= report["recall"][p] <= 1.0 for p in ("next_gate", "m2r2"))
    assert set(report["simulated_speedup"]["m2r2"]) == {"pcie_gen4", "nvlink_c2c"}
    assert report["simulated_speedup_model"] == "mixtral-8x7b"
    assert all(v > 0 for rung in report["simulated_speedup"].values() for v in rung.values())
    assert all(st["tokens_equal_all_resident"] for st in report["engine"]["ladder"].values())
    for png in ("recall_per_layer.png", "recall_by_lookahead.png", "simulated_speedup.png", "speedup_vs_rho.png",
                "recall_needed.png", "engine_tokens_per_s.png"):
        assert (out / png).stat().st_size > 1000, png
    text = _text(nb)
    assert "recall@k per layer" in text and "simulated speedup vs on-demand loading" in text
    assert "recall at which its prefetching would beat on-demand LFU" in text
    assert _images(nb) == 5


def test_bring_your_own_model_runs(executed):
    nb, out, (hf_dir, data) = _ran(executed, "test_bring_your_own_model_runs")
    assert {"config.json", "tokenizer.model"} <= {p.name for p in hf_dir.iterdir()}
    model_cfg = json.loads((out / "checkpoint" / "model_config.json").read_text())
    assert model_cfg["family"] == "qwen2" and model_cfg["n_layers"] == 4
    dsum = json.loads((out / "distill" / "distill_summary.json").read_text())
    assert dsum["m2r2"]["branch_layer"] == 1 and dsum["m2r2"]["rate"] == 2
    assert dsum["stream"]["step"] == 2 and dsum["router"]["step"] == 2
    distill_cfg = json.loads((out / "distill" / "config.json").read_text())
    assert distill_cfg["data"]["source"] == "jsonl" and distill_cfg["data"]["paths"] == [str(data)]
    bench = json.loads((out / "bench" / "report.json").read_text())
    assert bench["prompts"] == "mt_bench" and bench["n_prompts"] == 2 and bench["fresh_m2r2_params"] is False
    spec = bench["speculative"]
    assert spec["m2r2_spec"]["identical_to_ar"] is True and spec["distance_spec"]["identical_to_ar"] is True
    align = json.loads((out / "align" / "alignment.json").read_text())
    assert align["fresh_m2r2_params"] is False and len(align["slow_agreement"]) == 4
    for png in ("align/alignment.png", "bench/speculative.png"):
        assert (out / png).stat().st_size > 1000, png
    text = _text(nb)
    assert "speculative answers identical to plain decoding: True" in text
    assert _images(nb) == 2


def test_failing_command_stops_the_notebook(executed):
    """A failing `!m2r2 ...` line stops the notebook with its error (IPython does not raise on a
    shell command's exit status; the notebook checks it): here a folder that is no checkpoint."""
    from nbclient.exceptions import CellExecutionError

    nb, workdir, err, _ = executed["test_failing_command_stops_the_notebook"]
    assert isinstance(err, CellExecutionError) and "m2r2 convert failed" in str(err)
    assert "m2r2: error:" in _text(nb)  # the command's own one-line error is in the cell's output
    assert not (workdir / "work" / "distill").exists()
