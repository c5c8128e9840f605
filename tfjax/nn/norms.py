"""Normalisation layers with logically named parameters.

Letters: D the normalised width (the model width, or H for a per-head norm).

  "layer":        LayerNorm, (x - mean) / std * scale + bias
  "rms":          RMSNorm, x / rms(x) * scale (Llama, Qwen)
  "rms_plus_one": RMSNorm with the scale stored as an offset from one, x / rms(x) * (1 + w),
                  computed in float32 (Gemma; w starts at zero)
"""

from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from jax import lax

from tfjax.nn import axes

NORMS = ("layer", "rms", "rms_plus_one")


def rms_norm_plus_one(x, w, *, eps: float):
    """x / sqrt(mean(x^2) + eps) * (1 + w) over the last axis, in float32, back in x's dtype.

    Args:
      x: [.., D]; w: [D] the offsets from a unit scale.
    """
    x32 = x.astype(jnp.float32)
    # [.., 1]
    inv_rms = lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * inv_rms * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


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
    last axis [.., D] (see the module docstring for the kinds).

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
    if kind == "rms_plus_one":
        return RMSNormPlusOne(
            epsilon=eps, dtype=dtype, param_dtype=param_dtype, name=name, axis_name=axis_name
        )
    raise ValueError(f"norm={kind!r} is unknown; allowed: {NORMS}")
