"""kernels/bench.py: the CPU run checks correctness only (no timings); the device path's XLA and
roofline columns, and its report of a shape the kernel cannot take."""

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
    report = bench.run_device([1, 64], 64, 4, jnp.float32, iters=2, copy_mib=1)
    assert report["mode"] == "timing" and report["copy_bandwidth_gbs"] > 0
    for r in report["results"]:
        assert r["kernel_s"] is None and "needs a TPU or GPU" in r["kernel_unavailable"]
        assert r["xla_s"] > 0 and r["roofline_s"] == pytest.approx(r["bytes"] / (report["copy_bandwidth_gbs"] * 1e9))
    assert report["results"][0]["bytes"] == bench.bytes_moved(1, 64, 4, jnp.float32)


def test_bad_flags_exit_with_usage_error():
    with pytest.raises(SystemExit) as e:
        bench.main(["--decode-rows", "1,x"])
    assert e.value.code == 2
