"""The fused residual-rate update: reference, Pallas TPU and GPU backends, and the differentiable op."""

from .op import IMPLEMENTATIONS, KernelFallbackWarning, residual_rate_update, select_backend
from .reference import residual_rate_update_reference

__all__ = ["IMPLEMENTATIONS", "KernelFallbackWarning", "residual_rate_update", "residual_rate_update_reference",
           "select_backend"]
