"""Logical axis names and the one table that maps them to mesh axes.

Every parameter, activation, KV cache and batch dimension carries a *logical* name; a preset
(`configs/sharding/{train,specdec}.py`) maps each name to zero, one or several *mesh* axes. Model
code never names a mesh axis, so one model runs unchanged under any preset and any mesh shape.

Mesh axes (always all four, size 1 where unused): data, fsdp, tensor, expert.

Parameter axes
    vocab, embed, q_heads (n_heads * head_dim, merged), kv_heads (n_kv_heads * head_dim), mlp,
    experts, layers (the stacked layer axis), norm, expert_logits (router output), fast_steps (the
    M2R2 step axis), lora_rank
Activation / cache / batch axes
    batch, length, act_embed, act_vocab, act_heads, head_dim, cache_batch, cache_length, cache_heads

Parameters and activations use different names for the model width (`embed` vs `act_embed`):
FSDP shards the weights' embed dimension and the batch over the same mesh axis, which one array's
spec could not do twice.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional, Sequence, Union

from jax.sharding import PartitionSpec as P

from m2r2_jax.errors import ConfigError

MESH_AXES = ("data", "fsdp", "tensor", "expert")

PARAM_AXES = ("vocab", "embed", "q_heads", "kv_heads", "mlp", "experts", "layers", "norm", "expert_logits",
              "fast_steps", "lora_rank")
ACTIVATION_AXES = ("batch", "length", "act_embed", "act_vocab", "act_heads", "head_dim", "cache_batch",
                   "cache_length", "cache_heads")
LOGICAL_AXES = PARAM_AXES + ACTIVATION_AXES

MeshAxes = Union[None, str, Sequence[str]]


def _as_tuple(axes: MeshAxes) -> tuple:
    if axes is None:
        return ()
    if isinstance(axes, str):
        return (axes,)
    return tuple(axes)


@dataclasses.dataclass(frozen=True)
class Rules:
    """An immutable, hashable logical -> mesh axes table (a jit static argument)."""

    table: tuple  # ((logical name, (mesh axis, ...)), ...)

    @classmethod
    def from_pairs(cls, pairs: Iterable) -> "Rules":
        seen = {}
        for item in pairs:
            try:
                name, axes = item
            except (TypeError, ValueError):
                raise ConfigError(f"sharding rule {item!r} is invalid: expected (logical axis, mesh axes)") from None
            if name not in LOGICAL_AXES:
                raise ConfigError(f"sharding rule for {name!r} is invalid: unknown logical axis; "
                                  f"expected one of {', '.join(LOGICAL_AXES)}")
            axes = _as_tuple(axes)
            for a in axes:
                if a not in MESH_AXES:
                    raise ConfigError(f"sharding rule {name}={axes!r} is invalid: unknown mesh axis {a!r}; "
                                      f"expected one of {', '.join(MESH_AXES)}")
            if len(set(axes)) != len(axes):
                raise ConfigError(f"sharding rule {name}={axes!r} is invalid: a mesh axis appears twice")
            if name in seen:
                raise ConfigError(f"sharding rules map {name!r} twice")
            seen[name] = axes
        missing = [n for n in LOGICAL_AXES if n not in seen]
        if missing:
            raise ConfigError(f"sharding rules are incomplete: no entry for {', '.join(missing)}")
        return cls(tuple((n, seen[n]) for n in LOGICAL_AXES))

    def mesh_axes(self, name: Optional[str]) -> tuple:
        if name is None:
            return ()
        for n, axes in self.table:
            if n == name:
                return axes
        raise ConfigError(f"unknown logical axis {name!r}")

    def spec(self, names: Sequence[Optional[str]]) -> P:
        """PartitionSpec for logical `names` (one per dimension). A mesh axis already used by an
        earlier dimension is not used again (its later dimension stays unsharded)."""
        used, parts = set(), []
        for name in names:
            axes = tuple(a for a in self.mesh_axes(name) if a not in used)
            used.update(axes)
            parts.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return P(*parts)

    def to_pairs(self) -> list:
        return [(n, list(a)) for n, a in self.table]
