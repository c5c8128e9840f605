"""Logical axis names, rules -> NamedSharding, and the device mesh from the config.

Model code names the axes of every parameter and of the activations at block boundaries with
the logical names of `tfjax.ops.axes` (`tfjax.nn.axes` to Linen model code). A run maps them
onto a mesh with three axes through `config.logical_axis_rules`:

  data    pure data parallelism: the batch is split, parameters are replicated
  fsdp    the batch is split and so are parameters and optimizer state (ZeRO-3 / FSDP)
  tensor  Megatron-style tensor parallelism: heads, MLP and vocab dimensions are split

Data parallel, FSDP and tensor parallel runs differ only in `config.mesh` (and, if wanted, the
rules); the model never sees a mesh. With the default rules a weight [embed, mlp] is sharded
as P("fsdp", "tensor") and a batch [batch, length] as P(("data", "fsdp"), None).

Expert parallelism is a rule too: a mixture-of-experts layer's kernels [experts, embed, mlp]
keep their experts whole by default (FSDP and tensor parallelism split them as any kernel);
`expert_parallel(rules, "fsdp")` puts the experts on the fsdp axis instead, E / fsdp per device,
and the tokens then travel to their experts (tfjax.ops.moe says how).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from tfjax.ops import axes

__all__ = [
    "DEFAULT_RULES",
    "MESH_AXES",
    "MESH_CONFIG_KEYS",
    "batch_sharding",
    "check_divisible",
    "check_rules",
    "data_parallel_size",
    "data_shard",
    "expert_parallel",
    "logical_context",
    "logical_shardings",
    "make_mesh",
    "replicated",
    "shard_batch",
]

# Outermost to innermost: neighbouring devices (the fastest links) form the tensor axis.
MESH_AXES = ("data", "fsdp", "tensor")
# config.mesh: the sizes of MESH_AXES within a slice, and how many slices the data axis spans.
MESH_CONFIG_KEYS = MESH_AXES + ("dcn_data",)

# (logical name, mesh axis or axes or None). A name absent from the rules is not sharded.
DEFAULT_RULES = (
    (axes.BATCH, ("data", "fsdp")),
    (axes.LENGTH, None),
    (axes.ACT_EMBED, None),
    (axes.ACT_HEADS, "tensor"),
    (axes.ACT_MLP, "tensor"),
    (axes.ACT_VOCAB, "tensor"),
    (axes.EMBED, "fsdp"),
    (axes.MLP, "tensor"),
    (axes.HEADS, "tensor"),
    (axes.KV_HEADS, "tensor"),
    (axes.VOCAB, "tensor"),
    (axes.HEAD_DIM, None),
    (axes.NORM, None),
    (axes.LAYERS, None),
    (axes.EXPERTS, None),
)


def expert_parallel(rules, mesh_axes):
    """`rules` with a mixture's experts split over `mesh_axes` (a mesh axis or a tuple of them),
    its rule first: a weight's mesh axis goes to the first of its logical axes whose rule names
    it, so the experts take it before the kernels' embed (FSDP) or mlp (tensor) axis does."""
    return ((axes.EXPERTS, mesh_axes),) + tuple(
        r for r in check_rules(rules) if r[0] != axes.EXPERTS
    )


def make_mesh(mesh_config: Mapping[str, int], devices: Sequence | None = None) -> Mesh:
    """A mesh with axes MESH_AXES whose sizes come from `mesh_config` ({"data": -1, ...}).

    One of data, fsdp, tensor may be -1: it takes the devices the others leave. Their sizes
    multiply to the devices of one slice (all processes' devices in a multi-host run), so that
    no device idles. Several TPU slices (devices with different `slice_index`, joined by the
    data-centre network, DCN) are joined on the data axis only: mesh_config["dcn_data"] (-1 or
    absent: one part per slice) must then equal the number of slices, and the mesh's data axis
    is dcn_data x data, slices outermost, so that only the gradient reduction crosses DCN (the
    hybrid mesh of MaxText's dcn_*_parallelism).
    """
    devices = list(jax.devices() if devices is None else devices)
    unknown = sorted(set(mesh_config) - set(MESH_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"mesh: unknown axis {unknown}; the axes are {MESH_CONFIG_KEYS}")
    slices = _by_slice(devices)
    dcn = int(mesh_config.get("dcn_data", -1))
    if dcn not in (-1, len(slices)):
        raise ValueError(
            f"mesh.dcn_data={dcn}, but the devices span {len(slices)} slice(s): only the data "
            f"axis crosses slices, so dcn_data must be {len(slices)} (or -1)"
        )
    n = len(slices[0])
    where = f"the {n} devices" + (f" of each of {len(slices)} slices" if len(slices) > 1 else "")
    sizes = {axis: int(mesh_config.get(axis, 1)) for axis in MESH_AXES}
    free = [axis for axis, size in sizes.items() if size == -1]
    bad = [axis for axis, size in sizes.items() if size == 0 or size < -1]
    if bad or len(free) > 1:
        raise ValueError(
            f"mesh {sizes}: sizes must be positive, with at most one -1 (the remaining devices)"
        )
    known = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if n % known:
            raise ValueError(
                f"mesh {sizes}: the fixed sizes multiply to {known}, which does not divide {where}"
            )
        sizes[free[0]] = n // known
    if math.prod(sizes.values()) != n:
        raise ValueError(
            f"mesh {sizes} has {math.prod(sizes.values())} devices but there are {n} "
            f"({where}); the sizes must multiply to the device count (use -1 for one axis to "
            "take the rest)"
        )
    shape = tuple(sizes[axis] for axis in MESH_AXES)
    # Slices outermost on the data axis: each slice holds a contiguous block of the batch.
    grid = np.concatenate([_device_grid(shape, group) for group in slices], axis=0)
    # Auto axes: XLA's partitioner propagates shardings from our annotations (GSPMD style).
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _by_slice(devices) -> list[list]:
    """The devices grouped by TPU slice (one group where devices have no slice_index)."""
    groups: dict[int, list] = {}
    for d in devices:
        groups.setdefault(getattr(d, "slice_index", 0) or 0, []).append(d)
    sizes = {len(g) for g in groups.values()}
    if len(sizes) > 1:
        raise ValueError(f"mesh: the slices have different device counts {sorted(sizes)}")
    return [groups[k] for k in sorted(groups)]


def _device_grid(shape, devices) -> np.ndarray:
    """`devices` as an array of `shape` whose inner axes are physical neighbours."""
    try:
        # JAX's physical layout (TPU torus rings on the inner axes); it takes one device per
        # chip, so it refuses the per-TensorCore devices of v4 compile-only topologies.
        return jax.make_mesh(shape, MESH_AXES, devices=devices).devices
    except (AssertionError, ValueError, NotImplementedError):
        pass
    try:
        return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (AssertionError, ValueError, NotImplementedError):
        # The two cores of a chip next to each other, chips in coordinate order.
        def key(d):
            return (
                d.process_index,
                tuple(getattr(d, "coords", ()))[::-1],
                getattr(d, "core_on_chip", 0),
                d.id,
            )

        return np.array(sorted(devices, key=key), dtype=object).reshape(shape)


def check_rules(rules) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
    """Rules as a tuple of (name, mesh axes) pairs; an unknown mesh axis is an error naming it.

    Accepts what a config holds (lists from JSON or the command line as well as tuples).
    """
    out = []
    for rule in rules:
        if len(rule) != 2 or not isinstance(rule[0], str):
            raise ValueError(f"logical_axis_rules: {rule!r} is not a (name, mesh axes) pair")
        name, target = rule
        if isinstance(target, (list, tuple)):
            target = tuple(target)
            mesh_axes = target
        else:
            mesh_axes = () if target is None else (target,)
        for axis in mesh_axes:
            if axis not in MESH_AXES:
                raise ValueError(
                    f"logical_axis_rules: rule for {name!r} names mesh axis {axis!r}; the mesh "
                    f"axes are {MESH_AXES}"
                )
        out.append((name, target))
    return tuple(out)


def logical_shardings(abstract_tree, mesh: Mesh, rules):
    """NamedShardings for a tree of nn.LogicallyPartitioned leaves (e.g. from jax.eval_shape of
    `model.init`); leaves without names are replicated."""
    specs = nn.get_partition_spec(abstract_tree)
    return nn.logical_to_mesh_sharding(specs, mesh, rules)


@contextlib.contextmanager
def logical_context(mesh: Mesh, rules):
    """Inside a function being traced for jit: the model's logical activation constraints take
    effect (flax reads the rules and the abstract mesh from the context)."""
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(rules):
        yield


def check_divisible(abstract_tree, shardings, what: str = "parameter") -> None:
    """Every sharded dimension must divide evenly over its mesh axes (JAX requires it for
    parameters); the error names the array, its shape and the offending dimension."""
    flat = jax.tree_util.tree_flatten_with_path(abstract_tree)[0]
    for (path, leaf), sharding in zip(flat, jax.tree.leaves(shardings), strict=True):
        for dim, entry in enumerate(sharding.spec):
            parts = math.prod(sharding.mesh.shape[a] for a in _mesh_axes(entry))
            if leaf.shape[dim] % parts:
                name = "/".join(str(getattr(k, "key", k)) for k in path)
                raise ValueError(
                    f"{what} {name!r} of shape {tuple(leaf.shape)} cannot be sharded as "
                    f"{sharding.spec} on mesh {dict(sharding.mesh.shape)}: dimension {dim} "
                    f"({leaf.shape[dim]}) is not divisible by {parts}. Change the mesh, the "
                    "model size or config.logical_axis_rules."
                )


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, rules, ndim: int) -> NamedSharding:
    """How an input array [B, ...] is laid out: its batch axis by the `batch` rule."""
    return NamedSharding(mesh, nn.logical_to_mesh_axes((axes.BATCH,) + (None,) * (ndim - 1), rules))


def data_parallel_size(mesh: Mesh, rules) -> int:
    """Number of shards of the batch axis (data x fsdp with the default rules)."""
    spec = nn.logical_to_mesh_axes((axes.BATCH,), rules)[0]
    return math.prod(mesh.shape[axis] for axis in _mesh_axes(spec))


def _mesh_axes(entry) -> tuple:
    """A PartitionSpec entry (None, a mesh axis, or a tuple of them) as a tuple of mesh axes."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


@functools.lru_cache(maxsize=16)
def data_shard(mesh: Mesh, rules) -> tuple[int, int]:
    """(index, count): which distinct part of the global batch this process loads.

    Processes whose devices hold the same batch rows (when an axis that does not split the
    batch, e.g. `tensor`, spans processes) must load the same examples, so the loader is
    sharded over the distinct row sets, not over processes.
    """
    sharding = batch_sharding(mesh, rules, 1)
    rows_of = {}  # process -> the set of rows its devices hold, with one row per batch shard
    for device, index in sharding.devices_indices_map((data_parallel_size(mesh, rules),)).items():
        r = index[0]
        rows_of.setdefault(device.process_index, set()).add((r.start or 0, r.stop))
    groups = sorted({tuple(sorted(rows)) for rows in rows_of.values()})
    return groups.index(tuple(sorted(rows_of[jax.process_index()]))), len(groups)


def shard_batch(batch: Mapping[str, np.ndarray], mesh: Mesh, rules) -> dict[str, jax.Array]:
    """This process's rows of the global batch -> global arrays sharded by the `batch` rule.

    Each process passes only the rows it loaded (global batch / `data_shard` count); on one
    process this is a plain device_put.
    """
    out = {}
    for key, local in batch.items():
        local = np.asarray(local)
        sharding = batch_sharding(mesh, rules, local.ndim)
        rows = local.shape[0] * data_shard(mesh, rules)[1]
        out[key] = jax.make_array_from_process_local_data(sharding, local, (rows, *local.shape[1:]))
    return out
