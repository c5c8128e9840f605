"""Normalisation maths.

Letters: D the normalised width (the model width, or H for a per-head norm).

  "layer":        LayerNorm, (x - mean) / std * scale + bias
  "rms":          RMSNorm, x / rms(x) * scale (Llama, Qwen)
  "rms_plus_one": RMSNorm with the scale stored as an offset from one, x / rms(x) * (1 + w),
                  computed in float32 (Gemma; w starts at zero)
`unit_rms` is x / rms(x) with no scale (Llama 4's norm of each query and key head).
"""

import jax.numpy as jnp
from jax import lax

NORMS = ("layer", "rms", "rms_plus_one")


def rms_norm(x, w, *, eps: float):
    """x / sqrt(mean(x^2) + eps) * w over the last axis, normalised in float32, then back in
    x's dtype times w (as transformers' Llama / DeepSeek RMSNorm).

    Args:
      x: [.., D]; w: [D] the scale.
    """
    return unit_rms(x, eps=eps) * w.astype(x.dtype)


def unit_rms(x, *, eps: float):
    """x / sqrt(mean(x^2) + eps) over the last axis, in float32, back in x's dtype: RMSNorm
    without a scale (transformers' Llama4TextL2Norm). x: [.., D]."""
    x32 = x.astype(jnp.float32)
    # [.., 1]
    inv_rms = lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * inv_rms).astype(x.dtype)


def rms_norm_plus_one(x, w, *, eps: float):
    """x / sqrt(mean(x^2) + eps) * (1 + w) over the last axis, in float32, back in x's dtype.

    Args:
      x: [.., D]; w: [D] the offsets from a unit scale.
    """
    x32 = x.astype(jnp.float32)
    # [.., 1]
    inv_rms = lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * inv_rms * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
