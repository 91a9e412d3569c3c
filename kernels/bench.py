"""Benchmark of the fused residual-rate update: Pallas kernel vs the XLA reference vs the memory roofline.

    python -m m2r2_jax.kernels.bench [--out results.json] [--d 4096] [--rank 16] [--dtype bfloat16]

On a GPU or TPU, for decode-like (T = 1..64) and training-like (T = 4096..16384) row counts it times
the kernel (`implementation="pallas"`) and the XLA reference on the same inputs in the same run, and
compares both to the memory roofline: the bytes the op must move (read x, u, z, B, rho, w; write y, n)
divided by the bandwidth of a plain device copy measured at the start of the run. Times are medians of
per-call wall times after warm-up and include dispatch, which dominates at decode sizes for both.

On CPU there is no kernel to time: it runs the kernel in interpret mode against the reference for
correctness only (row counts clipped so interpret mode stays fast) and reports no timings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .residual_rate import residual_rate_update, residual_rate_update_reference, select_backend

DECODE_ROWS = (1, 8, 64)
TRAIN_ROWS = (4096, 16384)
CPU_MAX_ROWS = 16  # interpret mode runs the kernel body op by op: keep the correctness check quick


def _inputs(T: int, d: int, rank: int, dtype, seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(k[0], (T, d), dtype)
    u = (0.5 * jax.random.normal(k[1], (T, d))).astype(dtype)
    rho = 2.0 + 0.3 * jax.random.normal(k[2], (d,), jnp.float32)
    w = (1.0 + 0.1 * jax.random.normal(k[3], (d,))).astype(dtype)
    z = jax.random.normal(k[4], (T, rank), dtype) if rank else None
    B = (0.2 * jax.random.normal(k[5], (rank, d))).astype(dtype) if rank else None
    return x, u, rho, z, B, w


def bytes_moved(T: int, d: int, rank: int, dtype, rho_dtype=jnp.float32) -> int:
    """Minimum HBM traffic of the fused op: every operand read once, y and n written once."""
    it = jnp.dtype(dtype).itemsize
    return (4 * T * d + T * rank + rank * d + d) * it + d * jnp.dtype(rho_dtype).itemsize


def median_seconds(fn: Callable, args: Sequence, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(n_bytes: int, iters: int) -> float:
    """Bytes/s of a plain device copy (read + write) of an n_bytes array."""
    a = jnp.ones((n_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda v: jnp.copy(v))
    return 2 * a.nbytes / median_seconds(copy, (a,), iters)


def _op(implementation: str, scale: float):
    return jax.jit(lambda x, u, rho, z, B, w: residual_rate_update(
        x, u, rho, z, B, scale, w, implementation=implementation))


def run_device(rows: Sequence[int], d: int, rank: int, dtype, iters: int, copy_mib: int) -> Dict:
    bw = copy_bandwidth(copy_mib << 20, iters)
    results: List[Dict] = []
    for T in rows:
        args = _inputs(T, d, rank, dtype)
        entry: Dict = dict(rows=T, d=d, rank=rank, dtype=jnp.dtype(dtype).name,
                           bytes=bytes_moved(T, d, rank, dtype))
        entry["roofline_s"] = entry["bytes"] / bw
        entry["xla_s"] = median_seconds(_op("xla", 0.5), args, iters)
        try:
            backend, block_rows = select_backend("pallas", T, d, rank, dtype, True)
        except ValueError as e:  # ConfigError: the kernel cannot take this shape here
            entry.update(kernel_s=None, kernel_unavailable=str(e))
        else:
            kernel = _op("pallas", 0.5)
            y, n = kernel(*args)
            y_ref, n_ref = residual_rate_update_reference(*args[:5], 0.5, args[5])
            entry["max_abs_err"] = float(max(jnp.abs(y.astype(jnp.float32) - y_ref.astype(jnp.float32)).max(),
                                             jnp.abs(n.astype(jnp.float32) - n_ref.astype(jnp.float32)).max()))
            entry.update(backend=backend, block_rows=block_rows,
                         kernel_s=median_seconds(kernel, args, iters))
            entry["speedup_vs_xla"] = entry["xla_s"] / entry["kernel_s"]
            entry["kernel_roofline_fraction"] = entry["roofline_s"] / entry["kernel_s"]
        entry["xla_roofline_fraction"] = entry["roofline_s"] / entry["xla_s"]
        results.append(entry)
    return dict(mode="timing", copy_bandwidth_gbs=bw / 1e9, results=results)


def run_cpu_correctness(rows: Sequence[int], d: int, rank: int, dtype) -> Dict:
    results = []
    for T in sorted({min(T, CPU_MAX_ROWS) for T in rows}):
        args = _inputs(T, d, rank, dtype)
        y, n = residual_rate_update(*args[:5], 0.5, args[5], implementation="interpret")
        y_ref, n_ref = residual_rate_update_reference(*args[:5], 0.5, args[5])
        err = float(max(jnp.abs(y.astype(jnp.float32) - y_ref.astype(jnp.float32)).max(),
                        jnp.abs(n.astype(jnp.float32) - n_ref.astype(jnp.float32)).max()))
        tol = 2e-5 if jnp.dtype(dtype) == jnp.float32 else 2 ** -7 * max(1.0, float(jnp.abs(y_ref).max()))
        results.append(dict(rows=T, d=d, rank=rank, dtype=jnp.dtype(dtype).name, max_abs_err=err,
                            ok=bool(np.isfinite(err) and err <= tol)))
    return dict(mode="correctness only (CPU: Pallas interpret mode; no timings)", results=results)


def _fmt_us(s: Optional[float]) -> str:
    return "-" if s is None else f"{s * 1e6:10.1f}"


def print_table(report: Dict) -> None:
    print(f"platform: {report['platform']} ({report['device']}), jax {report['jax']}")
    print(f"mode: {report['mode']}")
    if report["mode"] != "timing":
        print(f"{'rows':>6} {'d':>6} {'rank':>4} {'dtype':>9} {'max|err|':>10} ok")
        for r in report["results"]:
            print(f"{r['rows']:>6} {r['d']:>6} {r['rank']:>4} {r['dtype']:>9} {r['max_abs_err']:>10.2e} {r['ok']}")
        return
    print(f"copy bandwidth: {report['copy_bandwidth_gbs']:.1f} GB/s")
    print(f"{'rows':>6} {'d':>6} {'rank':>4} {'kernel us':>10} {'xla us':>10} {'roofline us':>11} "
          f"{'xla/kernel':>10} {'kernel %roof':>12} {'xla %roof':>9}")
    for r in report["results"]:
        ratio = "-" if r.get("kernel_s") is None else f"{r['speedup_vs_xla']:10.2f}"
        kroof = "-" if r.get("kernel_s") is None else f"{100 * r['kernel_roofline_fraction']:11.1f}%"
        print(f"{r['rows']:>6} {r['d']:>6} {r['rank']:>4} {_fmt_us(r.get('kernel_s')):>10} {_fmt_us(r['xla_s']):>10} "
              f"{_fmt_us(r['roofline_s']):>11} {ratio:>10} {kroof:>12} {100 * r['xla_roofline_fraction']:8.1f}%")
        if r.get("kernel_unavailable"):
            print(f"        kernel unavailable: {r['kernel_unavailable']}")


def _int_list(text: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m m2r2_jax.kernels.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the results as JSON to this file")
    p.add_argument("--d", type=int, default=4096, help="model width (default 4096)")
    p.add_argument("--rank", type=int, default=16, help="adapter rank R; 0 for no low-rank term (default 16)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--decode-rows", type=_int_list, default=list(DECODE_ROWS), help="decode-like T values")
    p.add_argument("--train-rows", type=_int_list, default=list(TRAIN_ROWS), help="training-like T values")
    p.add_argument("--iters", type=int, default=50, help="timed calls per measurement (default 50)")
    p.add_argument("--copy-mib", type=int, default=512, help="size of the bandwidth-probe copy (default 512 MiB)")
    a = p.parse_args(argv)
    if a.d < 1 or a.rank < 0 or a.iters < 1 or a.copy_mib < 1:
        p.error("--d, --iters and --copy-mib must be positive and --rank non-negative")
    return a


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    a = parse_args(argv)
    dtype = jnp.dtype(a.dtype)
    rows = list(a.decode_rows) + list(a.train_rows)
    platform = jax.default_backend()
    if platform in ("gpu", "tpu"):
        report = run_device(rows, a.d, a.rank, dtype, a.iters, a.copy_mib)
    else:
        report = run_cpu_correctness(rows, a.d, a.rank, dtype)
    report.update(platform=platform, device=jax.devices()[0].device_kind, jax=jax.__version__)
    print_table(report)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {a.out}")
    if report["mode"] != "timing" and not all(r["ok"] for r in report["results"]):
        print("bench: error: the kernel disagrees with the reference", file=sys.stderr)
        sys.exit(1)
    return report


if __name__ == "__main__":
    main()
