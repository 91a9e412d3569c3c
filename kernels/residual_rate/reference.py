"""Pure-XLA reference of the fused residual-rate update (the semantics every backend must match).

    y = x + rho * (u + scale * (z @ B))      computed in float32, returned in x's dtype
    n = RMSNorm(y) * norm_weight              the next sub-block's pre-norm, on the rounded y

The norm follows the project's convention (`m2r2_jax.models.layers.rms_norm`): normalise in float32,
cast to the input dtype, then multiply by the weight in that dtype. It is applied to y *after* y is
rounded to x's dtype, so `n` is exactly what the unfused code (`rms_norm(y, w)`) would produce.

This module is also the implementation used on CPU: XLA fuses it into one loop, and plain autodiff
gives its gradients.
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp

Array = jax.Array
F32 = jnp.float32


def low_rank_term(z: Array, B: Array) -> Array:
    """z @ B with float32 accumulation; f32 operands at full precision (no bf16 passes on TPU/GPU)."""
    ct = jnp.promote_types(z.dtype, B.dtype)
    precision = jax.lax.Precision.HIGHEST if ct == F32 else None
    return jnp.einsum("...r,rd->...d", z.astype(ct), B.astype(ct), precision=precision,
                      preferred_element_type=F32)


def rms_norm_rows(y: Array, weight: Array, eps: float) -> Array:
    """RMSNorm over the last axis, the project's convention (f32 statistics, weight applied in y's dtype)."""
    y32 = y.astype(F32)
    normed = (y32 * jax.lax.rsqrt(jnp.mean(y32 * y32, axis=-1, keepdims=True) + eps)).astype(y.dtype)
    return weight.astype(y.dtype) * normed


def residual_rate_update_reference(x: Array, u: Array, rho: Array, z: Optional[Array] = None,
                                   B: Optional[Array] = None, scale: float = 1.0,
                                   norm_weight: Optional[Array] = None,
                                   eps: float = 1e-6) -> Tuple[Array, Optional[Array]]:
    """The residual-rate update in plain jax.numpy; see the module docstring for the exact semantics."""
    delta = u.astype(F32)
    if z is not None:
        delta = delta + scale * low_rank_term(z, B)
    y = (x.astype(F32) + rho.astype(F32) * delta).astype(x.dtype)
    n = None if norm_weight is None else rms_norm_rows(y, norm_weight, eps)
    return y, n
