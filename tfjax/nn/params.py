"""Linen parameters from a tfjax.ops `parameter_shapes` table, as the layers whose maths are
functions of a parameter dict take them (tfjax.nn.mla, tfjax.nn.linear_attention; NNX's
tfjax.nnx.params.ParamTable makes the same)."""

import flax.linen as nn


def table_params(module: nn.Module, shapes: dict, inits: dict, x):
    """The parameters of `shapes` ({name: (shape, logical axes, initializer kind)}), made by
    `module` (in its compact call) from inits[kind] in its param_dtype, and its input x, all in
    its compute dtype: (x, {name: parameter})."""
    p = {}
    for name, (shape, names, kind) in shapes.items():
        init = nn.with_logical_partitioning(inits[kind], names)
        p[name] = module.param(name, init, shape, module.param_dtype)
    # promote_dtype, not astype: LoRA (Qwix) follows a kernel through it to its matmuls
    x, *values = nn.dtypes.promote_dtype(x, *p.values(), dtype=module.dtype)
    return x, dict(zip(p, values, strict=True))
