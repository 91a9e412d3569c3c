"""Benchmark of the fused residual-rate update: Pallas kernel vs the XLA reference vs the memory roofline.

    python -m m2r2_jax.kernels.bench [--out results.json] [--d 4096] [--rank 16] [--dtype bfloat16]

On a GPU or TPU it first checks the compiled kernel against the XLA reference over the shapes the
CPU tests use (ragged row counts, d from 64 to 4096, rank 0 to 64, bf16 and f32; forward outputs and
every gradient), then, for decode-like (T = 1..64) and training-like (T = 4096..16384) row counts, times
the kernel (`implementation="pallas"`) and the XLA reference on the same inputs in the same run, and
compares both to the memory roofline: the bytes the op must move (read x, u, z, B, rho, w; write y, n)
divided by the bandwidth of a plain device copy measured at the start of the run (`--calls` copies
issued back to back per sample). An op's time is its device time inside a compiled program, as a
model sees it: programs looping 4 and 44 times over the op (each step feeding the next, through an
optimization barrier so that XLA cannot fuse steps or hoist work out of the loop) are timed, and the
difference is divided by 40, so host dispatch cancels; medians of `--iters` samples. The loop's own
cost per step is measured the same way with a body that changes one element, reported, and taken
off before the roofline fractions are computed.
At decode sizes both paths are bound by launch latency, not bytes.

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


def median_seconds(fn: Callable, args: Sequence, iters: int, warmup: int = 3, calls: int = 1) -> float:
    """Median over `iters` samples of the time per call, a sample being `calls` calls issued back to
    back and waited for once."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(calls)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def chained(op: Callable, k: int) -> Callable:
    """One compiled program applying `op` k times in a loop, each application feeding the next
    (y -> x, n -> u) through an optimization barrier, so that XLA can neither fuse applications
    together nor hoist the low-rank product out of the loop. A loop rather than k copies: each copy
    of a Pallas call would be compiled on its own."""
    def run(x, u, rho, z, B, w):
        def body(_, carry):
            x, u, z = carry
            y, n = op(x, u, rho, z, B, w)
            return jax.lax.optimization_barrier((y, u if n is None else n, z))
        x, u, _ = jax.lax.fori_loop(0, k, body, (x, u, z))
        return x, u
    return jax.jit(run)


def _loop_only(x, u, rho, z, B, w):
    """A body that does almost nothing (one element changes), to measure the loop's own cost per step."""
    return x.at[0, 0].add(1), None


def per_call_seconds(op: Callable, args: Sequence, iters: int, short: int = 4, long: int = 44) -> float:
    """Device time of one loop step applying `op` inside a compiled program, as a model sees it: the
    difference between programs of `long` and `short` steps, over their difference. Host dispatch and
    synchronisation are paid once per program and cancel; the loop's own cost per step does not (see
    `_loop_only`).

    The two programs are timed alternately and each is taken at its fastest sample. On a shared
    machine noise only ever adds time, and it comes in phases: a difference of medians goes to zero
    or below when most of one program's samples land in a busy phase, while the fastest samples of
    interleaved runs see the same quiet moments."""
    progs = (chained(op, short), chained(op, long))
    for prog in progs:
        for _ in range(3):  # compile and warm up both before timing either
            jax.block_until_ready(prog(*args))
    best = [float("inf"), float("inf")]
    for _ in range(iters):
        for i, prog in enumerate(progs):
            t0 = time.perf_counter()
            jax.block_until_ready(prog(*args))
            best[i] = min(best[i], time.perf_counter() - t0)
    return max(best[1] - best[0], 0.0) / (long - short)


def copy_bandwidth(n_bytes: int, iters: int, calls: int = 1) -> float:
    """Bytes/s of a plain device copy (read + write) of an n_bytes array."""
    # random data, not zeros: a copy of zeros can run faster than real data does
    a = jax.random.normal(jax.random.key(1), (n_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda v: v + 1.0)  # one read, one write (a plain copy may be elided)
    return 2 * a.nbytes / median_seconds(copy, (a,), iters, calls=calls)


# (T, d, rank, dtype, norm): the CPU tests' shapes (tests/kernels), compiled on the device.
CHECK_CASES = (
    (1, 64, 0, "float32", True), (5, 128, 16, "float32", True), (37, 64, 4, "bfloat16", True),
    (64, 64, 0, "float32", False), (70, 256, 4, "bfloat16", True), (300, 4096, 64, "bfloat16", True),
    (19, 512, 64, "bfloat16", True), (24, 1024, 8, "float32", True), (11, 4096, 64, "bfloat16", True),
    (4096, 1024, 16, "float32", True), (4096, 4096, 16, "bfloat16", True), (2, 192, 8, "float32", True),
)
# Forward: f32 differs from XLA by summation order only; a bf16 output by at most one rounding step.
CHECK_FWD_TOL = {"float32": 2e-5, "bfloat16": 2 ** -7}
# Gradients relative to the largest reference gradient (the bf16 reference rounds cotangents to bf16).
CHECK_GRAD_TOL = {"float32": 2e-5, "bfloat16": 3e-2}


def _max_rel_err(got, want) -> float:
    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if not np.isfinite(g).all():
        return float("inf")
    return float(np.abs(g - w).max() / max(1.0, float(np.abs(w).max())))


def check_case(T: int, d: int, rank: int, dtype: str, norm: bool, implementation: str = "pallas") -> Dict:
    """One shape: the kernel's outputs and gradients (through its custom_vjp) against the reference's."""
    x, u, rho, z, B, w = _inputs(T, d, rank, jnp.dtype(dtype), seed=T + d + rank)
    w = w if norm else None
    backend, _ = select_backend(implementation, T, d, rank, x.dtype, norm)

    def loss(impl):
        def f(x, u, rho, z, B, w):
            y, n = residual_rate_update(x, u, rho, z, B, 0.5, w, implementation=impl)
            total = jnp.sum(y.astype(jnp.float32) * jnp.cos(jnp.arange(d, dtype=jnp.float32)))
            return total if n is None else total + jnp.sum(n.astype(jnp.float32) ** 2)
        return f

    argnums = tuple(i for i, a in enumerate((x, u, rho, z, B, w)) if a is not None)
    fwd = jax.jit(lambda *a: residual_rate_update(*a[:5], 0.5, a[5], implementation=implementation))
    y, n = fwd(x, u, rho, z, B, w)
    y_ref, n_ref = residual_rate_update_reference(x, u, rho, z, B, 0.5, w)
    fwd_err = max(_max_rel_err(y, y_ref), 0.0 if n is None else _max_rel_err(n, n_ref))
    grads = jax.jit(jax.grad(loss(implementation), argnums=argnums))(x, u, rho, z, B, w)
    grads_ref = jax.jit(jax.grad(loss("xla"), argnums=argnums))(x, u, rho, z, B, w)
    grad_err = max(_max_rel_err(g, r) for g, r in zip(grads, grads_ref))
    ok = fwd_err <= CHECK_FWD_TOL[dtype] and grad_err <= CHECK_GRAD_TOL[dtype]
    return dict(rows=T, d=d, rank=rank, dtype=dtype, norm=norm, backend=backend, fwd_rel_err=fwd_err,
                grad_rel_err=grad_err, ok=bool(ok))


def run_device_checks(cases=CHECK_CASES) -> List[Dict]:
    results = []
    for case in cases:
        try:
            results.append(check_case(*case))
        except Exception as e:  # noqa: BLE001 - a failing compile is a result to report, not a crash
            T, d, rank, dtype, norm = case
            results.append(dict(rows=T, d=d, rank=rank, dtype=dtype, norm=norm, ok=False,
                                error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"))
        r = results[-1]
        print(f"check T={r['rows']:>5} d={r['d']:>5} rank={r['rank']:>2} {r['dtype']:>8} norm={int(r['norm'])}: "
              + (f"fwd {r['fwd_rel_err']:.1e} grad {r['grad_rel_err']:.1e} " if 'error' not in r else r['error'] + " ")
              + ("ok" if r["ok"] else "FAILED"), flush=True)
    return results


def _op(implementation: str, scale: float):
    return lambda x, u, rho, z, B, w: residual_rate_update(x, u, rho, z, B, scale, w, implementation=implementation)


def _fraction(ideal_s: float, measured_s: float) -> float:
    return ideal_s / measured_s if measured_s > 0 else float("nan")


def run_device(rows: Sequence[int], d: int, rank: int, dtype, iters: int, copy_mib: int, calls: int = 1) -> Dict:
    bw = copy_bandwidth(copy_mib << 20, iters, calls)
    results: List[Dict] = []
    for T in rows:
        args = _inputs(T, d, rank, dtype)
        loop_s = per_call_seconds(_loop_only, args, iters)
        entry: Dict = dict(rows=T, d=d, rank=rank, dtype=jnp.dtype(dtype).name,
                           bytes=bytes_moved(T, d, rank, dtype))
        entry["roofline_s"] = entry["bytes"] / bw
        entry["loop_step_s"] = loop_s  # included in xla_s and kernel_s; the fractions below net it out
        entry["xla_s"] = per_call_seconds(_op("xla", 0.5), args, iters)
        try:
            backend, block_rows = select_backend("pallas", T, d, rank, dtype, True)
        except ValueError as e:  # ConfigError: the kernel cannot take this shape here
            entry.update(kernel_s=None, kernel_unavailable=str(e))
        else:
            kernel = _op("pallas", 0.5)
            y, n = jax.jit(kernel)(*args)
            y_ref, n_ref = residual_rate_update_reference(*args[:5], 0.5, args[5])
            entry["max_abs_err"] = float(max(jnp.abs(y.astype(jnp.float32) - y_ref.astype(jnp.float32)).max(),
                                             jnp.abs(n.astype(jnp.float32) - n_ref.astype(jnp.float32)).max()))
            entry.update(backend=backend, block_rows=block_rows,
                         kernel_s=per_call_seconds(kernel, args, iters))
            entry["speedup_vs_xla"] = entry["xla_s"] / entry["kernel_s"]
            entry["kernel_roofline_fraction"] = _fraction(entry["roofline_s"], entry["kernel_s"] - loop_s)
        entry["xla_roofline_fraction"] = _fraction(entry["roofline_s"], entry["xla_s"] - loop_s)
        results.append(entry)
    return dict(mode="timing", copy_bandwidth_gbs=bw / 1e9, calls_per_sample=calls, results=results)


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
    return "-" if s is None else f"{s * 1e6:.1f}"


def print_table(report: Dict) -> None:
    print(f"platform: {report['platform']} ({report['device']}), jax {report['jax']}")
    print(f"mode: {report['mode']}")
    if report["mode"] != "timing":
        print(f"{'rows':>6} {'d':>6} {'rank':>4} {'dtype':>9} {'max|err|':>10} ok")
        for r in report["results"]:
            print(f"{r['rows']:>6} {r['d']:>6} {r['rank']:>4} {r['dtype']:>9} {r['max_abs_err']:>10.2e} {r['ok']}")
        return
    checks = report.get("checks", [])
    if checks:
        print(f"kernel checks (forward and gradients vs the reference): "
              f"{sum(r['ok'] for r in checks)}/{len(checks)} ok")
    print(f"copy bandwidth: {report['copy_bandwidth_gbs']:.1f} GB/s "
          f"({report['calls_per_sample']} copies back to back per sample); op times: device time per loop "
          f"step inside a compiled program (loop us: the loop's own share, off the %roof columns)")
    print(f"{'rows':>6} {'d':>6} {'rank':>4} {'kernel us':>10} {'xla us':>10} {'loop us':>8} {'roofline us':>11} "
          f"{'xla/kernel':>10} {'kernel %roof':>12} {'xla %roof':>9}")
    for r in report["results"]:
        ratio = "-" if r.get("kernel_s") is None else f"{r['speedup_vs_xla']:10.2f}"
        kroof = "-" if r.get("kernel_s") is None else f"{100 * r['kernel_roofline_fraction']:11.1f}%"
        print(f"{r['rows']:>6} {r['d']:>6} {r['rank']:>4} {_fmt_us(r.get('kernel_s')):>10} {_fmt_us(r['xla_s']):>10} "
              f"{_fmt_us(r['loop_step_s']):>8} {_fmt_us(r['roofline_s']):>11} {ratio:>10} {kroof:>12} "
              f"{100 * r['xla_roofline_fraction']:8.1f}%")
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
    p.add_argument("--iters", type=int, default=50, help="time samples per measurement (default 50)")
    p.add_argument("--calls", type=int, default=10,
                   help="bandwidth probe: copies issued back to back per sample (default 10)")
    p.add_argument("--check-cases", type=_int_list, default=None,
                   help="on a device, check only these CHECK_CASES (1-based, comma-separated; default all)")
    p.add_argument("--skip-checks", action="store_true",
                   help="on a device, time without first checking the kernel over the test shapes")
    p.add_argument("--copy-mib", type=int, default=512, help="size of the bandwidth-probe copy (default 512 MiB)")
    a = p.parse_args(argv)
    if a.d < 1 or a.rank < 0 or a.iters < 1 or a.calls < 1 or a.copy_mib < 1:
        p.error("--d, --iters, --calls and --copy-mib must be positive and --rank non-negative")
    if a.check_cases and max(a.check_cases) > len(CHECK_CASES):
        p.error(f"--check-cases: there are {len(CHECK_CASES)} cases")
    return a


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    a = parse_args(argv)
    dtype = jnp.dtype(a.dtype)
    rows = list(a.decode_rows) + list(a.train_rows)
    platform = jax.default_backend()
    if platform in ("gpu", "tpu"):
        cases = CHECK_CASES if a.check_cases is None else [CHECK_CASES[i - 1] for i in a.check_cases]
        checks = [] if a.skip_checks else run_device_checks(cases)
        report = run_device(rows, a.d, a.rank, dtype, a.iters, a.copy_mib, a.calls)
        report["checks"] = checks
    else:
        report = run_cpu_correctness(rows, a.d, a.rank, dtype)
    report.update(platform=platform, device=jax.devices()[0].device_kind, jax=jax.__version__)
    print_table(report)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {a.out}")
    failed = [r for r in report.get("checks", []) if not r["ok"]]
    if report["mode"] != "timing":
        failed += [r for r in report["results"] if not r["ok"]]
    if failed:
        print(f"bench: error: the kernel disagrees with the reference (or failed) in {len(failed)} case(s)",
              file=sys.stderr)
        sys.exit(1)
    return report


if __name__ == "__main__":
    main()
