"""Shared inputs and tolerances for the residual-rate kernel tests."""

import jax
import jax.numpy as jnp
import numpy as np

F32, BF16 = jnp.float32, jnp.bfloat16

# Forward tolerance by output dtype: f32 kernels differ from XLA only by summation order; bf16
# outputs may differ by one rounding step (2^-8 relative) where an f32 intermediate sits on a tie.
FWD_TOL = {F32: dict(rtol=2e-5, atol=2e-5), BF16: dict(rtol=2 ** -7, atol=2 ** -7)}
# Gradient tolerance, relative to the largest reference gradient: the kernel's backward runs in f32,
# the bf16 reference's autodiff rounds every cotangent to bf16.
GRAD_TOL = {F32: 2e-5, BF16: 3e-2}


def make_inputs(lead, d, rank, dtype, *, seed=0, norm=True, rho_dtype=F32):
    """Random (x, u, rho, z, B, w) with realistic scales: rho around the rate r=2, small adapters."""
    k = jax.random.split(jax.random.key(seed), 6)
    shape = tuple(lead) + (d,)
    x = jax.random.normal(k[0], shape, F32).astype(dtype)
    u = (0.5 * jax.random.normal(k[1], shape, F32)).astype(dtype)
    rho = (2.0 + 0.3 * jax.random.normal(k[2], (d,), F32)).astype(rho_dtype)
    w = (1.0 + 0.1 * jax.random.normal(k[3], (d,), F32)).astype(dtype) if norm else None
    z = jax.random.normal(k[4], tuple(lead) + (rank,), F32).astype(dtype) if rank else None
    B = (0.2 * jax.random.normal(k[5], (rank, d), F32)).astype(dtype) if rank else None
    return x, u, rho, z, B, w


def assert_close(actual, expected, dtype):
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a, e = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert np.isfinite(a).all(), "non-finite output (an unwritten, NaN-poisoned element?)"
    np.testing.assert_allclose(a, e, **FWD_TOL[dtype])


def assert_grads_close(got, want, dtype, names):
    for name, g, r in zip(names, got, want):
        assert g.dtype == r.dtype, (name, g.dtype, r.dtype)
        g32, r32 = np.asarray(g, np.float32), np.asarray(r, np.float32)
        err = np.abs(g32 - r32).max() / max(np.abs(r32).max(), 1e-6)
        assert err <= GRAD_TOL[dtype], f"d{name}: relative error {err:.2e} > {GRAD_TOL[dtype]:.0e}"
