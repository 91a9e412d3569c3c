"""Pallas kernels of m2r2_jax (installed as `m2r2_jax.kernels`). Depends only on jax."""

from .residual_rate import KernelFallbackWarning, residual_rate_update, residual_rate_update_reference

__all__ = ["KernelFallbackWarning", "residual_rate_update", "residual_rate_update_reference"]
