"""Positional information with parameters or state: learned tables, T5's relative position bias
and the decoding position counter; the pure functions (sinusoidal, 2-D sin-cos, RoPE and its
scalings, ALiBi, T5's buckets) are tfjax.ops.position's, re-exported here.

Letters: B batch, T length, N heads, H head dim, D model width.
"""

import flax.linen as nn
import jax.numpy as jnp

from tfjax.nn import axes
from tfjax.ops import embed
from tfjax.ops.position import (  # noqa: F401 (re-exported)
    SCALING_KINDS,
    RopeScaling,
    alibi_bias,
    alibi_slopes,
    relative_position_bias,
    relative_position_bucket,
    rope,
    rope_frequencies,
    sincos_2d,
    sinusoidal,
)


class LearnedPositions(nn.Module):
    """A learned [max_len, D] table, looked up at the given positions."""

    max_len: int  # the longest sequence the table covers
    width: int  # D
    init_stddev: float = 0.02  # BERT and GPT-2 use 0.02
    param_dtype: jnp.dtype = jnp.float32  # storage dtype
    dtype: jnp.dtype | None = None  # compute dtype of the output (param_dtype when None)

    @nn.compact
    def __call__(self, positions):
        """positions: [T] or [B, T] ints -> [T, D] or [B, T, D] in `dtype`."""
        table = self.param(
            "embedding",
            nn.with_logical_partitioning(
                nn.initializers.normal(self.init_stddev), (None, axes.EMBED)
            ),
            (self.max_len, self.width),
            self.param_dtype,
        )
        # Cast after the lookup: a bfloat16 model's residual stream stays bfloat16 (a float32
        # table added to it would promote the whole stream to float32).
        return embed.lookup(table, positions, dtype=self.dtype or self.param_dtype)


class RelativePositionBias(nn.Module):
    """T5's learned attention bias: one scalar per (bucket, head), added to the logits.

    T5 computes it in the first layer of each stack and shares it with every layer of that
    stack; a model holds one of these per stack and passes its output to all layers.
    """

    num_heads: int  # N
    bidirectional: bool  # True in the encoder, False in the (causal) decoder
    num_buckets: int = 32  # T5's default
    max_distance: int = 128  # T5's default
    param_dtype: jnp.dtype = jnp.float32  # storage dtype

    @nn.compact
    def __call__(self, query_positions, key_positions=None, *, decode: bool = False):
        """query_positions: [T] or [B, T]; key_positions: [S] or [B, S], the queries' when None
        -> [B|1, N, T, S] float32.

        decode=True: the keys are a KV cache's, at positions 0 .. S - 1. The first call (the one
        that initialises the caches, with S queries) sizes it; later calls give the new tokens'
        positions, biased against every cache slot (the attention masks the unwritten ones).
        """
        if key_positions is None:
            key_positions = query_positions
        if decode:
            # Only its length is read: a cache is zeroed after it is sized (decode.generate).
            slots = self.variable("cache", "key_slots", jnp.zeros, jnp.shape(key_positions)[-1:])
            key_positions = jnp.arange(slots.value.shape[0])
        table = self.param(
            "embedding",
            nn.with_logical_partitioning(nn.initializers.normal(1.0), (None, axes.HEADS)),
            (self.num_buckets, self.num_heads),
            self.param_dtype,
        )
        return relative_position_bias(
            table,
            query_positions,
            key_positions,
            bidirectional=self.bidirectional,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )


class DecodePositions(nn.Module):
    """Positions [T] of this call's tokens when decoding with a cache.

    Keeps a counter in the "cache" collection: 0.. at initialisation (which only sizes the
    caches), then continuing after the tokens already decoded.
    """

    @nn.compact
    def __call__(self, length: int):
        initialized = self.has_variable("cache", "position_index")
        index = self.variable("cache", "position_index", lambda: jnp.array(0, jnp.int32))
        start = index.value
        if initialized:
            index.value = start + length
        return start + jnp.arange(length)
