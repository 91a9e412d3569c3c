"""Two processes through jax.distributed on localhost agree with one process; ahead-of-time
compile checks (tiny in process, the Llama-3-8B presets through `m2r2 aot-check`)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from conftest import cpu_xla_flags, tiny_config
from m2r2_jax.errors import ConfigError
from m2r2_jax.m2r2.config import M2R2Config
from m2r2_jax.sharding import aot
from m2r2_jax.sharding.distributed import cluster_detected, initialize
from m2r2_jax.sharding.plan import ShardingPlan

HERE = Path(__file__).parent
ROOT = HERE.parents[1]


def _env(devices: int) -> dict:
    # the processes' time is compiling: XLA:CPU's faster-compiling emitters in every process of a test
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_xla_flags(devices, old_emitters=True))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # processes of one job would race on the same entries
    env["M2R2_COMPILE_CACHE"] = "off"
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_agree_with_one_on_a_distill_step_and_generation(tmp_path):
    worker = [sys.executable, str(HERE / "multihost_worker.py")]
    single = subprocess.Popen(worker + [str(tmp_path / "single.json"), str(tmp_path / "wd1")], env=_env(4),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    coord = f"localhost:{_free_port()}"
    procs = [subprocess.Popen(worker + [str(tmp_path / "multi.json"), str(tmp_path / "wd2"), coord, "2", str(i)],
                              env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    for p in [single] + procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out[-3000:]
    one = json.loads((tmp_path / "single.json").read_text())
    two = json.loads((tmp_path / "multi.json").read_text())
    assert (one["processes"], two["processes"]) == (1, 2)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert two["rates_sum"] == pytest.approx(one["rates_sum"], rel=1e-5)
    assert two["tokens"] == one["tokens"] and all(len(t) == 8 for t in one["tokens"])


def test_distributed_initialize_detects_clusters_and_checks_arguments():
    assert cluster_detected({}) is None
    assert cluster_detected({"TPU_WORKER_HOSTNAMES": "a,b"}) == "tpu"
    assert cluster_detected({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}) == "slurm"
    assert cluster_detected({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) is None
    assert initialize(env={}) == "single"
    with pytest.raises(ConfigError, match="needs num_processes and process_id"):
        initialize("localhost:1", env={})
    with pytest.raises(ConfigError, match="0 <= process_id < num_processes"):
        initialize("localhost:1", 2, 2, env={})
    with pytest.raises(ConfigError, match="need a coordinator"):
        initialize(None, 2, 0, env={})
    with pytest.raises(ConfigError, match="M2R2_PROCESS_ID|process_id='x'"):
        initialize(env={"M2R2_COORDINATOR": "localhost:1", "M2R2_NUM_PROCESSES": "2", "M2R2_PROCESS_ID": "x"})


def test_aot_check_of_a_tiny_model_reports_memory_and_fit():
    cfg = tiny_config("llama", vocab_size=64)
    plan = ShardingPlan.from_preset("train", mesh="fsdp=4,tensor=2")
    r = aot.check_train(cfg, plan, batch_size=8, seq_len=16, m2r2_cfg=M2R2Config(branch_layer=1, rate=2),
                        device_memory_bytes=aot.parse_bytes("1GiB"))
    assert r["program"] == "distill_step" and r["fits"] is True and r["argument_bytes"] > 0
    assert 0 < r["per_device_bytes"] < 1 << 30 and "lowered" not in r  # no --platform: compiled here only
    small = aot.check_generate(cfg, ShardingPlan.from_preset("specdec", mesh="data=2,tensor=4"), method="ar",
                               batch_size=2, prompt_len=8, max_new_tokens=4, device_memory_bytes=1024)
    assert small["program"] == "generate_ar" and small["fits"] is False
    with pytest.raises(ConfigError, match="not divisible by the 4 devices of the batch axes"):
        aot.check_train(cfg, plan, batch_size=6, seq_len=16)
    for text, n in [("16GiB", 16 << 30), ("80GB", 80 * 10 ** 9), ("512", 512)]:
        assert aot.parse_bytes(text) == n
    with pytest.raises(ConfigError, match="memory size"):
        aot.parse_bytes("lots")


def test_aot_check_cli_on_the_llama3_8b_presets(tmp_path):
    """The 8B presets compile for 8 devices and lower for TPU with the Pallas kernel inside; the
    weights really are split (an unsharded bf16 copy of Llama-3-8B is 16 GB; an eighth is 2 GB).
    --platform brings its own fake devices: the process starts with one."""
    out = tmp_path / "aot.json"
    r = subprocess.run([sys.executable, "-m", "m2r2_jax.cli.main", "aot-check", "--model=configs/models/llama3_8b.py",
                        "--m2r2=configs/m2r2/llama3_8b.py", "--program=both", "--mesh=tensor=8", "--batch_size=8",
                        "--seq_len=256", "--prompt_len=128", "--max_new_tokens=32", "--device_memory=95GiB",
                        "--platform=tpu", f"--out={out}"], cwd=ROOT, env=_env(1), capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    checks = json.loads(out.read_text())["checks"]
    train, gen = checks
    assert train["program"] == "distill_step" and "tensor=8" in train["sharding"] and train["fits"]
    assert gen["program"] == "generate_m2r2_spec" and gen["sharding"].startswith("specdec")
    for c in checks:
        assert 1.5 < c["argument_bytes"] / 2 ** 30 < 3.0, c  # ~16 GB of weights / 8 devices
        assert c["platform"] == "tpu" and c["lowered"] and c["custom_calls"].get("tpu_custom_call", 0) >= 2, c
        assert c["memory_analysis_by"] == "cpu compiler"
    bad = subprocess.run([sys.executable, "-m", "m2r2_jax.cli.main", "aot-check", "--model=configs/models/llama3_8b.py",
                          "--program=generate", "--mesh=tensor=3"], cwd=ROOT, env=_env(8), capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == ["m2r2: error: mesh data=1,fsdp=1,tensor=3,expert=1 needs 3 devices "
                                               "but 8 are available (cpu, 1 process(es))"]


@pytest.mark.parametrize("implementation", ["interpret", "auto"])
def test_fast_stream_update_runs_on_each_devices_rows(implementation):
    """Under a plan the fused update is split over the batch's devices: the TPU kernel of the exported
    program sees one device's rows (a custom call cannot be split by XLA), and on CPU the split
    update (the interpreted kernel body, or XLA) gives the unsplit values."""
    import re

    import numpy as np

    from m2r2_jax.kernels import residual_rate_update_reference
    from m2r2_jax.m2r2.fast_stream import _rate_update

    plan = ShardingPlan.from_preset("train", mesh="fsdp=4,tensor=2")
    B, T, d, R = 8, 16, 64, 4
    k = jax.random.split(jax.random.key(0), 5)
    g, u = (jax.random.normal(k[i], (B, T, d)) for i in range(2))
    rho, w = 1.0 + 0.1 * jax.random.normal(k[2], (2, d))
    z, b = jax.random.normal(k[3], (B, T, R)), 0.1 * jax.random.normal(k[4], (R, d))

    def update(g, u, rho, z, b, w):
        with plan.scope():
            return _rate_update(g, u, rho, z, b, 0.5, implementation, norm_weight=w)

    rows = plan.sharding(("batch", None, None))
    args = [jax.device_put(a, rows if a.ndim == 3 else plan.replicated) for a in (g, u, rho, z, b, w)]
    y, n = jax.jit(update)(*args)
    y_ref, n_ref = residual_rate_update_reference(g, u, rho, z, b, 0.5, w)
    np.testing.assert_allclose(y, y_ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(n, n_ref, rtol=2e-5, atol=2e-5)
    if implementation == "auto":
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in args]
        module = jax.export.export(jax.jit(update), platforms=["tpu"])(*specs).mlir_module()
        kernel_rows = {int(m) for m in re.findall(r"tpu_custom_call.*-> \(tensor<(\d+)x", module)}
        assert kernel_rows == {B // 4 * T}  # the batch is split over fsdp=4


def test_export_for_reports_a_program_that_does_not_lower():
    from m2r2_jax.kernels import residual_rate_update

    x = jax.ShapeDtypeStruct((16, 128), jax.numpy.float32)
    rho = jax.ShapeDtypeStruct((128,), jax.numpy.float32)
    fn = jax.jit(lambda x, u, rho: residual_rate_update(x, u, rho, implementation="pallas")[0])
    ok = aot.export_for(fn, (x, x, rho), "tpu")
    assert ok["lowered"] and ok["custom_calls"] == {"tpu_custom_call": 1}
    bad = aot.export_for(fn, (x, x, rho), "rocm")
    assert bad == {"platform": "rocm", "lowered": False, "lowering_error": "ConfigError: residual_rate_update: "
                   "implementation='pallas' needs a TPU or an NVIDIA GPU, but the program is for rocm; use 'auto' "
                   "or 'xla' (or 'interpret' for testing)"}
    with pytest.raises(ConfigError, match="platform='ipu' is invalid"):
        aot.export_for(fn, (x, x, rho), "ipu")


def test_jax_sees_eight_fake_devices():
    assert jax.device_count() == 8
