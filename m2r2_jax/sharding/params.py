"""Logical axes of every parameter, by its path in the tree, and the shardings they give.

Base trees (`models.transformer`) and M2R2 trees (`m2r2.fast_stream`) are plain nested dicts, so a
parameter is named by its path: the table below maps the last one or two path keys to the logical
axes of that leaf. The stacked layer axis ("layers" / "fast_steps") is added in front for leaves
under `layers` or inside the M2R2 tree's stacked groups. An unknown leaf is an error rather than
silently replicated, so a new parameter cannot slip through unsharded.

A dimension that its mesh axes do not divide (a vocabulary of 257, 32,001 or 50,257 over tensor=4)
is not refused; what happens instead is said by `placement_notes` (shown by
`ShardingPlan.describe`), naming the parameter, the dimension and why, so a mesh never runs
replicated by surprise (that is what runs out of memory on the real hardware):

(a) Vocabulary dimensions (the embedding's rows, the untied LM head's columns) are *padded*: the
    sharding keeps the split, and `put_global` (every placement for a plan goes through it) pads
    the leaf with zeros up to a multiple of the mesh axes' size (`pad_vocab_leaves`; ahead-of-time
    checks pad the abstract shapes). The embedding and head then run vocabulary-parallel, as serving
    engines do. Padding is safe without masking anywhere else: token ids are < vocab_size, so no
    padded row is looked up, and `models.transformer.head` drops the padded logits before anything
    (softmax, argmax, sampling, top-p, log-probs, KL) sees them: logits stay [..., vocab_size]
    and no output can hold a padded id. Frozen and served parameters only: see (b).
(b) Any other non-dividing dimension is *replicated* over the mesh axes that do not divide it (the
    longest leading part of a multi-axis split that divides it is kept). So are the vocabulary
    dimensions of *trained* parameters (`pad_vocab=False`, base pre-training): padding would change
    the shapes of the train state, its checkpoints (which must restore onto any mesh) and the
    returned parameters.

Only what cannot be placed at all is an error: a parameter with no logical axes.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from m2r2_jax.errors import ConfigError
from m2r2_jax.sharding.mesh import axis_size
from m2r2_jax.sharding.plan import ShardingPlan

# (last path keys) -> logical axes of the unstacked leaf
_BASE_LEAVES = {
    ("embed", "embedding"): ("vocab", "embed"),
    ("lm_head", "kernel"): ("embed", "vocab"),
    ("q_proj", "kernel"): ("embed", "q_heads"),
    ("q_proj", "bias"): ("q_heads",),
    ("k_proj", "kernel"): ("embed", "kv_heads"),
    ("k_proj", "bias"): ("kv_heads",),
    ("v_proj", "kernel"): ("embed", "kv_heads"),
    ("v_proj", "bias"): ("kv_heads",),
    ("o_proj", "kernel"): ("q_heads", "embed"),
    ("gate_proj", "kernel"): ("embed", "mlp"),
    ("up_proj", "kernel"): ("embed", "mlp"),
    ("down_proj", "kernel"): ("mlp", "embed"),
    ("router", "kernel"): ("embed", "expert_logits"),
    ("shared_expert_gate", "kernel"): ("embed", None),
    ("experts_gate",): ("experts", "embed", "mlp"),
    ("experts_up",): ("experts", "embed", "mlp"),
    ("experts_down",): ("experts", "mlp", "embed"),
    ("scale",): ("norm",),
}

# Adapter targets: (input axis, output axis) of the base projection they wrap.
_ADAPTER_IO = {
    "q_proj": ("embed", "q_heads"), "k_proj": ("embed", "kv_heads"), "v_proj": ("embed", "kv_heads"),
    "o_proj": ("q_heads", "embed"), "gate_proj": ("embed", "mlp"), "up_proj": ("embed", "mlp"),
    "down_proj": ("mlp", "embed"),
}


def _keys(path) -> tuple:
    """Dict keys / attribute names of a path; tuple and list positions are skipped, so a tuple of
    trees (the frozen (base, rest) pair of distillation) names its leaves like its members do."""
    out = []
    for p in path:
        if isinstance(p, jax.tree_util.SequenceKey):
            continue
        out.append(str(getattr(p, "key", getattr(p, "name", p))))
    return tuple(out)


def _base_leaf_axes(keys: tuple) -> Optional[tuple]:
    for n in (2, 1):
        if len(keys) >= n and keys[-n:] in _BASE_LEAVES:
            axes = _BASE_LEAVES[keys[-n:]]
            return (("layers",) + axes) if keys[0] == "layers" else axes
    return None


def _m2r2_leaf_axes(keys: tuple, ndim: int) -> Optional[tuple]:
    group = keys[0]
    if group == "adapters" and len(keys) == 3 and keys[1] in _ADAPTER_IO:
        din, dout = _ADAPTER_IO[keys[1]]
        return ("fast_steps", din, "lora_rank") if keys[2] == "A" else ("fast_steps", "lora_rank", dout)
    if group == "rates":
        return ("fast_steps", "embed")
    if group == "exit_norm":
        return ("fast_steps", "norm")
    if group == "moe_lowrank":
        return ("fast_steps", "embed", "lora_rank") if keys[-1] == "A" else ("fast_steps", "lora_rank", "embed")
    if group in ("router", "step_mlp"):  # a few thousand numbers: replicated
        return (None,) * ndim
    return None


def leaf_axes(keys: tuple, ndim: int) -> tuple:
    """Logical axes of the leaf at path `keys` (a base tree or an M2R2 tree leaf)."""
    m2r2_group = keys[0] in ("adapters", "rates", "exit_norm", "moe_lowrank", "router", "step_mlp")
    axes = _m2r2_leaf_axes(keys, ndim) if m2r2_group else _base_leaf_axes(keys)
    if axes is None or len(axes) != ndim:
        raise ConfigError(f"no logical axes for parameter {'/'.join(keys)} (rank {ndim}); "
                          "add it to m2r2_jax/sharding/params.py")
    return axes


def logical_axes(tree) -> Any:
    """Tree of logical-axes tuples with the structure of `tree` (arrays or ShapeDtypeStructs)."""
    return jax.tree_util.tree_map_with_path(lambda path, x: leaf_axes(_keys(path), len(x.shape)), tree)


def _axes_text(part) -> str:
    return part if isinstance(part, str) else "x".join(part)


def _dividing_part(mesh, part, size: int):
    """The longest leading part of mesh axes `part` whose size divides `size` (None: none does)."""
    axes = (part,) if isinstance(part, str) else tuple(part)
    for k in range(len(axes), 0, -1):
        if size % axis_size(mesh, axes[:k]) == 0:
            return axes[0] if k == 1 else axes[:k]
    return None


def _leaf_sharding(plan: ShardingPlan, keys: tuple, shape, axes, pad_vocab: bool):
    """(sharding, notes) of one leaf: its sharding by its logical axes, where a dimension its mesh
    axes do not divide is padded (vocabulary, `pad_vocab`) or replicated, and {key: line} saying
    which and why (see the module docstring)."""
    spec = plan.spec(axes)
    parts, name, changed, notes = list(spec), "/".join(keys), False, {}
    for dim, part in enumerate(parts):
        if part is None:
            continue
        size, n = int(shape[dim]), axis_size(plan.mesh, part)
        if size % n == 0:
            continue
        where = f"{_axes_text(part)}={n}"
        if axes[dim] == "vocab" and pad_vocab:
            notes[f"{name}:{dim}"] = f"{name}: vocab {size} padded to {-(-size // n) * n} for {where}"
            continue
        kept = _dividing_part(plan.mesh, part, size)
        why = ("a trained parameter is not padded" if axes[dim] == "vocab" else f"{size} is not divisible by {n}")
        over = "" if kept is None else f" (split over {_axes_text(kept)} only)"
        notes[f"{name}:{dim}"] = f"{name}: dimension {dim} ({axes[dim]}={size}) replicated over {where}{over}: {why}"
        parts[dim], changed = kept, True
    return NamedSharding(plan.mesh, P(*parts) if changed else spec), notes


def _placed(plan: ShardingPlan, tree, pad_vocab: bool):
    return jax.tree_util.tree_map_with_path(
        lambda path, x: _leaf_sharding(plan, _keys(path), x.shape, leaf_axes(_keys(path), len(x.shape)), pad_vocab),
        tree)


def _is_placed(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], NamedSharding)


def param_shardings(plan: ShardingPlan, tree, pad_vocab: bool = True) -> Any:
    """NamedSharding per leaf of a parameter tree (base, M2R2 or draft model). A vocabulary
    dimension its mesh axes do not divide keeps its split (the leaf is padded when placed:
    `put_global`, `pad_vocab_leaves`) unless `pad_vocab` is False (trained parameters), in which case it
    is replicated like any other non-dividing dimension; `placement_notes` says which."""
    return jax.tree.map(lambda x: x[0], _placed(plan, tree, pad_vocab), is_leaf=_is_placed)


def placement_notes(plan: ShardingPlan, tree, pad_vocab: bool = True) -> dict:
    """{key: line} for every dimension of `tree` that `param_shardings` pads or replicates on this
    plan's mesh (for `ShardingPlan.describe`), in the tree's order; {} when every dimension divides."""
    notes: dict = {}
    for _, leaf_notes in jax.tree.leaves(_placed(plan, tree, pad_vocab), is_leaf=_is_placed):
        notes.update(leaf_notes)
    return notes


def named_placement_notes(plan: ShardingPlan, trees: Mapping[str, Any]) -> dict:
    """`placement_notes` of several named trees ({"base": ..., "m2r2": ...}; None entries skipped),
    each key prefixed with its tree's name: what an engine or a benchmark placed, for `describe`."""
    return {f"{name}/{key}": line for name, tree in trees.items() if tree is not None
            for key, line in placement_notes(plan, tree).items()}


def _vocab_padding(keys: tuple, shape, sharding) -> Optional[tuple]:
    """(dimension, padded size) when the leaf at `keys` has a vocabulary dimension that
    `sharding` splits unevenly (a padded vocabulary of `param_shardings`), else None."""
    if not isinstance(sharding, NamedSharding):
        return None
    axes = _base_leaf_axes(keys)
    if axes is None or len(axes) != len(shape) or "vocab" not in axes:
        return None
    dim = axes.index("vocab")
    spec = list(sharding.spec) + [None] * len(shape)
    n = axis_size(sharding.mesh, spec[dim])
    size = int(shape[dim])
    return None if size % n == 0 else (dim, -(-size // n) * n)


def pad_vocab_leaves(tree, shardings) -> Any:
    """`tree` with every vocabulary dimension that its sharding splits unevenly padded with zeros
    to a multiple of the split (leaves: jax or numpy arrays, or ShapeDtypeStructs, whose shape is
    padded); every other leaf as it is. `put_global` calls it; ahead-of-time checks call it on
    abstract trees."""
    import numpy as np

    def pad(path, x, sh):
        hit = _vocab_padding(_keys(path), x.shape, sh)
        if hit is None:
            return x
        dim, size = hit
        if isinstance(x, jax.ShapeDtypeStruct):
            shape = tuple(size if i == dim else s for i, s in enumerate(x.shape))
            return jax.ShapeDtypeStruct(shape, x.dtype, sharding=x.sharding)
        widths = [(0, size - x.shape[i] if i == dim else 0) for i in range(x.ndim)]
        return np.pad(x, widths) if isinstance(x, np.ndarray) else jax.numpy.pad(x, widths)

    return jax.tree_util.tree_map_with_path(pad, tree, shardings)


def put_global(tree, shardings, copy: bool = False) -> Any:
    """Place host data (the same on every process) as global arrays with `shardings` (a tree
    matching `tree`). One process: `device_put`. Several: each process builds its own shards from
    its copy, since no process can address the others' devices. `copy`: never share a buffer
    with the input (what a caller must ask for before donating the result). A vocabulary that
    its sharding splits unevenly is padded first (`pad_vocab_leaves`)."""
    tree = pad_vocab_leaves(tree, shardings)
    if jax.process_count() == 1:
        if copy:  # device_put may reuse the input's buffer for the shard on its own device
            import jax.numpy as jnp

            return jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=shardings)(tree)
        return jax.device_put(tree, shardings)
    import numpy as np

    def put(x, sh):
        host = np.asarray(jax.device_get(x))
        return jax.make_array_from_callback(host.shape, sh, lambda idx: host[idx])

    return jax.tree.map(put, tree, shardings)


def shard_params(plan: ShardingPlan, tree) -> Any:
    """`tree` placed on the plan's devices with its parameter shardings."""
    return put_global(tree, param_shardings(plan, tree))


def follow_params(plan: ShardingPlan, tree, params, param_sh) -> Any:
    """Shardings for a tree whose leaves mirror parameters (optimiser moments, gradients): a leaf
    whose path ends with a parameter's path and has its shape gets that parameter's sharding;
    anything else (step counters, scalars) is replicated."""
    by_path = {}
    for (path, x), sh in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(param_sh)):
        by_path[_keys(path)] = (tuple(x.shape), sh)

    def pick(path, x):
        keys = _keys(path)
        for start in range(len(keys)):
            hit = by_path.get(keys[start:])
            if hit is not None and hit[0] == tuple(x.shape):
                return hit[1]
        return plan.replicated

    return jax.tree_util.tree_map_with_path(pick, tree)


def describe_shardings(shardings: Mapping) -> dict:
    """{'path': 'PartitionSpec(...)'} for logs and the AOT report."""
    return {"/".join(_keys(p)): str(s.spec) for p, s in jax.tree_util.tree_leaves_with_path(shardings)}
