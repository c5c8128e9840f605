"""NNX parameters with logical axis names: how tfjax.nnx's modules create them and place them on
the mesh in context (the blocks; `ParamTable`: multi-head latent attention, tfjax.nnx.mla, and
Gated DeltaNet, tfjax.nnx.linear_attention)."""

from collections.abc import Callable
from types import ModuleType
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from tfjax.ops.config import default_kernel_init


def place(value, names):
    """`value` placed where the logical axis rules in context put a parameter of logical
    `names` on the mesh in context (jax.set_mesh); as it is without a mesh or rules. Resolved by
    Linen's nn.logical_to_mesh_axes, so as the Linen model's parameter: a mesh axis goes to the
    first name whose rule names it (the expert-parallel rules give E the fsdp axis before D);
    NNX's own eager sharding maps each name alone, and two names can then claim one axis."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not nn.get_logical_axis_rules():
        return value
    spec = nn.logical_to_mesh_axes(tuple(names))
    if mesh.are_all_axes_explicit:
        return jax.sharding.reshard(value, spec)
    return jax.lax.with_sharding_constraint(value, spec)


def metadata(names) -> dict:
    """A parameter's metadata: its logical axis `names` (one per dimension); its placement on a
    mesh is `place`'s, not NNX's eager sharding."""
    return {"out_sharding": tuple(names), "eager_sharding": False}


def param(rngs: nnx.Rngs, init: Callable, shape, dtype, names) -> nnx.Param:
    """An nnx.Param of `shape` and `dtype` from `init`, carrying its logical axis `names` (and
    placed by them under a mesh)."""
    return nnx.Param(place(init(rngs.params(), shape, dtype), names), **metadata(names))


class ParamTable(nnx.Module):
    """A layer on inputs of `width` whose parameters are the table of its tfjax.ops module
    `OPS` (`OPS.parameter_shapes(config, width)`: {name: (shape, logical axes, initializer
    kind)}), each the attribute of its name, made from `OPS.initializers(kernel_init)[kind]`
    (as Linen's tfjax.nn.params.table_params makes them); `promoted` hands them to the ops'
    maths."""

    OPS: ModuleType  # the layer's tfjax.ops module (tfjax.ops.mla, tfjax.ops.linear_attention)

    def __init__(
        self,
        config,
        width: int,
        *,
        kernel_init: Callable = default_kernel_init,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.config, self.dtype = config, dtype
        shapes, inits = self.OPS.parameter_shapes(config, width), self.OPS.initializers(kernel_init)
        self.names = tuple(shapes)
        for name, (shape, names, kind) in shapes.items():
            setattr(self, name, param(rngs, inits[kind], shape, param_dtype, names))

    def promoted(self, x):
        """x and the parameters in the compute dtype: (x, {name: parameter})."""
        # promote_dtype, not astype: LoRA (Qwix) follows a kernel through it to its matmuls
        x, *values = nnx.nn.dtypes.promote_dtype(
            (x, *(getattr(self, n)[...] for n in self.names)), dtype=self.dtype
        )
        return x, dict(zip(self.names, values, strict=True))
