"""--mesh on the CLI, launch/sweep.py (expansion, validation, a local run through `m2r2 pretrain
--mesh`) and the launcher scripts' commands (DRY_RUN)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cpu_xla_flags, tiny_pretrain_config

sys.path.insert(0, str(Path(__file__).parents[1] / "decoding"))
from decoding_helpers import model  # noqa: E402

from m2r2_jax.decoding import api  # noqa: E402
from m2r2_jax.models.checkpoint import save_model  # noqa: E402

ROOT = Path(__file__).parents[2]
PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [9, 8]]


def _env(devices=8):
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_xla_flags(devices))


def m2r2(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "m2r2_jax.cli.main", *args], capture_output=True, text=True,
                          env=_env(), timeout=timeout, cwd=ROOT)


def _sweep_module():
    spec = importlib.util.spec_from_file_location("sweep", ROOT / "launch" / "sweep.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generate_with_a_mesh_gives_the_unsharded_tokens(tmp_path):
    cfg, params = model("llama", vocab_size=64)
    save_model(tmp_path / "base", cfg, params)
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"tokens": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "out.jsonl"
    r = m2r2("generate", "--checkpoint", str(tmp_path / "base"), "--method", "m2r2_spec", "--prompts",
             str(tmp_path / "p.jsonl"), "--max-new-tokens", "6", "--batch-size", "2", "--gamma", "3",
             "--mesh", "data=2,tensor=4", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    ref = api.generate("ar", cfg, params, PROMPTS, max_new_tokens=6)
    assert [json.loads(line)["tokens"] for line in out.read_text().splitlines()] == [x.tokens for x in ref]
    bad = m2r2("generate", "--checkpoint", str(tmp_path / "base"), "--prompts", str(tmp_path / "p.jsonl"),
               "--mesh", "data=3", "--out", str(tmp_path / "never.jsonl"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == ["m2r2: error: mesh data=3,fsdp=1,tensor=1,expert=1 needs 3 devices "
                                               "but 8 are available (cpu, 1 process(es))"]
    assert not (tmp_path / "never.jsonl").exists()


SWEEP = """
def get_config():
    return {{"name": "s", "verb": "{verb}", "config": "{config}", "root": "{root}", "fixed": {fixed},
             "axes": {axes}, "flags": {flags}}}
"""


def _write_sweep(tmp_path, verb="distill", config="configs/m2r2/tiny_dense.py", fixed=None, axes=None, flags=()):
    path = tmp_path / "sweep.py"
    fixed = {"base_checkpoint": str(tmp_path / "no_base_yet")} if fixed is None else fixed
    path.write_text(SWEEP.format(verb=verb, config=config, root=tmp_path / "runs", fixed=fixed,
                                 axes=axes or {"m2r2": {"rate": [3, 5, 7], "lora_rank": [8, 16]}}, flags=list(flags)))
    return path


def test_sweep_expands_the_product_validates_and_prints_launcher_commands(tmp_path, capsys):
    sweep = _sweep_module()
    path = _write_sweep(tmp_path)
    assert sweep.main([str(path), "--dry-run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 6 and all(line.startswith("m2r2 distill --config=configs/m2r2/tiny_dense.py") for line in lines)
    assert "--config.m2r2.lora_rank=16 --config.m2r2.rate=7" not in lines[0]
    assert any("--config.m2r2.rate=7 --config.m2r2.lora_rank=16 --workdir" in line for line in lines)
    assert sweep.main([str(path), "--dry-run", "--launcher", "slurm", "--set", "axes.m2r2.rate=[4]"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("sbatch ") and "slurm_gpu.sbatch m2r2 distill" in line for line in lines)
    assert sweep.main([str(path), "--dry-run", "--launcher", "tpu", "--set", "axes.m2r2.rate=[4]",
                       "--set", "axes.m2r2.lora_rank=[8]"]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert "tpu_vm.sh run 'm2r2 distill" in line


@pytest.mark.parametrize("sets,needle", [
    (["--set", "axes.m2r2.lora_rank=[0]"], "run rate3_lora_rank0: m2r2.lora_rank=0 is invalid"),
    (["--set", "fixed.train.nonsense=1"], "no field 'train.nonsense'"),
    (["--set", "verb=generate"], "verb='generate' is invalid"),
    (["--set", "axes.m2r2.rate=[]"], "non-empty list"),
    (["--set", "oops"], "expected KEY=VALUE"),
    (["--set", "fixed.base_checkpoint="], "fixed.base_checkpoint is empty"),
])
def test_a_bad_sweep_fails_up_front_in_one_line(tmp_path, capsys, sets, needle):
    sweep = _sweep_module()
    assert sweep.main([str(_write_sweep(tmp_path)), *sets]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sweep: error:") and needle in err[0], err
    assert not (tmp_path / "runs").exists()  # nothing started, no manifest


def test_base_dependent_values_are_checked_against_the_base_checkpoint(tmp_path, capsys):
    sweep = _sweep_module()
    cfg, params = model("llama", vocab_size=64)  # 4 layers
    save_model(tmp_path / "base", cfg, params)
    path = _write_sweep(tmp_path, fixed={"base_checkpoint": str(tmp_path / "base")},
                        axes={"m2r2": {"branch_layer": [1, 6], "rate": [2]}})
    assert sweep.main([str(path), "--dry-run"]) == 2
    assert "branch_layer=6 is invalid" in capsys.readouterr().err


TINY = tiny_pretrain_config(steps=2, warmup_steps=1, checkpoint_every=100)


def test_a_local_sweep_runs_pretrain_with_a_mesh_and_writes_its_manifest(tmp_path):
    (tmp_path / "tiny.py").write_text(TINY)
    path = _write_sweep(tmp_path, verb="pretrain", config=tmp_path / "tiny.py", fixed={},
                        axes={"train": {"learning_rate": [0.003]}},
                        flags=["--mesh", "data=2,fsdp=2,tensor=2"])
    r = subprocess.run([sys.executable, str(ROOT / "launch" / "sweep.py"), str(path), "--launcher", "local"],
                       capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = json.loads((tmp_path / "runs" / "s" / "sweep.json").read_text())
    (run,) = manifest["runs"]
    assert run["overrides"] == {"train.learning_rate": 0.003} and run["argv"][:2] == ["m2r2", "pretrain"]
    summary = json.loads((Path(run["workdir"]) / "pretrain_summary.json").read_text())
    assert summary["step"] == 2 and summary["first_loss"] > 0


def test_launcher_scripts_print_their_commands_in_dry_run():
    env = dict(os.environ, DRY_RUN="1", TPU_NAME="pod", ZONE="z1", ACCELERATOR="v5p-16")
    create = subprocess.run(["bash", str(ROOT / "launch/tpu_vm.sh"), "create"], capture_output=True, text=True, env=env)
    assert create.returncode == 0
    assert create.stdout.split() == ["gcloud", "compute", "tpus", "tpu-vm", "create", "pod",
                                     "--accelerator-type=v5p-16", "--version=tpu-ubuntu2204-base", "--zone=z1"]
    run = subprocess.run(["bash", str(ROOT / "launch/tpu_vm.sh"), "run", "m2r2 distill --mesh fsdp=-1"],
                         capture_output=True, text=True, env=env)
    assert run.returncode == 0 and "--worker=all" in run.stdout and "m2r2\\\\\\ distill" in run.stdout
    bad = subprocess.run(["bash", str(ROOT / "launch/tpu_vm.sh"), "explode"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and bad.stderr.strip() == ("tpu_vm.sh: error: unknown step 'explode'; expected "
                                                          "create, install, run, logs or delete")
    slurm_env = dict(env, VENV=str(Path(sys.executable).parents[1]))
    srun = subprocess.run(["bash", str(ROOT / "launch/slurm_gpu.sbatch"), "m2r2", "distill", "--mesh", "fsdp=-1"],
                          capture_output=True, text=True, env=slurm_env)
    assert srun.returncode == 0 and srun.stdout.strip() == "srun m2r2 distill --mesh fsdp=-1"
    none = subprocess.run(["bash", str(ROOT / "launch/slurm_gpu.sbatch")], capture_output=True, text=True, env=slurm_env)
    assert none.returncode == 2 and "give the command to run" in none.stderr


def test_accelerator_check_stages_and_usage_errors(tmp_path):
    script = str(ROOT / "launch/accelerator_check.sh")
    base, m2r2 = tmp_path / "base", tmp_path / "m2r2"
    base.mkdir(), m2r2.mkdir()
    env = dict(os.environ, DRY_RUN="1", BENCH_ARGS="--n_prompts=5", CHECK_CASES="11,12")
    r = subprocess.run(["bash", script, str(tmp_path / "out"), str(base), str(m2r2), "koala"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "out").exists()  # a dry run writes nothing
    stages = dict(line.split(": ", 1) for line in r.stdout.strip().splitlines())
    assert list(stages) == ["kernels_d4096_r16", "kernels_d4096_r0", "kernels_d192_r8", "bench_xla", "bench_pallas"]
    checks = stages["kernels_d4096_r16"]
    assert "m2r2_jax.kernels.bench" in checks and "--check-cases 11\\,12" in checks
    assert all("--skip-checks" in stages[s] for s in ("kernels_d4096_r0", "kernels_d192_r8"))
    for impl in ("xla", "pallas"):
        cmd = stages[f"bench_{impl}"]
        assert f"--kernel_implementation={impl}" in cmd and "--prompts=koala" in cmd and "--n_prompts=5" in cmd
        assert f"--checkpoint={base}" in cmd and f"--m2r2={m2r2}" in cmd
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"tokens": [1, 2]}\n')
    moe = dict(env, MOE_BASE=str(base), MOE_M2R2=str(m2r2), MOE_ARGS="--capacity 4")
    r = subprocess.run(["bash", script, str(tmp_path / "out"), str(base), str(m2r2), str(prompts)],
                       capture_output=True, text=True, env=moe)
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("moe_bench: ") and "moe-bench" in last and f"--prompts={prompts}" in last
    assert "--capacity 4" in last
    for bad_env, needle in ((dict(env, MOE_BASE=str(base)), "set both MOE_BASE and MOE_M2R2"),
                            (moe, "the MoE stage needs a prompt file")):
        bad = subprocess.run(["bash", script, str(tmp_path / "out"), str(base), str(m2r2), "mt_bench"],
                             capture_output=True, text=True, env=bad_env)
        assert bad.returncode == 2 and needle in bad.stderr
    usage = subprocess.run(["bash", script, str(tmp_path)], capture_output=True, text=True)
    assert usage.returncode == 2 and usage.stderr.strip().startswith("accelerator_check.sh: error: usage:")
    missing = subprocess.run(["bash", script, str(tmp_path / "out"), str(tmp_path / "nope"), str(m2r2)],
                             capture_output=True, text=True)
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"accelerator_check.sh: error: no such directory: {tmp_path / 'nope'}"
