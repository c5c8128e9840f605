"""Token embeddings, with the output projection that shares their matrix (the maths:
tfjax.ops.embed).

Letters: B batch, T length, D model width, V vocab.
"""

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from tfjax.nn import axes
from tfjax.ops import embed


class Embed(nn.Module):
    """A [V, D] table: `embed(ids)` looks tokens up, `embed.attend(x)` gives logits x E^T.

    Vaswani et al. (2017) share this matrix between both embeddings and the pre-softmax
    projection and multiply the looked-up embeddings by sqrt(d_model).
    """

    vocab_size: int  # V
    width: int  # D
    scale_by_sqrt_width: bool = False  # multiply looked-up vectors by sqrt(D) (the paper)
    scale_dtype: Any = None  # sqrt(D) is rounded to this dtype first; the vectors' when None
    # (Gemma: the table's, so a bfloat16 Gemma multiplies by sqrt(3072) = 55.5, not 55.43)
    init_stddev: float | None = None  # D**-0.5 when None (unit variance after the sqrt(D) scale)
    dtype: Any = None  # compute dtype; float32 when None
    param_dtype: Any = jnp.float32  # storage dtype

    def setup(self):
        std = self.width**-0.5 if self.init_stddev is None else self.init_stddev
        self.embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(nn.initializers.normal(std), (axes.VOCAB, axes.EMBED)),
            (self.vocab_size, self.width),
            self.param_dtype,
        )

    def __call__(self, ids):
        """ids: [B, T] ints -> [B, T, D]."""
        return embed.lookup(
            self.embedding,
            ids,
            dtype=self.dtype,
            scale_by_sqrt_width=self.scale_by_sqrt_width,
            scale_dtype=self.scale_dtype,
        )

    def attend(self, x):
        """x: [B, T, D] -> [B, T, V] logits against the (shared) embedding matrix."""
        x, table = nn.dtypes.promote_dtype(x, self.embedding, dtype=self.dtype)
        # [B, T, V]
        return embed.attend(x, table)
