"""Training the M2R2 parameters by self-distillation from the frozen base (what `m2r2 distill` runs).

    summary = distill(cfg, workdir)

Config (an ml_collections ConfigDict, see `configs/m2r2/`):

    base_checkpoint   model directory of the frozen base (`m2r2 pretrain` / `m2r2 convert` output)
    m2r2              fields of `M2R2Config`
    loss              fields of `LossConfig`
    schedule          "two_stage" (default: stream, then router on the frozen stream) | "joint" |
                      "router" (the router stage only, on the frozen stream of `init_m2r2`)
    init_m2r2         "" or an M2R2 checkpoint of this base whose stream (adapters, rates, exit
                      norms) the run starts from; its stream fields of `m2r2` must be this config's.
                      Its deciders are kept too when the router fields match, else trained afresh
                      (e.g. a router that reads the state only, or one that can give up)
    train             the stream (or joint) stage: `m2r2_jax.training.config.train_section()`
    router_train      the router stage (same fields; used with "two_stage")
    data              corpus section (tokenizer "" = the base checkpoint's tokenizer)
    draft_vocab       "" (the full vocabulary) or a `m2r2 draft-vocab` file: the stream stage's KL
                      scores only those tokens, as the drafter given the same file will
                      (`losses.distill_loss`'s `vocab`); the router stage keeps the full vocabulary
    teacher_cache     True: run the frozen base once over the whole (packed) training set before
                      the first step and keep what the fast steps need (`fast_stream.Teacher`:
                      h_b, the targets, the final state, keys and values at the visited layers);
                      each step then runs only the fast stream and the heads. Pays from the
                      second epoch on; memory: N x T x (K + 2) x d + 2 x N x K x T x KV x hd floats

Workdir layout: `stream/` and `router/` (train checkpoints + TensorBoard, one per stage, each
resumable), `m2r2/` (the final M2R2 checkpoint, tied to the base's fingerprint), `distill_summary.json`.
The base parameters are an argument of every step and never an optimiser input: they stay
bit-identical (`base_fingerprint_after` in the summary repeats the check on the weights).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from m2r2_jax.data.pipeline import batch_iterator, lm_pipeline
from m2r2_jax.data.tokenizer import load_tokenizer
from m2r2_jax.errors import CheckpointError, ConfigError
from m2r2_jax.m2r2 import losses as L
from m2r2_jax.m2r2.checkpoint import save_m2r2
from m2r2_jax.m2r2.config import M2R2Config
from m2r2_jax.m2r2.fast_stream import init_m2r2_params
from m2r2_jax.models.checkpoint import load_config, load_model, params_fingerprint, tokenizer_path
from m2r2_jax.training.config import data_section, train_section, validate_data, validate_train
from m2r2_jax.training.loop import train

SCHEDULES = ("two_stage", "joint", "router")
# M2R2Config fields that shape the deciders only: an init checkpoint may differ in these
DECIDER_FIELDS = ("router_dim", "router_hidden", "router_features", "router_give_up", "kernel_implementation")
M2R2_DIR = "m2r2"


def m2r2_section(**overrides) -> ml_collections.ConfigDict:
    d = M2R2Config().to_dict()
    d.update(overrides)
    # a tuple, so that --config.m2r2.lora_targets="('q_proj','v_proj')" can override it (ml_collections
    # refuses command-line overrides of list fields)
    d["lora_targets"] = tuple(d["lora_targets"])
    return ml_collections.ConfigDict(d)


def distill_config() -> ml_collections.ConfigDict:
    cfg = ml_collections.ConfigDict()
    cfg.base_checkpoint = ""
    cfg.m2r2 = m2r2_section()
    cfg.loss = ml_collections.ConfigDict(dataclasses.asdict(L.LossConfig()))
    cfg.schedule = "two_stage"
    cfg.teacher_cache = False
    cfg.draft_vocab = ""
    cfg.init_m2r2 = ""
    cfg.seed = 0
    cfg.train = train_section()
    cfg.train.update(dict(steps=300, learning_rate=2e-3, warmup_steps=20, weight_decay=0.0, checkpoint_every=100))
    cfg.router_train = train_section()
    cfg.router_train.update(dict(steps=100, learning_rate=3e-3, warmup_steps=10, weight_decay=0.0, checkpoint_every=100))
    cfg.data = data_section()
    return cfg


def m2r2_config_from(section) -> M2R2Config:
    d = section.to_dict() if hasattr(section, "to_dict") else dict(section)
    return M2R2Config.from_dict(d)


def validate_distill(cfg, base_cfg=None) -> tuple:
    """Returns (M2R2Config, LossConfig) after checking every section."""
    if not isinstance(cfg.get("teacher_cache", False), bool):
        raise ConfigError(f"teacher_cache={cfg.teacher_cache!r} is invalid: expected True or False")
    if cfg.schedule not in SCHEDULES:
        raise ConfigError(f"schedule={cfg.schedule!r} is invalid: expected one of {', '.join(SCHEDULES)}")
    init = cfg.get("init_m2r2", "")
    if not isinstance(init, str):
        raise ConfigError(f"init_m2r2={init!r} is invalid: expected an M2R2 checkpoint directory or ''")
    if cfg.schedule == "router" and not init:
        raise ConfigError("schedule='router' trains the deciders on a trained stream: set "
                          "--config.init_m2r2=M2R2_CHECKPOINT")
    draft_vocab = cfg.get("draft_vocab", "")
    if not isinstance(draft_vocab, str):
        raise ConfigError(f"draft_vocab={draft_vocab!r} is invalid: expected a draft vocabulary file or ''")
    if draft_vocab and cfg.schedule != "two_stage":
        raise ConfigError(f"draft_vocab is for schedule='two_stage': it trains the stream stage, which "
                          f"schedule={cfg.schedule!r} does not run")
    try:
        mcfg = m2r2_config_from(cfg.m2r2)
        lcfg = L.LossConfig(**cfg.loss.to_dict()).validate()
    except TypeError as e:
        raise ConfigError(f"bad m2r2/loss section: {e}") from None
    mcfg.validate(base_cfg)  # base-dependent fields only when the base is known
    if lcfg.lambda_routing > 0 and base_cfg is not None and not base_cfg.is_moe:
        raise ConfigError(f"loss.lambda_routing={lcfg.lambda_routing!r} is invalid: the base is a dense "
                          f"{base_cfg.family} model with no routing to distil (set it for MoE bases)")
    if cfg.schedule != "router":
        validate_train(cfg.train)
    if cfg.schedule != "joint":
        validate_train(cfg.router_train)
    for section in ("train", "router_train"):
        coef = cfg[section].get("moe_aux_loss_coef", 0.0)
        if coef:  # the base is frozen: its routing cannot be balanced here
            raise ConfigError(f"{section}.moe_aux_loss_coef={coef!r} is invalid: distillation keeps the base "
                              "(and its router) frozen; set the balance loss when pre-training the base")
    validate_data(cfg.data, model_tokenizer=True)  # "": the base checkpoint's tokenizer
    return mcfg, lcfg


def _loss_fn(base_cfg, mcfg, lcfg, seq_len, stage: str = "joint", draft_ids=None):
    """The training loss. frozen = (base params, the other M2R2 params[, the teacher cache]); with a
    cache each batch row ends in its example's index into it. `draft_ids`: the stream stage scores
    that draft vocabulary only."""
    from m2r2_jax.models.transformer import head_kernel_columns

    def loss_fn(trainable, frozen, batch, rng):
        base_params, rest, *cache = frozen
        teacher = _cached_teacher(cache[0], batch[:, -1]) if cache else None
        vocab = None
        if draft_ids is not None and stage == "stream":  # gathered in the step: 8k of the base's rows, no copy kept
            vocab = {"ids": jnp.asarray(draft_ids), "kernel": head_kernel_columns(base_cfg, base_params, draft_ids)}
        loss, metrics = L.distill_loss(base_cfg, mcfg, lcfg, base_params, {**rest, **trainable}, batch[:, :seq_len],
                                       rng, deciders=(stage != "stream"), teacher=teacher, vocab=vocab)
        metrics = dict(metrics)
        per_step = metrics.pop("agreement_per_step")
        for i in range(per_step.shape[0]):
            metrics[f"agreement_step{i + 1}"] = per_step[i]
        return loss, metrics

    return loss_fn


# --------------------------------------------------------------------------------------------
# Teacher cache
# --------------------------------------------------------------------------------------------
TEACHER_CACHE_LIMIT = 8 << 30  # bytes: a larger cache is refused (shorten the data or turn it off)


def teacher_cache_bytes(base_cfg, mcfg, n_examples: int, seq_len: int) -> int:
    k = mcfg.steps(base_cfg)
    per_token = (k + 2) * base_cfg.d_model + 2 * k * base_cfg.n_kv_heads * base_cfg.head_dim
    return 4 * n_examples * seq_len * per_token


def build_teacher_cache(base_cfg, mcfg, base_params, examples: np.ndarray, seq_len: int, batch_size: int,
                        progress: bool = True) -> dict:
    """`fast_stream.Teacher` for every packed example, example-major ([N, ...] numpy arrays), with
    a progress bar. One jitted program over `batch_size` rows (the last chunk is padded)."""
    from tqdm.auto import tqdm

    from m2r2_jax.m2r2.fast_stream import teacher_outputs

    fn = jax.jit(lambda p, t: teacher_outputs(base_cfg, mcfg, p, t))
    n = examples.shape[0]
    out: dict = {}
    for lo in tqdm(range(0, n, batch_size), desc="teacher cache", leave=False, disable=not progress):
        chunk = examples[lo:lo + batch_size, :seq_len]
        pad = batch_size - chunk.shape[0]
        tokens = np.concatenate([chunk, np.zeros((pad, seq_len), chunk.dtype)]) if pad else chunk
        t = jax.device_get(fn(base_params, jnp.asarray(tokens, jnp.int32)))
        rows = {"g0": t.g0, "final": t.final, "targets": np.swapaxes(t.targets, 0, 1),
                "k": np.swapaxes(t.k, 0, 1), "v": np.swapaxes(t.v, 0, 1)}
        for name, a in rows.items():
            if name not in out:
                out[name] = np.empty((n,) + a.shape[1:], a.dtype)
            out[name][lo:lo + chunk.shape[0]] = a[:chunk.shape[0]]
    return out


def _cached_teacher(cache: dict, index):
    """The `Teacher` of a batch from the example-major cache (inside the jitted step)."""
    from m2r2_jax.m2r2.fast_stream import Teacher

    rows = {k: jnp.take(v, index, axis=0) for k, v in cache.items()}
    step_major = {k: jnp.swapaxes(rows[k], 0, 1) for k in ("targets", "k", "v")}
    return Teacher(rows["g0"], step_major["targets"], rows["final"], step_major["k"], step_major["v"])


def _stage(tcfg, workdir, base_cfg, mcfg, lcfg, base_params, m2r2_params, stage, data_iter, seq_len, seed, prefix,
           plan=None, teacher_cache=None, draft_ids=None):
    trainable, rest = L.split_params(m2r2_params, stage)
    frozen = (base_params, rest) if teacher_cache is None else (base_params, rest, teacher_cache)
    result = train(tcfg, workdir, trainable, frozen, _loss_fn(base_cfg, mcfg, lcfg, seq_len, stage, draft_ids),
                   data_iter,
                   rng=jax.random.key(seed), metrics_prefix=prefix,
                   tokens_per_batch=lambda b: int(np.prod(np.shape(b)[:1])) * seq_len, plan=plan)
    return {**rest, **jax.device_get(result.trainable)}, result


def _summarize(result) -> dict:
    hist = result.history
    out = {"step": result.step, "preempted": result.preempted, "skipped": result.skipped}
    if hist:
        out["first_loss"] = hist[0]["loss"]
        out["last_loss"] = float(np.mean([h["loss"] for h in hist[-10:]]))
        keys = sorted(k for k in hist[-1] if k.startswith("agreement_step"))
        out["agreement_per_step"] = [float(np.mean([h[k] for h in hist[-10:]])) for k in
                                     sorted(keys, key=lambda s: int(s.removeprefix("agreement_step")))]
        for name in ("router_acc", "later_acc"):
            if name in hist[-1]:
                out[name] = float(np.mean([h[name] for h in hist[-10:]]))
    return out


def distill(cfg, workdir, plan=None) -> dict:
    """`plan`: a `sharding.ShardingPlan` for both stages (None: data parallel, see `loop.train`)."""
    workdir = Path(workdir).absolute()
    if not cfg.base_checkpoint:
        raise ConfigError("base_checkpoint='' is invalid: expected the base model directory (--config.base_checkpoint=DIR)")
    if not Path(cfg.base_checkpoint).is_dir():
        raise CheckpointError(f"base checkpoint {cfg.base_checkpoint} does not exist")
    # The whole config is checked against the base's config file before its weights are read (an
    # 8B base takes minutes to load): a bad value fails at once.
    base_cfg = load_config(cfg.base_checkpoint)
    mcfg, lcfg = validate_distill(cfg, base_cfg)
    seq_len = cfg.data.seq_len
    if seq_len > base_cfg.max_seq_len:
        raise ConfigError(f"data.seq_len={seq_len} is invalid: the base model's max_seq_len is {base_cfg.max_seq_len}")
    tok_file = cfg.data.tokenizer or tokenizer_path(cfg.base_checkpoint)
    if not tok_file:
        raise CheckpointError(f"{cfg.base_checkpoint} has no tokenizer; set --config.data.tokenizer=PATH")
    tok = load_tokenizer(tok_file)
    draft_ids = None
    if cfg.get("draft_vocab", ""):
        from m2r2_jax.decoding import draft_vocab as DV

        draft_ids = DV.load(cfg.draft_vocab, base_cfg.vocab_size)
    base_cfg, base_params = load_model(cfg.base_checkpoint, base_cfg)
    fingerprint = params_fingerprint(base_cfg, base_params)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(cfg.to_json())

    m2r2_params = init_m2r2_params(base_cfg, mcfg, jax.random.key(cfg.seed))
    init = cfg.get("init_m2r2", "")
    if init:
        m2r2_params = _start_from(init, base_cfg, fingerprint, mcfg, m2r2_params)
    summary = {"base_checkpoint": str(Path(cfg.base_checkpoint).absolute()), "base_fingerprint": fingerprint,
               "m2r2": mcfg.to_dict(), "schedule": cfg.schedule}
    if draft_ids is not None:
        summary["draft_vocab"] = {"file": str(Path(cfg.draft_vocab).absolute()), "size": int(draft_ids.size)}
    if init:
        summary["init_m2r2"] = str(Path(init).absolute())
    first = {"joint": "joint", "two_stage": "stream", "router": None}[cfg.schedule]
    cache = None
    if cfg.teacher_cache:
        examples = _indexed_examples(cfg, tok, base_cfg, mcfg, plan)
        cache = build_teacher_cache(base_cfg, mcfg, base_params, examples, seq_len, cfg.train.batch_size,
                                    cfg.train.progress)
        summary["teacher_cache"] = {"examples": int(examples.shape[0]),
                                    "bytes": int(sum(a.nbytes for a in cache.values()))}

    def data(batch_size, seed):
        if cache is None:
            return lm_pipeline(cfg.data, tok, batch_size, seed)[0]
        return batch_iterator(examples, batch_size, seed, shuffle=cfg.data.shuffle)

    if first is not None:
        m2r2_params, res = _stage(cfg.train, workdir / "stream", base_cfg, mcfg, lcfg, base_params, m2r2_params,
                                  first, data(cfg.train.batch_size, cfg.data.seed), seq_len, cfg.seed,
                                  f"distill_{first}", plan, cache, draft_ids)
        summary[first] = _summarize(res)
        if res.preempted:
            summary["preempted"] = True
            return summary
    if cfg.schedule != "joint":
        m2r2_params, res = _stage(cfg.router_train, workdir / "router", base_cfg, mcfg, lcfg, base_params, m2r2_params,
                                  "router", data(cfg.router_train.batch_size, cfg.data.seed + 1), seq_len,
                                  cfg.seed + 1, "distill_router", plan, cache)
        summary["router"] = _summarize(res)
        if res.preempted:
            summary["preempted"] = True
            return summary
    after = params_fingerprint(base_cfg, base_params)
    if after != fingerprint:  # the base is an argument, never an optimiser input: this must hold
        raise CheckpointError("the base parameters changed during distillation")
    summary["base_fingerprint_after"] = after
    out = save_m2r2(workdir / M2R2_DIR, mcfg, m2r2_params, base_cfg, fingerprint)
    summary["m2r2_checkpoint"] = str(out)
    summary["preempted"] = False
    (workdir / "distill_summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _start_from(path, base_cfg, fingerprint: str, mcfg: M2R2Config, fresh: dict) -> dict:
    """`fresh` with the stream of the M2R2 checkpoint at `path` (and its deciders when they have
    the same shape). Refuses a checkpoint of another base or with another stream in one line."""
    from m2r2_jax.m2r2.checkpoint import load_m2r2

    saved_cfg, saved = load_m2r2(path, base_cfg, fingerprint)
    a, b = saved_cfg.to_dict(), mcfg.to_dict()
    differ = sorted(f for f in b if f not in DECIDER_FIELDS and a[f] != b[f])
    if differ:
        raise ConfigError(f"init_m2r2={path} has another fast stream than this config: "
                          + ", ".join(f"m2r2.{f}={a[f]!r} there, {b[f]!r} here" for f in differ))
    keep_deciders = all(a[f] == b[f] for f in DECIDER_FIELDS if f != "kernel_implementation")
    keys = L.STREAM_KEYS + (L.DECIDER_KEYS if keep_deciders else ())
    return {k: (saved[k] if k in keys and k in saved else v) for k, v in fresh.items()}


def _indexed_examples(cfg, tok, base_cfg, mcfg, plan) -> np.ndarray:
    """The packed training examples [N, seq_len + 2]: tokens, then the row's own index (the
    teacher cache's row). Refuses what the cache cannot serve."""
    from m2r2_jax.data.pipeline import pack, tokenize_documents
    from m2r2_jax.data.sources import load_documents

    if plan is not None:
        raise ConfigError("teacher_cache=True runs without a sharding plan (--mesh/--sharding): the cache is one "
                          "host's memory")
    if cfg.loss.lambda_routing > 0 and base_cfg.is_moe:
        raise ConfigError("teacher_cache=True cannot serve loss.lambda_routing (routing distillation needs every "
                          "layer's routing each step): set one of them off")
    examples = pack(tokenize_documents(tok, load_documents(cfg.data)), cfg.data.seq_len)
    need = teacher_cache_bytes(base_cfg, mcfg, examples.shape[0], cfg.data.seq_len)
    if need > TEACHER_CACHE_LIMIT:
        raise ConfigError(f"teacher_cache=True needs {need / 2**30:.1f} GiB for {examples.shape[0]} examples of "
                          f"{cfg.data.seq_len} tokens (limit {TEACHER_CACHE_LIMIT / 2**30:.0f} GiB): use less data or "
                          "turn the cache off")
    return np.concatenate([examples, np.arange(examples.shape[0], dtype=examples.dtype)[:, None]], axis=1)


def heldout_batches(tok, seq_len: int, batch_size: int, max_batches: int, text: str):
    """Packed held-out token batches [B, seq_len] for analysis."""
    from m2r2_jax.data.pipeline import pack, tokenize_documents

    examples = pack(tokenize_documents(tok, [text]), seq_len)[:, :seq_len]
    n = min(max_batches, len(examples) // batch_size)
    if n == 0:
        raise ConfigError(f"held-out text too small for one batch of {batch_size} x {seq_len} tokens")
    return [jnp.asarray(examples[i * batch_size:(i + 1) * batch_size]) for i in range(n)]
