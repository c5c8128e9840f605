"""Multi-head latent attention (DeepSeek) in Linen: the parameters of tfjax.ops.mla (names,
shapes and logical axes from `mla.parameter_shapes`, as NNX's tfjax.nnx.mla.LatentAttention),
its maths that module's."""

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from tfjax.nn import axes
from tfjax.nn.params import table_params
from tfjax.ops import mla
from tfjax.ops.cache import LatentCache
from tfjax.ops.config import AttentionConfig, default_kernel_init


class LatentAttention(nn.Module):
    """Self-attention with `config.latent` (tfjax.ops.mla): the expanded form without a cache,
    the absorbed form over an explicit tfjax.ops.LatentCache (`cache=`, decode=True)."""

    config: AttentionConfig  # with `latent`
    kernel_init: Callable = default_kernel_init  # every projection's
    dtype: Any = None  # compute dtype; the input's when None
    param_dtype: Any = jnp.float32  # storage dtype

    @nn.compact
    def __call__(
        self,
        x,
        *,
        mask=None,
        bias=None,
        segment_ids=None,
        is_causal: bool = False,
        positions=None,
        train: bool = False,
        decode: bool = False,
        variant=None,
        cache: LatentCache | None = None,
    ):
        """tfjax.nn.MultiHeadAttention's self-attention call; decoding needs the explicit
        `cache` (the "cache" collection holds per-head keys, which this layer never makes).
        Returns [B, T, D]; with `cache`, ([B, T, D], the updated cache)."""
        if bias is not None:
            raise ValueError("LatentAttention: takes no additive logit bias")
        if decode and cache is None:
            raise ValueError(
                "LatentAttention: decode=True needs an explicit cache (a tfjax.ops.LatentCache "
                "from the model's init_cache), not the 'cache' collection"
            )
        if cache is not None and not decode:
            raise ValueError("LatentAttention: a cache is for decode=True")
        shapes = mla.parameter_shapes(self.config, x.shape[-1])
        x, p = table_params(self, shapes, mla.initializers(self.kernel_init), x)
        # The dropout and sharding options are the expanded form's: decoding takes none.
        rate = self.config.dropout_rate if train and cache is None else 0.0
        return mla.latent_attention(
            x,
            p,
            self.config,
            positions=positions,
            cache=cache,
            mask=mask,
            segment_ids=segment_ids,
            is_causal=is_causal,
            dropout_rate=rate,
            dropout_rng=self.make_rng("dropout") if rate > 0.0 else None,
            sharding=axes.attention_sharding(),
        )
