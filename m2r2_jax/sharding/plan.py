"""A sharding plan (mesh + rules) and the one helper that model code calls on activations.

    plan = ShardingPlan.from_preset("specdec", mesh="data=2,tensor=4")
    with plan.scope():            # entered *inside* a jitted function while it is traced
        x = constrain(x, ("batch", "length", "act_embed"))

`constrain` is the identity when no plan is in scope, so unsharded code paths are untouched. A
plan is hashable and is passed to jitted functions as (part of) a static argument, which makes a
different plan a different compiled program: the trace never reuses a cached trace made without
the constraints.

An activation dimension that its mesh axes do not divide (a batch of 1 over data=2, say) stays
unsharded in that constraint. A parameter dimension that they do not divide is padded (the
vocabulary) or replicated, and `params.placement_notes` says which, for `describe(notes)`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Mapping, Optional, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from m2r2_jax.sharding.mesh import MeshSpec, axis_size, format_mesh, make_mesh
from m2r2_jax.sharding.rules import Rules

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("m2r2_sharding_plan", default=None)


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    mesh: Mesh
    rules: Rules
    name: str = "custom"

    @classmethod
    def from_preset(cls, preset: str, mesh: MeshSpec = None, devices=None) -> "ShardingPlan":
        """A named preset of `configs/sharding/` (or a path to a preset file) on a mesh; `mesh`
        None uses the preset's own default mesh."""
        from m2r2_jax.sharding.presets import load_preset

        cfg = load_preset(preset)
        spec = cfg.mesh if mesh is None or mesh == "" else mesh
        return cls(make_mesh(spec, devices), Rules.from_pairs(cfg.rules), cfg.name)

    def spec(self, names: Sequence[Optional[str]]) -> P:
        return self.rules.spec(names)

    def sharding(self, names: Sequence[Optional[str]]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(names))

    def fitted_sharding(self, names: Sequence[Optional[str]], shape: Sequence[int]) -> NamedSharding:
        """`sharding(names)` with every dimension its mesh axes do not divide left unsharded."""
        parts = list(self.spec(names)) + [None] * (len(shape) - len(names))
        parts = parts[:len(shape)]
        fitted = [p if p is None or shape[i] % axis_size(self.mesh, p) == 0 else None for i, p in enumerate(parts)]
        return NamedSharding(self.mesh, P(*fitted))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def axis_size(self, name: str) -> int:
        """Devices that logical axis `name` is split over."""
        return axis_size(self.mesh, self.rules.mesh_axes(name) or None)

    def describe(self, notes: Mapping[str, str] = None) -> str:
        """'specdec on mesh data=2,...' and one line per note of how parameters were placed on it
        (`params.placement_notes`: each padded or replicated parameter dimension)."""
        text = f"{self.name} on mesh {format_mesh(dict(self.mesh.shape))}"
        return "; ".join([text, *(notes or {}).values()])

    @contextlib.contextmanager
    def scope(self):
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)


def active_plan() -> Optional[ShardingPlan]:
    return _ACTIVE.get()


@contextlib.contextmanager
def maybe_scope(plan: Optional[ShardingPlan]):
    """`plan.scope()`, or nothing when plan is None."""
    if plan is None:
        yield None
    else:
        with plan.scope():
            yield plan


def constrain(x: jax.Array, names: Sequence[Optional[str]]) -> jax.Array:
    """Pin activation `x`'s sharding to logical `names` under the plan in scope (else identity).
    Names align with the trailing dimensions: extra leading dimensions (a stack of per-step
    states, say) stay unsharded; fewer dimensions use the last names."""
    plan = _ACTIVE.get()
    if plan is None:
        return x
    names = tuple(names)
    names = (None,) * (x.ndim - len(names)) + names if x.ndim >= len(names) else names[len(names) - x.ndim:]
    return jax.lax.with_sharding_constraint(x, plan.fitted_sharding(names, x.shape))
