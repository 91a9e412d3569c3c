"""The TPU and GPU kernels on a CPU-only machine, executed in Pallas' TPU / GPU interpreters, which
simulate the device's memory spaces, start from NaN-filled buffers (unwritten outputs stay NaN) and
check for data races. Their lowering for the real targets (Mosaic TPU, Mosaic GPU) is pinned through
the public op in test_residual_rate_export.py."""

import jax.numpy as jnp
import pytest
from jax.experimental.pallas import tpu as pltpu

from residual_rate_cases import BF16, F32, assert_close, make_inputs

from m2r2_jax.kernels import residual_rate_update_reference
from m2r2_jax.kernels.residual_rate import pallas_gpu, pallas_tpu

SCALE, EPS = 0.5, 1e-6

try:  # the GPU interpreter is private API in this JAX version
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except ImportError:  # pragma: no cover - depends on the installed JAX
    gpu_interpret = None


def test_tpu_kernel_in_tpu_interpret_mode():
    x, u, rho, z, B, w = make_inputs((37,), 256, 4, BF16)
    y, n = pallas_tpu.fused_update(x, u, rho, z, B, w, scale=SCALE, eps=EPS, block_rows=16,
                                   interpret=pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan"))
    y_ref, n_ref = residual_rate_update_reference(x, u, rho, z, B, SCALE, w, EPS)
    assert_close(y, y_ref, BF16)
    assert_close(n, n_ref, BF16)


@pytest.mark.skipif(gpu_interpret is None, reason="this JAX has no Mosaic GPU interpreter")
@pytest.mark.parametrize("T,d,rank,dtype,norm", [(70, 256, 4, BF16, True), (5, 128, 16, F32, True),
                                                 (64, 64, 0, F32, False)])
def test_gpu_kernel_in_gpu_interpret_mode(T, d, rank, dtype, norm):
    x, u, rho, z, B, w = make_inputs((T,), d, rank, dtype, norm=norm)
    y, n = pallas_gpu.fused_update(x, u, rho, z, B, w, scale=SCALE, eps=EPS,
                                   interpret=InterpretGPUParams(detect_races=True, uninitialized_memory="nan"))
    assert not gpu_interpret.get_races().races_found
    y_ref, n_ref = residual_rate_update_reference(x, u, rho, z, B, SCALE, w, EPS)
    assert_close(y, y_ref, dtype)
    if norm:
        assert_close(n, n_ref, dtype)
    else:
        assert n is None


def test_gpu_kernel_rejects_shapes_it_cannot_take():
    assert pallas_gpu.unsupported_reason(8, 96, 4, F32, 64).startswith("d=96")
    assert "rank 65" in pallas_gpu.unsupported_reason(8, 128, 65, F32, 64)
    assert pallas_gpu.unsupported_reason(8, 128, 4, jnp.float16, 64).startswith("dtype float16")
    x, u, rho, _, _, _ = make_inputs((8,), 96, 0, F32)
    with pytest.raises(ValueError, match="GPU kernel cannot run: d=96"):
        pallas_gpu.fused_update(x, u, rho, None, None, None, scale=1.0, eps=EPS)
