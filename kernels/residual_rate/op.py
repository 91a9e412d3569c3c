"""Public op: the fused residual-rate update with a custom VJP and an `implementation=` switch.

    y, n = residual_rate_update(x, u, rho, z, B, scale, norm_weight, eps, implementation)
    y = x + rho * (u + scale * (z @ B));   n = RMSNorm(y) * norm_weight (or None)

Implementations:
  "xla"        the pure-XLA reference (plain autodiff); the fast path on CPU.
  "pallas"     the Pallas kernel of the target platform (Mosaic TPU or Mosaic GPU on CUDA); raises
               ConfigError where no kernel exists (CPU, ROCm) or the kernel cannot take the shape.
  "interpret"  the TPU kernel body run by Pallas' interpreter (any platform; slow, for tests).
  "auto"       the kernel on TPU/GPU when it can take the shape, else XLA (with a KernelFallbackWarning
               on TPU/GPU; silently on CPU, where XLA is the intended path). On a GPU only for
               training-sized calls (>= GPU_AUTO_MIN_ROWS rows of >= GPU_AUTO_MIN_D): below that XLA
               measured faster.

The target platform is the one the program is *lowered* for, not the one JAX runs on: the op stages
one branch per platform with `jax.lax.platform_dependent`, and lowering keeps only the target's. So
`jax.export.export(jax.jit(f), platforms=["tpu"])` on a CPU holds the Mosaic TPU kernel, and the
fallback warning or the "pallas" error is raised when (and only when) the program is lowered for a
platform that cannot take the call. A single export for several platforms at once is not possible
with a kernel inside: Pallas lowers a kernel for one platform per module.

Kernel paths run the forward pass as one pallas_call; the backward pass is plain XLA (a few fused
elementwise loops, two thin matmuls and row reductions), so every path is reverse-differentiable and
works under jit, vmap and grad. `scale` and `eps` are static Python numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from m2r2_jax.errors import ConfigError

from . import pallas_gpu, pallas_tpu
from .reference import F32, low_rank_term, residual_rate_update_reference

Array = jax.Array
IMPLEMENTATIONS = ("auto", "xla", "pallas", "interpret")

# "auto" on a GPU takes the Mosaic GPU kernel only for at least this many rows of at least this width.
# Measured on an H200 (docs/RESULTS.md, "On an NVIDIA H200"), bf16, d=4096: at 16,384 rows the
# kernel ran 1.19x faster than XLA; at 4,096 rows (64 row blocks for 132 multiprocessors, half of
# them idle) and at decode sizes it was slower, and at d=192 it was slower at every row count
# measured (1 to 4,096). A kernel call also ends XLA's fusion of the update with its neighbours,
# which at decode sizes costs more than the update itself. 8,192 rows = 128 row blocks, one wave.
GPU_AUTO_MIN_ROWS = 8192
GPU_AUTO_MIN_D = 1024


class KernelFallbackWarning(UserWarning):
    """`implementation="auto"` wanted a kernel but used the XLA reference (the message says why)."""


def _static_number(name: str, value) -> float:
    try:
        return float(value)
    except (TypeError, jax.errors.ConcretizationTypeError):
        raise ValueError(f"residual_rate_update: {name} must be a static Python number, "
                         f"got {type(value).__name__}") from None


def _check_args(x, u, rho, z, B, norm_weight) -> None:
    def fail(msg):
        raise ValueError(f"residual_rate_update: {msg}")

    if x.ndim < 1:
        fail(f"x must have a feature axis, got shape {x.shape}")
    d = x.shape[-1]
    for name, a in (("x", x), ("u", u), ("rho", rho), ("z", z), ("B", B), ("norm_weight", norm_weight)):
        if a is not None and not jnp.issubdtype(a.dtype, jnp.floating):
            fail(f"{name} must be floating point, got {a.dtype}")
    if u.shape != x.shape:
        fail(f"u has shape {u.shape}, expected x's shape {x.shape}")
    if rho.shape != (d,):
        fail(f"rho has shape {rho.shape}, expected ({d},)")
    if norm_weight is not None and norm_weight.shape != (d,):
        fail(f"norm_weight has shape {norm_weight.shape}, expected ({d},)")
    if (z is None) != (B is None):
        fail("z and B must be given together (or both None)")
    if z is not None:
        if z.shape[:-1] != x.shape[:-1] or z.ndim != x.ndim:
            fail(f"z has shape {z.shape}, expected {x.shape[:-1]} + (R,)")
        if B.shape != (z.shape[-1], d):
            fail(f"B has shape {B.shape}, expected ({z.shape[-1]}, {d})")


def _platform() -> str:
    """'tpu', 'gpu' or 'cpu': the platform JAX runs on by default (used by `select_backend`)."""
    return jax.default_backend()


# Lowering platforms (jax.lax.platform_dependent's names) that have a kernel, and that kernel's backend.
KERNEL_PLATFORMS = {"tpu": "tpu", "cuda": "gpu"}


@dataclasses.dataclass(frozen=True)
class Choice:
    """What one platform runs for a call: a kernel backend with its row block, or XLA, and why XLA."""

    backend: str                  # "xla" | "tpu" | "gpu" | "interpret"
    rows: Optional[int] = None
    reason: Optional[str] = None  # set when a kernel was wanted but cannot run; "{platform}" names the target
    fatal: bool = False           # the reason is an error ("pallas"), not a fallback warning ("auto")


def choose(implementation: str, platform: str, n_rows: int, d: int, rank: int, dtype, has_norm: bool,
           block_rows: Optional[int] = None) -> Choice:
    """The decision for one platform ('tpu', 'gpu', 'cpu' or any other name), without side effects.
    A reason's "{platform}" is filled in with the target platform where the choice is acted on."""
    if implementation not in IMPLEMENTATIONS:
        raise ConfigError(f"residual_rate_update: implementation={implementation!r}; "
                          f"allowed: {', '.join(IMPLEMENTATIONS)}")
    if implementation == "xla" or n_rows == 0:
        return Choice("xla")
    if block_rows is not None and block_rows < 1:
        raise ValueError(f"residual_rate_update: block_rows must be positive, got {block_rows}")
    backend = "interpret" if implementation == "interpret" else {"tpu": "tpu", "gpu": "gpu"}.get(platform)
    if backend is None:
        if implementation == "pallas":
            return Choice("xla", reason="residual_rate_update: implementation='pallas' needs a TPU or an NVIDIA "
                                        "GPU, but the program is for {platform}; use 'auto' or 'xla' (or "
                                        "'interpret' for testing)", fatal=True)
        return Choice("xla")
    if implementation == "auto" and backend == "gpu" and (n_rows < GPU_AUTO_MIN_ROWS or d < GPU_AUTO_MIN_D):
        return Choice("xla")  # XLA is the faster path here (measured; see GPU_AUTO_MIN_ROWS), not a fallback
    if backend == "gpu":
        rows = pallas_gpu.BLOCK_ROWS if block_rows is None else block_rows
        why = pallas_gpu.unsupported_reason(n_rows, d, rank, dtype, rows)
    else:
        rows = block_rows if block_rows is not None else pallas_tpu.choose_block_rows(n_rows, d, rank, dtype, has_norm)
        why = None
        if rows is None:
            why = (f"no row block of d={d}, rank={rank}, dtype={jnp.dtype(dtype).name} fits the TPU kernel's "
                   f"{pallas_tpu.VMEM_BUDGET_BYTES >> 20} MiB VMEM budget")
        elif backend == "tpu" and rows < n_rows and rows % pallas_tpu.sublane_multiple(dtype):
            why = f"block_rows={rows} is not a multiple of the TPU tile's {pallas_tpu.sublane_multiple(dtype)} rows"
    if why is None:
        return Choice(backend, rows)
    if implementation == "auto":
        return Choice("xla", reason="residual_rate_update: using the XLA reference on {platform}: " + why)
    return Choice("xla", reason=f"residual_rate_update: implementation={implementation!r} cannot run on "
                                "{platform}: " + why, fatal=True)


def _act_on(choice: Choice, platform: str, stacklevel: int) -> None:
    if choice.reason is None:
        return
    message = choice.reason.format(platform=platform)
    if choice.fatal:
        raise ConfigError(message)
    warnings.warn(message, KernelFallbackWarning, stacklevel=stacklevel)


def select_backend(implementation: str, n_rows: int, d: int, rank: int, dtype, has_norm: bool,
                   block_rows: Optional[int] = None, platform: Optional[str] = None) -> Tuple[str, Optional[int]]:
    """Which backend runs this call on `platform` (default: the one JAX runs on) and with how many rows
    per block: ("xla"|"tpu"|"gpu"|"interpret", rows). Warns when "auto" falls back to XLA, raises
    ConfigError when "pallas" cannot run."""
    platform = platform or _platform()
    choice = choose(implementation, platform, n_rows, d, rank, dtype, has_norm, block_rows)
    _act_on(choice, platform, stacklevel=3)
    return choice.backend, choice.rows


# An identity on one array that carries a Choice's fallback warning or error into lowering: it is
# staged in the branch of the platform that needs it, so it fires when a program is lowered (or run
# eagerly) for that platform, never when the branch is only traced for another one.
_notice_p = Primitive("residual_rate_kernel_notice")


def _notice_impl(x, *, choice):
    _act_on(choice, _platform(), stacklevel=4)
    return x


def _notice_lowering(ctx, x, *, choice):
    _act_on(choice, "/".join(ctx.module_context.platforms), stacklevel=4)
    return [x]


_notice_p.def_impl(_notice_impl)
_notice_p.def_abstract_eval(lambda x, **_: x)
mlir.register_lowering(_notice_p, _notice_lowering)
ad.primitive_jvps[_notice_p] = lambda primals, tangents, **kw: (_notice_p.bind(primals[0], **kw), tangents[0])
batching.primitive_batchers[_notice_p] = lambda args, dims, **kw: (_notice_p.bind(args[0], **kw), dims[0])


def _forward_kernel(backend: str, block_rows: int, scale: float, eps: float, x, u, rho, z, B, w):
    kw = dict(scale=scale, eps=eps, block_rows=block_rows)
    if backend == "gpu":
        return pallas_gpu.fused_update(x, u, rho, z, B, w, **kw)
    return pallas_tpu.fused_update(x, u, rho, z, B, w, interpret=(backend == "interpret"), **kw)


def _backward(scale: float, eps: float, residuals, cotangents):
    """Gradients of the update in f32 XLA; inputs are [T, d] / [T, R] row matrices.

    With delta = u + s*(z@B), y = x + rho*delta and n = w * yhat, yhat = y * r, r = rsqrt(mean(y^2)+eps):
      g = dy + r * (dn*w - yhat * mean(dn*w*yhat))     (total gradient at y)
      dx = g, du = rho*g, drho = sum_rows(g*delta), dz = s*(rho*g) @ B^T, dB = s * z^T @ (rho*g),
      dw = sum_rows(dn * yhat).
    """
    y, u, rho, z, B, w = residuals
    dy, dn = cotangents
    g = dy.astype(F32)
    dw = None
    if w is not None:
        y32 = y.astype(F32)
        r = jax.lax.rsqrt(jnp.mean(y32 * y32, axis=-1, keepdims=True) + eps)
        yhat = y32 * r
        dn32 = dn.astype(F32)
        dw = jnp.sum(dn32 * yhat.astype(y.dtype).astype(F32), axis=0).astype(w.dtype)
        gh = dn32 * w.astype(F32)
        g = g + r * (gh - yhat * jnp.mean(gh * yhat, axis=-1, keepdims=True))
    delta = u.astype(F32)
    if z is not None:
        delta = delta + scale * low_rank_term(z, B)
    grho_in = g * rho.astype(F32)  # gradient w.r.t. delta
    drho = jnp.sum(g * delta, axis=0).astype(rho.dtype)
    dz = dB = None
    if z is not None:
        hi = jax.lax.Precision.HIGHEST
        dz = (scale * jnp.dot(grho_in, B.astype(F32).T, precision=hi)).astype(z.dtype)
        dB = (scale * jnp.dot(z.astype(F32).T, grho_in, precision=hi)).astype(B.dtype)
    return g.astype(residuals[0].dtype), grho_in.astype(u.dtype), drho, dz, dB, dw


@functools.lru_cache(maxsize=None)
def _kernel_op(backend: str, block_rows: int, scale: float, eps: float):
    """A custom_vjp function (x, u, rho, z, B, w) -> (y, n) for one static configuration."""

    @jax.custom_vjp
    def op(x, u, rho, z, B, w):
        return _forward_kernel(backend, block_rows, scale, eps, x, u, rho, z, B, w)

    def fwd(x, u, rho, z, B, w):
        y, n = _forward_kernel(backend, block_rows, scale, eps, x, u, rho, z, B, w)
        return (y, n), (y, u, rho, z, B, w)

    def bwd(residuals, cotangents):
        dx, du, drho, dz, dB, dw = _backward(scale, eps, residuals, cotangents)
        return dx, du, drho, dz, dB, dw

    op.defvjp(fwd, bwd)
    return op


def residual_rate_update(x: Array, u: Array, rho: Array, z: Optional[Array] = None, B: Optional[Array] = None,
                         scale: float = 1.0, norm_weight: Optional[Array] = None, eps: float = 1e-6,
                         implementation: str = "auto",
                         block_rows: Optional[int] = None) -> Tuple[Array, Optional[Array]]:
    """Fused `y = x + rho * (u + scale * (z @ B))` and `n = RMSNorm(y) * norm_weight`.

    x, u: [..., d]; z: [..., R] and B: [R, d] (both None for no low-rank term); rho, norm_weight: [d].
    Inputs may be bf16 or f32; the math accumulates in f32; y and n come back in x's dtype (n is None
    without norm_weight). `block_rows` overrides the kernel's rows per grid step (tests, tuning).
    """
    _check_args(x, u, rho, z, B, norm_weight)
    scale = _static_number("scale", scale)
    eps = _static_number("eps", eps)
    if z is not None and z.shape[-1] == 0:
        z = B = None  # rank 0: no low-rank term
    d = x.shape[-1]
    lead = x.shape[:-1]
    n_rows = math.prod(lead)
    rank = 0 if z is None else z.shape[-1]
    has_norm = norm_weight is not None
    decide = functools.partial(choose, implementation, n_rows=n_rows, d=d, rank=rank, dtype=x.dtype,
                               has_norm=has_norm, block_rows=block_rows)
    if implementation == "interpret":
        per_platform, default = {}, decide("interpret")
    else:
        per_platform = {name: decide(backend) for name, backend in KERNEL_PLATFORMS.items()}
        default = decide("default")  # CPU, ROCm and any platform without a kernel
    plain = Choice("xla")
    if default == plain and all(c == plain for c in per_platform.values()):
        return residual_rate_update_reference(x, u, rho, z, B, scale, norm_weight, eps)

    def branch(choice: Choice):
        def run(x, u, rho, z, B, w):
            if choice.backend == "xla":
                if choice.reason is not None:
                    x = _notice_p.bind(x, choice=choice)
                return residual_rate_update_reference(x, u, rho, z, B, scale, w, eps)
            flat = lambda a, width: None if a is None else a.reshape(n_rows, width)  # noqa: E731
            y, n = _kernel_op(choice.backend, choice.rows, scale, eps)(flat(x, d), flat(u, d), rho, flat(z, rank),
                                                                       B, w)
            return y.reshape(x.shape), (None if n is None else n.reshape(x.shape))
        return run

    args = (x, u, rho, z, B, norm_weight)
    if not per_platform:
        return branch(default)(*args)
    return jax.lax.platform_dependent(*args, default=branch(default),
                                      **{name: branch(c) for name, c in per_platform.items()})
