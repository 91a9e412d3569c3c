"""Pallas kernel of the fused residual-rate update, Mosaic TPU backend (also the interpret-mode kernel).

One grid step owns a block of `block_rows` rows with the full model width d (RMSNorm needs the whole
row). It reads x, u, z rows plus the broadcast operands B, rho, w, and writes y and n: one pass over
[T, d] instead of the three or four an unfused XLA graph may make. The ragged last block needs no mask:
rows are independent, and Pallas clips the block's writes at the array edge, so garbage read past the
end only ever lands in discarded rows.

The same body runs on CPU with `interpret=True` (the tests) and in TPU interpret mode
(`pltpu.InterpretParams()`, which also simulates TPU memory spaces).

Status: lowered to Mosaic on CPU through the public op (`jax.export` for "tpu", forward and gradient,
tests/kernels/test_residual_rate_export.py) and executed in both interpreters (tests/kernels); not
yet compiled by libtpu or run on a TPU.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

Array = jax.Array
F32 = jnp.float32

# Scoped-VMEM budget for one grid step's blocks (double-buffered) plus f32 temporaries. TPU v4/v5e
# default to 16 MiB of scoped VMEM; staying at half leaves room for Mosaic's own spills.
VMEM_BUDGET_BYTES = 8 * 1024 * 1024
MAX_BLOCK_ROWS = 1024
F32_TEMPORARIES_PER_ROW = 4  # x, delta, y and the normalised row live in f32 at once


def sublane_multiple(dtype) -> int:
    """Row alignment of a TPU tile: (8, 128) for 32-bit dtypes, (16, 128) for bf16, (32, 128) for 8-bit."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def choose_block_rows(n_rows: int, d: int, rank: int, dtype, has_norm: bool,
                      budget_bytes: int = VMEM_BUDGET_BYTES) -> Optional[int]:
    """Rows per grid step so that one step's VMEM footprint fits the budget; None if no block fits.

    Footprint: x, u, y (and n) rows and z rows, each double-buffered by the pipeline; B, rho, w
    (double-buffered too, although their block never changes); f32 temporaries of the row math.
    """
    itemsize = jnp.dtype(dtype).itemsize
    n_rowwise = 3 + int(has_norm)
    per_row = 2 * (n_rowwise * d + rank) * itemsize + F32_TEMPORARIES_PER_ROW * d * 4
    fixed = 2 * (rank * d * itemsize + 2 * d * 4)
    if fixed + per_row > budget_bytes:
        return None
    fit = (budget_bytes - fixed) // per_row
    align = sublane_multiple(dtype)
    if n_rows <= min(fit, MAX_BLOCK_ROWS):
        return n_rows  # one block spanning every row: a full-extent block needs no alignment
    rows = 1 << (min(fit, MAX_BLOCK_ROWS).bit_length() - 1)  # power of two <= fit
    return rows if rows >= align else None


def _row_update(x_ref, u_ref, rho_ref, z_ref, b_ref, w_ref, y_ref, n_ref, *, scale: float, eps: float):
    """The row-block math shared by every grid step (f32 throughout, rounded once per output)."""
    delta = u_ref[...].astype(F32)
    if z_ref is not None:
        z, b = z_ref[...], b_ref[...]
        ct = jnp.promote_types(z.dtype, b.dtype)
        precision = jax.lax.Precision.HIGHEST if ct == F32 else None
        delta = delta + scale * jnp.dot(z.astype(ct), b.astype(ct), precision=precision,
                                        preferred_element_type=F32)
    y = (x_ref[...].astype(F32) + rho_ref[...].astype(F32) * delta).astype(y_ref.dtype)
    y_ref[...] = y
    if n_ref is not None:
        dt = n_ref.dtype
        y32 = y.astype(F32)
        normed = (y32 * jax.lax.rsqrt(jnp.mean(y32 * y32, axis=-1, keepdims=True) + eps)).astype(dt)
        # Two values of dtype dt multiply exactly in f32, so this rounds like a multiply in dt
        # (the reference's convention) without needing bf16 VPU arithmetic (absent on v5e).
        n_ref[...] = (w_ref[...].astype(dt).astype(F32) * normed.astype(F32)).astype(dt)


def _kernel(*refs, has_z: bool, has_norm: bool, n_poisoned: int, scale: float, eps: float):
    refs = list(refs)
    x_ref, u_ref, rho_ref = refs[:3]
    pos = 3
    z_ref = b_ref = w_ref = None
    if has_z:
        z_ref, b_ref = refs[pos:pos + 2]
        pos += 2
    if has_norm:
        w_ref = refs[pos]
        pos += 1
    pos += n_poisoned  # aliased output buffers: never read, only there to pre-fill the outputs
    y_ref = refs[pos]
    n_ref = refs[pos + 1] if has_norm else None
    _row_update(x_ref, u_ref, rho_ref, z_ref, b_ref, w_ref, y_ref, n_ref, scale=scale, eps=eps)


def fused_update(x: Array, u: Array, rho: Array, z: Optional[Array], B: Optional[Array],
                 norm_weight: Optional[Array], *, scale: float, eps: float, block_rows: int,
                 interpret: Any = False,
                 out_init: Sequence[Array] = ()) -> Tuple[Array, Optional[Array]]:
    """pallas_call over row blocks. x, u: [T, d]; z: [T, R]; B: [R, d]; rho, norm_weight: [d].

    `out_init` (tests only): buffers aliased to the outputs (y, then n), so any element the kernel
    fails to write keeps their contents (e.g. NaN) instead of silently reading as a plausible value.
    `interpret`: False on TPU, True (generic interpreter) or `pltpu.InterpretParams()` elsewhere.
    """
    T, d = x.shape
    has_z, has_norm = z is not None, norm_weight is not None
    rank = z.shape[-1] if has_z else 0
    if out_init and T % block_rows:
        # JAX 0.11's generic interpreter pads blocked operands of a ragged grid but not the
        # whole-array (ANY) buffers aliased to the outputs, and then fails on the shape mismatch.
        # The poisoned test runs therefore pad to whole blocks: rows < T must still be written.
        pad = pl.cdiv(T, block_rows) * block_rows - T
        grow = lambda a: jnp.pad(a, ((0, pad), (0, 0)))  # noqa: E731
        y, n = fused_update(grow(x), grow(u), rho, None if z is None else grow(z), B, norm_weight,
                            scale=scale, eps=eps, block_rows=block_rows, interpret=interpret,
                            out_init=[grow(o) for o in out_init])
        return y[:T], (None if n is None else n[:T])

    def rows(width):
        return pl.BlockSpec((block_rows, width), lambda i: (i, 0))

    def whole(shape):
        return pl.BlockSpec(shape, lambda i: (0,) * len(shape))

    inputs = [x, u, rho.reshape(1, d)]
    in_specs = [rows(d), rows(d), whole((1, d))]
    if has_z:
        inputs += [z, B]
        in_specs += [rows(rank), whole((rank, d))]
    if has_norm:
        inputs.append(norm_weight.reshape(1, d))
        in_specs.append(whole((1, d)))
    n_out = 1 + int(has_norm)
    if out_init:
        if len(out_init) != n_out:
            raise ValueError(f"out_init needs {n_out} buffers (y{', n' if has_norm else ''}), got {len(out_init)}")
        aliases = {len(inputs) + k: k for k in range(n_out)}
        inputs += list(out_init)
        in_specs += [pl.BlockSpec(memory_space=pl.ANY)] * n_out
    else:
        aliases = {}

    out_shape = [jax.ShapeDtypeStruct((T, d), x.dtype)] * n_out
    itemsize = x.dtype.itemsize
    cost = pl.CostEstimate(
        flops=int(T * d * (4 + 2 * rank + (5 if has_norm else 0))),
        transcendentals=int(T if has_norm else 0),
        bytes_accessed=int(T * d * (2 + n_out) * itemsize + T * rank * itemsize + rank * d * itemsize),
    )
    kernel = functools.partial(_kernel, has_z=has_z, has_norm=has_norm, n_poisoned=len(out_init),
                               scale=float(scale), eps=float(eps))
    outs = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(T, block_rows),),
        in_specs=in_specs,
        out_specs=[rows(d)] * n_out,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        cost_estimate=cost,
        interpret=interpret,
        name="residual_rate_update",
    )(*inputs)
    return outs[0], (outs[1] if has_norm else None)
