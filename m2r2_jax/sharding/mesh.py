"""Device meshes from `--mesh data=2,fsdp=1,tensor=4` style specs.

A mesh always has the four axes of `rules.MESH_AXES` (unnamed ones have size 1). One size may be
-1: it takes whatever the other axes leave of the device count. A spec whose sizes do not multiply
to the number of devices is refused with one line naming both numbers.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence, Union

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from m2r2_jax.errors import ConfigError
from m2r2_jax.sharding.rules import MESH_AXES

MeshSpec = Union[str, Mapping[str, int], None]


def parse_mesh(spec: MeshSpec) -> dict:
    """'data=2,tensor=4' (or a mapping) -> {'data': 2, 'fsdp': 1, 'tensor': 4, 'expert': 1}."""
    if spec is None or spec == "":
        return {a: (-1 if a == "data" else 1) for a in MESH_AXES}
    if isinstance(spec, str):
        items = {}
        for part in spec.split(","):
            part = part.strip()
            if not part:
                continue
            name, eq, size = part.partition("=")
            name = name.strip()
            if not eq:
                raise ConfigError(f"--mesh {spec!r} is invalid: {part!r} is not AXIS=SIZE")
            if name in items:
                raise ConfigError(f"--mesh {spec!r} is invalid: axis {name!r} given twice")
            try:
                items[name] = int(size)
            except ValueError:
                raise ConfigError(f"--mesh {spec!r} is invalid: size {size.strip()!r} of {name!r} is not an integer") from None
    else:
        items = dict(spec)
    for name, size in items.items():
        if name not in MESH_AXES:
            raise ConfigError(f"mesh axis {name!r} is invalid: expected one of {', '.join(MESH_AXES)}")
        if not isinstance(size, (int, np.integer)) or (size < 1 and size != -1):
            raise ConfigError(f"mesh axis {name}={size!r} is invalid: expected a positive integer or -1")
    if sum(1 for s in items.values() if s == -1) > 1:
        raise ConfigError("mesh is invalid: at most one axis may be -1")
    return {a: int(items.get(a, 1)) for a in MESH_AXES}


def resolve_sizes(sizes: Mapping[str, int], n_devices: int) -> dict:
    """Fill the -1 axis and check that the sizes use exactly `n_devices` devices."""
    sizes = dict(sizes)
    known = int(np.prod([s for s in sizes.values() if s != -1]))
    fill = [a for a, s in sizes.items() if s == -1]
    if fill:
        if n_devices % known:
            raise ConfigError(f"mesh {format_mesh(sizes)} does not fit {n_devices} devices: the other axes "
                              f"use {known}, which does not divide {n_devices}")
        sizes[fill[0]] = n_devices // known
    total = int(np.prod(list(sizes.values())))
    if total != n_devices:
        raise ConfigError(f"mesh {format_mesh(sizes)} needs {total} devices but {n_devices} are available "
                          f"({jax.default_backend()}, {jax.process_count()} process(es))")
    return sizes


def format_mesh(sizes: Mapping[str, int]) -> str:
    return ",".join(f"{a}={sizes[a]}" for a in MESH_AXES if a in sizes)


def make_mesh(spec: MeshSpec = None, devices: Optional[Sequence] = None) -> Mesh:
    """A 4-axis mesh over `devices` (default: every device of every process)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_sizes(parse_mesh(spec), len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def axis_size(mesh: Mesh, axes) -> int:
    """Number of devices that mesh axes (None, a name, or a tuple of names) span."""
    if axes is None:
        return 1
    if isinstance(axes, str):
        axes = (axes,)
    return int(np.prod([mesh.shape[a] for a in axes]))
