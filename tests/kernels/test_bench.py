"""kernels/bench.py: the CPU run checks correctness only (no timings); the device path's XLA and
roofline columns, and its report of a shape the kernel cannot take; the device checks and the
in-program timing, run here on the interpreted kernel."""

import json

import jax.numpy as jnp
import pytest

from m2r2_jax.kernels import bench


def test_cpu_run_is_correctness_only_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    report = bench.main(["--d", "64", "--rank", "4", "--decode-rows", "1", "--train-rows", "4096",
                         "--out", str(out)])
    printed = capsys.readouterr().out
    assert "correctness only" in printed and "no timings" in printed
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(report))
    assert saved["platform"] == "cpu"
    assert [r["rows"] for r in saved["results"]] == [1, bench.CPU_MAX_ROWS]  # 4096 clipped
    assert all(r["ok"] for r in saved["results"])
    assert not any(k.endswith("_s") for r in saved["results"] for k in r)  # no timings at all


def test_device_path_measures_xla_and_reports_unavailable_kernel():
    # On CPU `implementation="pallas"` cannot run, so the kernel column is empty with the reason.
    report = bench.run_device([1, 4096], 64, 4, jnp.float32, iters=3, copy_mib=1)
    assert report["mode"] == "timing" and report["copy_bandwidth_gbs"] > 0
    for r in report["results"]:
        assert r["kernel_s"] is None and "needs a TPU or an NVIDIA GPU" in r["kernel_unavailable"]
        assert r["xla_s"] >= 0 and r["loop_step_s"] >= 0
        assert r["roofline_s"] == pytest.approx(r["bytes"] / (report["copy_bandwidth_gbs"] * 1e9))
    # a 1 MB update per step is well above timer noise: the in-program time is measured, not clipped
    assert report["results"][1]["xla_s"] > 0
    assert report["results"][0]["bytes"] == bench.bytes_moved(1, 64, 4, jnp.float32)


def test_bad_flags_exit_with_usage_error():
    with pytest.raises(SystemExit) as e:
        bench.main(["--decode-rows", "1,x"])
    assert e.value.code == 2


def test_device_checks_compare_forward_and_gradients():
    # the GPU/TPU check path, on the interpreted kernel: every case within tolerance, and a kernel
    # that gets the update wrong is caught
    results = [bench.check_case(*case, implementation="interpret") for case in bench.CHECK_CASES[:3]]
    assert all(r["ok"] and r["backend"] == "interpret" for r in results)
    assert all(0 <= r["fwd_rel_err"] <= 2e-5 for r in results if r["dtype"] == "float32")


def test_device_checks_report_a_wrong_kernel(monkeypatch):
    from m2r2_jax.kernels.residual_rate import op as op_module

    real = op_module._forward_kernel

    def off_by_a_bit(*args):
        y, n = real(*args)
        return y * 1.01, n
    monkeypatch.setattr(op_module, "_forward_kernel", off_by_a_bit)
    op_module._kernel_op.cache_clear()
    try:
        r = bench.check_case(5, 128, 16, "float32", True, implementation="interpret")
    finally:
        op_module._kernel_op.cache_clear()
    assert not r["ok"] and r["fwd_rel_err"] > 1e-3


def test_chained_program_applies_the_op_k_times():
    args = bench._inputs(4, 64, 0, jnp.float32)
    x, u, rho, _, _, w = args
    # the loop feeds y back as x and n back as u: check against three plain applications
    got_x, got_u = bench.chained(bench._op("xla", 0.5), 3)(*args)
    for _ in range(3):
        x, u = bench.residual_rate_update_reference(x, u, rho, None, None, 0.5, w)
    assert jnp.allclose(got_x, x, rtol=1e-5, atol=1e-5) and jnp.allclose(got_u, u, rtol=1e-5, atol=1e-5)
