"""Ahead-of-time compile checks: does a sharded train step or generation program fit the devices?

    report = check_train(model_cfg, plan, batch_size=64, seq_len=2048, m2r2_cfg=mcfg)
    report = check_generate(model_cfg, plan, method="m2r2_spec", batch_size=8, prompt_len=1024,
                            max_new_tokens=256, m2r2_cfg=mcfg)

Nothing is allocated: parameters, optimiser state and batches are `jax.ShapeDtypeStruct`s with
their shardings, the program is `jax.jit(...).lower(...).compile()`d for the plan's mesh (fake CPU
devices are enough: `XLA_FLAGS=--xla_force_host_platform_device_count=N`), and XLA's memory
analysis gives the bytes one device needs: arguments + outputs not aliased to donated arguments +
temporaries. `fits` compares that with `device_memory_bytes`. The CPU compiler's temporaries are
an estimate of an accelerator's (different fusion and layouts): keep a margin (`headroom`).

With `platform="tpu"` (or "cuda", "rocm") the same program is also exported for that platform
(`jax.export`, StableHLO for the target, on the machine at hand): the report says whether it lowered
(else the first line of the error), and which custom calls it holds, e.g. `tpu_custom_call` for the
Pallas kernels. XLA's compile for the target, and so its memory analysis, needs the target itself:
the bytes stay those of the compiler this machine runs (`memory_analysis_by`).
"""

from __future__ import annotations

import collections
import dataclasses
import re
import time
from typing import Optional

import jax
import jax.numpy as jnp

from m2r2_jax.errors import ConfigError
from m2r2_jax.models.config import ModelConfig
from m2r2_jax.sharding.params import named_placement_notes, pad_vocab_leaves, param_shardings, placement_notes
from m2r2_jax.sharding.plan import ShardingPlan

GIB = 1024 ** 3


def parse_bytes(text: str) -> int:
    """'16GiB', '95GB', '80G', '1024MiB' or a plain number of bytes."""
    units = {"kib": 1024, "mib": 1024 ** 2, "gib": GIB, "tib": 1024 ** 4, "kb": 1e3, "mb": 1e6, "gb": 1e9,
             "tb": 1e12, "k": 1024, "m": 1024 ** 2, "g": GIB, "t": 1024 ** 4, "b": 1, "": 1}
    t = str(text).strip().lower()
    num = t.rstrip("kmgtib")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise ConfigError(f"memory size {text!r} is invalid: expected e.g. 16GiB, 80GB or a number of bytes")
    return int(value * units[unit])


def _abstract(tree, shardings):
    """ShapeDtypeStructs with `shardings`, a vocabulary the mesh does not divide padded as
    `put_global` pads the real parameters."""
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
    return pad_vocab_leaves(abstract, shardings)


def _memory(compiled, device_memory_bytes: Optional[int], headroom: float) -> dict:
    m = compiled.memory_analysis()
    args, outs = int(m.argument_size_in_bytes), int(m.output_size_in_bytes)
    alias, temp = int(m.alias_size_in_bytes), int(m.temp_size_in_bytes)
    total = args + outs - alias + temp
    out = {"argument_bytes": args, "output_bytes": outs, "alias_bytes": alias, "temp_bytes": temp,
           "per_device_bytes": total, "per_device_gib": round(total / GIB, 3)}
    if device_memory_bytes:
        out["device_memory_gib"] = round(device_memory_bytes / GIB, 3)
        out["headroom"] = headroom
        out["fits"] = bool(total <= device_memory_bytes * (1.0 - headroom))
    return out


EXPORT_PLATFORMS = ("tpu", "cuda", "rocm")


def export_for(jitted, args, platform: str) -> dict:
    """Export `jitted` at `args` (ShapeDtypeStructs with shardings) for `platform`: lowered or not,
    the first error line, and the custom calls of the module (target name -> count)."""
    if platform not in EXPORT_PLATFORMS:
        raise ConfigError(f"platform={platform!r} is invalid: expected one of {', '.join(EXPORT_PLATFORMS)}")
    t0 = time.perf_counter()
    try:
        module = jax.export.export(jitted, platforms=[platform])(*args).mlir_module()
    except Exception as e:  # the failure is the finding: reported per program, not raised
        lines = str(e).strip().splitlines() or [type(e).__name__]
        return {"platform": platform, "lowered": False, "lowering_error": f"{type(e).__name__}: {lines[0]}"}
    calls = collections.Counter(re.findall(r"custom_call @([\w.$-]+)", module))
    return {"platform": platform, "lowered": True, "custom_calls": dict(sorted(calls.items())),
            "lowering_seconds": round(time.perf_counter() - t0, 2)}


def _lower_and_compile(jitted, *args, platform: Optional[str] = None) -> tuple:
    """(compiled program, seconds, export report or {}): compiled for the devices at hand, and
    exported for `platform` when one is named."""
    exported = {} if platform is None else export_for(jitted, args, platform)
    t0 = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    seconds = time.perf_counter() - t0
    if exported:
        exported["memory_analysis_by"] = f"{jax.default_backend()} compiler"
    return compiled, seconds, exported


def check_train(model_cfg: ModelConfig, plan: ShardingPlan, *, batch_size: int, seq_len: int, m2r2_cfg=None,
                tcfg=None, device_memory_bytes: Optional[int] = None, headroom: float = 0.1,
                platform: Optional[str] = None) -> dict:
    """Compile one train step: distillation of M2R2 parameters against the frozen base when
    `m2r2_cfg` is given, else base pre-training; exported for `platform` too when named."""
    from m2r2_jax.m2r2 import losses as L
    from m2r2_jax.models.transformer import init_params
    from m2r2_jax.training.config import train_section
    from m2r2_jax.training.lm import lm_loss_fn
    from m2r2_jax.training.loop import make_optimizer, init_state, lr_schedule, make_step, state_shardings, _in_scope

    tcfg = tcfg or train_section()
    if batch_size % plan.axis_size("batch"):
        raise ConfigError(f"batch_size={batch_size} is invalid: not divisible by the {plan.axis_size('batch')} "
                          f"devices of the batch axes ({plan.describe()})")
    base = jax.eval_shape(lambda: init_params(model_cfg, jax.random.key(0)))
    tx = make_optimizer(tcfg)
    if m2r2_cfg is not None:
        from m2r2_jax.m2r2.fast_stream import init_m2r2_params

        m2r2_cfg.validate(model_cfg)
        m2r2 = jax.eval_shape(lambda: init_m2r2_params(model_cfg, m2r2_cfg, jax.random.key(0)))
        trainable, rest = L.split_params(m2r2, "stream")
        frozen = (base, rest)
        lcfg = L.LossConfig()

        def loss_fn(tr, fr, batch, rng):
            loss, metrics = L.distill_loss(model_cfg, m2r2_cfg, lcfg, fr[0], {**fr[1], **tr}, batch)
            return loss, {k: v for k, v in metrics.items() if k != "agreement_per_step"}

        batch = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    else:
        trainable, frozen, loss_fn = base, {}, lm_loss_fn(model_cfg, tcfg.get("moe_aux_loss_coef", 0.0))
        batch = jax.ShapeDtypeStruct((batch_size, seq_len + 1), jnp.int32)
    state = jax.eval_shape(lambda t: init_state(tx, t, jax.random.key(0)), trainable)
    state_sh = state_shardings(plan, state)
    frozen_sh = param_shardings(plan, frozen)
    batch_sh = plan.sharding(("batch",))
    step = jax.jit(_in_scope(plan, make_step(loss_fn, tx, lr_schedule(tcfg))), donate_argnums=(0,),
                   in_shardings=(state_sh, frozen_sh, batch_sh), out_shardings=(state_sh, plan.replicated))
    compiled, seconds, exported = _lower_and_compile(
        step, _abstract(state, state_sh), _abstract(frozen, frozen_sh),
        jax.ShapeDtypeStruct(batch.shape, batch.dtype, sharding=batch_sh), platform=platform)
    notes = {**placement_notes(plan, frozen), **placement_notes(plan, trainable, pad_vocab=False)}
    return {"program": "distill_step" if m2r2_cfg is not None else "pretrain_step", "sharding": plan.describe(notes),
            "batch_size": batch_size, "seq_len": seq_len, **exported, "compile_seconds": round(seconds, 2),
            **_memory(compiled, device_memory_bytes, headroom)}


def check_generate(model_cfg: ModelConfig, plan: ShardingPlan, *, method: str = "m2r2_spec", batch_size: int,
                   prompt_len: int, max_new_tokens: int, gamma: int = 4, m2r2_cfg=None,
                   device_memory_bytes: Optional[int] = None, headroom: float = 0.1,
                   platform: Optional[str] = None) -> dict:
    """Compile the whole generation program (prefill + decoding loop) of one method; exported for
    `platform` too when named."""
    from m2r2_jax.decoding import api
    from m2r2_jax.models.transformer import init_params

    if method not in ("ar", "m2r2_spec", "distance_spec", "m2r2_exit", "distance_exit"):
        raise ConfigError(f"method={method!r} is invalid for the ahead-of-time check: expected ar, m2r2_spec, "
                          "distance_spec, m2r2_exit or distance_exit")
    if batch_size % plan.axis_size("batch"):
        raise ConfigError(f"batch_size={batch_size} is invalid: not divisible by the {plan.axis_size('batch')} "
                          f"devices of the batch axes ({plan.describe()})")
    base = jax.eval_shape(lambda: init_params(model_cfg, jax.random.key(0)))
    m2r2 = None
    if method.startswith("m2r2") or method == "distance_spec":
        from m2r2_jax.m2r2.fast_stream import init_m2r2_params

        mcfg = m2r2_cfg or api.default_m2r2_config(model_cfg)
        m2r2 = (mcfg, jax.eval_shape(lambda: init_m2r2_params(model_cfg, mcfg, jax.random.key(0))))
    engine = api.build_engine(method, model_cfg, base, max_new_tokens=max_new_tokens, gamma=gamma, m2r2=m2r2)
    spec = dataclasses.replace(engine.spec, sharding=plan)
    shardings = {k: param_shardings(plan, v) for k, v in engine.params.items()}
    jitted = api.sharded_jit(spec, engine.params, shardings, batch_size, prompt_len)
    rows = plan.sharding(("batch",))
    batch = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rows) for a in api.abstract_batch(batch_size, prompt_len)]
    compiled, seconds, exported = _lower_and_compile(
        jitted, _abstract(engine.params, shardings), *batch,
        jax.ShapeDtypeStruct((), jnp.float32, sharding=plan.replicated), platform=platform)
    return {"program": f"generate_{method}", "sharding": plan.describe(named_placement_notes(plan, engine.params)),
            "batch_size": batch_size, "prompt_len": prompt_len, "max_new_tokens": max_new_tokens, **exported,
            "compile_seconds": round(seconds, 2), **_memory(compiled, device_memory_bytes, headroom)}
