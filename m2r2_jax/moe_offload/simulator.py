"""Trace replay through a discrete-event model of one transfer link and a sequential compute unit.

Model (per decoded token, ops in schedule order; see `trace.py` for the op keys):

* Compute runs one op at a time. An ("moe", l) op may start only when every expert the slow stream
  routed to at layer l is in layer l's device cache *and has arrived*; the wait is stall time.
* The link carries one expert at a time; a transfer takes latency + bytes / bandwidth. Blocking
  loads (misses) are served before queued prefetches (`demand_priority`, default; off = first
  come first served), and a queued prefetch whose slot is reused before it starts is cancelled.
  With `link_chunks` > 1 an expert moves in that many pieces (each paying the latency) and a
  blocking load also overtakes the rest of a prefetch already on the link, at its next chunk
  boundary (a copy engine fed chunk by chunk, demand first); 1 (the default) moves whole
  experts, as the real engine's `jax.device_put` per expert does.
* Before each op, the predictor's guesses whose issue key is that op are prefetched (top
  `prefetch_k` experts; victims chosen by the layer's `SlotTable` policy, the layer's guess
  protected). With `min_confidence` only guesses at least that confident are fetched
  (`guess_confidence`); a guessed expert already resident still counts as a use. Joined predictors
  ("m2r2+next_gate") each issue their own guess at their own op. A demand for an expert that is
  neither resident nor in flight is a miss: it is issued at the demand time and blocks.
* Predictors that run the fast stream pay its ops (a fast attention sub-block + its MLP per step
  run: all K steps, or for m2r2 up to the last step its sources need, `trace.fast_steps`). With
  moe_fast_mlp == "experts" the fast MLP at step i demands its own top-k at layer j_i: those loads
  block the fast pass and are the prefetch (charged in bytes and time).
* The makespan is max(end of the last op, end of the last transfer).
* Policy "belady" (simulator only) evicts by next use, read from the trace's true routing: an
  expert's next use at layer l during token n is the first token m >= n that routes layer l to it
  (the current token's own demand is "now"; never again = inf). Under it a prefetch is skipped
  when the victim would be needed no later than the prefetched expert; under the frequency
  policies when the victim has been demanded more often (`SlotTable.victim`'s admission).

Analytic anchors (tested): all resident -> total = compute; no reuse and no prediction -> total =
compute + misses x transfer time; always max(compute, transfers) <= total <= compute + transfers.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from m2r2_jax.errors import ConfigError
from m2r2_jax.moe_offload.platforms import CostModel
from m2r2_jax.moe_offload.policies import SlotTable, check_policy
from m2r2_jax.moe_offload.predictors import check_min_confidence, guess_confidence
from m2r2_jax.moe_offload.trace import RoutingTrace


@dataclasses.dataclass
class SimResult:
    predictor: str
    policy: str
    capacity: int
    total_s: float
    compute_s: float
    stall_s: float
    transfers: int
    bytes_moved: int
    demand_hits: int
    demand_misses: int
    late_hits: int  # resident-or-in-flight at demand time but not yet arrived
    prefetches: int
    useful_prefetches: int
    fast_loads: int
    tokens: int
    cancelled: int = 0  # queued prefetches dropped because their slot was reused first
    link_chunks: int = 1  # pieces per expert on the link (> 1: a demand preempts a prefetch)
    link_busy_s: float = 0.0  # time the link spent moving chunks

    @property
    def hit_rate(self) -> float:
        d = self.demand_hits + self.demand_misses
        return self.demand_hits / d if d else 1.0

    @property
    def s_per_token(self) -> float:
        return self.total_s / max(self.tokens, 1)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(hit_rate=self.hit_rate, s_per_token=self.s_per_token)
        return d


def token_schedule(trace: RoutingTrace, predictor: str) -> list:
    """Op keys of one token for `predictor` (the fast pass sits before slow layer b)."""
    ops = []
    for l in range(trace.n_layers):
        if l == trace.branch_layer:
            for i in range(trace.fast_steps_of(predictor)):
                ops += [("fast_attn", i), ("fast_mlp", i)]
        ops += [("attn", l), ("moe", l)]
    return ops


def next_use_table(trace: RoutingTrace) -> np.ndarray:
    """[N, L, E] float: the first token m >= n whose true routing at layer l includes expert e
    (inf if none), for Belady eviction."""
    n_tok, L, E = trace.n_tokens, trace.n_layers, trace.n_experts
    member = np.zeros((n_tok, L, E), bool)
    np.put_along_axis(member, np.asarray(trace.true, np.int64), True, axis=-1)
    out = np.empty((n_tok, L, E))
    nxt = np.full((L, E), np.inf)
    for n in range(n_tok - 1, -1, -1):
        nxt = np.where(member[n], float(n), nxt)
        out[n] = nxt
    return out


def _op_time(key, costs: CostModel) -> float:
    return {"attn": costs.attn_s, "moe": costs.moe_s, "fast_attn": costs.fast_attn_s,
            "fast_mlp": costs.fast_mlp_s}[key[0]]


class Link:
    """One transfer link serving one expert at a time, in `chunks` equal pieces per expert.

    Transfers are (re)laid out in service order each time one is added: a chunk that has started
    cannot move; what is queued can. With `demand_priority`, a blocking load (a miss, or a demand
    on an expert still queued) goes ahead of queued prefetches. With `chunks` > 1 it also goes
    ahead of the rest of a prefetch already on the link, which resumes afterwards: a copy engine
    fed chunk by chunk, demand first, so that a prefetch delays a miss by one chunk at most
    instead of a whole expert. Every chunk pays the link latency. A queued prefetch whose slot
    was overwritten before it started is cancelled (it moves no bytes); a prefetch preempted
    part-way whose slot is overwritten stops there (the chunks it moved count)."""

    def __init__(self, transfer_s: float, demand_priority: bool, on_ready, chunks: int = 1,
                 latency_s: float = 0.0):
        if chunks < 1:
            raise ConfigError(f"link chunks={chunks} is invalid: expected a positive number of pieces per expert")
        self.chunk_s = (transfer_s - latency_s) / chunks + latency_s
        self.chunks = chunks
        self.demand_priority = demand_priority
        self.on_ready = on_ready  # callback(layer, slot, gen, ready_time)
        self.pending: list = []  # not finished at the last layout, in service order
        self.committed_end = 0.0  # end of the last chunk that has started
        self.committed = 0  # transfers that moved at least one chunk
        self.chunks_moved = 0
        self.cancelled = 0

    @property
    def busy_s(self) -> float:
        return self.chunks_moved * self.chunk_s

    def _commit(self, now: float, live) -> None:
        """Fix every chunk that has started by `now`; drop queued work whose slot was reused."""
        while self.pending and self.pending[0]["start"] <= now:
            x = self.pending[0]
            started = min(x["left"], int((now - x["start"]) // self.chunk_s) + 1)
            if not x["moved"]:
                self.committed += 1
            x["moved"] += started
            x["left"] -= started
            self.chunks_moved += started
            self.committed_end = x["start"] + started * self.chunk_s
            if x["left"]:
                x["start"] = self.committed_end  # the rest may yield to a demand (chunks > 1)
                break
            self.pending.pop(0)
        keep = [x for x in self.pending if live(x)]
        self.cancelled += sum(1 for x in self.pending if not live(x) and not x["moved"])
        self.pending = keep

    def _layout(self, now: float) -> None:
        free = max(now, self.committed_end)
        for x in self.pending:
            x["start"] = max(free, x["issue"])
            x["end"] = free = x["start"] + x["left"] * self.chunk_s
            self.on_ready(x["layer"], x["slot"], x["gen"], x["end"])

    def _first_after_blocking(self) -> int:
        """Queue index a new blocking load takes: behind earlier blocking loads, ahead of every
        prefetch (a prefetch in progress can yield only at a chunk boundary, i.e. when chunks > 1)."""
        n = 0
        while n < len(self.pending) and self.pending[n]["blocking"]:
            n += 1
        return n

    def add(self, now: float, layer: int, slot: int, gen: int, blocking: bool, live) -> None:
        self._commit(now, live)
        x = {"issue": now, "layer": layer, "slot": slot, "gen": gen, "blocking": blocking,
             "left": self.chunks, "moved": 0}
        if blocking and self.demand_priority:
            self.pending.insert(self._first_after_blocking(), x)
        else:
            self.pending.append(x)
        self._layout(now)

    def promote(self, now: float, layer: int, slot: int, gen: int, live) -> None:
        """A demand found its expert still queued (or part-way): serve it before the prefetches."""
        if not self.demand_priority:
            return
        self._commit(now, live)
        for i, x in enumerate(self.pending):
            if x["layer"] == layer and x["slot"] == slot and x["gen"] == gen and not x["blocking"]:
                self.pending.pop(i)
                x["blocking"] = True
                self.pending.insert(self._first_after_blocking(), x)
                self._layout(now)
                return

    def finish(self) -> float:
        for x in self.pending:
            self.committed += not x["moved"]
            self.chunks_moved += x["left"]
        if self.pending:
            self.committed_end = self.pending[-1]["end"]
        self.pending = []
        return self.committed_end


def simulate(
    trace: RoutingTrace,
    predictor: str,
    costs: CostModel,
    capacity: int,
    policy: str = "lru",
    prefetch_k: Optional[int] = None,
    all_resident: bool = False,
    demand_priority: bool = True,
    min_confidence: float = 0.0,
    link_chunks: int = 1,
) -> SimResult:
    """Replay `trace` with `predictor`'s guesses (use "none" for on-demand loading).

    `predictor` may join several of the trace's predictors with "+" (e.g. "m2r2+next_gate"): each
    issues its own guess at its own issue point, so a later, better-informed guess can still bring
    in what an earlier one missed. `min_confidence`: prefetch only guesses whose confidence (see
    `guess_confidence`, from `trace.probs`) is at least this; 0 prefetches every guess.
    `link_chunks`: pieces per expert on the link (see `Link`); 1 moves whole experts, as the real
    engine's `jax.device_put` does, and a demand then waits behind a prefetch already started."""
    check_policy(policy)
    parts = [] if predictor == "none" else predictor.split("+")
    for name in parts:
        if name not in trace.rankings:
            raise ConfigError(f"predictor {name!r} is not in the trace: it has {', '.join(trace.rankings)}")
    gated = check_min_confidence(min_confidence) > 0
    if gated and parts and not all(name in (trace.probs or {}) for name in parts):
        raise ConfigError(f"confidence-gated prefetch needs the router probabilities of {predictor!r}; this trace "
                          "has none for it (record it again)")
    if capacity < trace.top_k and not all_resident:
        raise ConfigError(f"cache capacity={capacity} is invalid: a layer needs at least top_k={trace.top_k} slots")
    prefetch_k = trace.top_k if prefetch_k is None else prefetch_k
    L = trace.n_layers
    use_fast = any(trace.uses_fast.get(name, False) for name in parts)
    schedule = token_schedule(trace, next((n for n in parts if trace.uses_fast.get(n)), "none")
                              if not all_resident else "none")
    # guesses issued before each op: op key -> [(layer, predictor)]
    issued_at: dict = {}
    if not all_resident:
        for name in parts:
            for layer, key in enumerate(trace.issue[name]):
                if key is not None:
                    issued_at.setdefault(tuple(key), []).append((layer, name))

    tables = [SlotTable(capacity, policy) for _ in range(L)]
    belady = policy == "belady"
    next_use = next_use_table(trace) if belady and not all_resident else None
    ready = [[0.0] * capacity for _ in range(L)]
    gen = [[0] * capacity for _ in range(L)]  # bumped whenever a slot gets a new expert
    prefetched = [[False] * capacity for _ in range(L)]
    t = 0.0
    res = SimResult(predictor if not all_resident else "all_resident", policy, capacity,
                    0.0, 0.0, 0.0, 0, 0, 0, 0, 0, 0, 0, 0, trace.n_tokens, link_chunks=link_chunks)

    def on_ready(layer, slot, g, when):
        if gen[layer][slot] == g:
            ready[layer][slot] = when

    def live(x):
        return gen[x["layer"]][x["slot"]] == x["gen"]

    link = Link(costs.transfer_s, demand_priority, on_ready, link_chunks, costs.link_latency_s)

    def install(layer: int, slot: int, e: int, now: float, blocking: bool) -> None:
        tables[layer].install(slot, e)
        gen[layer][slot] += 1
        link.add(now, layer, slot, gen[layer][slot], blocking, live)

    def demand(layer: int, experts, now: float, slow: bool) -> float:
        """Make `experts` resident at `layer`; return when the last one has arrived."""
        tab = tables[layer]
        need = [int(e) for e in experts]
        if slow:
            tab.count_uses(need)
        slots = []
        for e in need:
            s = tab.slot_of(e)
            if s is None:
                s = tab.victim(protect=need)
                install(layer, s, e, now, blocking=True)
                prefetched[layer][s] = False
                if slow:
                    res.demand_misses += 1
                else:
                    res.fast_loads += 1
            else:
                tab.touch(s)
                if ready[layer][s] > now:
                    link.promote(now, layer, s, gen[layer][s], live)
                if slow:
                    res.demand_hits += 1
                    res.late_hits += ready[layer][s] > now
                    res.useful_prefetches += prefetched[layer][s]
                    prefetched[layer][s] = False
            slots.append(s)
        return max([now] + [ready[layer][s] for s in slots])

    def prefetch(layer: int, guess, now: float, conf=None) -> None:
        tab = tables[layer]
        tab.set_prediction(guess)
        for e in guess:
            s = tab.slot_of(e)
            if s is not None:
                tab.touch(s)
                continue
            if conf is not None and conf[e] < min_confidence:
                continue
            s = tab.victim(protect=guess, incoming=e)
            if s is None:
                continue
            install(layer, s, e, now, blocking=False)
            prefetched[layer][s] = True
            res.prefetches += 1

    for n in range(trace.n_tokens):
        true_n = trace.true[n]
        if next_use is not None:
            for layer in range(L):
                tables[layer].set_next_use(next_use[n, layer])
        for key in schedule:
            for layer, name in issued_at.get(key, ()):
                guess = [int(e) for e in trace.rankings[name][n, layer, :prefetch_k] if e >= 0]
                if guess:
                    conf = (guess_confidence(trace.probs[name][n, layer], trace.rankings[name][n, layer], trace.top_k)
                            if gated else None)
                    prefetch(layer, guess, t, conf)
            dur = _op_time(key, costs)
            start = t
            if key[0] == "moe" and not all_resident:
                start = demand(key[1], true_n[key[1]], t, slow=True)
            elif key[0] == "moe":
                res.demand_hits += len(true_n[key[1]])
            elif key[0] == "fast_mlp" and use_fast and trace.moe_fast_mlp == "experts":
                start = demand(trace.visited[key[1]], trace.fast_routes[n, key[1]], t, slow=False)
            res.stall_s += start - t
            res.compute_s += dur
            t = start + dur
    link_end = link.finish()
    res.transfers = link.committed
    res.bytes_moved = link.chunks_moved * costs.expert_bytes // link_chunks
    res.cancelled = link.cancelled
    res.link_busy_s = link.busy_s
    res.total_s = max(t, link_end)
    return res


def sweep(trace: RoutingTrace, predictors, costs_by_bw: dict, capacities, policy_for: dict) -> list:
    """Every (predictor, link bandwidth, capacity) cell; `costs_by_bw` maps GB/s -> CostModel."""
    rows = []
    for bw, costs in costs_by_bw.items():
        for cap in capacities:
            for p in predictors:
                r = simulate(trace, p, costs, cap, policy_for.get(p, "lru"))
                rows.append(dict(r.to_dict(), link_gbps=bw, rho=costs.rho))
            r = simulate(trace, "none", costs, cap, all_resident=True)
            rows.append(dict(r.to_dict(), link_gbps=bw, rho=costs.rho))
    return rows


def transfer_bound(res: SimResult, costs: CostModel) -> float:
    """Time the link was busy. Whole experts: the cost model's transfers x `costs.transfer_s`,
    independent of the simulator's own accounting, so the bounds check that too. Chunks: a
    preempted prefetch may stop part-way, which the result's counts cannot express, so the link's
    own busy time (`link_busy_s`)."""
    return res.link_busy_s if res.link_chunks > 1 else res.transfers * costs.transfer_s


def check_bounds(res: SimResult, costs: CostModel, tol: float = 1e-9) -> bool:
    lo = max(res.compute_s, transfer_bound(res, costs))
    hi = res.compute_s + transfer_bound(res, costs)
    return lo - tol <= res.total_s <= hi + tol


