"""The public op exported for TPU and for CUDA on a CPU-only machine (`jax.export`, the way an
ahead-of-time build or a serving bundle is made): the target platform, not the platform JAX runs on,
decides which kernel a program holds. Mosaic's lowering rejects block shapes a TPU cannot tile, so
these exports catch what interpret mode cannot; where a kernel cannot take a shape on a platform,
`auto` falls back there (warning when that platform is lowered) and `pallas` refuses."""

import math
import re
import warnings

import jax
import jax.numpy as jnp
import pytest

from residual_rate_cases import BF16, F32, FORWARD_CASES, GRAD_CASES, make_inputs

from m2r2_jax.errors import ConfigError
from m2r2_jax.kernels import KernelFallbackWarning, residual_rate_update
from m2r2_jax.kernels.residual_rate import op as op_module

SCALE, EPS = 0.5, 1e-6
KERNEL_CALL = {"tpu": "tpu_custom_call", "cuda": "mosaic_gpu_v2"}
PLATFORMS = tuple(KERNEL_CALL)

# Every shape the interpret-mode tests run (forward and gradient cases), plus training-sized calls
# where `auto` on a GPU takes the kernel.
SHAPES = sorted({((T,), d, rank, dtype, norm) for T, d, rank, dtype, _, norm in FORWARD_CASES}
                | {(lead, d, rank, dtype, True) for lead, d, rank, dtype, _ in GRAD_CASES}
                | {((16384,), 1024, 16, BF16, True), ((2, 8192), 4096, 64, BF16, True)},
                key=repr)


def _update(implementation, block_rows=None):
    def f(x, u, rho, z, B, w):
        return residual_rate_update(x, u, rho, z, B, SCALE, w, EPS, implementation=implementation,
                                    block_rows=block_rows)
    return f


def _grad(implementation, block_rows=None):
    f = _update(implementation, block_rows)

    def loss(x, u, rho, z, B, w):
        y, n = f(x, u, rho, z, B, w)
        return jnp.sum(y.astype(F32)) + (0.0 if n is None else jnp.sum(jnp.square(n.astype(F32))))
    return jax.grad(loss, argnums=(0, 1, 2))


def _custom_calls(fn, args, platform) -> set:
    specs = [None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]  # values unused
    module = jax.export.export(jax.jit(fn), platforms=[platform])(*specs).mlir_module()
    return set(re.findall(r"custom_call @(\w+)", module))


def _abstract_inputs(lead, d, rank, dtype, norm):
    # Shapes only: export never touches values, so big training shapes cost nothing to build.
    return jax.eval_shape(lambda: make_inputs(lead, d, rank, dtype, norm=norm))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("lead,d,rank,dtype,norm", SHAPES)
def test_pallas_exports_the_platform_kernel_forward_and_gradient(platform, lead, d, rank, dtype, norm):
    args = _abstract_inputs(lead, d, rank, dtype, norm)
    other = KERNEL_CALL["cuda" if platform == "tpu" else "tpu"]
    for program in (_update("pallas"), _grad("pallas")):
        calls = _custom_calls(program, args, platform)
        assert KERNEL_CALL[platform] in calls and other not in calls, calls


@pytest.mark.parametrize("lead,d,rank,dtype,norm", SHAPES)
def test_auto_exports_the_kernel_where_it_chose_it(lead, d, rank, dtype, norm, recwarn):
    args = _abstract_inputs(lead, d, rank, dtype, norm)
    n_rows = math.prod(lead)
    for platform, backend in op_module.KERNEL_PLATFORMS.items():
        chosen = op_module.choose("auto", backend, n_rows, d, rank, dtype, norm)
        assert chosen.reason is None  # every tested shape is one the kernels can take
        calls = _custom_calls(_update("auto"), args, platform)
        assert (KERNEL_CALL[platform] in calls) == (chosen.backend != "xla"), (platform, chosen, calls)
    assert not [w for w in recwarn if issubclass(w.category, KernelFallbackWarning)]


def test_cpu_program_holds_no_kernel_and_stays_silent():
    args = make_inputs((64,), 256, 8, F32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _custom_calls(_update("auto"), args, "cpu")
        assert not _custom_calls(_grad("auto"), args, "cpu")


# (platform, shape, why the kernel cannot take it): auto falls back only there, pallas refuses there.
UNLOWERABLE = [
    ("tpu", ((8,), 1 << 20, 0, F32), "fits the TPU kernel's 8 MiB VMEM budget"),
    ("cuda", ((op_module.GPU_AUTO_MIN_ROWS,), 1056, 4, BF16), "not a multiple of 64"),
    ("cuda", ((op_module.GPU_AUTO_MIN_ROWS,), 1024, 128, BF16), "rank 128 > 64"),
    ("cuda", ((op_module.GPU_AUTO_MIN_ROWS,), 1024, 8, jnp.float16), "dtype float16"),
]


@pytest.mark.parametrize("platform,shape,why", UNLOWERABLE)
def test_auto_falls_back_on_the_platform_that_cannot_take_the_shape(platform, shape, why):
    args = _abstract_inputs(*shape, True)
    with pytest.warns(KernelFallbackWarning, match=f"XLA reference on {platform}: .*{re.escape(why)}"):
        assert not _custom_calls(_update("auto"), args, platform)
    with pytest.raises(ConfigError, match=f"'pallas' cannot run on {platform}: .*{re.escape(why)}"):
        _custom_calls(_update("pallas"), args, platform)
    with warnings.catch_warnings():  # tracing that branch for another platform does not warn
        warnings.simplefilter("error")
        _custom_calls(_update("auto"), args, "cpu")


def test_misaligned_tpu_block_is_refused_at_tpu_lowering_only():
    # bf16 packs 16 rows per TPU tile: a forced 8-row block runs in interpret mode but not on a TPU.
    args = make_inputs((37,), 128, 4, BF16)
    assert KERNEL_CALL["tpu"] in _custom_calls(_update("pallas", block_rows=16), args, "tpu")
    with pytest.raises(ConfigError, match="not a multiple of the TPU tile's 16 rows"):
        _custom_calls(_update("pallas", block_rows=8), args, "tpu")
    _custom_calls(_update("interpret", block_rows=8), args, "tpu")  # the interpreter has no tiles


@pytest.mark.parametrize("platform", ["cpu", "rocm"])
def test_pallas_is_refused_where_no_kernel_exists(platform):
    args = make_inputs((16,), 128, 4, F32)
    with pytest.raises(ConfigError, match=f"needs a TPU or an NVIDIA GPU, but the program is for {platform}"):
        _custom_calls(_update("pallas"), args, platform)


def test_export_does_not_leak_into_later_runs_on_this_machine():
    # The same jitted function exported for TPU, then run here: the CPU program takes XLA's path.
    args = make_inputs((40,), 128, 4, F32)
    fn = jax.jit(_update("auto"))
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    assert "tpu_custom_call" in jax.export.export(fn, platforms=["tpu"])(*specs).mlir_module()
    y, n = fn(*args)
    y_ref, n_ref = jax.jit(_update("xla"))(*args)
    assert (y == y_ref).all() and (n == n_ref).all()
