"""Gated DeltaNet linear attention (Qwen3.5's linear layers) in Linen: the parameters of
tfjax.ops.linear_attention (names, shapes and logical axes from its `parameter_shapes`, as
NNX's tfjax.nnx.linear_attention.GatedDeltaNet), its maths that module's."""

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

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
        inits = la.initializers(self.kernel_init)
        p = {}
        for name, (shape, names, kind) in la.parameter_shapes(self.config, x.shape[-1]).items():
            init = nn.with_logical_partitioning(inits[kind], names)
            p[name] = self.param(name, init, shape, self.param_dtype)
        # promote_dtype, not astype: LoRA (Qwix) follows a kernel through it to its matmuls
        x, *values = nn.dtypes.promote_dtype(x, *p.values(), dtype=self.dtype)
        p = dict(zip(p, values, strict=True))
        return la.gated_deltanet(x, p, self.config, segment_ids=segment_ids, cache=cache)
