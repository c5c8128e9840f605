"""The parameters' layout for the token loop.

Training lays the parameters out for the train step (FSDP shards every kernel over the data
axes, in float32). Read from that layout every step of the token loop would all-gather the
whole model per generated token: neither libtpu nor XLA's GPU compiler hoists that
loop-invariant gather out of the while loop. So `generate` lays them out once per call,
before the loop, as `layout` says:
  "replicated": every device holds the whole model in the compute dtype (one all-gather of a
      compute-dtype copy per call; the loop is data parallel and moves no weights);
  "tensor": the kernels split over every mesh axis along their heads / mlp / vocab dimension
      (the embed dimension whole), the rows replicated: the loop moves activations only
      (a contraction split over devices sums its partial results in the compute dtype: in
      bf16 the logits round otherwise than on one device; in float32 they are the same);
  "auto": "replicated" when that copy takes at most REPLICATE_FRACTION of a device's memory,
      else "tensor";
  "as-given": the parameters as they come (storage dtype, training layout).
Only kernels and embedding tables (an embed axis beside a heads / mlp / vocab axis, which
every use casts to the compute dtype) are cast, so the outputs do not change; norms, biases,
routers and relative-position tables keep their dtype.
"""

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from tfjax.decode.options import check_layout
from tfjax.decode.stepper import is_encoder_decoder
from tfjax.nn import axes

REPLICATE_FRACTION = 0.4
_SPLIT_AXES = (axes.HEADS, axes.KV_HEADS, axes.MLP, axes.VOCAB)  # what "tensor" shards


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Per parameter leaf (flattened): the dtype to cast to (None: keep) and the sharding (None:
    unconstrained); `rules`: the logical rules the loop's activations follow (None: the
    caller's). Hashable: a static argument of the jitted `_generate`."""

    treedef: Any
    dtypes: tuple
    shardings: tuple
    sources: tuple  # the leaves' own shardings (None: not a NamedSharding)
    rules: tuple | None = None

    def apply(self, params):
        leaves, treedef = jax.tree.flatten(params)
        if treedef != self.treedef:
            raise ValueError(f"parameters {treedef} do not match the layout's {self.treedef}")
        out = []
        for x, dtype, where, source in zip(
            leaves, self.dtypes, self.shardings, self.sources, strict=True
        ):
            if dtype is not None:
                x = x.astype(dtype)
                if source is not None:  # cast where it lies: else the compiler gathers first
                    x = lax.with_sharding_constraint(x, source)
            out.append(x if where is None else lax.with_sharding_constraint(x, where))
        return jax.tree.unflatten(treedef, out)


@functools.lru_cache(maxsize=8)
def _logical_names(model) -> list[tuple]:
    """Each parameter leaf's logical axis names, in tree order (() where it has none)."""
    ids = jnp.zeros((1, 1), jnp.int32)
    args = (ids, ids) if is_encoder_decoder(model) else (ids,)
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), *args)).get("params", {})
    specs = nn.get_partition_spec(boxed)
    return [
        tuple(s) for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    ]


def _device_memory(device) -> int | None:
    """Bytes one device may allocate, from its runtime (None: a host CPU, or a compile-only
    device, for which the caller gives the target's memory)."""
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # compile-only devices have no runtime
        limit = None
    return int(limit) if limit else None


def decode_layout(model, params, layout="auto", *, memory_bytes=None) -> _Layout | None:
    """How `generate` lays out `params` (arrays or ShapeDtypeStructs, unboxed) for its token
    loop (see the section's comment): None for "as-given". memory_bytes: of one device (None:
    what its runtime reports; none reported, as on a CPU, counts as room enough)."""
    check_layout(layout)
    leaves, treedef = jax.tree.flatten(params)
    if layout == "as-given" or not leaves:
        return None
    names = _logical_names(model)
    if len(names) != len(leaves):  # a tree the model does not make (e.g. a wrapped model's)
        names = [()] * len(leaves)
    compute = jnp.dtype(getattr(model, "dtype", None) or jnp.float32)

    def cast(x, n):
        kernel = axes.EMBED in n and any(a in n for a in _SPLIT_AXES)
        floating = jnp.issubdtype(x.dtype, jnp.floating)
        return compute if kernel and floating and x.dtype.itemsize > compute.itemsize else None

    dtypes = tuple(cast(x, n) for x, n in zip(leaves, names, strict=True))
    copy_bytes = sum(
        math.prod(x.shape) * jnp.dtype(d or x.dtype).itemsize
        for x, d in zip(leaves, dtypes, strict=True)
    )
    sources = tuple(
        x.sharding if isinstance(getattr(x, "sharding", None), NamedSharding) else None
        for x in leaves
    )
    mesh = next((s.mesh for s in sources if s is not None), None)
    if mesh is None or mesh.size == 1:  # one device: the cast is the whole layout
        return _Layout(treedef, dtypes, (None,) * len(leaves), sources)
    if layout == "auto":
        if memory_bytes is None:
            memory_bytes = _device_memory(mesh.devices.flat[0])
        fits = memory_bytes is None or copy_bytes <= REPLICATE_FRACTION * memory_bytes
        layout = "replicated" if fits else "tensor"
    if layout == "replicated":
        replicated = (NamedSharding(mesh, PartitionSpec()),) * len(leaves)
        return _Layout(treedef, dtypes, replicated, sources)
    # Split a kernel axis over the whole mesh where every kernel's dimension of it divides.
    mesh_axes = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)
    parts, split = mesh.size, mesh_axes if len(mesh_axes) > 1 else mesh_axes[0]
    dims = [
        (name, x.shape[d]) for x, n in zip(leaves, names, strict=True) for d, name in enumerate(n)
    ]
    splits = {a for a in _SPLIT_AXES if all(size % parts == 0 for name, size in dims if name == a)}

    def spec(n, ndim):
        dim = next((d for d, name in enumerate(n) if name in splits), None)
        return PartitionSpec(*(split if d == dim else None for d in range(ndim)))

    shardings = tuple(
        NamedSharding(mesh, spec(n, x.ndim)) for x, n in zip(leaves, names, strict=True)
    )
    # The rows replicated (absent names are not split), the activations split as the kernels.
    acts = {axes.ACT_MLP: {axes.MLP}, axes.ACT_VOCAB: {axes.VOCAB}}
    acts[axes.ACT_HEADS] = {axes.HEADS, axes.KV_HEADS}
    rules = tuple((act, split) for act, kernel in acts.items() if kernel <= splits)
    rules += ((axes.BATCH, None),)
    return _Layout(treedef, dtypes, shardings, sources, rules)
