"""Gated DeltaNet linear attention (Qwen3.5's linear layers) in Linen: the parameters of
tfjax.ops.linear_attention (names, shapes and logical axes from its `parameter_shapes`, as
NNX's tfjax.nnx.linear_attention.GatedDeltaNet), its maths that module's."""

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from tfjax.nn.params import table_params
from tfjax.ops import linear_attention as la
from tfjax.ops.config import default_kernel_init


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet layer (tfjax.ops.linear_attention.gated_deltanet); its decoding state is
    the explicit `cache` (a RecurrentState), not the "cache" collection."""

    config: la.LinearAttentionConfig
    kernel_init: Callable = default_kernel_init  # every projection's
    dtype: Any = None  # compute dtype; the input's when None
    param_dtype: Any = jnp.float32  # storage dtype

    @nn.compact
    def __call__(self, x, *, segment_ids=None, cache: la.RecurrentState | None = None):
        """x [B, T, D] -> (y [B, T, D], the RecurrentState after x, or None without `cache`)."""
        shapes = la.parameter_shapes(self.config, x.shape[-1])
        x, p = table_params(self, shapes, la.initializers(self.kernel_init), x)
        return la.gated_deltanet(x, p, self.config, segment_ids=segment_ids, cache=cache)
