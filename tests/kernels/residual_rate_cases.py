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


# (rows, d, rank, dtype, block_rows, with norm): T ragged w.r.t. the block, d from 64 to 4096,
# rank 0 and 4..64, both dtypes; big d gets few rows because interpret mode is slow.
FORWARD_CASES = [
    (37, 64, 0, F32, 8, True),
    (37, 64, 4, BF16, 16, True),
    (50, 256, 16, F32, 16, False),
    (19, 512, 64, BF16, 16, True),
    (24, 1024, 8, F32, 16, True),
    (11, 4096, 64, BF16, 8, True),
    (6, 4096, 0, F32, None, True),
]

# (leading dims, d, rank, dtype, block_rows); the f32 tolerance is tight enough to pin the hand-written
# backward formula, not just bf16-level agreement.
GRAD_CASES = [((21,), 64, 0, F32, 8), ((3, 7), 128, 4, F32, 8), ((13,), 256, 16, BF16, 16),
              ((5,), 512, 64, F32, None)]


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
