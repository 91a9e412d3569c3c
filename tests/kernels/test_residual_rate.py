"""The fused residual-rate update: reference semantics, the Pallas kernel in interpret mode against
the reference (forward with NaN-poisoned outputs, and gradients), dispatch, jit/vmap."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from residual_rate_cases import BF16, F32, FORWARD_CASES, GRAD_CASES, assert_close, assert_grads_close, make_inputs

from m2r2_jax.errors import ConfigError
from m2r2_jax.kernels import KernelFallbackWarning, residual_rate_update, residual_rate_update_reference
from m2r2_jax.kernels.residual_rate import op as op_module
from m2r2_jax.kernels.residual_rate import pallas_gpu, pallas_tpu
from m2r2_jax.models.layers import rms_norm

SCALE, EPS = 0.5, 1e-6


# ---------------------------------------------------------------- reference semantics


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_reference_matches_unfused_definition(dtype):
    x, u, rho, z, B, w = make_inputs((3, 5), 64, 8, dtype)
    y, n = residual_rate_update_reference(x, u, rho, z, B, SCALE, w, EPS)
    f32 = lambda a: a.astype(F32)  # noqa: E731
    y_want = (f32(x) + f32(rho) * (f32(u) + SCALE * jnp.einsum("...r,rd->...d", f32(z), f32(B)))).astype(dtype)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_want, np.float32))
    # n is exactly the project's RMSNorm of the rounded y.
    np.testing.assert_array_equal(np.asarray(n, np.float32), np.asarray(rms_norm(y, w, EPS), np.float32))
    assert y.dtype == n.dtype == dtype


def test_reference_without_optional_terms():
    x, u, rho, _, _, _ = make_inputs((4,), 32, 0, F32, norm=False)
    y, n = residual_rate_update_reference(x, u, rho)
    np.testing.assert_allclose(y, x + rho * u, rtol=1e-6)
    assert n is None


# ---------------------------------------------------------------- kernel forward (interpret mode)

@pytest.mark.parametrize("T,d,rank,dtype,block_rows,norm", FORWARD_CASES)
def test_kernel_forward_matches_reference_poisoned(T, d, rank, dtype, block_rows, norm):
    x, u, rho, z, B, w = make_inputs((T,), d, rank, dtype, seed=T + d, norm=norm)
    rows = block_rows or pallas_tpu.choose_block_rows(T, d, rank, dtype, norm)
    nan = jnp.full((T, d), jnp.nan, dtype)
    y, n = pallas_tpu.fused_update(x, u, rho, z, B, w, scale=SCALE, eps=EPS, block_rows=rows, interpret=True,
                                   out_init=(nan, nan) if norm else (nan,))
    y_ref, n_ref = residual_rate_update_reference(x, u, rho, z, B, SCALE, w, EPS)
    assert_close(y, y_ref, dtype)
    if norm:
        assert_close(n, n_ref, dtype)
    else:
        assert n is None


def test_poisoning_catches_unwritten_rows():
    """The harness itself: an output block the kernel skips keeps the NaN it was aliased to."""
    def write_first_block_only(x_ref, init_ref, o_ref):
        del init_ref

        @pl.when(pl.program_id(0) == 0)
        def _():
            o_ref[...] = x_ref[...]

    x = jnp.ones((16, 128), F32)
    out = pl.pallas_call(write_first_block_only, grid=(2,),
                         in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0)), pl.BlockSpec(memory_space=pl.ANY)],
                         out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                         out_shape=jax.ShapeDtypeStruct(x.shape, F32), input_output_aliases={1: 0},
                         interpret=True)(x, jnp.full_like(x, jnp.nan))
    assert np.isfinite(np.asarray(out[:8])).all() and np.isnan(np.asarray(out[8:])).all()


def test_op_interpret_leading_dims_and_mixed_dtypes():
    # [batch, T, d] activations in bf16 with an f32 rate vector (the fast stream's usual mix).
    x, u, rho, z, B, w = make_inputs((2, 9), 128, 4, BF16)
    y, n = residual_rate_update(x, u, rho, z, B, SCALE, w, EPS, implementation="interpret", block_rows=16)
    y_ref, n_ref = residual_rate_update_reference(x, u, rho, z, B, SCALE, w, EPS)
    assert y.shape == n.shape == x.shape
    assert_close(y, y_ref, BF16)
    assert_close(n, n_ref, BF16)


# ---------------------------------------------------------------- gradients

def _loss(implementation, block_rows, x, u, rho, z, B, w):
    y, n = residual_rate_update(x, u, rho, z, B, SCALE, w, EPS, implementation=implementation,
                                block_rows=block_rows)
    # Fixed, position-dependent cotangents so every element's gradient path is exercised.
    cy = jnp.cos(jnp.arange(y.size, dtype=F32)).reshape(y.shape)
    cn = jnp.sin(jnp.arange(n.size, dtype=F32)).reshape(n.shape)
    return jnp.sum(y.astype(F32) * cy) + jnp.sum(n.astype(F32) * cn)


@pytest.mark.parametrize("lead,d,rank,dtype,block_rows", GRAD_CASES)
def test_kernel_gradients_match_reference(lead, d, rank, dtype, block_rows):
    args = make_inputs(lead, d, rank, dtype, seed=7 * d)
    names = ["x", "u", "rho", "z", "B", "w"]
    argnums = tuple(i for i, a in enumerate(args) if a is not None)
    got = jax.grad(lambda *a: _loss("interpret", block_rows, *a), argnums=argnums)(*args)
    want = jax.grad(lambda *a: _loss("xla", None, *a), argnums=argnums)(*args)
    assert_grads_close(got, want, dtype, [names[i] for i in argnums])


def test_gradients_without_norm():
    x, u, rho, z, B, _ = make_inputs((10,), 64, 4, F32)

    def loss(impl, *a):
        y, n = residual_rate_update(*a, scale=SCALE, implementation=impl, block_rows=8)
        assert n is None
        return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=F32)).reshape(y.shape))

    got = jax.grad(lambda *a: loss("interpret", *a), argnums=tuple(range(5)))(x, u, rho, z, B)
    want = jax.grad(lambda *a: loss("xla", *a), argnums=tuple(range(5)))(x, u, rho, z, B)
    assert_grads_close(got, want, F32, "x u rho z B".split())


# ---------------------------------------------------------------- jit / vmap / dispatch


@pytest.mark.parametrize("implementation", ["interpret", "xla", "auto"])
def test_jit_and_vmap(implementation):
    x, u, rho, z, B, w = make_inputs((3, 10), 64, 4, F32)
    f = jax.jit(lambda x, u, z: residual_rate_update(x, u, rho, z, B, SCALE, w, EPS, implementation=implementation,
                                                     block_rows=8 if implementation == "interpret" else None))
    y_v, n_v = jax.vmap(f)(x, u, z)
    for b in range(3):
        y_r, n_r = residual_rate_update_reference(x[b], u[b], rho, z[b], B, SCALE, w, EPS)
        assert_close(y_v[b], y_r, F32)
        assert_close(n_v[b], n_r, F32)


def test_auto_on_cpu_is_xla_without_warning():
    x, u, rho, z, B, w = make_inputs((4,), 64, 4, F32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert op_module.select_backend("auto", 4, 64, 4, F32, True) == ("xla", None)
        y, _ = residual_rate_update(x, u, rho, z, B, SCALE, w)
    np.testing.assert_array_equal(y, residual_rate_update_reference(x, u, rho, z, B, SCALE, w)[0])


def test_forced_pallas_on_cpu_raises_clear_error():
    x, u, rho, _, _, _ = make_inputs((4,), 64, 0, F32)
    with pytest.raises(ConfigError, match="needs a TPU or an NVIDIA GPU"):
        residual_rate_update(x, u, rho, implementation="pallas")


def test_unknown_implementation_raises():
    x, u, rho, _, _, _ = make_inputs((4,), 64, 0, F32)
    with pytest.raises(ConfigError, match="allowed: auto, xla, pallas, interpret"):
        residual_rate_update(x, u, rho, implementation="triton")


@pytest.mark.parametrize("platform,d,rank", [("tpu", 1 << 20, 0), ("gpu", 1056, 4), ("gpu", 1024, 128)])
def test_auto_falls_back_with_warning_when_kernel_cannot_take_shape(monkeypatch, platform, d, rank):
    monkeypatch.setattr(op_module, "_platform", lambda: platform)
    rows = op_module.GPU_AUTO_MIN_ROWS  # a size where "auto" on a GPU wants the kernel
    with pytest.warns(KernelFallbackWarning, match="using the XLA reference"):
        assert op_module.select_backend("auto", rows, d, rank, F32, True) == ("xla", None)
    with pytest.raises(ConfigError, match="cannot run"):
        op_module.select_backend("pallas", rows, d, rank, F32, True)


def test_forced_tpu_block_rows_must_fit_the_tile(monkeypatch):
    monkeypatch.setattr(op_module, "_platform", lambda: "tpu")
    assert op_module.select_backend("pallas", 100, 128, 0, BF16, True, block_rows=32) == ("tpu", 32)
    with pytest.raises(ConfigError, match="not a multiple of the TPU tile's 16 rows"):
        op_module.select_backend("pallas", 100, 128, 0, BF16, True, block_rows=24)


@pytest.mark.parametrize("platform,chooser", [("tpu", pallas_tpu.choose_block_rows),
                                               ("gpu", pallas_gpu.choose_block_rows)])
def test_auto_picks_the_platform_kernel(monkeypatch, platform, chooser):
    monkeypatch.setattr(op_module, "_platform", lambda: platform)
    rows = chooser(16384, 1024, 16, BF16, True)
    assert rows is not None
    assert op_module.select_backend("auto", 16384, 1024, 16, BF16, True) == (platform, rows)


@pytest.mark.parametrize("n_rows,d", [(1, 4096), (5, 192), (4096, 4096), (op_module.GPU_AUTO_MIN_ROWS, 192)])
def test_auto_on_gpu_keeps_xla_where_it_measured_faster(monkeypatch, recwarn, n_rows, d):
    # decode-sized and narrow calls: XLA's fused update beat the kernel on an H200; not a fallback
    monkeypatch.setattr(op_module, "_platform", lambda: "gpu")
    assert op_module.select_backend("auto", n_rows, d, 8, BF16, True) == ("xla", None)
    assert not [w for w in recwarn if issubclass(w.category, KernelFallbackWarning)]
    assert op_module.select_backend("pallas", n_rows, d, 8, BF16, True) == ("gpu", pallas_gpu.BLOCK_ROWS)
    assert op_module.select_backend("auto", op_module.GPU_AUTO_MIN_ROWS, 4096, 8, BF16, True)[0] == "gpu"


def test_block_rows_fit_vmem_budget():
    for d, rank, dtype in [(64, 0, F32), (4096, 64, BF16), (4096, 16, F32), (8192, 64, F32)]:
        rows = pallas_tpu.choose_block_rows(100_000, d, rank, dtype, True)
        assert rows >= pallas_tpu.sublane_multiple(dtype) and rows & (rows - 1) == 0
        assert pallas_tpu.choose_block_rows(rows - 3, d, rank, dtype, True) == rows - 3  # one full block
    assert pallas_tpu.choose_block_rows(100, 1 << 20, 0, F32, True) is None


@pytest.mark.parametrize("bad,match", [
    (dict(u=jnp.zeros((4, 32))), "u has shape"),
    (dict(rho=jnp.zeros((32, 1))), "rho has shape"),
    (dict(z=jnp.zeros((4, 2))), "z and B must be given together"),
    (dict(z=jnp.zeros((4, 2)), B=jnp.zeros((3, 64))), r"B has shape \(3, 64\), expected \(2, 64\)"),
    (dict(norm_weight=jnp.zeros((63,))), "norm_weight has shape"),
    (dict(x=jnp.zeros((4, 64), jnp.int32)), "x must be floating point"),
])
def test_bad_arguments_name_the_problem(bad, match):
    args = dict(x=jnp.zeros((4, 64)), u=jnp.zeros((4, 64)), rho=jnp.zeros((64,)))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        residual_rate_update(**args)
