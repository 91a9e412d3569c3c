"""How fast plain decoding could be: the weight-streaming bound of one decoding step.

At batch 1 every decoding step reads every weight a token touches once (all layers, the final norm
and the LM head; of the embedding table a single row), so no decoder can beat

    bound tokens/s = memory bandwidth / bytes of weights read per token

on a machine whose caches cannot hold the model. The bandwidth is measured here, as a STREAM-style
copy (bytes read + bytes written per second) of buffers far larger than the caches, on as many
threads as the process has cores (numpy's copy releases the GIL). Comparing ar's measured tokens/s
with the bound says how much of a decoding step is memory traffic and how much is everything else
(compute, dispatch), which is what a speculative method can and cannot win back.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

from m2r2_jax.bench.cpu_cores import cores_in_use


def weight_bytes_per_token(cfg, params) -> int:
    """Bytes of weights one batch-1 decoding step reads: everything except the embedding table,
    of which one row is read, unless the LM head is tied to it (then all of it is read as the head).
    MoE bases: all experts counted (an upper bound; a token reads its top-k)."""
    total = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(params))
    if cfg.tie_embeddings:
        return total
    emb = params["embed"]["embedding"]
    return total - int(np.prod(emb.shape)) * emb.dtype.itemsize + emb.shape[-1] * emb.dtype.itemsize


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5, threads: int = 0) -> dict:
    """Median copy bandwidth (read + write bytes / s) over `repeats` copies of `nbytes`, split over
    `threads` threads (0: the cores this process may use); with the spread."""
    threads = threads or cores_in_use()
    n = nbytes // 8
    src, dst = np.ones(n), np.empty(n)
    bounds = np.linspace(0, n, threads + 1).astype(int)
    parts = [(dst[a:b], src[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    rates = []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats + 1):  # the first copy touches fresh pages: not timed
            t0 = time.perf_counter()
            list(pool.map(lambda p: np.copyto(*p), parts))
            rates.append(2 * nbytes / (time.perf_counter() - t0))
    rates = rates[1:]
    return {"bytes_per_s": float(np.median(rates)), "spread": [float(min(rates)), float(max(rates))],
            "buffer_bytes": int(nbytes), "threads": int(threads)}


def ar_roofline(cfg, params, ar_tokens_per_s: float) -> dict:
    """ar's measured tokens/s next to the weight-streaming bound on this machine."""
    wb = weight_bytes_per_token(cfg, params)
    bw = copy_bandwidth()
    bound = bw["bytes_per_s"] / wb
    return {"weight_bytes_per_token": wb, "copy_bandwidth": bw, "bound_tokens_per_s": bound,
            "ar_tokens_per_s": float(ar_tokens_per_s), "fraction_of_bound": float(ar_tokens_per_s / bound)}
