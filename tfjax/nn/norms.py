"""Normalisation layers with logically named parameters.

Letters: D the normalised width (the model width, or H for a per-head norm).
"""

import flax.linen as nn

from tfjax.nn import axes

NORMS = ("layer", "rms")


def make_norm(kind: str, *, eps: float, dtype, param_dtype, name: str, axis_name=axes.NORM):
    """LayerNorm (scale and bias) or RMSNorm (scale only) over the last axis [.., D].

    `axis_name` is the parameters' logical axis (a per-head norm over H uses axes.HEAD_DIM).
    """
    scale_init = nn.with_logical_partitioning(nn.initializers.ones, (axis_name,))
    if kind == "layer":
        bias_init = nn.with_logical_partitioning(nn.initializers.zeros, (axis_name,))
        return nn.LayerNorm(
            epsilon=eps,
            dtype=dtype,
            param_dtype=param_dtype,
            name=name,
            scale_init=scale_init,
            bias_init=bias_init,
        )
    if kind == "rms":
        return nn.RMSNorm(
            epsilon=eps, dtype=dtype, param_dtype=param_dtype, name=name, scale_init=scale_init
        )
    raise ValueError(f"norm={kind!r} is unknown; allowed: {NORMS}")
