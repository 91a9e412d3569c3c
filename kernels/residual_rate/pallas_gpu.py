"""Pallas kernel of the fused residual-rate update, Mosaic GPU backend (Hopper-class NVIDIA GPUs).

Written against `jax.experimental.pallas.mosaic_gpu` with `plgpu.kernel` (the `pl.pallas_call` route
to Mosaic GPU is deprecated). Triton is not used: Mosaic GPU expresses this op on the installed JAX.

Layout of the work: one CTA (one warpgroup) owns a block of 64 rows, the height of the WGMMA register
tile, whose row-reduction layout gives the per-row RMS statistic without shared-memory traffic. A full
row of width d does not fit in registers for large d, so the block walks d in column chunks (128 or
64 columns), twice:

  pass 1  load the x, u, rho, B chunks by TMA (two SMEM slots: chunk c+1 loads while chunk c
          computes; z^T of the block once), y = x + rho * (u + s * z @ B) in f32, store y rounded to
          x's dtype by TMA, and accumulate the per-row sum of y^2 in the loop carry;
  pass 2  (only with norm_weight) re-read the y chunks just written (they are in L2), scale by
          rsqrt(mean + eps) and the weight, store n.

The pipeline is written out by hand rather than with `plgpu.emit_pipeline`, because Pallas' GPU
interpreter (which runs this kernel on CPU in the tests) cannot execute emit_pipeline's predicated
stores in this JAX version.

z @ B is done as R rank-1 updates on the CUDA cores (R <= 64 broadcast FMAs per element): at the
adapter ranks this project uses that avoids staging swizzled WGMMA operands and any K-alignment
constraint. A ragged T is padded to whole 64-row blocks outside the kernel (see `fused_update`).

Status: lowered to Mosaic GPU MLIR on CPU and run in Pallas' GPU interpreter with race detection
(tests/kernels/test_residual_rate_backends.py); compiled and checked on an NVIDIA H200 with JAX 0.11.2
(outputs and gradients on 12 shapes; docs/RESULTS.md). There it reaches 72% of the copy-bandwidth
roofline at 16,384 x 4,096 bf16: the second pass re-reads y, so 5/4 of the minimum bytes move.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

Array = jax.Array
F32 = jnp.float32

BLOCK_ROWS = 64        # WGMMA tile height: one warpgroup holds 64 rows x chunk columns in registers
MAX_RANK = 64          # the rank-1 update loop is unrolled; beyond this the kernel is not the right tool
SMEM_BUDGET_BYTES = 200 * 1024  # H100/H200 allow 227 KiB of shared memory per block
PIPELINE_STAGES = 2    # double buffering of every chunk


def _chunk_and_smem(d: int, rank: int, itemsize: int) -> Tuple[Optional[int], int]:
    """Widest column chunk (128 or 64) whose pipelined SMEM footprint fits; (None, bytes) if none does."""
    smem = 0
    for chunk in (128, 64):
        if d % chunk:
            continue
        # x, u, y tiles, the rho / w and B chunks per slot; z^T of the row block once.
        per_stage = (3 * BLOCK_ROWS * chunk + rank * chunk + 2 * chunk) * itemsize
        smem = PIPELINE_STAGES * per_stage + rank * BLOCK_ROWS * itemsize
        if smem <= SMEM_BUDGET_BYTES:
            return chunk, smem
    return None, smem


def _widest_itemsize(*arrays) -> int:
    return max(a.dtype.itemsize for a in arrays if a is not None)


def unsupported_reason(n_rows: int, d: int, rank: int, dtype, block_rows: int) -> Optional[str]:
    """Why the GPU kernel cannot take this shape, or None when it can.

    The SMEM estimate assumes 4-byte elements (any operand may be f32 next to bf16 activations).
    """
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return f"dtype {jnp.dtype(dtype).name} (the GPU kernel takes bfloat16 or float32)"
    if d % 64:
        return f"d={d} is not a multiple of 64 (the GPU kernel's column chunk)"
    if rank > MAX_RANK:
        return f"rank {rank} > {MAX_RANK}"
    if block_rows != BLOCK_ROWS:
        return f"block_rows={block_rows} (the GPU kernel uses {BLOCK_ROWS}-row blocks)"
    chunk, smem = _chunk_and_smem(d, rank, 4)
    if chunk is None:
        return f"shared memory: {smem} bytes > {SMEM_BUDGET_BYTES}"
    return None


def choose_block_rows(n_rows: int, d: int, rank: int, dtype, has_norm: bool) -> Optional[int]:
    del has_norm  # the norm pass reuses pass 1's buffers
    return BLOCK_ROWS if unsupported_reason(n_rows, d, rank, dtype, BLOCK_ROWS) is None else None


def _with_layout(x, layout, interpret: bool):
    """Pin a register layout. Layouts only steer Mosaic GPU's code generation; Pallas' GPU interpreter
    has no rule for `layout_cast` (nor `plgpu.load`), so interpreted runs skip the annotation — the
    only difference between the compiled and the interpreted kernel body."""
    return x if interpret else plgpu.layout_cast(x, layout)


def _tile(ref, interpret: bool):
    """A [64, chunk] SMEM tile into registers in the WGMMA layout (row reductions are warp-local)."""
    return _with_layout(ref[...], plgpu.Layout.WGMMA, interpret).astype(F32)


def _row_vector(ref, i, interpret: bool):
    """Row i of a 2-D SMEM ref as a per-row vector of the 64-row tile (one value per tile row)."""
    return _with_layout(ref[i], plgpu.Layout.WGMMA.reduce(1), interpret).astype(F32)


def _col_vector(ref, i, interpret: bool):
    """Row i of a 2-D SMEM ref as a per-column vector of the tile (one value per tile column)."""
    return _with_layout(ref[i], plgpu.Layout.WGMMA.reduce(0), interpret).astype(F32)


def _kernel(*refs, d: int, rank: int, chunk: int, has_norm: bool, scale: float, eps: float,
            interpret: bool):
    refs = list(refs)
    x_g, u_g, rho_g = refs[:3]
    pos = 3
    zt_g = b_g = w_g = None
    if rank:
        zt_g, b_g = refs[pos:pos + 2]
        pos += 2
    if has_norm:
        w_g = refs[pos]
        pos += 1
    y_g = refs[pos]
    n_g = refs[pos + 1] if has_norm else None
    scratch = iter(refs[pos + 1 + int(has_norm):])
    x_s, u_s, rho_s, y_s, x_bar, u_bar, rho_bar = (next(scratch) for _ in range(7))
    if rank:
        zt_s, b_s, zt_bar, b_bar = (next(scratch) for _ in range(4))
    if has_norm:
        w_s, w_bar = next(scratch), next(scratch)

    shape = (BLOCK_ROWS, chunk)
    n_chunks = d // chunk
    rows = pl.ds(lax.axis_index("rows") * BLOCK_ROWS, BLOCK_ROWS)

    def cols(c):
        # A Python int start needs no alignment hint (and JAX 0.11's Mosaic GPU lowering of
        # `multiple_of` fails on a constant).
        start = c * chunk if isinstance(c, int) else pl.multiple_of(c * chunk, chunk)
        return pl.ds(start, chunk)

    def load_update_operands(c, slot):
        plgpu.copy_gmem_to_smem(x_g.at[rows, cols(c)], x_s.at[slot], x_bar.at[slot])
        plgpu.copy_gmem_to_smem(u_g.at[rows, cols(c)], u_s.at[slot], u_bar.at[slot])
        plgpu.copy_gmem_to_smem(rho_g.at[:, cols(c)], rho_s.at[slot], rho_bar.at[slot])
        if rank:
            plgpu.copy_gmem_to_smem(b_g.at[:, cols(c)], b_s.at[slot], b_bar.at[slot])

    def store(tile, c, slot, out_g):
        # The store issued two chunks ago from this slot must have finished reading it.
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        y_s.at[slot][...] = tile
        plgpu.commit_smem()  # make the register->SMEM writes visible to the TMA engine
        plgpu.copy_smem_to_gmem(y_s.at[slot], out_g.at[rows, cols(c)])

    # Pass 1: y chunk by chunk, prefetching chunk c+1 while chunk c is computed.
    if rank:
        plgpu.copy_gmem_to_smem(zt_g.at[:, rows], zt_s, zt_bar.at[0])
    load_update_operands(0, 0)
    if rank:
        plgpu.barrier_wait(zt_bar.at[0])

    def update_chunk(c, sumsq):
        slot = lax.rem(c, 2)

        @pl.when(c + 1 < n_chunks)
        def _():
            load_update_operands(c + 1, 1 - slot)

        for bar in (x_bar, u_bar, rho_bar) + ((b_bar,) if rank else ()):
            plgpu.barrier_wait(bar.at[slot])
        delta = _tile(u_s.at[slot], interpret)
        if rank:
            low_rank = jnp.zeros(shape, F32)
            for r in range(rank):  # R rank-1 updates: z[:, r] (per row) x B[r, chunk] (per column)
                low_rank = low_rank + (lax.broadcast_in_dim(_row_vector(zt_s, r, interpret), shape, [0])
                                       * lax.broadcast_in_dim(_col_vector(b_s.at[slot], r, interpret), shape, [1]))
            delta = delta + scale * low_rank
        rho = lax.broadcast_in_dim(_col_vector(rho_s.at[slot], 0, interpret), shape, [1])
        y = (_tile(x_s.at[slot], interpret) + rho * delta).astype(y_g.dtype)
        store(y, c, slot, y_g)
        y32 = y.astype(F32)
        return sumsq + jnp.sum(y32 * y32, axis=1)

    zero_rows = _with_layout(jnp.zeros((BLOCK_ROWS,), F32), plgpu.Layout.WGMMA.reduce(1), interpret)
    sumsq = lax.fori_loop(0, n_chunks, update_chunk, zero_rows)
    # Every y chunk must have landed in global memory: pass 2 reads them back, and reuses y_s.
    plgpu.wait_smem_to_gmem(0)
    if not has_norm:
        return
    inv_rms = lax.rsqrt(sumsq * (1.0 / d) + eps)

    # Pass 2: n = w * (y * inv_rms), y re-read through x's buffers (y has x's dtype).
    def load_norm_operands(c, slot):
        plgpu.copy_gmem_to_smem(y_g.at[rows, cols(c)], x_s.at[slot], x_bar.at[slot])
        plgpu.copy_gmem_to_smem(w_g.at[:, cols(c)], w_s.at[slot], w_bar.at[slot])

    load_norm_operands(0, 0)

    def norm_chunk(c, carry):
        slot = lax.rem(c, 2)

        @pl.when(c + 1 < n_chunks)
        def _():
            load_norm_operands(c + 1, 1 - slot)

        plgpu.barrier_wait(x_bar.at[slot])
        plgpu.barrier_wait(w_bar.at[slot])
        dt = n_g.dtype
        normed = (_tile(x_s.at[slot], interpret) * lax.broadcast_in_dim(inv_rms, shape, [0])).astype(dt)
        weight = _col_vector(w_s.at[slot], 0, interpret).astype(dt).astype(F32)
        # Two dt values multiply exactly in f32: this rounds like the reference's multiply in dt.
        store((lax.broadcast_in_dim(weight, shape, [1]) * normed.astype(F32)).astype(dt), c, slot, n_g)
        return carry

    lax.fori_loop(0, n_chunks, norm_chunk, 0)
    plgpu.wait_smem_to_gmem(0)


def _scratch(d: int, rank: int, chunk: int, has_norm: bool, x, u, rho, z, B, w):
    """SMEM buffers (two slots each: chunk c+1 loads while chunk c computes) and their TMA barriers."""

    def tiles(dtype):
        itemsize = jnp.dtype(dtype).itemsize
        swizzle = plgpu.find_swizzle(chunk * itemsize * 8)
        # Tiled + swizzled SMEM, so that loading a WGMMA-layout tile is free of bank conflicts.
        return plgpu.SMEM((2, BLOCK_ROWS, chunk), dtype, transforms=(
            plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)))

    two = plgpu.Barrier(num_barriers=2)
    out = [tiles(x.dtype), tiles(u.dtype), plgpu.SMEM((2, 1, chunk), rho.dtype), tiles(x.dtype), two, two, two]
    if rank:
        out += [plgpu.SMEM((rank, BLOCK_ROWS), z.dtype), plgpu.SMEM((2, rank, chunk), B.dtype),
                plgpu.Barrier(num_barriers=1), two]
    if has_norm:
        out += [plgpu.SMEM((2, 1, chunk), w.dtype), two]
    return out


def fused_update(x: Array, u: Array, rho: Array, z: Optional[Array], B: Optional[Array],
                 norm_weight: Optional[Array], *, scale: float, eps: float, block_rows: int = BLOCK_ROWS,
                 interpret: Any = None) -> Tuple[Array, Optional[Array]]:
    """Run the Mosaic GPU kernel. x, u: [T, d]; z: [T, R]; B: [R, d]; rho, norm_weight: [d].

    `interpret`: None on a GPU, or `InterpretGPUParams()` to run the same kernel in Pallas' GPU
    interpreter on CPU.
    """
    T, d = x.shape
    rank = 0 if z is None else z.shape[-1]
    why = unsupported_reason(T, d, rank, x.dtype, block_rows)
    if why is not None:
        raise ValueError(f"residual_rate_update GPU kernel cannot run: {why}")
    chunk, _ = _chunk_and_smem(d, rank, _widest_itemsize(x, u, rho, z, B, norm_weight))
    # Whole 64-row blocks only: a ragged T is padded (rows past T compute on zeros and are sliced
    # off). Decode shapes are tiny and training shapes are multiples of 64, so the copy is rare and
    # cheap, and every TMA transfer stays in bounds (which the GPU interpreter also requires).
    T_pad = pl.cdiv(T, BLOCK_ROWS) * BLOCK_ROWS
    if T_pad != T:
        x, u = (jnp.pad(a, ((0, T_pad - T), (0, 0))) for a in (x, u))
        z = None if z is None else jnp.pad(z, ((0, T_pad - T), (0, 0)))
    has_norm = norm_weight is not None
    # Each operand keeps its own dtype (an f32 rho next to bf16 activations stays f32); math is f32.
    operands = [x, u, rho.reshape(1, d)]
    if rank:
        operands += [z.T, B]  # z^T: column r of a row block is a contiguous 64-element TMA row
    if has_norm:
        operands.append(norm_weight.reshape(1, d))
    out_shape = [jax.ShapeDtypeStruct((T_pad, d), x.dtype)] * (1 + int(has_norm))
    kernel = functools.partial(_kernel, d=d, rank=rank, chunk=chunk, has_norm=has_norm,
                               scale=float(scale), eps=float(eps), interpret=interpret is not None)
    kw = {} if interpret is None else {"interpret": interpret}
    outs = plgpu.kernel(kernel, out_type=out_shape, grid=(T_pad // BLOCK_ROWS,), grid_names=("rows",),
                        scratch_types=_scratch(d, rank, chunk, has_norm, x, u, rho, z, B, norm_weight),
                        compiler_params=plgpu.CompilerParams(), **kw)(*operands)
    if T_pad != T:
        outs = [o[:T] for o in outs]
    return outs[0], (outs[1] if has_norm else None)
