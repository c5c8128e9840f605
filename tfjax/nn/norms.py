"""Normalisation layers with logically named parameters (the kinds and the maths of
"rms_plus_one": tfjax.ops.norms).

Letters: D the normalised width (the model width, or H for a per-head norm).
"""

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from tfjax.nn import axes
from tfjax.ops.norms import NORMS, rms_norm_plus_one


class RMSNormPlusOne(nn.Module):
    """`rms_norm_plus_one` with its offsets w as the parameter "scale" [D] (zeros at init)."""

    epsilon: float = 1e-6  # added to the mean square
    dtype: Any = None  # output dtype; the input's when None
    param_dtype: Any = jnp.float32  # storage dtype of w
    axis_name: str = axes.NORM  # w's logical axis

    @nn.compact
    def __call__(self, x):
        """x: [.., D] -> [.., D]."""
        w = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.zeros, (self.axis_name,)),
            (x.shape[-1],),
            self.param_dtype,
        )
        return rms_norm_plus_one(x.astype(self.dtype or x.dtype), w, eps=self.epsilon)


def make_norm(kind: str, *, eps: float, dtype, param_dtype, name: str, axis_name=axes.NORM):
    """LayerNorm (scale and bias), RMSNorm (scale only) or RMSNorm with (1 + scale) over the
    last axis [.., D] (the kinds: tfjax.ops.norms).

    `axis_name` is the parameters' logical axis (a per-head norm over H uses axes.HEAD_DIM).
    """
    options = dict(epsilon=eps, dtype=dtype, param_dtype=param_dtype, name=name)
    scale_init = nn.with_logical_partitioning(nn.initializers.ones, (axis_name,))
    if kind == "layer":
        bias_init = nn.with_logical_partitioning(nn.initializers.zeros, (axis_name,))
        return nn.LayerNorm(scale_init=scale_init, bias_init=bias_init, **options)
    if kind == "rms":
        return nn.RMSNorm(scale_init=scale_init, **options)
    if kind == "rms_plus_one":
        return RMSNormPlusOne(axis_name=axis_name, **options)
    raise ValueError(f"norm={kind!r} is unknown; allowed: {NORMS}")
