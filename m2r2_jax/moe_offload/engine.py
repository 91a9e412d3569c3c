"""The real offload engine: experts in host memory, a per-layer device slot cache, prefetch.

* `ExpertStore`: every expert's (gate [d, f], up [d, f], down [f, d]) is its own array in host
  memory (memory kind `pinned_host` by default), so loading one expert never slices a stacked host
  array (that would block).
* Each layer has `capacity` device slots (default 2 x experts per token), managed by a
  `SlotTable` (policy "lru", "predictive", "lfu" or "predictive_lfu"; "belady" needs the future and
  is simulator-only).
  Loading is `jax.device_put(host, device)`: dispatch returns at once and the copy runs
  asynchronously, overlapped with the compute that follows. A demand for an expert that is not
  resident is a miss: it is loaded and waited for (a stall).
* Decoding is driven layer by layer from Python (the point of this engine): each layer's attention
  (+ router) and its experts are separate jitted functions; the experts function receives only the
  weights of the slots it needs (padded to a fixed count so it compiles once).
* Predictors (see `predictors.py`) issue prefetches: next_gate after each layer, oracle at the start
  of a token (from a previous pass's recorded routing), m2r2 after the fast pass, which the engine
  runs at the start of the token, up to the last step its sources need (layers before the branch
  point use next_gate). With `min_confidence` only confident guesses are fetched
  (`predictors.guess_confidence`), as in the simulator.

The m2r2 predictor's fast pass (`fast_stream.fast_prefix`, up to the last step its sources read)
runs with a device copy of the base weights, including the experts of the layers it visits: this
engine measures the prediction and overlap mechanics, while the fast pass's own expert loads
(moe_fast_mlp="experts") are charged in the trace-replay simulator. On CPU, host and device memory
are the same RAM: the numbers show the mechanics, not a real platform.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from m2r2_jax.errors import ConfigError, DataError
from m2r2_jax.m2r2 import fast_stream as F
from m2r2_jax.models import transformer as T
from m2r2_jax.models.layers import MLP, DecoderLayer, attend, attention_mask, dtype_of, rms_norm, route
from m2r2_jax.moe_offload.policies import FUTURE_POLICIES, POLICIES, SlotTable, check_policy
from m2r2_jax.moe_offload.predictors import (check_min_confidence, check_predictor, cross_router_logits,
                                             fast_steps_needed, guess_confidence, m2r2_state_plan, ranking,
                                             router_probs)

EXPERT_KEYS = ("experts_gate", "experts_up", "experts_down")


def memory_kinds(device=None) -> tuple:
    """Memory kinds this backend's device exposes (e.g. device, pinned_host, unpinned_host)."""
    device = device or jax.devices()[0]
    return tuple(m.kind for m in device.addressable_memories())


class ExpertStore:
    """Every routed expert of every layer as three separate host-memory arrays."""

    def __init__(self, base_cfg, base_params, device=None, memory_kind: str = "pinned_host"):
        self.device = device or jax.devices()[0]
        kinds = memory_kinds(self.device)
        if memory_kind not in kinds:
            raise ConfigError(f"host memory kind {memory_kind!r} is not available on {self.device}: it has {', '.join(kinds)}")
        self.memory_kind = memory_kind
        host = jax.sharding.SingleDeviceSharding(self.device, memory_kind=memory_kind)
        mlp = base_params["layers"]["mlp"]
        stacked = [np.asarray(jax.device_get(mlp[k])) for k in EXPERT_KEYS]  # [L, E, ...] each
        self.n_layers, self.n_experts = stacked[0].shape[:2]
        self.experts = [[tuple(jax.device_put(s[l, e], host) for s in stacked) for e in range(self.n_experts)]
                        for l in range(self.n_layers)]
        self.expert_bytes = int(sum(s[0, 0].nbytes for s in stacked))


@dataclasses.dataclass
class EngineStats:
    tokens: int = 0
    demand_hits: int = 0
    demand_misses: int = 0
    late_hits: int = 0  # resident but still in flight when needed
    prefetches: int = 0
    transfers: int = 0
    bytes_moved: int = 0
    stall_s: float = 0.0
    wall_s: float = 0.0
    predict_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        d = self.demand_hits + self.demand_misses
        return self.demand_hits / d if d else 1.0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(hit_rate=self.hit_rate, tokens_per_s=self.tokens / self.wall_s if self.wall_s else 0.0)
        return d


# --------------------------------------------------------------------------------------------
# Jitted per-layer pieces (built from the base model's modules)
# --------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(4,))
def _attn_part(cfg, lp, x, positions, cache, layer):
    """Attention sub-block with the KV cache (as in `transformer.layer_forward`), then the MLP
    pre-norm and the router. Returns (x, xn, weights [N, k], idx [N, k], cache)."""
    mod, v = DecoderLayer(cfg), {"params": lp}
    xn = mod.apply(v, x, method="norm_attn")
    q, k, vv = mod.apply(v, xn, positions, method="qkv")
    cache = T.cache_write(cache, layer, positions, k, vv)
    s = T.cache_length(cache)
    k_pos = jnp.broadcast_to(jnp.arange(s)[None], (x.shape[0], s))
    mask = attention_mask(positions, k_pos, cfg.sliding_window)
    a = attend(q, *T.layer_kv(cache, layer), mask)
    x = x + mod.apply(v, a, method="attn_out")
    xn = mod.apply(v, x, method="norm_mlp")
    logits = xn.reshape(-1, cfg.d_model) @ lp["mlp"]["router"]["kernel"].astype(xn.dtype)
    weights, idx = route(cfg, logits)
    return x, xn, weights, idx, cache


@jax.jit
def _expert_chunk(acc, xn_flat, combine, gates, ups, downs):
    """acc + sum_p combine[:, p] * SwiGLU_p(x) over the P slot experts passed in."""
    dt = xn_flat.dtype
    g = jnp.stack(gates).astype(dt)
    u = jnp.stack(ups).astype(dt)
    dn = jnp.stack(downs).astype(dt)
    h = jax.nn.silu(jnp.einsum("nd,pdf->npf", xn_flat, g)) * jnp.einsum("nd,pdf->npf", xn_flat, u)
    y = jnp.einsum("npf,pfd->npd", h, dn)
    return acc + jnp.einsum("npd,np->nd", y, combine.astype(dt))


@functools.partial(jax.jit, static_argnums=(0,))
def _moe_finish(cfg, lp, x, xn, y):
    """Residual add of the routed experts' output (+ the sigmoid-gated shared expert)."""
    if cfg.shared_expert_d_ff:
        flat = xn.reshape(-1, cfg.d_model)
        mlp = MLP(cfg.shared_expert_d_ff, cfg.d_model, dtype_of(cfg.param_dtype))
        _, shared = mlp.apply({"params": lp["mlp"]["shared_expert"]}, flat)
        gate = jax.nn.sigmoid(flat @ lp["mlp"]["shared_expert_gate"]["kernel"].astype(flat.dtype))
        y = y + gate * shared
    return x + y.reshape(x.shape)


@functools.partial(jax.jit, static_argnums=(0,))
def _embed(cfg, params, tokens):
    return T.embed(cfg, params, tokens)


@functools.partial(jax.jit, static_argnums=(0,))
def _head(cfg, params, x):
    logits = T.head(cfg, params, x[:, -1:])
    return logits[:, 0], jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0,))
def _router_logits(cfg, scale, kernel, h):
    """[E] one layer's router logits on state h [B, T, d] (last position, batch 0)."""
    logits = rms_norm(h[:, -1], scale, cfg.rms_eps) @ kernel.astype(h.dtype)
    return logits[0].astype(jnp.float32)


@functools.partial(jax.jit, static_argnums=(0, 1, 7), donate_argnums=(6,))
def _fast_pass(base_cfg, mcfg, base_params, m2r2_params, tokens, positions, cache, n_steps: int):
    """The fast pass of one token, its first `n_steps` steps (the ones the predictor's sources
    need): each visited layer's router logits from the fast stream's own router, and the fast
    states (for the layers the stream skips)."""
    states, own, cache = F.fast_prefix(base_cfg, mcfg, base_params, m2r2_params, tokens, positions, cache, n_steps)
    return own[:, 0, -1].astype(jnp.float32), states[:, :, -1], cache  # own [n, E]; g_1 .. g_n [n, B, d]


@functools.partial(jax.jit, static_argnums=(0,))
def _cross_logits(cfg, params, states):
    return cross_router_logits(cfg, params, states)[:, :, 0]  # [L, M, E]


# --------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------
class OffloadEngine:
    def __init__(self, base_cfg, base_params, *, capacity: Optional[int] = None, policy: str = "lru",
                 predictor: str = "none", mcfg=None, m2r2_params=None, prefetch_k: Optional[int] = None,
                 device=None, host_memory_kind: str = "pinned_host", m2r2_sources=None,
                 min_confidence: float = 0.0):
        if not base_cfg.is_moe:
            raise ConfigError(f"moe offload needs a MoE base model; family {base_cfg.family!r} has n_experts=0")
        self.cfg = base_cfg
        self.k = base_cfg.n_experts_per_tok
        self.capacity = 2 * self.k if capacity is None else int(capacity)
        if not (self.k <= self.capacity <= base_cfg.n_experts):
            raise ConfigError(f"cache capacity={self.capacity} is invalid: expected top_k={self.k} .. n_experts={base_cfg.n_experts} slots")
        self.policy = check_policy(policy)
        if policy in FUTURE_POLICIES:
            engine_ok = ", ".join(p for p in POLICIES if p not in FUTURE_POLICIES)
            raise ConfigError(f"cache policy {policy!r} needs the future routing of every token and is "
                              f"simulator-only (moe_offload.simulator); the engine accepts {engine_ok}")
        self.predictor = check_predictor(predictor)
        if predictor == "m2r2":
            if mcfg is None or m2r2_params is None:
                raise ConfigError("predictor 'm2r2' needs an M2R2 config and parameters")
            mcfg.validate(base_cfg)
            self.m2r2_plan, _ = m2r2_state_plan(base_cfg.n_layers, mcfg.branch_layer,
                                                F.visited_layers(base_cfg, mcfg), m2r2_sources)
            self.fast_steps = fast_steps_needed(self.m2r2_plan)
        self.mcfg, self.m2r2_params = mcfg, m2r2_params
        self.prefetch_k = self.k if prefetch_k is None else int(prefetch_k)
        self.min_confidence = check_min_confidence(min_confidence)
        self.device = device or jax.devices()[0]
        self.store = ExpertStore(base_cfg, base_params, self.device, host_memory_kind)
        self.on_device = jax.sharding.SingleDeviceSharding(self.device, memory_kind="device")
        dense = dict(base_params)
        dense["layers"] = dict(base_params["layers"])
        dense["layers"]["mlp"] = {k: v for k, v in base_params["layers"]["mlp"].items() if k not in EXPERT_KEYS}
        self.dense = jax.device_put(dense, self.on_device)
        self.layer_params = [T.layer_params(self.dense, l) for l in range(base_cfg.n_layers)]
        # only the m2r2 fast pass keeps full base weights on device (see the module docstring)
        self.fast_params = jax.device_put(base_params, self.on_device) if predictor == "m2r2" else None
        d, f = base_cfg.d_model, base_cfg.moe_d_ff
        pdt = dtype_of(base_cfg.param_dtype)
        self._pad = (jnp.zeros((d, f), pdt), jnp.zeros((d, f), pdt), jnp.zeros((f, d), pdt))
        self.reset()

    # -- cache state --------------------------------------------------------------------------
    def reset(self) -> None:
        """Empty every layer's device cache and the statistics."""
        L = self.cfg.n_layers
        self.tables = [SlotTable(self.capacity, self.policy) for _ in range(L)]
        self.slots = [[None] * self.capacity for _ in range(L)]
        self.stats = EngineStats()
        self.routes: list = []  # per decoded token: [L, k] experts the slow stream used

    def preload_all(self) -> None:
        """Fill every slot (capacity must be n_experts): the all-resident rung of the ladder."""
        if self.capacity != self.cfg.n_experts:
            raise ConfigError(f"preloading every expert needs capacity={self.cfg.n_experts}, not {self.capacity}")
        for l in range(self.cfg.n_layers):
            for e in range(self.cfg.n_experts):
                self._load(l, e, ())
        jax.block_until_ready(self.slots)
        self.stats = EngineStats()

    def _load(self, layer: int, e: int, protect, prefetch: bool = False) -> Optional[int]:
        tab = self.tables[layer]
        s = tab.victim(protect, incoming=e if prefetch else None)  # a prefetch must be admitted
        if s is None:
            return None
        tab.install(s, e)
        # asynchronous: device_put dispatches the copy and returns
        self.slots[layer][s] = tuple(jax.device_put(a, self.on_device) for a in self.store.experts[layer][e])
        self.stats.transfers += 1
        self.stats.bytes_moved += self.store.expert_bytes
        return s

    def prefetch(self, layer: int, experts: Sequence[int], confidence=None) -> None:
        """Bring the guessed `experts` (best first) in ahead of their demand; with `min_confidence`,
        only those whose `confidence[e]` reaches it (a guessed expert already resident counts as a use)."""
        guess = [int(e) for e in experts[: self.prefetch_k]]
        tab = self.tables[layer]
        tab.set_prediction(guess)
        for e in guess:
            s = tab.slot_of(e)
            if s is not None:
                tab.touch(s)
            elif confidence is not None and confidence[e] < self.min_confidence:
                continue
            elif self._load(layer, e, guess, prefetch=True) is not None:
                self.stats.prefetches += 1

    def prefetch_from_logits(self, layer: int, logits) -> None:
        """Prefetch the top guesses of router `logits` [E] (confidence-gated if `min_confidence`)."""
        order = ranking(logits)
        conf = guess_confidence(router_probs(logits), order, self.k) if self.min_confidence > 0 else None
        self.prefetch(layer, order, conf)

    def _demand(self, layer: int, experts: Sequence[int]) -> list:
        """Make `experts` resident; block until their weights are on device. Returns their slots."""
        tab = self.tables[layer]
        tab.count_uses(experts)
        slots, fresh = [], []
        for e in experts:
            s = tab.slot_of(e)
            if s is None:
                s = self._load(layer, e, experts)
                self.stats.demand_misses += 1
                fresh.append(s)
            else:
                tab.touch(s)
                self.stats.demand_hits += 1
                if not all(a.is_ready() for a in self.slots[layer][s]):
                    self.stats.late_hits += 1
            slots.append(s)
        t0 = time.perf_counter()
        for s in slots:
            for a in self.slots[layer][s]:
                a.block_until_ready()
        self.stats.stall_s += time.perf_counter() - t0
        return slots

    # -- one layer ----------------------------------------------------------------------------
    def _moe(self, layer: int, x, xn, weights, idx):
        w = np.asarray(weights)
        ids = np.asarray(idx)
        union = sorted(set(int(e) for e in ids.reshape(-1)))
        n = ids.shape[0]
        acc = jnp.zeros((n, self.cfg.d_model), xn.dtype)
        xn_flat = xn.reshape(n, self.cfg.d_model)
        # Experts per call: a fixed size per token count (one compile each), never more than the
        # slots; prefill may need more experts than there are slots and runs in chunks.
        width = min(self.capacity, ids.size)
        for c in range(0, len(union), width):
            chunk = union[c : c + width]
            slots = self._demand(layer, chunk)
            combine = np.zeros((n, width), np.float32)
            for p, e in enumerate(chunk):
                combine[:, p] = np.sum(np.where(ids == e, w, 0.0), axis=-1)
            arrays = [self.slots[layer][s] for s in slots] + [self._pad] * (width - len(chunk))
            acc = _expert_chunk(acc, xn_flat, jnp.asarray(combine), *[tuple(a[i] for a in arrays) for i in range(3)])
        return _moe_finish(self.cfg, self.layer_params[layer], x, xn, acc)

    def _predict_next_gate(self, layer: int, h) -> None:
        """Layer `layer`'s router on its input h (the previous layer's output): prefetch."""
        lp = self.layer_params[layer]
        t0 = time.perf_counter()
        logits = np.asarray(_router_logits(self.cfg, lp["mlp_norm"]["scale"], lp["mlp"]["router"]["kernel"], h))
        self.stats.predict_s += time.perf_counter() - t0
        self.prefetch_from_logits(layer, logits)

    # -- one token ----------------------------------------------------------------------------
    def step(self, tokens, positions, cache, oracle_route=None):
        """Decode (or prefill) tokens [1, T] at positions [1, T]. Returns (last logits, next token,
        cache, per-layer routed experts)."""
        cfg, L = self.cfg, self.cfg.n_layers
        guesses_after: dict = {}
        if self.predictor == "oracle" and oracle_route is not None:
            for l in range(L):
                self.prefetch(l, oracle_route[l])
        if self.predictor == "m2r2" and tokens.shape[1] == 1:
            t0 = time.perf_counter()
            b = self.mcfg.branch_layer
            plan = self.m2r2_plan
            own = cross = None
            if self.fast_steps > 0:
                own, states, cache = _fast_pass(cfg, self.mcfg, self.fast_params, self.m2r2_params, tokens, positions,
                                                cache, self.fast_steps)
                own = np.asarray(own)
                if any(kind == "state" and s >= 1 for kind, s in plan):
                    cross = np.asarray(_cross_logits(cfg, self.dense, states))  # [L, n, E] (g_1..g_n)
            self.stats.predict_s += time.perf_counter() - t0
            for l, (kind, s) in enumerate(plan):
                if kind == "fast":
                    self.prefetch_from_logits(l, own[s])
                elif kind == "state" and s >= 1:
                    self.prefetch_from_logits(l, cross[l, s - 1])
                elif kind == "state":  # g_0 = h_b: the slow input of layer b, known after layer b-1
                    guesses_after.setdefault(b, []).append(l)
        x = _embed(cfg, self.dense, tokens)
        route_rows = []
        for l in range(L):
            if self.predictor == "next_gate" or (self.predictor == "m2r2" and (l < self.mcfg.branch_layer)):
                if tokens.shape[1] == 1:
                    self._predict_next_gate(l, x)
            for m in guesses_after.get(l, ()):
                self._predict_next_gate(m, x)
            x, xn, weights, idx, cache = _attn_part(cfg, self.layer_params[l], x, positions, cache, l)
            route_rows.append(np.asarray(idx))
            x = self._moe(l, x, xn, weights, idx)
        logits, nxt = _head(cfg, self.dense, x)
        return logits, nxt, cache, route_rows

    def generate(self, prompt: Sequence[int], max_new_tokens: int, oracle_routes=None):
        """Greedy decoding of one prompt. Returns (tokens, per-token logits [N, V])."""
        cfg = self.cfg
        prompt = [int(t) for t in prompt]
        if not prompt or min(prompt) < 0 or max(prompt) >= cfg.vocab_size:
            raise DataError(f"a prompt must be a non-empty list of token ids in [0, {cfg.vocab_size})")
        if len(prompt) + max_new_tokens > cfg.max_seq_len:
            raise DataError(f"prompt of {len(prompt)} tokens + {max_new_tokens} new tokens exceeds max_seq_len={cfg.max_seq_len}")
        if self.predictor == "oracle" and (oracle_routes is None or len(oracle_routes) < max_new_tokens - 1):
            raise ConfigError("predictor 'oracle' needs the routing of a previous pass (oracle_routes)")
        cache = jax.device_put(T.init_cache(cfg, 1, len(prompt) + max_new_tokens), self.on_device)
        toks = jnp.asarray([prompt], jnp.int32)
        pos = jnp.arange(len(prompt), dtype=jnp.int32)[None]
        before = dataclasses.replace(self.stats)
        logits, nxt, cache, _ = self.step(toks, pos, cache)
        self.stats = before  # statistics cover decoding; the cache keeps what prefill loaded
        out, all_logits = [], []
        t0 = time.perf_counter()
        for t in range(max_new_tokens):
            tok = int(nxt[0])
            out.append(tok)
            all_logits.append(np.asarray(logits[0]))
            if t == max_new_tokens - 1:
                break
            pos = jnp.full((1, 1), len(prompt) + t, jnp.int32)
            route = oracle_routes[t] if self.predictor == "oracle" else None
            logits, nxt, cache, rows = self.step(jnp.asarray([[tok]], jnp.int32), pos, cache, route)
            self.routes.append(np.stack([r[0] for r in rows]))
            self.stats.tokens += 1
        self.stats.wall_s += time.perf_counter() - t0
        return out, np.stack(all_logits)
