"""A generic training loop: one trainable pytree, one frozen pytree, any loss.

    result = train(tcfg, workdir, trainable, frozen, loss_fn, data_iter, rng=key)
    # -> TrainResult(trainable, step, history, preempted, skipped)

Contract
--------
- `loss_fn(trainable, frozen, batch, rng) -> (loss, metrics)`: a scalar loss and a dict of scalar
  metrics, traceable by `jax.jit`. Only `trainable` is differentiated and optimised; `frozen` is
  an ordinary argument of the step — never donated, never seen by the optimiser, never written
  (base-model pre-training passes `frozen={}`; M2R2 distillation passes the base model).
- `data_iter` yields host-local batches (an array or a pytree of arrays whose leading axis is this
  host's share of `tcfg.batch_size`). If it has `get_state()` / `set_state(state)` (the grain
  iterators of `m2r2_jax.data.pipeline` do), its state is checkpointed with the train state, so a
  resumed run draws the same next batch. Every host must hold the same iterator state.
- `rng`: a `jax.random.key` (or raw uint32 key); step n gets `fold_in(rng, n)`, so per-step
  randomness does not depend on where a run was interrupted.
- `tcfg`: the `train` section of a config (`m2r2_jax.training.config.train_section`).

Behaviour
---------
- Optimiser: AdamW (decay on >= 2-D leaves only) with a linear-warmup cosine schedule down to
  `learning_rate * min_lr_ratio`, after global-norm clipping.
- The step is `jax.jit`-compiled once with explicit in/out shardings and the train state donated.
  `plan` (a `sharding.ShardingPlan`, e.g. the `train` preset on `--mesh data=2,fsdp=2,tensor=2`)
  shards the batch, the frozen tree, the trainable parameters and the optimiser state by their
  logical axes; without one the batch is split over every device (`data_parallel`, else one) and
  everything else replicated. Checkpoints restore onto the current plan, whatever mesh wrote them.
- Checkpoints: an orbax `CheckpointManager` in `workdir/checkpoints` keeps the newest
  `keep_checkpoints` steps, saving the first step of a run, every `checkpoint_every` steps and
  at the end (async by default). Each holds the train state (step, params, optimiser state, rng,
  skip counter) and the data iterator state. A call with an existing checkpoint resumes from the
  latest one: the same next batch and bitwise the same losses as an uninterrupted run. Orbax
  writes to a temporary directory and renames it when complete, so a half-written checkpoint is
  never restored.
- SIGTERM (preemption): the current step finishes, a checkpoint is written, and `train` returns
  with `preempted=True`. `stop_at=N` ends the call after step N the same way (a planned stop).
- Non-finite loss or gradient norm: detected inside the step, whose update is then not applied
  (params and optimiser state keep their old values; the data is consumed). `nonfinite="stop"`
  raises `M2R2Error` naming the step; `"skip"` counts it and goes on (up to `max_skipped`).
- Metrics: every step's loss, learning rate, grad norm and the loss_fn metrics go to `history`,
  the tqdm bar (with tokens/s) and, every `log_every` steps, TensorBoard files in `workdir/tb`
  under `<metrics_prefix>/<name>`.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from m2r2_jax.errors import ConfigError, M2R2Error
from m2r2_jax.sharding.params import follow_params, param_shardings, put_global
from m2r2_jax.sharding.plan import ShardingPlan

CHECKPOINT_DIR = "checkpoints"
TB_DIR = "tb"

LossFn = Callable[[Any, Any, Any, jax.Array], tuple[jax.Array, dict]]


@dataclasses.dataclass
class TrainResult:
    trainable: Any          # final (or, when preempted, latest) trainable pytree
    step: int               # optimiser steps taken in total (including earlier runs)
    history: list           # one dict per step run in this call: step, loss, lr, grad_norm, ...
    preempted: bool = False  # stopped early by SIGTERM or stop_at; a checkpoint holds the state
    skipped: int = 0        # steps whose update was dropped for a non-finite loss/gradient


# --------------------------------------------------------------------------------------------
# Optimiser
# --------------------------------------------------------------------------------------------
def lr_schedule(tcfg) -> optax.Schedule:
    decay_steps = max(tcfg.steps, tcfg.warmup_steps + 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=tcfg.learning_rate, warmup_steps=tcfg.warmup_steps,
        decay_steps=decay_steps, end_value=tcfg.learning_rate * tcfg.min_lr_ratio,
    )


def make_optimizer(tcfg) -> optax.GradientTransformation:
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)  # noqa: E731
    parts = [optax.clip_by_global_norm(tcfg.grad_clip)] if tcfg.grad_clip > 0 else []
    parts.append(optax.adamw(lr_schedule(tcfg), b1=tcfg.b1, b2=tcfg.b2, eps=tcfg.eps,
                             weight_decay=tcfg.weight_decay, mask=decay_mask))
    return optax.chain(*parts)


# --------------------------------------------------------------------------------------------
# Train state and step
# --------------------------------------------------------------------------------------------
def _raw_key(rng) -> jax.Array:
    """uint32 key data (what the checkpoint stores) from a typed or raw key."""
    rng = jnp.asarray(rng)
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(rng)
    return rng.astype(jnp.uint32)


def init_state(tx, trainable, rng) -> dict:
    return {
        "step": jnp.zeros((), jnp.int32),
        "params": trainable,
        "opt_state": tx.init(trainable),
        "rng": _raw_key(rng),
        "skipped": jnp.zeros((), jnp.int32),
    }


def make_step(loss_fn: LossFn, tx, schedule):
    """(state, frozen, batch) -> (state, metrics); the update is dropped when not finite."""

    def step_fn(state, frozen, batch):
        step = state["step"]
        key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), step)
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], frozen, batch, key)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        keep_if_finite = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        new_state = {
            "step": step + 1,
            "params": keep_if_finite(params, state["params"]),
            "opt_state": keep_if_finite(opt_state, state["opt_state"]),
            "rng": state["rng"],
            "skipped": state["skipped"] + (~finite).astype(jnp.int32),
        }
        out = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(step), "finite": finite}
        out.update(metrics)
        return new_state, out

    return step_fn


# --------------------------------------------------------------------------------------------
# Sharding
# --------------------------------------------------------------------------------------------
def default_plan(tcfg) -> ShardingPlan:
    """No plan given: the train preset with the batch over every device (`train.data_parallel`)
    or on the first device only."""
    devices = jax.devices() if tcfg.data_parallel else jax.devices()[:1]
    return ShardingPlan.from_preset("train", mesh=f"data={len(devices)}", devices=devices)


def state_shardings(plan: ShardingPlan, state: dict, by_axes: bool = True) -> dict:
    """Parameters by their logical axes (or replicated), optimiser moments like their
    parameters, counters and the rng replicated. A trained vocabulary that the mesh does not
    divide is replicated, not padded (`param_shardings(pad_vocab=False)`): the train state, its
    checkpoints and the returned parameters keep the model's shapes."""
    params = state["params"]
    params_sh = (param_shardings(plan, params, pad_vocab=False) if by_axes
                 else jax.tree.map(lambda _: plan.replicated, params))
    return {
        "step": plan.replicated,
        "params": params_sh,
        "opt_state": follow_params(plan, state["opt_state"], params, params_sh),
        "rng": plan.replicated,
        "skipped": plan.replicated,
    }


def _in_scope(plan: ShardingPlan, fn):
    """`fn` traced with the plan in scope, so the model's activation constraints apply."""

    def scoped(*args):
        with plan.scope():
            return fn(*args)

    return scoped


# --------------------------------------------------------------------------------------------
# Checkpoints, preemption, metrics
# --------------------------------------------------------------------------------------------
def checkpoint_manager(workdir, tcfg) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=tcfg.keep_checkpoints, save_interval_steps=tcfg.checkpoint_every,
        enable_async_checkpointing=tcfg.async_checkpointing, create=True,
    )
    return ocp.CheckpointManager(Path(workdir).absolute() / CHECKPOINT_DIR, options=options,
                                 item_names=("state", "data"))


def latest_step(workdir) -> Optional[int]:
    """Newest complete checkpoint step in `workdir`, or None."""
    d = Path(workdir).absolute() / CHECKPOINT_DIR
    if not d.is_dir():
        return None
    mngr = ocp.CheckpointManager(d, options=ocp.CheckpointManagerOptions(read_only=True, create=False))
    try:
        return mngr.latest_step()
    finally:
        mngr.close()


class _SigtermFlag:
    """Sets a flag on SIGTERM (the loop checks it between steps); main thread only."""

    def __init__(self):
        self.raised = False
        self._previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame):
        self.raised = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


class _Metrics:
    """tqdm bar + TensorBoard writer (process 0 only)."""

    def __init__(self, workdir, tcfg, prefix, start, total):
        self.main = jax.process_index() == 0
        self.prefix = prefix
        self.log_every = tcfg.log_every
        self.bar = None
        self.writer = None
        if self.main:
            from tqdm.auto import tqdm

            SummaryWriter = _import_summary_writer()

            self.writer = SummaryWriter(str(Path(workdir).absolute() / TB_DIR))
            self.bar = tqdm(total=total, initial=start, disable=not tcfg.progress, desc=prefix,
                            dynamic_ncols=True, file=sys.stderr)

    def say(self, msg: str):
        if self.main:
            from tqdm.auto import tqdm

            tqdm.write(msg, file=sys.stderr)

    def log(self, record: dict):
        if not self.main:
            return
        if self.bar is not None:
            post = {"loss": f"{record['loss']:.4f}", "lr": f"{record['lr']:.2e}", "gnorm": f"{record['grad_norm']:.2f}"}
            if "tokens_per_s" in record:
                post["tok/s"] = f"{record['tokens_per_s']:.0f}"
            self.bar.set_postfix(post, refresh=False)
            self.bar.update(1)
        step = record["step"]
        if step % self.log_every == 0 or step == 1:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.writer.add_scalar(f"{self.prefix}/{k}", v, step)

    def close(self):
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()


def _import_summary_writer():
    """tensorboardX's SummaryWriter, imported without torch: tensorboardX imports torch when it
    is installed (optional, for torch tensors; we log Python floats), which costs seconds."""
    if "tensorboardX" not in sys.modules and "torch" not in sys.modules:
        sys.modules["torch"] = None  # makes `import torch` raise ImportError, which tensorboardX allows
        try:
            from tensorboardX import SummaryWriter
        finally:
            del sys.modules["torch"]
        return SummaryWriter
    from tensorboardX import SummaryWriter

    return SummaryWriter


def _default_tokens(batch) -> Optional[int]:
    """Tokens trained per host batch: B * (T - 1) for packed [B, T+1] token batches."""
    if hasattr(batch, "ndim") and batch.ndim == 2 and np.issubdtype(batch.dtype, np.integer):
        return int(batch.shape[0] * (batch.shape[1] - 1))
    return None


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------
def train(
    tcfg,
    workdir,
    trainable,
    frozen,
    loss_fn: LossFn,
    data_iter,
    *,
    rng,
    metrics_prefix: str = "train",
    stop_at: Optional[int] = None,
    tokens_per_batch: Optional[Callable[[Any], Optional[int]]] = None,
    plan: Optional[ShardingPlan] = None,
) -> TrainResult:
    """Train `trainable` for `tcfg.steps` steps (resuming from `workdir` if it has checkpoints)."""
    workdir = Path(workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    tokens_per_batch = tokens_per_batch or _default_tokens
    # Without a plan, parameters of any structure (this loop trains any pytree) are replicated;
    # a plan shards them by their logical axes, which it must know.
    by_axes = plan is not None
    plan = plan or default_plan(tcfg)
    batch_sharding = plan.sharding(("batch",))
    n_batch = plan.axis_size("batch")
    if tcfg.batch_size % n_batch:
        raise ConfigError(f"train.batch_size={tcfg.batch_size} is invalid: must be divisible by the {n_batch} "
                          f"devices the batch is sharded over ({plan.describe()})")

    tx = make_optimizer(tcfg)
    schedule = lr_schedule(tcfg)
    state = init_state(tx, trainable, rng)
    state_sh = state_shardings(plan, state, by_axes)
    state = put_global(state, state_sh, copy=True)  # donated below: the caller's arrays must survive
    frozen_sh = param_shardings(plan, frozen) if by_axes else jax.tree.map(lambda _: plan.replicated, frozen)
    frozen = put_global(frozen, frozen_sh)
    step_fn = jax.jit(_in_scope(plan, make_step(loss_fn, tx, schedule)), donate_argnums=(0,),
                      in_shardings=(state_sh, frozen_sh, batch_sharding),
                      out_shardings=(state_sh, plan.replicated))
    stateful_data = hasattr(data_iter, "get_state") and hasattr(data_iter, "set_state")

    # Installed first, so a SIGTERM at any point of start-up still ends in a clean checkpoint.
    sigterm = _SigtermFlag().__enter__()
    mngr = checkpoint_manager(workdir, tcfg)
    metrics = None
    try:
        start = mngr.latest_step()
        if start is not None:
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
            restored = mngr.restore(start, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
            state = restored["state"]
            data_state = restored["data"]
            if stateful_data and data_state:
                data_iter.set_state(data_state)
            elif data_state:
                raise M2R2Error(f"{workdir} holds a data iterator state but the data iterator cannot restore it")
        start = int(state["step"])
        end = tcfg.steps if stop_at is None else min(tcfg.steps, stop_at)
        metrics = _Metrics(workdir, tcfg, metrics_prefix, start, tcfg.steps)
        if start:
            metrics.say(f"resumed from the checkpoint at step {start} in {workdir / CHECKPOINT_DIR}")
        if not stateful_data:
            metrics.say("warning: the data iterator has no get_state(); a resumed run restarts its data stream")

        def save(step, force):
            data_state = data_iter.get_state() if stateful_data else {}
            mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    data=ocp.args.JsonSave(data_state)), force=force)

        history, preempted = [], False
        last_time, skipped = None, int(state["skipped"])
        for step in range(start, end):
            batch = next(data_iter)
            n_tokens = tokens_per_batch(batch)
            global_batch = jax.tree.map(
                lambda x: jax.make_array_from_process_local_data(batch_sharding, np.asarray(x)), batch)
            state, out = step_fn(state, frozen, global_batch)
            out = jax.device_get(out)
            now = time.perf_counter()
            record = {"step": step + 1}
            record.update({k: (bool(v) if k == "finite" else float(v)) for k, v in out.items()})
            if n_tokens is not None and last_time is not None:  # the first step includes compilation
                record["tokens_per_s"] = n_tokens * jax.process_count() / max(now - last_time, 1e-9)
            last_time = now
            history.append(record)
            if not record["finite"]:
                skipped += 1
                msg = (f"non-finite loss or gradient at step {step + 1} (loss={record['loss']}, "
                       f"grad_norm={record['grad_norm']}); the update was not applied")
                if tcfg.nonfinite == "stop":
                    raise M2R2Error(msg + "; lower train.learning_rate or set train.nonfinite=skip")
                metrics.say(msg + f" (skipped {skipped} so far)")
                if tcfg.max_skipped and skipped > tcfg.max_skipped:
                    raise M2R2Error(f"more than train.max_skipped={tcfg.max_skipped} non-finite steps (at step {step + 1})")
            metrics.log(record)
            if sigterm.raised and step + 1 < end:
                save(step + 1, force=True)
                metrics.say(f"SIGTERM: saved a checkpoint at step {step + 1}; rerun to resume")
                preempted = True
                break
            save(step + 1, force=(step + 1 == end))
        if start == end and mngr.latest_step() != end:
            save(end, force=True)
        mngr.wait_until_finished()
        final = int(state["step"])
        return TrainResult(trainable=state["params"], step=final, history=history,
                           preempted=preempted or final < tcfg.steps, skipped=skipped)
    finally:
        sigterm.__exit__()
        if metrics is not None:
            metrics.close()
        mngr.wait_until_finished()
        mngr.close()
