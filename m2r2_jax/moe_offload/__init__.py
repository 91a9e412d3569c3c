"""MoE ahead-of-time expert loading driven by the M2R2 fast stream.

  engine.py      the real offload engine: experts in pinned host memory, a per-layer device slot
                 cache, asynchronous `jax.device_put` prefetch, per-layer jitted compute
  policies.py    slot bookkeeping and eviction policies (lru, predictive), shared with the simulator
  predictors.py  none | next_gate | m2r2 | oracle: rankings of experts per layer + issue points
  record.py      routing traces from real greedy decoding (true routing + every predictor's guess)
  trace.py       the trace format, issue points and lead times
  metrics.py     recall@k per layer and by lookahead
  platforms.py   named platforms and real model shapes (every cost assumption, stated)
  simulator.py   discrete-event trace replay: one transfer link + sequential compute
  report.py      `moe_report(...)` (report["moe"] of the demo), plots, prompt files
"""

from m2r2_jax.moe_offload.engine import ExpertStore, OffloadEngine, memory_kinds
from m2r2_jax.moe_offload.report import moe_report, write_plots
from m2r2_jax.moe_offload.simulator import simulate

__all__ = ["ExpertStore", "OffloadEngine", "memory_kinds", "moe_report", "write_plots", "simulate"]
