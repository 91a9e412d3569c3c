"""The decoding engine's public entry: `generate(method, ...)`.

    results = generate("m2r2_spec", cfg, params, prompts, max_new_tokens=64, gamma=4,
                       m2r2=(mcfg, m2r2_params))
    results[i].tokens, .accepted, .rounds, .target_layers, .draft_layers, .layers_per_token

Methods:
- "ar"             plain autoregressive decoding (the reference);
- "m2r2_spec"      lossless self-speculative decoding, drafts from the M2R2 fast stream;
- "distance_spec"  lossless self-speculation drafting with the first E slow layers + exit head,
                   E = round(draft_cost_layers(...)) unless `exit_layer` is given;
- "two_model"      lossless speculative decoding with a separate draft model (`draft=(cfg, params)`);
- "m2r2_exit"      early exit on the fast stream, router decides (lossy by design);
- "distance_exit"  early exit on the slow stream, confidence or saturation decider (lossy).

Every method runs a whole batch inside one jitted `lax.while_loop` with static shapes; prompts are
right-padded and batches are padded with idle rows, so one compiled program serves every batch of
a call. Sequence i draws its randomness from `fold_in(key(seed), line_numbers[i])` (default i),
so results do not depend on the batch size or on the other prompts.

Per sequence the result holds: `tokens` (generated ids, the first from the prefill, stopping after
the first of the `eos_ids` stop tokens or at max_new_tokens), `accepted` (speculative methods: per
verification round, accepted drafts + 1 -- the tokens one verification produced before EOS/length
truncation; empty otherwise), `rounds` (verification rounds; decoding steps after the prefill for
ar and early exit), `target_layers` (base-model layers run per token, summed: layer x token
evaluations after the prefill; a verify pass over G+1 positions counts (G+1) x N less the shared
layers a self-drafter already ran for G of them, `speculative.verify_layers`), `draft_layers`
(drafter layer-equivalents summed over draft steps: E per step for distance_spec,
`draft_cost_layers` for M2R2, the draft model's own layer count for two_model; fast steps for
m2r2_exit), and `layers_per_token`.

For benchmarks: `Engine` (from `build_engine`) exposes the jitted `prefill`, `draft_round` and
`verify` pieces so draft and verify can be timed separately, and `ideal_speedup(...)` gives the
standard speculative speedup bound from the measured acceptance and the draft's relative cost.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from m2r2_jax.decoding import ar, early_exit, speculative
from m2r2_jax.decoding.loop import GenState, prefill, run_rounds
from m2r2_jax.decoding.sampling import Sampling
from m2r2_jax.errors import ConfigError, DataError
from m2r2_jax.m2r2.config import default_m2r2_config  # noqa: F401  (the one fresh default, re-exported)
from m2r2_jax.models.config import ModelConfig
from m2r2_jax.models.transformer import unstack_layers
from m2r2_jax.sharding.plan import maybe_scope

METHODS = ("ar", "m2r2_spec", "distance_spec", "two_model", "m2r2_exit", "distance_exit")
SPEC_METHODS = ("m2r2_spec", "distance_spec", "two_model")
EXIT_METHODS = ("m2r2_exit", "distance_exit")
SELF_DRAFT_METHODS = ("m2r2_spec", "distance_spec")  # drafters that are part of the base (draft_vocab applies)
DRAFT_LENGTHS = ("fixed", "dynamic")
KV_MISSING = ("propagate", "deferred")
LAYER_LOOPS = ("auto", "scan", "unrolled")
DECIDERS = ("confidence", "saturation")


@dataclasses.dataclass
class SequenceResult:
    tokens: list
    accepted: list
    rounds: int
    target_layers: float
    draft_layers: float
    early_exits: int = 0  # early-exit methods: tokens emitted before the last layer

    @property
    def layers(self) -> float:
        return self.target_layers + self.draft_layers

    @property
    def layers_per_token(self) -> float:
        """Decode-phase layer-equivalents per generated token after the first (prefill) one."""
        return self.layers / max(1, len(self.tokens) - 1)

    @property
    def mean_accepted(self) -> float:
        return float(np.mean(self.accepted)) if self.accepted else 1.0


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """Everything static about one compiled generation program (hashable: a jit static arg)."""

    method: str
    cfg: ModelConfig
    sampling: Sampling
    max_new: int
    gamma: int = 1
    dynamic: bool = False
    eos_ids: tuple[int, ...] = ()  # stop after any of these tokens (sorted, unique); (): never
    drafter: Any = None  # speculative drafters (speculative.py) or the early-exit runner
    accept_fn: Optional[Callable] = None  # override of the rejection rule (tests of the tests)
    sharding: Any = None  # a sharding.ShardingPlan (e.g. the specdec preset), or None: one device

    @property
    def commit_width(self) -> int:
        return self.gamma + 1 if self.method in SPEC_METHODS else 1

    def cache_len(self, prompt_width: int) -> int:
        return prompt_width + self.max_new + self.commit_width


def _round_fn(spec: EngineSpec, params, tau):
    if spec.method == "ar":
        return functools.partial(ar.ar_round, spec.cfg, spec.sampling, spec.max_new, spec.eos_ids, params["base"])
    if spec.method in SPEC_METHODS:
        return functools.partial(speculative.spec_round, spec.cfg, spec.drafter, spec.sampling, spec.gamma,
                                 spec.dynamic, spec.max_new, spec.eos_ids, spec.accept_fn, params, tau)
    return functools.partial(early_exit.exit_round, spec.drafter, spec.sampling, spec.max_new, spec.eos_ids,
                             params, tau)


def _prefill(spec: EngineSpec, params, prompts, lengths, keys, valid) -> GenState:
    b, width = prompts.shape
    cache_len = spec.cache_len(width)
    dstate, extra = (), ()
    if spec.method in SPEC_METHODS:
        dstate = spec.drafter.init_state(b, cache_len)
        dstate = spec.drafter.prefill(params, dstate, prompts, lengths)
    elif spec.method in EXIT_METHODS:
        extra = spec.drafter.init_extra(b, cache_len)
    return prefill(spec.cfg, params["base"], prompts, lengths, keys, valid, spec.sampling, max_new=spec.max_new,
                   commit_width=spec.commit_width, cache_len=cache_len, eos_ids=spec.eos_ids, dstate=dstate,
                   extra=extra)


def _run_batch(spec: EngineSpec, params, prompts, lengths, keys, valid, tau) -> GenState:
    with maybe_scope(spec.sharding):  # traced with the plan's activation constraints, if any
        st = _prefill(spec, params, prompts, lengths, keys, valid)
        return run_rounds(_round_fn(spec, params, tau), st, spec.max_new)


# Prefill + the whole generation loop for one padded batch, in one compiled program.
run_batch = functools.partial(jax.jit, static_argnums=0)(_run_batch)


def _sharded_runner(engine: "Engine", batch: int, width: int):
    """`run_batch` for a sharded engine, compiled once per batch shape (see `sharded_jit`)."""
    key = (batch, width)
    if key not in engine.compiled:
        engine.compiled[key] = sharded_jit(engine.spec, engine.params, engine.param_shardings, batch, width)
    return engine.compiled[key]


def sharded_jit(spec: EngineSpec, params, param_shardings, batch: int, width: int):
    """`run_batch` under `spec.sharding` as a `jax.jit` with explicit in/out shardings:
    parameters by their logical axes, prompts and per-sequence state over the batch axes, the KV
    cache by (batch, kv heads). `params` may be abstract (ShapeDtypeStructs: ahead-of-time
    checks). Keys travel as raw key data (global arrays of typed keys cannot be built from host
    data on every platform)."""
    plan = spec.sharding
    rows = plan.sharding(("batch",))

    def body(params, prompts, lengths, key_data, valid, tau):
        return _run_batch(spec, params, prompts, lengths, jax.random.wrap_key_data(key_data), valid, tau)

    abstract = jax.eval_shape(body, params, *abstract_batch(batch, width), jnp.float32(0))
    return jax.jit(body, in_shardings=(param_shardings, rows, rows, rows, rows, plan.replicated),
                   out_shardings=state_shardings(plan, abstract, batch))


def abstract_batch(batch: int, width: int):
    return (jax.ShapeDtypeStruct((batch, width), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.int32),
            jax.ShapeDtypeStruct((batch, 2), jnp.uint32), jax.ShapeDtypeStruct((batch,), jnp.bool_))


def state_shardings(plan, abstract: GenState, batch: int):
    """Per-leaf shardings of a generation state: 5-D leaves are KV caches (layers, batch, kv
    heads, length, head_dim); other leaves with a leading batch dimension split over the batch axes;
    the rest replicated."""
    from m2r2_jax.models.transformer import CACHE_AXES

    def pick(x):
        if x.ndim == 5:
            return plan.fitted_sharding(CACHE_AXES, x.shape)
        if x.ndim >= 1 and x.shape[0] == batch:
            return plan.fitted_sharding(("batch",), x.shape)
        return plan.replicated

    return jax.tree.map(pick, abstract)


# Separately jitted pieces for benchmarks (time the draft and the verify pass on their own).
@functools.partial(jax.jit, static_argnums=0)
def prefill_batch(spec: EngineSpec, params, prompts, lengths, keys, valid) -> GenState:
    return _prefill(spec, params, prompts, lengths, keys, valid)


@functools.partial(jax.jit, static_argnums=0)
def draft_round(spec: EngineSpec, params, st: GenState, tau):
    """Drafting of one speculative round: a `speculative.Draft`."""
    from m2r2_jax.decoding.loop import round_keys

    k_draft = jax.vmap(lambda k: jax.random.split(k, 2)[0])(round_keys(st.keys, st.it + 1))
    return speculative.draft(spec.drafter, spec.sampling, spec.gamma, spec.dynamic, params, st, tau, k_draft)


@functools.partial(jax.jit, static_argnums=0)
def verify_pass(spec: EngineSpec, params, st: GenState, cache, drafts, hidden=None):
    """The slow verification pass of one round (`hidden`: the draft's shared-layer output, see
    `speculative.verify`): (logits [B, G+1, V], cache)."""
    return speculative.verify(spec.cfg, params, st, cache, drafts, hidden, spec.drafter.shared_layers)


@functools.partial(jax.jit, static_argnums=0)
def one_round(spec: EngineSpec, params, st: GenState, tau) -> GenState:
    st = _round_fn(spec, params, tau)(st)
    return st._replace(it=st.it + 1)


def ideal_speedup(mean_tokens_per_round: float, gamma: int, draft_cost_ratio: float) -> float:
    """Speedup bound of speculative decoding when a verify pass costs one target step: a round
    yields `mean_tokens_per_round` tokens for gamma draft steps of relative cost c plus one verify:
    E[tokens] / (gamma * c + 1)."""
    return mean_tokens_per_round / (gamma * draft_cost_ratio + 1.0)


def draft_cost_ratio(spec: EngineSpec) -> float:
    """One draft step's cost relative to one base-model step, LM heads included (matmul weights
    touched per token): (draft layer-equivalents + its head) / (N + the full head), a
    self-drafter's head over its draft vocabulary when it has one. For two_model: the draft
    model's whole step over the base's."""
    from m2r2_jax.m2r2.fast_stream import head_cost_layers, layer_macs

    if spec.method not in SPEC_METHODS:
        raise ConfigError(f"method {spec.method!r} has no draft")
    d, cfg = spec.drafter, spec.cfg
    base_step = cfg.n_layers + head_cost_layers(cfg)
    if isinstance(d, speculative.TwoModelDrafter):
        dc = d.draft_cfg
        in_base_layers = layer_macs(dc) / layer_macs(cfg)
        return (dc.n_layers + head_cost_layers(dc)) * in_base_layers / base_step
    return (d.cost_per_token() + head_cost_layers(cfg, d.draft_vocab)) / base_step


# --------------------------------------------------------------------------------------------
# Building the static spec from user-level options
# --------------------------------------------------------------------------------------------
def _default_m2r2(cfg: ModelConfig, m2r2):
    if m2r2 is not None:
        return m2r2
    from m2r2_jax.m2r2.fast_stream import init_m2r2_params

    mcfg = default_m2r2_config(cfg)
    return mcfg, init_m2r2_params(cfg, mcfg, jax.random.key(0))


def check_eos_ids(eos_ids, vocab_size: int) -> tuple[int, ...]:
    """Stop ids as a sorted tuple of unique ints (hashable: they sit in the static EngineSpec and
    unroll to one compare each). None, one int or a sequence of ints, each in [0, vocab_size); bools
    and floats are refused rather than coerced (True or 2.0 is a mistake, not a token id)."""
    if eos_ids is None:
        return ()
    if isinstance(eos_ids, np.ndarray):  # numpy ints become Python ints, floats stay floats (refused)
        eos_ids = eos_ids.tolist()
    ids = [eos_ids] if isinstance(eos_ids, (int, np.integer)) else eos_ids
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, set, frozenset)):
        raise ConfigError(f"eos_ids={eos_ids!r} is invalid: expected None, a token id or a sequence of token ids")
    for e in ids:
        if isinstance(e, (bool, np.bool_)) or not isinstance(e, (int, np.integer)) or not (0 <= e < vocab_size):
            raise ConfigError(f"eos_ids has {e!r}, which is not a token id: expected ints in [0, {vocab_size})")
    return tuple(sorted({int(e) for e in ids}))


def distance_exit_layer(cfg: ModelConfig, mcfg) -> int:
    """E for distance_spec: the number of slow layers costing what one M2R2 draft costs."""
    from m2r2_jax.m2r2.fast_stream import draft_cost_layers

    return int(min(max(1, round(draft_cost_layers(cfg, mcfg))), cfg.n_layers))


@dataclasses.dataclass(frozen=True)
class Engine:
    spec: EngineSpec
    params: Any  # {"base": ..., "m2r2": ..., "draft": ..., "exit_norm_scale": ..., "draft_head": ...}
    param_shardings: Any = None  # sharded engines: NamedSharding per leaf of params
    placement_notes: dict = dataclasses.field(default_factory=dict, compare=False)  # sharded: padded / replicated dims
    compiled: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)


def build_engine(
    method: str,
    cfg: ModelConfig,
    base_params,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    gamma: int = 4,
    draft_length: str = "fixed",
    eos_ids: Union[None, int, Sequence[int]] = None,
    m2r2=None,
    draft=None,
    exit_layer: Optional[int] = None,
    exit_norm_scale=None,
    decider: str = "confidence",
    exit_confirm: bool = False,
    kv_missing: str = "propagate",
    deferred_window: int = 8,
    accept_fn: Optional[Callable] = None,
    plan=None,
    reuse_shared_layers: bool = True,
    draft_vocab=None,
    layer_loop: str = "scan",
) -> Engine:
    """Validate the options and assemble the static spec + parameter tree of one method. With a
    `plan` (`sharding.ShardingPlan`, e.g. the specdec preset) the parameters are placed on its
    mesh by their logical axes and every batch runs sharded (same tokens as unsharded).
    `reuse_shared_layers` (m2r2_spec, distance_spec): the verification pass takes the drafter's
    exact output of the base layers it shares (M2R2's b branch layers, distance_spec's E) instead
    of running them again; off only to measure what that saves.
    `draft_vocab` (m2r2_spec, distance_spec): token ids the draft head scores (`decoding.draft_vocab`;
    None: the whole vocabulary). Verification keeps the full head: output stays lossless.
    `layer_loop`: "scan" (a `lax.scan` over the stacked layers), "unrolled" (the base's and the
    draft model's layers unstacked, `transformer.unstack_layers`, and every layer loop unrolled:
    faster one-token steps on CPU, longer compiles; no sharding plan) or "auto" (`resolve_layer_loop`). Tokens are the same either way.
    `eos_ids`: stop a sequence after the first token that is any of these ids (`check_eos_ids`).
    `exit_confirm` (m2r2_exit): a token the router releases leaves only if its exit head's max
    probability is >= tau too (`early_exit.M2R2Exit.confirm`)."""
    if method not in METHODS:
        raise ConfigError(f"method={method!r} is invalid: expected one of {', '.join(METHODS)}")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens <= 0:
        raise ConfigError(f"max_new_tokens={max_new_tokens!r} is invalid: expected a positive integer")
    sampling = Sampling(float(temperature), float(top_p)).validate()
    eos_ids = check_eos_ids(eos_ids, cfg.vocab_size)
    if method in SPEC_METHODS and (not isinstance(gamma, (int, np.integer)) or gamma < 1):
        raise ConfigError(f"gamma={gamma!r} is invalid: expected an integer >= 1")
    if draft_length not in DRAFT_LENGTHS:
        raise ConfigError(f"draft_length={draft_length!r} is invalid: expected fixed or dynamic")
    if kv_missing not in KV_MISSING:
        raise ConfigError(f"kv_missing={kv_missing!r} is invalid: expected propagate or deferred")
    if kv_missing == "deferred" and (not isinstance(deferred_window, (int, np.integer)) or deferred_window < 1):
        raise ConfigError(f"deferred_window={deferred_window!r} is invalid: expected a positive integer")
    if decider not in DECIDERS:
        raise ConfigError(f"decider={decider!r} is invalid: expected confidence or saturation")
    if exit_confirm and method != "m2r2_exit":
        raise ConfigError(f"exit_confirm is for m2r2_exit (its router's exits confirmed by the exit head), not {method}")
    layer_loop = resolve_layer_loop(layer_loop, method, plan)
    params = {"base": base_params}
    drafter = None
    n_vocab = 0
    if draft_vocab is not None:
        from m2r2_jax.decoding import draft_vocab as DV
        from m2r2_jax.models.transformer import head_kernel_columns

        if method not in SELF_DRAFT_METHODS:
            raise ConfigError(f"a draft vocabulary is for the self-drafting methods m2r2_spec and distance_spec, "
                              f"not {method}")
        ids = DV.check_ids(draft_vocab, cfg.vocab_size)
        n_vocab = int(ids.size)
        params["draft_head"] = {"ids": jnp.asarray(ids), "kernel": head_kernel_columns(cfg, base_params, ids)}
    if method == "distance_spec":
        # only the M2R2 config matters here (it sets E); no parameters are initialised
        mcfg = m2r2[0] if m2r2 is not None else default_m2r2_config(cfg)
        e = distance_exit_layer(cfg, mcfg.validate(cfg)) if exit_layer is None else int(exit_layer)
        if not (1 <= e <= cfg.n_layers):
            raise ConfigError(f"exit_layer={exit_layer!r} is invalid: expected 1..n_layers={cfg.n_layers}")
        drafter = speculative.DistanceDrafter(cfg, e, bool(reuse_shared_layers), n_vocab)
    elif method in ("m2r2_spec", "m2r2_exit"):
        mcfg, m2r2_params = _default_m2r2(cfg, m2r2)
        mcfg.validate(cfg)
        if method == "m2r2_spec":
            drafter = speculative.M2R2Drafter(cfg, mcfg, bool(reuse_shared_layers), n_vocab)
            params["m2r2"] = m2r2_params
        else:
            drafter = early_exit.M2R2Exit(cfg, mcfg, kv_missing, int(deferred_window), bool(exit_confirm))
            params["m2r2"] = m2r2_params
    elif method == "two_model":
        if draft is None:
            raise ConfigError("method two_model needs a draft model (--draft-checkpoint)")
        dcfg, dparams = draft
        if dcfg.vocab_size != cfg.vocab_size:
            raise ConfigError(f"the draft model's vocabulary ({dcfg.vocab_size}) differs from the base's ({cfg.vocab_size})")
        drafter = speculative.TwoModelDrafter(dcfg)
        params["draft"] = dparams
    elif method == "distance_exit":
        drafter = early_exit.DistanceExit(cfg, decider, kv_missing, int(deferred_window))
    if exit_norm_scale is not None:
        params["exit_norm_scale"] = exit_norm_scale
    if layer_loop == "unrolled":
        params = {k: (unstack_layers(v) if k in ("base", "draft") else v) for k, v in params.items()}
    spec = EngineSpec(method=method, cfg=cfg, sampling=sampling, max_new=int(max_new_tokens),
                      gamma=int(gamma) if method in SPEC_METHODS else 1,
                      dynamic=(draft_length == "dynamic" and method in SPEC_METHODS),
                      eos_ids=eos_ids, drafter=drafter, accept_fn=accept_fn, sharding=plan)
    if plan is None:
        return Engine(spec, params)
    from m2r2_jax.sharding.params import named_placement_notes, param_shardings, put_global

    by_axes = {k: v for k, v in params.items() if k not in ("exit_norm_scale", "draft_head")}  # others: replicated
    shardings = {k: (param_shardings(plan, v) if k in by_axes else jax.tree.map(lambda _: plan.replicated, v))
                 for k, v in params.items()}
    return Engine(spec, put_global(params, shardings), shardings, named_placement_notes(plan, by_axes))


# --------------------------------------------------------------------------------------------
# Prompts and batches
# --------------------------------------------------------------------------------------------
def check_prompts(cfg: ModelConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  names: Optional[Sequence[str]] = None) -> list:
    """Validate token prompts; returns them as lists of ints. Errors name the prompt (`names[i]`,
    default "prompt i")."""
    out = []
    for i, p in enumerate(prompts):
        name = names[i] if names is not None else f"prompt {i}"
        ids = [int(t) for t in np.asarray(p, dtype=np.int64).reshape(-1)]
        if not ids:
            raise DataError(f"{name} is empty")
        bad = [t for t in ids if not (0 <= t < cfg.vocab_size)]
        if bad:
            raise DataError(f"{name} has token id {bad[0]} outside the vocabulary [0, {cfg.vocab_size})")
        if len(ids) + max_new_tokens > cfg.max_seq_len:
            raise DataError(f"{name} is too long: {len(ids)} tokens + max_new_tokens={max_new_tokens} exceed the "
                            f"model's context of {cfg.max_seq_len}")
        out.append(ids)
    return out


def bucket(n: int, floor: int = 1, limit: Optional[int] = None) -> int:
    """The smallest size >= n (and >= floor) of the ladder 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, ...
    (2^k and 3 * 2^(k-1)), capped at `limit` (never below n). Shapes drawn from it bound the programs a
    process compiles to two per doubling of the prompt width or batch, for at most 1.5x padding."""
    n = max(int(n), int(floor), 1)
    size = 1
    while size < n:
        power_of_two = size >= 2 and size & (size - 1) == 0
        size = size * 3 // 2 if power_of_two else 1 << size.bit_length()
    return size if limit is None else max(n, min(size, int(limit)))


# Smallest KV cache a generation program gets. A program's shapes are the batch and the cache length
# (prompt width + max_new + one round's commit width); the prompt array is as wide as the cache bucket
# leaves room for and the prefill runs only the chunks the prompts need (`loop.chunked_prefill`), so
# every prompt up to this length minus max_new shares one program per batch size. Attending over a
# longer cache costs each decoding step K/V reads: 256 slots of SmolLM2-135M are 12 MB (f32) against
# its 538 MB of weights.
MIN_CACHE_LEN = 256


def prompt_width(spec: "EngineSpec", longest: int) -> int:
    """The prompt width `run_engine` pads a batch to by default: the room a cache-length bucket
    (`bucket` of longest + max_new + commit width, at least MIN_CACHE_LEN, at most the model's
    context + commit width) leaves after max_new and the commit width; never below `longest`."""
    extra = spec.max_new + spec.commit_width
    limit = spec.cfg.max_seq_len + spec.commit_width
    return bucket(int(longest) + extra, min(MIN_CACHE_LEN, limit), limit) - extra


def pad_batch(prompts: Sequence[Sequence[int]], batch_size: int, width: int):
    """Right-pad prompts into [batch_size, width]; missing rows are idle (valid False)."""
    toks = np.zeros((batch_size, width), np.int32)
    lengths = np.ones((batch_size,), np.int32)
    valid = np.zeros((batch_size,), bool)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = p
        lengths[i] = len(p)
        valid[i] = True
    return jnp.asarray(toks), jnp.asarray(lengths), jnp.asarray(valid)


def sequence_keys(seed: int, line_numbers: Sequence[int]) -> jax.Array:
    """Per-sequence keys: fold_in(key(seed), line number). Compiled once per seed: op by op these
    few ops cost ~1 ms of dispatch on every call, a cost timed into every answer of a benchmark."""
    return _fold_line_keys(int(seed), np.asarray(list(line_numbers), np.uint32))


@functools.partial(jax.jit, static_argnums=0)
def _fold_line_keys(seed: int, lines: jax.Array) -> jax.Array:
    base = jax.random.key(seed)
    return jax.vmap(lambda i: jax.random.fold_in(base, i))(lines)


def results_from_state(st: GenState, n: int) -> list:
    fields = (st.out, st.n_gen, st.accepted, st.n_rounds, st.target_layers, st.draft_layers, st.early_exits)
    if jax.process_count() > 1:  # rows live on other hosts' devices too
        from jax.experimental import multihost_utils

        return tuple(np.asarray(multihost_utils.process_allgather(f, tiled=True)) for f in fields)
    return jax.device_get(fields)


def run_engine(engine: Engine, prompts: Sequence[Sequence[int]], *, seed: int = 0,
               line_numbers: Optional[Sequence[int]] = None, batch_size: int = 8, tau: float = 0.5,
               width: Optional[int] = None, fixed_batch: bool = False, return_states: bool = False):
    """Generate for already-validated token prompts with a built engine (see `generate`).
    Batches are padded to `batch_size` rows (unless `fixed_batch`, to fewer when there are fewer
    prompts: the next `bucket` size) and prompts to `width` (default: `prompt_width`, from a bucket
    of cache lengths), so every batch of a call runs the same compiled program, and calls with
    prompts of any length up to the bucket share it: a process compiles a handful of programs, not
    one per prompt length. Padding is exact: padded positions are masked and idle rows ignored,
    and the prefill skips the chunks past the longest prompt."""
    spec = engine.spec
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ConfigError(f"batch_size={batch_size!r} is invalid: expected a positive integer")
    if not (0.0 <= float(tau) <= 1.0):
        raise ConfigError(f"tau={tau!r} is invalid: expected a value in [0, 1]")
    line_numbers = list(range(len(prompts))) if line_numbers is None else list(line_numbers)
    if not fixed_batch:
        batch_size = min(int(batch_size), bucket(len(prompts)))
    if spec.sharding is not None:  # whole rows per device: pad the batch with idle rows
        n = spec.sharding.axis_size("batch")
        batch_size = -(-batch_size // n) * n
    width = width or prompt_width(spec, max(len(p) for p in prompts))
    results, states = [], []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        toks, lengths, valid = pad_batch(chunk, batch_size, width)
        lines = line_numbers[start:start + batch_size]
        lines = lines + [0] * (batch_size - len(lines))
        keys = sequence_keys(seed, lines)
        if spec.sharding is None:
            st = run_batch(spec, engine.params, toks, lengths, keys, valid, jnp.float32(tau))
        else:
            from m2r2_jax.sharding.params import put_global

            rows = spec.sharding.sharding(("batch",))
            batch = put_global((toks, lengths, jax.random.key_data(keys), valid), (rows,) * 4)
            st = _sharded_runner(engine, batch_size, width)(engine.params, *batch, jnp.float32(tau))
        out, n_gen, acc, rounds, tl, dl, ee = results_from_state(st, len(chunk))
        for i in range(len(chunk)):
            results.append(SequenceResult(
                tokens=[int(t) for t in out[i, : n_gen[i]]],
                accepted=[int(a) for a in acc[i, : rounds[i]]] if spec.method in SPEC_METHODS else [],
                rounds=int(rounds[i]),
                target_layers=float(tl[i]),
                draft_layers=float(dl[i]),
                early_exits=int(ee[i]),
            ))
        if return_states:
            states.append(st)
    return (results, states) if return_states else results


def resolve_layer_loop(layer_loop: str, method: str, plan=None, backend: Optional[str] = None) -> str:
    """The layer loop an engine of `method` gets: "scan" or "unrolled". "auto" picks the unrolled
    loop on the CPU backend for every method without a sharding plan, and the scan everywhere
    else. Why: on CPU the unrolled loop decodes plain ar 1.15-1.80x faster on two cores
    (docs/RESULTS.md, "The layer loop"), so a benchmark against the scan's plain decoding would
    flatter every speculative method; on accelerators the scan keeps compile time flat in depth
    and the trade is unmeasured; the early-exit methods run their layers behind one `lax.cond`
    each, so a token that exits skips the rest. Raises ConfigError for an unknown loop, or
    "unrolled" with a sharding plan."""
    if layer_loop not in LAYER_LOOPS:
        raise ConfigError(f"layer_loop={layer_loop!r} is invalid: expected one of {', '.join(LAYER_LOOPS)}")
    if layer_loop == "auto":
        backend = jax.default_backend() if backend is None else backend
        return "unrolled" if plan is None and backend == "cpu" else "scan"
    if layer_loop == "unrolled" and plan is not None:
        raise ConfigError(f"layer_loop=unrolled is for engines without a sharding plan, not {method} with a plan")
    return layer_loop


def generate(
    method: str,
    cfg: ModelConfig,
    base_params,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    line_numbers: Optional[Sequence[int]] = None,
    batch_size: int = 8,
    gamma: int = 4,
    draft_length: str = "fixed",
    tau: float = 0.5,
    eos_ids: Union[None, int, Sequence[int]] = None,
    m2r2=None,
    draft=None,
    exit_layer: Optional[int] = None,
    decider: str = "confidence",
    exit_confirm: bool = False,
    kv_missing: str = "propagate",
    plan=None,
    draft_vocab=None,
    layer_loop: str = "scan",
) -> list:
    """Generate continuations of token prompts with one method; returns one `SequenceResult` per
    prompt, in order (see the module docstring for the fields).

    m2r2: (M2R2Config, M2R2 params) for m2r2_spec / m2r2_exit / distance_spec's E (default: a fresh
    `init_m2r2_params` with the default config, which is still lossless for m2r2_spec).
    draft: (ModelConfig, params) of the two_model draft model. tau: the router / decider threshold
    (dynamic draft length and early exit). eos_ids: stop a sequence after the first token that is any
    of these ids (one int or a sequence of ints; None or empty: never).
    draft_vocab: token ids the m2r2_spec / distance_spec draft head scores (`decoding.draft_vocab`).
    layer_loop: "scan", "unrolled" or "auto" (`resolve_layer_loop`). exit_confirm: m2r2_exit's exits
    also need a confident exit head (`build_engine`).
    """
    engine = build_engine(method, cfg, base_params, max_new_tokens=max_new_tokens, temperature=temperature,
                          top_p=top_p, gamma=gamma, draft_length=draft_length, eos_ids=eos_ids, m2r2=m2r2,
                          draft=draft, exit_layer=exit_layer, decider=decider, exit_confirm=exit_confirm,
                          kv_missing=kv_missing, plan=plan, draft_vocab=draft_vocab, layer_loop=layer_loop)
    if line_numbers is not None and len(line_numbers) != len(prompts):
        raise ConfigError(f"line_numbers has {len(line_numbers)} entries for {len(prompts)} prompts")
    if not len(prompts):
        return []
    names = None if line_numbers is None else [f"prompt {n}" for n in line_numbers]
    prompts = check_prompts(cfg, prompts, int(max_new_tokens), names)
    return run_engine(engine, prompts, seed=seed, line_numbers=line_numbers, batch_size=batch_size, tau=tau)
