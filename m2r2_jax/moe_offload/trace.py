"""A routing trace: what the slow stream routed to and what each predictor said, per decoded token.

Recorded from real decoding (`record.py`), replayed by the simulator (`simulator.py`) and scored for
recall (`metrics.py`). Batch 1: every row is one decoded token of one prompt.

Issue points. A predictor's guess for layer l becomes available at a fixed point of the token's
schedule, the *issue key*: the op before which the prefetch is started. Ops are

    ("attn", l)    slow layer l's attention sub-block and router (0-based l)
    ("moe", l)     slow layer l's routed experts: the demand point
    ("fast_attn", i), ("fast_mlp", i)   fast step i (only for predictors that run the fast stream),
                   placed between slow layer b-1 and slow layer b.

The *lead* of a guess is how many layer boundaries lie between its issue point and the demand:
issuing before ("attn", m) gives lead l - m + 1 for layer l (next-gate at lookahead a has lead a;
a fast-stream guess issued before slow layer b has lead l - b + 1).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from m2r2_jax.errors import DataError

OpKey = tuple
NO_PREDICTION = -1


@dataclasses.dataclass
class RoutingTrace:
    n_layers: int
    n_experts: int
    top_k: int
    true: np.ndarray  # [N, L, k] experts the slow stream routed each token to
    rankings: dict  # predictor name -> [N, L, E] experts ranked best-first (-1 rows: no guess)
    issue: dict  # predictor name -> per layer OpKey or None (static over tokens)
    uses_fast: dict  # predictor name -> whether its schedule includes the fast pass
    branch_layer: int = 0
    visited: tuple = ()  # 0-based layer of each fast step
    moe_fast_mlp: str = "none"
    fast_routes: Optional[np.ndarray] = None  # [N, K, k] the fast stream's own top-k at visited layers
    # predictor name -> [N, L, E] router probabilities behind each ranking (softmax of the logits the
    # predictor computed; 0 where it makes no guess). Optional: confidence-gated prefetch needs it.
    probs: Optional[dict] = None
    # predictor name -> fast steps its schedule runs per token (default: all K for a predictor that
    # uses the fast stream); the m2r2 predictor stops after the last step its sources need.
    fast_steps: dict = dataclasses.field(default_factory=dict)
    notes: dict = dataclasses.field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return int(self.true.shape[0])

    @property
    def predictors(self) -> tuple:
        return tuple(self.rankings)

    def fast_steps_of(self, name: str) -> int:
        """Fast steps predictor `name` runs per token (0 if it does not use the fast stream)."""
        if not self.uses_fast.get(name, False):
            return 0
        return int(self.fast_steps.get(name, len(self.visited)))

    def lead(self, name: str) -> np.ndarray:
        """[L] lead in layers of each layer's guess (-1 where the predictor makes none)."""
        out = np.full(self.n_layers, NO_PREDICTION, np.int64)
        for layer, key in enumerate(self.issue[name]):
            if key is None:
                continue
            out[layer] = layer - issue_layer(key, self.branch_layer) + 1
        return out

    def validate(self) -> "RoutingTrace":
        n, L, k = self.true.shape
        if L != self.n_layers or k != self.top_k:
            raise DataError(f"trace: true routing has shape {self.true.shape}, expected [N, {self.n_layers}, {self.top_k}]")
        for name, r in self.rankings.items():
            if r.shape != (n, L, self.n_experts):
                raise DataError(f"trace: ranking of {name!r} has shape {r.shape}, expected {(n, L, self.n_experts)}")
            if len(self.issue[name]) != L:
                raise DataError(f"trace: issue points of {name!r} must list {L} layers")
        for name, p in (self.probs or {}).items():
            if name not in self.rankings or p.shape != self.rankings[name].shape:
                raise DataError(f"trace: probabilities of {name!r} must match its ranking's shape "
                                f"{self.rankings.get(name, np.empty(0)).shape}, got {p.shape}")
        for name, steps in self.fast_steps.items():
            if not 0 <= int(steps) <= len(self.visited):
                raise DataError(f"trace: {name!r} runs {steps} fast steps; the fast stream has {len(self.visited)}")
            for key in self.issue.get(name, ()):
                if key is not None and key[0] in ("fast_attn", "fast_mlp") and key[1] >= int(steps):
                    raise DataError(f"trace: {name!r} issues a guess at {tuple(key)} but runs only {steps} fast steps")
        if self.fast_routes is not None and self.fast_routes.shape[:2] != (n, len(self.visited)):
            raise DataError(f"trace: fast_routes has shape {self.fast_routes.shape}, expected [N, {len(self.visited)}, k]")
        return self


def issue_layer(key: OpKey, branch_layer: int) -> int:
    """The slow-layer boundary an issue key sits at (fast ops sit just before slow layer b)."""
    kind = key[0]
    if kind in ("attn", "moe"):
        return int(key[1])
    if kind in ("fast_attn", "fast_mlp"):
        return branch_layer
    raise ValueError(f"unknown op key {key!r}")


def next_gate_issue(n_layers: int, lookahead: int) -> list:
    """Layer l's guess from h_{l-a+1}, the output of layer l-a (h_0 = the embeddings): issued
    before slow layer l-a+1's attention."""
    return [("attn", l - lookahead + 1) if l - lookahead + 1 >= 0 else None for l in range(n_layers)]


def blend_with_oracle(trace: RoutingTrace, name: str, share: float, seed: int = 0, new_name: str = "blend") -> RoutingTrace:
    """A what-if predictor `new_name`: predictor `name` whose guess is replaced by the true routing on
    a random `share` of its (token, layer) guesses, with the same issue points and fast pass. Its
    recall rises from `name`'s toward 1 while its lead and cost stay `name`'s: how much recall the
    predictor would need before prefetching pays (report["recall_needed"])."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share={share} is outside [0, 1]")
    if "oracle" not in trace.rankings or name not in trace.rankings:
        raise DataError(f"trace: blending needs the oracle and {name!r} rankings")
    mine = trace.rankings[name]
    truth = np.random.default_rng(seed).random(mine.shape[:2]) < share
    truth &= mine[..., 0] >= 0  # layers the predictor does not guess stay unguessed
    ranks = np.where(truth[..., None], trace.rankings["oracle"], mine)
    probs = dict(trace.probs or {})
    if name in probs and "oracle" in probs:
        probs[new_name] = np.where(truth[..., None], probs["oracle"], probs[name])
    return dataclasses.replace(
        trace, rankings=dict(trace.rankings, **{new_name: ranks}), issue=dict(trace.issue, **{new_name: trace.issue[name]}),
        uses_fast=dict(trace.uses_fast, **{new_name: trace.uses_fast.get(name, False)}),
        fast_steps=dict(trace.fast_steps, **({new_name: trace.fast_steps[name]} if name in trace.fast_steps else {})),
        probs=probs or None).validate()


def oracle_with_lead(trace: RoutingTrace, lead: int, new_name: str = "oracle_lead") -> RoutingTrace:
    """A what-if predictor `new_name`: the true routing, issued `lead` layers ahead of each layer's
    demand (before slow layer l - lead + 1; layers closer to the token's start than that get it at
    the token's start). No fast pass. How much lead a perfect predictor needs (report["lead_needed"])."""
    if lead < 1:
        raise ValueError(f"lead={lead} must be >= 1 layer")
    issue = [key if key is not None else ("attn", 0) for key in next_gate_issue(trace.n_layers, lead)]
    probs = dict(trace.probs or {})
    if "oracle" in probs:
        probs[new_name] = probs["oracle"]
    return dataclasses.replace(trace, rankings=dict(trace.rankings, **{new_name: trace.rankings["oracle"]}),
                               issue=dict(trace.issue, **{new_name: issue}), probs=probs or None).validate()
